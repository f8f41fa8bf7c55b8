"""Tests of `tf-psx launch` (tf_psx/launch/).

Unit tier, no servers: every invalid input exits 2 with a message naming the
option, the value and the fix. Marked `processes`: real launches
whose chief is a cheap command (no model), checking the streaming, the log
files, the environment of the chief, the exit status, signal handling, worker
restarts, giving up, and --isolate. The training chaos tests are in
tests/launch/test_chaos.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tf_psx import cli, launch
from tf_psx.launch import Launcher, LaunchError
from tf_psx.launch.contract import exit_code
from tf_psx.launch.launcher import _describe_status

from launch_harness import SCRIPTS, LaunchRun, pid_alive

pytestmark = pytest.mark.unit

PY = sys.executable
# A chief that prints what the launcher gave it, as one line of key=value.
ENV_PROBE = (
    "import json, os, sys; c = json.loads(os.environ['TF_CONFIG']); "
    "print('probe', c['task']['type'], c['task']['index'], sorted(c['cluster']), "
    "os.environ['GRPC_FAIL_FAST'], os.environ['TF_PSX_SNAPSHOT_DIR'], os.environ['TF_PSX_CHIEF_ATTEMPT'], "
    "flush=True); sys.exit(3)"
)
# A chief that prints its pid and then sleeps until it is signalled.
SLEEPER = "import os, time; print('sleeper pid=%d' % os.getpid(), flush=True); time.sleep(600)"
CONNECT_TIMEOUT_S = 1.0


def _launch(capsys, *argv):
    code = cli.main(["launch", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- unit: bad inputs, no servers -----------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workers", "2", "--ps", "1"], r"command after `--` must be a non-empty list.*received \[\].*-- python train.py"),
        (["--workers", "0", "--ps", "1", "--", PY], r"Option `--workers` must be an int >= 1\. Received: 0\. Fix: pass e.g. --workers 2"),
        (["--workers", "1", "--ps", "-1", "--", PY], r"Option `--ps` must be an int >= 1\. Received: -1"),
        (["--workers", "1", "--ps", "1", "--max-restarts", "-2", "--", PY], r"Option `--max-restarts` must be an int >= 0\. Received: -2"),
        (["--workers", "1", "--ps", "1", "--intra-op-threads", "0", "--", PY], r"Option `--intra-op-threads` must be an int >= 1\. Received: 0\. Fix: pass e.g. --intra-op-threads 2, or auto"),
        (["--workers", "1", "--ps", "1", "--intra-op-threads", "many", "--", PY], r"Option `--intra-op-threads` must be an int >= 1\. Received: 'many'"),
        (["--workers", "1", "--ps", "1", "--inter-op-threads", "0", "--", PY], r"Option `--inter-op-threads` must be an int >= 1\. Received: 0"),
        (["--workers", "1", "--ps", "1", "--metrics-port", "0", "--", PY], r"Option `--metrics-port` must be an int in 1..65534.*Received: 0\. Fix: pass e.g. --metrics-port 9400"),
        (["--workers", "1", "--ps", "1", "--", "no-such-program-tf-psx"], r"'no-such-program-tf-psx', which is not on PATH"),
        (["--workers", "1", "--ps", "1", "--", "{not_executable}"], r"'.*/data.txt', which is not an executable file"),
    ],
)
def test_bad_input_exits_2_with_the_fix(capsys, tmp_path, argv, message):
    not_executable = tmp_path / "data.txt"
    not_executable.write_text("not a program")
    not_executable.chmod(0o644)
    code, out, err = _launch(capsys, *[arg.format(not_executable=not_executable) for arg in argv])
    assert code == 2
    assert out == ""
    assert err.startswith("tf-psx launch: error: ")
    assert re.search(message, err), err


def test_non_int_count_is_an_argparse_error(capsys):
    code, _, err = _launch(capsys, "--workers", "two", "--ps", "1", "--", PY)
    assert code == 2
    assert "argument --workers: invalid int value: 'two'" in err


def test_log_dir_that_cannot_be_created(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, _, err = _launch(capsys, "--workers", "1", "--ps", "1", "--log-dir", str(blocker / "logs"), "--", PY)
    assert code == 2
    assert re.search(r"Option `--log-dir` \".*a_file/logs\" cannot be created \(Not a directory\)", err), err
    assert not (tmp_path / "a_file" / "logs").exists()


def test_launcher_rejects_a_string_command():
    with pytest.raises(LaunchError, match=r"non-empty list of non-empty strings.*received 'python train.py'"):
        Launcher("python train.py", workers=1, ps=1)


def test_launch_is_registered_and_documents_its_options(capsys):
    assert cli.main(["launch", "--help"]) == 0
    text = capsys.readouterr().out
    for option in ("--workers", "--ps", "--evaluator", "--max-restarts", "--log-dir", "--snapshot-dir", "--isolate"):
        assert option in text
    assert f"default: {launch.DEFAULT_MAX_RESTARTS}" in text


def test_helpers_read_the_environment(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv(launch.SNAPSHOT_DIR_ENV, raising=False)
    assert launch.task_type() is None
    assert launch.snapshot_dir("fallback") == "fallback"
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"evaluator": ["e:1"]}, "task": {"type": "evaluator", "index": 0}}')
    monkeypatch.setenv(launch.SNAPSHOT_DIR_ENV, "/snaps")
    assert launch.task_type() == "evaluator"
    assert launch.snapshot_dir("fallback") == "/snaps"


def test_exit_status_of_a_signalled_chief_is_128_plus_the_signal():
    # Shell convention; the chaos tests and users' scripts rely on it.
    assert exit_code(-signal.SIGKILL) == 137
    assert exit_code(3) == 3
    assert _describe_status(-9) == "-9 (killed by SIGKILL)"


# --- processes: real launches with a cheap chief --------------------------


def _host_addresses() -> list[str]:
    """The IPv4 addresses of this machine's interfaces other than loopback."""
    return [
        addr.address
        for name, addrs in psutil.net_if_addrs().items()
        for addr in addrs
        if addr.family == socket.AF_INET and not addr.address.startswith("127.")
    ]


