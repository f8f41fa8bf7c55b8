"""`TableEviction`: applies the eviction of `DynamicEmbedding` hash tables on a schedule of steps or seconds.

What to evict, and how, is each layer's policy (`tf_psx.tables`); this
module decides when.
"""

from __future__ import annotations

import logging
import time

from tf_psx import _checks, tables as _tables
from tf_psx._tf import runtime as _runtime
from tf_psx.callbacks.base import _RunCallback
from tf_psx.errors import ArgumentError

__all__ = ["TableEviction"]

logger = logging.getLogger("tf_psx")


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
            raise ArgumentError(f"Argument `every_seconds` of TableEviction must be a number > 0 or None. Received: "
                                f"{every_seconds!r}. Fix: pass e.g. TableEviction(every_seconds=60).")
        if every_n_steps is None and every_seconds is None:
            raise ArgumentError("TableEviction needs `every_n_steps` or `every_seconds`. Received: neither. "
                                "Fix: pass e.g. TableEviction(every_n_steps=1000).")
        self.every_seconds = every_seconds
        self.reports: list = []
        self._layers: list = []

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._layers = [layer for layer in _tables.table_layers(self.model) if layer.policy is not None]
        if not self._layers:
            raise ArgumentError(
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
