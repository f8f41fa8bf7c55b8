"""The TF runtime: gRPC fail-fast, the eager context, the coordinator (TF 2.16.2)."""

from __future__ import annotations

import os

# With GRPC_FAIL_FAST=use_caller a call to a dead task fails at once instead of
# waiting for the connection to come back, which is what lets ClusterCoordinator
# notice a failed worker and re-run its closure elsewhere (TF 2.16 PS guide).
GRPC_FAIL_FAST_ENV = "GRPC_FAIL_FAST"


GRPC_FAIL_FAST_VALUE = "use_caller"


def set_grpc_fail_fast() -> None:
    """Sets GRPC_FAIL_FAST=use_caller unless the user set it already."""
    os.environ.setdefault(GRPC_FAIL_FAST_ENV, GRPC_FAIL_FAST_VALUE)


# A task keeps a coordinator's eager context, and every variable the
# coordinator made on it, until this long after the coordinator's last RPC.
# TF's default (context._KEEP_ALIVE_SECS, 600 s) lets a coordinator that is
# gone (crashed, or stopped by `tf-psx scale` while the ps keeps running)
# hold its copy of every variable on the ps for 10 minutes, and each restart
# within them adds a copy (measured on TF 2.16.2: +256 MB of ps memory per
# restart for a 256 MB table; with 5 s, none). A live coordinator keeps its
# contexts with keep-alive RPCs, idle or not, so this bounds only what a
# departed one leaves behind. $TF_PSX_KEEP_ALIVE_S overrides it (read by
# tf_psx.strategies).
KEEP_ALIVE_S = 60
KEEP_ALIVE_ENV = "TF_PSX_KEEP_ALIVE_S"


def shorten_keep_alive(seconds: int) -> None:
    """Makes the coordinator's remote contexts expire `seconds` after its last RPC.

    Sets the module default that TF reads when it first connects (private:
    context._KEEP_ALIVE_SECS) and the default of `Context.set_server_def` /
    `update_server_def` for a context that is connected again. Idempotent.
    """
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel

    context._KEEP_ALIVE_SECS = seconds  # pylint: disable=protected-access
    for name in ("set_server_def", "update_server_def"):
        method = getattr(context.Context, name)
        original = getattr(method, "__wrapped__", method)

        def with_keep_alive(self, server_def, keep_alive_secs=seconds, _original=original):
            return _original(self, server_def, keep_alive_secs=keep_alive_secs)

        with_keep_alive.__wrapped__ = original
        setattr(context.Context, name, with_keep_alive)


def eager_context_initialized() -> bool:
    """True when this process already ran TF ops eagerly (private: context handle)."""
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel

    ctx = context.context()
    return getattr(ctx, "_context_handle", None) is not None


def connected_to_cluster() -> bool:
    """True when the eager context has a server_def (connected to a cluster)."""
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel

    return getattr(context.context(), "_server_def", None) is not None


def is_parameter_server_strategy(strategy) -> bool:
    """True for strategies whose steps run through a ClusterCoordinator."""
    return bool(getattr(strategy, "_should_use_with_coordinator", False))


def coordinator_of(strategy):
    """The strategy's `ClusterCoordinator` (TF keeps one per strategy; this returns it)."""
    from tensorflow.python.distribute.coordinator import cluster_coordinator  # pylint: disable=import-outside-toplevel

    return cluster_coordinator.ClusterCoordinator(strategy)


def num_ps(strategy) -> int:
    """The ps task count of a ParameterServerStrategy (TF 2.16: `extended._num_ps`)."""
    return int(strategy.extended._num_ps)  # pylint: disable=protected-access


def flatten_layers(model):
    """Every layer nested in `model`, itself included (tf-keras 2.16 `_flatten_layers`)."""
    return list(model._flatten_layers())  # pylint: disable=protected-access


class ClosureRetries:
    """Counts the closures a ClusterCoordinator put back in its queue to run again."""

    def __init__(self):
        self.count = 0


