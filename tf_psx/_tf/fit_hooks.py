"""Hooks into tf-keras 2.16's fit for tf_psx.callbacks: train_step, the optimizer's apply, resume counters."""

from __future__ import annotations

from tf_psx.errors import ArgumentError, ArgumentTypeError

def wrap_train_step(model, make_wrapper):
    """Replaces `model.train_step` on the instance by `make_wrapper(original)`.

    Returns a function that puts the original back. tf-keras 2.16's
    `make_train_function` calls `model.train_step(data)` inside
    `strategy.run`, so an instance attribute is picked up on the next trace;
    call `rebuild_train_function` after wrapping.
    """
    had_own = "train_step" in model.__dict__
    original = model.train_step
    model.__dict__["train_step"] = make_wrapper(original)

    def undo():
        if had_own:
            model.__dict__["train_step"] = original
        else:
            model.__dict__.pop("train_step", None)

    return undo


def wrap_optimizer_apply(optimizer, make_wrapper):
    """Wraps the optimizer's cross-replica apply, `_distributed_apply_gradients_fn`.

    tf-keras 2.16 `Optimizer.apply_gradients` aggregates the gradients
    (a `merge_call`), builds the slots, then calls
    `_distributed_apply_gradients_fn(distribution, grads_and_vars, **kwargs)`,
    which updates every variable and `iterations`. Wrapping that function
    (and not `apply_gradients`) lets the wrapper put the whole update under a
    `tf.cond`: a `merge_call` inside a `tf.cond` is refused by
    tf.distribute. TFRA 0.8.1's `DynamicEmbeddingOptimizer` sets its own
    version of this function on the instance; the wrapper wraps whichever
    is there. Returns a function that puts the original back.
    """
    name = "_distributed_apply_gradients_fn"
    if not hasattr(optimizer, name):
        raise ArgumentTypeError(
            f"The optimizer {type(optimizer).__qualname__} has no `{name}`: it is not a tf-keras 2.16 "
            "optimizer (tf.keras.optimizers.*). Fix: compile the model with a tf.keras optimizer; legacy "
            "optimizers (tf.keras.optimizers.legacy.*) are not supported by tf_psx.callbacks."
        )
    had_own = name in optimizer.__dict__
    original = getattr(optimizer, name)
    setattr(optimizer, name, make_wrapper(original))

    def undo():
        if had_own:
            setattr(optimizer, name, original)
        else:
            optimizer.__dict__.pop(name, None)

    return undo


def rebuild_train_function(model) -> None:
    """Makes `fit` use a new train function, traced again on its next call.

    tf-keras 2.16's `fit` reads `model.train_function` on every step, so a
    rebuild in `on_train_begin` takes effect for the first step.
    """
    model.train_function = None
    model.make_train_function(force=True)


def forget_train_function(model) -> None:
    """Makes the next `fit` build (and trace) its train function again."""
    model.train_function = None


class _InitialCounters:
    """Stands in for tf-keras's WorkerTrainingState during one `fit`.

    tf-keras 2.16 `Model.fit` calls
    `model._training_state.maybe_load_initial_counters_from_ckpt(...)` right
    after `on_train_begin` and starts its epoch and step loops from what it
    returns (BackupAndRestore works this way): steps already done are skipped.
    """

    def __init__(self, epoch: int, step: int):
        self.epoch, self.step = int(epoch), int(step)

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):  # pylint: disable=unused-argument
        return self.epoch, self.step


def set_initial_counters(model, epoch: int, step: int) -> None:
    """Makes the running `fit` start at (epoch, step in that epoch)."""
    current = getattr(model, "_training_state", None)
    if current is not None and not isinstance(current, _InitialCounters):
        raise ArgumentError(
            "tf.keras.callbacks.BackupAndRestore and tf_psx.callbacks.PeriodicSync were both passed "
            "to fit; both decide where fit resumes. Fix: keep only PeriodicSync (it saves between "
            "epochs too, and its batch-level snapshots work under ParameterServerStrategy)."
        )
    model._training_state = _InitialCounters(epoch, step)  # pylint: disable=protected-access


def clear_initial_counters(model) -> None:
    """Undoes `set_initial_counters` (leaves BackupAndRestore's state alone)."""
    if isinstance(getattr(model, "_training_state", None), _InitialCounters):
        model._training_state = None  # pylint: disable=protected-access
