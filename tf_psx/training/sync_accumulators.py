"""The gradient sums of synchronous training: one accumulator beside each variable (tf_psx.training.sync_training).

An arrival adds its gradient under the sync lock; the R-th arrival's apply
reads the mean (`mean(count)`: the gradient, and the ops that must run
before the optimizer reads it) and then clears the sums.

* `DenseAccumulator`: a dense gradient; a variable of the same shape.
* `SparseAccumulator`: an `IndexedSlices` gradient; a variable of the same
  shape plus a mark per row, so the apply is a sparse apply of the touched
  rows, deduplicated as the optimizer would.
* A hash table's accumulators (`KeyedAccumulator`, `TableAccumulator`)
  live with the tables, in tf_psx.tables.sync.

Each has `writes` (what an arrival writes, saved in a journal by
tf_psx.training.step_once) and `scope` (where its token ring lives). Called only by
tf_psx.training.sync_training. Importing this module imports TensorFlow.
"""

from __future__ import annotations

import tensorflow as tf



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
        # What an arrival writes (saved in a journal, tf_psx.training.step_once), and where its token ring lives.
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
