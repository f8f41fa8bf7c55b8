"""Thin subclasses of TF's parameter-server and central-storage strategies.

`isinstance(s, tf.distribute.ParameterServerStrategy)` holds for
`tf_psx.ParameterServerStrategy`, so tf-keras treats it exactly as TF's own.
What is added: the cluster may be given in more ways, partitioners may be spec
strings, the evaluator never enters the training cluster, `.coordinator`, and
errors that name the fix for Keras 3 and for resources made before the
cluster was connected.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import tensorflow as tf

from tf_psx import _checks, _quiet
from tf_psx import partitioners as _partitioners, weights as _weights
from tf_psx._tf import fit_inputs as _fit_inputs, keras as _tf_keras, runtime as _runtime
from tf_psx._tf import lookup_layers as _lookup_layers, tfra as _tfra
from tf_psx._tf import captured_datasets as _captured_datasets, loss_reduction as _loss_reduction
from tf_psx._tf import metric_results as _metric_results
from tf_psx._tf import versions as _versions, weights as _weights_hook
from tf_psx.cluster import ClusterConfig
from tf_psx.cluster.config import ClusterSource
from tf_psx.cluster.ports import address_listens
from tf_psx.errors import ArgumentError, ArgumentTypeError, ClusterUnreachableError, Keras3Error, LocalResourcesError, TFConfigError
from tf_psx.tables import tfra_updates as _tfra_updates
from tf_psx.training import exact_compile as _exact_compile, exact_updates as _exact_updates
from tf_psx.training import sync_training as _sync_training

__all__ = [
    "ParameterServerStrategy",
    "CentralStorageStrategy",
    "auto_strategy",
    "LocalResourcesError",
    "ClusterUnreachableError",
]

logger = logging.getLogger("tf_psx")

LOCAL_RESOURCES_FIX = (
    "A model, variable or TFRA table was created in this process before it connected to the "
    "cluster, so it lives on /job:localhost, which the cluster does not know. Fix: create the "
    "LocalCluster and the strategy before building any model (in a notebook: restart the kernel, "
    "then run the cluster cell first)."
)


# Tasks that run a server, never the training script.
_SERVER_TASKS = ("worker", "ps")


# TF's connection to a cluster whose tasks never come up blocks forever in
# context initialisation. A minute covers tasks started just before the
# chief on a loaded machine (importing TF takes 3 to 20 s).
CONNECT_TIMEOUT_S = 60.0
# How often an unreachable task is tried again while waiting.
CONNECT_POLL_S = 0.5
# How long a sync step waits for a slot's gradient before reassigning it.
SYNC_TIMEOUT_S = 60.0


# A line says which tasks the strategy still waits for, this often.
WAIT_NOTICE_S = 10.0


def wait_until_reachable(jobs: dict, timeout_s: float) -> None:
    """Waits until every worker and ps address of `jobs` accepts TCP connections.

    Args:
      jobs: a cluster spec as a dict, {"worker": [...], "ps": [...], ...}.
      timeout_s: the bound on the wait, in seconds.

    Raises:
      ClusterUnreachableError: naming each task that did not listen in time.
    """
    pending = [(job, i, address) for job in _SERVER_TASKS for i, address in enumerate(jobs.get(job, []))]
    start = time.monotonic()
    deadline = start + timeout_s
    said = 0
    while True:
        pending = [task for task in pending if not address_listens(task[2])]
        if not pending:
            return
        waited = time.monotonic() - start
        if waited >= (said + 1) * WAIT_NOTICE_S:
            said = int(waited // WAIT_NOTICE_S)
            names = ", ".join(f"{job}:{i} at {address}" for job, i, address in pending)
            logger.info("waiting for %s (%d s of %d)", names, waited, timeout_s)
        if time.monotonic() >= deadline:
            names = ", ".join(f"{job}:{i} at {address}" for job, i, address in pending)
            raise ClusterUnreachableError(
                f"No connection to {names} within {timeout_s:.0f} s. Fix: start those tasks "
                "(`python -m tf_psx.server` with their TF_CONFIG, or `tf-psx launch`), check the "
                "addresses in TF_CONFIG, or wait longer with ParameterServerStrategy(connect_timeout_s=...)."
            )
        time.sleep(CONNECT_POLL_S)


def keep_alive_seconds() -> int:
    """How long the tasks keep a departed coordinator's variables: $TF_PSX_KEEP_ALIVE_S, else 60 s.

    Raises:
      ValueError: $TF_PSX_KEEP_ALIVE_S is set and is not an int >= 1.
    """
    seconds = _checks.int_from_env(_runtime.KEEP_ALIVE_ENV, 1, _runtime.KEEP_ALIVE_S)
    return _runtime.KEEP_ALIVE_S if seconds is None else seconds


def _resolver_from(cluster: Any):
    """Returns (resolver, ClusterConfig or None) for every accepted `cluster`."""
    resolvers = tf.distribute.cluster_resolver
    if cluster is None or isinstance(cluster, (str, dict)):
        cluster = ClusterConfig.from_tf_config(cluster)
    if isinstance(cluster, ClusterSource):  # a tf_psx.LocalCluster: started here if needed
        cluster = cluster.running_config()
    if isinstance(cluster, ClusterConfig):
        cluster.validate_for_parameter_server()
        if cluster.task_type in _SERVER_TASKS:
            raise TFConfigError(
                f'TF_CONFIG["task"]["type"] must be "chief" (or absent) in the process that builds '
                f'the strategy; this task is "{cluster.task_type}". Fix: run `python -m tf_psx.server` '
                "for ps and worker tasks (or use `tf-psx launch`); only the chief runs the training script."
            )
        # The resolver is built from our spec, never from TF_CONFIG directly:
        # ours leaves the evaluator out (tensorflow#46169: it hangs the
        # coordinator when it is in the training cluster).
        # The coordinator is the chief; with no chief in the spec TF adds one
        # on a free local port, so task_type stays unset.
        in_spec = cluster.task_type in ("chief", "worker", "ps")
        resolver = resolvers.SimpleClusterResolver(
            cluster.cluster_spec(),
            task_type=cluster.task_type if in_spec else None,
            task_id=cluster.task_index if in_spec else None,
            rpc_layer="grpc",
        )
        return resolver, cluster
    if isinstance(cluster, resolvers.ClusterResolver):
        return cluster, None
    raise ArgumentTypeError(
        "Argument `cluster_resolver` must be None (read TF_CONFIG), a tf_psx.ClusterConfig, a "
        f"tf_psx.LocalCluster or a tf.distribute.cluster_resolver.ClusterResolver. Received: {cluster!r}."
    )


def _check_resolver(resolver) -> None:
    jobs = resolver.cluster_spec().as_dict()
    for job in ("worker", "ps"):
        if not jobs.get(job):
            raise TFConfigError(
                f'The cluster must have at least one "{job}" task for parameter-server training; '
                f"received jobs {sorted(jobs)}. Fix: add {job} addresses to the cluster."
            )
    if "evaluator" in jobs:
        raise TFConfigError(
            'The training cluster must not contain "evaluator" (it hangs the coordinator, '
            f"tensorflow#46169); received jobs {sorted(jobs)}. Fix: pass a tf_psx.ClusterConfig, "
            "which keeps the evaluator out."
        )


# Marks an alias keyword that was not given (None is a meaningful value).
_UNSET = object()


def _one_of(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if alias_value is _UNSET:
        return value
    if value is not None:
        raise ArgumentTypeError(
            f"Arguments `{name}` and `{alias}` name the same thing; pass one of them. "
            f"Received: {name}={value!r}, {alias}={alias_value!r}."
        )
    return alias_value


def _partitioner_from(partitioner: Any, num_ps: int):
    if partitioner is None or callable(partitioner) and not isinstance(partitioner, str):
        if isinstance(partitioner, _partitioners.PerPSPartitioner) and partitioner.num_ps is None:
            # A bound copy: the caller's object stays unbound, so it can serve
            # the next strategy (a notebook cell rerun with another ps count).
            return copy.copy(partitioner).bind(num_ps)
        return partitioner
    if isinstance(partitioner, str):
        return _partitioners.from_spec(partitioner, num_ps=num_ps)
    raise ArgumentTypeError(
        "Argument `variable_partitioner` must be None, a partitioner object or a spec string such as "
        f"{', '.join(_partitioners.SPEC_FORMS)}. Received: {partitioner!r}."
    )


class ParameterServerStrategy(tf.distribute.ParameterServerStrategy):
    """TF's ParameterServerStrategy, with friendlier inputs.

    Example (see examples/quickstart.py for a whole run):

    >>> import tf_psx, tensorflow as tf
    >>> cluster = tf_psx.LocalCluster(num_workers=1, num_ps=1)   # doctest: +SKIP
    >>> strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")  # doctest: +SKIP
    >>> with strategy.scope():                                   # doctest: +SKIP
    ...     model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    ...     model.compile("adagrad", "mse", steps_per_execution=8)

    Args:
      cluster_resolver: where the cluster is. As in TF, a
        `tf.distribute.cluster_resolver.ClusterResolver`; also None (read
        `TF_CONFIG`), a TF_CONFIG dict or JSON string, a `tf_psx.ClusterConfig`
        or a `tf_psx.LocalCluster` (started if needed). `cluster=` is an alias.
      variable_partitioner: as in TF, None (no sharding) or a partitioner
        callable; also a spec string (`tf_psx.partitioners.SPEC_FORMS`, e.g.
        "fixed:4", "min_size:256k"). `partitioner=` is an alias.
      exact_updates: apply each variable's optimizer update as one unit, so
        that several async workers never lose or double an update (see
        `tf_psx.training.exact_updates`). True by default; False gives TF's own
        update path.
      connect_timeout_s: how long to wait for every worker and ps task to
        accept connections before raising `ClusterUnreachableError` (TF's
        own connection waits forever); None waits as TF does.
      sync: False (TF's asynchronous training), True (synchronous: each
        step applies the mean of `replicas_to_aggregate` gradients, all
        computed from the same parameters, so N workers of batch b train as
        one worker of batch N*b), or "switchable" (starts asynchronous;
        `set_sync` or `tf_psx.callbacks.SyncSwitch` switch it). See
        docs/guides/sync.md.
      replicas_to_aggregate: with `sync`, the gradients one step applies,
        1 to the number of workers (the default). With fewer than the
        workers, the rest are backups: a step applies once the first
        `replicas_to_aggregate` gradients arrive, and the late ones are
        dropped and counted (`sync_stats()["dropped"]`).
      sync_timeout_s: with `sync`, how long a step waits for a worker that
        took a slot and sent no gradient (it died) before the slot goes to
        another worker; also how long `fit` waits when no worker is
        reachable before raising `SyncStepError`.

    `model.evaluate(dataset)` of a finite `tf.data.Dataset` with no `steps`
    (and `fit`'s `validation_data`) uses tf-keras's exact evaluation, every
    element once, unless `compile(pss_evaluation_shards=...)` chose
    otherwise; TF alone fails with `CancelledError` (tf_psx._tf.evaluation).
    `model.fit` of arrays, or of a finite dataset with no `steps_per_epoch`,
    runs one pass of the data per epoch, each worker reading its own part;
    TF alone fails on both (tf_psx._tf.fit_inputs).

    Attributes:
      exact_updates: as passed.
      exact_evaluation: True: evaluate finite datasets as above.
      sync_controller: the sync state (None when `sync=False`).
      num_workers: the worker tasks of the cluster.
      cluster_config: the `tf_psx.ClusterConfig`, or None when a resolver
        was given.

    Raises:
      ClusterUnreachableError: a task did not listen within `connect_timeout_s`.
      TFConfigError: the cluster has no worker or no ps, or TF_CONFIG is bad.
      ValueError: a malformed partitioner spec.
      TypeError: an argument given twice (`cluster_resolver` and `cluster`,
        or `variable_partitioner` and `partitioner`).

    Known limitations:
      * Needs tf-keras (Keras 2) for `model.fit`; Keras 3 models get a
        `Keras3Error` that names the fix.
      * Resources made before the strategy connects to the cluster live on
        `/job:localhost` and cannot be used on it (`LocalResourcesError`).
      * With `exact_updates`, two updates of the same variable shard wait on
        each other (a lock on its ps task); updates of different shards do not.
      * The tasks keep a coordinator's variables until 60 s after its last
        RPC (TF's own default is 600 s; $TF_PSX_KEEP_ALIVE_S changes it): a
        coordinator that crashed or was restarted leaves its copies on the
        ps that long, and a task frozen or cut off for longer forgets the
        live coordinator's context (its steps then fail and are retried).
    """

    def __init__(
        self,
        cluster_resolver: Any = None,
        variable_partitioner: Any = None,
        *,
        cluster: Any = _UNSET,
        partitioner: Any = _UNSET,
        exact_updates: bool = True,
        connect_timeout_s: float | None = CONNECT_TIMEOUT_S,
        sync: bool | str = False,
        replicas_to_aggregate: int | None = None,
        sync_timeout_s: float = SYNC_TIMEOUT_S,
    ):
        cluster_resolver = _one_of("cluster_resolver", cluster_resolver, "cluster", cluster)
        variable_partitioner = _one_of("variable_partitioner", variable_partitioner, "partitioner", partitioner)
        if not isinstance(exact_updates, bool):
            raise ArgumentTypeError(f"Argument `exact_updates` must be True or False. Received: {exact_updates!r}.")
        _check_sync_arguments(sync, replicas_to_aggregate, sync_timeout_s)
        resolver, config = _resolver_from(cluster_resolver)
        _check_resolver(resolver)
        workers = resolver.cluster_spec().as_dict()["worker"]
        replicas_to_aggregate = _check_replicas(sync, replicas_to_aggregate, len(workers))
        self.cluster_config = config
        num_ps = len(resolver.cluster_spec().as_dict()["ps"])
        variable_partitioner = _partitioner_from(variable_partitioner, num_ps)
        _runtime.set_grpc_fail_fast()
        _runtime.shorten_keep_alive(keep_alive_seconds())
        # A cluster that is not up is the first thing to fix: said before any check of this process.
        if connect_timeout_s is not None:
            wait_until_reachable(resolver.cluster_spec().as_dict(), connect_timeout_s)
        _check_no_local_tables()
        # Connecting initializes TF's devices: TF 2.21 logs a native cuInit error there on a machine without
        # CUDA, which no log level set after TF's import reaches (tf_psx._quiet drops the known lines).
        with _quiet.native_stderr_filtered():
            super().__init__(resolver, variable_partitioner=variable_partitioner)
        self.exact_updates = exact_updates
        self.num_workers = len(resolver.cluster_spec().as_dict()["worker"])
        if exact_updates:
            _exact_updates.install()
        _exact_compile.install_compile_warning()
        _weights_hook.install(_weights.convert, _weights.whole_values)
        # fit's and evaluate's input read by the coordinator, sent with each step (tf_psx._tf.fit_inputs).
        _fit_inputs.install()
        _quiet.install_log_filter()
        # Models with TFRA's own layers: exact table updates at compile (tf_psx.training.exact_updates).
        _tfra_updates.install_tfra_optimizer_hook()
        _install_tfra_shadows_if_imported()
        # Lookup layers in exact evaluation's loop (tf_psx._tf.lookup_layers).
        _lookup_layers.install()
        # A loss object of default reduction in a model's own train_step: each worker's step is one replica.
        _loss_reduction.install(lambda strategy: isinstance(strategy, ParameterServerStrategy))
        # A dataset of the coordinator used inside a step (TFRS's FactorizedTopK candidates): rebuilt in the step.
        _captured_datasets.install()
        # fit's and evaluate's logs: the metrics' state over the epoch, also beside keys that are not metrics (TFRS).
        _metric_results.install()
        self.sync_controller = None
        if sync is not False:
            _sync_training.install()
            self.sync_controller = _sync_training.SyncController(
                self, enabled=sync is True, replicas_to_aggregate=replicas_to_aggregate,
                timeout_s=sync_timeout_s, worker_addresses=list(workers),
                address_listens=address_listens)

    def scope(self):  # pylint: disable=useless-parent-delegation
        """As TF's `scope`; TFRA imported since the strategy was made gets per-worker shadows first."""
        _install_tfra_shadows_if_imported()
        return super().scope()

    def run(self, fn, args=(), kwargs=None, options=None):
        """As TF's `run`; in sync mode the step first claims its place in a sync step."""
        fn = _versions.step_converted(fn)  # a model's own train_step converted on TF 2.21 too (tf_psx._tf.versions)
        if self.sync_controller is not None:
            fn = self.sync_controller.wrap_step(fn)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def _sync_or_raise(self, what: str) -> "_sync_training.SyncController":
        if self.sync_controller is None:
            raise ArgumentError(
                f"{what} needs a strategy made with sync=True or sync=\"switchable\"; this one has sync=False. "
                "Fix: tf_psx.ParameterServerStrategy(cluster, sync=\"switchable\")."
            )
        return self.sync_controller

    def set_sync(self, enabled: bool) -> None:
        """Switches between synchronous and asynchronous steps.

        Waits for the steps in flight, applies a partial sync step (fewer
        than `replicas_to_aggregate` gradients), then switches: every batch
        is applied once. Call it between steps, from the coordinator (a
        callback's batch hook is such a place).
        """
        if not isinstance(enabled, bool):
            raise ArgumentTypeError(f"Argument `enabled` of set_sync must be True or False. Received: {enabled!r}.")
        self._sync_or_raise("set_sync").flush(enable=enabled)

    def flush_sync(self) -> None:
        """Applies a partial sync step now (fit does this when it ends; a custom loop calls it after join)."""
        self._sync_or_raise("flush_sync").flush()

    def sync_stats(self) -> dict:
        """The sync state: enabled, version, pending, dropped, reassigned, applied_batches, applied_steps."""
        return self._sync_or_raise("sync_stats").stats()

    def sync_version(self):
        """Inside a step: the sync step (an int64 tensor) its gradient belongs to; -1 for an async step.

        Only valid in a function passed to `run`, with `sync` on.
        """
        version = self._sync_or_raise("sync_version").current_version()
        if version is None:
            raise ArgumentError("sync_version() is only valid inside a function passed to strategy.run.")
        return version

    @property
    def coordinator(self) -> tf.distribute.experimental.coordinator.ClusterCoordinator:
        """The strategy's ClusterCoordinator, created on first use and then reused."""
        # ClusterCoordinator keeps one instance per strategy (its __new__),
        # so this is the same object tf-keras's fit uses.
        return _runtime.coordinator_of(self)

    def experimental_distribute_dataset(self, dataset, options=None):
        _raise_if_keras3_caller()
        return super().experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        _raise_if_keras3_caller()
        return super().distribute_datasets_from_function(dataset_fn, options)

    @staticmethod
    def check_model(model) -> None:
        """Raises `Keras3Error` when `model` is a Keras 3 model (not tf-keras)."""
        _tf_keras.check_not_keras3(model)


# Called inside a user's tf.function (a custom loop's `strategy.run`), these run as TF's own methods do:
# unconverted by AutoGraph, the user's step converted by TF's `run` (on TF 2.21 AutoGraph's conversion of
# `super().run` here called the wrong method: "tf__scope() got an unexpected keyword argument 'args'").
for _name in ("run", "scope", "sync_version"):
    setattr(ParameterServerStrategy, _name, _versions.autograph_artifact(getattr(ParameterServerStrategy, _name)))


def _check_sync_arguments(sync, replicas_to_aggregate, timeout_s) -> None:
    if not (sync is True or sync is False or sync == "switchable"):
        raise ArgumentError(
            f'Argument `sync` must be False, True or "switchable". Received: {sync!r}. Fix: sync=True for '
            'synchronous steps, sync="switchable" to start async and switch later.'
        )
    if sync is False and replicas_to_aggregate is not None:
        raise ArgumentError(
            f"Argument `replicas_to_aggregate` ({replicas_to_aggregate!r}) needs sync=True or "
            'sync="switchable". Fix: pass sync=True, or drop replicas_to_aggregate.'
        )
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ArgumentError(f"Argument `sync_timeout_s` must be a number of seconds > 0. Received: {timeout_s!r}.")


def _check_replicas(sync, replicas_to_aggregate, num_workers: int) -> int:
    if sync is False:
        return num_workers
    if replicas_to_aggregate is None:
        return num_workers
    if isinstance(replicas_to_aggregate, bool) or not isinstance(replicas_to_aggregate, int) \
            or not 1 <= replicas_to_aggregate <= num_workers:
        raise ArgumentError(
            f"Argument `replicas_to_aggregate` must be an int from 1 to the number of workers ({num_workers}). "
            f"Received: {replicas_to_aggregate!r}. Fix: pass e.g. replicas_to_aggregate={max(1, num_workers - 1)} "
            "for one backup worker, or leave it None to aggregate every worker."
        )
    return replicas_to_aggregate


def _install_tfra_shadows_if_imported() -> None:
    """Per-worker shadow buffers for every TFRA layer built under the strategy, once TFRA is imported.

    TFRA's own layers (`de.keras.layers.Embedding`, `SquashedEmbedding`) keep
    each step's rows in shadow variables that all workers shared: with 2
    workers, TFRA's own parameter-server demo failed with shape errors. TFRA
    is never imported here (it is slow and patches TF): only when the user
    already did.
    """
    import sys  # pylint: disable=import-outside-toplevel

    if "tensorflow_recommenders_addons" in sys.modules:
        from tf_psx._tf import shadows as _shadows  # pylint: disable=import-outside-toplevel

        _shadows.install_per_worker_shadows()


def _check_no_local_tables() -> None:
    if _runtime.connected_to_cluster():
        return  # tables made since then were made for the cluster
    count = _tfra.live_tfra_variables()
    if count:
        raise LocalResourcesError(
            f"{count} TFRA dynamic-embedding variable(s) already exist in this process. "
            + LOCAL_RESOURCES_FIX
        )


def _raise_if_keras3_caller() -> None:
    caller = _tf_keras.keras3_caller()
    if caller is not None:
        raise Keras3Error(
            f"Keras 3 ({caller}) called model.fit under tf_psx.ParameterServerStrategy. "
            + _tf_keras.KERAS3_FIX
        )


def _local_gpus() -> list[str]:
    return [d.name for d in tf.config.list_logical_devices("GPU")]


class CentralStorageStrategy(tf.distribute.experimental.CentralStorageStrategy):
    """TF's experimental CentralStorageStrategy, on the GPUs when there are any.

    Variables live on `parameter_device`; each compute device runs a replica
    and the gradients are summed before the update, so one step with global
    batch B equals a single-device step with batch B.

    Example:

    >>> import tf_psx
    >>> strategy = tf_psx.CentralStorageStrategy()
    >>> strategy.num_replicas_in_sync >= 1
    True

    Args:
      compute_devices: device names; all local GPUs, or the CPU when there
        are none, when None.
      parameter_device: where variables live; the CPU when there are several
        compute devices, else the single compute device (TF's default).
    """

    def __init__(self, compute_devices: list[str] | None = None, parameter_device: str | None = None):
        if compute_devices is None:
            compute_devices = _local_gpus() or ["/device:CPU:0"]
        if isinstance(compute_devices, str) or not list(compute_devices):
            raise ArgumentError(
                "Argument `compute_devices` must be a non-empty list of device names such as "
                f'["/gpu:0", "/gpu:1"]. Received: {compute_devices!r}.'
            )
        super().__init__(compute_devices=list(compute_devices), parameter_device=parameter_device)
        if os.environ.get("TF_CONFIG"):
            # Under `tf-psx launch` the chief runs this script; the launched tasks stay idle.
            logger.warning("CentralStorageStrategy trains in this process on %s; the cluster of TF_CONFIG is not "
                           "used (its ps and worker tasks stay idle). For a cluster, use "
                           "tf_psx.ParameterServerStrategy() or tf_psx.auto_strategy().", list(compute_devices))


def auto_strategy(tf_config: Any = None) -> tf.distribute.Strategy:
    """Picks a strategy from the environment, and logs which and why.

    * a TF_CONFIG with ps tasks: `tf_psx.ParameterServerStrategy`;
    * else two or more GPUs: `tf_psx.CentralStorageStrategy`;
    * else the default strategy.

    Example:

    >>> import tf_psx, tensorflow as tf
    >>> strategy = tf_psx.auto_strategy(tf_config="")  # no TF_CONFIG, no GPUs here
    >>> strategy is tf.distribute.get_strategy()  # the default strategy
    True

    Args:
      tf_config: a TF_CONFIG value (dict or JSON); the environment's when None;
        an empty string means "no TF_CONFIG".

    Returns:
      A `tf.distribute.Strategy`.
    """
    import os  # pylint: disable=import-outside-toplevel

    raw = os.environ.get("TF_CONFIG", "") if tf_config is None else tf_config
    if raw:
        config = ClusterConfig.from_tf_config(raw)
        if config.num_ps > 0:
            logger.info("auto_strategy: TF_CONFIG has %d ps task(s): ParameterServerStrategy", config.num_ps)
            return ParameterServerStrategy(config)
        logger.info("auto_strategy: TF_CONFIG has no ps task; looking at local devices")
    gpus = _local_gpus()
    if len(gpus) >= 2:
        logger.info("auto_strategy: %d GPUs and no ps: CentralStorageStrategy", len(gpus))
        return CentralStorageStrategy(gpus)
    logger.info("auto_strategy: no ps task and %d GPU(s): the default strategy", len(gpus))
    return tf.distribute.get_strategy()
