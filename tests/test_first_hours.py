"""What a newcomer meets first: examples under the launcher, quiet logs, advice that leads to a working run."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx import _quiet, cluster as _cluster, strategies as _strategies

from conftest import REPO, SCRIPT_TIMEOUT_S
from launch_harness import LaunchRun

pytestmark = pytest.mark.unit

# Lines the quickstart may print with the default settings (measured after the noise filter: 14, of them
# Keras's epoch lines and bars, tf_psx's notices and the result; 98 before).
QUICKSTART_LINE_BUDGET = 30
# The output of a notebook's sequence 2 -> 3 -> 2 workers in one process (three
# fits of one epoch, verbose=2): measured 31 lines. What remains: TF's four
# C++ lines at its import (CUDA/TensorRT registration, printed before any
# Python runs), and TF's "Unable to close remote context" (3 lines per task
# of the cluster left behind, at the next connection); before: ~1,000 lines.
RESHAPE_LINE_BUDGET = 40
# `tf-psx launch --workers 2 --ps 1` of the quickstart, one epoch: measured 17 lines.
LAUNCH_LINE_BUDGET = 30


def test_known_noise_is_dropped_and_everything_comes_back_with_tf_psx_verbose(monkeypatch):
    noise = ("2026-12-04 20:59:26.299579: E external/local_xla/xla/stream_executor/cuda/cuda_dnn.cc:10575] Unable "
             "to register cuDNN factory: Attempting to register factory for plugin cuDNN when one has already been "
             "registered")
    assert _quiet.is_noise(noise)
    assert not _quiet.is_noise("ValueError: Argument `directory` of PeriodicSync cannot be written")
    assert not _quiet.is_noise("Traceback (most recent call last):")
    monkeypatch.setenv(_quiet.VERBOSE_ENV, "1")
    assert not _quiet.is_noise(noise)


def test_a_traceback_is_never_filtered_even_when_it_quotes_noise(monkeypatch):
    monkeypatch.delenv(_quiet.VERBOSE_ENV, raising=False)
    noise = "Found source dataset of type _TensorSliceDataset. This type is not efficiently shardable"
    lines = ["Unable to register cuDNN factory: ...", "Traceback (most recent call last):",
             '  File "train.py", line 3, in <module>', f"    raise ValueError({noise!r})",
             f"ValueError: {noise}", noise]
    line_filter = _quiet.LineFilter()
    kept = [line for line in lines if line_filter.keep(line)]
    # The traceback whole, the noise before and after it dropped.
    assert kept == lines[1:5]


def test_the_tensorflow_logger_filter_keeps_errors():
    record = logging.LogRecord("tensorflow", logging.INFO, __file__, 1, "Reduce to /device:CPU:0 then broadcast to "
                               "('/replica:0/device:CPU:0',).", None, None)
    assert not _quiet._FILTER.filter(record)  # pylint: disable=protected-access
    record.levelno = logging.ERROR
    assert _quiet._FILTER.filter(record)  # pylint: disable=protected-access


@pytest.mark.processes
def test_launched_or_uses_tf_config_when_it_is_set(monkeypatch, caplog):
    local = tf_psx.LocalCluster(num_workers=2, num_ps=1)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["w:1"], "ps": ["p:1"]},
                                                "task": {"type": "chief", "index": 0}}))
    with tf_psx.launched_or(local) as cluster:
        assert cluster is None  # ParameterServerStrategy(None) reads TF_CONFIG
    assert not local._started  # pylint: disable=protected-access
    assert "training on the cluster of TF_CONFIG" in caplog.text


@pytest.mark.processes
def test_a_local_cluster_under_tf_config_says_the_launched_tasks_stay_idle(monkeypatch, caplog):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["w:1"], "ps": ["p:1"]}}))
    with tf_psx.LocalCluster(num_workers=1, num_ps=1, processes=True):
        pass
    assert re.search(r"LocalCluster starts its own 1 worker and 1 ps tasks although TF_CONFIG is set .* Fix: "
                     r"`with tf_psx\.launched_or\(tf_psx\.LocalCluster\(\.\.\.\)\) as cluster:`", caplog.text)


def test_the_tf_config_advice_is_a_chief_s_and_works_when_followed(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(tf_psx.TFConfigError) as raised:
        tf_psx.ClusterConfig.from_tf_config()
    advice = re.search(r"export TF_CONFIG='(\{.*?\})'", str(raised.value)).group(1)
    assert '"type": "chief"' in advice
    config = tf_psx.ClusterConfig.from_tf_config(advice)
    config.validate_for_parameter_server()
    assert config.task_type == "chief"  # the strategy accepts it (a "worker" task was refused)


def test_a_cluster_that_is_not_up_is_named_while_the_strategy_waits(monkeypatch, caplog):
    port = tf_psx.cluster.ports.free_ports(1)[0]
    monkeypatch.setattr(_strategies, "WAIT_NOTICE_S", 0.5)
    with pytest.raises(tf_psx.ClusterUnreachableError, match=rf"No connection to ps:0 at 127.0.0.1:{port}"):
        _strategies.wait_until_reachable({"worker": [], "ps": [f"127.0.0.1:{port}"]}, timeout_s=1.6)
    assert re.search(rf"waiting for ps:0 at 127\.0\.0\.1:{port} \(\d s of 1\)", caplog.text), caplog.text


@pytest.mark.processes
def test_launch_refuses_a_script_that_does_not_exist_before_starting_tasks(run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, _, err = run("launch", "--workers", "1", "--ps", "1", "--", sys.executable, "nonexistent.py")
    assert status == 2
    assert "runs the Python script 'nonexistent.py', which does not exist" in err and "no task was started" in err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_periodic_sync_names_itself_when_its_directory_cannot_be_written(tmp_path, where):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    directory = str(blocker / "snapshots") if where == "under-a-file" else "/proc/tf_psx_snapshots"
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x, y = np.ones((8, 2)), np.ones(8)
    with pytest.raises(tf_psx.errors.SnapshotDirectoryError,
                       match=r"Argument `directory` of PeriodicSync cannot be written: .* fit stopped before its "
                             r"first step\. Fix: pass a directory this process can create and write"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[tf_psx.callbacks.PeriodicSync(2, directory)])
    assert int(model.optimizer.iterations.numpy()) == 0
    # The fix: a writable directory.
    model.fit(x, y, batch_size=4, verbose=0, callbacks=[tf_psx.callbacks.PeriodicSync(2, str(tmp_path / "ok"))])
    assert [s.step for s in tf_psx.callbacks.PeriodicSync.snapshots(str(tmp_path / "ok"))] == [2]


@pytest.mark.processes
def test_keras3_chosen_before_import_tf_psx_is_said_at_import():
    code = "import tensorflow as tf; tf.keras.layers.Dense; import tf_psx"
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S,
                         env=env, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "tf.keras already resolved to Keras 3 before `import tf_psx`" in run.stderr, run.stderr[-2000:]


@pytest.mark.processes
def test_quickstart_is_quiet_and_runs_under_the_launcher(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", _quiet.VERBOSE_ENV)}
    alone = subprocess.run([sys.executable, os.path.join(REPO, "examples", "quickstart.py"), "--epochs", "1"],
                           capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, cwd=REPO, env=env, check=False)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    lines = (alone.stdout + alone.stderr).splitlines()
    assert len(lines) <= QUICKSTART_LINE_BUDGET, "\n".join(lines)
    # Under the launcher the script trains on the launched cluster (TF_CONFIG), not on a LocalCluster of its own.
    with LaunchRun(["--workers", "2", "--ps", "1", "--log-dir", str(tmp_path)],
                   [sys.executable, os.path.join("examples", "quickstart.py"), "--epochs", "1"]) as run:
        code = run.wait()
    assert code == 0, run.output[-3000:]
    assert len(run.lines) <= LAUNCH_LINE_BUDGET, run.output
    assert "training on the cluster of TF_CONFIG" in run.output and "RESULT " in run.output, run.output[-3000:]
    assert "LocalCluster starts its own" not in run.output
    assert not any(_quiet.NOISE.search(line) for line in run.output.splitlines()), run.output[-3000:]


def test_export_verify_of_a_keras_file_says_what_it_expects(run, tmp_path):
    path = tmp_path / "model_a.keras"
    path.write_bytes(b"PK")
    status, _, err = run("export", "--verify", str(path))
    assert status == 2
    assert f"{path} is a Keras model file, not the directory tf_psx.export_serving writes" in err, err
    assert "Fix: export it with tf_psx.export_serving(tf.keras.models.load_model(" in err


@pytest.mark.processes
def test_a_notebook_that_changes_the_cluster_shape_stays_readable():
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", _quiet.VERBOSE_ENV)}
    result = subprocess.run([sys.executable, os.path.join(REPO, "tests", "scripts", "reshape_cluster.py")],
                            capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, cwd=REPO, env=env, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert 'RESULT {"fits": 3}' in output
    lines = output.splitlines()
    assert len(lines) <= RESHAPE_LINE_BUDGET, output
    assert not [line for line in lines if "Failed to remove function remotely" in line], output


# A 12-line script that imports TF first, with TF's default log level (issue: 69 lines on TF 2.16, 40 of them
# the in-process servers' option dumps and rendezvous lines).
IMPORTED_FIRST_LINE_BUDGET = 40


def _quiet_exit(mode: str, **env_set):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", _quiet.VERBOSE_ENV)}
    env.update(env_set)
    result = subprocess.run([sys.executable, os.path.join(REPO, "tests", "scripts", "quiet_exit.py"), mode],
                            capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, cwd=REPO, env=env, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "RESULT {'loss':" in result.stdout, output[-3000:]
    return result


@pytest.mark.processes
def test_a_script_that_imports_tensorflow_first_stays_in_its_line_budget():
    result = _quiet_exit("imported_first")
    lines = (result.stdout + result.stderr).splitlines()
    assert len(lines) <= IMPORTED_FIRST_LINE_BUDGET, "\n".join(lines)


@pytest.mark.processes
def test_a_script_on_task_processes_ends_without_error_lines():
    # Trains inside `with LocalCluster(..., processes=True)` and exits: the coordinator's remote functions are
    # released after the tasks are gone (before: hundreds of "Failed to remove function remotely" lines).
    result = _quiet_exit("processes", TF_CPP_MIN_LOG_LEVEL="2")
    errors = [line for line in result.stderr.splitlines() if "Failed to remove function remotely" in line
              or re.match(r"E\d{4} ", line)]
    assert not errors, result.stderr[-3000:]
