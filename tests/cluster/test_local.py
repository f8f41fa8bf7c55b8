"""LocalCluster: argument checks and real task processes (processes tier)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

import tf_psx
from tf_psx.cluster.ports import port_is_listening

from conftest import run_script

pytestmark = pytest.mark.processes


def _ports(config: tf_psx.ClusterConfig) -> list[int]:
    return [int(a.rsplit(":", 1)[1]) for a in config.workers + config.ps]


def _listening(ports: list[int]) -> list[int]:
    listening = {c.laddr.port for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    return sorted(set(ports) & listening)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_workers": 0}, r"`num_workers` must be an int >= 1\. Received: 0"),
    ({"num_ps": -1}, r"`num_ps` must be an int >= 1\. Received: -1"),
    ({"num_workers": "2"}, r"`num_workers` must be an int >= 1\. Received: '2'"),
])
def test_bad_sizes_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tf_psx.LocalCluster(**kwargs)


def test_process_controls_need_processes():
    with pytest.raises(RuntimeError, match=r"needs task processes.*processes=True"):
        tf_psx.LocalCluster(1, 1).kill("worker", 0)


@pytest.mark.cluster
def test_in_process_cluster_sets_grpc_fail_fast_and_reuses_servers(local_cluster, monkeypatch):
    import os

    assert os.environ["GRPC_FAIL_FAST"] == "use_caller"
    again = tf_psx.LocalCluster(num_workers=local_cluster.num_workers, num_ps=local_cluster.num_ps)
    with again:
        # Same shape: the running servers are reused, so no new ports leak.
        assert again.config == local_cluster.config
    assert all(port_is_listening(p) for p in _ports(local_cluster.config))


def test_in_process_worker_threads_cover_the_workers():
    from tf_psx.cluster.local import INPROCESS_INTER_OP_THREADS, MAX_INPROCESS_WORKERS
    from tf_psx.cluster.server import server_config

    for workers in (1, 2, 5):
        assert server_config("worker", workers).inter_op_parallelism_threads >= workers + 1
    assert server_config("ps", 3) is None
    assert MAX_INPROCESS_WORKERS + 1 <= INPROCESS_INTER_OP_THREADS
    with pytest.raises(ValueError, match=rf"`num_workers` must be <= {MAX_INPROCESS_WORKERS} for an in-process"):
        tf_psx.LocalCluster(num_workers=MAX_INPROCESS_WORKERS + 1)


@pytest.mark.parametrize("kwargs, match", [
    ({"log_dir": "/tmp/x"}, r"`log_dir` needs task processes.*Fix: pass processes=True"),
    ({"start_timeout_s": 0}, r"`start_timeout_s` must be a number of seconds > 0\. Received: 0"),
])
def test_more_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tf_psx.LocalCluster(1, 1, **kwargs)


def test_restart_before_start_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"restart\('worker', 0\) is not available before the cluster starts"):
        tf_psx.LocalCluster(1, 1, processes=True).restart("worker", 0)


@pytest.mark.parametrize("processes", [
    pytest.param(False, id="in-process"),
    pytest.param(True, id="processes", marks=pytest.mark.processes),
])
def test_clusters_of_other_shapes_one_after_another(processes):
    args = ["--processes"] if processes else []
    result = run_script("cluster_shapes.py", *args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    shapes = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("SHAPE ")]
    assert shapes == [["1", "1", "10"], ["3", "2", "10"], ["1", "1", "10"]]


def test_process_cluster_kill_restart_and_clean_exit_on_error():
    with pytest.raises(RuntimeError, match="body failed"):
        with tf_psx.LocalCluster(num_workers=1, num_ps=1, processes=True) as cluster:
            ports = _ports(cluster.config)
            pids = [cluster.pid("worker", 0), cluster.pid("ps", 0)]
            assert _listening(ports) == sorted(ports)
            assert cluster.config.to_json("ps", 0)  # the config is a real ClusterConfig

            cluster.kill("worker", 0)
            assert not cluster.alive("worker", 0)
            assert not psutil.pid_exists(pids[0])
            # Restarted from a thread that then ends, as a restart loop or a
            # test's killer does: the task must outlive that thread (the
            # kernel's PR_SET_PDEATHSIG follows the forking thread).
            restarter = threading.Thread(target=cluster.restart, args=("worker", 0))
            restarter.start()
            restarter.join(120)
            assert not restarter.is_alive()
            time.sleep(1.0)  # PR_SET_PDEATHSIG's SIGKILL comes as the thread exits
            assert cluster.alive("worker", 0)
            assert psutil.Process(cluster.pid("worker", 0)).status() != psutil.STATUS_ZOMBIE
            pids.append(cluster.pid("worker", 0))
            assert pids[-1] != pids[0]
            assert port_is_listening(ports[0])
            raise RuntimeError("body failed")
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert _listening(ports) == []


def test_task_whose_port_is_taken_fails_and_names_its_log(tmp_path, monkeypatch):
    # Another program grabs the ps port between the pick and the bind. The ps
    # cannot listen, and the error must say which task and where its log is,
    # not mistake the other program for the task.
    import socket

    thief = socket.socket()
    thief.bind(("0.0.0.0", 0))
    thief.listen()
    taken = thief.getsockname()[1]
    real_free_ports = tf_psx.cluster.ports.free_ports
    # Patched where LocalCluster looks it up (tf_psx.cluster.local), not where it is defined.
    monkeypatch.setattr(tf_psx.local, "free_ports", lambda n: real_free_ports(n - 1) + [taken])
    try:
        with pytest.raises(tf_psx.cluster.local.TaskFailedError, match=r"task ps:0 exited while starting.*its log is .*ps-0\.log"):
            with tf_psx.LocalCluster(num_workers=1, num_ps=1, processes=True, log_dir=str(tmp_path)) as cluster:
                pass
    finally:
        thief.close()
    assert not list(psutil.Process().children())


def test_fit_survives_a_worker_killed_mid_fit():
    result = run_script("fit_with_worker_kill.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "worker 1 killed at batch" in result.stdout
    assert "all steps done" in result.stdout


@pytest.mark.tfra
def test_model_built_before_the_cluster_gets_clear_error():
    result = run_script("local_resources_then_cluster.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "clear error:" in result.stdout


def test_tasks_die_with_a_killed_coordinator():
    # The coordinator starts a process cluster, prints its task pids and then
    # is killed with SIGKILL, so no `__exit__` runs: the kernel must end the
    # tasks (PR_SET_PDEATHSIG).
    code = (
        "import tf_psx, time\n"
        "cluster = tf_psx.LocalCluster(num_workers=1, num_ps=1, processes=True).start()\n"
        "print('PIDS', cluster.pid('worker', 0), cluster.pid('ps', 0), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(pid) for pid in line.split()[1:]]
        assert all(psutil.pid_exists(pid) for pid in pids)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in pids):
        time.sleep(0.2)
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == []


def test_task_thread_pools_are_checked_and_need_processes():
    from tf_psx.cluster.server import INTRA_OP_ENV, server_config, threads_from_env, threads_per_task

    config = server_config("ps", 2, inter_op_threads=3, intra_op_threads=1)
    assert (config.inter_op_parallelism_threads, config.intra_op_parallelism_threads) == (3, 1)
    # A worker never gets fewer inter-op threads than workers + 1 (the first step would deadlock).
    assert server_config("worker", 4, inter_op_threads=2).inter_op_parallelism_threads == 5
    assert threads_per_task(10 ** 6) == 1 and threads_per_task(1) >= 1
    with pytest.raises(ValueError, match=r"`intra_op_threads` of LocalCluster must be an int >= 1.*Received: 0"):
        tf_psx.LocalCluster(1, 1, processes=True, intra_op_threads=0)
    with pytest.raises(ValueError, match=r"need processes=True. Received: intra_op_threads=2"):
        tf_psx.LocalCluster(1, 1, intra_op_threads=2)
    os.environ[INTRA_OP_ENV] = "two"
    try:
        with pytest.raises(ValueError, match=r"TF_PSX_INTRA_OP_THREADS must be an int >= 1. Received: 'two'"):
            threads_from_env(INTRA_OP_ENV)
    finally:
        del os.environ[INTRA_OP_ENV]


def test_task_processes_run_with_the_thread_pools_asked():
    from tf_psx.cluster.server import threads_per_task

    with tf_psx.LocalCluster(num_workers=1, num_ps=1, processes=True, inter_op_threads=3) as cluster:
        logs = {task: open(cluster.log_path(*task), encoding="utf-8").read() for task in (("ps", 0), ("worker", 0))}
        # The pids the stall doctor and ClusterMonitor's process metrics read.
        assert cluster.task_pids() == {"ps:0": cluster.pid("ps", 0), "worker:0": cluster.pid("worker", 0)}
    assert tf_psx.LocalCluster(1, 1).task_pids() == {}  # in-process: no task processes
    # "auto": the CPUs divided among 1 worker, 1 ps and the coordinator.
    auto = threads_per_task(3)
    for task, text in logs.items():
        assert f"tf_psx.server threads: intra_op={auto} inter_op=3" in text, (task, text[-2000:])


def test_a_spawn_that_does_not_return_is_a_bounded_error():
    # The spawner thread forks the task processes; a fork that hangs is
    # reported with what was being started, not waited on forever.
    from tf_psx.cluster import supervisor

    with pytest.raises(tf_psx.errors.TaskFailedError, match=r"starting the process of worker:9 took over 0.05 s"):
        supervisor._Spawner().call(lambda: time.sleep(1), "worker:9", timeout_s=0.05)  # pylint: disable=protected-access