def _host_listening_ports() -> set[int]:
    """TCP ports in LISTEN state in this (the host's) network namespace."""
    ports = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name, encoding="ascii") as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[3] == "0A":
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _reachable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(CONNECT_TIMEOUT_S)
        return sock.connect_ex((host, port)) == 0


@pytest.mark.processes
def test_streams_prefixed_output_keeps_logs_and_returns_the_chiefs_status(tmp_path):
    logs, snaps = tmp_path / "logs", tmp_path / "snaps"
    with LaunchRun(
        ["--workers", "2", "--ps", "1", "--log-dir", str(logs), "--snapshot-dir", str(snaps)],
        [PY, "-c", ENV_PROBE],
    ) as run:
        code = run.wait()
    out = run.output
    assert code == 3, out
    # One warning line before anything starts, naming the risk and --isolate.
    warning = [line for line in run.lines if "warning" in line]
    assert len(warning) == 1 and "no authentication" in warning[0] and "--isolate" in warning[0]
    for task in ("ps:0", "worker:0", "worker:1"):
        assert re.search(rf"^\[{task}\] tf_psx.server ready {task} pid=\d+$", out, re.M), out
    # The chief ran with its own TF_CONFIG (task chief:0, no evaluator in the
    # cluster), GRPC_FAIL_FAST and the snapshot directory.
    probe = f"probe chief 0 ['chief', 'ps', 'worker'] use_caller {snaps} 0"
    assert f"[chief:0] {probe}" in run.lines
    assert re.search(rf"chief:0 failed with exit status 3; logs in {logs}; its log is {logs}/chief-0.log", out)
    # Every task has a log file with its own output, unprefixed.
    assert sorted(os.listdir(logs)) == ["chief-0.log", "launcher.json", "ps-0.log", "task_pids.json", "worker-0.log", "worker-1.log"]
    assert (logs / "chief-0.log").read_text().splitlines() == [probe]
    assert "tf_psx.server ready worker:1" in (logs / "worker-1.log").read_text()
    assert "[worker:1]" not in (logs / "worker-1.log").read_text()
    # Every server stopped when the chief did.
    assert not any(pid_alive(pid) for pid in run.pids().values())


