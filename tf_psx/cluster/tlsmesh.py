"""A mutual-TLS mesh between the hosts of a cluster: every gRPC byte that leaves a host is encrypted.

TensorFlow's gRPC server speaks plain text and has no authentication. The
mesh puts `netproxy.TLSTunnel`s around each task without changing
TensorFlow: the task's process sees a cluster in which *every* task is on
loopback, `127.0.0.1:(base_port + i)` for the i-th task of the cluster (in
"chief", "ps", "worker" order, the evaluator left out: workers come last so
that a change of their number moves no other task's port). On each host,

  * an "accept" tunnel listens on the task's public address (the one in the
    real TF_CONFIG, for example the Kubeflow operator's
    `NAME-ps-0.NS.svc:2222`) with TLS, and passes the plain bytes on to the
    task's own loopback port;
  * a "connect" tunnel listens on `127.0.0.1:(base_port + j)` for every
    other task j and carries the bytes over TLS to task j's public address.

Both ends show a certificate signed by the cluster's CA and accept only a
peer that does (`netproxy.tls_context`). Since the TensorFlow processes are
given loopback addresses only, nothing they send can leave the host except
through a tunnel.

`python -m tf_psx.tlsmesh --cert-dir DIR -- CMD ...` starts the task's
tunnels from the TF_CONFIG in the environment, runs CMD with the loopback
TF_CONFIG, passes SIGTERM and SIGINT on to it, stops the tunnels when it
exits, and exits with its status. The k8s manifests
(`tf_psx.cluster.k8s.tfjob_manifest(..., tls_secret=...)`) wrap every container's
command this way.

DIR holds `ca.crt`, `tls.crt` and `tls.key`: the key names of a Kubernetes
TLS secret made by cert-manager, so that such a secret mounts as is. One
certificate may serve every task: trust is "signed by the cluster's CA",
not a host name. It is used on both sides (server and client), so its
extended key usage, if it has one, must allow both.

Known limitations:
  * TensorFlow's server still binds its loopback-mapped port on every
    interface. Keep other hosts off it with a network policy (the k8s
    manifests add one that admits only the TLS port), a firewall or a network
    namespace; the mesh itself only guarantees that the job's own traffic is
    encrypted.
  * `tf-psx launch` runs a job on one host, whose traffic never leaves
    loopback, and `--isolate` already keeps every port of it unreachable;
    it has no TLS option.
  * The ports `base_port .. base_port + tasks - 1` must be free on every
    host, and must not include a task's public port.

Example (the plan only; `run` starts the tunnels):

>>> plan = mesh_plan({"cluster": {"chief": ["c:2222"], "worker": ["w:2222"], "ps": ["p:2222"]},
...                   "task": {"type": "ps", "index": 0}}, base_port=32200)
>>> plan.local_tf_config["cluster"]
{'chief': ['127.0.0.1:32200'], 'ps': ['127.0.0.1:32201'], 'worker': ['127.0.0.1:32202']}
>>> plan.accept, plan.connect
({'0.0.0.0:2222': '127.0.0.1:32201'}, {'127.0.0.1:32200': 'c:2222', '127.0.0.1:32202': 'w:2222'})
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
from typing import Any, Mapping

from tf_psx.cluster import netproxy
from tf_psx.cluster import ClusterConfig
from tf_psx.errors import ArgumentError, MissingFileError, TFConfigError

__all__ = ["CERT_FILES", "DEFAULT_BASE_PORT", "MeshPlan", "mesh_plan", "run"]

# The loopback port of the cluster's first task; the others follow it. High
# enough to stay clear of the TFJob port (2222) and of the usual service
# ports, below Linux's default ephemeral range (32768..60999), so that no
# outgoing connection of the host takes one of them.
DEFAULT_BASE_PORT = 32100
# The file names in the certificate directory (a cert-manager TLS secret's keys).
CERT_FILES = {"ca": "ca.crt", "cert": "tls.crt", "key": "tls.key"}
# Printed (with flush) once every tunnel listens, before CMD starts.
READY_MARK = "tf_psx.tlsmesh ready"
# After SIGTERM is passed on, how long CMD has before it is killed.
STOP_GRACE_S = 10.0
# Workers last: scaling them (tf-psx scale, a new TFJob replica count) keeps
# every other task's loopback port, so meshes started before still agree.
_PORT_ORDER = ("chief", "ps", "worker")
_ANY_HOST = "0.0.0.0"
_LOOPBACK = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """The tunnels of one task, and the TF_CONFIG its process gets.

    Attributes:
      local_tf_config: the task's TF_CONFIG with every training task at
        `127.0.0.1:(base_port + i)`.
      accept: {"0.0.0.0:PUBLIC_PORT": "127.0.0.1:LOCAL_PORT"}: the task's own
        TLS door; empty for a task outside the training cluster (evaluator).
      connect: {"127.0.0.1:LOCAL_PORT_J": PUBLIC_ADDRESS_J} for every other task.
    """

    local_tf_config: dict[str, Any]
    accept: dict[str, str]
    connect: dict[str, str]


def _port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def mesh_plan(tf_config: str | Mapping[str, Any] | None = None, base_port: int = DEFAULT_BASE_PORT) -> MeshPlan:
    """Works out the tunnels of the task in `tf_config` (None: $TF_CONFIG).

    Raises:
      TFConfigError: the TF_CONFIG is invalid or has no "task".
      ValueError: `base_port` is not an int in 1024..65535 that leaves room
        for every task, or the task's public port falls among the loopback ports.
    """
    config = ClusterConfig.from_tf_config(tf_config)
    if config.task_type is None:
        raise TFConfigError('TF_CONFIG has no "task". Fix: give the task\'s {"type": ..., "index": ...}, '
                            "as the Kubeflow operator and `tf-psx launch` do.")
    cluster = config.as_dict()
    jobs = {t: cluster[t] for t in _PORT_ORDER if t in cluster}
    tasks = [(t, i, address) for t, addresses in jobs.items() for i, address in enumerate(addresses)]
    if isinstance(base_port, bool) or not isinstance(base_port, int) or not (
            1024 <= base_port and base_port + len(tasks) - 1 <= 65535):
        raise ArgumentError(f"Argument `base_port` must be an int >= 1024 with base_port + {len(tasks) - 1} "
                            f"(one port per task) <= 65535. Received: {base_port!r}. "
                            f"Fix: use the default {DEFAULT_BASE_PORT}.")
    local = {(t, i): f"{_LOOPBACK}:{base_port + n}" for n, (t, i, _) in enumerate(tasks)}
    own = (config.task_type, config.task_index)
    accept, connect = {}, {}
    for t, i, address in tasks:
        if (t, i) == own:
            public_port = _port_of(address)
            if base_port <= public_port < base_port + len(tasks):
                raise ArgumentError(
                    f"The task's public port {public_port} ({t}:{i} at {address}) is one of the loopback ports "
                    f"{base_port}..{base_port + len(tasks) - 1} of the mesh. Fix: pass another `base_port`.")
            accept[f"{_ANY_HOST}:{public_port}"] = local[(t, i)]
        else:
            connect[local[(t, i)]] = address
    local_config = {"cluster": {t: [local[(t, i)] for i in range(len(a))] for t, a in jobs.items()},
                    "task": {"type": config.task_type, "index": config.task_index}}
    return MeshPlan(local_config, accept, connect)


def _contexts(cert_dir: str):
    if not os.path.isdir(cert_dir):
        raise MissingFileError(f"The certificate directory {cert_dir!r} does not exist. Fix: pass the directory that holds "
                               f"{', '.join(CERT_FILES.values())} (a mounted Kubernetes TLS secret).")
    paths = {role: os.path.join(cert_dir, name) for role, name in CERT_FILES.items()}
    return {side: netproxy.tls_context(side, paths["cert"], paths["key"], paths["ca"]) for side in ("accept", "connect")}


def start_tunnels(plan: MeshPlan, cert_dir: str) -> list[netproxy.TLSTunnel]:
    """Starts the plan's tunnels; closes the started ones if one fails."""
    contexts = _contexts(cert_dir)
    tunnels: list[netproxy.TLSTunnel] = []
    try:
        for side, routes in (("accept", plan.accept), ("connect", plan.connect)):
            if routes:
                tunnels.append(netproxy.TLSTunnel(routes, side, contexts[side]).start())
    except BaseException:
        for tunnel in tunnels:
            tunnel.close()
        raise
    return tunnels


