"""The TLS mesh: the plan of every task's tunnels, a task behind its TLS door, and the errors.

A mesh of several tasks needs one host per task (every task's peers sit on
the same loopback ports); that runs in tests/cluster/test_multihost.py, in network
namespaces. Here one task runs behind its door on this host's loopback.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from tf_psx.cluster import tlsmesh
from tf_psx.errors import TFConfigError
from tf_psx.cluster.ports import free_ports
from tf_psx.cluster.netproxy import TLSTunnel, tls_context

from tls_pki import make_pki, needs_openssl, refused_without_certificate

pytestmark = pytest.mark.unit

WAIT_S = 30
CLUSTER = {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"], "evaluator": ["e0:2222"]}
# A task that serves its own TF_CONFIG address: an echo server standing in for a TF server.
ECHO_TASK = (
    "import json, os, socket\n"
    "config = json.loads(os.environ['TF_CONFIG'])\n"
    "host, port = config['cluster']['worker'][0].rsplit(':', 1)\n"
    "server = socket.create_server((host, int(port)))\n"
    "print('task listening on', host, port, 'with cluster', json.dumps(config['cluster']), flush=True)\n"
    "while True:\n"
    "    conn, _ = server.accept()\n"
    "    while data := conn.recv(65536):\n"
    "        conn.sendall(data)\n"
    "    conn.close()\n"
)


def _config(task_type, index, cluster=None):
    return {"cluster": cluster or CLUSTER, "task": {"type": task_type, "index": index}}


def test_every_task_sees_the_same_loopback_cluster_and_dials_each_peer_once():
    plans = {(t, i): tlsmesh.mesh_plan(_config(t, i), base_port=40000)
             for t, addresses in CLUSTER.items() for i in range(len(addresses))}
    expected = {"chief": ["127.0.0.1:40000"], "ps": ["127.0.0.1:40001"],
                "worker": ["127.0.0.1:40002", "127.0.0.1:40003"]}
    for (task_type, index), plan in plans.items():
        assert plan.local_tf_config == {"cluster": expected, "task": {"type": task_type, "index": index}}
        if task_type == "evaluator":
            # Outside the training cluster: no door of its own, a tunnel to every training task.
            assert plan.accept == {} and sorted(plan.connect.values()) == sorted(
                a for t, addresses in CLUSTER.items() if t != "evaluator" for a in addresses)
            continue
        own = expected[task_type][index]
        assert plan.accept == {"0.0.0.0:2222": own}
        # Each peer's loopback port leads to that peer's public address, and never to itself.
        peers = {local: public for t, addresses in CLUSTER.items() if t != "evaluator"
                 for local, public in zip(expected[t], addresses) if local != own}
        assert plan.connect == peers


def test_the_plan_reads_tf_config_from_the_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(_config("ps", 0)))
    assert tlsmesh.mesh_plan().accept == {"0.0.0.0:2222": f"127.0.0.1:{tlsmesh.DEFAULT_BASE_PORT + 1}"}


def test_more_workers_move_no_other_tasks_port():
    # A worker pod started before a rescale and the chief restarted after it agree on every port they share.
    grown = dict(CLUSTER, worker=["w0:2222", "w1:2222", "w2:2222", "w3:2222"])
    before = tlsmesh.mesh_plan(_config("worker", 1), base_port=40000).local_tf_config["cluster"]
    after = tlsmesh.mesh_plan(_config("chief", 0, grown), base_port=40000).local_tf_config["cluster"]
    assert after["chief"] == before["chief"] and after["ps"] == before["ps"]
    assert after["worker"][:2] == before["worker"]


@pytest.mark.parametrize("tf_config, base_port, error, match", [
    ({"cluster": CLUSTER}, 40000, ValueError, 'TF_CONFIG has no "task"'),
    (_config("worker", 0), 80, ValueError, r"`base_port` must be an int >= 1024 .* Received: 80"),
    (_config("worker", 0), 65534, ValueError, r"base_port \+ 3 \(one port per task\) <= 65535. Received: 65534"),
    (_config("worker", 0), "4000", ValueError, r"Received: '4000'"),
    (_config("worker", 1), 2219, ValueError, r"public port 2222 \(worker:1 at w1:2222\) is one of the loopback "
                                             r"ports 2219..2222 .* Fix: pass another `base_port`"),
    ({"cluster": {"worker": ["w0"]}, "task": {"type": "worker", "index": 0}}, 40000, TFConfigError, "w0"),
])
def test_bad_plans_are_refused_with_the_value_and_the_fix(tf_config, base_port, error, match):
    with pytest.raises(error, match=match):
        tlsmesh.mesh_plan(tf_config, base_port)


@pytest.mark.processes
def test_a_missing_certificate_directory_is_named(tmp_path):
    code = subprocess.run(
        [sys.executable, "-m", "tf_psx.tlsmesh", "--cert-dir", str(tmp_path / "none"), "--", "true"],
        env={"TF_CONFIG": json.dumps(_config("worker", 0)), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=WAIT_S, check=False)
    assert code.returncode == 2
    assert "certificate directory" in code.stderr and "/none" in code.stderr and "ca.crt, tls.crt, tls.key" in code.stderr


@pytest.mark.processes
def test_a_missing_command_is_an_error():
    code = subprocess.run([sys.executable, "-m", "tf_psx.tlsmesh", "--cert-dir", "/tmp"], capture_output=True,
                          text=True, timeout=WAIT_S, check=False)
    assert code.returncode == 2 and "give the task's command after --" in code.stderr


@pytest.mark.processes
@needs_openssl
def test_a_task_behind_its_door_talks_tls_only_and_its_exit_status_is_passed_on(tmp_path):
    pki = make_pki(str(tmp_path))
    public, base = free_ports(2)
    tf_config = {"cluster": {"worker": [f"127.0.0.1:{public}"]}, "task": {"type": "worker", "index": 0}}
    log_path = tmp_path / "mesh.log"
    with open(log_path, "wb") as log:
        mesh = subprocess.Popen(  # pylint: disable=consider-using-with
            [sys.executable, "-m", "tf_psx.tlsmesh", "--cert-dir", pki["mesh_dir"], "--base-port", str(base), "--",
             sys.executable, "-c", ECHO_TASK],
            env={"TF_CONFIG": json.dumps(tf_config), "PATH": "/usr/bin:/bin"}, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT_S
        while "task listening" not in log_path.read_text():
            assert mesh.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        # The task itself was given its loopback address, not the public one.
        assert f"task listening on 127.0.0.1 {base}" in log_path.read_text()
        client = TLSTunnel({"127.0.0.1:0": f"127.0.0.1:{public}"}, "connect",
                           tls_context("connect", *pki["client"], pki["ca"])).start()
        try:
            with socket.create_connection(client.address(0), timeout=WAIT_S) as conn:
                conn.sendall(b"ping over tls")
                assert conn.recv(1024) == b"ping over tls"
        finally:
            client.close()
        refused_without_certificate(("127.0.0.1", public), pki["ca"])
        refused_without_certificate(("127.0.0.1", public), pki["ca"], pki["rogue"])
        mesh.send_signal(signal.SIGTERM)
        # SIGTERM reached the task, which died of it: the shell's 128 + 15.
        assert mesh.wait(WAIT_S) == 128 + signal.SIGTERM
    finally:
        if mesh.poll() is None:
            mesh.kill()
            mesh.wait()
    stats = json.loads(log_path.read_text().strip().splitlines()[-1])
    (door,) = stats["accept"].values()
    assert door["connections"] == 1 and door["bytes_up"] == door["bytes_down"] == len(b"ping over tls")
