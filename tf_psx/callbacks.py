"""Keras callbacks that make asynchronous parameter-server training predictable.

* `PeriodicSync`: every N steps, a barrier and an atomic snapshot (model,
  optimizer slots, step counter, DynamicEmbedding tables); `fit` resumes from
  the newest complete snapshot, skipping the steps already done.
* `StalenessBound`: measures how stale each gradient is (a version counter on
  a ps task) and drops or down-weights gradients that are too stale.
* `ClusterMonitor`: TensorBoard scalars for the cluster (throughput, bytes
  per ps task, gradient sparsity, staleness, snapshot time, retried closures,
  ps memory, rows per hash table and rows evicted).
* `TableEviction`: applies the eviction of `DynamicEmbedding` tables
  (`max_age_steps`, `max_rows`, the disk tier) every N steps or seconds.

All three run their batch hooks under `ParameterServerStrategy` (they accept
remote values: `_supports_tf_logs`). The per-step measurements are made by one
shared probe per model (`_StepProbe`), which wraps `train_step` and the
optimizer's apply through `tf_psx._tf.fit_hooks`; the public classes only configure
it and read it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
import uuid
import weakref
from typing import Any, Literal

import numpy as np
import tensorflow as tf

from tf_psx.errors import SnapshotDirectoryError
from tf_psx import _checks, deltas as _deltas, metrics as _metrics, optimizers as _optimizers, stalls as _stalls
from tf_psx import snapshots as _snapshots, tables as _tables
from tf_psx._tf import checkpoint as _checkpoint, exact_updates as _exact_updates, fit_hooks as _fit_hooks
from tf_psx._tf import keras as _tf_keras, runtime as _runtime, tfra as _tfra

__all__ = ["StalenessBound", "PeriodicSync", "ClusterMonitor", "TableEviction", "SyncSwitch", "Snapshot"]

# The snapshot format lives in tf_psx.snapshots; these names stay here too.
Snapshot = _snapshots.Snapshot
SNAPSHOT_PREFIX = _snapshots.SNAPSHOT_PREFIX
TMP_PREFIX = _snapshots.TMP_PREFIX
MANIFEST = _snapshots.MANIFEST
CHECKPOINT_NAME = _snapshots.CHECKPOINT_NAME

logger = logging.getLogger("tf_psx")
_keras = _tf_keras.keras()

Policy = Literal["drop", "scale"]
POLICIES = ("drop", "scale")
# Staleness values are counted exactly up to STALENESS_BINS - 1; larger ones
# share the last bin. A step is rarely staler than a few times the number of
# workers, so 64 bins are exact for clusters of up to about 20 workers.
STALENESS_BINS = 64
# Layout of the probe's one vector of additive counters (`_StepProbe.counts`).
_STEPS, _EXAMPLES, _STALENESS_SUM, _DROPPED, _GRADIENT_NORM = 0, 1, 2, 3, 4
_HISTOGRAM_AT = 5
# The gradient norms are summed in an int64 slot as integer multiples of this
# (a millionth: norms below it read as 0; a sum up to 9e12 fits).
_NORM_UNIT = 1e-6
_NORM_MAX_UNITS = 1e15  # a norm of 1e9 per step; 9,000 such steps still fit in an int64
_ROWS_AT = _HISTOGRAM_AT + STALENESS_BINS  # then one slot per embedding layer
# The tensor of a TF2 checkpoint that holds its object graph (TF's
# `trackable.base.OBJECT_GRAPH_PROTO_KEY`): reading it checks that the index
# and the data file can be opened before anything is restored.
_OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
# An error names at most this many objects a snapshot did not restore: enough
# to recognise the model, short enough to read in a log.
_NAMES_SHOWN = 10
# ClusterMonitor: often enough to see a trend within one epoch of a test run,
# rare enough that its few small remote reads cost < 1 % of steps.
DEFAULT_MONITOR_STEPS = 100
# StallDoctor: 10 minutes without a finished step. Far above a first trace
# (~20 s on 2 cores) and the time TF takes to notice a dead worker and re-run
# its step elsewhere, so a report means a real stall.
DEFAULT_STALL_TIMEOUT_S = 600.0
# Bytes of one TFRA table key (int64).
_TFRA_KEY_BYTES = 8
_PS_TASK_RE = re.compile(r"/job:ps/replica:\d+/task:(\d+)")


def _check_path(owner: str, name: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ValueError(
            f"Argument `{name}` of {owner} must be a non-empty directory path (str or os.PathLike). "
            f"Received: {value!r}. Fix: pass e.g. {name}=\"/tmp/run1\"."
        )
    return os.fspath(value)


def _ps_task(device: str) -> int | None:
    match = _PS_TASK_RE.search(device or "")
    return int(match.group(1)) if match else None


def _components(variable) -> list:
    """The real variables behind `variable` (the shards of a ShardedVariable)."""
    return list(getattr(variable, "variables", None) or [variable]) if _is_sharded(variable) else [variable]


def _is_sharded(variable) -> bool:
    return isinstance(variable, tf.__internal__.distribute.ShardedVariable)


# ----------------------------------------------------------------------------
# The shared per-model probe.


class _StepProbe:
    """Counters on the ps tasks, updated by every training step of one model.

    Installed by whichever callback needs it, removed when the last one is
    done. Under ParameterServerStrategy the counters live on one ps task (the
    version counter's), so the steps of every worker update the same
    counters. The additive ones are one int64 vector (`counts`, layout in
    `_STEPS` .. `_ROWS_AT`) that a step updates with one op. Under a strategy
    with one replica and no coordinator (the default strategy) only the
    examples, steps and rows counters move; staleness is 0 by construction
    there.
    """

    def __init__(self, model):
        self._model = weakref.ref(model)
        strategy = model.distribute_strategy
        self.is_ps = _runtime.is_parameter_server_strategy(strategy)
        self.enabled = self.is_ps or strategy.num_replicas_in_sync == 1
        self.policy: tuple[str, int] | None = None
        self._holders: dict[int, tuple[str, int] | None] = {}
        self._installed: tuple | None = None
        self._undo: list = []
        self._frames: list[dict] = []
        self._epoch_key = None
        self.groups: dict[int, str] = {}  # id(variable) -> embedding name
        self.embedding_rows: dict[str, Any] = {}  # name -> int rows, or a DynamicEmbedding layer
        self._keep_alive: list = []
        if not self.enabled:
            return
        embeddings = list(self._embeddings(model))
        scope = strategy.scope() if self.is_ps else _NullScope()
        with scope:
            def counter(name, shape=()):
                return tf.Variable(tf.zeros(shape, tf.int64), trainable=False, name=f"tf_psx_{name}")

            self.version = counter("version")
            # Everything else sits on the version's ps task (one task to
            # talk to per step); colocated variables are never partitioned.
            colocate = strategy.extended.colocate_vars_with(self.version) if self.is_ps else _NullScope()
            with colocate:
                # steps, examples, staleness sum, dropped, histogram, rows touched per
                # embedding: one vector, so that a step adds to all of them in one op.
                self.counts = counter("counts", [_ROWS_AT + len(embeddings)])
                self.epoch_max = counter("staleness_epoch_max", [1])
            self.rows = {}  # embedding name -> its index in `counts`
            for name, variables, rows in embeddings:
                self.rows[name] = _ROWS_AT + len(self.rows)
                self.embedding_rows[name] = rows
                for variable in variables:
                    for component in [variable, *_components(variable)]:
                        self.groups[id(component)] = name
                        self._keep_alive.append(component)

    @staticmethod
    def _embeddings(model):
        from tf_psx.layers import DynamicEmbedding  # pylint: disable=import-outside-toplevel

        seen = set()
        for layer in [model, *model.submodules]:
            if id(layer) in seen:
                continue
            seen.add(id(layer))
            if isinstance(layer, DynamicEmbedding):
                yield layer.name, list(layer.trainable_weights), layer
            elif isinstance(layer, _keras.layers.Embedding):
                yield layer.name, list(layer.trainable_weights), int(layer.input_dim)

    # -- configuration -------------------------------------------------------

    def acquire(self, holder, policy: tuple[str, int] | None = None) -> None:
        self._holders[id(holder)] = policy
        policies = [p for p in self._holders.values() if p is not None]
        if len(set(policies)) > 1:
            raise ValueError(
                f"Two StalenessBound callbacks with different settings were passed to one fit: {sorted(set(policies))}. "
                "Fix: pass one StalenessBound."
            )
        self.policy = policies[0] if policies else None
        self._install()

    def release(self, holder) -> None:
        self._holders.pop(id(holder), None)
        if not self._holders:
            self._uninstall()

    def _install(self) -> None:
        model = self._model()
        if not self.enabled or model is None:
            return
        wanted = (self.policy, id(model.optimizer))
        if self._installed == wanted:
            return
        self._uninstall(rebuild=False)
        self._undo = [
            _fit_hooks.wrap_train_step(model, self._wrap_train_step),
            _fit_hooks.wrap_optimizer_apply(model.optimizer, self._wrap_apply),
        ]
        self._installed = wanted
        _fit_hooks.rebuild_train_function(model)

    def _uninstall(self, rebuild: bool = True) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        if self._installed is not None and rebuild and self._model() is not None:
            _fit_hooks.forget_train_function(self._model())
        self._installed = None

    # -- the wrappers (run while tf.function traces a step) ------------------

    def _wrap_train_step(self, original):
        def train_step(data):
            frame: dict = {"measures": [], "rows": [], "norms": []}
            deps = []
            if self.is_ps:
                # Read the version before any parameter: the control
                # dependency makes every read inside the step wait for it.
                # (The identity brings it over once; the step's ops depend
                # on the local copy.)
                frame["version"] = self.version.read_value()
                deps.append(tf.identity(frame["version"]))
            self._frames.append(frame)
            try:
                with tf.control_dependencies(deps):
                    outputs = original(data)
            finally:
                self._frames.pop()
            first = tf.nest.flatten(data)[0]
            with tf.control_dependencies(tf.nest.flatten(outputs)):
                self.counts.assign_add(self._delta(frame, tf.cast(tf.shape(first)[0], tf.int64)))
            return outputs

        return train_step

    def _delta(self, frame: dict, examples):
        """What one step adds to `counts` (one dense int64 vector)."""
        zero = tf.constant(0, tf.int64)
        staleness_sum, dropped, histogram = zero, zero, tf.zeros([STALENESS_BINS], tf.int64)
        for staleness, applied in frame["measures"]:
            staleness_sum += staleness
            dropped += 1 - applied
            histogram += tf.one_hot(tf.minimum(staleness, STALENESS_BINS - 1), STALENESS_BINS, dtype=tf.int64)
        rows = [zero] * len(self.rows)
        for index, touched in frame["rows"]:
            rows[index - _ROWS_AT] += touched
        norm = tf.add_n(frame["norms"]) if frame["norms"] else tf.constant(0.0)
        # Non-finite norms count as 0 and huge ones are clipped, so that one step cannot spoil the sum.
        norm = tf.clip_by_value(tf.where(tf.math.is_finite(norm), norm, 0.0) / _NORM_UNIT, 0.0, _NORM_MAX_UNITS)
        norm = tf.cast(tf.round(norm), tf.int64)
        head = tf.stack([tf.constant(1, tf.int64), examples, staleness_sum, dropped, norm])
        return tf.concat([head, histogram, tf.stack(rows)] if rows else [head, histogram], 0)

    def _wrap_apply(self, original):
        def apply(distribution, grads_and_vars, **kwargs):
            if not self._frames:  # an apply outside fit's train_step
                return original(distribution, grads_and_vars, **kwargs)
            frame = self._frames[-1]
            grads_and_vars = list(grads_and_vars)
            frame["rows"] += self._record_rows(grads_and_vars)
            frame["norms"].append(_global_norm([g for g, _ in grads_and_vars if g is not None]))
            if not self.is_ps:
                return original(distribution, grads_and_vars, **kwargs)
            name, bound = self.policy or ("none", 0)
            ready = tf.group(*[g.values if isinstance(g, tf.IndexedSlices) else g
                               for g, _ in grads_and_vars if g is not None])
            if name == "none":
                # Only measured: the increment after the apply also reads the
                # version (updates by others up to then count, as with a read
                # right before the apply, plus those during it).
                with tf.control_dependencies([ready, original(distribution, grads_and_vars, **kwargs)]):
                    now = self.version.assign_add(1, read_value=True) - 1
                staleness = tf.maximum(now - frame["version"], 0)
                applied = tf.constant(1, tf.int64)
                frame["measures"].append((staleness, applied))
                record = self.epoch_max.scatter_max(
                    tf.IndexedSlices(tf.reshape(staleness, [1]), tf.zeros([1], tf.int64)))
                with tf.control_dependencies([record]):
                    return now + 1
            # The version is read once the gradients exist, right before the apply.
            with tf.control_dependencies([ready]):
                now = self.version.read_value()
            staleness = tf.maximum(now - frame["version"], 0)
            record = self.epoch_max.scatter_max(tf.IndexedSlices(tf.reshape(staleness, [1]), tf.zeros([1], tf.int64)))
            if name == "scale":
                factor = _scale_factor(staleness, bound)
                grads_and_vars = [(_scaled(g, factor), v) for g, v in grads_and_vars]
            if name == "drop":
                def apply_update():
                    with tf.control_dependencies([original(distribution, grads_and_vars, **kwargs)]):
                        return tf.constant(1, tf.int64)

                applied = tf.cond(staleness <= bound, apply_update, lambda: tf.constant(0, tf.int64))
            else:
                with tf.control_dependencies([original(distribution, grads_and_vars, **kwargs)]):
                    applied = tf.constant(1, tf.int64)
            frame["measures"].append((staleness, applied))
            with tf.control_dependencies([record]):
                return self.version.assign_add(applied)

        return apply

    def _record_rows(self, grads_and_vars) -> list:
        records = []
        for gradient, variable in grads_and_vars:
            name = self.groups.get(id(variable))
            if name is not None and isinstance(gradient, tf.IndexedSlices):
                touched = tf.size(tf.unique(gradient.indices).y, out_type=tf.int64)
                records.append((self.rows[name], touched))
        return records

    # -- reading (eager, on the coordinator) ----------------------------------

    def begin_epoch(self, run_id, epoch: int) -> None:
        """Resets the per-epoch maximum once per epoch, whoever calls first."""
        if not self.enabled or self._epoch_key == (run_id, epoch):
            return
        self._epoch_key = (run_id, epoch)
        self.join()
        self.epoch_max.assign(tf.zeros([1], tf.int64))

    def join(self) -> None:
        model = self._model()
        if self.is_ps and model is not None:
            _coordinator(model).join()

    def totals(self) -> dict:
        """Cumulative counters (numpy), read from the ps tasks."""
        if not self.enabled:
            return {"steps": 0, "examples": 0, "staleness_sum": 0, "dropped": 0, "gradient_norm_sum": 0.0, "epoch_max": 0,
                    "histogram": np.zeros(STALENESS_BINS, np.int64), "rows": {}}
        counts = self.counts.numpy()
        return {
            "steps": int(counts[_STEPS]),
            "examples": int(counts[_EXAMPLES]),
            "staleness_sum": int(counts[_STALENESS_SUM]),
            "dropped": int(counts[_DROPPED]),
            "gradient_norm_sum": float(counts[_GRADIENT_NORM]) * _NORM_UNIT,
            "epoch_max": int(self.epoch_max.numpy()[0]),
            "histogram": np.array(counts[_HISTOGRAM_AT:_HISTOGRAM_AT + STALENESS_BINS]),
            "rows": {name: int(counts[index]) for name, index in self.rows.items()},
        }


class _NullScope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _global_norm(gradients) -> tf.Tensor:
    """The L2 norm of all of a step's gradients; duplicate rows of a sparse gradient are summed first."""
    squares = [tf.constant(0.0)]
    for gradient in gradients:
        if isinstance(gradient, tf.IndexedSlices):
            unique = tf.unique(gradient.indices)
            values = tf.math.unsorted_segment_sum(gradient.values, unique.idx, tf.size(unique.y))
        else:
            values = gradient
        squares.append(tf.reduce_sum(tf.square(tf.cast(values, tf.float32))))
    return tf.sqrt(tf.add_n(squares))


def _scale_factor(staleness, bound: int):
    """What the `"scale"` policy multiplies a step's gradients by (a float64 scalar tensor).

    `1 / (1 + staleness)` when `staleness > bound`, else 1: gradients within
    the bound are applied as they are (docs/guides/staleness.md).

    Args:
      staleness: int64 scalar tensor, the step's staleness (>= 0).
      bound: the callback's `max_staleness`.
    """
    staleness = tf.cast(staleness, tf.float64)
    return tf.where(staleness > bound, 1.0 / (1.0 + staleness), tf.constant(1.0, tf.float64))


def _scaled(gradient, factor):
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * tf.cast(factor, gradient.values.dtype),
                                gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


_PROBES: "weakref.WeakKeyDictionary[Any, _StepProbe]" = weakref.WeakKeyDictionary()
# Seconds of every snapshot PeriodicSync wrote for a model (ClusterMonitor reads them).
_SNAPSHOT_SECONDS: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def _probe(model) -> _StepProbe:
    probe = _PROBES.get(model)
    if probe is None:
        probe = _PROBES[model] = _StepProbe(model)
    return probe


def _coordinator(model):
    return tf.distribute.experimental.coordinator.ClusterCoordinator(model.distribute_strategy)


def _stats_between(start: dict, end: dict) -> dict:
    steps = end["steps"] - start["steps"]
    histogram = end["histogram"] - start["histogram"]
    counted = int(histogram.sum())
    total = end["staleness_sum"] - start["staleness_sum"]
    return {
        "staleness_mean": float(total / counted) if counted else 0.0,
        "staleness_max": int(end["epoch_max"]),
        "dropped_gradients": int(end["dropped"] - start["dropped"]),
        "steps": steps,
        "histogram": histogram,
    }


class _RunCallback(_keras.callbacks.Callback):
    """A callback whose batch hooks run under ParameterServerStrategy."""

    def __init__(self):
        super().__init__()
        # tf-keras skips batch hooks of callbacks that need numpy logs under
        # ParameterServerStrategy; ours never read the logs' values.
        self._supports_tf_logs = True
        self._run_id = None

    def on_train_begin(self, logs=None):
        self._run_id = uuid.uuid4().hex


# ----------------------------------------------------------------------------
# StalenessBound


class StalenessBound(_RunCallback):
    """Drops or down-weights gradients computed from parameters that are too old.

    The staleness of a gradient is the number of updates that other steps
    applied between this step's read of the parameters and its own apply.
    It is measured with an int64 version counter on a ps task: each step
    reads it before it reads any parameter, reads it again just before its
    apply, and adds 1 after applying. Policies:

    * `"drop"`: skip the apply (the whole update, `optimizer.iterations`
      included) when staleness > `max_staleness`;
    * `"scale"`: when staleness > `max_staleness`, multiply the step's
      gradients by `1 / (1 + staleness)`; gradients within the bound are
      applied unchanged. For SGD this scales the update, for Adam-like
      optimizers it scales what enters the moments.

    After each epoch the logs (so the History and a TensorBoard callback
    placed after this one) get `staleness_mean`, `staleness_max` and
    `dropped_gradients` of that epoch.

    Example (a default-strategy model has no staleness; see
    docs/guides/staleness.md for a cluster run):

    >>> import numpy as np, tensorflow as tf, tf_psx
    >>> model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> bound = tf_psx.callbacks.StalenessBound(max_staleness=2, policy="drop")
    >>> history = model.fit(np.ones((8, 2)), np.ones(8), epochs=1, verbose=0, callbacks=[bound])
    >>> history.history["staleness_max"], history.history["dropped_gradients"]
    ([0], [0])

    Args:
      max_staleness: int >= 0, the largest staleness a gradient may have
        (`drop`), or the largest one it keeps its full weight at (`scale`:
        every gradient whose staleness exceeds `max_staleness` is scaled;
        0 scales all stale gradients).
      policy: `"drop"` or `"scale"`.

    Raises:
      ValueError: a bad `max_staleness` or `policy`.

    How close the bound is: the read before the apply and the increment after
    it are separate ops, not one atomic step. An update that another worker
    applies between this step's check and its increment is not seen by this
    step, so a step may apply with a true staleness up to
    `max_staleness + (num_workers - 1)` (each other worker can slip in at most
    one apply in that window; it is measured as 0-1 extra in practice, since
    the window is one apply long). The version is read before the first
    parameter read, and parameters are not all read at one instant, so the
    measured staleness never undercounts the updates since the step started.

    Known limitations:
      * Only measures under `ParameterServerStrategy`. Under the default
        strategy or CentralStorageStrategy updates are synchronous, nothing
        is stale, and the callback is a no-op that logs zeros.
      * Needs a tf.keras (2.16) optimizer, not a legacy one.
      * The train function is traced again when fit starts with this
        callback, and after fit ends without it.
    """

    def __init__(self, max_staleness: int, policy: Policy = "drop"):
        super().__init__()
        self.max_staleness = _checks.int_at_least(max_staleness, 0, "max_staleness", owner="StalenessBound",
                                                  fix='pass e.g. StalenessBound(max_staleness=2, policy="drop")')
        if policy not in POLICIES:
            raise ValueError(
                f"Argument `policy` of StalenessBound must be one of {', '.join(repr(p) for p in POLICIES)}. "
                f"Received: {policy!r}. Fix: pass policy=\"drop\" to skip stale gradients or "
                "policy=\"scale\" to down-weight them."
            )
        self.policy = policy
        self._start = None
        self.histogram = np.zeros(STALENESS_BINS, np.int64)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._probe = _probe(self.model)
        self._probe.acquire(self, (self.policy, self.max_staleness) if self._probe.is_ps else None)
        self.histogram = np.zeros(STALENESS_BINS, np.int64)

    def on_epoch_begin(self, epoch, logs=None):
        self._probe.begin_epoch(self._run_id, epoch)
        self._start = self._probe.totals()

    def on_epoch_end(self, epoch, logs=None):
        self._probe.join()
        stats = _stats_between(self._start, self._probe.totals())
        self.histogram = self.histogram + stats["histogram"]
        if logs is not None:
            logs["staleness_mean"] = stats["staleness_mean"]
            logs["staleness_max"] = stats["staleness_max"]
            logs["dropped_gradients"] = stats["dropped_gradients"]

    def on_train_end(self, logs=None):
        self._probe.release(self)


# ----------------------------------------------------------------------------
# PeriodicSync


def _hook_before_commit(path: str) -> None:  # pylint: disable=unused-argument
    """Called after a snapshot is written and before it is renamed (a seam for crash tests)."""


def _unreadable(prefix: str) -> str | None:
    """Why the checkpoint at `prefix` cannot be opened, or None when it can.

    Only local files are read (the index and the object graph), so the
    errors caught here are about those files. TF 2.16's checkpoint reader
    raises a bare `tf.errors.OpError` (code UNKNOWN) for a missing or
    unparsable file or a bad checksum, and IndexError for a truncated data
    file.
    """
    try:
        # Not tf.train.load_checkpoint: on ram:// it takes the prefix for a directory.
        tf.compat.v1.train.NewCheckpointReader(prefix).get_tensor(_OBJECT_GRAPH_KEY)
    except (tf.errors.OpError, IndexError) as error:
        return f"{type(error).__name__}: {_snapshots.first_line(error)}"
    return None


def _state_name(obj) -> str:
    """A readable name for a variable, a ShardedVariable or a TFRA table."""
    if _is_sharded(obj) and obj.variables:
        obj = obj.variables[0]
    name = str(getattr(obj, "name", None) or type(obj).__name__)
    return re.sub(r"(/part_\d+)?:\d+$", "", name)


def _tfra_scratch_types() -> tuple:
    """TFRA's per-step lookup buffers: variables that no snapshot can restore.

    A DynamicEmbedding's trainable weight is a ShadowVariable (a
    TrainableWrapper) with DEResourceVariable helpers; they hold the rows of
    the last batch, are written into snapshots, and are never matched on
    restore (TFRA 0.8.1). The state they stand for is the table.
    """
    if not _tfra.tfra_loaded():
        return ()
    de = _tfra.tfra()
    return (de.TrainableWrapper, de.shadow_ops.DEResourceVariable)


def _required_state(model) -> list:
    """What a snapshot of `model` must restore: every variable of the model and
    of its optimizer that exists now (shards as their ShardedVariable), and
    every DynamicEmbedding table. Optimizer slots made on the first apply do
    not exist yet and are restored when they are made (a deferred restore)."""
    from tf_psx.layers import DynamicEmbedding  # pylint: disable=import-outside-toplevel

    owners = {}
    for obj in tf.train.TrackableView(model).descendants():
        if _is_sharded(obj):
            for shard in obj.variables:
                owners[id(shard)] = obj
    scratch = _tfra_scratch_types()
    candidates = list(model.variables)
    if model.optimizer is not None:
        candidates += list(model.optimizer.variables)
    required = {}
    for variable in candidates:
        if scratch and isinstance(variable, scratch):
            continue
        owner = owners.get(id(variable), variable)
        required.setdefault(id(owner), owner)
    for layer in model.submodules:
        if isinstance(layer, DynamicEmbedding):
            required.setdefault(id(layer.table), layer.table)
    return list(required.values())


def _restored_ids(status) -> set[int]:
    return _checkpoint.restored_ids(status)


# The file PeriodicSync writes and removes to check its directory before the first step.
_WRITE_CHECK_NAME = ".tf_psx-write-check"


def _check_writable(directory, store) -> None:
    """Raises SnapshotDirectoryError, naming PeriodicSync and the argument, when `directory` cannot be written.

    A path under a file, under /proc, or an unreachable bucket failed at the
    first snapshot with the filesystem's own text (NotADirectoryError,
    FileNotFoundError, libcurl), which named neither.
    """
    probe = store.fs.join(directory, f"{_WRITE_CHECK_NAME}-{os.getpid()}")
    try:
        store.fs.makedirs(directory)
        store.fs.write_bytes(probe, b"")
        store.fs.remove_file(probe)
    except Exception as err:  # pylint: disable=broad-except  (any filesystem's error: OSError, tf.errors, ...)
        text = str(err).strip()
        first = text.splitlines()[0][:200] if text else ""
        raise SnapshotDirectoryError(
            f"Argument `directory` of PeriodicSync cannot be written: {directory!r} ({type(err).__name__}: "
            f"{first}). fit stopped before its first step. Fix: pass a directory this process can create and "
            "write: a local path whose parents are directories, or a reachable gs://, s3:// or hdfs:// location."
        ) from None


class PeriodicSync(_RunCallback):
    """Every N steps: a barrier, then an atomic snapshot; fit resumes from the newest.

    Every `every_n_steps` steps (counted over the whole run, across epochs):

    1. `coordinator.join()` waits until no step is in flight, so the
       snapshot holds the effect of exactly the steps done;
    2. the coordinator writes the model, the optimizer (slots and
       `iterations`) and every DynamicEmbedding table (their `tf.train.Checkpoint`
       dependencies) to `<directory>/.tmp-snapshot-<step>-<id>/`, then a
       manifest with the step counter, then renames the directory to
       `<directory>/snapshot-<step>`. A crash at any point leaves either no
       new snapshot or a temporary directory that is never restored;
    3. the steps scheduled next read the parameters as saved: every worker
       starts from the same state.

    When `fit` starts, the newest complete snapshot is restored (an older
    one if the files of the newest cannot be read, with a warning) and fit
    continues from its step, like `tf.keras.callbacks.BackupAndRestore`: the
    steps already done are not run again. A snapshot that can be read but
    does not hold every variable of the model and its optimizer (and every
    DynamicEmbedding table) is an error, not a partial restore: it was
    written by another model. Each snapshot is logged with its duration;
    `snapshot_seconds` keeps the durations.

    After each write, only the newest `max_to_keep` snapshots up to the step
    just written are kept. Snapshots with a higher step (an earlier run's in
    the same directory, or ones that could not be read) are never deleted and
    not counted: a warning names them, since a later fit tries them first.
    Replacing and pruning a snapshot are renames as well: a snapshot
    directory is complete or absent, never half deleted.

    Example:

    >>> import tempfile, numpy as np, tensorflow as tf, tf_psx
    >>> directory = tempfile.mkdtemp()
    >>> def build():
    ...     model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    ...     model.compile("sgd", "mse")
    ...     return model
    >>> x, y = np.ones((40, 2)), np.ones(40)
    >>> sync = tf_psx.callbacks.PeriodicSync(every_n_steps=4, directory=directory)
    >>> _ = build().fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[sync])
    >>> [s.step for s in tf_psx.callbacks.PeriodicSync.snapshots(directory)]
    [4, 8, 10]
    >>> resumed = build()
    >>> history = resumed.fit(x, y, batch_size=4, epochs=2, verbose=0,
    ...                       callbacks=[tf_psx.callbacks.PeriodicSync(4, directory)])
    >>> len(history.history["loss"]), int(resumed.optimizer.iterations.numpy())  # only epoch 2 ran
    (1, 20)

    Args:
      every_n_steps: int >= 1, steps between snapshots.
      directory: where snapshots go: a local path (the commit is a directory
        rename) or any `tf.io.gfile` URL (`gs://`, `s3://`, `hdfs://`,
        `ram://`; the manifest, written last, commits; under a
        ParameterServerStrategy every file is written by the coordinator).
        Use one directory per training run.
      max_to_keep: int >= 1, complete snapshots kept.
      background: write in the background (TF's async checkpoint,
        `CheckpointOptions(experimental_enable_async_checkpoint=True)`): the
        values are copied at the barrier, training resumes, and a thread
        writes the files, then the manifest. At most one snapshot is in
        flight: the next one, and the end of fit, wait for it. A model with
        a DynamicEmbedding is written synchronously (TF's async checkpoint
        copies variables only, not TFRA's hash tables), logged once.
      delta_every_n_steps: None (no deltas) or an int >= 1 below
        `every_n_steps`: steps between delta snapshots. A delta waits for a
        background full snapshot still being written.
      delta_rows_by: how a delta finds the changed rows of the tables. "auto":
        under a ParameterServerStrategy with exact updates and an optimizer
        whose update writes only the gradient's rows
        (`tf_psx.optimizers.updates_touched_rows_only`: LazyAdam, tf_psx's
        SGD, Adagrad), each update marks its rows beside the table, and a
        delta reads the marks; otherwise, and with "fingerprint", by content
        (a fingerprint per row). Marks are not used for a variable with a
        Keras constraint (applied to every row after the update) or one the
        optimizer was not built for, nor for a model with a `train_step` of
        its own. They miss values written outside the optimizer (`assign`,
        `set_weights`) between a full snapshot and a delta; fingerprints miss
        nothing.

    Attributes:
      restored: the `Snapshot` restored when the last fit started, or None.
      snapshot_seconds: seconds of each snapshot this callback wrote.
      delta_seconds: seconds of each delta (barrier, finding the rows, write).
      delta_rows: rows of the large variables in each delta.
      delta_tracking: how the changed rows of each large variable are found
        in this fit: "marks" or "fingerprint" (by checkpoint path).

    Raises:
      ValueError: bad arguments, BackupAndRestore in the same fit, or (when
        fit starts) a snapshot in `directory` that is not of this model.

    Delta snapshots (`delta_every_n_steps`): between two full snapshots,
    every `delta_every_n_steps` steps a barrier and a *delta*: the rows of the
    large variables (the tables and their optimizer slots) that changed since
    the last full snapshot, and every small variable whole, found by a
    fingerprint per row kept on each ps task (`tf_psx.deltas`: exact for
    every optimizer), or, with an optimizer that writes only the gradient's
    rows, from marks that each update sets (`delta_rows_by`). A delta is a few files in the full snapshot's directory,
    the manifest last; only the newest is kept (they are cumulative). A fit
    that resumes restores the newest full snapshot, then its newest delta,
    and continues from the delta's step: a crash (a ps task's included)
    loses at most `delta_every_n_steps` steps instead of `every_n_steps`.
    A fit that starts with no snapshot to build on writes a full one at its
    first delta point. `delta_seconds` and `delta_rows` keep each delta's
    cost and size.

    Known limitations:
      * Delta snapshots are refused for a model with a DynamicEmbedding
        (a hash table has no row index to fingerprint): ValueError when fit
        starts.
      * The position in the input data is not saved: after a resume the
        dataset starts from its beginning. Use a shuffled, repeated dataset
        (any order is as good), or skip `PeriodicSync.latest(directory).step`
        batches yourself (docs/guides/staleness.md shows how).
      * A snapshot is also written at the end of fit (when its step is not
        one already); a fit whose snapshot is already at its last step runs
        no step and tf-keras raises "Unexpected result of train_function".
        Raise `epochs`, or use a fresh directory, to train again.
      * Under ParameterServerStrategy the barrier stalls the workers while
        the coordinator writes; the cost is in `snapshot_seconds`.
    """

    def __init__(self, every_n_steps: int, directory, max_to_keep: int = 3, background: bool = False,
                 delta_every_n_steps: int | None = None,
                 delta_rows_by: Literal["auto", "fingerprint"] = "auto"):
        super().__init__()
        if delta_rows_by not in ("auto", "fingerprint"):
            raise ValueError(f"Argument `delta_rows_by` of PeriodicSync must be 'auto' or 'fingerprint'. Received: "
                             f"{delta_rows_by!r}. Fix: pass delta_rows_by='fingerprint' to find changed rows by "
                             "content only, or leave the default.")
        self.delta_rows_by = delta_rows_by
        if not isinstance(background, bool):
            raise ValueError(f"Argument `background` of PeriodicSync must be True or False. Received: {background!r}. "
                             "Fix: pass background=True to write snapshots in the background.")
        self.background = background
        self._pending = None  # the thread finishing the last background snapshot
        self.every_n_steps = _checks.int_at_least(every_n_steps, 1, "every_n_steps", owner="PeriodicSync",
                                        fix='pass e.g. PeriodicSync(every_n_steps=100, directory="/tmp/run1")')
        self.directory = _check_path("PeriodicSync", "directory", directory)
        self.max_to_keep = _checks.int_at_least(max_to_keep, 1, "max_to_keep", owner="PeriodicSync",
                                        fix='pass e.g. PeriodicSync(100, "/tmp/run1", max_to_keep=3)')
        self.delta_every_n_steps = None
        if delta_every_n_steps is not None:
            self.delta_every_n_steps = _checks.int_at_least(
                delta_every_n_steps, 1, "delta_every_n_steps", owner="PeriodicSync",
                fix="pass e.g. PeriodicSync(every_n_steps=500, directory=..., delta_every_n_steps=20)")
            if self.delta_every_n_steps >= self.every_n_steps:
                raise ValueError(
                    f"Argument `delta_every_n_steps` of PeriodicSync must be below `every_n_steps` "
                    f"({self.every_n_steps}): a delta holds what changed since the last full snapshot. Received: "
                    f"{delta_every_n_steps!r}. Fix: pass a smaller delta_every_n_steps, or None for full snapshots "
                    "only.")
        self.restored: Snapshot | None = None
        self.snapshot_seconds: list[float] = []
        self.delta_seconds: list[float] = []
        self.delta_rows: list[int] = []
        self.delta_tracking: dict[str, str] = {}
        self._tracker = None
        self._base: Snapshot | None = None  # the full snapshot deltas are written against
        self._last_delta = -1
        self._step = 0
        self._epoch = 0
        self._epoch_start = 0
        self._last_saved = -1
        self._checkpoint = None
        self._store = _snapshots.SnapshotStore(self.directory, self.max_to_keep,
                                               before_commit=lambda path: _hook_before_commit(path))

    # -- finding snapshots (usable without a model) ---------------------------

    @staticmethod
    def snapshots(directory) -> list[Snapshot]:
        """The complete snapshots in `directory`, oldest first."""
        return _snapshots.SnapshotStore(directory, max_to_keep=1).snapshots()

    @staticmethod
    def latest(directory) -> Snapshot | None:
        """Where a fit in `directory` resumes: the newest complete snapshot, or None.

        When that snapshot has a readable delta snapshot, its `step`, `epoch`
        and `step_in_epoch` are the delta's (`delta_of` is the full
        snapshot's step; `path` and `checkpoint` stay the full snapshot's).
        """
        found = PeriodicSync.snapshots(directory)
        if not found:
            return None
        delta = _deltas.latest_delta(found[-1].path, found[-1].step)
        return found[-1] if delta is None else _with_delta(found[-1], delta)

    # -- fit hooks ------------------------------------------------------------

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        model = self.model
        strategy = model.distribute_strategy
        self._is_ps = _runtime.is_parameter_server_strategy(strategy)
        self._writes = bool(getattr(strategy.extended, "should_checkpoint", True))
        self._seconds = _SNAPSHOT_SECONDS.setdefault(model, [])
        if model.optimizer is not None and not getattr(model.optimizer, "_built", False):
            # Slots must exist before a restore so that it fills them now.
            # The name scope gives the slots the names apply_gradients would.
            with strategy.scope(), tf.name_scope(model.optimizer.name):
                model.optimizer.build(model.trainable_variables)
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        self._options = None
        if self._is_ps and not _snapshots.is_local(self.directory):
            # The ps tasks would write their own shards through their own
            # filesystem; on a remote one every file goes through the coordinator.
            resolver = strategy.cluster_resolver
            job, task = getattr(resolver, "task_type", None) or "chief", getattr(resolver, "task_id", None) or 0
            device = f"/job:{job}/replica:0/task:{task}/device:CPU:0"
            self._options = tf.train.CheckpointOptions(experimental_io_device=device)
        if self.delta_every_n_steps is not None and _tables.hash_table_layers(model):
            names = ", ".join(layer.name for layer in _tables.hash_table_layers(model))
            raise ValueError(
                f"PeriodicSync(delta_every_n_steps={self.delta_every_n_steps}) cannot write delta snapshots of model "
                f"{model.name}: its DynamicEmbedding layers ({names}) are hash tables, which have no row index to "
                "find the changed rows by. Fix: pass delta_every_n_steps=None (full snapshots only, e.g. more "
                "often with background=True), or use tf_psx.layers.ShardedEmbedding for these features.")
        self._background = self.background
        if self._background and _tables.hash_table_layers(model):
            logger.info("PeriodicSync: model %s holds DynamicEmbedding tables, which TF's async checkpoint does not "
                        "copy; its snapshots are written synchronously", model.name)
            self._background = False
        if self._background:
            self._options = tf.train.CheckpointOptions(
                experimental_io_device=getattr(self._options, "experimental_io_device", None),
                experimental_enable_async_checkpoint=True)
        if self._writes:
            _check_writable(self.directory, self._store)
            self._store.clean_temporaries()
        steps = (self.params or {}).get("steps")
        self.restored = self._restore_newest()
        self._base, self._tracker = self.restored, None
        if self.delta_every_n_steps is not None:
            variables = _deltas.variables_by_path(self._checkpoint, skip=_tfra_scratch_types())
            marks = self._row_marks(variables) if self.delta_rows_by == "auto" else {}
            self._tracker = _deltas.DeltaTracker(variables, strategy, row_marks=marks)
            self.delta_tracking = {path: "marks" if path in self._tracker.marked else "fingerprint"
                                   for path in self._tracker.tracked}
            if self.restored is not None:
                self._tracker.rebase()  # the full snapshot is the base; its delta is applied on top
                self.restored = self._apply_newest_delta(self.restored)
        self._step, self._resume_in_epoch = 0, 0
        if self.restored is not None:
            epoch, in_epoch = self.restored.resume_point(steps)
            _fit_hooks.set_initial_counters(model, epoch, in_epoch)
            self._step, self._resume_in_epoch = self.restored.step, in_epoch
            logger.info("PeriodicSync: restored %s (step %d); fit continues at epoch %d, step %d",
                        self.restored.path, self.restored.step, epoch + 1, in_epoch)
        self._last_saved = self._last_delta = self._step

    def _row_marks(self, variables: dict) -> dict:
        """Masks of the rows each update writes, for the large trainable variables and their slots.

        Only where an update writes nothing but its gradient's rows
        (`tf_psx.optimizers.updates_touched_rows_only`) and runs through the
        exact-update lock (a ParameterServerStrategy with `exact_updates`);
        otherwise {} (every large variable is fingerprinted). A new mask makes
        the train function again, so that its updates set it.
        """
        model, strategy = self.model, self.model.distribute_strategy
        optimizer = model.optimizer
        if not (self._is_ps and getattr(strategy, "exact_updates", False) and optimizer is not None
                and _optimizers.updates_touched_rows_only(optimizer)):
            return {}
        large = {id(shard) for value in variables.values()
                 if _deltas.full_shape(value) and _deltas.full_shape(value)[0] >= _deltas.MIN_ROWS
                 for shard, _ in _deltas.shards_of(value)}
        if type(model).train_step is not _keras.Model.train_step:
            # A train_step of its own may write the tables otherwise (another optimizer, a direct assign).
            return {}
        # Marked: what the optimizer updates and nothing rewrites in full afterwards (a Keras constraint
        # is applied to the whole variable after the update).
        trainable = [variable for variable in model.trainable_variables
                     if id(variable) in large and getattr(variable, "constraint", None) is None
                     and _exact_updates.updates(optimizer, variable)]
        slots = _exact_updates.slots_of(optimizer, trainable)
        marks, new = {}, False
        for variable in trainable:
            mask = _exact_updates.row_marks_of(optimizer, variable)
            if mask is None:
                with strategy.scope(), strategy.extended.colocate_vars_with(variable):
                    mask = tf.Variable(tf.zeros([variable.shape[0]], tf.bool), trainable=False,
                                       name="tf_psx_row_marks")
            new = _exact_updates.register_row_marks(optimizer, variable, mask) or new
            for shard in [variable, *slots.get(id(variable), [])]:
                marks[id(shard)] = mask
        if new:
            _fit_hooks.rebuild_train_function(model)
        return marks

    def _apply_newest_delta(self, snapshot: Snapshot) -> Snapshot:
        """Applies the newest readable delta of `snapshot`; returns what fit resumes from."""
        delta = _deltas.latest_delta(snapshot.path, snapshot.step)
        if delta is None:
            return snapshot
        variables, unknown = self._tracker.variables, []
        for path, rows, values in delta.entries():
            variable = variables.get(path)
            if variable is None:
                counter = _exact_updates.counter_path_name(path)
                if counter is not None and self.model.optimizer is not None:
                    # Made by the first update: set then.
                    _exact_updates.restore_counter_later(self.model.optimizer, counter, values)
                else:
                    unknown.append(path)
                continue
            full = _deltas.full_shape(variable)
            shape, got = (full[1:], values.shape[1:]) if rows is not None else (full, values.shape)
            if tuple(shape) != tuple(got) or (rows is not None and rows.size and int(rows.max()) >= full[0]):
                raise ValueError(self._mismatch(snapshot, f"a delta ({delta.path}) with {path} of shape "
                                                          f"{tuple(got)}{' per row' if rows is not None else ''} "
                                                          f"where this model has {tuple(full)}"))
            # Rows count across all shards: the delta restores onto any number of ps tasks.
            _deltas.apply_rows(variable, rows, values)
            self._tracker.mark_written(path, rows)
        if unknown:
            # Variables made lazily by the first step (compiled metrics): the full snapshot's deferred restore
            # covers them, at the full snapshot's values.
            logger.warning("PeriodicSync: %d values of the delta %s have no variable here yet, and keep the values "
                           "of the full snapshot: %s", len(unknown), delta.path, ", ".join(unknown[:_NAMES_SHOWN]))
        logger.info("PeriodicSync: applied the delta of step %d (%d rows) on top of %s", delta.step,
                    delta.manifest.get("rows", 0), snapshot.path)
        return _with_delta(snapshot, delta)

    def _restore_newest(self) -> Snapshot | None:
        """Restores the newest snapshot that can be read; None when there is none.

        A snapshot whose files cannot be read is skipped with a warning (an
        older one is tried). A snapshot that can be read but does not hold
        this model's state raises: an older one from the same directory would
        not either, and training on would skip the steps it records with
        weights it did not restore. Any other error (e.g. a ps task that is
        down) propagates.
        """
        for path in self._store.incomplete():
            logger.warning("PeriodicSync: skipping %s: it has no manifest or no checkpoint index (a write that did "
                           "not finish); it is never restored", path)
        for snapshot in reversed(self.snapshots(self.directory)):
            cause = _unreadable(snapshot.checkpoint)
            if cause is None:
                try:
                    # `read` is the counterpart of `write` (no save_counter).
                    status = self._checkpoint.read(snapshot.checkpoint, options=self._options)
                except tf.errors.DataLossError as error:  # a tensor whose checksum does not match
                    cause = f"{type(error).__name__}: {_snapshots.first_line(error)}"
                except ValueError as error:  # a tensor of another shape or dtype than the variable
                    what = f"a value of another shape or dtype ({_snapshots.first_line(error)})"
                    raise ValueError(self._mismatch(snapshot, what)) from error
            if cause is not None:
                logger.warning("PeriodicSync: cannot read %s (%s); trying an older snapshot", snapshot.path, cause)
                continue
            # Values in the snapshot that nothing here takes are expected: TFRA's
            # lookup buffers, and slots that are made on the first apply (restored then).
            status.expect_partial()
            # Hash tables written with another number of ps tasks, and tables
            # restored without the admission counts their layer now keeps.
            _tables.restore_tables(self.model, snapshot.checkpoint)
            _tables.seed_policies(self.model, snapshot.step)
            restored = _restored_ids(status)
            required = _required_state(self.model)
            missing = [_state_name(obj) for obj in required if id(obj) not in restored]
            if missing:
                shown = ", ".join(missing[:_NAMES_SHOWN]) + (
                    f" and {len(missing) - _NAMES_SHOWN} more" if len(missing) > _NAMES_SHOWN else "")
                raise ValueError(self._mismatch(
                    snapshot, f"{len(required) - len(missing)} of the {len(required)} variables and tables of this "
                    f"model and its optimizer; not in it: {shown}"))
            return snapshot
        return None

    def _mismatch(self, snapshot: Snapshot, what: str) -> str:
        return (
            f"PeriodicSync cannot resume from {snapshot.path} (step {snapshot.step}): it holds {what}. It was "
            "written by another model or optimizer, or the model changed since. fit stopped before its first step "
            f"rather than skip {snapshot.step} steps with weights it did not restore. Fix: point `directory` at "
            f"this model's own snapshots (one directory per training run), or delete the snapshot-* directories "
            f"of the other model from {self.directory} to train from step 0."
        )

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_start = self._step - self._resume_in_epoch
        self._resume_in_epoch = 0

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the index of the last step of the execution in this epoch.
        self._step = self._epoch_start + int(batch) + 1
        if self._step // self.every_n_steps > self._last_saved // self.every_n_steps:
            self._snapshot()
        elif (self._tracker is not None and self._writes
              and self._step // self.delta_every_n_steps > self._last_delta // self.delta_every_n_steps):
            if self._base is None:
                self._snapshot()  # the first delta point has nothing to be a delta of: a full snapshot
            else:
                self._delta()

    def on_train_end(self, logs=None):
        if self._step > self._last_saved:
            self._snapshot()
        self._finish_pending()
        _fit_hooks.clear_initial_counters(self.model)

    def _finish_pending(self) -> None:
        """Waits for the background snapshot in flight (if any); its error is raised here."""
        pending, self._pending = self._pending, None
        _WRITING.pop(self, None)
        if pending is None:
            return
        pending.join()
        if pending.error is not None:
            raise pending.error

    def _barrier(self) -> None:
        if self._is_ps:
            _coordinator(self.model).join()
            controller = getattr(self.model.distribute_strategy, "sync_controller", None)
            if controller is not None:
                # A partial sync step is applied first: the snapshot holds every batch trained before it.
                controller.flush()

    def _position(self) -> dict:
        return {"epoch": self._epoch, "step_in_epoch": self._step - self._epoch_start,
                "steps_per_epoch": (self.params or {}).get("steps")}

    def _delta(self) -> None:
        start = time.perf_counter()
        self._barrier()
        self._finish_pending()  # the base must be committed first
        step, record = self._step, {"rows": 0, "bytes": 0}
        if self._writes:
            self._tracker.add_new(_deltas.variables_by_path(self._checkpoint, skip=_tfra_scratch_types()))
            record = _deltas.write_delta(self._base.path, step, self._base.step, self._tracker.changed(),
                                         {**self._position(), "seconds": time.perf_counter() - start})
        seconds = time.perf_counter() - start
        self._last_delta = step
        self.delta_seconds.append(seconds)
        self.delta_rows.append(int(record["rows"]))
        logger.info("PeriodicSync: delta of step %d on the snapshot of step %d: %d rows, %d bytes, in %.2f s",
                    step, self._base.step, record["rows"], record["bytes"], seconds)

    def _snapshot(self) -> None:
        start = time.perf_counter()
        self._barrier()
        barrier = time.perf_counter() - start
        step = self._step
        self._finish_pending()
        if self._writes:
            manifest = {**self._position(), "seconds": time.perf_counter() - start}
            if self._background:
                # The values are copied now; the files, the manifest and the prune follow in a thread.
                self._pending = _BackgroundCommit(self._store, step, self._checkpoint, self._options, manifest)
                _WRITING[self] = self.model.distribute_strategy
                self._pending.start_write()
            else:
                self._store.commit(step, lambda prefix: self._checkpoint.write(prefix, options=self._options),
                                   manifest)
                self._store.prune(step)
            if self._tracker is not None:
                # The values just saved (still, under the barrier) are the new base.
                self._tracker.rebase()
                self._base = _snapshots.Snapshot(path=self._store.path_of(step), step=step, epoch=self._epoch,
                                                 step_in_epoch=manifest["step_in_epoch"],
                                                 steps_per_epoch=manifest["steps_per_epoch"], seconds=0.0)
        seconds = time.perf_counter() - start
        self._last_saved = self._last_delta = step
        self.snapshot_seconds.append(seconds)
        self._seconds.append(seconds)
        logger.info("PeriodicSync: snapshot of step %d in %.2f s (barrier %.2f s)", step, seconds, barrier)

def _with_delta(snapshot: Snapshot, delta) -> Snapshot:
    """The resume point of a full snapshot and its delta."""
    manifest = delta.manifest
    return dataclasses.replace(snapshot, step=delta.step, epoch=int(manifest["epoch"]),
                               step_in_epoch=int(manifest["step_in_epoch"]),
                               steps_per_epoch=manifest.get("steps_per_epoch"), delta_of=snapshot.step)


# PeriodicSync callbacks with a background snapshot in flight, and their strategy.
_WRITING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def finish_snapshots_of(strategy) -> int:
    """Waits for the background snapshots being written under `strategy`; returns how many there were."""
    writers = [callback for callback, owner in list(_WRITING.items()) if owner is strategy]
    for callback in writers:
        callback._finish_pending()  # pylint: disable=protected-access  (tf_psx's own class)
    return len(writers)


# ----------------------------------------------------------------------------
# SyncSwitch


class SyncSwitch(_RunCallback):
    """Switches a `sync="switchable"` strategy from async to sync steps (or back) during `fit`.

    The practice of training async first for speed and finishing sync for
    accuracy, in one `fit`. The switch happens at the first of:

    * `at_step`: after that many training steps of this fit (counted over
      epochs);
    * a plateau of `monitor` in the epoch logs: `patience` epochs in a row
      that improve the best value by less than `min_delta` (relative).

    The switch waits for the steps in flight and for a background
    `PeriodicSync` snapshot being written, applies a partial sync step when
    leaving sync, then changes the mode (`strategy.set_sync`): every batch
    is applied once. The epoch logs get `sync` (1.0 or 0.0).

    Example (under the default strategy there is nothing to switch):

    >>> import tf_psx
    >>> switch = tf_psx.callbacks.SyncSwitch(to="sync", patience=2)
    >>> switch.switched_at_step is None
    True

    Args:
      to: `"sync"` (async -> sync) or `"async"` (sync -> async).
      at_step: int >= 1, or None (then only the plateau decides).
      monitor: the epoch log to watch (`"loss"` by default).
      patience: int >= 1, epochs without improvement before switching, or
        None (then only `at_step` decides).
      min_delta: the smallest relative improvement that counts.

    Attributes:
      switched_at_step: the training step of this fit after which the mode
        changed, or None.
      switched_at_epoch: the epoch in which it changed, or None.
      snapshots_waited: background `PeriodicSync` snapshots the switch
        waited for.

    Raises:
      ValueError: bad arguments, or neither `at_step` nor `patience` given.
      TypeError (in fit): the model's strategy is not a
        `tf_psx.ParameterServerStrategy` made with `sync=True` or
        `sync="switchable"`.
    """

    def __init__(self, to: str = "sync", at_step: int | None = None, monitor: str = "loss",
                 patience: int | None = None, min_delta: float = 0.002):
        super().__init__()
        if to not in ("sync", "async"):
            raise ValueError(f'Argument `to` of SyncSwitch must be "sync" or "async". Received: {to!r}.')
        if at_step is None and patience is None:
            raise ValueError(
                "SyncSwitch needs `at_step` or `patience` (or both). Received neither. Fix: e.g. "
                'SyncSwitch(to="sync", patience=2) to switch when the loss stops improving.'
            )
        if at_step is not None:
            at_step = _checks.int_at_least(at_step, 1, "at_step", owner="SyncSwitch", fix="pass e.g. at_step=1000")
        if patience is not None:
            patience = _checks.int_at_least(patience, 1, "patience", owner="SyncSwitch", fix="pass e.g. patience=2")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise ValueError(f"Argument `min_delta` of SyncSwitch must be a number >= 0. Received: {min_delta!r}.")
        self.to, self.at_step, self.monitor = to, at_step, monitor
        self.patience, self.min_delta = patience, float(min_delta)
        self.switched_at_step: int | None = None
        self.switched_at_epoch: int | None = None
        self.snapshots_waited = 0
        self._steps = 0
        self._epoch = 0
        self._best: float | None = None
        self._flat_epochs = 0

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        strategy = self.model.distribute_strategy
        if getattr(strategy, "sync_controller", None) is None:
            raise TypeError(
                f"SyncSwitch needs a tf_psx.ParameterServerStrategy made with sync=True or sync=\"switchable\"; "
                f"the model's strategy is {type(strategy).__name__}"
                + (" with sync=False" if hasattr(strategy, "sync_controller") else "")
                + '. Fix: tf_psx.ParameterServerStrategy(cluster, sync="switchable").'
            )
        self.switched_at_step = self.switched_at_epoch = None
        self._steps, self._best, self._flat_epochs = 0, None, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        if self.at_step is not None and self._steps >= self.at_step:
            self._switch()

    def on_epoch_end(self, epoch, logs=None):
        value = None if logs is None else logs.get(self.monitor)
        if self.patience is not None and value is not None and self.switched_at_step is None:
            value = float(value)
            if self._best is None or value < self._best * (1.0 - self.min_delta):
                self._best, self._flat_epochs = value, 0
            else:
                self._flat_epochs += 1
                if self._flat_epochs >= self.patience:
                    self._switch()
        if logs is not None:
            logs["sync"] = 1.0 if self.model.distribute_strategy.sync_stats()["enabled"] else 0.0

    def _switch(self) -> None:
        if self.switched_at_step is not None:
            return
        strategy = self.model.distribute_strategy
        self.snapshots_waited += finish_snapshots_of(strategy)
        strategy.set_sync(self.to == "sync")
        self.switched_at_step, self.switched_at_epoch = self._steps, self._epoch
        logger.info("SyncSwitch: %s from step %d (epoch %d)", self.to, self._steps, self._epoch)


class _BackgroundCommit:
    """One background snapshot: the async write starts on the caller's thread, the commit finishes on its own."""

    def __init__(self, store, step: int, checkpoint, options, manifest: dict):
        self.error: BaseException | None = None
        self._store, self._step, self._checkpoint = store, step, checkpoint
        self._options, self._manifest = options, manifest
        self._started = threading.Event()
        self._prefix: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"tf_psx-snapshot-{step}", daemon=True)

    def start_write(self) -> None:
        """Returns once the values are copied and the files are being written (the training stall)."""
        self._thread.start()
        self._started.wait()
        if self.error is not None:
            self.join()
            raise self.error

    def _write(self, prefix: str) -> None:
        try:
            self._checkpoint.write(prefix, options=self._options)
        finally:
            self._started.set()

    def _run(self) -> None:
        try:
            self._store.commit(self._step, self._write, self._manifest, wait=self._checkpoint.sync)
            self._store.prune(self._step)
        except BaseException as error:  # pylint: disable=broad-except  (raised on the training thread)
            self.error = error
        finally:
            self._started.set()

    def join(self) -> None:
        self._thread.join()


# ----------------------------------------------------------------------------
# ClusterMonitor


class ClusterMonitor(_RunCallback):
    """Writes TensorBoard scalars about the cluster every N steps, and serves them to Prometheus.

    Tags (`<i>` is a ps task, `<name>` an embedding layer):

    | tag | what |
    |---|---|
    | `throughput/examples_per_sec` | examples the cluster finished per second since the last write |
    | `throughput/step_time_ms` | wall ms per finished step (all workers together) |
    | `throughput/steps_per_sec` | steps the cluster finished per second since the last write |
    | `gradients/norm` | mean global L2 norm of the gradients of the steps since the last write |
    | `ps/<i>/latency_ms` | round trip of a one-element read from a worker to ps task i (a probe per write) |
    | `ps/<i>/bytes_from_ps_per_step`, `ps/<i>/bytes_to_ps_per_step` | estimated bytes a step reads from ps task i (variables, embedding rows) and sends to it (gradients) |
    | `ps/<i>/variable_bytes` | bytes of the dense and sharded variables on ps task i (model and optimizer) |
    | `ps/<i>/table_bytes` | bytes of the TFRA tables (and their slots) on ps task i: keys plus values |
    | `sparsity/<name>` | mean fraction of the rows of the embedding that a step touched |
    | `staleness/mean`, `staleness/max`, `staleness/dropped` | mean staleness of the steps since the last write, the epoch's max so far, gradients dropped since the last write |
    | `sync/snapshot_seconds` | seconds of the latest PeriodicSync snapshot (written once there is one) |
    | `cluster/closure_retries` | closures the coordinator ran again after a worker failure, since fit began |
    | `ps/<i>/rss_bytes` | resident memory of ps task i (only for `LocalCluster(processes=True)`, passed as `cluster`) |
    | `tables/<name>/rows` | rows in the hash table of DynamicEmbedding `<name>` (all ps tasks) |
    | `tables/<name>/rows_evicted`, `tables/<name>/rows_spilled` | rows `TableEviction` removed (and moved to disk) since the layer was built |

    Example:

    >>> import tempfile, numpy as np, tensorflow as tf, tf_psx
    >>> log_dir = tempfile.mkdtemp()
    >>> model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> monitor = tf_psx.callbacks.ClusterMonitor(log_dir, every_n_steps=2)
    >>> _ = model.fit(np.ones((16, 2)), np.ones(16), batch_size=4, verbose=0, callbacks=[monitor])
    >>> "throughput/examples_per_sec" in monitor.last_values
    True

    With `metrics_port`, the same values (as `tf_psx.metrics.METRICS`) are
    served at `http://HOST:PORT/metrics` for Prometheus; with a `cluster`,
    also each task's memory and CPU and the host's CPU and swap. A port in
    use is logged as an error naming it, and training goes on
    (`metrics_error` says why nothing is served).

    Args:
      log_dir: the TensorBoard log directory (events go to `<log_dir>/cluster`);
        None to serve Prometheus metrics only.
      every_n_steps: int >= 1, steps between writes.
      cluster: the `tf_psx.LocalCluster` the strategy runs on, for the ps
        RSS; optional.
      metrics_port: the Prometheus port (0 for a free one, see
        `metrics_server.port`); None reads `TF_PSX_METRICS_PORT` (set by
        `tf-psx launch --metrics-port`), and serves nothing when it is unset.
      metrics_host: the address the endpoint listens on.

    Attributes:
      last_values: {tag: value} of the last write.
      metrics_server: the `tf_psx.metrics.MetricsServer`, or None.
      metrics_error: why no endpoint is served despite a port, or None.

    Raises:
      ValueError: bad arguments.

    Known limitations:
      * Under the default strategy there is one ps-less process: no ps tags,
        staleness 0. Under CentralStorageStrategy (several replicas) only the
        snapshot seconds are written.
      * Counters are read while steps run, so one write may include a step
        or two that was finishing.
      * Retries before fit started are not counted.
      * Bytes per ps are estimated from the model (every dense variable read
        and its gradient sent each step; embedding rows and their gradients
        as the rows touched, spread over the shards by size), not counted on
        the wire; `wire_dtype` and the exact hash-table update's slot moves
        are not in them.
      * The latency probe is a closure on a worker, scheduled beside the
        training steps at each write and read at the next one.
    """

    def __init__(self, log_dir=None, every_n_steps: int = DEFAULT_MONITOR_STEPS, cluster=None,
                 metrics_port: int | None = None, metrics_host: str = _metrics.DEFAULT_HOST):
        super().__init__()
        if metrics_port is None:
            metrics_port = _metrics.port_from_env()
        elif not (_checks.is_int_at_least(metrics_port, 0) and metrics_port <= 65535):
            raise ValueError(f"Argument `metrics_port` of ClusterMonitor must be an int in 0..65535 or None. "
                             f"Received: {metrics_port!r}. Fix: pass e.g. metrics_port=9400, or 0 for a free port.")
        if log_dir is None and metrics_port is None:
            raise ValueError("ClusterMonitor needs a `log_dir` (TensorBoard) or a `metrics_port` (Prometheus). "
                             "Received neither. Fix: pass e.g. ClusterMonitor(\"/tmp/logs\") or "
                             "ClusterMonitor(metrics_port=9400).")
        self.log_dir = None if log_dir is None else _check_path("ClusterMonitor", "log_dir", log_dir)
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.metrics_server: _metrics.MetricsServer | None = None
        self.metrics_error: str | None = None
        self._samples: list = []
        self._latency: tuple | None = None  # (ps tasks, RemoteValue) of the probe in flight
        self._latency_fn = None
        self.every_n_steps = _checks.int_at_least(every_n_steps, 1, "every_n_steps", owner="ClusterMonitor",
                                        fix='pass e.g. ClusterMonitor("/tmp/logs", every_n_steps=100)')
        if cluster is not None and not all(hasattr(cluster, attr) for attr in ("pid", "processes", "config")):
            raise ValueError(
                "Argument `cluster` of ClusterMonitor must be None or a tf_psx.LocalCluster. "
                f"Received: {cluster!r}. Fix: pass the LocalCluster the strategy was built on, or nothing."
            )
        self.cluster = cluster
        self.last_values: dict[str, float] = {}
        self._writer = None
        self._unsized_slots: set[str] = set()

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        model = self.model
        self._probe = _probe(model)
        self._probe.acquire(self, None)
        self._retries = _runtime.closure_retries(_coordinator(model)) if self._probe.is_ps else None
        self._retries_start = self._retries.count if self._retries else 0
        if self._writer is None and self.log_dir is not None:
            with tf.init_scope():
                self._writer = tf.summary.create_file_writer(os.path.join(self.log_dir, "cluster"))
        self._serve_metrics()
        self._seconds = _SNAPSHOT_SECONDS.setdefault(model, [])
        self._seconds_seen = len(self._seconds)
        self._batches = 0
        self._mark = (time.perf_counter(), self._probe.totals())

    def on_epoch_begin(self, epoch, logs=None):
        self._probe.begin_epoch(self._run_id, epoch)

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % self.every_n_steps == 0:
            self._write()

    def on_train_end(self, logs=None):
        self._probe.join()
        self._write(final=True)
        if self._writer is not None:
            self._writer.flush()
        self._probe.release(self)

    def _serve_metrics(self) -> None:
        if self.metrics_port is None or self.metrics_server is not None or self.metrics_error is not None:
            return
        try:
            self.metrics_server = _metrics.serve(self.metrics_port, self.metrics_host)
        except _metrics.MetricsPortError as err:
            self.metrics_error = str(err)
            logger.error("ClusterMonitor serves no Prometheus metrics; training goes on: %s", err)
            return
        self.metrics_server.set_source("ClusterMonitor", lambda: self._samples)
        logger.info("ClusterMonitor serves Prometheus metrics at http://%s:%d/metrics", self.metrics_host,
                    self.metrics_server.port)
        if self.cluster is not None and self.cluster.processes:
            self.metrics_server.set_source("LocalCluster", _metrics.ProcessSampler(self.cluster.task_pids))

    # -- measurements ---------------------------------------------------------

    def _write(self, final: bool = False) -> None:
        now, totals = time.perf_counter(), self._probe.totals()
        then, before = self._mark
        values: dict[str, float] = {}
        elapsed = max(now - then, 1e-9)
        steps = totals["steps"] - before["steps"]
        if self._probe.enabled and steps == 0 and (self.last_values or not final):
            return  # no step finished since the last write (e.g. the first is being traced)
        if self._probe.enabled:
            values["throughput/examples_per_sec"] = (totals["examples"] - before["examples"]) / elapsed
            if steps:
                values["throughput/step_time_ms"] = 1000.0 * elapsed / steps
                for name, rows in self._probe.embedding_rows.items():
                    size = rows if isinstance(rows, int) else max(rows.size(), 1)
                    touched = totals["rows"][name] - before["rows"][name]
                    values[f"sparsity/{name}"] = touched / steps / size
            stats = _stats_between(before, totals)
            values["throughput/steps_per_sec"] = steps / elapsed
            values["staleness/mean"] = stats["staleness_mean"]
            values["staleness/max"] = float(totals["epoch_max"])
            values["staleness/dropped"] = float(stats["dropped_gradients"])
            if steps:
                values["gradients/norm"] = (totals["gradient_norm_sum"] - before["gradient_norm_sum"]) / steps
        if self._probe.is_ps:
            values.update(self._ps_bytes())
            values.update(self._traffic(totals, before, steps))
            values.update(self._latency_values(final))
            values["cluster/closure_retries"] = float(self._retries.count - self._retries_start)
        if self._seconds:
            values["sync/snapshot_seconds"] = float(self._seconds[-1])
        values.update(self._ps_rss())
        values.update(_table_values(self.model))
        if self._writer is not None:
            step = int(self.model.optimizer.iterations.numpy()) if self.model.optimizer is not None else self._batches
            with self._writer.as_default(step=step):
                for tag, value in values.items():
                    tf.summary.scalar(tag, value)
            self._writer.flush()
        self.last_values = values
        self._samples = _prometheus_samples(values, totals["steps"])
        self._mark = (now, totals)

    def _ps_components(self) -> list:
        """(ps task, variable component, embedding name or None) of the model's trainable variables."""
        out, seen = [], set()
        for variable in self.model.trainable_variables:
            for component in _components(variable):
                task = _ps_task(getattr(component, "device", ""))
                if task is None or id(component) in seen or not component.shape.is_fully_defined():
                    continue
                seen.add(id(component))
                out.append((task, component, self._probe.groups.get(id(component))))
        return out

    def _traffic(self, totals: dict, before: dict, steps: int) -> dict[str, float]:
        """Estimated bytes per step from and to each ps task (see Known limitations)."""
        if not steps:
            return {}
        num_ps = _runtime.num_ps(self.model.distribute_strategy)
        per_ps = [0.0] * num_ps
        parts = self._ps_components()
        rows_of = {}  # embedding name -> total rows of its components
        for _, component, name in parts:
            if name is not None:
                rows_of[name] = rows_of.get(name, 0) + int(component.shape[0])
        for task, component, name in parts:
            if task >= num_ps:
                continue
            if name is None:
                per_ps[task] += component.shape.num_elements() * component.dtype.size
            else:
                touched = (totals["rows"][name] - before["rows"][name]) / steps
                row_bytes = component.shape[1:].num_elements() * component.dtype.size
                per_ps[task] += touched * int(component.shape[0]) / max(rows_of[name], 1) * row_bytes
        for name, layer in self._probe.embedding_rows.items():
            if isinstance(layer, int):
                continue
            table_var = layer.table
            touched = (totals["rows"][name] - before["rows"][name]) / steps
            row_bytes = int(table_var.dim) * tf.as_dtype(table_var.value_dtype).size
            for device in table_var.devices:
                task = _ps_task(device)
                if task is not None and task < num_ps:
                    per_ps[task] += touched / len(table_var.devices) * row_bytes
        values = {}
        for task in range(num_ps):
            # A gradient has the shape of what was read.
            values[f"ps/{task}/bytes_from_ps_per_step"] = float(per_ps[task])
            values[f"ps/{task}/bytes_to_ps_per_step"] = float(per_ps[task])
        return values

    def _latency_values(self, final: bool) -> dict[str, float]:
        """The previous probe's round trips (ms per ps task); schedules the next probe."""
        values = {}
        if self._latency is not None:
            tasks, remote = self._latency
            self._latency = None
            try:
                seconds = remote.fetch()
            except Exception as err:  # pylint: disable=broad-except  (a worker lost mid-probe: no value this time)
                logger.info("ClusterMonitor: the latency probe failed: %s", _snapshots.first_line(err))
            else:
                values = {f"ps/{task}/latency_ms": 1000.0 * float(s) for task, s in zip(tasks, seconds)}
        if not final:
            self._schedule_latency_probe()
        return values

    def _schedule_latency_probe(self) -> None:
        if self._latency_fn is None:
            smallest: dict[int, Any] = {}
            for task, component, _ in self._ps_components():
                size = component.shape.num_elements()
                if task not in smallest or size < smallest[task].shape.num_elements():
                    smallest[task] = component
            tasks = sorted(smallest)
            reads = [smallest[task] for task in tasks]
            if not reads:
                return

            @tf.function
            def probe():
                # One element from each ps task in turn, timed on the worker:
                # the control edges order clock, read, clock.
                times, previous = [], tf.timestamp()
                for variable in reads:
                    with tf.control_dependencies([previous]):
                        start = tf.timestamp()
                    with tf.control_dependencies([start]):
                        value = variable.sparse_read([0]) if variable.shape.rank else variable.read_value()
                    with tf.control_dependencies([value]):
                        previous = tf.timestamp()
                    times.append(previous - start)
                return tf.stack(times)

            self._latency_fn = (tasks, probe)
        tasks, probe = self._latency_fn
        self._latency = (tasks, _coordinator(self.model).schedule(probe))

    def _ps_bytes(self) -> dict[str, float]:
        model = self.model
        num_ps = _runtime.num_ps(model.distribute_strategy)
        variable_bytes = [0] * num_ps
        table_bytes = [0] * num_ps
        seen = set()
        candidates = list(model.variables)
        if model.optimizer is not None:
            candidates += list(model.optimizer.variables)
        for variable in candidates:
            for component in _components(variable):
                if id(component) in seen:
                    continue
                seen.add(id(component))
                task = _ps_task(getattr(component, "device", ""))
                if task is not None and task < num_ps and component.shape.is_fully_defined():
                    variable_bytes[task] += component.shape.num_elements() * component.dtype.size
        for table_var in self._tfra_variables():
            row_bytes = _TFRA_KEY_BYTES + int(table_var.dim) * tf.as_dtype(table_var.value_dtype).size
            for device, table in zip(table_var.devices, table_var.tables):
                task = _ps_task(device)
                if task is not None and task < num_ps:
                    table_bytes[task] += int(table.size()) * row_bytes
        values = {}
        for task in range(num_ps):
            values[f"ps/{task}/variable_bytes"] = float(variable_bytes[task])
            values[f"ps/{task}/table_bytes"] = float(table_bytes[task])
        return values

    def _tfra_variables(self) -> list:
        tables = []
        for rows in self._probe.embedding_rows.values():
            if isinstance(rows, int):
                continue
            table = rows.table
            tables.append(table)
            try:
                # [] for an optimizer without slots (SGD).
                tables.extend(table.get_slot_variables(self.model.optimizer))
            except TypeError as error:  # TFRA 0.8.1: an optimizer class it does not know
                if table.name not in self._unsized_slots:
                    self._unsized_slots.add(table.name)
                    logger.warning("ClusterMonitor: ps/<i>/table_bytes leaves out the optimizer slots of table %s: %s",
                                   table.name, _snapshots.first_line(error))
        return tables

    def _ps_rss(self) -> dict[str, float]:
        cluster = self.cluster
        if cluster is None or not cluster.processes:
            return {}
        import psutil  # pylint: disable=import-outside-toplevel

        values = {}
        for task in range(cluster.config.num_ps):
            try:
                values[f"ps/{task}/rss_bytes"] = float(psutil.Process(cluster.pid("ps", task)).memory_info().rss)
            except psutil.NoSuchProcess:  # a task that is down right now (ZombieProcess included)
                continue
        return values


# ClusterMonitor tag -> (Prometheus metric, label name of the tag's middle part, scale).
_PROMETHEUS_TAGS = {
    "throughput/examples_per_sec": ("tf_psx_examples_per_second", None, 1.0),
    "throughput/steps_per_sec": ("tf_psx_steps_per_second", None, 1.0),
    "staleness/mean": ("tf_psx_staleness_mean", None, 1.0),
    "staleness/max": ("tf_psx_staleness_max", None, 1.0),
    "staleness/dropped": ("tf_psx_dropped_gradients", None, 1.0),
    "gradients/norm": ("tf_psx_gradient_norm", None, 1.0),
    "sync/snapshot_seconds": ("tf_psx_snapshot_seconds", None, 1.0),
    "cluster/closure_retries": ("tf_psx_closure_retries", None, 1.0),
    "ps/*/variable_bytes": ("tf_psx_ps_variable_bytes", "ps", 1.0),
    "ps/*/table_bytes": ("tf_psx_ps_table_bytes", "ps", 1.0),
    "ps/*/latency_ms": ("tf_psx_ps_latency_seconds", "ps", 1e-3),
    "ps/*/bytes_from_ps_per_step": ("tf_psx_ps_bytes_per_step", "ps", 1.0),
    "ps/*/bytes_to_ps_per_step": ("tf_psx_ps_bytes_per_step", "ps", 1.0),
    "sparsity/*": ("tf_psx_gradient_row_share", "layer", 1.0),
    "tables/*/rows": ("tf_psx_table_rows", "layer", 1.0),
    "tables/*/rows_evicted": ("tf_psx_table_rows_evicted", "layer", 1.0),
    "tables/*/rows_spilled": ("tf_psx_table_rows_spilled", "layer", 1.0),
}


def _prometheus_samples(values: dict[str, float], steps: int) -> list:
    """ClusterMonitor's values as `tf_psx.metrics` samples (rss comes from the process sampler)."""
    samples = [("tf_psx_steps", {}, float(steps))]
    for tag, value in values.items():
        parts = tag.split("/")
        key = tag if tag in _PROMETHEUS_TAGS or len(parts) < 2 else "/".join([parts[0], "*", *parts[2:]])
        if key not in _PROMETHEUS_TAGS:
            continue
        name, label, scale = _PROMETHEUS_TAGS[key]
        labels = {label: "/".join(parts[1:-1] if len(parts) > 2 else parts[1:])} if label else {}
        if name == "tf_psx_ps_bytes_per_step":
            labels["direction"] = "from_ps" if "from_ps" in tag else "to_ps"
        samples.append((name, labels, value * scale))
    return samples


def _table_values(model) -> dict[str, float]:
    """ClusterMonitor's `tables/...` tags."""
    values = {}
    for layer in _tables.hash_table_layers(model):
        values[f"tables/{layer.name}/rows"] = float(layer.size())
        if layer.policy is not None:
            values[f"tables/{layer.name}/rows_evicted"] = float(layer.policy.rows_evicted)
            values[f"tables/{layer.name}/rows_spilled"] = float(layer.policy.rows_spilled)
    return values


# ----------------------------------------------------------------------------
# StallDoctor


class StallDoctor(_RunCallback):
    """Logs why `fit` stopped making progress: closures by worker, task states, stacks.

    Under `ParameterServerStrategy`, when no step finishes for `timeout_s`
    while steps are pending, it logs one report (`tf_psx.stalls.StallWatch`):
    which worker runs which step since when and on which attempt, the state
    of each task process it knows (a worker stopped by SIGSTOP stands out),
    the coordinator's Python stacks, and it asks each running
    `tf_psx.server` task to write its stacks into its log. It changes
    nothing in training. Under other strategies it does nothing.

    Example:

    >>> doctor = tf_psx.callbacks.StallDoctor(timeout_s=300)  # doctest: +SKIP
    >>> model.fit(..., callbacks=[doctor])  # doctest: +SKIP
    >>> doctor.reports  # doctest: +SKIP
    []

    Args:
      timeout_s: number > 0, seconds without a finished step that make a stall.
      cluster: the `tf_psx.LocalCluster(processes=True)` the strategy runs
        on, for the task processes; under `tf-psx launch` the launcher's
        tasks are found without it.
      signal_tasks: ask the running tasks for their stacks (SIGUSR1).

    Attributes:
      reports: the text of every report of this callback's fits.

    Raises:
      ValueError: a bad `timeout_s`.
    """

    def __init__(self, timeout_s: float = DEFAULT_STALL_TIMEOUT_S, cluster=None, signal_tasks: bool = True):
        super().__init__()
        self.timeout_s = _stalls.check_timeout(timeout_s, "StallDoctor")
        self.cluster, self.signal_tasks = cluster, bool(signal_tasks)
        self.reports: list[str] = []
        self._watch: _stalls.StallWatch | None = None

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if _runtime.is_parameter_server_strategy(self.model.distribute_strategy):
            self._watch = _stalls.StallWatch(_coordinator(self.model), self.timeout_s, cluster=self.cluster,
                                             signal_tasks=self.signal_tasks)
            self._watch.reports = self.reports
            self._watch.start()

    def on_train_end(self, logs=None):
        if self._watch is not None:
            self._watch.stop()
            self._watch = None


# ----------------------------------------------------------------------------
# TableEviction


class TableEviction(_RunCallback):
    """Applies hash-table eviction (`max_age_steps`, `max_rows`, `spill_dir`) on a schedule.

    Every `every_n_steps` steps and/or every `every_seconds` seconds (and
    once when fit ends, after its last step), each `tf_psx.layers.DynamicEmbedding` of the model
    that has a policy runs `layer.policy.evict()`: the rows to drop are chosen
    from a copy of the table's meta entries, then removed (with their
    optimizer slots) under the table's locks after a recheck that each was
    not used meanwhile. Workers keep running the steps already scheduled;
    only the removal itself holds the locks. Each run is logged with its
    numbers, and `reports` keeps them (`tables.EvictionReport`).

    Example:

    >>> import numpy as np, tensorflow as tf, tf_psx
    >>> inputs = tf.keras.Input((1,), dtype=tf.int64)
    >>> table = tf_psx.layers.DynamicEmbedding(2, max_rows=3, name="ids")
    >>> model = tf.keras.Model(inputs, tf.reduce_sum(table(inputs), axis=[1, 2]))
    >>> model.compile("sgd", "mse")
    >>> _ = model.fit(np.arange(8).reshape(8, 1), np.zeros(8), batch_size=2, verbose=0,
    ...               callbacks=[tf_psx.callbacks.TableEviction(every_n_steps=2)])
    >>> table.size()  # the 3 most recently used keys
    3

    Args:
      every_n_steps: int >= 1 or None: steps between runs.
      every_seconds: number > 0 or None: seconds between runs. At least one
        of the two must be given.

    Attributes:
      reports: the `EvictionReport` of every run, all tables.

    Raises:
      ValueError: bad arguments, or (when fit starts) a model without a
        DynamicEmbedding that has a policy.
    """

    def __init__(self, every_n_steps: int | None = None, every_seconds: float | None = None):
        super().__init__()
        self.every_n_steps = _checks.int_at_least(every_n_steps, 1, "every_n_steps", owner="TableEviction",
                                                  or_none=True, fix="pass e.g. TableEviction(every_n_steps=1000)")
        if every_seconds is not None and (isinstance(every_seconds, bool) or not isinstance(every_seconds, (int, float))
                                          or not every_seconds > 0):
            raise ValueError(f"Argument `every_seconds` of TableEviction must be a number > 0 or None. Received: "
                             f"{every_seconds!r}. Fix: pass e.g. TableEviction(every_seconds=60).")
        if every_n_steps is None and every_seconds is None:
            raise ValueError("TableEviction needs `every_n_steps` or `every_seconds`. Received: neither. "
                             "Fix: pass e.g. TableEviction(every_n_steps=1000).")
        self.every_seconds = every_seconds
        self.reports: list = []
        self._layers: list = []

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._layers = [layer for layer in _tables.hash_table_layers(self.model) if layer.policy is not None]
        if not self._layers:
            raise ValueError(
                f"TableEviction: model {self.model.name} has no DynamicEmbedding with max_age_steps, max_rows or "
                "min_count, so there is nothing to evict. Fix: pass max_rows=... or max_age_steps=... to the "
                "DynamicEmbedding layers, or drop the callback.")
        self._steps = 0
        self._last_run_step = 0
        self._last_run_time = time.monotonic()
        self._epoch_start = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = self._steps

    def on_train_batch_end(self, batch, logs=None):
        self._steps = self._epoch_start + int(batch) + 1
        due = self.every_n_steps is not None and self._steps - self._last_run_step >= self.every_n_steps
        due = due or (self.every_seconds is not None and time.monotonic() - self._last_run_time >= self.every_seconds)
        if due:
            self._run()

    def on_train_end(self, logs=None):
        # Under ParameterServerStrategy always: the runs during fit may have
        # come before the steps they follow were applied.
        if self._steps > self._last_run_step or _runtime.is_parameter_server_strategy(self.model.distribute_strategy):
            self._run()

    def _run(self) -> None:
        # No barrier: steps keep running; a row chosen as a victim and used
        # before it is removed stays (the recheck under the table's locks).
        for layer in self._layers:
            report = layer.policy.evict()
            self.reports.append(report)
            logger.info(
                "TableEviction: %s at step %d: %d -> %d rows (%d by age, %d by size, %d pending counters dropped, "
                "%d spilled, %d back from disk) in %.3f s", report.table, report.step, report.rows_before,
                report.rows_after, report.evicted_by_age, report.evicted_by_size, report.pending_dropped,
                report.spilled, report.returned, report.seconds)
        self._last_run_step = self._steps
        self._last_run_time = time.monotonic()