def run(command: list[str], cert_dir: str, base_port: int = DEFAULT_BASE_PORT,
        env: Mapping[str, str] | None = None) -> int:
    """Runs `command` inside the mesh of the task in env["TF_CONFIG"]; returns its exit status.

    Prints READY_MARK once the tunnels listen, and each tunnel's byte counts
    (one JSON line) when the command has exited.
    """
    env = dict(os.environ if env is None else env)
    plan = mesh_plan(env.get("TF_CONFIG"), base_port)
    tunnels = start_tunnels(plan, cert_dir)
    try:
        own = plan.local_tf_config["task"]
        print(f"{READY_MARK}: {own['type']}:{own['index']} TLS on {', '.join(plan.accept) or '(no port)'}, "
              f"{len(plan.connect)} peers; the command sees {json.dumps(plan.local_tf_config['cluster'])}",
              flush=True)
        child = subprocess.Popen(command, env=dict(env, TF_CONFIG=json.dumps(plan.local_tf_config)))  # pylint: disable=consider-using-with
        forwarded = {signum: signal.signal(signum, lambda signum, _: child.send_signal(signum))
                     for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            status = child.wait()
        finally:
            for signum, handler in forwarded.items():
                signal.signal(signum, handler)
            if child.poll() is None:
                child.terminate()
                try:
                    child.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
    finally:
        stats = {}
        for tunnel in tunnels:
            tunnel.close()
            stats[tunnel.side] = tunnel.stats()
        print(json.dumps(stats), flush=True)
    # A command killed by a signal exits as a shell reports it: 128 + the signal.
    return status if status >= 0 else 128 - status


def main(argv: list[str] | None = None) -> int:
    """`python -m tf_psx.tlsmesh --cert-dir DIR [--base-port P] -- CMD ...`."""
    parser = argparse.ArgumentParser(prog="python -m tf_psx.tlsmesh", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cert-dir", required=True,
                        help=f"the directory of {', '.join(CERT_FILES.values())} (a mounted TLS secret)")
    parser.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT,
                        help=f"the loopback port of the cluster's first task (default {DEFAULT_BASE_PORT})")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD", help="the task's command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the task's command after --, e.g. -- python -m tf_psx.server")
    try:
        return run(command, args.cert_dir, args.base_port)
    except (ValueError, OSError) as err:
        print(f"tf_psx.tlsmesh: {err}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
