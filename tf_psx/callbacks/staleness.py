"""`StalenessBound`: measures how stale each gradient is, and drops or down-weights those that are too stale.

The measuring is the shared step probe's (`tf_psx.callbacks.probe`); this
module sets its policy and writes the epoch's statistics into the logs.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from tf_psx import _checks
from tf_psx.callbacks.base import _RunCallback
from tf_psx.callbacks.probe import STALENESS_BINS, _probe, _stats_between
from tf_psx.errors import ArgumentError

__all__ = ["StalenessBound", "POLICIES"]

Policy = Literal["drop", "scale"]
POLICIES = ("drop", "scale")


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
            raise ArgumentError(
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
