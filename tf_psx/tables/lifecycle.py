"""Hash-table lifecycle for `DynamicEmbedding`: admission, eviction, a disk tier, resharded restore.

A `TablePolicy` gives one DynamicEmbedding a second TFRA table, its "meta"
table, on the same ps tasks and with the same key partition as the rows.
For every key seen in training it holds two int64s:

* `count`: how many times the key was seen in training (occurrences, summed
  over every worker). A key gets a trainable row, and optimizer slots, only
  once `count >= min_count`; until then it reads `UNSEEN_KEY_DEFAULT` rows
  and its gradient is dropped. `count == SPILLED` (-1) marks a key whose row
  is in the disk tier.
* `last_step`: the optimizer's `iterations` when a training step last looked
  the key up. A row is updated by every training step that looks it up, so
  this is also the step of its last update.

Counting runs in the forward pass under a lock on the meta table's first ps
task (a read and a write of each key's pair, exact under several workers);
the optimizer writes back only rows of admitted keys
(`tf_psx.training.exact_updates`). `TablePolicy.evict` runs between steps (the
`tf_psx.callbacks.TableEviction` callback) and removes rows, slots and meta
entries under both tables' locks, rechecking that a victim was not used
since it was chosen.

Example (no cluster; the same code runs under a ParameterServerStrategy):

>>> import tensorflow as tf, tf_psx
>>> layer = tf_psx.layers.DynamicEmbedding(2, min_count=2, initializer="ones")
>>> layer(tf.constant([[5, 7, 7]], tf.int64), training=True).numpy()[0, :, 0].tolist()
[0.0, 1.0, 1.0]
>>> layer.policy.counts([5, 7]).tolist()
[1, 2]
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time

import numpy as np
import tensorflow as tf

from tf_psx._tf import tfra as _tfra
from tf_psx.errors import DataError
from tf_psx.tables import tfra_updates as _tfra_updates
from tf_psx.training import exact_updates as _exact_updates

__all__ = ["TablePolicy", "DiskTier", "EvictionReport", "SPILLED", "restore_tables", "seed_policies", "slot_tables",
           "hash_table_layers", "table_layers"]

logger = logging.getLogger("tf_psx")

# `count` of a key whose row and slots were moved to the disk tier.
SPILLED = -1
_COUNT, _LAST = 0, 1


@dataclasses.dataclass
class EvictionReport:
    """What one `TablePolicy.evict` call did."""

    table: str
    step: int
    rows_before: int
    rows_after: int
    evicted_by_age: int = 0
    evicted_by_size: int = 0
    pending_dropped: int = 0
    spilled: int = 0
    returned: int = 0
    skipped_in_use: int = 0
    seconds: float = 0.0
    # Of `seconds`, the time both locks were held (steps touching this table wait that long at most).
    locked_seconds: float = 0.0

    @property
    def evicted(self) -> int:
        return self.evicted_by_age + self.evicted_by_size


def check_budget(layer_name: str, max_rows, unique):
    """An error when one batch has more distinct keys than `max_rows` (eviction would drop what it trains)."""
    if max_rows is None:
        return tf.no_op()
    message = (f"DynamicEmbedding `{layer_name}`: a batch has more distinct keys than max_rows={max_rows}, so "
               "eviction would remove rows the step just trained. Distinct keys in the batch:")
    fix = "Fix: raise max_rows well above the distinct keys of one batch (times the number of workers)."
    n = tf.size(unique, out_type=tf.int64)
    if tf.executing_eagerly():
        if int(n) > max_rows:
            raise tf.errors.InvalidArgumentError(None, None, f"{message} {int(n)}. {fix}")
        return tf.no_op()
    return tf.debugging.Assert(n <= max_rows, [message, n, fix], summarize=1)


def choose_victims(last, admitted, pending, step: int, max_age_steps, max_rows, report: EvictionReport):
    """The keys to evict (a bool mask), by age then by size; counts them in `report`. Shared by both stores.

    By age: `last` more than `max_age_steps` behind `step`, rows and pending
    counters alike. By size: the `max_rows` most recently used rows stay,
    and pending counters have a budget of their own of the same size.
    """
    victim = np.zeros(len(last), bool)
    if max_age_steps is not None:
        old = (step - last) > max_age_steps
        report.evicted_by_age = int(np.sum(old & admitted))
        report.pending_dropped += int(np.sum(old & pending))
        victim |= old & (admitted | pending)
    if max_rows is not None:
        for group, field in ((admitted, "evicted_by_size"), (pending, "pending_dropped")):
            alive = np.flatnonzero(group & ~victim)
            if len(alive) > max_rows:
                order = np.argsort(-last[alive], kind="stable")
                drop = alive[order[max_rows:]]
                victim[drop] = True
                setattr(report, field, getattr(report, field) + len(drop))
    return victim


class TablePolicy:
    """Admission (`min_count`), eviction (`max_age_steps`, `max_rows`) and the disk tier of one table.

    Built by `DynamicEmbedding` when any of them is set; use it through the
    layer (`layer.policy`). Size eviction keeps the `max_rows` most recently
    used rows (by `last_step`; least recently used go first).

    Attributes:
      rows_evicted: rows removed by eviction (age and size) since the layer was built.
      rows_spilled: rows moved to the disk tier; `rows_returned`: rows moved back.
      reports: the `EvictionReport` of every `evict` call.
    """

    def __init__(self, layer, *, min_count: int, max_age_steps: int | None, max_rows: int | None,
                 spill_dir: str | None, devices):
        de = _tfra.tfra()
        self.layer = layer
        self.min_count = int(min_count)
        self.max_age_steps = max_age_steps
        self.max_rows = max_rows
        self.meta = de.Variable(
            key_dtype=tf.int64, value_dtype=tf.int64, dim=2, devices=devices,
            name=f"{layer.name}_meta", initializer=0, trainable=False,
        )
        with tf.init_scope(), tf.device(self.meta.devices[0]):
            self.lock = tf.CriticalSection(shared_name=f"tf_psx_meta_{layer.name}_{id(self)}")
        self.disk = DiskTier(spill_dir, layer.output_dim) if spill_dir else None
        self.rows_evicted = 0
        self.rows_spilled = 0
        self.rows_returned = 0
        self.reports: list[EvictionReport] = []
        self._optimizer = None
        self._functions: dict = {}

    # -- the training step ----------------------------------------------------

    def attach_optimizer(self, optimizer) -> None:
        """The optimizer whose `iterations` ages rows (set by `Model.compile`)."""
        self._optimizer = optimizer

    def _step(self) -> tf.Tensor:
        if self._optimizer is None:
            return tf.constant(0, tf.int64)
        return tf.cast(self._optimizer.iterations, tf.int64)

    def count(self, unique: tf.Tensor, occurrences: tf.Tensor) -> tf.Tensor:
        """Adds `occurrences` to the counts of `unique` keys; returns the new counts (under the lock)."""
        step = self._step()
        occurrences = tf.cast(occurrences, tf.int64)

        def body():
            old = self.meta.lookup(unique)
            counts = old[:, _COUNT]
            new_counts = tf.where(counts < 0, counts, counts + occurrences)
            new = tf.stack([new_counts, tf.fill(tf.shape(new_counts), step)], axis=1)
            with tf.control_dependencies([self.meta.upsert(unique, new)]):
                return tf.identity(new_counts)

        return _tfra_updates.run_locked(self.lock, body)

    def admitted(self, keys: tf.Tensor) -> tf.Tensor:
        """bool per key: it may hold a row (its count reached `min_count`)."""
        counts = self.meta.lookup(keys)[:, _COUNT]
        return tf.reshape(counts >= self.min_count, [-1])

    def check_budget(self, unique: tf.Tensor):
        """An error when one batch has more distinct keys than `max_rows` (eviction would drop what it trains)."""
        return check_budget(self.layer.name, self.max_rows, unique)

    # -- reading state (coordinator) -------------------------------------------

    def counts(self, keys) -> np.ndarray:
        """Training occurrences counted for `keys` (0 for keys never seen, SPILLED for rows on disk)."""
        return self.meta.lookup(tf.constant(np.asarray(keys, np.int64)))[:, _COUNT].numpy()

    def last_steps(self, keys) -> np.ndarray:
        """The `iterations` at which each key was last used in training."""
        return self.meta.lookup(tf.constant(np.asarray(keys, np.int64)))[:, _LAST].numpy()

    def tracked_keys(self) -> int:
        """Keys in the meta table (rows, pending counters and spilled keys)."""
        return int(self.meta.size())

    def _tables(self) -> list:
        """The row table and its optimizer slot tables."""
        return [self.layer.table] + slot_tables(self.layer)

    # -- eviction (between steps, on the coordinator) -----------------------------

    def evict(self, step: int | None = None) -> EvictionReport:
        """Applies `max_age_steps` and `max_rows` now, and brings spilled keys that came back.

        Args:
          step: the current `iterations` (read from the optimizer when None).

        Returns:
          An `EvictionReport` (also appended to `reports`).
        """
        start = time.perf_counter()
        if step is None:
            step = int(self._step().numpy())
        keys, values = (t.numpy() for t in self.meta.export())
        report = EvictionReport(self.layer.table.name, int(step), rows_before=self.layer.size(), rows_after=0)
        counts, last = values[:, _COUNT], values[:, _LAST]
        admitted = counts >= self.min_count
        pending = (counts >= 0) & ~admitted
        spilled = counts == SPILLED
        victim = choose_victims(last, admitted, pending, step, self.max_age_steps, self.max_rows, report)
        rows_victims = victim & admitted
        if np.any(victim):
            removed, report.spilled, report.locked_seconds = self._remove(keys[victim], last[victim],
                                                                          rows_victims[victim])
            report.skipped_in_use = int(np.sum(victim)) - removed
        if self.disk is not None:
            back = spilled & (last >= 0)  # spilling sets last_step to -1; a lookup since sets it to the step
            if np.any(back):
                report.returned = self._bring_back(keys[back])
        report.rows_after = self.layer.size()
        report.seconds = time.perf_counter() - start
        self.rows_evicted += report.evicted - report.skipped_in_use
        self.rows_spilled += report.spilled
        self.rows_returned += report.returned
        self.reports.append(report)
        return report

    def _locked_function(self, kind: str, make_body):
        """A cached tf.function running `make_body(tables)(*args)` under the meta lock and the table's lock.

        Under both locks no step counts keys and no optimizer writes this
        table back meanwhile.
        """
        tables = self._tables()
        key = (kind, len(tables), self._optimizer is not None)
        function = self._functions.get(key)
        if function is None:
            optimizer = getattr(self._optimizer, "inner_optimizer", self._optimizer)
            table_lock = _tfra_updates.table_lock(optimizer, self.layer.table) if optimizer is not None else None
            body = make_body(tables)

            @tf.function(autograph=False, reduce_retracing=True)
            def function(*args):
                def run():
                    return body(*args)

                if table_lock is None:
                    return self.lock.execute(run, exclusive_resource_access=False)
                return self.lock.execute(lambda: table_lock.execute(run, exclusive_resource_access=False),
                                         exclusive_resource_access=False)

            self._functions[key] = function
        return function

    def _remove_body(self, tables):
        spill_rows = self.disk is not None

        def body(keys, last, has_row):
            # A victim used since it was chosen (its last_step moved) stays.
            current = self.meta.lookup(keys)[:, _LAST]
            still = tf.reshape(tf.equal(current, last), [-1])
            gone = tf.boolean_mask(keys, still)
            spill = tf.boolean_mask(keys, tf.logical_and(still, has_row))
            outputs = [tf.size(gone)]
            if spill_rows:
                outputs += [spill] + [table.lookup(spill) for table in tables]
            with tf.control_dependencies(outputs[1:]):
                removes = [table.remove(gone) for table in tables]
                if spill_rows:
                    marks = tf.stack([tf.fill(tf.shape(spill), tf.constant(SPILLED, tf.int64)),
                                      tf.fill(tf.shape(spill), tf.constant(-1, tf.int64))], axis=1)
                    with tf.control_dependencies([self.meta.remove(gone)]):
                        removes.append(self.meta.upsert(spill, marks))
                else:
                    removes.append(self.meta.remove(gone))
            with tf.control_dependencies(removes):
                return [tf.identity(t) for t in outputs]

        return body

    def _remove(self, keys: np.ndarray, last: np.ndarray, has_row: np.ndarray) -> tuple[int, int, float]:
        """Removes the victims not used since they were chosen; returns (removed, spilled, seconds locked)."""
        function = self._locked_function("remove", self._remove_body)
        start = time.perf_counter()
        outputs = function(tf.constant(keys, tf.int64), tf.constant(last, tf.int64),
                           tf.constant(np.asarray(has_row, bool)))
        removed = int(outputs[0].numpy())
        locked = time.perf_counter() - start
        spilled = 0
        if self.disk is not None:
            spilled_keys = outputs[1].numpy()
            self.disk.write(spilled_keys, [o.numpy().reshape(len(spilled_keys), -1) for o in outputs[2:]],
                            step=int(self._step().numpy()))
            spilled = len(spilled_keys)
        return removed, spilled, locked

    def _bring_back_body(self, tables):
        def body(keys, *values):
            last = self.meta.lookup(keys)[:, _LAST]
            writes = [table.upsert(keys, value) for table, value in zip(tables, values)]
            admitted = tf.stack([tf.fill(tf.shape(last), tf.constant(self.min_count, tf.int64)), last], axis=1)
            writes.append(self.meta.upsert(keys, admitted))
            with tf.control_dependencies(writes):
                return tf.size(keys)

        return body

    def _bring_back(self, keys: np.ndarray) -> int:
        found, parts = self.disk.read(keys)
        if not len(found):
            return 0
        tables = self._tables()
        values = [tf.constant(part, dtype=table.value_dtype) for part, table in zip(parts, tables)]
        count = int(self._locked_function("bring_back", self._bring_back_body)(tf.constant(found), *values).numpy())
        self.disk.forget(found)
        return count

    # -- restore ------------------------------------------------------------------

    def seed(self, step: int = 0) -> int:
        """Admits every key that has a row but no meta entry (a snapshot taken without a policy).

        Returns how many keys were seeded (0 when the meta table already has entries).
        """
        if int(self.meta.size()) > 0 or self.layer.size() == 0:
            return 0
        keys, _ = self.layer.table.export()
        values = tf.stack([tf.fill(tf.shape(keys), tf.constant(self.min_count, tf.int64)),
                           tf.fill(tf.shape(keys), tf.constant(int(step), tf.int64))], axis=1)
        self.meta.upsert(keys, values)
        return int(tf.size(keys))


class DiskTier:
    """A spill store for evicted rows and their optimizer slots: one directory per table.

    Records are fixed-size (int64 key, the rows of every table as float64
    bytes) appended to `rows.bin`; an in-memory index maps a key to its
    record and the step it was spilled at, and is written to `index.npz`
    after every change. A key read back is forgotten (its record becomes
    garbage; `compact()` rewrites the file).
    """

    def __init__(self, directory: str, dim: int):
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.dim = int(dim)
        self._data = os.path.join(self.directory, "rows.bin")
        self._index_path = os.path.join(self.directory, "index.npz")
        self._index: dict[int, tuple[int, int]] = {}
        self._width = None
        if os.path.exists(self._index_path):
            saved = np.load(self._index_path)
            self._width = int(saved["width"])
            self._index = {int(k): (int(o), int(s)) for k, o, s in zip(saved["keys"], saved["offsets"], saved["steps"])}

    def __len__(self) -> int:
        return len(self._index)

    def write(self, keys: np.ndarray, parts: list[np.ndarray], step: int) -> None:
        """Appends the rows (`parts[i][j]` of table i for key j) of `keys`."""
        if not len(keys):
            return
        block = np.concatenate([np.asarray(p, np.float64).reshape(len(keys), -1) for p in parts], axis=1)
        width = block.shape[1]
        if self._width is None:
            self._width = width
        if width != self._width:
            raise DataError(f"DiskTier {self.directory}: rows of width {width}, the store holds {self._width}. "
                            "Fix: use a new spill_dir for a model with other slots or dims.")
        records = np.empty(len(keys), dtype=[("key", "<i8"), ("row", "<f8", (width,))])
        records["key"], records["row"] = keys, block
        with open(self._data, "ab") as handle:
            first = handle.tell() // records.itemsize
            handle.write(records.tobytes())
            handle.flush()
            os.fsync(handle.fileno())
        for i, key in enumerate(keys):
            self._index[int(key)] = (first + i, int(step))
        self._save_index()

    def read(self, keys: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """(keys found, [rows of table i]) for the keys on disk."""
        found = [int(k) for k in keys if int(k) in self._index]
        if not found:
            return np.zeros(0, np.int64), []
        record = np.dtype([("key", "<i8"), ("row", "<f8", (self._width,))])
        data = np.memmap(self._data, dtype=record, mode="r")
        offsets = np.array([self._index[k][0] for k in found], np.int64)
        picked = data[offsets]
        if not np.array_equal(picked["key"], found):
            raise DataError(f"DiskTier {self.directory}: {self._data} does not match its index. Fix: use a new "
                            "spill_dir (the store was written by another run or damaged).")
        rows = np.asarray(picked["row"])
        parts = [rows[:, i:i + self.dim] for i in range(0, self._width, self.dim)]
        return np.array(found, np.int64), parts

    def forget(self, keys) -> None:
        for key in keys:
            self._index.pop(int(key), None)
        self._save_index()

    def _save_index(self) -> None:
        keys = np.array(list(self._index), np.int64)
        offsets = np.array([v[0] for v in self._index.values()], np.int64)
        steps = np.array([v[1] for v in self._index.values()], np.int64)
        tmp = self._index_path + ".tmp.npz"
        np.savez(tmp, keys=keys, offsets=offsets, steps=steps, width=np.int64(self._width or 0))
        os.replace(tmp, self._index_path)


# -- restore onto another number of ps tasks ----------------------------------------

def hash_table_layers(model) -> list:
    """The DynamicEmbedding layers of `model` (any depth) on TFRA's tables."""
    return [layer for layer in model.submodules if getattr(layer, _tfra.HASH_TABLE_LAYER_ATTR, False)]


