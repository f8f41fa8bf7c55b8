"""`run_script` runs a script once more only when it crashed inside an import, never when its own code crashed."""

from __future__ import annotations

import pytest

from conftest import run_script, script_results

pytestmark = pytest.mark.processes


def test_a_crash_while_importing_is_run_once_more(tmp_path, capsys):
    result = run_script("crash_once.py", str(tmp_path / "marker"), "import")
    assert script_results(result) == [{"runs": 2}]
    assert "crashed while importing (signal 11)" in capsys.readouterr().out


def test_a_crash_in_the_scripts_own_code_fails_the_run(tmp_path):
    result = run_script("crash_once.py", str(tmp_path / "marker"), "code")
    assert result.returncode == -11 and "RESULT" not in result.stdout
    assert "Current thread" in result.stderr  # the faulthandler stack, for whoever reads the failure
