"""tf_psx's hash tables on TensorFlow's own ops: one `DenseHashTable` per ps task, a row and its state under one key.

A `NativeTable` is what `tf_psx.layers.DynamicEmbedding` stores its rows
in. Each shard is one `tf.lookup.experimental.DenseHashTable` on the ps task
that owns it (with no strategy, on this machine). The value of a key is
one float32 vector holding, side by side:

    [ row (dim) | optimizer slots (slots x dim) | updates (1) | last step (1) | seen (1) ]

so a training step's update of a shard is one find and one insert
(`tf_psx.tables.updates`). `updates` counts the steps that trained the key,
`last step` is the shard's step counter at its last use, and `seen` the
occurrences counted by training lookups (with an admission policy:
tf_psx.tables.native_policy); all three are int32 bit patterns
(`tf.bitcast`), exact to 2**31. A key with a trained row has
`updates >= 1`: the table's default value has 0, which is how a find tells
a key with no row (absent, or pending admission).

Why `DenseHashTable`. Measured in one process on these machines (3,000
keys, a find then an insert of 50 floats per key): `DenseHashTable` 0.78-0.86
ms, `MutableHashTable` 3.7-4.1 ms (a heap vector per key), TFRA's
three-table layout 2.7-3.0 ms. `DenseHashTable` is open addressing over flat
arrays of keys and values and grows by doubling when its load passes
`MAX_LOAD_FACTOR`; the growth holds that table's own mutex only, so other
shards never wait for it, and the update of a shard holds the shard's
lock across its find and insert (`tf_psx.tables.updates`), so no update
made during a growth is lost. Two int64 keys are reserved by the op
(`EMPTY_KEY`, `DELETED_KEY`): they are refused in the data.

Keys go to shards by a 64-bit mix of the key (`shard_of`), so
consecutive ids and ids sorted by frequency spread evenly, and the same
key goes to the same shard in any process with the same shard count.

New keys start from the layer's initializer drawn per key
(`draw_rows`): a counter-based hash of (seed, key, column) gives each
element a uniform number, turned into the initializer's distribution by
its inverse CDF. So a key's first row is the same on every worker, in a
one-process run and after a restore, with no state to share.

Importing this module imports TensorFlow.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import tensorflow as tf

from tf_psx._tf import checkpoint as _checkpoint
from tf_psx.errors import ArgumentError

__all__ = ["NativeTable", "draw_rows", "initializer_spec", "shard_of", "EMPTY_KEY", "DELETED_KEY",
           "BOOKKEEPING"]

# The two keys DenseHashTable reserves for its empty and deleted buckets:
# the two smallest int64s, which hashed string keys (non-negative) never take.
EMPTY_KEY = -(2**63)
DELETED_KEY = -(2**63) + 1
# Columns after the row and slots: the updates of the key, its last step and its occurrences seen.
BOOKKEEPING = 3
# DenseHashTable's own default: the table doubles when 80% of its buckets are used.
MAX_LOAD_FACTOR = 0.8
# Buckets a shard starts with (a power of 2; it grows as keys arrive).
INITIAL_BUCKETS = 1024

# splitmix64's constants (Steele, Lea and Flood, 2014): a 64-bit finaliser
# whose outputs pass BigCrush, so the low bits of mixed keys are uniform.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB


def _mix(x):
    """splitmix64 of a uint64 tensor, elementwise."""
    x = x + tf.constant(_GOLDEN, tf.uint64)
    x = (x ^ tf.bitwise.right_shift(x, tf.constant(30, tf.uint64))) * tf.constant(_MIX_1, tf.uint64)
    x = (x ^ tf.bitwise.right_shift(x, tf.constant(27, tf.uint64))) * tf.constant(_MIX_2, tf.uint64)
    return x ^ tf.bitwise.right_shift(x, tf.constant(31, tf.uint64))


def shard_of(keys, num_shards: int):
    """The shard (int32) of each int64 key: a 64-bit mix of the key, modulo `num_shards`."""
    if num_shards == 1:
        return tf.zeros_like(keys, dtype=tf.int32)
    mixed = _mix(tf.bitcast(keys, tf.uint64))
    return tf.cast(tf.math.floormod(mixed, tf.constant(num_shards, tf.uint64)), tf.int32)


# The initializers a new key's row can be drawn from per key, by class name: what
# `tf.keras.initializers` and `tf.random_*_initializer` name them. Others are refused.
SUPPORTED_INITIALIZERS = ("Zeros", "Ones", "Constant", "RandomNormal", "RandomUniform", "TruncatedNormal")
_TRUNCATION = 2.0  # TruncatedNormal redraws values more than 2 standard deviations from the mean


def initializer_spec(initializer, owner: str, default_stddev: float) -> tuple:
    """(kind, a, b, seed) of `initializer` for `draw_rows`; seed None when the initializer has none.

    Raises:
      ArgumentError: for an initializer that cannot be drawn per key.
    """
    if initializer is None:
        return ("normal", 0.0, float(default_stddev), None)
    kind = type(initializer).__name__
    config = initializer.get_config() if hasattr(initializer, "get_config") else {}
    seed = config.get("seed")
    if kind == "Zeros":
        return ("constant", 0.0, 0.0, None)
    if kind == "Ones":
        return ("constant", 1.0, 0.0, None)
    if kind == "Constant" and np.ndim(config.get("value", 0)) == 0:
        return ("constant", float(config.get("value", 0)), 0.0, None)
    if kind == "RandomNormal":
        return ("normal", float(config["mean"]), float(config["stddev"]), seed)
    if kind == "TruncatedNormal":
        return ("truncated", float(config["mean"]), float(config["stddev"]), seed)
    if kind == "RandomUniform":
        return ("uniform", float(config["minval"]), float(config["maxval"]), seed)
    raise ArgumentError(
        f"Argument `initializer` of {owner} must be one that a hash table can draw per key: "
        f"{', '.join(SUPPORTED_INITIALIZERS)} (a scalar Constant), as tf.keras.initializers or "
        f"tf.random_*_initializer. Received: {initializer!r}. Fix: pass e.g. "
        "tf.keras.initializers.RandomNormal(0.0, 0.05), \"uniform\" or \"zeros\" (a table has no fan-in or "
        "fan-out to scale by, so Glorot and He initializers do not apply)."
    )


def layer_seed(name: str) -> int:
    """The seed of a layer whose initializer has none: a checksum of its name, the same in every process."""
    return zlib.crc32(name.encode())


def draw_rows(keys, dim: int, spec: tuple, seed: int):
    """The initial rows [n, dim] float32 of int64 `keys`, each key's drawn from (seed, key) alone.

    Example:

    >>> import tensorflow as tf
    >>> spec = ("uniform", -1.0, 1.0, None)
    >>> a = draw_rows(tf.constant([7, 8], tf.int64), 3, spec, seed=1)
    >>> b = draw_rows(tf.constant([8], tf.int64), 3, spec, seed=1)
    >>> bool(tf.reduce_all(a[1] == b[0])), bool(tf.reduce_any(a[0] != a[1]))
    (True, True)
    """
    kind, a, b, _ = spec
    keys = tf.reshape(keys, [-1])
    if kind == "constant":
        return tf.fill(tf.stack([tf.size(keys), dim]), tf.constant(a, tf.float32))
    base = _mix(tf.bitcast(keys, tf.uint64) ^ tf.constant(int(seed) & (2**64 - 1), tf.uint64))
    columns = tf.range(dim, dtype=tf.int64)
    bits = _mix(tf.reshape(base, [-1, 1]) + tf.bitcast(columns, tf.uint64)[tf.newaxis, :])
    # The top 24 bits, centred in their interval: uniform on (0, 1), never 0 or 1.
    uniform = (tf.cast(tf.bitwise.right_shift(bits, tf.constant(40, tf.uint64)), tf.float32) + 0.5) / 2.0**24
    if kind == "uniform":
        return a + (b - a) * uniform
    if kind == "truncated":
        low = 0.5 * (1.0 + math.erf(-_TRUNCATION / math.sqrt(2.0)))  # the normal CDF at -2
        uniform = low + (1.0 - 2.0 * low) * uniform
    return a + b * tf.math.ndtri(uniform)


class NativeTable(_checkpoint.SavedWhole):
    """One embedding table as `DenseHashTable` shards, one per device; keys int64.

    A checkpoint holds the table whole: every stored key and its value
    (row, slots, bookkeeping), whatever the number of shards, so it restores
    onto any number of ps tasks (each key goes to its shard by `shard_of`).
    A checkpoint of another layout (other optimizer slots) restores the
    table in that layout; the layer lays it out again for its optimizer.

    Args:
      name: the table's name (its shards are `name/shard_<i>` in checkpoints).
      dim: the row width.
      slots: the optimizer slots kept per key (0 for SGD, 1 for momentum
        and Adagrad, 2 for Adam).
      devices: the devices of the shards (ps tasks), or [None]: this machine.
    """

    def __init__(self, name: str, dim: int, slots: int, devices: list, removable: bool = False):
        super().__init__()
        self.name = name
        self.dim = int(dim)
        self.devices = list(devices)
        self.removable = bool(removable)
        self._make_shards(int(slots))

    def _make_shards(self, slots: int) -> None:
        self.slots = slots
        self.width = self.dim * (1 + slots) + BOOKKEEPING
        shards = []
        with tf.init_scope():
            for index, device in enumerate(self.devices):
                with tf.device(device):
                    if self.removable:
                        # Keys are removed (eviction): DenseHashTable's erase leaves a tombstone that a later
                        # insert of a key further along the same probe chain takes, so the key is then stored
                        # twice (measured with TF 2.21: 2 duplicate keys of 236 after 3 evictions), and a
                        # growth keeps whichever copy it meets last. MutableHashTable removes cleanly.
                        shards.append(tf.lookup.experimental.MutableHashTable(
                            tf.int64, tf.float32, default_value=tf.zeros([self.width], tf.float32),
                            name=f"{self.name}_shard_{index}"))
                    else:
                        shards.append(tf.lookup.experimental.DenseHashTable(
                            tf.int64, tf.float32, default_value=tf.zeros([self.width], tf.float32),
                            empty_key=EMPTY_KEY, deleted_key=DELETED_KEY, initial_num_buckets=INITIAL_BUCKETS,
                            name=f"{self.name}_shard_{index}"))
        # Not tracked one by one: the checkpoint holds the table whole (`tensors_to_save`).
        self.shards = shards

    def tensors_to_save(self) -> dict:
        keys, values = [], []
        for shard, device in zip(self.shards, self.devices):
            with tf.device(device):
                part_keys, part_values = _live(*shard.export(), None)
            keys.append(part_keys)
            values.append(part_values)
        return {"keys": tf.concat(keys, 0), "values": tf.concat(values, 0)}

    def restore_tensors(self, tensors: dict):
        keys = tf.reshape(tensors["keys"], [-1])
        values = tensors["values"]
        width = int(values.shape[-1]) if values.shape.rank == 2 and values.shape[-1] is not None else self.width
        saved_slots = (width - BOOKKEEPING) // self.dim - 1
        if width != self.width and (width - BOOKKEEPING) % self.dim == 0 and saved_slots >= 0:
            self._make_shards(saved_slots)  # the saved layout; the layer lays it out for its optimizer again
        values = tf.reshape(values, [-1, self.width])
        positions, parts = self.split(keys)
        imports = []
        for shard, device, part, position in zip(self.shards, self.devices, parts, positions):
            with tf.device(device):
                # Replaces the shard's content, as DenseHashTable's own restore does. Every stored key is
                # removed before any is inserted, so no key is left behind a tombstone (`remove`).
                stored, _ = _live(*shard.export(), 0)
                with tf.control_dependencies([remove(shard, stored)]):
                    imports.append(shard.insert(part, tf.gather(values, position)))
        return tf.group(imports)

    @property
    def num_shards(self) -> int:
        return len(self.devices)

    def split(self, keys):
        """(the key positions of each shard, each shard's keys) of a 1-D int64 tensor of keys."""
        if self.num_shards == 1:
            return [tf.range(tf.size(keys))], [keys]
        shard = shard_of(keys, self.num_shards)
        positions = tf.dynamic_partition(tf.range(tf.size(keys)), shard, self.num_shards)
        return positions, tf.dynamic_partition(keys, shard, self.num_shards)

    def find_rows(self, keys, wire=None):
        """(rows [n, dim] float32, exists [n] bool) of distinct int64 `keys`, read on each shard's device.

        Only the row and the updates column cross from the ps tasks (cast to
        `wire` there, when given); an absent key's row is zeros.
        """
        keys = tf.reshape(keys, [-1])
        positions, parts = self.split(keys)
        rows, exists = [], []
        for shard, device, part in zip(self.shards, self.devices, parts):
            with tf.device(device):
                found = shard.lookup(part)
                row = found[:, :self.dim]
                if wire is not None:
                    row = tf.cast(row, wire)
                rows.append(row)
                exists.append(tf.logical_and(updates_of(found) > 0, seen_of(found) >= 0))
        if self.num_shards == 1:
            row, present = rows[0], exists[0]
        else:
            row = tf.dynamic_stitch(positions, rows)
            present = tf.dynamic_stitch(positions, exists)
        return tf.reshape(tf.cast(row, tf.float32), [-1, self.dim]), tf.reshape(present, [-1])

    def trained_size(self) -> int:
        """The keys with a trained row (not pending admission, not on the disk tier), over every shard."""
        count = 0
        for shard, device in zip(self.shards, self.devices):
            with tf.device(device):
                _, values = _live(*shard.export(), None)
                count += int(tf.reduce_sum(tf.cast(tf.logical_and(updates_of(values) > 0, seen_of(values) >= 0),
                                                   tf.int64)))
        return count

    def size(self):
        """The keys stored, over every shard (an int64 tensor)."""
        sizes = []
        for shard, device in zip(self.shards, self.devices):
            with tf.device(device):
                sizes.append(shard.size())
        return tf.add_n(sizes)

    def export(self, columns: int | None = None, trained_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(keys [n] int64, values [n, columns] float32) of every stored key, sorted by key, as numpy.

        `columns`: the leading columns of each value to return (the row:
        `dim`); None: the whole value (row, slots, bookkeeping).
        `trained_only`: only keys with a trained row (not pending admission,
        not on the disk tier).
        """
        keys, values = [], []
        for shard, device in zip(self.shards, self.devices):
            with tf.device(device):
                part_keys, part_values = _live(*shard.export(), None)
                if trained_only:  # (a key an undone attempt left with zeros has no trained row either)
                    keep = tf.logical_and(updates_of(part_values) > 0, seen_of(part_values) >= 0)
                    part_keys, part_values = tf.boolean_mask(part_keys, keep), tf.boolean_mask(part_values, keep)
                if columns is not None:
                    part_values = part_values[:, :columns]
            keys.append(part_keys.numpy())
            values.append(part_values.numpy())
        keys = np.concatenate(keys) if keys else np.zeros([0], np.int64)
        width = self.width if columns is None else columns
        values = np.concatenate(values) if values else np.zeros([0, width], np.float32)
        order = np.argsort(keys, kind="stable")
        return keys[order], values[order]

    def import_values(self, keys, values) -> None:
        """Inserts whole values (`export()`'s layout, this table's width) of int64 `keys`, each on its shard."""
        keys = tf.reshape(tf.constant(keys, tf.int64), [-1])
        values = tf.reshape(tf.constant(values, tf.float32), [-1, self.width])
        check_keys(keys)
        positions, parts = self.split(keys)
        for shard, device, part, position in zip(self.shards, self.devices, parts, positions):
            with tf.device(device):
                shard.insert(part, tf.gather(values, position))


def _live(keys, values, columns):
    """The stored (key, value) pairs of an exported shard: its empty and deleted buckets left out."""
    keys = tf.reshape(keys, [-1])
    keep = tf.logical_and(tf.not_equal(keys, EMPTY_KEY), tf.not_equal(keys, DELETED_KEY))
    values = tf.boolean_mask(values, keep)
    if columns is not None:
        values = values[:, :columns]
    return tf.boolean_mask(keys, keep), values


def remove(shard, keys):
    """Removes `keys` from a shard (`MutableHashTable.remove`, `DenseHashTable.erase`).

    On a DenseHashTable only where no key stays behind the tombstones (every
    stored key removed at once): see `NativeTable._make_shards`.
    """
    if isinstance(shard, tf.lookup.experimental.MutableHashTable):
        return shard.remove(keys)
    return shard.erase(keys)


def updates_of(values):
    """The `updates` column (int32) of whole table values [n, width]."""
    return tf.bitcast(values[:, -3], tf.int32)


def last_steps_of(values):
    """The `last step` column (int32) of whole table values [n, width]."""
    return tf.bitcast(values[:, -2], tf.int32)


def seen_of(values):
    """The `seen` column (int32) of whole table values [n, width]."""
    return tf.bitcast(values[:, -1], tf.int32)


def bookkeeping(updates, last_step, seen=None):
    """The bookkeeping columns [n, 3] float32 of int32 `updates` [n], `last_step` and `seen` (scalars or [n])."""
    shape = tf.shape(updates)
    last_step = tf.broadcast_to(tf.cast(last_step, tf.int32), shape)
    seen = tf.zeros(shape, tf.int32) if seen is None else tf.broadcast_to(tf.cast(seen, tf.int32), shape)
    return tf.stack([tf.bitcast(tf.cast(updates, tf.int32), tf.float32), tf.bitcast(last_step, tf.float32),
                     tf.bitcast(seen, tf.float32)], axis=1)


def check_keys(keys):
    """An assertion op: no key of `keys` is one of the two DenseHashTable reserves."""
    reserved = tf.logical_or(tf.equal(keys, EMPTY_KEY), tf.equal(keys, DELETED_KEY))
    return tf.debugging.Assert(tf.logical_not(tf.reduce_any(reserved)), [
        f"tf_psx hash table: a key is {EMPTY_KEY} or {EMPTY_KEY + 1}, which the table reserves. "
        "Fix: map these two ids to others (e.g. tf.where(ids < -2**62, ids + 2, ids))."], name="reserved_keys")

