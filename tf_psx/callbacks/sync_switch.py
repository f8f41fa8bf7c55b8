"""`SyncSwitch`: switches a `sync="switchable"` strategy from async to sync steps (or back) during `fit`."""

from __future__ import annotations

import logging

from tf_psx import _checks
from tf_psx.callbacks.base import _RunCallback
from tf_psx.errors import ArgumentError, ArgumentTypeError
from tf_psx.snapshots.engine import finish_snapshots_of

__all__ = ["SyncSwitch"]

logger = logging.getLogger("tf_psx")


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
    is applied once. The epoch logs get `sync`: 1.0 when the epoch's last
    step ran synchronously, else 0.0 (a switch at the end of an epoch shows
    from the next epoch on).

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
      switched_at_epoch: the epoch in which it changed, counted from 0 as
        `history.history` indexes epochs, or None.
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
            raise ArgumentError(f'Argument `to` of SyncSwitch must be "sync" or "async". Received: {to!r}.')
        if at_step is None and patience is None:
            raise ArgumentError(
                "SyncSwitch needs `at_step` or `patience` (or both). Received neither. Fix: e.g. "
                'SyncSwitch(to="sync", patience=2) to switch when the loss stops improving.'
            )
        if at_step is not None:
            at_step = _checks.int_at_least(at_step, 1, "at_step", owner="SyncSwitch", fix="pass e.g. at_step=1000")
        if patience is not None:
            patience = _checks.int_at_least(patience, 1, "patience", owner="SyncSwitch", fix="pass e.g. patience=2")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise ArgumentError(f"Argument `min_delta` of SyncSwitch must be a number >= 0. Received: {min_delta!r}.")
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
            raise ArgumentTypeError(
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
        # The mode this epoch's last step ran in: a switch at its end changes the next epoch.
        ran_sync = self.model.distribute_strategy.sync_stats()["enabled"]
        value = None if logs is None else logs.get(self.monitor)
        if self.patience is not None and value is not None and self.switched_at_step is None:
            value = float(value)
            if self._best is None or value < self._best * (1.0 - self.min_delta):
                self._best, self._flat_epochs = value, 0
            else:
                self._flat_epochs += 1
                if self._flat_epochs >= self.patience:
                    self._switch(at_epoch_end=True)
        if logs is not None:
            logs["sync"] = 1.0 if ran_sync else 0.0

    def _switch(self, at_epoch_end: bool = False) -> None:
        if self.switched_at_step is not None:
            return
        strategy = self.model.distribute_strategy
        self.snapshots_waited += finish_snapshots_of(strategy)
        strategy.set_sync(self.to == "sync")
        self.switched_at_step, self.switched_at_epoch = self._steps, self._epoch
        # Epochs as Keras's progress bar counts them (from 1); history["sync"] is indexed from 0.
        if at_epoch_end:
            logger.info("SyncSwitch: %s from step %d, from epoch %d on (history['sync'][%d] is its first)",
                        self.to, self._steps, self._epoch + 2, self._epoch + 1)
        else:
            logger.info("SyncSwitch: %s from step %d, during epoch %d (history['sync'][%d] is its first)",
                        self.to, self._steps, self._epoch + 1, self._epoch)
