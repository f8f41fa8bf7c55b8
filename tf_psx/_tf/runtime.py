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
