"""The gradient sums of synchronous training for hash tables (tf_psx.training.sync_training).

The accumulators of fixed variables are in tf_psx.training.sync_accumulators;
these two have the same surface (`writes`, `scope`, `add`, `mean`, `clear`):

* `KeyedAccumulator`: a native table (tf_psx.tables.native); a
  `DenseHashTable` of gradient sums per key beside the table's anchor.
* `TableAccumulator`: a TFRA table; a hash table of gradient sums per key
  on the sync state's ps task. The rows the apply starts from are read from
  the table then (a key still absent gets the table's default, which
  differs from the row the forward pass drew when the initializer is
  random); the apply loads them into TFRA's shadows (tf_psx._tf.shadows).

Importing this module imports TensorFlow.
"""

from __future__ import annotations

import tensorflow as tf

from tf_psx._tf import shadows as _shadows, tfra as _tfra
from tf_psx.tables import native
from tf_psx.training import exact_updates as _exact, sync_training as _sync_training


class KeyedAccumulator:
    """Sums a native hash table's gradient rows per key (tf_psx.tables), in a `DenseHashTable` beside its anchor.

    The table's gradient is an `IndexedSlices` keyed by table keys (any
    int64), so the sums are kept per key; the apply gives the table's
    update (tf_psx.tables.updates) the mean per key, which then reads every
    row afresh on its shard.
    """

    def __init__(self, anchor):
        self.variable = anchor
        self._keys = None
        self.sums = None
        self._device = anchor.device
        # No journal: its rows live in a hash table (an arrival cut off midway counts as "unsure").
        self.writes = []
        self.scope = lambda: tf.device(anchor.device)

    def _table(self, width):
        if self.sums is None:
            with tf.init_scope(), tf.device(self._device):
                self.sums = tf.lookup.experimental.DenseHashTable(
                    tf.int64, tf.float32, default_value=tf.zeros([width], tf.float32), empty_key=native.EMPTY_KEY,
                    deleted_key=native.DELETED_KEY, name="tf_psx_sync_sums")
            self._width = width
        return self.sums

    def add(self, gradient):
        keys = tf.reshape(tf.cast(gradient.indices, tf.int64), [-1])
        values = tf.convert_to_tensor(gradient.values)
        sums = self._table(int(values.shape[-1]))
        keys, position = tf.unique(keys)
        values = tf.math.unsorted_segment_sum(values, position, tf.shape(keys)[0])
        # Under the sync lock: nothing else writes the sums in between.
        return sums.insert(keys, sums.lookup(keys) + values)

    def mean(self, count):
        keys, summed = self.sums.export()
        keys = tf.reshape(keys, [-1])
        live = tf.logical_and(tf.not_equal(keys, native.EMPTY_KEY), tf.not_equal(keys, native.DELETED_KEY))
        keys, summed = tf.boolean_mask(keys, live), tf.boolean_mask(summed, live)
        self._keys = keys
        shape = tf.constant([2**63 - 1, self._width], tf.int64)
        return tf.IndexedSlices(summed / tf.cast(count, summed.dtype), keys, shape), []

    def clear(self):
        return self.sums.erase(self._keys)


class TableAccumulator:
    """Sums a TFRA table's gradient rows per key, in a hash table of its own on the sync state's ps task."""

    def __init__(self, shadow, anchor):
        self.variable = shadow
        params = shadow.params
        self._keys = None
        with tf.init_scope():
            self.sums = _tfra.tfra().Variable(
                key_dtype=params.key_dtype, value_dtype=params.value_dtype, dim=params.dim,
                devices=[anchor.device], name=f"tf_psx_sync_{params.name.replace('/', '_')}", initializer=0.0,
                trainable=False)
        # No journal: its rows live in a hash table (an arrival cut off midway counts as "unsure").
        self.writes = []
        self.scope = lambda: tf.device(anchor.device)

    def add(self, gradient):
        ids = tf.reshape(self.variable.ids.read_value(), [-1])
        if isinstance(gradient, tf.IndexedSlices):
            position = tf.cast(gradient.indices, tf.int32)
            keys, values = tf.gather(ids, position), gradient.values
        else:
            keys, values = ids, gradient
        keys, position = tf.unique(keys)
        values = tf.math.unsorted_segment_sum(values, position, tf.shape(keys)[0])
        # Under the sync lock: nothing else writes the sums in between.
        return self.sums.upsert(keys, self.sums.lookup(keys) + values)

    def mean(self, count):
        keys, summed = self.sums.export()
        self._keys = keys
        rows = tf.shape(keys)[0]
        shadow = self.variable
        # The optimizer's apply reads the step's keys and rows from the shadow.
        values, exists = shadow.params.lookup(keys, return_exists=True)
        # As a training lookup does: the exact update sends the rows of absent keys (tf_psx.tables.tfra_updates).
        loads = [_shadows.write_buffer(shadow.ids, keys), _shadows.write_buffer(shadow, values),
                 _shadows.write_buffer(shadow.exists, exists)]
        gradient = tf.IndexedSlices(summed / tf.cast(count, summed.dtype), tf.range(rows),
                                    tf.stack([rows, shadow.params.dim]))
        return gradient, loads

    def clear(self):
        return self.sums.remove(self._keys)


def accumulator_for(optimizer, variable, state):
    """The accumulator of a table's variable (a native table's anchor, a TFRA shadow), or None."""
    if _exact.is_table_anchor(optimizer, variable):
        return KeyedAccumulator(variable)
    if _tfra.is_tfra_shadow(variable):
        return TableAccumulator(variable, state)
    return None


if accumulator_for not in _sync_training.TABLE_ACCUMULATORS:
    _sync_training.TABLE_ACCUMULATORS.append(accumulator_for)
