"""What synchronous training (tf_psx.training.sync_training) reaches into in TF 2.16.2 and tf-keras 2.16.

The algorithm (claims, accumulators, the apply of a version, the flush, the
watchdog) is tf_psx.training.sync_training; this module only patches and reads:

* `install(controller_of)`: tf-keras `Optimizer._internal_apply_gradients`
  calls `controller.apply_gradients_fn(optimizer, original)` through
  tf.distribute's `merge_call` while a step with a claim is traced, and
  `Model.fit` calls `controller.flush()` when it returns (the tail flush);
  `controller_of(strategy)` returns the strategy's controller or None.
* `StepClaims`: the claim a step traced by `strategy.run` holds, found again
  from the graph the optimizer's apply is traced in (`outer_graph`).
* `learning_rate_update`: tf-keras's `_current_learning_rate` and
  `_learning_rate` (a schedule) for the step about to be applied.
* `steps_pending` and `fail_steps`: the coordinator's closure queue (its
  private fields), which the watchdog fails with an error that names the
  workers.
* `sleep`: tf.data's sleep transformation, a graph op that waits.

TFRA's shadows are loaded at the apply through `tf_psx._tf.shadows`.
"""

from __future__ import annotations

import threading

from tf_psx._tf import keras as _tf_keras

_install_lock = threading.Lock()
_INSTALLED = False


def sleep(seconds: float):
    """A graph op that sleeps `seconds` where it runs (tf.data's sleep transformation)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.python.data.experimental.ops import testing  # pylint: disable=import-outside-toplevel

    micros = max(1, int(seconds * 1e6))
    dataset = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).apply(testing.sleep(micros))
    return dataset.reduce(tf.constant(0, tf.int64), lambda total, item: total + item)


class StepClaims:
    """The claim held by each step being traced, keyed by its graph.

    Keyed by graph, not thread: tf.distribute runs a replica's fn in its own
    thread and the optimizer's merge_call in the caller's. A nested function
    (a `tf.cond` branch, a `while_loop` body) finds its step's claim through
    the graphs it is nested in.
    """

    def __init__(self):
        self._claims: dict = {}

    def wrap(self, fn, claim):
        """`fn` run after `claim()` (a tensor): every op it makes waits for the claim."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        def step(*args, **kwargs):
            version = claim()
            graph = tf.compat.v1.get_default_graph()
            stack = self._claims.setdefault(graph, [])
            stack.append(version)
            try:
                with tf.control_dependencies([version]):
                    return fn(*args, **kwargs)
            finally:
                stack.pop()
                if not stack:
                    self._claims.pop(graph, None)

        return step

    def current(self):
        """The claim of the step being traced, or None outside one."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        graph = tf.compat.v1.get_default_graph()
        while graph is not None:
            stack = self._claims.get(graph)
            if stack:
                return stack[-1]
            graph = getattr(graph, "outer_graph", None)
        return None


def learning_rate_update(optimizer) -> list:
    """The schedule's rate for the step about to be applied, from `iterations` (read under the lock).

    tf-keras 2.16 sets `_current_learning_rate` from `_learning_rate(iterations)`
    when `apply_gradients` starts (`_compute_current_learning_rate`); a sync
    step's apply runs later, under the lock, and sets it again. Returns the
    assign ops ([] without a schedule).
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    schedule_class = tf.keras.optimizers.schedules.LearningRateSchedule
    current = getattr(optimizer, "_current_learning_rate", None)
    if current is None or not isinstance(getattr(optimizer, "_learning_rate", None), schedule_class):
        return []
    value = optimizer._learning_rate(optimizer.iterations)  # pylint: disable=protected-access
    return [current.assign(tf.cast(value, current.dtype), read_value=False)]


def _closure_queue(strategy):
    coordinator = getattr(strategy, "_cluster_coordinator", None)
    return getattr(getattr(coordinator, "_cluster", None), "closure_queue", None)


def steps_pending(strategy) -> bool:
    """True when the strategy's coordinator has closures queued or in flight (False without a coordinator)."""
    queue = _closure_queue(strategy)
    return queue is not None and not (queue._queue.empty() and queue._inflight_closure_count == 0)  # pylint: disable=protected-access


def fail_steps(strategy, error: Exception) -> None:
    """Makes the strategy's coordinator raise `error` in `join()`/`schedule()`, its queued closures cancelled."""
    queue = _closure_queue(strategy)
    if queue is not None:
        fail_queue(queue, error)


def fail_queue(queue, error: Exception) -> None:
    """Makes TF 2.16's closure queue raise `error` in `join()`/`schedule()` (private fields)."""
    with queue._queue_lock:  # pylint: disable=protected-access
        if queue._error is None:  # pylint: disable=protected-access
            queue._error = error  # pylint: disable=protected-access
        while not queue._queue.empty():  # pylint: disable=protected-access
            queue._queue.get(block=False).mark_cancelled()  # pylint: disable=protected-access
            queue._queue_free_slot_condition.notify()  # pylint: disable=protected-access
        queue._stop_waiting_condition.notify_all()  # pylint: disable=protected-access
        queue._no_inflight_closure_condition.notify_all()  # pylint: disable=protected-access


def install(controller_of) -> None:
    """Routes the tf-keras optimizer apply through the strategy's controller, and flushes at fit's end (once).

    Args:
      controller_of: `controller_of(strategy)`, the strategy's sync
        controller or None. A controller has `current_version()` (the claim
        of the step being traced, or None), `apply_gradients_fn(optimizer,
        original)` (a `_distributed_apply_gradients_fn` that wraps
        `original`) and `flush()`.
    """
    global _INSTALLED  # pylint: disable=global-statement
    with _install_lock:
        if _INSTALLED:
            return
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        keras = _tf_keras.keras()
        optimizer_class = keras.optimizers.Optimizer
        original_internal = optimizer_class._internal_apply_gradients  # pylint: disable=protected-access

        def _internal_apply_gradients(self, grads_and_vars):
            controller = controller_of(self._distribution_strategy)  # pylint: disable=protected-access
            if controller is None or controller.current_version() is None:
                return original_internal(self, grads_and_vars)
            fn = controller.apply_gradients_fn(self, self._distributed_apply_gradients_fn)  # pylint: disable=protected-access
            return tf.__internal__.distribute.interim.maybe_merge_call(fn, self._distribution_strategy, grads_and_vars)  # pylint: disable=protected-access

        _internal_apply_gradients.__wrapped__ = original_internal
        optimizer_class._internal_apply_gradients = _internal_apply_gradients  # pylint: disable=protected-access

        model_class = keras.Model
        original_fit = model_class.fit

        def fit(self, *args, **kwargs):
            history = original_fit(self, *args, **kwargs)
            controller = controller_of(self.distribute_strategy)
            if controller is not None:
                controller.flush()
            return history

        fit.__doc__ = original_fit.__doc__
        fit.__wrapped__ = original_fit
        model_class.fit = fit
        _INSTALLED = True
