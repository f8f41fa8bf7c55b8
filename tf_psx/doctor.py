"""The stall doctor: says why a parameter-server job stopped making progress.

A stalled job and a slow one look the same from outside. `StallWatch`
follows the coordinator's closures (the steps `fit` or a custom loop
scheduled) and, when none has finished for `timeout_s` while some are
pending, logs one report:

* the closure table: which worker runs which closure, since when, and on
  which attempt (a closure re-run after a worker failure counts up);
* the state of each task process it knows the pid of (`LocalCluster` task
  processes, or the tasks of `tf-psx launch`): a worker stopped by SIGSTOP,
  a zombie, or a task that is gone stands out;
* each such running task is sent SIGUSR1, on which `tf_psx.server` dumps the
  Python stacks of all its threads into its own log (`faulthandler`);
* the Python stacks of every thread of this (the coordinator's) process.

One report per stall: the next comes only after some closure finished again.
`tf_psx.callbacks.StallDoctor` runs a watch during `fit`.

Example (a custom loop; the watch is a context manager):

    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with tf_psx.doctor.StallWatch(coordinator, timeout_s=300, cluster=cluster) as watch:
        for _ in range(steps):
            coordinator.schedule(step_fn, args=(iterator,))
        coordinator.join()
    print(watch.reports)

Known limitations:
  * A stopped (SIGSTOP) or hung task cannot run its signal handler: its
    stacks come when it runs again. The report names its state instead.
  * Only tasks on this host are signalled: `tf-psx launch` jobs and
    `LocalCluster(processes=True)`. Tasks on other hosts show in the
    closure table only.
  * It watches and reports; it does not move a closure off a frozen worker
    (TF's worker thread is blocked inside the remote call and cannot be
    interrupted from Python).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

logger = logging.getLogger("tf_psx")

# The launcher writes {task: pid} of its tasks here (and rewrites it on each
# restart), and passes the path to the chief in this variable.
PIDS_FILE_ENV = "TF_PSX_TASK_PIDS_FILE"
# tf_psx.server dumps its threads' stacks into its log on this signal.
STACKS_SIGNAL = signal.SIGUSR1
# A stall is noticed within this share of the timeout (and at most this many seconds late).
_POLL_SHARE, _MAX_POLL_S = 0.25, 1.0
# Joining the watch thread on stop.
_JOIN_TIMEOUT_S = 5.0


def pids_from_file(path: str | None = None) -> dict[str, int]:
    """{task: pid} from the launcher's pids file (`$TF_PSX_TASK_PIDS_FILE`); {} when there is none."""
    path = path or os.environ.get(PIDS_FILE_ENV)
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            return {str(task): int(pid) for task, pid in json.load(handle).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _cluster_pids(cluster) -> dict[str, int]:
    """The running task processes of a `LocalCluster(processes=True)`, or {}."""
    if cluster is None or not getattr(cluster, "processes", False):
        return {}
    return {task: pid for task, pid in cluster.task_pids().items() if pid is not None}


def task_states(pids: dict[str, int]) -> dict[str, str]:
    """{task: psutil state ("running", "sleeping", "stopped", "zombie", ...) or "gone"}."""
    import psutil  # pylint: disable=import-outside-toplevel

    states = {}
    for task, pid in sorted(pids.items()):
        try:
            states[task] = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            states[task] = "gone"
    return states


def python_stacks() -> str:
    """The Python stack of every thread of this process (faulthandler's format, innermost call first)."""
    import faulthandler  # pylint: disable=import-outside-toplevel
    import tempfile  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryFile("w+") as handle:
        faulthandler.dump_traceback(handle, all_threads=True)
        handle.seek(0)
        return handle.read()


class StallWatch:
    """Watches a `ClusterCoordinator` and reports when no closure finishes for `timeout_s`.

    Args:
      coordinator: the `ClusterCoordinator` (for `fit`:
        `tf_psx._tf.runtime.coordinator_of(strategy)`; the callback does it).
      timeout_s: number > 0, seconds without a finished closure, while
        closures are pending, that make a stall.
      cluster: a `tf_psx.LocalCluster(processes=True)` whose task processes
        are signalled and described; optional.
      pids: a function returning more {task: pid}; by default the launcher's
        pids file when the chief runs under `tf-psx launch`.
      signal_tasks: send `STACKS_SIGNAL` to the running tasks so that
        `tf_psx.server` dumps their stacks into their logs.

    Attributes:
      reports: the text of every report so far.

    Raises:
      ValueError: a bad `timeout_s`.
    """

    def __init__(self, coordinator, timeout_s: float, cluster=None, pids: Callable[[], dict[str, int]] | None = None,
                 signal_tasks: bool = True):
        from tf_psx._tf import runtime as _runtime  # pylint: disable=import-outside-toplevel

        self.coordinator = coordinator
        self.timeout_s = check_timeout(timeout_s, "StallWatch")
        self.cluster = cluster
        self._pids = pids or pids_from_file
        self.signal_tasks = bool(signal_tasks)
        self.table = _runtime.closure_table(coordinator)
        self.reports: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported_at: int | None = None  # table.finished when the last report was made
        self._idle_at = time.monotonic()  # the last check that found nothing pending

    def start(self) -> "StallWatch":
        self._idle_at = time.monotonic()  # a new watch does not inherit an old silence
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tf_psx.StallWatch")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT_S)
        self._thread = None

    def __enter__(self) -> "StallWatch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        poll = min(self.timeout_s * _POLL_SHARE, _MAX_POLL_S)
        while not self._stop.wait(poll):
            try:
                self.check()
            except Exception:  # pylint: disable=broad-except  (the watch must outlive one failed look)
                logger.exception("tf_psx stall doctor: a check failed; it keeps watching")

    def check(self) -> str | None:
        """Reports if the coordinator is stalled now (and was not reported yet); returns the report."""
        inflight, queued = self.table.pending(self.coordinator)
        now = time.monotonic()
        if not (inflight or queued):
            # Nothing to wait for is no stall (e.g. the coordinator tracing the first step):
            # the silence that counts starts once something is pending.
            self._idle_at = now
            return None
        with self.table.lock:
            silent_s = now - max(self.table.last_progress, self._idle_at)
            finished = self.table.finished
        if silent_s < self.timeout_s or self._reported_at == finished:
            return None
        self._reported_at = finished
        report = self.report(silent_s, inflight, queued)
        self.reports.append(report)
        logger.error("%s", report)
        return report

    def report(self, silent_s: float, inflight: int, queued: int) -> str:
        """The report's text (see the module docstring)."""
        now_wall, now = time.time(), time.monotonic()
        lines = [f"tf_psx stall doctor: no step finished for {silent_s:.1f} s (timeout {self.timeout_s:g} s); "
                 f"{inflight} closure(s) in flight, {queued} queued.", "Closures by worker:"]
        with self.table.lock:
            running = dict(self.table.running)
        for index in range(self.table.num_workers):
            if index in running:
                name, started_wall, started, attempt = running[index]
                lines.append(f"  worker:{index}  runs {name}  since {time.strftime('%H:%M:%S', time.localtime(started_wall))} "
                             f"({now - started:.1f} s)  attempt {attempt}")
            else:
                lines.append(f"  worker:{index}  idle")
        pids = {**_cluster_pids(self.cluster), **self._pids()}
        if pids:
            lines.append("Task processes:")
            states = task_states(pids)
            for task, state in states.items():
                note = {"stopped": "  <- stopped (SIGSTOP?): it holds its closure and answers nothing",
                        "zombie": "  <- exited, not reaped", "gone": "  <- no such process"}.get(state, "")
                lines.append(f"  {task}  pid {pids[task]}  {state}{note}")
                # Only tf_psx.server tasks dump stacks on SIGUSR1: the chief (the user's
                # script) and the evaluator would die of it.
                is_server = task.split(":")[0] in ("ps", "worker") and pids[task] != os.getpid()
                if self.signal_tasks and is_server and state not in ("stopped", "zombie", "gone"):
                    try:
                        os.kill(pids[task], STACKS_SIGNAL)
                    except OSError:
                        continue
            if self.signal_tasks:
                lines.append(f"  (the running ps and worker tasks were sent {STACKS_SIGNAL.name}: tf_psx.server "
                             "writes its threads' stacks into its log)")
        else:
            lines.append("Task processes: unknown here (pass cluster=, or run under tf-psx launch).")
        lines.append(f"Stacks of this process (the coordinator), at {time.strftime('%H:%M:%S', time.localtime(now_wall))}:")
        lines.append(python_stacks())
        return "\n".join(lines)


def check_timeout(timeout_s, owner: str) -> float:
    """`timeout_s` as a float when it is a number > 0; ValueError naming `owner` otherwise."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"Argument `timeout_s` of {owner} must be a number > 0. Received: {timeout_s!r}. "
                         "Fix: pass e.g. timeout_s=300 (longer than your slowest step, first trace included).")
    return float(timeout_s)



# ----------------------------------------------------------------------------
# `tf-psx doctor TF_CONFIG`: the cluster before a run.

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
_LOOPBACK_PREFIXES = ("127.", "localhost", "::1", "[::1]")


def server_info_path(port: int) -> str:
    """Where `tf_psx.server` listening on `port` writes its versions (on its own host)."""
    return os.path.join(SERVER_INFO_DIR, f"tf_psx_server_{port}.json")


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def _reachable(address: str) -> tuple[bool, str]:
    import socket  # pylint: disable=import-outside-toplevel

    start = time.monotonic()
    try:
        with socket.create_connection((_host(address), _port(address)), timeout=CONNECT_TIMEOUT_S):
            return True, f"{1000 * (time.monotonic() - start):.1f} ms to connect"
    except OSError as err:
        return False, f"unreachable: {err.strerror or err}"


def _port_free_here(address: str) -> bool:
    import socket  # pylint: disable=import-outside-toplevel

    with socket.socket() as probe:
        try:
            probe.bind(("", _port(address)))
            return True
        except OSError:
            return False


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
        free = _port_free_here(config.chief)
        ok &= free
        lines.append(f"  {'ok  ' if free else 'FAIL'} chief {config.chief}: port {_port(config.chief)} "
                     + ("is free here" if free else "is in use here: the chief cannot bind it (pick another port, "
                                                    "or stop what listens there)"))
    exposed = [a for a in (*config.ps, *config.workers, *([config.chief] if config.chief else []))
               if not _host(a).startswith(_LOOPBACK_PREFIXES)]
    if exposed:
        lines.append(f"  warning: {len(exposed)} task(s) listen beyond loopback ({', '.join(exposed[:4])}"
                     f"{', ...' if len(exposed) > 4 else ''}); TF's gRPC has no authentication, so keep them on a "
                     "trusted network (docs/security.md)")
    if not ok:
        lines.append("TensorFlow checks (clocks, versions): skipped, fix the addresses first.")
        return lines, False
    try:
        result = subprocess.run([sys.executable, "-m", "tf_psx.doctor", "--probe"], input=tf_config,
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
                    info = json.loads(tf.io.read_file(server_info_path(_port(address))).numpy())
                    versions = {k: v for k, v in info["versions"].items() if k in here}
                except (tf.errors.NotFoundError, ValueError, KeyError):
                    versions = None
            tasks[f"{task_type}:{index}"] = {"skew_ms": 1000 * skew, "rtt_ms": 1000 * rtt, "versions": versions}
    print("PROBE " + json.dumps({"here": here, "tasks": tasks}), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        sys.exit(_probe())
    sys.exit("usage: tf-psx doctor TF_CONFIG (python -m tf_psx.doctor --probe is its internal child)")
