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
    with tf_psx.training.stalls.StallWatch(coordinator, timeout_s=300, cluster=cluster) as watch:
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

from tf_psx.errors import ArgumentError

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
        raise ArgumentError(f"Argument `timeout_s` of {owner} must be a number > 0. Received: {timeout_s!r}. "
                            "Fix: pass e.g. timeout_s=300 (longer than your slowest step, first trace included).")
    return float(timeout_s)
