"""`LocalCluster`: a working parameter-server cluster on free loopback ports.

Two modes:

* in-process (`processes=False`, the default, for notebooks and test suites):
  every ps and worker is a `tf.distribute.Server` running on threads of this
  process;
* processes (`processes=True`): every task is a `python -m tf_psx.server`
  child process, which can be killed and restarted to test failures.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from typing import Any

from tf_psx import _checks, _quiet
from tf_psx.cluster import server as _server, supervisor as _supervisor
from tf_psx._tf import runtime as _runtime
from tf_psx.cluster import TF_CONFIG_ENV, ClusterConfig
from tf_psx.cluster.config import ClusterSource
from tf_psx.cluster.ports import LOOPBACK, free_ports
from tf_psx.errors import ArgumentError, StateError, TaskFailedError

logger = logging.getLogger("tf_psx")

# Past this a cluster whose tasks cannot come up raises instead of waiting on.
TASK_START_TIMEOUT_S = _supervisor.START_TIMEOUT_S
# SIGTERM first so the task can exit on its own; SIGKILL after this grace.
TASK_STOP_GRACE_S = _supervisor.STOP_GRACE_S
TASK_TYPES = ("worker", "ps")

# In-process gRPC servers cannot be stopped in TF 2.16 (Server.stop() raises
# "Clean shutdown is not currently implemented"). A second in-process
# LocalCluster of the same shape therefore reuses the running servers instead
# of leaking another set of ports and threads.
_INPROCESS_SERVERS: dict[tuple[int, int], tuple[ClusterConfig, list[Any]]] = {}
# In-process tf.data services by their number of data workers: (address, servers).
_INPROCESS_DATA_SERVICES: dict[int, tuple[str, list[Any]]] = {}
# TF sizes one inter-op thread pool per process, from the options of the
# first server that asks for it (process_util.cc ComputePool: a function-local
# static), and every in-process server after it shares that pool. A worker
# needs num_workers + 1 threads of it (DESIGN.md), so a first cluster of 1
# worker (2 threads) made a later cluster of 3 workers hang in its first step.
# In-process servers therefore always ask for this many, enough for any
# in-process cluster up to MAX_INPROCESS_WORKERS workers; idle threads cost
# only their stacks.
INPROCESS_INTER_OP_THREADS = 64
MAX_INPROCESS_WORKERS = INPROCESS_INTER_OP_THREADS - 1


class LocalCluster(ClusterSource):
    """A parameter-server cluster on this machine, as a context manager.

    Example:

    >>> import tf_psx
    >>> with tf_psx.LocalCluster(num_workers=1, num_ps=2) as cluster:
    ...     print(cluster.config.num_workers, cluster.config.num_ps)
    1 2

    Args:
      num_workers: worker tasks (>= 1).
      num_ps: parameter-server tasks (>= 1).
      processes: run each task as a `python -m tf_psx.server` child process
        (True) or as servers on threads of this process (False).
      log_dir: where process tasks write `<type>-<index>.log`; a fresh
        temporary directory when None. In-process servers write no task
        logs (they log to this process), so `log_dir` needs `processes=True`.
      start_timeout_s: how long to wait for every task to listen before
        raising `TaskFailedError` (process tasks).
      intra_op_threads: each task process's intra-op threads: an int >= 1,
        or "auto" (default): this machine's CPUs divided among the tasks and
        the coordinator, so that they do not fight for cores.
      inter_op_threads: each task process's inter-op threads (int >= 1), or
        None for the default (workers: at least one per worker plus one).
        Both need `processes=True` when not the default: in-process servers
        share this process's thread pools.
      data_workers: tf.data service workers to start beside the cluster
        (int >= 0), with their dispatcher: task processes with
        `processes=True`, servers in this process otherwise. Their address
        is `data_service` (tf_psx.cluster.data_service says how fit uses it).

    Attributes:
      config: the `ClusterConfig` of the cluster (loopback addresses).
      resolver: a `SimpleClusterResolver` for `tf.distribute` strategies.
      data_service: "grpc://127.0.0.1:PORT" of the tf.data service dispatcher,
        for `tf.data.experimental.service.distribute(service=...)`; None
        without `data_workers`.

    Known limitations:
      * In-process servers cannot be stopped (TF 2.16 has no clean shutdown
        of gRPC servers), so their ports stay open until the process exits.
        A later in-process LocalCluster of the same shape reuses them; one
        of another shape starts new servers (any number of clusters of any
        shapes work one after another). Use `processes=True` when the ports
        must be released on exit.
      * In-process clusters share one TF thread pool, which caps them at
        `MAX_INPROCESS_WORKERS` workers; more need `processes=True`.
      * Like every TF gRPC server, the tasks listen on all interfaces and
        accept any caller (docs/security.md).
      * Create the cluster (and the strategy) before building any model in
        the process: resources made before live on `/job:localhost`.
      * Task processes get SIGKILL when this process exits (Linux
        PR_SET_PDEATHSIG, from one thread that lives as long as the process:
        tf_psx.cluster.supervisor), so a killed coordinator leaves none behind.
    """

    def __init__(
        self,
        num_workers: int = 2,
        num_ps: int = 2,
        processes: bool = False,
        log_dir: str | None = None,
        start_timeout_s: float = TASK_START_TIMEOUT_S,
        intra_op_threads: int | str = "auto",
        inter_op_threads: int | None = None,
        data_workers: int = 0,
    ):
        self.num_workers = _checks.int_at_least(num_workers, 1, "num_workers", fix="pass LocalCluster(num_workers=1) or more")
        self.num_ps = _checks.int_at_least(num_ps, 1, "num_ps", fix="pass LocalCluster(num_ps=1) or more")
        self.processes = bool(processes)
        if not self.processes and self.num_workers > MAX_INPROCESS_WORKERS:
            raise ArgumentError(
                f"Argument `num_workers` must be <= {MAX_INPROCESS_WORKERS} for an in-process LocalCluster "
                f"(its servers share one TF thread pool of {INPROCESS_INTER_OP_THREADS} threads). "
                f"Received: {num_workers}. Fix: pass processes=True."
            )
        if not self.processes and log_dir is not None:
            raise ArgumentError(
                f"Argument `log_dir` needs task processes: in-process servers log to this process. "
                f"Received: log_dir={log_dir!r} with processes=False. Fix: pass processes=True, or drop log_dir."
            )
        if isinstance(start_timeout_s, bool) or not isinstance(start_timeout_s, (int, float)) or start_timeout_s <= 0:
            raise ArgumentError(
                f"Argument `start_timeout_s` must be a number of seconds > 0. Received: {start_timeout_s!r}."
            )
        self.start_timeout_s = float(start_timeout_s)
        if intra_op_threads != "auto":
            _checks.int_at_least(intra_op_threads, 1, "intra_op_threads", owner="LocalCluster",
                                 fix='pass an int >= 1, or "auto" to divide the CPUs among the tasks')
        _checks.int_at_least(inter_op_threads, 1, "inter_op_threads", owner="LocalCluster", or_none=True,
                             fix="pass an int >= 1, or None for the default")
        if not self.processes and (intra_op_threads != "auto" or inter_op_threads is not None):
            raise ArgumentError(
                "Arguments `intra_op_threads` and `inter_op_threads` of LocalCluster set each task process's "
                f"thread pools and need processes=True. Received: intra_op_threads={intra_op_threads!r}, "
                f"inter_op_threads={inter_op_threads!r} with processes=False. Fix: pass processes=True, or "
                "set this process's pools with tf.config.threading before the cluster starts."
            )
        self.intra_op_threads = (_server.threads_per_task(self.num_workers + self.num_ps + 1)
                                 if intra_op_threads == "auto" else int(intra_op_threads))
        self.inter_op_threads = inter_op_threads
        self.data_workers = _checks.int_at_least(data_workers, 0, "data_workers", owner="LocalCluster",
                                                 fix="pass 0 (no tf.data service) or more data workers")
        self.data_service: str | None = None
        self._log_dir_arg = log_dir
        self.log_dir: str | None = None
        self.config: ClusterConfig | None = None
        self._tasks: dict[tuple[str, int], _supervisor.TaskProcess] = {}
        self._started = False

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> "LocalCluster":
        """Starts every task and waits until each one listens."""
        if self._started:
            return self
        if os.environ.get(TF_CONFIG_ENV):
            logger.warning(
                "LocalCluster starts its own %d worker and %d ps tasks although TF_CONFIG is set (this script "
                "runs under tf-psx launch or Kubernetes): the launched tasks stay idle. Fix: "
                "`with tf_psx.launched_or(tf_psx.LocalCluster(...)) as cluster:` uses TF_CONFIG's cluster "
                "when there is one.", self.num_workers, self.num_ps)
        _runtime.set_grpc_fail_fast()
        if self.processes:
            self._start_processes()
        else:
            self._start_in_process()
        if self.data_workers:
            self._start_data_service()
        self._started = True
        return self

    def running_config(self) -> ClusterConfig:
        """Starts the cluster if it is not running; returns its `ClusterConfig` (what a strategy trains on)."""
        return self.start().config

    def stop(self) -> None:
        """Stops every task process and waits for it (no-op in-process)."""
        if self._tasks:
            # The coordinator's remote functions outlive the tasks: their release at exit is noise (tf_psx._quiet).
            _quiet.filter_native_stderr_at_exit()
        _supervisor.stop(list(self._tasks.values()), grace_s=TASK_STOP_GRACE_S)
        self._started = False
        if self.processes:
            self.data_service = None

    def __enter__(self) -> "LocalCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def resolver(self):
        """A `tf.distribute.cluster_resolver.SimpleClusterResolver` for the cluster."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        self._require_started("resolver")
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            self.config.cluster_spec(), rpc_layer="grpc"
        )

    def pid(self, task_type: str, index: int) -> int:
        """The pid of a task process (processes=True only)."""
        return self._task(task_type, index).pid

    def task_pids(self) -> dict[str, int | None]:
        """{"ps:0": pid, "worker:0": pid, ...} of the task processes (None for one not running); {} in-process."""
        return {task.name: task.pid for task in list(self._tasks.values())}

    def kill(self, task_type: str, index: int) -> None:
        """Kills a task process with SIGKILL and waits until it is gone.

        Args:
          task_type: "worker" or "ps".
          index: the task index.
        """
        self._task(task_type, index).kill()

    def restart(self, task_type: str, index: int) -> None:
        """Restarts a task process on its old port and waits until it listens."""
        key = self._key(task_type, index)
        self._require_processes("restart")
        self._require_started(f"restart({task_type!r}, {index})")
        task = self._tasks[key]
        _supervisor.stop([task], grace_s=TASK_STOP_GRACE_S)
        task.start()
        self._wait_ready([task])

    def alive(self, task_type: str, index: int) -> bool:
        """True when the task process is running."""
        return self._task(task_type, index).alive()

    def log_path(self, task_type: str, index: int) -> str:
        """The log file of a task process."""
        self._require_processes("log_path")
        return os.path.join(self.log_dir, f"{task_type}-{index}.log")

    # -- in-process --------------------------------------------------------

    def _start_in_process(self) -> None:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        shape = (self.num_workers, self.num_ps)
        if shape in _INPROCESS_SERVERS:
            self.config = _INPROCESS_SERVERS[shape][0]
            return
        ports = free_ports(self.num_workers + self.num_ps)
        self.config = ClusterConfig(
            workers=[f"{LOOPBACK}:{p}" for p in ports[: self.num_workers]],
            ps=[f"{LOOPBACK}:{p}" for p in ports[self.num_workers :]],
        )
        spec = self.config.cluster_spec()
        servers = []
        # Starting servers prints native lines no log level reaches once TF was imported first (server
        # option dumps; TF 2.21's cuInit error at device discovery): the known ones are dropped (tf_psx._quiet).
        with _quiet.native_stderr_filtered():
            self._start_servers(tf, spec, servers)
        _INPROCESS_SERVERS[shape] = (self.config, servers)

    def _start_servers(self, tf, spec, servers: list) -> None:
        from tf_psx.cluster.server import server_config  # pylint: disable=import-outside-toplevel

        for task_type, count in (("worker", self.num_workers), ("ps", self.num_ps)):
            for index in range(count):
                servers.append(
                    tf.distribute.Server(
                        spec,
                        job_name=task_type,
                        task_index=index,
                        config=server_config(task_type, self.num_workers, INPROCESS_INTER_OP_THREADS),
                        protocol="grpc",
                        start=True,
                    )
                )

    # -- processes ---------------------------------------------------------

    def _start_processes(self) -> None:
        self.log_dir = self._log_dir_arg or tempfile.mkdtemp(prefix="tf_psx_cluster_")
        os.makedirs(self.log_dir, exist_ok=True)
        ports = free_ports(self.num_workers + self.num_ps)
        self.config = ClusterConfig(
            workers=[f"{LOOPBACK}:{p}" for p in ports[: self.num_workers]],
            ps=[f"{LOOPBACK}:{p}" for p in ports[self.num_workers :]],
        )
        keys = [("ps", i) for i in range(self.num_ps)]
        keys += [("worker", i) for i in range(self.num_workers)]
        commands = []
        for task_type, index in keys:
            env = _supervisor.server_env(os.environ, self.config.to_json(task_type, index))
            env.update(_server.thread_env(self.intra_op_threads, self.inter_op_threads))
            commands.append(((task_type, index), [sys.executable, "-m", "tf_psx.server"], env))
        self._start_tasks(commands)

    def _start_tasks(self, commands: list) -> None:
        """Starts ((task type, index), argv, env) task processes and waits until each one listens."""
        tasks = []
        for (task_type, index), argv, env in commands:
            task = _supervisor.TaskProcess(task_type, index, argv, env, self.log_path(task_type, index))
            self._tasks[(task_type, index)] = task
            # A Ctrl-C in a notebook or terminal does not reach the tasks
            # (their own session; stop() ends them), and a coordinator killed
            # outright takes them with it (PR_SET_PDEATHSIG).
            task.start()
            tasks.append(task)
        self._wait_ready(tasks)

    def _wait_ready(self, tasks: list) -> None:
        # The task prints READY_MARK once its server listens. Waiting for the
        # mark, not for the port, keeps another program that holds the port
        # from passing for the task.
        failed = _supervisor.wait_ready(tasks, self.start_timeout_s)
        if failed is None:
            return
        task, what = failed
        if what.startswith("did not listen"):
            what += " (LocalCluster(start_timeout_s=...) waits longer on a loaded machine)"
        raise TaskFailedError(
            f"LocalCluster task {task.name} {what} (exit status {task.poll()}); "
            f"its log is {task.log_path}. Last lines:\n{task.log_tail()}"
        )

    # -- the tf.data service ------------------------------------------------

    def _start_data_service(self) -> None:
        from tf_psx.cluster import data_service as _data_service  # pylint: disable=import-outside-toplevel

        if not self.processes:
            if self.data_workers not in _INPROCESS_DATA_SERVICES:  # in-process servers cannot be stopped: reused
                ports = free_ports(self.data_workers + 1)
                servers = _data_service.start_in_process(ports[0], self.data_workers, ports[1:])
                _INPROCESS_DATA_SERVICES[self.data_workers] = (_data_service.address(ports[0]), servers)
            self.data_service = _INPROCESS_DATA_SERVICES[self.data_workers][0]
            return
        ports = free_ports(self.data_workers + 1)
        env = _data_service.task_env(os.environ)
        self._start_tasks([(key, argv, env) for key, argv in _data_service.task_commands(ports, LOOPBACK)])
        self.data_service = _data_service.address(ports[0])

    # -- helpers -----------------------------------------------------------

    def _key(self, task_type: str, index: int) -> tuple[str, int]:
        if task_type not in TASK_TYPES:
            raise ArgumentError(
                f"Argument `task_type` must be one of {list(TASK_TYPES)}. Received: {task_type!r}."
            )
        count = self.num_workers if task_type == "worker" else self.num_ps
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise ArgumentError(
                f"Argument `index` for {task_type!r} must be an int in [0, {count}). Received: {index!r}."
            )
        return task_type, index

    def _task(self, task_type: str, index: int) -> _supervisor.TaskProcess:
        self._require_processes("kill/restart/alive/pid")
        key = self._key(task_type, index)
        self._require_started(f"{task_type}:{index}")
        return self._tasks[key]

    def _require_processes(self, what: str) -> None:
        if not self.processes:
            raise StateError(
                f"LocalCluster.{what} needs task processes. Fix: LocalCluster(..., processes=True)."
            )

    def _require_started(self, what: str) -> None:
        if self.config is None:
            raise StateError(
                f"LocalCluster {what} is not available before the cluster starts. "
                "Fix: use `with LocalCluster(...) as cluster:` or call cluster.start()."
            )

    def __repr__(self) -> str:
        mode = "processes" if self.processes else "in-process"
        return f"LocalCluster(num_workers={self.num_workers}, num_ps={self.num_ps}, {mode})"


