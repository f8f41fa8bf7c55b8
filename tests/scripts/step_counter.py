"""A callback for the crash-and-resume scripts (not a script itself): counts global steps, acts on each."""

from __future__ import annotations

import tensorflow as tf


class StepCounter(tf.keras.callbacks.Callback):
    """Appends the global step of every batch end to `batch_ends`, then calls `on_step(step, model)`.

    The global step is epoch * steps_per_epoch + batch + 1, so a resumed fit
    (initial_epoch > 0) counts on from where the first run stopped.
    """

    def __init__(self, steps_per_epoch: int, on_step=None):
        super().__init__()
        self._supports_tf_logs = True  # batch hooks run under ParameterServerStrategy
        self.steps_per_epoch = steps_per_epoch
        self.on_step = on_step
        self.batch_ends: list[int] = []
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step = self.epoch * self.steps_per_epoch + batch + 1
        self.batch_ends.append(step)
        if self.on_step is not None:
            self.on_step(step, self.model)
