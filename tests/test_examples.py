"""The examples run end to end (each in its own process: it builds its own cluster)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO, SCRIPT_TIMEOUT_S


def _run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", name), *args],
        capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, cwd=REPO, check=False,
    )


@pytest.mark.processes
def test_quickstart_beats_chance_and_reports_the_bayes_auc():
    result = _run_example("quickstart.py", "--steps", "900")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    match = re.search(r"holdout AUC (\d\.\d+)\s+best possible \(Bayes\) AUC (\d\.\d+)", result.stdout)
    assert match, result.stdout[-2000:]
    auc, bayes = float(match.group(1)), float(match.group(2))
    assert 0.6 <= auc <= bayes + 0.01  # above chance, and never (beyond noise) above the optimum


@pytest.mark.processes
def test_readme_quickstart_runs(tmp_path):
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        code = re.search(r"```python\n(.*?)```", handle.read(), re.S).group(1)
    script = tmp_path / "readme_quickstart.py"
    # In-process servers cannot be stopped; leave without waiting on them.
    script.write_text(code + "\nprint('loss', model.history.history['loss'][-1])\nimport os; os._exit(0)\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=SCRIPT_TIMEOUT_S, cwd=REPO, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert float(re.search(r"^loss (\S+)", result.stdout, re.M).group(1)) < 0.69  # below chance-level log loss
