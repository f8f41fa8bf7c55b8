"""What a model's optimizer becomes at compile under a strategy with exact updates, and the warning when it is not exact.

The update protocol itself is tf_psx.training.exact_updates. At `Model.compile`
(the hook of `tf_psx._tf.exact_updates.install_compile_hook`): a legacy
optimizer becomes its current tf-keras twin, a model with TFRA's own layers
gets TFRA's optimizer wrapper with exact table updates
(`adopt_exact_optimizer`), and a result that is still not exact under
several async workers is named with its fix (`inexact_reason`).
"""

from __future__ import annotations

import inspect
import logging

from tf_psx._tf import exact_updates as _door, keras as _tf_keras, runtime as _runtime, tfra as _tfra
from tf_psx.errors import TFRAOptimizerError

logger = logging.getLogger("tf_psx")

# The wrapper that gives a TFRA optimizer exact table updates: set by tf_psx.tables.tfra_updates when it is
# imported (tf_psx.strategies imports it), so the training core does not import the tables.
_TFRA_WRAPPER = []


def register_tfra_wrapper(wrap) -> None:
    """`wrap(optimizer, bp_v2=...)` wraps a model's optimizer when the model has TFRA's own layers."""
    _TFRA_WRAPPER[:] = [wrap]


def inexact_reason(optimizer, strategy) -> str | None:
    """Why `optimizer` under `strategy` may lose or double updates; None when exact.

    Exact: one worker, or tf_psx's strategy with `exact_updates` and a
    tf-keras (non-legacy) optimizer. Legacy optimizers
    (`tf.keras.optimizers.legacy.*`) apply through TF's own kernels without
    the lock; of those only plain SGD (a scatter-add) is exact.
    """
    if not hasattr(strategy, "exact_updates") or getattr(strategy, "num_workers", 1) < 2:
        return None
    if not strategy.exact_updates:
        return (
            "ParameterServerStrategy(exact_updates=False): several async workers can lose or double "
            "updates of one variable. Fix: leave exact_updates=True (the default)."
        )
    legacy = _tf_keras.keras().optimizers.legacy.Optimizer
    if isinstance(optimizer, legacy):
        plain_sgd = type(optimizer).__name__ == "SGD" and not _door.legacy_momentum(optimizer)
        if not plain_sgd:
            return (
                f"the legacy optimizer {type(optimizer).__qualname__} applies its updates without tf_psx's "
                "per-variable lock, so several async workers can lose or mix updates. Fix: use "
                f"tf.keras.optimizers.{type(optimizer).__name__} (or tf_psx.optimizers.LazyAdam / SGD)."
            )
    return None


def current_optimizer_for(optimizer):
    """The current tf-keras optimizer with a legacy optimizer's settings, or None when there is none.

    A legacy optimizer (`tf.keras.optimizers.legacy.*`) applies its update
    through TF's fused kernels, outside tf_psx's per-variable lock, and its
    Adam bias correction reads the global step: several async workers lose or
    mix updates. The current class of the same name computes the same update
    (Adam: `lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)` in both).
    None when the class has no current twin or a setting has no meaning there
    (`decay` != 0).
    """
    current = getattr(_tf_keras.keras().optimizers, type(optimizer).__name__, None)
    if current is None or not isinstance(current, type):
        return None
    config = optimizer.get_config()
    if config.pop("decay", 0.0):
        return None
    accepted = inspect.signature(current.__init__).parameters
    return current.from_config({key: value for key, value in config.items() if key in accepted})