def closure_retries(coordinator) -> ClosureRetries:
    """Returns the retry counter of `coordinator`, installing it on first use.

    TF 2.16's `ClusterCoordinator` re-queues a closure that failed on a
    worker (a worker failure, or a transient error) with
    `coordinator._cluster.closure_queue.put_back(closure)`; nothing public
    counts those. The counter wraps `put_back` on that queue instance, once.
    Retries before the counter was installed are not counted.
    """
    queue = coordinator._cluster.closure_queue  # pylint: disable=protected-access
    counter = queue.__dict__.get("_tf_psx_retries")
    if counter is None:
        counter = ClosureRetries()
        original = queue.put_back

        def put_back(closure):
            counter.count += 1
            return original(closure)

        queue.put_back = put_back
        queue._tf_psx_retries = counter  # pylint: disable=protected-access
    return counter


class ClosureTable:
    """What each worker thread of a ClusterCoordinator runs now, and when a closure last finished.

    `running` maps a worker index to (closure name, wall time started,
    monotonic time started, attempt); `finished` counts closures that
    returned (done or failed); `last_progress` is the monotonic time of the
    latest. Read under `lock`.
    """

    def __init__(self, num_workers: int):
        import threading  # pylint: disable=import-outside-toplevel
        import time  # pylint: disable=import-outside-toplevel

        self.lock = threading.Lock()
        self.num_workers = num_workers
        self.running: dict[int, tuple[str, float, float, int]] = {}
        self.finished = 0
        self.last_progress = time.monotonic()
        self._attempts: dict[int, int] = {}  # id(closure) -> runs so far, until it is done for good

    def pending(self, coordinator) -> tuple[int, int]:
        """(closures in flight, closures queued) of the coordinator's queue."""
        queue = coordinator._cluster.closure_queue  # pylint: disable=protected-access
        return int(queue.inflight_closure_count), int(queue._queue.qsize())  # pylint: disable=protected-access


def _closure_name(closure) -> str:
    function = getattr(closure, "_concrete_function", None) or getattr(closure, "_function", None)
    name = getattr(function, "name", None) or getattr(function, "__name__", None) or type(closure).__name__
    return name.decode() if isinstance(name, bytes) else str(name)


def closure_table(coordinator) -> ClosureTable:
    """Returns the closure table of `coordinator`, installing it on first use.

    TF 2.16's worker threads run each closure through
    `Worker._process_closure(closure)` (looked up on the instance every
    time) and re-queue a failed one with `closure_queue.put_back`. The table
    wraps both, on these instances, once. Closures that started before it
    was installed are not in it.
    """
    import time  # pylint: disable=import-outside-toplevel

    cluster = coordinator._cluster  # pylint: disable=protected-access
    table = cluster.__dict__.get("_tf_psx_closure_table")
    if table is not None:
        return table
    table = ClosureTable(len(cluster.workers))
    queue = cluster.closure_queue
    for worker in cluster.workers:
        def process(closure, _original=worker._process_closure, _index=worker.worker_index):  # pylint: disable=protected-access
            key = id(closure)
            with table.lock:
                attempt = table._attempts.get(key, 0) + 1  # pylint: disable=protected-access
                table._attempts[key] = attempt  # pylint: disable=protected-access
                table.running[_index] = (_closure_name(closure), time.time(), time.monotonic(), attempt)
            try:
                return _original(closure)
            finally:
                with table.lock:
                    table.running.pop(_index, None)
                    table.finished += 1
                    table.last_progress = time.monotonic()
                    if not _requeued(queue, closure):  # done for good: forget its attempts
                        table._attempts.pop(key, None)  # pylint: disable=protected-access

        worker._process_closure = process  # pylint: disable=protected-access
    cluster._tf_psx_closure_table = table  # pylint: disable=protected-access
    return table


def _requeued(queue, closure) -> bool:
    """True when `closure` waits in the queue again (put back after a failure)."""
    with queue._queue_lock:  # pylint: disable=protected-access
        return any(item is closure for item in list(queue._queue.queue))  # pylint: disable=protected-access
