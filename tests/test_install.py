"""A non-editable install works: wheel into a fresh virtualenv, used from another directory.

The fresh venv gets tf_psx from the wheel only; its dependencies (TensorFlow
and the rest, ~1 GB) come from this test run's environment through a .pth
file, so the test downloads nothing. The editable install of the checkout is
not visible there (its finder is a .pth of the test environment's own site
directory, which a .pth-added path does not run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest

pytestmark = pytest.mark.processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Building the wheel and a venv: seconds; importing TF in it: ~10 s.
INSTALL_TIMEOUT_S = 300


def _run(args, cwd, env=None):
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=env,
                            check=False)
    assert result.returncode == 0, f"{args}: {result.stdout[-2000:]}{result.stderr[-2000:]}"
    return result.stdout


def _wheel_and_venv(tmp_path):
    """tf_psx's wheel built, and a fresh venv that sees this run's packages through a .pth: (wheel, venv, python, site)."""
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), REPO],
         cwd=tmp_path)
    (wheel,) = list(wheels.glob("tf_psx-*.whl"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = str(venv / "bin" / "python")
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).strip()
    with open(os.path.join(site, "deps_from_test_env.pth"), "w", encoding="utf-8") as handle:
        handle.write(sysconfig.get_paths()["purelib"] + "\n")
    return wheel, venv, python, site


def test_wheel_in_a_fresh_venv_from_another_directory(tmp_path):
    wheel, venv, python, site = _wheel_and_venv(tmp_path)
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], cwd=tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    out = _run([python, "-c", (
        "import os, tempfile, tf_psx, tf_psx.data, tf_psx.layers, tf_psx.callbacks, tf_psx.optimizers; "
        "print('FILE', tf_psx.__file__); "
        "path = os.path.join(tempfile.mkdtemp(), 's.tsv'); "
        "sample = tf_psx.data.write_criteo_sample(path, rows=20, malformed=2); "
        "reader = tf_psx.data.CriteoReader(path, batch_size=5); "
        "print('ROWS', sum(int(b[1].shape[0]) for b in reader.dataset()))"
    )], cwd=elsewhere, env=env)
    assert f"FILE {site}" in out, out
    assert "ROWS 20" in out, out
    cli = _run([str(venv / "bin" / "tf-psx"), "config", "--workers", "w0:2222,w1:2222", "--ps", "ps0:2222", "--task", "worker:1"], cwd=elsewhere, env=env)
    assert '"worker"' in cli and '"ps"' in cli, cli


def test_install_with_dependencies_keeps_the_tensorflow_already_there(tmp_path):
    # A non-editable install of tf_psx, dependencies resolved (not --no-deps), into an environment that
    # already has this stack's TensorFlow: pip finds every requirement satisfied (setup.py's ranges, not
    # pins) and installs nothing else. --no-index: a TensorFlow pip wanted to change would fail the install.
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    wheel, _, python, _ = _wheel_and_venv(tmp_path)
    out = _run([python, "-m", "pip", "install", "--no-index", str(wheel)], cwd=tmp_path)
    installed = [line.replace("_", "-") for line in out.splitlines() if line.startswith("Successfully installed")]
    assert installed and installed[0].split()[2:] == [f"tf-psx-{_wheel_version(wheel)}"], out
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    seen = _run([python, "-c", "import tensorflow as tf, tf_psx; print('TF', tf.__version__)"], cwd=tmp_path, env=env)
    assert f"TF {tf.__version__}" in seen, seen


def _wheel_version(wheel) -> str:
    return wheel.name.split("-")[1]
