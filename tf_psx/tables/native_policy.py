"""Admission, eviction and the disk tier of a native hash table (tf_psx.tables.native), in the table's own values.

A key's value holds `updates`, `last step` and `seen` beside its row and
slots (tf_psx.tables.native). With a policy (`min_count`, `max_age_steps`,
`max_rows`, `spill_dir` of `DynamicEmbedding(table="native")`):

* **Counting.** A training lookup counts its keys on each shard, under the
  shard's lock (the lock its updates take, tf_psx.tables.updates): one find
  and one insert of the step's keys, which adds each key's occurrences to
  `seen` and sets `last step` to the shard's step counter. A key absent
  from the table is inserted as *pending* (`updates` 0, no row yet). A key
  is admitted once `seen >= min_count` (or once it has a trained row); until
  then it reads `UNSEEN_KEY_DEFAULT` rows and its gradient is dropped, so
  the optimizer never writes it. Exact with any number of workers.
* **Eviction** (`evict`, run by `tf_psx.callbacks.TableEviction` between
  steps). The coordinator exports each shard's keys and bookkeeping and
  chooses victims with numpy (by age: `last step` more than `max_age_steps`
  behind; by size: the `max_rows` most recently used rows stay, and
  pending keys have a budget of their own of the same size); then, per
  shard under its lock, removes every victim whose `last step` has not
  moved since it was chosen.
* **The disk tier.** A victim with a trained row is written whole (row,
  slots, bookkeeping) to `spill_dir` (`DiskTier`) and left in the table as
  a marker (`seen` = `SPILLED`, `last step` -1). A lookup of a marker reads
  the default row, drops its gradient and sets `last step`; the next
  `evict` brings such keys back from disk, with their slots.

Importing this module imports TensorFlow.
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from tf_psx._tf import lock_release as _lock_release
from tf_psx.tables import native as _native
from tf_psx.tables.lifecycle import SPILLED, DiskTier, EvictionReport, check_budget, choose_victims

__all__ = ["NativePolicy"]


class NativePolicy:
    """Admission (`min_count`), eviction (`max_age_steps`, `max_rows`) and the disk tier of one native table.

    Built by `DynamicEmbedding(table="native")` when any of them is set;
    use it through the layer (`layer.policy`).

    Attributes:
      rows_evicted: rows removed by eviction (age and size) since the layer was built.
      rows_spilled: rows moved to the disk tier; `rows_returned`: rows moved back.
      reports: the `EvictionReport` of every `evict` call.
    """

    def __init__(self, layer, *, min_count: int, max_age_steps: int | None, max_rows: int | None,
                 spill_dir: str | None):
        self.layer = layer
        self.min_count = int(min_count)
        self.max_age_steps = max_age_steps
        self.max_rows = max_rows
        self.spill_dir = spill_dir
        self.disk = None
        self.rows_evicted = 0
        self.rows_spilled = 0
        self.rows_returned = 0
        self.reports: list[EvictionReport] = []
        self._optimizer = None
        self._functions: dict = {}

    def attach_optimizer(self, optimizer) -> None:
        """The optimizer whose updates of the table this policy's writes share locks with (set by `Model.compile`)."""
        self._optimizer = optimizer
        self._functions = {}

    def _optimizer_or_error(self):
        if self._optimizer is None:
            from tf_psx.errors import StateError  # pylint: disable=import-outside-toplevel

            raise StateError(
                f"DynamicEmbedding {self.layer.name} has min_count, max_age_steps or max_rows, so its training "
                "lookups count keys under the table's update locks, which belong to the model's optimizer. "
                "Received: a training lookup before Model.compile. Fix: compile the model first.")
        return self._optimizer

    # -- the training lookup --------------------------------------------------

    def check_budget(self, unique):
        """An error when one batch has more distinct keys than `max_rows` (eviction would drop what it trains)."""
        return check_budget(self.layer.name, self.max_rows, unique)

    def counted_lookup(self, unique, occurrences, wire=None):
        """(rows [n, dim], admitted [n], trained [n]) of distinct `unique` keys, counting `occurrences` on each shard.

        `trained`: the key has a trained row (else an admitted key starts from its initial row).
        """
        from tf_psx.tables import updates as _updates  # pylint: disable=import-outside-toplevel

        table = self.layer.native_table
        dim, min_count = table.dim, self.min_count
        positions, parts = table.split(unique)
        occurrence_parts = [tf.gather(occurrences, position) for position in positions]
        rows, admitted, trained = [], [], []
        for index, (shard, device, keys, counts) in enumerate(zip(table.shards, table.devices, parts,
                                                                   occurrence_parts)):
            lock, step = self._shard_lock(index)
            with tf.device(device):
                keys, counts = tf.identity(keys), tf.identity(counts)

            def count(shard=shard, device=device, keys=keys, counts=counts, step=step):
                with tf.device(device):
                    found = tf.reshape(shard.lookup(keys), [-1, table.width])
                    updates, seen = _native.updates_of(found), _native.seen_of(found)
                    spilled = seen < 0
                    new_seen = tf.where(spilled, seen, seen + tf.cast(counts, tf.int32))
                    now = tf.constant(0, tf.int32) if step is None else tf.cast(step.read_value(), tf.int32)
                    kept = _native.bookkeeping(updates, now, new_seen)
                    write = shard.insert(keys, tf.concat([found[:, :-_native.BOOKKEEPING], kept], axis=1))
                    has_row = tf.logical_and(updates > 0, tf.logical_not(spilled))
                    admit = tf.logical_and(tf.logical_not(spilled), tf.logical_or(has_row, new_seen >= min_count))
                    row = found[:, :dim]
                    if wire is not None:
                        row = tf.cast(row, wire)
                    with tf.control_dependencies([write]):
                        return tf.identity(row), tf.identity(admit), tf.identity(has_row)

            with tf.control_dependencies([keys, counts]):
                row, admit, has_row = lock.execute(count, exclusive_resource_access=False)
            for output in (row, admit, has_row):  # each waits for the release (tf_psx._tf.lock_release)
                _lock_release.exempt_release_from_ordering(output)
            rows.append(row)
            admitted.append(admit)
            trained.append(has_row)
        if table.num_shards == 1:
            row, admit, has_row = rows[0], admitted[0], trained[0]
        else:
            row = tf.dynamic_stitch(positions, rows)
            admit = tf.dynamic_stitch(positions, admitted)
            has_row = tf.dynamic_stitch(positions, trained)
        return (tf.reshape(tf.cast(row, tf.float32), [-1, dim]), tf.reshape(admit, [-1]),
                tf.reshape(has_row, [-1]))

    def _shard_lock(self, index: int):
        """(lock, step counter or None) of shard `index`: its update lock once compiled, else the policy's own."""
        from tf_psx.tables import updates as _updates  # pylint: disable=import-outside-toplevel

        table = self.layer.native_table
        if self._optimizer is not None:
            return _updates.shard_state(self._optimizer, table, index)[0]
        # Before compile (a lookup outside fit): no update can run, so no update lock is needed to count.
        locks = self.__dict__.setdefault("_own_locks", {})
        key = (id(table.shards[index]), index)
        if key not in locks:
            with tf.init_scope(), tf.device(table.devices[index]):
                locks[key] = tf.CriticalSection(shared_name=f"tf_psx_native_policy_{id(self)}_{index}")
        return locks[key], None

    # -- reading state (coordinator) ---------------------------------------------

    def _bookkeeping_of(self, keys) -> np.ndarray:
        """[n, 3] int: updates, last step, seen of `keys` (zeros for keys never seen)."""
        table = self.layer.native_table
        stored, values = table.export()
        out = np.zeros([len(keys), 3], np.int64)
        if len(stored):
            index = np.searchsorted(stored, keys).clip(0, len(stored) - 1)
            hit = stored[index] == keys
            out[hit] = _bookkeeping_numpy(values[index[hit]])
        return out

    def counts(self, keys) -> np.ndarray:
        """Training occurrences counted for `keys` (0 for keys never seen, SPILLED for rows on disk)."""
        return self._bookkeeping_of(np.asarray(keys, np.int64))[:, 2]

    def last_steps(self, keys) -> np.ndarray:
        """The table's step at which each key was last used in training."""
        return self._bookkeeping_of(np.asarray(keys, np.int64))[:, 1]

    def tracked_keys(self) -> int:
        """Keys in the table: rows, pending counters and spilled keys."""
        return int(self.layer.native_table.size())

    # -- eviction (between steps, on the coordinator) ------------------------------

    def _step(self) -> int:
        from tf_psx.tables import updates as _updates  # pylint: disable=import-outside-toplevel

        if self._optimizer is None:
            return 0
        return max(_updates.shard_steps(self._optimizer, self.layer.native_table) or [0])

    def evict(self, step: int | None = None) -> EvictionReport:
        """Applies `max_age_steps` and `max_rows` now, and brings spilled keys that came back.

        Args:
          step: the table's current step (the largest shard step counter when None).

        Returns:
          An `EvictionReport` (also appended to `reports`).
        """
        start = time.perf_counter()
        step = self._step() if step is None else int(step)
        table = self.layer.native_table
        keys, values = table.export()
        updates, last, seen = _bookkeeping_numpy(values).T
        spilled = seen == SPILLED
        admitted = (updates > 0) & ~spilled
        pending = ~admitted & ~spilled
        report = EvictionReport(table.name, step, rows_before=int(admitted.sum()), rows_after=0)
        victim = choose_victims(last, admitted, pending, step, self.max_age_steps, self.max_rows, report)
        if np.any(victim):
            removed, report.spilled, report.locked_seconds = self._remove(keys[victim], last[victim],
                                                                          admitted[victim], step)
            report.skipped_in_use = int(np.sum(victim)) - removed
        if self.spill_dir is not None:
            back = spilled & (last >= 0)  # spilling sets last step to -1; a lookup since sets it to the step
            if np.any(back):
                report.returned = self._bring_back(keys[back])
        report.rows_after = int(self.layer.size())
        report.seconds = time.perf_counter() - start
        self.rows_evicted += report.evicted - report.skipped_in_use
        self.rows_spilled += report.spilled
        self.rows_returned += report.returned
        self.reports.append(report)
        return report

    def _locked(self, kind: str, make_body, signature):
        """A cached tf.function per shard: `make_body(shard, device)(*args)` under the shard's update lock."""
        from tf_psx.tables import updates as _updates  # pylint: disable=import-outside-toplevel

        table = self.layer.native_table
        key = (kind, id(table.shards[0]))
        if key not in self._functions:
            optimizer = self._optimizer_or_error()
            functions = []
            for index, (shard, device) in enumerate(zip(table.shards, table.devices)):
                (lock, _), _ = _updates.shard_state(optimizer, table, index)
                body = make_body(shard, device)

                def locked(*args, body=body, lock=lock):
                    return lock.execute(lambda: body(*args), exclusive_resource_access=False)

                function = tf.function(locked, input_signature=signature, autograph=False)

                functions.append(function)
            self._functions[key] = functions
        return self._functions[key]

    def _remove_body(self, shard, device):
        spill = self.spill_dir is not None

        def body(keys, last, has_row):
            with tf.device(device):
                current = tf.reshape(shard.lookup(keys), [-1, self.layer.native_table.width])
                # A victim used since it was chosen (its last step moved) stays.
                still = tf.equal(tf.cast(_native.last_steps_of(current), tf.int64), last)
                gone = tf.boolean_mask(keys, still)
                to_disk = tf.logical_and(still, has_row) if spill else tf.zeros_like(still)
                spilled_keys = tf.boolean_mask(keys, to_disk)
                spilled_values = tf.boolean_mask(current, to_disk)
                with tf.control_dependencies([spilled_values]):
                    erase = _native.remove(shard, gone)
                writes = [erase]
                if spill:
                    marker = tf.zeros([tf.size(spilled_keys), self.layer.native_table.width - _native.BOOKKEEPING])
                    count = tf.size(spilled_keys)
                    marks = _native.bookkeeping(tf.zeros([count], tf.int32), tf.fill([count], -1),
                                                tf.fill([count], SPILLED))
                    with tf.control_dependencies([erase]):
                        writes.append(shard.insert(spilled_keys, tf.concat([marker, marks], axis=1)))
                with tf.control_dependencies(writes):
                    return tf.size(gone), tf.identity(spilled_keys), tf.identity(spilled_values)

        return body

    def _remove(self, keys, last, has_row, step: int) -> tuple[int, int, float]:
        """Removes the victims not used since they were chosen; returns (removed, spilled, seconds locked)."""
        table = self.layer.native_table
        functions = self._locked("remove", self._remove_body, [tf.TensorSpec([None], tf.int64),
                                                               tf.TensorSpec([None], tf.int64),
                                                               tf.TensorSpec([None], tf.bool)])
        positions, parts = table.split(tf.constant(keys, tf.int64))
        removed, spilled, locked = 0, 0, 0.0
        for function, position, part in zip(functions, positions, parts):
            position = position.numpy()
            if not len(position):
                continue
            begin = time.perf_counter()
            gone, spill_keys, spill_values = function(part, tf.constant(last[position], tf.int64),
                                                      tf.constant(has_row[position]))
            locked += time.perf_counter() - begin
            removed += int(gone.numpy())
            if self.spill_dir is not None and int(tf.size(spill_keys)):
                self._disk().write(spill_keys.numpy(), [spill_values.numpy()], step=step)
                spilled += int(tf.size(spill_keys))
        return removed, spilled, locked

    def _disk(self) -> DiskTier:
        if self.disk is None:
            self.disk = DiskTier(self.spill_dir, self.layer.native_table.width)
        return self.disk

    def _bring_back_body(self, shard, device):
        def body(keys, values):
            with tf.device(device):
                current = tf.reshape(shard.lookup(keys), [-1, self.layer.native_table.width])
                # Still a marker (not counted afresh as pending meanwhile): its saved row, slots and counts.
                still = tf.equal(_native.seen_of(current), SPILLED)
                back = tf.boolean_mask(keys, still)
                saved = tf.boolean_mask(values, still)
                now = _native.last_steps_of(tf.boolean_mask(current, still))
                kept = _native.bookkeeping(_native.updates_of(saved), now, _native.seen_of(saved))
                write = shard.insert(back, tf.concat([saved[:, :-_native.BOOKKEEPING], kept], axis=1))
                with tf.control_dependencies([write]):
                    return tf.size(back)

        return body

    def _bring_back(self, keys: np.ndarray) -> int:
        found, parts = self._disk().read(keys)
        if not len(found):
            return 0
        table = self.layer.native_table
        values = np.asarray(parts[0], np.float32)
        functions = self._locked("bring_back", self._bring_back_body,
                                 [tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, table.width], tf.float32)])
        positions, part_keys = table.split(tf.constant(found, tf.int64))
        count = 0
        for function, position, part in zip(functions, positions, part_keys):
            position = position.numpy()
            if len(position):
                count += int(function(part, tf.constant(values[position])).numpy())
        self.disk.forget(found)
        return count


def _bookkeeping_numpy(values: np.ndarray) -> np.ndarray:
    """[n, 3] int64 (updates, last step, seen) of whole table values [n, width] (numpy)."""
    tail = np.ascontiguousarray(values[:, -_native.BOOKKEEPING:], np.float32)
    return tail.view(np.int32).astype(np.int64)
