"""The tf.data service beside a LocalCluster: fit over "distributed_epoch" trains each example once per epoch."""

from __future__ import annotations

import json
import os
import sys

import pytest

import tf_psx
from tf_psx.cluster import data_service

from conftest import run_script, script_results
from launch_harness import SCRIPTS, LaunchRun


def _result(*args) -> dict:
    (result,) = script_results(run_script("data_service_fit.py", *args))
    return result


@pytest.mark.processes
def test_fit_over_the_data_service_of_task_processes_trains_every_example_once_per_epoch():
    # A dispatcher and 2 data workers as task processes; the counting model
    # of tests/scripts/exact_epochs.py reads every row's applications.
    result = _result("--processes", "--data-workers", "2", "--epochs", "2")
    assert result["service"].startswith("grpc://127.0.0.1:")
    assert result["epochs"] == 2 and result["iterations"] == 2 * 40
    assert result["counts"] == {"2": result["rows"]}


@pytest.mark.processes
def test_launch_starts_the_data_service_and_gives_the_chief_its_address(tmp_path):
    command = [sys.executable, os.path.join(SCRIPTS, "data_service_fit.py"), "--launched", "--epochs", "2"]
    with LaunchRun(["--workers", "2", "--ps", "1", "--data-workers", "2", "--log-dir", str(tmp_path)], command) as run:
        code = run.wait()
    assert code == 0, run.output[-3000:]
    _, match = run.wait_for(r"^\[chief:0\] RESULT (?P<json>\{.*\})$", timeout=1)
    result = json.loads(match["json"])
    assert result["service"].startswith("grpc://127.0.0.1:")
    assert result["counts"] == {"2": result["rows"]}
    assert (tmp_path / "data_worker-1.log").exists() and (tmp_path / "data_dispatcher-0.log").exists()


@pytest.mark.processes
def test_the_count_fails_when_every_data_worker_reads_everything():
    # "parallel_epochs" (in-process servers this time): each of the 2 data
    # workers reads the whole dataset, so every example is trained twice per
    # epoch, and the same check sees it.
    result = _result("--data-workers", "2", "--epochs", "1", "--mode", "parallel_epochs")
    assert result["counts"] == {"2": result["rows"]}  # 1 epoch, each example twice


@pytest.mark.unit
def test_bad_data_workers_and_a_worker_without_dispatcher_get_clear_errors(capsys):
    with pytest.raises(tf_psx.errors.ArgumentError, match=r"data_workers.*Received: -1.*Fix: pass 0"):
        tf_psx.LocalCluster(num_workers=1, num_ps=1, data_workers=-1)
    assert tf_psx.LocalCluster(num_workers=1, num_ps=1).data_service is None
    assert data_service.main(["worker", "--port", "1"]) == 2
    assert "a worker needs --dispatcher HOST:PORT" in capsys.readouterr().err
    with pytest.raises(tf_psx.errors.StateError, match=r"No tf.data service: \$TF_PSX_DATA_SERVICE"):
        data_service.service_address()
    with pytest.raises(tf_psx.errors.LaunchError, match=r"Option `--data-workers`.*Received: -2"):
        tf_psx.launch.Launcher([sys.executable, "-c", "pass"], workers=1, ps=1, data_workers=-2)
