"""`tf-psx doctor TF_CONFIG`: checks a cluster before a run.

Every ps and worker address accepts a TCP connection; the chief's port is
free here; then, through TensorFlow in a child process (`python -m
tf_psx.cluster.preflight --probe`), each task's clock and its TF, tf-keras,
TFRA and tf_psx versions against this host's. Importing this module does not
import TensorFlow.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tf_psx.cluster.ports import connect_seconds, is_loopback_host, port_is_free, split_address


# tf_psx.server writes its versions and pid here (on the task's own host),
# keyed by its port; the doctor reads it through TensorFlow on that task.
SERVER_INFO_DIR = "/tmp"
# A TCP connect to a task that answers nothing.
CONNECT_TIMEOUT_S = 3.0
# Connecting TensorFlow to the cluster and one probe per task, in a child process.
DEFAULT_PROBE_TIMEOUT_S = 120.0
# Clock readings per task; the one with the shortest round trip is kept.
CLOCK_READINGS = 3
# Clocks further apart than this break timestamps in logs and TensorBoard across tasks.
MAX_CLOCK_SKEW_MS = 500.0


def server_info_path(port: int) -> str:
    """Where `tf_psx.server` listening on `port` writes its versions (on its own host)."""
    return os.path.join(SERVER_INFO_DIR, f"tf_psx_server_{port}.json")


def _reachable(address: str) -> tuple[bool, str]:
    """(whether the task at `address` accepts a connection, how long it took or why not)."""
    try:
        seconds = connect_seconds(*split_address(address), timeout_s=CONNECT_TIMEOUT_S)
    except OSError as err:
        return False, f"unreachable: {err.strerror or err}"
    return True, f"{1000 * seconds:.1f} ms to connect"


def check_cluster(tf_config: str, probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S) -> tuple[list[str], bool]:
    """Checks a cluster before a run; returns (report lines, every check passed).

    Checks: every ps and worker address accepts a TCP connection; the chief's
    port is free on this host (the chief binds it); then, through TensorFlow
    (in a child process, bounded by `probe_timeout_s`), each task's clock
    against this host's and its TF, tf-keras, TFRA and tf_psx versions (from
    the file `tf_psx.server` writes) against this host's. Warns when a task
    listens beyond loopback: TF's gRPC has no authentication.

    Args:
      tf_config: the TF_CONFIG (JSON) naming the cluster.
      probe_timeout_s: the bound on the TensorFlow part.

    Raises:
      TFConfigError: a malformed TF_CONFIG.
    """
    import subprocess  # pylint: disable=import-outside-toplevel

    from tf_psx.cluster import ClusterConfig  # pylint: disable=import-outside-toplevel

    config = ClusterConfig.from_tf_config(tf_config)
    config.validate_for_parameter_server()
    lines, ok = ["Addresses:"], True
    for task_type, addresses in (("ps", config.ps), ("worker", config.workers)):
        for index, address in enumerate(addresses):
            reachable, how = _reachable(address)
            ok &= reachable
            lines.append(f"  {'ok  ' if reachable else 'FAIL'} {task_type}:{index} {address}: {how}")
    if config.chief:
        chief_port = split_address(config.chief)[1]
        free = port_is_free(chief_port)
        ok &= free
        lines.append(f"  {'ok  ' if free else 'FAIL'} chief {config.chief}: port {chief_port} "
                     + ("is free here" if free else "is in use here: the chief cannot bind it (pick another port, "
                                                    "or stop what listens there)"))
    exposed = [a for a in (*config.ps, *config.workers, *([config.chief] if config.chief else []))
               if not is_loopback_host(split_address(a)[0])]
    if exposed:
        lines.append(f"  warning: {len(exposed)} task(s) listen beyond loopback ({', '.join(exposed[:4])}"
                     f"{', ...' if len(exposed) > 4 else ''}); TF's gRPC has no authentication, so keep them on a "
                     "trusted network (docs/security.md)")
    if not ok:
        lines.append("TensorFlow checks (clocks, versions): skipped, fix the addresses first.")
        return lines, False
    try:
        result = subprocess.run([sys.executable, "-m", "tf_psx.cluster.preflight", "--probe"], input=tf_config,
                                capture_output=True, text=True, timeout=probe_timeout_s, check=False)
    except subprocess.TimeoutExpired:
        lines.append(f"FAIL TensorFlow could not connect to every task and read its clock within {probe_timeout_s:g} s "
                     "(a task that is not a TF server, or a firewall between the tasks).")
        return lines, False
    found = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    if result.returncode != 0 or not found:
        lines.append(f"FAIL the TensorFlow probe failed (exit {result.returncode}): "
                     + (result.stderr.strip().splitlines() or ["no output"])[-1])
        return lines, False
    probe = json.loads(found[-1][len("PROBE "):])
    mine = probe["here"]
    lines.append(f"Clocks and versions (this host: {_versions_text(mine)}):")
    for task, info in probe["tasks"].items():
        skew_ok = abs(info["skew_ms"]) <= MAX_CLOCK_SKEW_MS
        versions = info["versions"]
        same = versions is not None and all(versions.get(k) == mine.get(k) for k in mine)
        ok &= skew_ok and same
        lines.append(f"  {'ok  ' if skew_ok else 'FAIL'} {task} clock {info['skew_ms']:+.1f} ms "
                     f"(+-{info['rtt_ms'] / 2:.1f} ms)" + ("" if skew_ok else f": more than {MAX_CLOCK_SKEW_MS:g} ms "
                                                           "off this host; sync the clocks (NTP)"))
        if versions is None:
            lines.append(f"  FAIL {task} versions unknown: not a tf_psx.server task (start it with "
                         "python -m tf_psx.server)")
        elif not same:
            differ = {k: (versions.get(k), mine.get(k)) for k in mine if versions.get(k) != mine.get(k)}
            lines.append(f"  FAIL {task} versions differ (task, here): {differ}; install the same on every task")
        else:
            lines.append(f"  ok   {task} versions equal this host's")
    return lines, ok


def _versions_text(versions: dict) -> str:
    return ", ".join(f"{name} {value}" for name, value in versions.items())


def _probe() -> int:
    """The child of `check_cluster`: connects as the chief, reads each task's clock and info file."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tf_psx import trail  # pylint: disable=import-outside-toplevel
    from tf_psx._tf import runtime as _runtime  # pylint: disable=import-outside-toplevel
    from tf_psx.cluster import ClusterConfig  # pylint: disable=import-outside-toplevel

    config = ClusterConfig.from_tf_config(sys.stdin.read())
    _runtime.set_grpc_fail_fast()
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    spec = config.cluster_spec()
    job = "chief" if config.chief else "tf_psx_doctor"
    tf.config.experimental_connect_to_cluster(spec, job_name=job, task_index=0)
    here = {k: v for k, v in trail.package_versions().items() if k != "python"}
    tasks = {}
    for task_type, addresses in (("ps", config.ps), ("worker", config.workers)):
        for index, address in enumerate(addresses):
            device = f"/job:{task_type}/replica:0/task:{index}/device:CPU:0"
            readings = []
            for _ in range(CLOCK_READINGS):
                with tf.device(device):
                    before = time.time()
                    remote = float(tf.timestamp().numpy())
                    after = time.time()
                readings.append((after - before, remote - (before + after) / 2))
            rtt, skew = min(readings)
            with tf.device(device):
                try:
                    info = json.loads(tf.io.read_file(server_info_path(split_address(address)[1])).numpy())
                    versions = {k: v for k, v in info["versions"].items() if k in here}
                except (tf.errors.NotFoundError, ValueError, KeyError):
                    versions = None
            tasks[f"{task_type}:{index}"] = {"skew_ms": 1000 * skew, "rtt_ms": 1000 * rtt, "versions": versions}
    print("PROBE " + json.dumps({"here": here, "tasks": tasks}), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        sys.exit(_probe())
    sys.exit("usage: tf-psx doctor TF_CONFIG (python -m tf_psx.cluster.preflight --probe is its internal child)")
