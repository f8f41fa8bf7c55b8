"""Multi-host test (process tier): a ps, a worker and the chief on three "hosts".

Each host is a Linux network namespace with one veth interface and its own
IP, all plugged into a bridge that lives in a fourth namespace (the
"switch"), so that nothing of it touches the host's own network. The tasks
find each other by those IPs only: loopback is per namespace. With
`tc netem`, every host's link delays its outgoing packets by 20 ms (a round
trip of 40 ms) and training must still complete. The proxy variant adds the
same delay without netem: every task's address in `TF_CONFIG` is a port of
`tf_psx.netproxy` in the switch namespace, which relays it, 20 ms late in
each direction, to the task's host; so it runs on kernels without sch_netem.
The TLS variant runs every task inside `tf_psx.tlsmesh` (mutual TLS between
the hosts, certificates made with openssl): the tasks are given loopback
addresses only, so the job can train only if every byte between the hosts
went through the tunnels; and a client without the cluster's certificate is
refused at a task's door.

Skipped, with the reason, when not run as root, when `ip` or `tc` is missing,
or (the netem variant) when the kernel has no netem qdisc.
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

from tf_psx.cluster import netproxy, tlsmesh
from tf_psx.cluster import ClusterConfig
from tf_psx.cluster.server import READY_MARK

from conftest import TESTS
from launch_harness import SCRIPTS
from tls_pki import make_pki

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
# The proxy variant: the switch's own address on the bridge, each task's port
# (distinct, as they all appear at that one address), and an echo port that
# measures the round trip through the proxy the way ping does through netem.
SWITCH_OCTET = 254
PROXY_PORTS = {"ps": 2222, "worker": 2223, "chief": 2224}
ECHO_PORT = 2299
ECHO_SERVER = (
    "import socket\n"
    "s = socket.create_server(('0.0.0.0', {port}))\n"
    "print('listening', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    while d := c.recv(64):\n"
    "        c.sendall(d)\n"
    "    c.close()\n"
)
ECHO_CLIENT = (
    "import socket, time\n"
    "c = socket.create_connection(('{host}', {port}), timeout=30)\n"
    "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "times = []\n"
    "for i in range({count}):\n"
    "    t = time.monotonic(); c.sendall(b'x'); assert c.recv(1) == b'x'; times.append(time.monotonic() - t)\n"
    "print(min(times) * 1000)\n"
)


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

    def give_switch_an_address(self) -> str:
        """The switch namespace joins the bridge's subnet (for the proxy); returns its IP."""
        address = f"{SUBNET}.{SWITCH_OCTET}"
        _run("ip", "-n", self.switch, "addr", "add", f"{address}/24", "dev", "br0")
        _run("ip", "-n", self.switch, "link", "set", "lo", "up")
        return address

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
        return ["ip", "netns", "exec", self.names.get(task, task), *argv]

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


