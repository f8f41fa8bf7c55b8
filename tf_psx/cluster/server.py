"""`python -m tf_psx.server`: runs one ps or worker task from TF_CONFIG until stopped.

The task reads its place in the cluster from the `TF_CONFIG` environment
variable, starts a `tf.distribute.Server` and blocks. SIGTERM and SIGINT stop it
with exit status 0; the launcher and `LocalCluster(processes=True)` rely on that.

Known limitations:
  * TensorFlow's gRPC server listens on every interface and has no
    authentication (see docs/security.md). Run it only on trusted networks.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import threading

from tf_psx import _checks

# Printed once the server listens; LocalCluster and the launcher wait for it.
READY_MARK = "tf_psx.server ready"
# Worker servers run one op thread per concurrently scheduled function plus
# one: with fewer, 2-core machines deadlock in the first step (DESIGN.md).
MIN_WORKER_INTER_OP_THREADS_EXTRA = 1
# How often the main thread wakes to notice a signal while it waits.
SIGNAL_POLL_S = 1.0
# Per-task TF thread pools (LocalCluster, the launcher and the k8s manifests set
# them); unset: intra-op = the CPUs this process may use (its affinity, capped
# by a cgroup CPU limit), inter-op = TF's default (workers: see below).
INTRA_OP_ENV = "TF_PSX_INTRA_OP_THREADS"
INTER_OP_ENV = "TF_PSX_INTER_OP_THREADS"
_CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def available_cpus() -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup v2 CPU limit (a container's)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(_CGROUP_CPU_MAX, encoding="ascii") as handle:
            quota, period = handle.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def threads_per_task(tasks_on_host: int) -> int:
    """Intra-op threads for each of `tasks_on_host` tasks sharing this host's CPUs (at least 1)."""
    return max(1, available_cpus() // max(1, tasks_on_host))


def thread_env(intra_op_threads: int, inter_op_threads: int | None) -> dict[str, str]:
    """The environment variables that give a task process these thread pools (None: TF's default)."""
    env = {INTRA_OP_ENV: str(intra_op_threads)}
    if inter_op_threads is not None:
        env[INTER_OP_ENV] = str(inter_op_threads)
    return env


def threads_from_env(name: str) -> int | None:
    """The thread count in environment variable `name`, or None; ValueError naming it if malformed."""
    return _checks.int_from_env(name, 1, 2)


def worker_inter_op_threads(num_workers: int) -> int:
    """The inter-op threads a worker server needs in a cluster of `num_workers`."""
    return max(num_workers + MIN_WORKER_INTER_OP_THREADS_EXTRA, os.cpu_count() or 1)


def server_config(task_type: str, num_workers: int, inter_op_threads: int | None = None,
                  intra_op_threads: int | None = None):
    """Returns the ConfigProto for a task: enough inter-op threads on workers, the thread counts asked.

    Args:
      task_type: "worker" or "ps".
      num_workers: the number of workers in the cluster.
      inter_op_threads: the inter-op threads; on a worker at least
        `num_workers + 1` (fewer deadlock the first step) and
        `worker_inter_op_threads` when None; on a ps TF's default when None.
      intra_op_threads: the intra-op threads; TF's default (every core) when None.

    Returns:
      A `tf.compat.v1.ConfigProto`, or None for a ps task with nothing asked (TF defaults).
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if task_type != "worker" and inter_op_threads is None and intra_op_threads is None:
        return None
    config = tf.compat.v1.ConfigProto()
    if task_type == "worker":
        config.inter_op_parallelism_threads = (max(inter_op_threads, num_workers + MIN_WORKER_INTER_OP_THREADS_EXTRA)
                                               if inter_op_threads else worker_inter_op_threads(num_workers))
    elif inter_op_threads:
        config.inter_op_parallelism_threads = inter_op_threads
    if intra_op_threads:
        config.intra_op_parallelism_threads = intra_op_threads
    return config


def _write_info(config) -> str | None:
    """Writes this task's versions and pid for `tf-psx doctor` (tf_psx.cluster.preflight); returns the path."""
    import json  # pylint: disable=import-outside-toplevel

    from tf_psx import trail  # pylint: disable=import-outside-toplevel
    from tf_psx.cluster import preflight as doctor  # pylint: disable=import-outside-toplevel

    port = int(config.as_dict()[config.task_type][config.task_index].rsplit(":", 1)[1])
    path = doctor.server_info_path(port)
    info = {"task": f"{config.task_type}:{config.task_index}", "pid": os.getpid(), "versions": trail.package_versions()}
    try:
        with open(path + ".tmp", "w", encoding="utf-8") as handle:
            json.dump(info, handle)
        os.replace(path + ".tmp", path)
    except OSError as err:  # a read-only /tmp: the doctor reports "versions unknown"
        print(f"tf_psx.server: cannot write {path} for tf-psx doctor: {err}", file=sys.stderr, flush=True)
        return None
    return path


def main(argv: list[str] | None = None) -> int:
    """Starts the task named by TF_CONFIG and blocks until it is signalled."""
    del argv
    from tf_psx._tf import runtime as _runtime, tfra as _tfra  # pylint: disable=import-outside-toplevel
    from tf_psx.cluster import ClusterConfig, TFConfigError  # pylint: disable=import-outside-toplevel

    _runtime.set_grpc_fail_fast()
    try:
        config = ClusterConfig.from_tf_config()
        if config.task_type not in ("worker", "ps"):
            raise TFConfigError(
                f'TF_CONFIG["task"]["type"] must be "worker" or "ps" for tf_psx.server; '
                f"received {config.task_type!r}. Fix: the chief runs your training script, "
                "not tf_psx.server."
            )
        intra_op = threads_from_env(INTRA_OP_ENV) or available_cpus()
        inter_op = threads_from_env(INTER_OP_ENV)
    except (TFConfigError, ValueError) as err:
        print(f"tf_psx.server: {err}", file=sys.stderr, flush=True)
        return 2

    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    # A DynamicEmbedding's hash tables are created on the ps tasks with TFRA's
    # custom ops ("TFRA>CuckooHashTableOfTensors"); a server that has not
    # loaded them fails every such op with "is neither a type of a primitive
    # operation nor a name of a function registered in binary".
    if not _tfra.load_tfra_ops():
        print("tf_psx.server: tensorflow-recommenders-addons is not importable; "
              "DynamicEmbedding tables cannot live on this task", file=sys.stderr, flush=True)

    stop = threading.Event()

    def _on_signal(signum, frame):  # pylint: disable=unused-argument
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    # The stall doctor (tf_psx.training.stalls) asks for this task's stacks with SIGUSR1.
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    tf.distribute.Server(
        config.cluster_spec(),
        job_name=config.task_type,
        task_index=config.task_index,
        config=server_config(config.task_type, config.num_workers, inter_op, intra_op),
        protocol="grpc",
        start=True,
    )
    info_path = _write_info(config)
    effective = server_config(config.task_type, config.num_workers, inter_op, intra_op)
    print(f"tf_psx.server threads: intra_op={intra_op} inter_op="
          f"{effective.inter_op_parallelism_threads or 'TF default'}", flush=True)
    print(f"{READY_MARK} {config.task_type}:{config.task_index} pid={os.getpid()}", flush=True)
    cpu_at_ready = time.process_time()
    while not stop.wait(SIGNAL_POLL_S):
        pass
    if info_path:
        try:
            os.remove(info_path)
        except OSError:
            pass
    # gRPC servers cannot be shut down cleanly in TF 2.16 ("Clean shutdown is
    # not currently implemented"); leaving the process releases the port.
    # The CPU this task spent serving (steps on a worker, lookups and updates on a
    # ps): a launched task that nothing used shows well under a second.
    print(f"tf_psx.server {config.task_type}:{config.task_index} stopping "
          f"(CPU {time.process_time() - cpu_at_ready:.1f} s since ready)", flush=True)
    os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
    sys.exit(main())