@pytest.mark.processes
def test_an_error_in_a_task_reaches_the_terminal_in_full(tmp_path):
    # The exception's message quotes a line that is known noise elsewhere: the
    # echo filter still shows the whole traceback.
    noise = "Found source dataset of type X. This type is not efficiently shardable"
    script = f"def train():\n    raise ValueError({noise!r})\n\ntrain()\n"
    with LaunchRun(["--workers", "1", "--ps", "1", "--log-dir", str(tmp_path)], [PY, "-c", script]) as run:
        code = run.wait()
    assert code == 1, run.output
    chief = [line[len("[chief:0] "):] for line in run.lines if line.startswith("[chief:0] ")]
    assert chief == ["Traceback (most recent call last):", '  File "<string>", line 4, in <module>',
                     '  File "<string>", line 2, in train', f"ValueError: {noise}"], run.output


@pytest.mark.processes
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 128 + signal.SIGINT)])
def test_a_signal_stops_every_task_and_the_status_is_the_chiefs(tmp_path, signum, status):
    with LaunchRun(["--workers", "1", "--ps", "1", "--log-dir", str(tmp_path)], [PY, "-c", SLEEPER]) as run:
        _, match = run.wait_for(r"^\[chief:0\] sleeper pid=(\d+)")
        pids = [*run.pids().values(), int(match[1])]
        assert len(pids) == 3 and all(pid_alive(pid) for pid in pids)
        started = time.monotonic()
        run.signal(signum)
        code = run.wait()
        took = time.monotonic() - started
    # The chief got the signal itself (SIGINT: a KeyboardInterrupt in Python,
    # which then dies of SIGINT), and the launcher's status is the chief's.
    assert code == status, run.output
    assert f"received {signal.Signals(signum).name}; stopping every task" in run.output
    assert not any(pid_alive(pid) for pid in pids)
    assert took < launch.STOP_GRACE_S * 2


@pytest.mark.processes
def test_a_dead_worker_is_restarted_then_the_launcher_gives_up(tmp_path):
    with LaunchRun(
        ["--workers", "2", "--ps", "1", "--max-restarts", "1", "--log-dir", str(tmp_path)], [PY, "-c", SLEEPER]
    ) as run:
        index, match = run.wait_for(r"^\[chief:0\] sleeper pid=(\d+)")
        chief_pid = int(match[1])
        first = run.pids()["worker:1"]
        os.kill(first, signal.SIGKILL)
        index, _ = run.wait_for(r"worker:1 exited with status -9 \(killed by SIGKILL\); restarting it \(restart 1 of 1\)", start=index)
        index, match = run.wait_for(r"^\[worker:1\] tf_psx.server ready worker:1 pid=(\d+)", start=index)
        second = int(match[1])
        assert second != first and pid_alive(second) and pid_alive(chief_pid)
        os.kill(second, signal.SIGKILL)
        code = run.wait()
    assert code == launch.EXIT_GAVE_UP
    expected = (
        f"giving up: worker:1 exited with status -9 (killed by SIGKILL) after 1 restart(s) "
        f"(--max-restarts 1); its log is {tmp_path}/worker-1.log"
    )
    assert expected in run.output
    # The log file keeps both starts.
    text = (tmp_path / "worker-1.log").read_text()
    assert text.count("tf_psx.server ready worker:1") == 2 and "start 2 of worker:1" in text
    assert not any(pid_alive(pid) for pid in [*run.pids().values(), chief_pid])


