"""The supervisor behind `tf-psx launch`: a whole parameter-server job on this machine.

`Launcher` starts every ps and worker task (`python -m tf_psx.server`, each
with its own TF_CONFIG, on free loopback ports), waits until they listen, and
then runs your training command as the chief, with the chief's TF_CONFIG and
GRPC_FAIL_FAST=use_caller. While the job runs it:

* streams every task's output with a prefix (`[ps:0]`, `[worker:1]`,
  `[chief:0]`) and keeps it in one log file per task (`<log_dir>/ps-0.log`);
* restarts a worker that dies, on its old port: `ClusterCoordinator` re-runs
  the lost worker's steps on the other workers and uses the worker again once
  it is back;
* restarts the ps tasks and then the chief when a ps dies: in TF 2.16 a ps
  failure is fatal to the coordinator, so the chief starts over and resumes
  from the newest `tf_psx.callbacks.PeriodicSync` snapshot;
* gives up after `max_restarts` restarts in all, naming the task that failed,
  its exit status and its log file;
* stops every task (SIGTERM to each task's process group, SIGKILL after a
  grace period) on Ctrl-C or SIGTERM, or when the chief exits. The exit
  status is the chief's.

The contract with the training command:
  * It runs as the chief: it reads the cluster from TF_CONFIG
    (`tf_psx.ParameterServerStrategy()` with no argument does) and must not
    start servers itself.
  * `TF_PSX_SNAPSHOT_DIR` holds the snapshot directory (`--snapshot-dir`,
    `<log_dir>/snapshots` by default). Give it to `PeriodicSync` so that a
    restarted chief resumes where the last snapshot left off; a command that
    keeps no snapshots starts from step 0 after a ps failure.
  * `TF_PSX_CHIEF_ATTEMPT` is 0 for the first chief and counts the restarts.
  * With `evaluator=True` the same command also runs as the side-car
    evaluator, with TF_CONFIG task `evaluator:0` and a cluster that holds only
    the evaluator job (`ClusterConfig` keeps it out of the training cluster,
    tensorflow#46169). The command checks `task_type()` and, for the
    evaluator, builds the model and its holdout data and calls
    `run_sidecar_evaluator(model, data)`, which runs tf-keras'
    `SidecarEvaluator` on the snapshot directory. Once the chief has finished
    the launcher writes `<snapshot_dir>/TRAINING_DONE`; the evaluator stops
    after it has evaluated the newest snapshot, or is stopped
    `EVALUATOR_FINISH_TIMEOUT_S` later.

Security: TensorFlow's gRPC servers have no authentication and listen on
every interface, even when TF_CONFIG says 127.0.0.1 (docs/security.md). The
launcher says so in a one-line warning, unless `isolate=True`: then the whole
job runs in a private network namespace whose only interface is its own
loopback, and nothing outside the job can reach its ports.

Known limitations:
  * A chief that fails by itself (not because a ps died) is not restarted:
    the launcher stops the job and exits with the chief's status. Launch again
    with the same `--snapshot-dir` to resume from the newest snapshot.
  * A step that a killed worker had already applied to the ps when it died is
    run again on another worker (TF retries closures at least once, not
    exactly once), so `optimizer.iterations` can exceed the steps of `fit` by
    at most the number of worker failures.
  * `isolate=True` needs Linux and either root or unprivileged user
    namespaces; the job cannot then reach the network (data must be local).
  * The evaluator is not restarted when it fails; its log says why, and
    training goes on.
  * All tasks run on this machine. For several machines use TF_CONFIG
    (`tf-psx config`) or Kubernetes (`tf-psx k8s`).

Example (the CLI; see docs/guides/fault_tolerance.md):

    tf-psx launch --workers 2 --ps 1 --max-restarts 3 -- python train.py

Example (the API, here with a command that only prints its task):

>>> import sys
>>> code = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
...         "print(c['task'], sorted(c['cluster']))")
>>> Launcher([sys.executable, "-c", code], workers=1, ps=1, out=sys.stdout,
...          err=sys.stdout).run()  # doctest: +ELLIPSIS
tf-psx launch: warning: ...
...
[chief:0] {'type': 'chief', 'index': 0} ['chief', 'ps', 'worker']
tf-psx launch: chief:0 finished with exit status 0; logs in ...
0
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

from tf_psx import _quiet
from tf_psx import _checks, metrics as _metrics, stalls as _stalls
from tf_psx.cluster import server as _server, supervisor as _supervisor
from tf_psx._tf import keras as _tf_keras, runtime as _runtime
from tf_psx.cluster import TF_CONFIG_ENV, ClusterConfig
from tf_psx.errors import LaunchError
from tf_psx.cluster.local import LOOPBACK, TASK_START_TIMEOUT_S, free_ports

__all__ = [
    "CHIEF_ATTEMPT_ENV",
    "LaunchError",
    "Launcher",
    "SNAPSHOT_DIR_ENV",
    "TRAINING_DONE_FILE",
    "request_scale",
    "run_sidecar_evaluator",
    "snapshot_dir",
    "task_type",
]

PREFIX = "tf-psx launch"

# Environment variables the launcher hands the chief and the evaluator.
SNAPSHOT_DIR_ENV = "TF_PSX_SNAPSHOT_DIR"
CHIEF_ATTEMPT_ENV = "TF_PSX_CHIEF_ATTEMPT"
# Set in the re-executed launcher that already runs in its private namespace.
_ISOLATED_ENV = "TF_PSX_LAUNCH_ISOLATED"
# Written into the snapshot directory once the chief has exited with status 0.
TRAINING_DONE_FILE = "TRAINING_DONE"
# {task: pid} of every task, in LOG_DIR, for the stall doctor in the chief (tf_psx.doctor).
PIDS_FILE = "task_pids.json"
# The running launcher's pid, in LOG_DIR, and the request `tf-psx scale` leaves there.
LAUNCHER_FILE = "launcher.json"
SCALE_FILE = "scale.json"
# The most workers a rescale may ask for (each takes a loopback port and a process).
MAX_WORKERS = 256

# A task restart or two (a preempted worker, an OOM-killed ps) is routine;
# a task that keeps dying is a bug, and giving up after 3 shows its log within
# a minute instead of crash-looping.
DEFAULT_MAX_RESTARTS = 3
# How often the supervisor looks at its tasks: a dead worker is restarted
# within this, which is short next to the ~3 s a task needs to import TF.
POLL_S = 0.1
# SIGTERM first so that a task can exit on its own; SIGKILL after this.
STOP_GRACE_S = _supervisor.STOP_GRACE_S
# A chief that exits with an error is usually reacting to a dead ps; the ps'
# death (SIGKILL is immediate, a lost pipe takes a poll or two) is looked for
# this long before the chief's error is taken as its own.
PS_FAILURE_GRACE_S = 2.0
# After the chief has finished, the evaluator may still be evaluating the last
# snapshot: a tiny model's evaluation takes seconds, a big one is stopped.
EVALUATOR_FINISH_TIMEOUT_S = 60.0
# How often the evaluator looks for a new snapshot and for TRAINING_DONE:
# it bounds how late a snapshot is evaluated, at the cost of a directory listing.
EVALUATOR_POLL_S = 1.0
# How long a named snapshot may wait for SidecarEvaluator to start on it
# before the next one is named: restoring a big model takes seconds, a
# snapshot pruned before it was read is never evaluated.
EVALUATOR_UNCONSUMED_S = 60.0
# Shells report death by signal N as exit status 128 + N; so does the launcher.
SIGNAL_EXIT_BASE = 128
# The exit status when the launcher gives up on a task or cannot start one.
EXIT_GAVE_UP = 1
EXIT_USAGE = 2

SERVER_TYPES = ("ps", "worker")
# The Linux clone flags and ioctls used by isolate=True (linux/sched.h, sockios.h).
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH22x"  # struct ifreq: the name, then the flags, padded to 40 bytes.


# --- helpers for the training command ----------------------------------------


def task_type() -> str | None:
    """The task type of this process from TF_CONFIG ("chief", "evaluator", ...), or None.

    Example:

    >>> import os
    >>> os.environ.pop("TF_CONFIG", None) and None
    >>> print(task_type())
    None
    """
    raw = os.environ.get(TF_CONFIG_ENV, "")
    if not raw:
        return None
    return ClusterConfig.from_tf_config(raw).task_type


def snapshot_dir(default: str | None = None) -> str | None:
    """The snapshot directory the launcher chose (`$TF_PSX_SNAPSHOT_DIR`), else `default`.

    Example:

    >>> snapshot_dir("/tmp/snaps") if SNAPSHOT_DIR_ENV not in os.environ else "/tmp/snaps"
    '/tmp/snaps'
    """
    return os.environ.get(SNAPSHOT_DIR_ENV) or default


def run_sidecar_evaluator(model, data, steps: int | None = None, directory: str | None = None, callbacks=None) -> int:
    """Evaluates every new PeriodicSync snapshot with tf-keras' `SidecarEvaluator` until training is done.

    Call it in the evaluator branch of a training command (see the module
    docstring): build and compile the model as the chief does, but with no
    strategy, then call this. It returns once the launcher has written
    TRAINING_DONE and the newest snapshot has been evaluated.

    `SidecarEvaluator` follows a directory's `checkpoint` state file, which
    PeriodicSync does not write (each snapshot is a `snapshot-<step>/`
    directory, committed by a rename). A thread of this function therefore
    keeps a private directory whose state file names the newest complete
    snapshot, and `SidecarEvaluator` follows that.

    Args:
      model: a compiled tf-keras model with the chief's architecture.
      data: the holdout data for `model.evaluate` (a `tf.data.Dataset`).
      steps: evaluation steps per snapshot; None evaluates all of `data`.
      directory: the PeriodicSync directory; `$TF_PSX_SNAPSHOT_DIR` when None.
      callbacks: extra callbacks for `model.evaluate`.

    Returns:
      The number of distinct snapshots evaluated.

    Raises:
      LaunchError: if no snapshot directory is given or set.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tf_psx.callbacks import PeriodicSync  # pylint: disable=import-outside-toplevel

    keras = _tf_keras.keras()
    directory = directory or snapshot_dir()
    if not directory:
        raise LaunchError(
            f"run_sidecar_evaluator needs the snapshot directory; received directory=None and "
            f"${SNAPSHOT_DIR_ENV} is unset. Fix: run it under `tf-psx launch --evaluator`, or pass "
            "directory=<the PeriodicSync directory>."
        )
    done = os.path.join(directory, TRAINING_DONE_FILE)
    view = tempfile.mkdtemp(prefix="tf_psx_evaluator_")
    evaluated: list[str] = []
    stop = threading.Event()
    # "consumed": SidecarEvaluator has begun evaluating the named snapshot.
    # The name only moves on after that, so that each evaluation is recorded
    # under the snapshot it really restored.
    state = {"named": None, "woken": False, "consumed": True, "since": 0.0}

    def _name(path: str) -> None:
        # The `checkpoint` file is a CheckpointState text proto; written to a
        # temporary name and renamed, so that a reader never sees half of it.
        text = f'model_checkpoint_path: {json.dumps(path)}\nall_model_checkpoint_paths: {json.dumps(path)}\n'
        tmp = os.path.join(view, "checkpoint.tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
        state.update(named=path, consumed=False, since=time.monotonic())
        os.replace(tmp, os.path.join(view, "checkpoint"))

    def _follow() -> None:
        while not stop.wait(EVALUATOR_POLL_S):
            latest = PeriodicSync.latest(directory)
            # A named snapshot that fails to restore (pruned meanwhile) is
            # never consumed; after a while the name moves on anyway.
            waiting = not state["consumed"] and time.monotonic() - state["since"] < EVALUATOR_UNCONSUMED_S
            if latest is None or waiting:
                continue
            if state["named"] is None or os.path.normpath(state["named"]) != latest.checkpoint:
                _name(latest.checkpoint)
            elif os.path.exists(done) and evaluated and evaluated[-1] == latest.checkpoint and not state["woken"]:
                # Training is over and the newest snapshot is evaluated, but
                # SidecarEvaluator waits for a new one: name the same snapshot
                # by another path ("dir/./ckpt") to wake it; the callback ends it.
                state["woken"] = True
                _name(os.path.join(os.path.dirname(latest.checkpoint), ".", os.path.basename(latest.checkpoint)))

    class _StopWhenDone(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            evaluated.append(os.path.normpath(state["named"] or ""))
            state["consumed"] = True

        def on_test_end(self, logs=None):
            print(f"tf_psx evaluator: evaluated {evaluated[-1]}: {logs}", flush=True)
            latest = PeriodicSync.latest(directory)
            if os.path.exists(done) and (latest is None or evaluated[-1] == latest.checkpoint):
                raise _TrainingDone()

    evaluator = keras.utils.SidecarEvaluator(
        model, data, checkpoint_dir=view, steps=steps, callbacks=[*(callbacks or []), _StopWhenDone()]
    )
    follower = threading.Thread(target=_follow, name="tf-psx-evaluator-follow", daemon=True)
    follower.start()
    try:
        evaluator.start()
    except _TrainingDone:
        pass
    finally:
        stop.set()
        follower.join()
        shutil.rmtree(view, ignore_errors=True)
    return len(set(evaluated))


class _TrainingDone(Exception):
    """Raised from a callback to end SidecarEvaluator's loop."""


# --- the supervisor ----------------------------------------------------------


def _describe_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"{code} (killed by {name})"
    return str(code)


def _exit_code(code: int) -> int:
    """A Popen return code as a shell exit status (death by signal N -> 128 + N)."""
    return SIGNAL_EXIT_BASE - code if code < 0 else code


def _libc():
    return ctypes.CDLL(None, use_errno=True)


class Launcher:
    """Runs a parameter-server job on this machine and keeps it running.

    See the module docstring for what it does and for the contract with the
    training command.

    Args:
      command: the chief's command, program first, e.g.
        ["python", "train.py", "--epochs", "3"].
      workers: the number of worker tasks (>= 1).
      ps: the number of parameter-server tasks (>= 1).
      evaluator: also run `command` as the side-car evaluator.
      max_restarts: the most task restarts of the whole job (>= 0); one ps
        failure (all ps and the chief restarted) counts as one.
      log_dir: where the per-task logs go; a fresh temporary directory when
        None. Created if missing.
      snapshot_dir: the `$TF_PSX_SNAPSHOT_DIR` of the chief and the evaluator;
        `<log_dir>/snapshots` when None.
      isolate: run the whole job in a private network namespace (Linux).
      metrics_port: serve Prometheus metrics of the tasks' processes (up,
        restarts, memory, CPU) and of the host (CPU, swap) on this port; the
        chief gets `metrics_port + 1` in `TF_PSX_METRICS_PORT`, where a
        `ClusterMonitor` serves the training metrics. None: no metrics. A
        port in use is reported and the job runs without metrics.
      metrics_host: the address the launcher's endpoint listens on.
      intra_op_threads: each ps and worker task's intra-op threads: an int
        >= 1, or "auto" (default): the CPUs divided among every task of the
        job (the chief and the evaluator included).
      inter_op_threads: each ps and worker task's inter-op threads, or None
        for the default (workers: at least one per worker plus one).
      out: where task output is streamed (stdout when None).
      err: where the launcher's own messages go (stderr when None).

    Raises:
      LaunchError: if an argument is invalid; the message names the option,
        the value received and the fix.
    """

    def __init__(
        self,
        command: Sequence[str],
        workers: int,
        ps: int,
        evaluator: bool = False,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        log_dir: str | None = None,
        snapshot_dir: str | None = None,  # pylint: disable=redefined-outer-name
        isolate: bool = False,
        out: TextIO | None = None,
        err: TextIO | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "0.0.0.0",
        intra_op_threads: int | str = "auto",
        inter_op_threads: int | None = None,
    ):
        if isinstance(command, str) or not isinstance(command, Sequence) or not command or not all(
            isinstance(part, str) and part for part in command
        ):
            raise LaunchError(
                "The command after `--` must be a non-empty list of non-empty strings (the chief's "
                f"command, program first); received {command!r}. Fix: end the options with --, then "
                "the command, e.g. -- python train.py."
            )
        self.command = list(command)
        program = self.command[0]
        found = os.access(program, os.X_OK) and os.path.isfile(program) if os.sep in program else shutil.which(program)
        if not found:
            raise LaunchError(
                f"The command after `--` must start with a program that can be run; received "
                f"{program!r}, which is {'not an executable file' if os.sep in program else 'not on PATH'}. "
                f"Fix: give the program by its path or install it, e.g. -- {sys.executable} train.py."
            )
        script = _python_script(self.command)
        if script is not None and not os.path.isfile(script):
            raise LaunchError(
                f"The command after `--` runs the Python script {script!r}, which does not exist (looked for in "
                f"{os.getcwd()}); no task was started. Fix: give the script's path from this directory, e.g. "
                f"-- {os.path.basename(program)} {os.path.join('examples', 'quickstart.py')}."
            )
        self.num_workers = _checks.int_at_least(workers, 1, "Option `--workers`", fix="pass e.g. --workers 2", error=LaunchError)
        self.num_ps = _checks.int_at_least(ps, 1, "Option `--ps`", fix="pass e.g. --ps 1", error=LaunchError)
        self.max_restarts = _checks.int_at_least(
            max_restarts, 0, "Option `--max-restarts`", fix=f"pass e.g. --max-restarts {DEFAULT_MAX_RESTARTS}", error=LaunchError
        )
        self.evaluator = bool(evaluator)
        self.isolate = bool(isolate)
        if metrics_port is not None and not (_checks.is_int_at_least(metrics_port, 1) and metrics_port < 65535):
            raise LaunchError(
                f"Option `--metrics-port` must be an int in 1..65534 (the chief serves on the next port). "
                f"Received: {metrics_port!r}. Fix: pass e.g. --metrics-port 9400."
            )
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        if intra_op_threads != "auto":
            _checks.int_at_least(intra_op_threads, 1, "Option `--intra-op-threads`", error=LaunchError,
                                 fix="pass e.g. --intra-op-threads 2, or auto")
        if inter_op_threads is not None:
            _checks.int_at_least(inter_op_threads, 1, "Option `--inter-op-threads`", error=LaunchError,
                                 fix="pass e.g. --inter-op-threads 4")
        self._intra_auto = intra_op_threads == "auto"
        self.intra_op_threads = self._auto_threads() if self._intra_auto else int(intra_op_threads)
        self.inter_op_threads = inter_op_threads
        self.metrics_server = None
        self._starts: dict[str, int] = {}
        if self.isolate and not sys.platform.startswith("linux"):
            raise LaunchError(
                f"Option `--isolate` needs Linux network namespaces; this is {sys.platform}. Fix: "
                "drop --isolate and keep the machine on a trusted network (docs/security.md)."
            )
        self.log_dir = self._prepare_dir("log-dir", log_dir) if log_dir else None
        self.snapshot_dir = self._prepare_dir("snapshot-dir", snapshot_dir) if snapshot_dir else None
        self._out = out
        self._err = err
        self._lock = threading.Lock()
        self._signal: int | None = None
        self._tasks: dict[tuple[str, int], _supervisor.TaskProcess] = {}
        self.restarts = 0
        self.config: ClusterConfig | None = None

    @staticmethod
    def _prepare_dir(option: str, path: Any) -> str:
        if not isinstance(path, str):
            raise LaunchError(f"Option `--{option}` must be a directory path; received {path!r}.")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as err:
            raise LaunchError(
                f'Option `--{option}` "{path}" cannot be created ({err.strerror}). Fix: pass a '
                "directory you can write, or leave the option out."
            ) from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise LaunchError(
                f'Option `--{option}` "{path}" is not writable. Fix: pass a directory you can write.'
            )
        return os.path.abspath(path)

    # -- output ------------------------------------------------------------

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    def _say(self, message: str) -> None:
        with self._lock:
            self.err.write(f"{PREFIX}: {message}\n")
            self.err.flush()

    # -- public ------------------------------------------------------------

    def run(self) -> int:
        """Runs the job until the chief exits; returns the chief's exit status.

        Returns:
          The chief's exit status (128 + N when it died of signal N), or
          EXIT_GAVE_UP (1) when a task failed more than `max_restarts` times
          or could not be started.
        """
        if self.isolate and os.environ.get(_ISOLATED_ENV) != "1":
            return self._run_isolated()
        if os.environ.get(_ISOLATED_ENV) == "1":
            _bring_up_loopback()
        handlers = self._install_signal_handlers()
        try:
            return self._supervise()
        finally:
            self._stop_all()
            for signum, handler in handlers.items():
                signal.signal(signum, handler)

    # -- isolation ---------------------------------------------------------

    def _cli_args(self) -> list[str]:
        args = ["launch", "--workers", str(self.num_workers), "--ps", str(self.num_ps)]
        args += ["--max-restarts", str(self.max_restarts)]
        if self.evaluator:
            args.append("--evaluator")
        if self.log_dir:
            args += ["--log-dir", self.log_dir]
        if self.snapshot_dir:
            args += ["--snapshot-dir", self.snapshot_dir]
        if self.metrics_port is not None:
            args += ["--metrics-port", str(self.metrics_port)]
        args += ["--intra-op-threads", str(self.intra_op_threads)]
        if self.inter_op_threads is not None:
            args += ["--inter-op-threads", str(self.inter_op_threads)]
        return [*args, "--", *self.command]

    def _run_isolated(self) -> int:
        """Runs this launcher again, in a new network namespace, and waits for it."""
        env = dict(os.environ)
        env[_ISOLATED_ENV] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        libc = _libc()
        uid, gid = os.getuid(), os.getgid()

        def _enter_namespace():  # runs in the child, before exec
            if libc.unshare(_CLONE_NEWNET) == 0:
                return
            if ctypes.get_errno() != errno.EPERM:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
            # Not root: a user namespace gives the child CAP_NET_ADMIN over a
            # network namespace of its own, as `unshare --net --map-root-user` does.
            if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER | CLONE_NEWNET) failed")
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w", encoding="ascii") as handle:
                    handle.write(text)

        try:
            proc = subprocess.Popen(  # pylint: disable=consider-using-with
                [sys.executable, "-m", "tf_psx.cli", *self._cli_args()],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=_enter_namespace,  # pylint: disable=subprocess-popen-preexec-fn
            )
        except (OSError, subprocess.SubprocessError) as err:
            raise LaunchError(
                f"Option `--isolate` could not create a private network namespace ({err}). Fix: run "
                "as root, enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), "
                "or drop --isolate and keep the machine on a trusted network (docs/security.md)."
            ) from None
        copiers = [
            threading.Thread(target=_copy_lines, args=(proc.stdout, lambda: self.out, self._lock), daemon=True),
            threading.Thread(target=_copy_lines, args=(proc.stderr, lambda: self.err, self._lock), daemon=True),
        ]
        for copier in copiers:
            copier.start()
        handlers = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                handlers[signum] = signal.signal(signum, lambda s, f: proc.send_signal(s))
            except ValueError:  # not the main thread
                pass
        try:
            code = proc.wait()
            for copier in copiers:
                copier.join()
            return _exit_code(code)
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)

    # -- supervision -------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, Any]:
        def _on_signal(signum, frame):  # pylint: disable=unused-argument
            self._signal = signum

        handlers = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                handlers[signum] = signal.signal(signum, _on_signal)
            except ValueError:  # signals can only be caught in the main thread
                pass
        return handlers

    def _build_tasks(self) -> None:
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="tf_psx_launch_")
        if self.snapshot_dir is None:
            self.snapshot_dir = os.path.join(self.log_dir, "snapshots")
            os.makedirs(self.snapshot_dir, exist_ok=True)
        done = os.path.join(self.snapshot_dir, TRAINING_DONE_FILE)
        if os.path.exists(done):
            os.remove(done)  # left by an earlier run that used this directory
        ports = free_ports(self.num_workers + self.num_ps + 2)
        addresses = [f"{LOOPBACK}:{port}" for port in ports]
        self.config = ClusterConfig(
            workers=addresses[: self.num_workers],
            ps=addresses[self.num_workers : self.num_workers + self.num_ps],
            chief=addresses[-2],
            # The evaluator listens nowhere; its address only names its task.
            evaluator=addresses[-1] if self.evaluator else None,
        )
        base = dict(os.environ)
        base.pop(_ISOLATED_ENV, None)
        base[_runtime.GRPC_FAIL_FAST_ENV] = _runtime.GRPC_FAIL_FAST_VALUE
        # Lines must reach the prefixer as they are printed, not when a buffer fills.
        base["PYTHONUNBUFFERED"] = "1"
        server_argv = [sys.executable, "-m", "tf_psx.server"]
        for task_type_, count in (("ps", self.num_ps), ("worker", self.num_workers)):
            for index in range(count):
                env = _supervisor.server_env(base, self.config.to_json(task_type_, index))
                env.update(_server.thread_env(self.intra_op_threads, self.inter_op_threads))
                self._add_task(task_type_, index, server_argv, env)
        user_env = dict(base, **{SNAPSHOT_DIR_ENV: self.snapshot_dir, CHIEF_ATTEMPT_ENV: "0"})
        if self.metrics_port is not None:
            user_env[_metrics.ENV_PORT] = str(self.metrics_port + 1)
        # The stall doctor in the chief finds the tasks' pids here (rewritten on every start).
        self._pids_file = os.path.join(self.log_dir, PIDS_FILE)
        user_env[_stalls.PIDS_FILE_ENV] = self._pids_file
        self._add_task("chief", 0, self.command, dict(user_env, **{TF_CONFIG_ENV: self.config.to_json("chief", 0)}))
        if self.evaluator:
            env = dict(user_env, **{TF_CONFIG_ENV: self.config.to_json("evaluator", 0)})
            env.setdefault("CUDA_VISIBLE_DEVICES", "")
            self._add_task("evaluator", 0, self.command, env)

    def _add_task(self, task_type_: str, index: int, argv: list[str], env: dict[str, str]) -> None:
        path = os.path.join(self.log_dir, f"{task_type_}-{index}.log")
        self._tasks[(task_type_, index)] = _supervisor.TaskProcess(
            task_type_, index, argv, env, path, echo=self._echo, orphan_exit=EXIT_GAVE_UP
        )

    def _servers(self, task_type_: str | None = None) -> list[_supervisor.TaskProcess]:
        return [
            task
            for task in self._tasks.values()
            if task.task_type in SERVER_TYPES and (task_type_ is None or task.task_type == task_type_)
        ]

    def _supervise(self) -> int:
        self._build_tasks()
        if os.environ.get(_ISOLATED_ENV) == "1":
            self._say("isolated: the job runs in a private network namespace; its ports are unreachable from outside")
        else:
            self._say(
                "warning: the TF gRPC ports below have no authentication and listen on every interface; "
                "whoever reaches them can run any op on this machine (use --isolate; docs/security.md)"
            )
        self._say(f"cluster: {self._address_list()}; logs in {self.log_dir}")
        self._serve_metrics()
        _write_json(os.path.join(self.log_dir, LAUNCHER_FILE), {"pid": os.getpid(), "workers": self.num_workers})
        code = self._start_and_wait(self._servers(), "exited while starting")
        if code is not None:
            return code
        if self._signal is not None:
            return _exit_code(-self._signal)
        chief = self._tasks[("chief", 0)]
        if self.evaluator:
            self._spawn(self._tasks[("evaluator", 0)])
        self._spawn(chief)
        while True:
            if self._signal is not None:
                return self._on_signal(chief)
            wanted = self._scale_request()
            if wanted is not None:
                code = self._rescale(wanted, chief)
                if code is not None:
                    return code
                continue
            for task in self._servers("ps"):
                if not task.alive():
                    code = self._recover_ps(task, chief)
                    if code is not None:
                        return code
            for task in self._servers("worker"):
                if not task.alive():
                    if self.restarts >= self.max_restarts:
                        return self._give_up(task, "exited")
                    self.restarts += 1
                    self._say(
                        f"{task.name} exited with status {_describe_status(task.poll())}; restarting it "
                        f"(restart {self.restarts} of {self.max_restarts}); its log is {task.log_path}"
                    )
                    self._spawn(task)
            code = chief.poll()
            if code is not None:
                if code != 0:
                    dead_ps = self._wait_for_dead_ps()
                    if dead_ps is not None:
                        continue  # the ps branch above restarts the ps tasks and the chief
                self._say(
                    f"chief:0 {'finished' if code == 0 else 'failed'} with exit status {_exit_code(code)}; "
                    f"logs in {self.log_dir}" + ("" if code == 0 else f"; its log is {chief.log_path}")
                )
                if code == 0:
                    self._finish_evaluator()
                return _exit_code(code)
            time.sleep(POLL_S)

    def _serve_metrics(self) -> None:
        if self.metrics_port is None:
            return
        try:
            self.metrics_server = _metrics.serve(self.metrics_port, self.metrics_host)
        except _metrics.MetricsPortError as err:
            self._say(f"error: no metrics are served, the job runs without them: {err}")
            return
        # The scrape runs on the server's thread while a rescale changes the tasks: it reads copies.
        sampler = _metrics.ProcessSampler(lambda: {task.name: task.pid if task.alive() else None
                                                   for task in list(self._tasks.values())})

        def samples():
            live = {task.name for task in list(self._tasks.values())}
            restarts = [("tf_psx_task_restarts", {"task": name, "role": name.split(":")[0]}, max(count - 1, 0))
                        for name, count in sorted(dict(self._starts).items()) if name in live]
            return sampler() + restarts

        self.metrics_server.set_source("launcher", samples)
        self._say(f"metrics: http://{self.metrics_host}:{self.metrics_server.port}/metrics (tasks); "
                  f"the chief's ClusterMonitor serves on port {self.metrics_port + 1}")

    def _auto_threads(self) -> int:
        """The intra-op threads of each server task: the CPUs divided among every task of the job."""
        return _server.threads_per_task(self.num_workers + self.num_ps + 1 + int(self.evaluator))

    def _scale_request(self) -> int | None:
        """The worker count `tf-psx scale` asked for (the request is consumed), or None."""
        path = os.path.join(self.log_dir, SCALE_FILE)
        if not os.path.exists(path):
            return None
        try:
            with open(path, encoding="utf-8") as handle:
                wanted = json.load(handle)["workers"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            self._say(f"error: ignoring the scale request {path}: {err}")
            wanted = None
        try:
            os.remove(path)
        except OSError:
            pass
        if wanted is None or not _checks.is_int_at_least(wanted, 1) or wanted > MAX_WORKERS:
            self._say(f"error: ignoring the scale request for {wanted!r} workers: it must be an int in 1..{MAX_WORKERS}")
            return None
        return None if wanted == self.num_workers else int(wanted)

    def _rescale(self, wanted: int, chief: _supervisor.TaskProcess) -> int | None:
        """Restarts the chief with `wanted` workers; it resumes from the newest snapshot.

        TF2's ClusterCoordinator has a fixed worker list, so the chief stops
        (steps since the newest snapshot are trained again) and starts again
        with the new TF_CONFIG. The ps tasks and the workers that stay keep
        running: a new coordinator opens its own context on them and makes
        its variables anew, restored from the snapshot. Only removed workers
        stop and only added ones start. Returns an exit status to give up
        with, or None.
        """
        before = self.num_workers
        self._say(f"scaling from {before} to {wanted} workers: restarting the chief, which resumes from the newest "
                  f"snapshot in {self.snapshot_dir}; the ps tasks and {min(before, wanted)} workers keep running")
        self._stop([chief])
        removed = [self._tasks.pop(("worker", index)) for index in range(wanted, before)]
        self._stop(removed)
        workers = list(self.config.workers[:wanted])
        if wanted > before:
            workers += [f"{LOOPBACK}:{port}" for port in free_ports(wanted - before)]
        self.num_workers = wanted
        self.config = ClusterConfig(workers=workers, ps=self.config.ps, chief=self.config.chief,
                                    evaluator=self.config.evaluator)
        server_argv = [sys.executable, "-m", "tf_psx.server"]
        base = dict(self._tasks[("ps", 0)].env)
        for index in range(before, wanted):
            self._add_task("worker", index, server_argv, dict(base))
        if self._intra_auto:
            self.intra_op_threads = self._auto_threads()
        # A task restarted later (a crash) comes back in the new cluster with the new thread counts;
        # the running ones keep theirs.
        for task in self._tasks.values():
            task.env[TF_CONFIG_ENV] = self.config.to_json(task.task_type, task.index)
            if task.task_type in SERVER_TYPES:
                task.env.update(_server.thread_env(self.intra_op_threads, self.inter_op_threads))
        self._say(f"cluster: {self._address_list()}; logs in {self.log_dir}")
        added = [self._tasks[("worker", index)] for index in range(before, wanted)]
        code = self._start_and_wait(added, "exited while rescaling")
        if code is not None:
            return code
        if self._signal is not None:
            return self._on_signal(chief)
        chief.env[CHIEF_ATTEMPT_ENV] = str(int(chief.env.get(CHIEF_ATTEMPT_ENV, "0")) + 1)
        self._spawn(chief)
        _write_json(os.path.join(self.log_dir, LAUNCHER_FILE), {"pid": os.getpid(), "workers": wanted})
        self._say(f"scaled to {wanted} workers")
        return None

    def _address_list(self) -> str:
        jobs = self.config.as_dict()
        return ", ".join(
            f"{job}:{index} {address}" for job, addresses in jobs.items() for index, address in enumerate(addresses)
        )

    def _wait_for_dead_ps(self) -> _supervisor.TaskProcess | None:
        deadline = time.monotonic() + PS_FAILURE_GRACE_S
        while True:
            for task in self._servers("ps"):
                if not task.alive():
                    return task
            if time.monotonic() > deadline or self._signal is not None:
                return None
            time.sleep(POLL_S)

    def _recover_ps(self, failed: _supervisor.TaskProcess, chief: _supervisor.TaskProcess) -> int | None:
        """Restarts every ps and then the chief; returns an exit status to give up with, or None."""
        if self.restarts >= self.max_restarts:
            return self._give_up(failed, "exited")
        self.restarts += 1
        self._say(
            f"{failed.name} exited with status {_describe_status(failed.poll())}; restarting the ps tasks "
            f"and then the chief, which resumes from the newest snapshot in {self.snapshot_dir} "
            f"(restart {self.restarts} of {self.max_restarts}); its log is {failed.log_path}"
        )
        # The chief's variables lived on the ps: the old chief cannot go on.
        self._stop([chief])
        ps_tasks = self._servers("ps")
        self._stop(ps_tasks)
        code = self._start_and_wait(ps_tasks, "exited while restarting")
        if code is not None:
            return code
        if self._signal is not None:
            return self._on_signal(chief)
        attempt = int(chief.env.get(CHIEF_ATTEMPT_ENV, "0")) + 1
        chief.env[CHIEF_ATTEMPT_ENV] = str(attempt)
        self._spawn(chief)
        return None

    def _on_signal(self, chief: _supervisor.TaskProcess) -> int:
        signum = self._signal
        self._say(f"received {signal.Signals(signum).name}; stopping every task")
        # The chief gets the signal itself (a Ctrl-C is a KeyboardInterrupt
        # there) so that it can end cleanly; its status is the launcher's.
        if chief.alive():
            chief.signal(signum)
        self._stop([chief], first_signal=None)
        code = chief.poll()
        return _exit_code(code if code is not None else -signum)

    def _finish_evaluator(self) -> None:
        task = self._tasks.get(("evaluator", 0))
        if task is None or not task.alive():
            return
        with open(os.path.join(self.snapshot_dir, TRAINING_DONE_FILE), "w", encoding="utf-8") as handle:
            handle.write("the chief finished with exit status 0\n")
        self._say(f"waiting up to {EVALUATOR_FINISH_TIMEOUT_S:.0f} s for evaluator:0 to evaluate the last snapshot")
        deadline = time.monotonic() + EVALUATOR_FINISH_TIMEOUT_S
        while task.alive() and time.monotonic() < deadline and self._signal is None:
            time.sleep(POLL_S)

    def _give_up(self, task: _supervisor.TaskProcess, what: str) -> int:
        self._say(
            f"giving up: {task.name} {what} with status {_describe_status(task.poll())} after "
            f"{self.restarts} restart(s) (--max-restarts {self.max_restarts}); its log is {task.log_path}"
        )
        return EXIT_GAVE_UP

    # -- processes ---------------------------------------------------------

    def _spawn(self, task: _supervisor.TaskProcess) -> None:
        self._starts[task.name] = self._starts.get(task.name, 0) + 1
        try:
            task.start(banner=PREFIX)
            self._write_pids()
        except OSError as err:
            raise LaunchError(
                f"{task.name}: cannot run {task.argv[0]!r} ({err.strerror}). Fix: check the command "
                "after `--` (the program must be on PATH or given by its path)."
            ) from None

    def _write_pids(self) -> None:
        _write_json(self._pids_file, {task.name: task.pid for task in self._tasks.values() if task.pid is not None})

    def _start_and_wait(self, tasks: list[_supervisor.TaskProcess], what: str) -> int | None:
        """Starts `tasks` and waits until they listen; the exit status to give up with, or None."""
        for task in tasks:
            self._spawn(task)
        failed = self._wait_ready(tasks)
        return None if failed is None else self._give_up(failed, what)

    def _echo(self, task: _supervisor.TaskProcess, line: str) -> None:
        if _quiet.is_noise(line):  # the task's log file keeps it
            return
        with self._lock:
            self.out.write(f"[{task.name}] {line}\n")
            self.out.flush()

    def _wait_ready(self, tasks: list[_supervisor.TaskProcess]) -> _supervisor.TaskProcess | None:
        """Waits until every task listens; returns a task that died first, or None."""
        failed = _supervisor.wait_ready(tasks, TASK_START_TIMEOUT_S, interrupted=lambda: self._signal is not None)
        if failed is None:
            return None
        task, what = failed
        if what.startswith("did not listen"):
            self._say(f"{task.name} {what}")
        return task

    @staticmethod
    def _stop(tasks: list[_supervisor.TaskProcess], first_signal: int | None = signal.SIGTERM) -> None:
        _supervisor.stop(tasks, first_signal)

    def _stop_all(self) -> None:
        order = ["chief", "evaluator", "worker", "ps"]
        tasks = sorted(self._tasks.values(), key=lambda task: order.index(task.task_type))
        self._stop(tasks)
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None


def _write_json(path: str, value) -> None:
    """Writes `path` whole or not at all (a reader never sees half a file)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(value, handle)
    os.replace(temporary, path)


def request_scale(log_dir: str, workers: Any) -> int:
    """Asks the `tf-psx launch` running with `log_dir` to rescale to `workers`; returns the launcher's pid.

    Raises:
      LaunchError: a bad count, or no launcher running with that log directory.
    """
    _checks.int_at_least(workers, 1, "Option `--workers`", error=LaunchError,
                         fix="pass e.g. --workers 2 (a job needs at least one worker)")
    if workers > MAX_WORKERS:
        raise LaunchError(f"Option `--workers` must be at most {MAX_WORKERS} (one loopback port and process each). "
                          f"Received: {workers}. Fix: pass a smaller count.")
    path = os.path.join(str(log_dir), LAUNCHER_FILE)
    try:
        with open(path, encoding="utf-8") as handle:
            pid = int(json.load(handle)["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError) as err:
        raise LaunchError(
            f"No running tf-psx launch has the log directory {log_dir!r} ({path}: {err}). Fix: pass the LOG_DIR "
            "the launcher printed in its \"cluster:\" line."
        ) from None
    _write_json(os.path.join(str(log_dir), SCALE_FILE), {"workers": int(workers)})
    return pid


def _python_script(command: list[str]) -> str | None:
    """The script a `python ... script.py ...` command runs, or None (not Python, or `-c` / `-m`)."""
    if not os.path.basename(command[0]).startswith("python"):
        return None
    for part in command[1:]:
        if part in ("-c", "-m"):
            return None
        if not part.startswith("-"):
            return part
    return None


def _copy_lines(stream, target, lock: threading.Lock) -> None:
    """Copies the lines of a byte stream to target() (a text stream) until EOF."""
    try:
        for line in iter(stream.readline, b""):
            with lock:
                target().write(line.decode("utf-8", errors="replace"))
                target().flush()
    finally:
        stream.close()


def _bring_up_loopback() -> None:
    """Sets `lo` up in this (fresh) network namespace, as `ip link set lo up` does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack(_IFREQ, b"lo", 0)
        flags = struct.unpack(_IFREQ, fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
