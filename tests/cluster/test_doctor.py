"""The stall doctor: a worker frozen by SIGSTOP is reported while fit waits, and fit then completes."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from tf_psx import callbacks as cb
from tf_psx.cluster import preflight
from tf_psx.training import stalls

from conftest import run_script

pytestmark = pytest.mark.unit

STEPS = 300  # tests/scripts/stall_doctor.py


@pytest.mark.processes
def test_a_frozen_worker_is_reported_and_fit_completes_after_it_runs_again():
    result = run_script("stall_doctor.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    # Every step ran once the worker was continued.
    assert out["iterations"] == STEPS and out["events"]["reported"]
    # One report for the one stall.
    (report,) = out["reports"]
    assert re.search(r"no step finished for \d+\.\d s \(timeout 10 s\); 1 closure\(s\) in flight, \d+ queued", report)
    # The closure table: worker 0 holds a train step, first attempt.
    assert re.search(r"worker:0  runs \S*train_function\S*  since \d\d:\d\d:\d\d \(\d+\.\d s\)  attempt 1", report)
    # The frozen task stands out; the ps is not frozen.
    assert f"worker:0  pid {out['worker_pid']}  stopped  <- stopped (SIGSTOP?)" in report, report[:1500]
    assert re.search(r"ps:0  pid \d+  (sleeping|running)\n", report)
    # The coordinator's own stacks: its main thread waits for room in the queue (fit keeps a few steps queued
    # ahead, tf_psx._tf.fed_steps) or, at the end of the epoch, in join().
    assert "Thread 0x" in report and ("in wait_for_room" in report or "in join" in report), report[-3000:]
    # The ps task (running) wrote its stacks into its log on SIGUSR1.
    assert out["ps_log_has_stacks"]


def test_bad_timeouts_are_named():
    with pytest.raises(ValueError, match=r"`timeout_s` of StallDoctor must be a number > 0. Received: 0"):
        cb.StallDoctor(timeout_s=0)
    with pytest.raises(ValueError, match=r"`timeout_s` of StallWatch must be a number > 0. Received: '5'"):
        stalls.StallWatch(object(), timeout_s="5")


def test_pids_file_and_task_states(tmp_path, monkeypatch):
    path = tmp_path / "pids.json"
    path.write_text(json.dumps({"ps:0": os.getpid(), "worker:0": 2 ** 22 + 12345}))
    monkeypatch.setenv(stalls.PIDS_FILE_ENV, str(path))
    pids = stalls.pids_from_file()
    assert pids == {"ps:0": os.getpid(), "worker:0": 2 ** 22 + 12345}
    states = stalls.task_states(pids)
    assert states["ps:0"] in ("running", "sleeping") and states["worker:0"] == "gone"
    path.write_text("{not json")
    assert stalls.pids_from_file() == {}  # a file being rewritten is no crash


def _doctor(*args, env=None):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "tf_psx.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=300, env=full_env, check=False)


@pytest.mark.processes
def test_doctor_checks_addresses_ports_clocks_and_versions(tmp_path):
    import tf_psx  # pylint: disable=import-outside-toplevel
    from tf_psx.cluster import ClusterConfig  # pylint: disable=import-outside-toplevel
    from tf_psx.cluster.ports import free_ports  # pylint: disable=import-outside-toplevel

    with tf_psx.LocalCluster(num_workers=1, num_ps=1, processes=True) as cluster:
        chief_port, dead_port = free_ports(2)
        good = ClusterConfig(workers=cluster.config.workers, ps=cluster.config.ps, chief=f"127.0.0.1:{chief_port}")
        result = _doctor(good.to_json("chief", 0))
        assert result.returncode == 0, result.stdout + result.stderr
        out = result.stdout
        for task, address in (("ps:0", cluster.config.ps[0]), ("worker:0", cluster.config.workers[0])):
            assert re.search(rf"ok   {task} {address}: \d+\.\d ms to connect", out), out
            assert re.search(rf"ok   {task} clock [+-]\d+\.\d ms \(\+-\d+\.\d ms\)", out), out
            assert f"ok   {task} versions equal this host's" in out
        assert f"ok   chief 127.0.0.1:{chief_port}: port {chief_port} is free here" in out
        assert "listen beyond loopback" not in out and "every check passed" in out

        # A task whose versions differ (its info file says another TF), read through TF on that task.
        info_path = preflight.server_info_path(int(cluster.config.ps[0].rsplit(":", 1)[1]))
        with open(info_path, encoding="utf-8") as handle:
            info = json.load(handle)
        info["versions"]["tensorflow"] = "2.15.0"
        with open(info_path, "w", encoding="utf-8") as handle:
            json.dump(info, handle)
        (tmp_path / "tf_config.json").write_text(good.to_json("chief", 0))
        result = _doctor(f"@{tmp_path / 'tf_config.json'}")
        assert result.returncode == 1
        assert re.search(r"FAIL ps:0 versions differ \(task, here\): \{'tensorflow': \('2.15.0', '2.\d+.\d+'\)\}",
                         result.stdout), result.stdout
        assert "ok   worker:0 versions equal this host's" in result.stdout

        # An unreachable worker and a chief port in use: named, and TF is not tried.
        with socket.create_server(("127.0.0.1", 0)) as taken:
            busy = taken.getsockname()[1]
            bad = ClusterConfig(workers=[*cluster.config.workers, f"127.0.0.1:{dead_port}"], ps=cluster.config.ps,
                                chief=f"127.0.0.1:{busy}")
            result = _doctor(env={"TF_CONFIG": bad.to_json("chief", 0)})
        assert result.returncode == 1
        assert re.search(rf"FAIL worker:1 127.0.0.1:{dead_port}: unreachable: Connection refused", result.stdout)
        assert f"FAIL chief 127.0.0.1:{busy}: port {busy} is in use here" in result.stdout
        assert "TensorFlow checks (clocks, versions): skipped, fix the addresses first." in result.stdout
        assert "some checks FAILED" in result.stdout


def test_doctor_needs_a_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    result = _doctor(env={"TF_CONFIG": ""})
    assert result.returncode == 2 and "tf-psx doctor needs a TF_CONFIG" in result.stderr
    result = _doctor('{"cluster": {"worker": ["w0"]}}')
    assert result.returncode == 2 and 'must be "host:port"' in result.stderr
    result = _doctor("@/no/such/file.json")
    assert result.returncode == 2 and "cannot read the TF_CONFIG file '/no/such/file.json'" in result.stderr


def test_doctor_warns_about_tasks_beyond_loopback():
    # 192.0.2.0/24 is TEST-NET-1: nothing answers there, so only the address checks run.
    lines, ok = preflight.check_cluster(json.dumps({"cluster": {"worker": ["192.0.2.1:2222"], "ps": ["192.0.2.2:2222"]}}))
    assert not ok
    assert any("2 task(s) listen beyond loopback" in line and "no authentication" in line for line in lines)


class _FakeQueue:
    """Stands in for TF's closure queue in a unit test of the report: one closure in flight."""

    def __init__(self):
        import queue  # pylint: disable=import-outside-toplevel
        import threading  # pylint: disable=import-outside-toplevel

        self.inflight_closure_count = 1
        self._queue = queue.Queue()
        self._queue_lock = threading.Lock()