@pytest.mark.processes
def test_without_isolate_the_ports_are_reachable_on_every_interface(tmp_path):
    """Measures what the warning says: TF servers listen on *:port, not only on 127.0.0.1."""
    addresses = _host_addresses()
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address to probe")
    with LaunchRun(["--workers", "1", "--ps", "1", "--log-dir", str(tmp_path)], [PY, "-c", SLEEPER]) as run:
        run.wait_for(r"^\[chief:0\] sleeper pid=")
        ports = run.ports()
        for task in ("ps:0", "worker:0"):
            assert _reachable(addresses[0], ports[task]), f"{task} not reachable on {addresses[0]}"


def _namespace_can_reach(pid: int, port: int) -> bool:
    probe = f"import socket; s = socket.socket(); s.settimeout({CONNECT_TIMEOUT_S}); print(s.connect_ex(('127.0.0.1', {port})))"
    result = subprocess.run(
        ["nsenter", f"--net=/proc/{pid}/ns/net", PY, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return result.stdout.strip() == "0"


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="--isolate needs Linux network namespaces")
def test_isolate_makes_every_port_unreachable_from_the_host(tmp_path):
    if os.geteuid() != 0 or not _has("nsenter"):
        pytest.skip("probing inside the namespace needs root and nsenter")
    stop = tmp_path / "stop"
    with LaunchRun(
        ["--workers", "1", "--ps", "1", "--isolate", "--log-dir", str(tmp_path / "logs")],
        [PY, os.path.join(SCRIPTS, "launch_connect_and_wait.py"), str(stop)],
    ) as run:
        _, match = run.wait_for(r"^\[chief:0\] tf_psx connected pid=(\d+)")
        chief_pid = int(match[1])
        ports = run.ports()
        assert set(ports) == {"chief:0", "worker:0", "ps:0"}
        assert "warning" not in run.output and "isolated: the job runs in a private network namespace" in run.output
        # The tasks live in another network namespace than this test.
        assert os.readlink(f"/proc/{chief_pid}/ns/net") != os.readlink("/proc/self/ns/net")
        # Positive control: inside the namespace every port listens ...
        for task, port in ports.items():
            assert _namespace_can_reach(chief_pid, port), f"{task} does not listen inside the namespace"
        # ... and from the host namespace none can be reached, on any address.
        # The job's sockets are in another namespace than this one, so a LISTEN entry of this
        # namespace on one of their port numbers is another process's (a parallel test's).
        assert os.readlink(f"/proc/{chief_pid}/ns/net") != os.readlink("/proc/self/ns/net")
        for host in ["127.0.0.1", *_host_addresses()]:
            for task, port in ports.items():
                if port in _host_listening_ports():
                    continue
                assert not _reachable(host, port), f"{task} port {port} reachable from the host on {host}"
        stop.write_text("")
        code = run.wait()
    assert code == 0, run.output
    assert (tmp_path / "logs" / "chief-0.log").exists()


def _has(program: str) -> bool:
    from shutil import which  # pylint: disable=import-outside-toplevel

    return which(program) is not None


@pytest.mark.processes
def test_evaluator_evaluates_the_snapshots_and_stops_by_itself(tmp_path):
    with LaunchRun(
        ["--workers", "1", "--ps", "1", "--evaluator", "--log-dir", str(tmp_path)],
        [PY, os.path.join(SCRIPTS, "launch_train.py"), "--epochs", "1", "--steps", "40", "--every", "20"],
    ) as run:
        code = run.wait()
        _, final = run.wait_for(r"^\[chief:0\] RESULT .*\"holdout_loss\": (?P<loss>[\d.]+)", timeout=1)
        _, done = run.wait_for(r"^\[evaluator:0\] tf_psx evaluator done: (\d+) snapshot", timeout=1)
    assert code == 0, run.output
    evaluations = re.findall(r"^\[evaluator:0\] tf_psx evaluator: evaluated (\S+)/ckpt: \{'loss': ([\d.]+)\}", run.output, re.M)
    assert evaluations and int(done[1]) >= 1
    # It evaluated the final snapshot last, and its loss on the holdout data
    # is the one the chief computes from its final weights (in numpy).
    last_path, last_loss = evaluations[-1]
    assert last_path.endswith("snapshot-000000000040"), evaluations
    assert float(last_loss) == pytest.approx(float(final["loss"]), rel=1e-4)
    assert os.path.exists(tmp_path / "snapshots" / launch.TRAINING_DONE_FILE)
    assert "waiting up to" in run.output and "(killed by" not in run.output.split("finished with exit status 0")[1]


def test_public_names_are_pinned():
    import tf_psx  # pylint: disable=import-outside-toplevel

    assert launch.__all__ == [
        "CHIEF_ATTEMPT_ENV", "LaunchError", "Launcher", "SNAPSHOT_DIR_ENV", "TRAINING_DONE_FILE",
        "request_scale", "run_sidecar_evaluator", "snapshot_dir", "task_type",
    ]
    assert "launch" in tf_psx.__all__ and tf_psx.launch is launch


def _scrape(port: int) -> dict[tuple, float]:
    import urllib.request  # pylint: disable=import-outside-toplevel

    from prometheus_client.parser import text_string_to_metric_families  # pylint: disable=import-outside-toplevel

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {(s.name, s.labels.get("task")): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _free_port_pair() -> int:
    """A port P with P + 1 free too (the launcher's and the chief's)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < 65534:
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise AssertionError("no free pair of ports")


@pytest.mark.processes
def test_metrics_port_serves_each_tasks_process_and_counts_restarts(tmp_path):
    port = _free_port_pair()
    chief = "import os, time; print('chief metrics port', os.environ['TF_PSX_METRICS_PORT'], flush=True); time.sleep(600)"
    with LaunchRun(["--workers", "2", "--ps", "1", "--log-dir", str(tmp_path), "--metrics-port", str(port)],
                   [PY, "-c", chief]) as run:
        index, match = run.wait_for(r"^\[chief:0\] chief metrics port (\d+)")
        assert int(match[1]) == port + 1
        first = _scrape(port)
        for task in ("ps:0", "worker:0", "worker:1", "chief:0"):
            assert first[("tf_psx_task_up", task)] == 1.0 and first[("tf_psx_task_rss_bytes", task)] > 0, task
            assert first[("tf_psx_task_restarts", task)] == 0.0
        assert ("tf_psx_host_swap_used_bytes", None) in first and ("tf_psx_host_cpu_percent", None) in first
        os.kill(run.pids()["worker:1"], signal.SIGKILL)
        run.wait_for(r"^\[worker:1\] tf_psx.server ready worker:1", start=index)
        after = _scrape(port)
        assert after[("tf_psx_task_restarts", "worker:1")] == 1.0 and after[("tf_psx_task_up", "worker:1")] == 1.0
        # The stall doctor's view of the tasks follows the restart.
        pids = json.loads((tmp_path / launch.PIDS_FILE).read_text())
        assert pids["worker:1"] == run.pids()["worker:1"] and set(pids) == {"ps:0", "worker:0", "worker:1", "chief:0"}
        assert after[("tf_psx_task_restarts", "worker:0")] == 0.0
        run.signal(signal.SIGTERM)
        run.wait()
    assert f"metrics: http://0.0.0.0:{port}/metrics (tasks)" in run.output


@pytest.mark.processes
def test_a_metrics_port_in_use_is_named_and_the_job_runs(tmp_path):
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        with LaunchRun(["--workers", "1", "--ps", "1", "--log-dir", str(tmp_path), "--metrics-port", str(port)],
                       [PY, "-c", "print('chief ran', flush=True)"]) as run:
            code = run.wait()
    finally:
        taken.close()
    assert code == 0 and "[chief:0] chief ran" in run.output
    assert f"error: no metrics are served, the job runs without them: [Errno 98] The metrics port {port}" in run.output
