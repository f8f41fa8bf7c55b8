"""The gradient sums of synchronous training: one accumulator beside each variable (tf_psx.sync_training).

An arrival adds its gradient under the sync lock; the R-th arrival's apply
reads the mean (`mean(count)`: the gradient, and the ops that must run
before the optimizer reads it) and then clears the sums.

* `DenseAccumulator`: a dense gradient; a variable of the same shape.
* `SparseAccumulator`: an `IndexedSlices` gradient; a variable of the same
  shape plus a mark per row, so the apply is a sparse apply of the touched
  rows, deduplicated as the optimizer would.
* `TableAccumulator`: a TFRA table; a hash table of gradient sums per key
  on the sync state's ps task. The rows the apply starts from are read from
  the table then (a key still absent gets the table's default, which
  differs from the row the forward pass drew when the initializer is
  random); the apply loads them into TFRA's shadows (tf_psx._tf.shadows).

Each has `writes` (what an arrival writes, saved in a journal by
tf_psx.step_once) and `scope` (where its token ring lives). Called only by
tf_psx.sync_training. Importing this module imports TensorFlow.
"""

from __future__ import annotations

import tensorflow as tf

from tf_psx._tf import shadows as _shadows, tfra as _tfra


def journal_key(accumulator) -> str:
    return f"sync_sum_{id(accumulator)}"


def rows_written(gradient):
    """The rows an add of `gradient` writes (an `IndexedSlices`' indices), or None: all of them."""
    return tf.cast(gradient.indices, tf.int64) if isinstance(gradient, tf.IndexedSlices) else None


class DenseAccumulator:
    """Sums dense gradients of one variable."""

    def __init__(self, strategy, variable):
        self.variable = variable
        with tf.init_scope(), strategy.extended.colocate_vars_with(variable):
            self.sum = tf.Variable(tf.zeros(variable.shape, variable.dtype), trainable=False,
                                   name="tf_psx_sync_sum", aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # What an arrival writes (saved in a journal, tf_psx.step_once), and where its token ring lives.
        self.writes = [self.sum]
        self.scope = lambda: strategy.extended.colocate_vars_with(variable)

    def add(self, gradient):
        if isinstance(gradient, tf.IndexedSlices):
            return self.sum.scatter_add(gradient)
        return self.sum.assign_add(gradient, read_value=False)

    def mean(self, count):
        return self.sum.read_value() / tf.cast(count, self.sum.dtype), []

    def clear(self):
        return self.sum.assign(tf.zeros_like(self.sum), read_value=False)


class SparseAccumulator:
    """Sums `IndexedSlices` gradients of one variable and marks the rows they touch.

    The marks are a vector of the variable's row count (a variable of
    unknown shape, such as a list of ids, fails TF 2.16's remote function
    calls), so the apply reads the touched rows with one `where`.
    """

    def __init__(self, strategy, variable):
        self.variable = variable
        with tf.init_scope(), strategy.extended.colocate_vars_with(variable):
            self.sum = tf.Variable(tf.zeros(variable.shape, variable.dtype), trainable=False,
                                   name="tf_psx_sync_sum", aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.marks = tf.Variable(tf.zeros(variable.shape[:1], tf.int32), trainable=False,
                                     name="tf_psx_sync_marks", aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self._touched = None
        self.writes = [self.sum, self.marks]
        self.scope = lambda: strategy.extended.colocate_vars_with(variable)

    def add(self, gradient):
        if not isinstance(gradient, tf.IndexedSlices):
            return tf.group(self.sum.assign_add(gradient, read_value=False),
                            self.marks.assign(tf.ones_like(self.marks), read_value=False))
        indices = tf.cast(gradient.indices, tf.int64)
        ones = tf.ones(tf.shape(indices), tf.int32)
        return tf.group(self.sum.scatter_add(tf.IndexedSlices(gradient.values, indices)),
                        self.marks.scatter_max(tf.IndexedSlices(ones, indices)))

    def mean(self, count):
        touched = tf.reshape(tf.where(self.marks.read_value() > 0), [-1])
        self._touched = touched
        values = tf.gather(self.sum.read_value(), touched) / tf.cast(count, self.sum.dtype)
        return tf.IndexedSlices(values, touched, tf.shape(self.sum, out_type=tf.int64)), []

    def clear(self):
        touched = self._touched
        zeros = tf.zeros(tf.concat([tf.shape(touched), tf.shape(self.sum)[1:]], 0), self.sum.dtype)
        return tf.group(self.sum.scatter_update(tf.IndexedSlices(zeros, touched)),
                        self.marks.scatter_update(tf.IndexedSlices(tf.zeros(tf.shape(touched), tf.int32), touched)))


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
            from tf_psx.tables import native  # pylint: disable=import-outside-toplevel

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
        from tf_psx.tables import native  # pylint: disable=import-outside-toplevel

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
        # As a training lookup does: the exact update sends the rows of absent keys (tf_psx.exact_tables).
        loads = [_shadows.write_buffer(shadow.ids, keys), _shadows.write_buffer(shadow, values),
                 _shadows.write_buffer(shadow.exists, exists)]
        gradient = tf.IndexedSlices(summed / tf.cast(count, summed.dtype), tf.range(rows),
                                    tf.stack([rows, shadow.params.dim]))
        return gradient, loads

    def clear(self):
        return self.sums.remove(self._keys)
