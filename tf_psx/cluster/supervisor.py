"""One supervisor of task processes, used by `LocalCluster(processes=True)` and `tf-psx launch`.

A `TaskProcess` is one command (a `python -m tf_psx.server` task, or the
user's chief): it starts in its own session and process group, dies with
the process that started it (Linux PR_SET_PDEATHSIG), and its output goes
line by line through a reader thread to its log file (and, for the
launcher, to the terminal with a prefix). It is ready when it prints
`tf_psx.cluster.server.READY_MARK`. `wait_ready` bounds the wait for a set of
tasks; `stop` ends them (SIGTERM to the group, SIGKILL after a grace).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from tf_psx._tf import runtime as _runtime
from tf_psx.cluster import TF_CONFIG_ENV
from tf_psx.cluster.server import READY_MARK
from tf_psx.errors import TaskFailedError

# SIGTERM first so that a task can exit on its own; SIGKILL after this.
STOP_GRACE_S = 5.0
# A task process imports TensorFlow (about 3 s on 2 cores, 10 to 20 s on a
# machine loaded by a parallel test run) before it listens; past this a task
# that cannot come up is reported instead of waited on.
START_TIMEOUT_S = 60.0
# How often a wait looks at its tasks.
POLL_S = 0.1
# prctl(2) option: the kernel sends the given signal to a child when the
# thread that forked it exits.
_PR_SET_PDEATHSIG = 1
# Lines of a task's log quoted in an error.
LOG_TAIL_LINES = 20
# Longest wait for the spawner thread to fork and exec a task (it takes
# milliseconds; past this the spawner is reported as stuck).
SPAWN_TIMEOUT_S = 60.0


def server_env(base: Mapping[str, str], tf_config_json: str) -> dict[str, str]:
    """The environment of a `python -m tf_psx.server` task: its TF_CONFIG, quiet TF, no GPU."""
    env = dict(base)
    env[TF_CONFIG_ENV] = tf_config_json
    env[_runtime.GRPC_FAIL_FAST_ENV] = _runtime.GRPC_FAIL_FAST_VALUE
    # Lines must reach the reader as they are printed, not when a buffer fills.
    env["PYTHONUNBUFFERED"] = "1"
    # Keep the servers' TF quiet and on the CPU; the chief owns any GPU.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


class _Spawner:
    """Forks every task process from one thread that lives as long as this process.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits,
    not the process (prctl(2)). A task restarted from a short-lived thread
    (a thread that restarts killed workers, a launcher's helper) was
    SIGKILLed the moment that thread returned: measured, both workers of a
    2-worker fit died together after the last restart from such a thread,
    and the coordinator waited for them without end. Forking from one
    daemon thread ties every task to the life of this process, as meant.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while True:
            job, future = self._jobs.get()
            try:
                future.set_result(job())
            except BaseException as error:  # pylint: disable=broad-except  (raised in the caller)
                future.set_exception(error)

    def call(self, job: Callable[[], subprocess.Popen], what: str, timeout_s: float = SPAWN_TIMEOUT_S):
        """Runs `job` (a fork and exec) on the spawner thread and returns its result (bounded)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="tf_psx-spawner", daemon=True)
                self._thread.start()
        self._jobs.put((job, future))
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise TaskFailedError(f"tf_psx: starting the process of {what} took over {timeout_s:g} s on the spawner "
                                  "thread (a fork and exec takes milliseconds); the machine may be out of processes "
                                  "or memory.") from None


_SPAWNER = _Spawner()


def _die_with_parent(parent: int, orphan_exit: int) -> None:
    """Runs in the forked child before exec: own session; SIGKILL when `parent` dies (Linux)."""
    os.setsid()  # its own process group: stopped as a whole, and shielded from the terminal's Ctrl-C
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: tasks outlive a killed parent
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(orphan_exit)  # pylint: disable=protected-access


class TaskProcess:
    """One supervised task process.

    Args:
      task_type: "ps", "worker", "chief" or "evaluator".
      index: the task index.
      argv: the command.
      env: its environment.
      log_path: the log file (appended to; each restart is marked).
      echo: called with (task, line) for every output line, e.g. to print it.
      orphan_exit: the exit status of a child whose parent died before it ran.
    """

    def __init__(self, task_type: str, index: int, argv: Sequence[str], env: dict[str, str], log_path: str,
                 echo: Callable[["TaskProcess", str], None] | None = None, orphan_exit: int = 1):
        self.task_type = task_type
        self.index = index
        self.argv = list(argv)
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.starts = 0
        self._echo = echo
        self._orphan_exit = orphan_exit
        self._reader: threading.Thread | None = None

    @property
    def name(self) -> str:
        return f"{self.task_type}:{self.index}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, banner: str = "") -> None:
        """Starts (or restarts) the command.

        Raises:
          OSError: the command cannot be run (not found, not executable).
        """
        if self._reader is not None:
            self._reader.join(timeout=STOP_GRACE_S)
        self.ready.clear()
        self.starts += 1
        log = open(self.log_path, "ab")  # pylint: disable=consider-using-with
        if self.starts > 1:
            log.write(f"--- {banner + ': ' if banner else ''}start {self.starts} of {self.name} ---\n".encode())
            log.flush()
        popen = functools.partial(
            subprocess.Popen,
            self.argv,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=functools.partial(_die_with_parent, os.getpid(), self._orphan_exit),  # pylint: disable=subprocess-popen-preexec-fn
        )
        try:
            # From the spawner thread, never the caller's: PR_SET_PDEATHSIG follows the forking thread.
            self.proc = _SPAWNER.call(popen, self.name)
        except (OSError, TaskFailedError):
            log.close()
            raise
        self._reader = threading.Thread(
            target=self._pump, args=(self.proc.stdout, log), name=f"tf-psx-{self.name}", daemon=True
        )
        self._reader.start()

    def _pump(self, stream, log) -> None:
        mark = READY_MARK.encode()
        try:
            for line in iter(stream.readline, b""):
                log.write(line)
                log.flush()
                if mark in line:
                    self.ready.set()
                if self._echo is not None:
                    self._echo(self, line.decode("utf-8", errors="replace").rstrip("\n"))
        finally:
            stream.close()
            log.close()

    def signal(self, signum: int) -> None:
        """Sends `signum` to the task's process group."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass
        except PermissionError:
            self.proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL to the task's process group; waits until it is gone."""
        if self.alive():
            self.signal(signal.SIGKILL)
            self.proc.wait()

    def join_reader(self) -> None:
        """Waits (bounded) until the task's output has all reached its log."""
        if self._reader is not None:
            self._reader.join(timeout=STOP_GRACE_S)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the task's log."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as handle:
                return "".join(handle.readlines()[-lines:])
        except OSError:
            return "(no log)"


def wait_ready(tasks: Sequence[TaskProcess], timeout_s: float,
               interrupted: Callable[[], bool] = lambda: False) -> tuple[TaskProcess, str] | None:
    """Waits until every task printed READY_MARK.

    Returns:
      None when all are ready (or `interrupted()` became true), else the
      first task that failed and what happened to it.
    """
    deadline = time.monotonic() + timeout_s
    pending = list(tasks)
    while pending and not interrupted():
        for task in list(pending):
            if task.ready.is_set():
                pending.remove(task)
            elif not task.alive():
                return task, "exited while starting"
        if pending and time.monotonic() > deadline:
            return pending[0], f"did not listen within {timeout_s:.0f} s"
        time.sleep(POLL_S)
    return None


def stop(tasks: Sequence[TaskProcess], first_signal: int | None = signal.SIGTERM,
         grace_s: float = STOP_GRACE_S) -> None:
    """Signals each task's process group, then SIGKILLs what is left after the grace."""
    running = [task for task in tasks if task.alive()]
    if first_signal is not None:
        for task in running:
            task.signal(first_signal)
    deadline = time.monotonic() + grace_s
    for task in running:
        try:
            task.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            task.signal(signal.SIGKILL)
            task.proc.wait()
    for task in tasks:
        if task.proc is not None:
            # The group may hold children of the command; none may outlive it.
            task.signal(signal.SIGKILL)
            task.proc.wait()
        task.join_reader()