class _FakeCoordinator:
    def __init__(self):
        self._cluster = type("Cluster", (), {"workers": [], "closure_queue": _FakeQueue()})()


@pytest.mark.processes
def test_the_report_signals_only_server_tasks(tmp_path):
    import time  # pylint: disable=import-outside-toplevel

    # chief:0 is a user's script with no SIGUSR1 handler (SIGUSR1 would kill it); worker:0 dumps its stacks.
    chief = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # pylint: disable=consider-using-with
    worker_log = open(tmp_path / "worker.log", "w", encoding="utf-8")  # pylint: disable=consider-using-with
    worker = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-c", "import faulthandler, signal, time; faulthandler.register(signal.SIGUSR1, "
         "all_threads=True); print('up', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, stderr=worker_log, text=True)
    try:
        assert worker.stdout.readline().strip() == "up"
        watch = stalls.StallWatch(_FakeCoordinator(), timeout_s=0.01,
                                  pids=lambda: {"chief:0": chief.pid, "worker:0": worker.pid})
        time.sleep(0.05)
        report = watch.check()
        assert report is not None and "1 closure(s) in flight" in report
        assert f"chief:0  pid {chief.pid}" in report and f"worker:0  pid {worker.pid}" in report
        time.sleep(1.0)
        assert chief.poll() is None  # not signalled
        assert worker.poll() is None and "(most recent call first)" in (tmp_path / "worker.log").read_text()
        assert watch.check() is None  # one report per stall
    finally:
        for proc in (chief, worker):
            proc.kill()
            proc.wait()
        worker_log.close()
