"""Multi-host test (process tier): a ps, a worker and the chief on three "hosts".

Each host is a Linux network namespace with one veth interface and its own
IP, all plugged into a bridge that lives in a fourth namespace (the
"switch"), so that nothing of it touches the host's own network. The tasks
find each other by those IPs only: loopback is per namespace. With
`tc netem`, every host's link delays its outgoing packets by 20 ms (a round
trip of 40 ms) and training must still complete.

Skipped, with the reason, when not run as root, when `ip` or `tc` is missing,
or (the delayed variant) when the kernel has no netem qdisc.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tf_psx.cluster import ClusterConfig
from tf_psx.server import READY_MARK

from launch_harness import SCRIPTS

pytestmark = pytest.mark.processes

PORT = 2222
SUBNET = "10.231.0"
HOSTS = {"ps": 1, "worker": 2, "chief": 3}  # task -> last octet of its host's IP
DELAY_MS = 20
# A server imports TF (seconds) and the chief traces the first step (~20 s on
# 2 cores); over a 40 ms round trip every remote call is slower too.
READY_TIMEOUT_S = 180
CHIEF_TIMEOUT_S = 420
STOP_GRACE_S = 5
STEPS = 30
PING_COUNT = 3


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces, veth pairs and a bridge needs root (run the tests as root)"
    for program in ("ip", "tc"):
        if shutil.which(program) is None:
            return f"`{program}` (iproute2) is not installed"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=check)


class _Hosts:
    """Three namespaces on a bridge; removes everything it made in close()."""

    def __init__(self, tag: str):
        self.switch = f"psx{tag}sw"
        self.names = {task: f"psx{tag}{task[:2]}" for task in HOSTS}
        self.made: list[str] = []

    def ip(self, task: str) -> str:
        return f"{SUBNET}.{HOSTS[task]}"

    def create(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self.made.append(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for task, ns in self.names.items():
            _run("ip", "netns", "add", ns)
            self.made.append(ns)
            # The pair is made inside the host namespace; its peer moves to the switch.
            _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"p-{task[:2]}")
            _run("ip", "-n", ns, "link", "set", f"p-{task[:2]}", "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", f"p-{task[:2]}", "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.ip(task)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def add_delay(self, delay_ms: int) -> str | None:
        """Delays every host's outgoing packets; returns why it cannot, or None."""
        for ns in self.names.values():
            result = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem",
                          "delay", f"{delay_ms}ms", check=False)
            if result.returncode != 0:
                return f"`tc qdisc add ... netem` fails on this kernel: {result.stderr.strip()} (no sch_netem)"
        return None

    def exec_argv(self, task: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.names[task], *argv]

    def close(self) -> None:
        for ns in reversed(self.made):
            _run("ip", "netns", "del", ns, check=False)
        self.made.clear()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, log_path: str, name: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        with open(log_path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        if READY_MARK in text:
            return
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited ({proc.returncode}) before it listened:\n{text[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{name} did not listen within {READY_TIMEOUT_S} s")


@pytest.mark.parametrize("delay_ms", [0, DELAY_MS], ids=["no-delay", f"netem-{DELAY_MS}ms"])
def test_ps_worker_and_chief_on_three_hosts(tmp_path, delay_ms):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    hosts = _Hosts(f"{os.getpid() % 10000}{'d' if delay_ms else 'n'}")
    procs: list[subprocess.Popen] = []
    try:
        hosts.create()
        if delay_ms:
            why = hosts.add_delay(delay_ms)
            if why:
                pytest.skip(why)
            # The delay is really on the path: a round trip crosses two delayed links.
            ping = _run(*hosts.exec_argv("chief", "ping", "-c", str(PING_COUNT), "-i", "0.2", hosts.ip("ps")))
            rtts = [float(x) for x in re.findall(r"time=([\d.]+) ms", ping.stdout)]
            assert len(rtts) == PING_COUNT and min(rtts) >= 2 * delay_ms * 0.9, ping.stdout
        config = ClusterConfig(
            workers=[f"{hosts.ip('worker')}:{PORT}"], ps=[f"{hosts.ip('ps')}:{PORT}"], chief=f"{hosts.ip('chief')}:{PORT}"
        )
        env = dict(os.environ, GRPC_FAIL_FAST="use_caller", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
        for task in ("ps", "worker"):
            log_path = str(tmp_path / f"{task}.log")
            with open(log_path, "wb") as log:
                procs.append(subprocess.Popen(  # pylint: disable=consider-using-with
                    hosts.exec_argv(task, sys.executable, "-m", "tf_psx.server"),
                    env=dict(env, TF_CONFIG=config.to_json(task, 0)), stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                ))
            _wait_ready(procs[-1], log_path, task)
        # Separate hosts: from the chief's host, the ps port is not on loopback.
        probe = f"import socket; print(socket.socket().connect_ex(('127.0.0.1', {PORT})))"
        assert _run(*hosts.exec_argv("chief", sys.executable, "-c", probe)).stdout.strip() != "0"
        result_path = tmp_path / "result.json"
        chief = subprocess.Popen(  # pylint: disable=consider-using-with
            hosts.exec_argv("chief", sys.executable, os.path.join(SCRIPTS, "launch_train.py"),
                            "--epochs", "1", "--steps", str(STEPS), "--result", str(result_path)),
            env=dict(env, TF_CONFIG=config.to_json("chief", 0)), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
        procs.append(chief)
        try:
            output, _ = chief.communicate(timeout=CHIEF_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop(chief)
            raise AssertionError(f"the chief did not finish within {CHIEF_TIMEOUT_S} s") from None
        assert chief.returncode == 0, output[-5000:]
        result = json.loads(result_path.read_text())
        assert result["iterations"] == STEPS and result["steps_with_loss"] == STEPS, result
        # The servers were still serving at the end (none crashed).
        assert all(proc.poll() is None for proc in procs[:2])
    finally:
        for proc in procs:
            _stop(proc)
        hosts.close()
    assert not [ns for ns in _run("ip", "netns", "list").stdout.split() if ns.startswith(f"psx{os.getpid() % 10000}")]
