"""`Launcher`: the supervisor behind `tf-psx launch` (see `tf_psx.launch` for the whole story).

It starts every ps and worker task on free loopback ports, waits until they
listen, runs the training command as the chief, streams and logs every
task's output, restarts a dead worker on its old port, restarts the ps tasks
and then the chief (which resumes from the newest snapshot) when a ps dies,
gives up after `max_restarts`, rescales on `tf-psx scale` (tf_psx.launch.elastic)
and stops every task at the end. The contract with the chief is
tf_psx.launch.contract; `--isolate` is tf_psx.launch.isolation. Importing this
module does not import TensorFlow.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

from tf_psx import _checks, _quiet, metrics as _metrics
from tf_psx._tf import runtime as _runtime
from tf_psx.cluster import TF_CONFIG_ENV, ClusterConfig
from tf_psx.cluster import data_service as _data_service, server as _server, supervisor as _supervisor
from tf_psx.cluster.ports import LOOPBACK, free_ports
from tf_psx.errors import LaunchError
from tf_psx.training import stalls as _stalls
from tf_psx.launch.contract import (
    CHIEF_ATTEMPT_ENV,
    EXIT_GAVE_UP,
    LAUNCHER_FILE,
    PIDS_FILE,
    SNAPSHOT_DIR_ENV,
    TRAINING_DONE_FILE,
    exit_code,
    write_json,
)
from tf_psx.launch.elastic import RescaleMixin
from tf_psx.launch.isolation import ISOLATED_ENV, bring_up_loopback, in_private_namespace, require_support, run_isolated

__all__ = ["Launcher"]

PREFIX = "tf-psx launch"

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

SERVER_TYPES = ("ps", "worker")


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


class Launcher(RescaleMixin):
    """Runs a parameter-server job on this machine and keeps it running.

    See `tf_psx.launch` for what it does and for the contract with the
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
      data_workers: tf.data service workers to run, with their dispatcher
        (tf_psx.cluster.data_service); the chief gets the dispatcher's
        address in `$TF_PSX_DATA_SERVICE`. A dead one is restarted.
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
        snapshot_dir: str | None = None,
        isolate: bool = False,
        out: TextIO | None = None,
        err: TextIO | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "0.0.0.0",
        intra_op_threads: int | str = "auto",
        inter_op_threads: int | None = None,
        data_workers: int = 0,
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
        self.data_workers = _checks.int_at_least(data_workers, 0, "Option `--data-workers`", error=LaunchError,
                                                 fix="pass e.g. --data-workers 2, or leave it out")
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
        if self.isolate:
            require_support()
        self.log_dir = self._prepare_dir("log-dir", log_dir) if log_dir else None
        self.snapshot_dir = self._prepare_dir("snapshot-dir", snapshot_dir) if snapshot_dir else None
        self._out = out
        self._err = err
        self._lock = threading.Lock()
        self._line_filters: dict[str, _quiet.LineFilter] = {}  # task name -> its echo filter
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
        if self.isolate and not in_private_namespace():
            return self._run_isolated()
        if in_private_namespace():
            bring_up_loopback()
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
        if self.data_workers:
            args += ["--data-workers", str(self.data_workers)]
        return [*args, "--", *self.command]

    def _run_isolated(self) -> int:
        """Runs this launcher again, in a new network namespace, and waits for it."""
        return run_isolated(self._cli_args(), lambda: self.out, lambda: self.err, self._lock)

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
        base.pop(ISOLATED_ENV, None)
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
        if self.data_workers:
            data_ports = free_ports(self.data_workers + 1)
            for (task_type_, index), argv in _data_service.task_commands(data_ports, LOOPBACK):
                self._add_task(task_type_, index, argv, _data_service.task_env(base))
            user_env[_data_service.ENV] = _data_service.address(data_ports[0])
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

    def _data_tasks(self) -> list[_supervisor.TaskProcess]:
        return [task for task in self._tasks.values() if task.task_type in _data_service.TASK_TYPES]

    def _supervise(self) -> int:
        self._build_tasks()
        if in_private_namespace():
            self._say("isolated: the job runs in a private network namespace; its ports are unreachable from outside")
        else:
            self._say(
                "warning: the TF gRPC ports below have no authentication and listen on every interface; "
                "whoever reaches them can run any op on this machine (use --isolate; docs/security.md)"
            )
        self._say(f"cluster: {self._address_list()}; logs in {self.log_dir}")
        self._serve_metrics()
        write_json(os.path.join(self.log_dir, LAUNCHER_FILE), {"pid": os.getpid(), "workers": self.num_workers})
        code = self._start_and_wait(self._servers() + self._data_tasks(), "exited while starting")
        if code is not None:
            return code
        if self._signal is not None:
            return exit_code(-self._signal)
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
            for task in self._servers("worker") + self._data_tasks():
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
                    f"chief:0 {'finished' if code == 0 else 'failed'} with exit status {exit_code(code)}; "
                    f"logs in {self.log_dir}" + ("" if code == 0 else f"; its log is {chief.log_path}")
                )
                if code == 0:
                    self._finish_evaluator()
                return exit_code(code)
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
        return exit_code(code if code is not None else -signum)

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
        write_json(self._pids_file, {task.name: task.pid for task in self._tasks.values() if task.pid is not None})

    def _start_and_wait(self, tasks: list[_supervisor.TaskProcess], what: str) -> int | None:
        """Starts `tasks` and waits until they listen; the exit status to give up with, or None."""
        for task in tasks:
            self._spawn(task)
        failed = self._wait_ready(tasks)
        return None if failed is None else self._give_up(failed, what)

    def _echo(self, task: _supervisor.TaskProcess, line: str) -> None:
        line_filter = self._line_filters.setdefault(task.name, _quiet.LineFilter())
        if not line_filter.keep(line):  # known noise; the task's log file keeps it
            return
        with self._lock:
            self.out.write(f"[{task.name}] {line}\n")
            self.out.flush()

    def _wait_ready(self, tasks: list[_supervisor.TaskProcess]) -> _supervisor.TaskProcess | None:
        """Waits until every task listens; returns a task that died first, or None."""
        failed = _supervisor.wait_ready(tasks, _supervisor.START_TIMEOUT_S, interrupted=lambda: self._signal is not None)
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
        order = ["chief", "evaluator", "worker", "ps", *_data_service.TASK_TYPES]
        tasks = sorted(self._tasks.values(), key=lambda task: order.index(task.task_type))
        self._stop(tasks)
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None


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
