"""Exact optimizer updates under several asynchronous workers.

tf-keras optimizers write a variable's update as several separate ops: SGD
runs `m.assign(m * momentum)`, `m.scatter_add(...)` and `var.assign_add(m)`
(even at momentum 0), Adam decays and scatters `m` and `v` and then reads
them back, and bias-corrects with the global `iterations`. With one worker
the ops of two steps never interleave. With several, they do, on the same
ps variable: measured with stock `SGD` and 2 workers, 1.2x to 1.4x of the
true update was applied (worker A's `var.assign_add(m)` adds worker B's
gradient, which B adds again).

Here each variable's update runs as one unit. Every trainable variable (each
shard of a sharded one) gets a `tf.CriticalSection` on its own ps task, and
the optimizer's `_update_step` for that variable runs inside it: the
gradient is first copied to the ps (so the lock is never held while data is
still in flight from a worker), then the optimizer's own ops run under the
lock, and the lock is released when every op they created has run. Locks
are per variable, so updates of different variables (and different shards)
still run in parallel; only two updates of the same shard wait on each other,
which is what the `use_locking` kernels of TF's fused optimizers do too.

Adam-family optimizers bias-correct with the step number. Under several
workers the global `iterations` is read by two steps at once, so each
variable also gets its own step counter, colocated with it, read and
incremented under the lock; inside the update `optimizer.iterations` is that
counter. With one worker it equals the global count. The counters are
tracked by the optimizer (`_tf_psx_local_steps`), so they are checkpointed
and restored with it.

Written against tf-keras 2.16 (`optimizers/optimizer.py`: `_BaseOptimizer.
_update_step`, `_update_step_xla`, `_iterations`, `_var_key`) and TF 2.16.2
(`tf.CriticalSection`). `tests/test_exact_updates.py` fails loudly if they move.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import tensorflow as tf

from tf_psx import _compat

# Attribute names on the optimizer instance.
_STATE_ATTR = "_tf_psx_update_locks"
_STEPS_ATTR = "_tf_psx_local_steps"
# Mutexes are shared by name on their ps task; the counter keeps two
# optimizers (or two processes' variables of one name) apart.
_LOCK_PREFIX = "tf_psx_update_lock"
_ids = itertools.count()
_install_lock = threading.Lock()
_INSTALLED = False


def _base_optimizer_class():
    return _compat.keras().optimizers.Optimizer.__mro__[1]


def _strategy_wants_exact(optimizer) -> bool:
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    strategy = strategy or getattr(optimizer, "_distribution_strategy", None)
    return bool(getattr(strategy, "exact_updates", False))


def _is_tfra_shadow(variable) -> bool:
    # TFRA's per-batch buffers are written back to the hash tables by TFRA's
    # own apply path (tf_psx.layers.DynamicEmbedding handles those).
    return type(variable).__module__.startswith("tensorflow_recommenders_addons")


def _applies(optimizer, variable) -> bool:
    return (
        getattr(variable, "_unique_id", None) is not None
        and not _is_tfra_shadow(variable)
        and _strategy_wants_exact(optimizer)
    )


def _state_for(optimizer, variable):
    """The (lock, step counter) of `variable`, created on its ps task on first use."""
    locks = optimizer.__dict__.setdefault(_STATE_ATTR, {})
    key = optimizer._var_key(variable)  # pylint: disable=protected-access
    if key in locks:
        return locks[key]
    strategy = tf.distribute.get_strategy()
    with tf.init_scope():
        if not hasattr(optimizer, _STEPS_ATTR):
            # A tracked dict: the counters are saved with the optimizer.
            setattr(optimizer, _STEPS_ATTR, {})
        with strategy.extended.colocate_vars_with(variable):
            step = tf.Variable(
                tf.constant(0, tf.int64),
                trainable=False,
                name=f"{key.replace('/', '_').replace(':', '_')}_local_step",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
        with tf.device(variable.device):
            lock = tf.CriticalSection(shared_name=f"{_LOCK_PREFIX}_{next(_ids)}")
        getattr(optimizer, _STEPS_ATTR)[key] = step
    locks[key] = (lock, step)
    return locks[key]


@contextlib.contextmanager
def _iterations_as(optimizer, value):
    """Makes `optimizer.iterations` read `value` inside the block."""
    original = optimizer.__dict__["_iterations"]
    # object.__setattr__: a plain swap, not a new tracked dependency.
    object.__setattr__(optimizer, "_iterations", value)
    try:
        yield
    finally:
        object.__setattr__(optimizer, "_iterations", original)


def _on_variable_device(gradient, variable):
    with tf.device(variable.device):
        if isinstance(gradient, tf.IndexedSlices):
            return tf.IndexedSlices(tf.identity(gradient.values), tf.identity(gradient.indices), gradient.dense_shape)
        return tf.identity(gradient)


def _locked_update(original, optimizer, gradient, variable):
    lock, step = _state_for(optimizer, variable)
    gradient = _on_variable_device(gradient, variable)

    def update():
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        before = set(graph.get_operations()) if graph is not None else set()
        done_steps = step.read_value()
        with _iterations_as(optimizer, done_steps):
            original(optimizer, gradient, variable)
        created = [op for op in graph.get_operations() if op not in before] if graph is not None else []
        # The lock is released once the returned tensor exists: make it wait
        # for every op of the update, not only for the counter.
        with tf.control_dependencies(created):
            return step.assign_add(1, read_value=True)

    return lock.execute(update, exclusive_resource_access=False)


def install() -> None:
    """Routes tf-keras optimizer updates through `_locked_update` (once per process).

    The patch is inert unless the strategy in scope has `exact_updates`
    set (tf_psx.ParameterServerStrategy does by default).
    """
    global _INSTALLED  # pylint: disable=global-statement
    with _install_lock:
        if _INSTALLED:
            return
        base = _base_optimizer_class()
        original_update = base._update_step  # pylint: disable=protected-access
        original_xla = base.__dict__["_update_step_xla"]

        def _update_step(self, gradient, variable):
            if not _applies(self, variable):
                return original_update(self, gradient, variable)
            return _locked_update(original_update, self, gradient, variable)

        def _update_step_xla(self, gradient, variable, key):
            # A mutex cannot be compiled by XLA: the exact path runs unjitted.
            if _applies(self, variable):
                return _update_step(self, gradient, variable)
            return original_xla.__get__(self, type(self))(gradient, variable, key)

        _update_step.__wrapped__ = original_update
        _update_step_xla.__wrapped__ = original_xla
        base._update_step = _update_step  # pylint: disable=protected-access
        base._update_step_xla = _update_step_xla  # pylint: disable=protected-access
        _INSTALLED = True