def adopt_exact_optimizer(model) -> None:
    """Under a strategy with exact updates: a legacy optimizer becomes its current twin, TFRA layers get exact updates.

    A legacy optimizer (`tf.keras.optimizers.legacy.*`) applies its update
    through TF's fused kernels, outside the per-variable lock, and its Adam
    bias correction reads the global step. The current class of the same
    name computes the same update, so it replaces it, with the same
    settings (logged once per model); without a twin
    (`current_optimizer_for` is None) the compile warning says so.

    A model with TFRA's own layers (`de.keras.layers.Embedding`,
    `SquashedEmbedding`) failed with 2 workers under TF alone, as in TFRA's
    own parameter-server demo ("Cannot update variable with shape [63,32]
    using a Tensor with shape [64,32]"): the workers shared the shadows
    (made per worker by `tf_psx._tf.shadows`) and the update wrote rows back
    as values outside any lock. Its optimizer is wrapped by TFRA if the user
    left that out, and the table updates go through
    `tf_psx.tables.tfra_updates.tfra_apply_gradients_fn`.
    tf_psx's own DynamicEmbedding is handled by its compile hook.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or _tfra.wrapped_for_tables(optimizer):
        return
    tfra_layers = _tfra.model_has_tfra_layers(model) and not _tfra.model_has_dynamic_embedding(model)
    bp_v2 = _tfra.bp_v2_of(optimizer)
    if isinstance(optimizer, _tf_keras.keras().optimizers.legacy.Optimizer):
        # In the model's strategy scope, as compile made the optimizer: its `iterations` was otherwise made on
        # the coordinator, and every step's bump of it a round trip there.
        with model.distribute_strategy.scope():
            replacement = current_optimizer_for(optimizer)
        if replacement is None:
            if tfra_layers:
                raise TFRAOptimizerError(
                    f"Model {model.name} has TFRA layers and the legacy optimizer {type(optimizer).__qualname__}, "
                    "which has no current tf.keras twin with these settings; its table updates cannot be made "
                    f"exact under several async workers. Received: {optimizer.get_config()}. Fix: compile with a "
                    "tf.keras.optimizers optimizer (wrapped in de.DynamicEmbeddingOptimizer as before).")
            return
        logger.info(
            "Model %s: the legacy %s was replaced by tf.keras.optimizers.%s with the same settings, so that "
            "every update is exact under several async workers.",
            model.name, type(optimizer).__name__, type(replacement).__name__)
        optimizer = replacement
    if tfra_layers:
        optimizer = _TFRA_WRAPPER[0](optimizer, bp_v2=bp_v2)
    model.optimizer = optimizer


def _after_compile(model) -> None:
    """Adopts an exact optimizer under a strategy with exact updates, and warns when the result is not exact.

    Under a tf_psx ParameterServerStrategy, an optimizer constructed outside
    `strategy.scope()` first gets its `iterations` and learning rate made
    again on the ps tasks (`remake_in_scope`). Left on the coordinator, a
    small model's step (Dense 64-1, Adam, batch 256, 1 worker, 2 ps tasks)
    took 8.4-11.9 ms in 3 runs by hand; made again, 5.4-6.6 ms, as with the
    optimizer made in the scope (5.6-6.7).
    """
    optimizer = getattr(model, "optimizer", None)
    if hasattr(model.distribute_strategy, "exact_updates") and optimizer is not None:
        remade = _door.remake_in_scope(optimizer, model.distribute_strategy)
        if remade:
            logger.info("Model %s: the optimizer was made outside strategy.scope(); %s made again on the ps tasks.",
                        model.name, " and ".join(remade))
    if getattr(model.distribute_strategy, "exact_updates", False):
        adopt_exact_optimizer(model)
    _attach_native_tables(model)
    reason = inexact_reason(getattr(model, "optimizer", None), model.distribute_strategy)
    if reason:
        logger.warning("Model %s: %s", model.name, reason)


def _attach_native_tables(model) -> None:
    """Each native hash table of `model` checks its optimizer and is laid out for its slots (tf_psx.tables.updates)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    for layer in _runtime.flatten_layers(model):
        if getattr(layer, "store", None) == "native":
            layer.attach_optimizer(optimizer)


def install_compile_warning() -> None:
    """Makes tf-keras `Model.compile` adopt an exact optimizer, and warn when it is not exact under the strategy."""
    _door.install_compile_hook(_after_compile)
