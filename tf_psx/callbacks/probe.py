"""The per-model step probe: counters on the ps tasks that every training step of one model updates.

`_StepProbe` wraps `train_step` and the optimizer's apply (through
`tf_psx._tf.fit_hooks`) once per model, for whichever callbacks need it:
`StalenessBound` configures its policy (drop or scale stale gradients),
`StalenessBound` and `ClusterMonitor` read its counters (steps, examples,
staleness, dropped gradients, gradient norms, rows touched per embedding).
It is installed by the first callback that acquires it and removed when
the last one releases it.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import tensorflow as tf

from tf_psx._tf import fit_hooks as _fit_hooks, keras as _tf_keras, runtime as _runtime
from tf_psx.errors import ArgumentError

_keras = _tf_keras.keras()

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


def _components(variable) -> list:
    """The real variables behind `variable` (the shards of a ShardedVariable)."""
    return list(getattr(variable, "variables", None) or [variable]) if _is_sharded(variable) else [variable]


def _is_sharded(variable) -> bool:
    return isinstance(variable, tf.__internal__.distribute.ShardedVariable)


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
                # A native table's weight is its scalar anchor: its rows are counted by `size()` (ClusterMonitor's
                # tables/<name>/rows), not by the probe's row counters.
                if layer.store != "native":
                    yield layer.name, list(layer.trainable_weights), layer
            elif isinstance(layer, _keras.layers.Embedding):
                yield layer.name, list(layer.trainable_weights), int(layer.input_dim)

    # -- configuration -------------------------------------------------------

    def acquire(self, holder, policy: tuple[str, int] | None = None) -> None:
        self._holders[id(holder)] = policy
        policies = [p for p in self._holders.values() if p is not None]
        if len(set(policies)) > 1:
            raise ArgumentError(
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


# The probe of each model (one per model, shared by its callbacks).
_PROBES: "weakref.WeakKeyDictionary[Any, _StepProbe]" = weakref.WeakKeyDictionary()


def _probe(model) -> _StepProbe:
    """The probe of `model`, made on first use."""
    probe = _PROBES.get(model)
    if probe is None:
        probe = _PROBES[model] = _StepProbe(model)
    return probe


def _coordinator(model):
    return tf.distribute.experimental.coordinator.ClusterCoordinator(model.distribute_strategy)


def _stats_between(start: dict, end: dict) -> dict:
    """Staleness statistics of the steps between two `_StepProbe.totals()` readings."""
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
