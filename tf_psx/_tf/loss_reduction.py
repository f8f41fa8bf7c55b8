"""tf-keras's refusal of a default-reduction loss object under a strategy, lifted for one-replica workers (tf-keras 2.16-2.21).

tf-keras's `Loss._get_reduction` raises "Please use
`tf.keras.losses.Reduction.SUM` or `tf.keras.losses.Reduction.NONE` ... when
losses are used with `tf.distribute.Strategy`" for any loss object with the
default reduction (`AUTO` or `SUM_OVER_BATCH_SIZE`) called outside
`compile`, under any strategy. The refusal guards against a per-replica mean
under a mirrored strategy, which sums the replicas' gradients. Under a
parameter-server strategy each worker's step is one replica
(`num_replicas_in_sync == 1`), so the default reduction means what it means
without a strategy: a model's own `train_step` that calls such a loss (TensorFlow
Recommenders' `tasks.Ranking` does) trains as it does with no strategy. Under
tf_psx's `sync=True` the step's gradient is the mean of the workers' batch
gradients, so a per-batch mean equals the mean over the combined batch when
the batches are of equal size; a short last batch weighs as much as a full one.

Only a strategy that `applies(strategy)` says is tf_psx's (the caller passes
that test) with one replica in sync is let through; every other strategy gets
tf-keras's error unchanged.
"""

from __future__ import annotations

from tf_psx._tf.keras import keras

_INSTALLED: dict = {}


def install(applies) -> None:
    """Lets `applies(strategy)` strategies with one replica in sync use default-reduction losses (first call's test kept)."""
    if _INSTALLED:
        return
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    loss_class = keras().losses.Loss
    original = loss_class._get_reduction  # pylint: disable=protected-access
    reduction = keras().losses.Reduction

    def _get_reduction(self):
        if (self.reduction in (reduction.AUTO, reduction.SUM_OVER_BATCH_SIZE) and tf.distribute.has_strategy()):
            strategy = tf.distribute.get_strategy()
            if applies(strategy) and strategy.num_replicas_in_sync == 1:
                return reduction.SUM_OVER_BATCH_SIZE
        return original(self)

    _get_reduction.__wrapped__ = original
    loss_class._get_reduction = _get_reduction  # pylint: disable=protected-access
    _INSTALLED["original"] = original