def _wait_ready(proc: subprocess.Popen, log_path: str, name: str, mark: str = READY_MARK) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        with open(log_path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        if mark in text:
            return
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited ({proc.returncode}) before it listened:\n{text[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{name} did not listen within {READY_TIMEOUT_S} s")


def _start_logged(argv: list[str], env: dict, log_path: str) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,  # pylint: disable=consider-using-with
                                stdin=subprocess.DEVNULL)


def _start_proxy(hosts: _Hosts, tmp_path, env: dict, procs: list) -> tuple[dict[str, str], str]:
    """The delay proxy in the switch namespace; returns each task's address and the proxy's log."""
    switch_ip = hosts.give_switch_an_address()
    routes = [f"{switch_ip}:{port}={hosts.ip(task)}:{port}" for task, port in PROXY_PORTS.items()]
    routes.append(f"{switch_ip}:{ECHO_PORT}={hosts.ip('ps')}:{ECHO_PORT}")
    echo_log = str(tmp_path / "echo.log")
    procs.append(_start_logged(hosts.exec_argv("ps", sys.executable, "-c", ECHO_SERVER.format(port=ECHO_PORT)), env,
                               echo_log))
    _wait_ready(procs[-1], echo_log, "the echo server", mark="listening")
    proxy_log = str(tmp_path / "proxy.log")
    procs.append(_start_logged(hosts.exec_argv(hosts.switch, sys.executable, "-m", "tf_psx.netproxy",
                                               "--delay-ms", str(DELAY_MS), *routes), env, proxy_log))
    _wait_ready(procs[-1], proxy_log, "the delay proxy", mark=netproxy.READY_MARK)
    # The delay is really on the path: a round trip crosses the proxy twice.
    rtt = _run(*hosts.exec_argv("chief", sys.executable, "-c",
                                ECHO_CLIENT.format(host=switch_ip, port=ECHO_PORT, count=PING_COUNT)))
    assert float(rtt.stdout) >= 2 * DELAY_MS * 0.9, rtt
    return {task: f"{switch_ip}:{port}" for task, port in PROXY_PORTS.items()}, proxy_log


def _check_tls_doors(hosts: _Hosts, addresses: dict, pki: dict, logs: dict) -> None:
    """Each task was given loopback addresses only, and refuses a client without the cluster's certificate."""
    for task, log_path in logs.items():
        with open(log_path, encoding="utf-8", errors="replace") as handle:
            ready = [line for line in handle if line.startswith(tlsmesh.READY_MARK)]
        assert ready and "the command sees" in ready[0], (task, ready)
        seen = json.loads(ready[0].split("the command sees ", 1)[1])
        assert all(a.startswith("127.0.0.1:") for job in seen.values() for a in job), (task, seen)
    probe = ("import sys; sys.path.insert(0, {tests!r}); from tls_pki import refused_without_certificate; "
             "print(refused_without_certificate(({host!r}, {port}), {ca!r}))")
    host, port = addresses["ps"].rsplit(":", 1)
    refusal = _run(*hosts.exec_argv("chief", sys.executable, "-c", probe.format(
        tests=TESTS, host=host, port=int(port), ca=pki["ca"])))
    assert refusal.returncode == 0 and refusal.stdout.strip(), refusal


def _stats(log_path: str) -> dict:
    """The byte counts a relay (netproxy, tlsmesh) prints as its last line when it stops."""
    with open(log_path, encoding="utf-8", errors="replace") as handle:
        return json.loads(handle.read().strip().splitlines()[-1])


@pytest.mark.parametrize("delay_ms, via", [(0, "link"), (DELAY_MS, "netem"), (DELAY_MS, "proxy"), (0, "tls")],
                         ids=["no-delay", f"netem-{DELAY_MS}ms", f"proxy-{DELAY_MS}ms", "tls-mesh"])
def test_ps_worker_and_chief_on_three_hosts(tmp_path, delay_ms, via):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    hosts = _Hosts(f"{os.getpid() % 10000}{via[0]}")
    procs: list[subprocess.Popen] = []
    env = dict(os.environ, GRPC_FAIL_FAST="use_caller", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    addresses = {task: f"{hosts.ip(task)}:{PORT}" for task in HOSTS}
    proxy = None
    mesh: list[str] = []
    if via == "tls":
        if shutil.which("openssl") is None:
            pytest.skip("the TLS variant makes its certificates with openssl")
        pki = make_pki(str(tmp_path))
        mesh = [sys.executable, "-m", "tf_psx.tlsmesh", "--cert-dir", pki["mesh_dir"], "--"]
    try:
        hosts.create()
        if via == "proxy":
            addresses, proxy_log = _start_proxy(hosts, tmp_path, env, procs)
            proxy = procs[-1]
        if via == "netem":
            why = hosts.add_delay(delay_ms)
            if why:
                pytest.skip(why)
            # The delay is really on the path: a round trip crosses two delayed links.
            ping = _run(*hosts.exec_argv("chief", "ping", "-c", str(PING_COUNT), "-i", "0.2", hosts.ip("ps")))
            rtts = [float(x) for x in re.findall(r"time=([\d.]+) ms", ping.stdout)]
            assert len(rtts) == PING_COUNT and min(rtts) >= 2 * delay_ms * 0.9, ping.stdout
        config = ClusterConfig(workers=[addresses["worker"]], ps=[addresses["ps"]], chief=addresses["chief"])
        servers = []
        logs = {}
        for task in ("ps", "worker"):
            logs[task] = log_path = str(tmp_path / f"{task}.log")
            procs.append(_start_logged(hosts.exec_argv(task, *mesh, sys.executable, "-m", "tf_psx.server"),
                                       dict(env, TF_CONFIG=config.to_json(task, 0)), log_path))
            servers.append(procs[-1])
            _wait_ready(procs[-1], log_path, task)
        if not mesh:
            # Separate hosts: from the chief's host, the ps port is not on loopback.
            probe = f"import socket; print(socket.socket().connect_ex(('127.0.0.1', {PORT})))"
            assert _run(*hosts.exec_argv("chief", sys.executable, "-c", probe)).stdout.strip() != "0"
        result_path = tmp_path / "result.json"
        chief = subprocess.Popen(  # pylint: disable=consider-using-with
            hosts.exec_argv("chief", *mesh, sys.executable, os.path.join(SCRIPTS, "launch_train.py"),
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
        assert all(proc.poll() is None for proc in servers)
        if mesh:
            _check_tls_doors(hosts, addresses, pki, logs)
            for proc in servers:
                _stop(proc)
            for task in ("ps", "worker"):
                # The task's door carried the chief's (and, for the ps, the worker's) connections.
                (door,) = _stats(logs[task])["accept"].values()
                assert door["connections"] >= 1 and door["bytes_up"] > 0 and door["bytes_down"] > 0, (task, door)
            # The chief's mesh printed its stats once the training script exited.
            chief_mesh = json.loads(output.strip().splitlines()[-1])
            assert sum(route["bytes_up"] for route in chief_mesh["connect"].values()) > 0, chief_mesh
        if proxy is not None:
            # Every task's traffic went through the proxy (its byte counts, printed when it stops).
            _stop(proxy)
            stats = _stats(proxy_log)
            for task in ("ps", "worker"):
                route = stats[addresses[task]]
                assert route["bytes_up"] > 0 and route["bytes_down"] > 0 and not route["errors"], (task, route)
    finally:
        for proc in procs:
            _stop(proc)
        hosts.close()
    assert not [ns for ns in _run("ip", "netns", "list").stdout.split() if ns.startswith(f"psx{os.getpid() % 10000}")]