def table_layers(model) -> list:
    """Every DynamicEmbedding layer of `model` (any depth), on either store (TFRA's tables or tf_psx's own)."""
    return [layer for layer in model.submodules if getattr(layer, "store", None) in ("native", "tfra")
            and hasattr(layer, "export") and hasattr(layer, "size")]


def slot_tables(layer) -> list:
    """The optimizer slot tables (TFRA variables) of a DynamicEmbedding, made on its first apply."""
    slots = getattr(layer.embedding, "optimizer_vars", None) or []
    return list(getattr(slots, "value", slots))


def _layer_tables(layer) -> list:
    tables = [layer.table] + slot_tables(layer)
    if layer.policy is not None:
        tables.append(layer.policy.meta)
    return tables


def carry_step_counters(model, counters: dict) -> None:
    """Starts each DynamicEmbedding's step counters that `counters` (a snapshot's, by name) lack at the table's largest.

    A table's counters are named by its layout (one per shard, or one for
    the whole table): `tf_psx.tables.tfra_updates.carry_counters`.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return
    for layer in table_layers(model):
        if layer.store == "native":
            _carry_native_counters(optimizer, layer.native_table, counters)
    for layer in hash_table_layers(model):
        saved = _tfra_updates.counters_of(layer.table, counters)
        started = _tfra_updates.carry_counters(optimizer, layer.table, saved)
        whole, *shards = _tfra_updates.counter_names(layer.table)
        if started and set(saved) not in ({whole}, set(shards)):
            logger.info("table %s: saved with step counters %s; %s start at %d", layer.table.name,
                        ", ".join(sorted(saved)), ", ".join(started), max(saved.values()))


def _carry_native_counters(optimizer, table, counters: dict) -> list[str]:
    """Starts the shard step counters of a native `table` that `counters` lacks at its largest saved one.

    Every step updates every shard, so each shard's counter is the table's
    step count; a snapshot of fewer ps tasks lacks the new shards' counters,
    which would otherwise start at 0 (Adam's bias correction of a first step
    applied to restored moments).
    """
    prefix = _exact_updates.counter_name(f"native/{table.name}/shard_")
    saved = {name: value for name, value in counters.items() if name.startswith(prefix)}
    top = max((int(value) for value in saved.values()), default=0)
    if top == 0:
        return []
    started = []
    for index in range(table.num_shards):
        name = _exact_updates.counter_name(f"native/{table.name}/shard_{index}")
        if int(saved.get(name, 0)) == 0:
            _exact_updates.set_counter(optimizer, name, top)
            started.append(name)
    if started:
        logger.info("table %s: saved with %d shard step counters; %s start at %d", table.name, len(saved),
                    ", ".join(started), top)
    return started


def restore_tables(model, prefix: str) -> list[str]:
    """Moves every DynamicEmbedding row restored from `prefix` onto the shard its key belongs to.

    TFRA saves one table per ps task, numbered, and restores table i into
    table i. When the snapshot was written with another number of ps tasks
    (2 -> 3), the keys are then on the wrong shards (lookups miss them) or,
    with fewer tasks, not restored at all. For each table (rows, optimizer
    slots, meta) whose shard count differs, this clears it and inserts every
    saved shard again through the table's own key partition. Tables saved
    with the current shard count are left as TF restored them. Step
    counters the snapshot lacks (another shard count) start at the table's
    largest saved one (`carry_step_counters`).

    Returns:
      The names of the tables that were resharded.
    """
    reader = tf.compat.v1.train.NewCheckpointReader(prefix)  # a prefix, also on ram://
    names = list(reader.get_variable_to_shape_map())
    resharded = []
    carry_step_counters(model, _exact_updates.saved_counters(reader))
    for layer in hash_table_layers(model):
        for table in _layer_tables(layer):
            escaped = re.escape(table.name.replace("/", ".S"))
            pattern = re.compile(rf"tables_of_{escaped}/(\d+)/\.ATTRIBUTES/table-keys$")
            shards = {}
            for name in names:
                match = pattern.search(name)
                if match:
                    shards.setdefault(int(match.group(1)), name)
            if not shards or len(shards) == len(table.devices):
                continue
            table.clear()
            for name in shards.values():
                keys = reader.get_tensor(name)
                values = reader.get_tensor(name[: -len("table-keys")] + "table-values")
                if len(keys):
                    table.upsert(tf.constant(keys), tf.constant(values, dtype=table.value_dtype))
            resharded.append(table.name)
            logger.info("table %s restored from %d shards onto %d", table.name, len(shards), len(table.devices))
    return resharded


def seed_policies(model, step: int = 0) -> int:
    """`TablePolicy.seed` for every DynamicEmbedding of `model` with a policy; returns keys seeded."""
    return sum(layer.policy.seed(step) for layer in hash_table_layers(model) if layer.policy is not None)