@contextlib.contextmanager
def launched_or(local: LocalCluster):
    """The launched cluster when TF_CONFIG is set, else `local` (started, and stopped at the end).

    One script, both ways: alone it starts `local`; under `tf-psx launch` or
    a TFJob (TF_CONFIG set) it yields None, which
    `tf_psx.ParameterServerStrategy` reads as "the cluster of TF_CONFIG",
    and `local` is never started.

    Example:

    >>> import os, tf_psx
    >>> os.environ.pop("TF_CONFIG", None) is None or True
    True
    >>> os.environ["TF_CONFIG"] = '{"cluster": {"worker": ["w:1"], "ps": ["p:1"]}, "task": {"type": "chief"}}'
    >>> with tf_psx.launched_or(tf_psx.LocalCluster(num_workers=2, num_ps=1)) as cluster:
    ...     print(cluster)
    None
    >>> del os.environ["TF_CONFIG"]

    Args:
      local: the `LocalCluster` to use when TF_CONFIG is not set.

    Yields:
      None (TF_CONFIG's cluster) or the started `local`.
    """
    if os.environ.get(TF_CONFIG_ENV):
        logger.info("training on the cluster of TF_CONFIG; the LocalCluster of %d workers and %d ps is not "
                    "started", local.num_workers, local.num_ps)
        yield None
        return
    with local as cluster:
        yield cluster
