"""What the hash-table tests of both stores share: the keys with duplicates, the model head, the wire rounding.

Not a test module: tests/layers/test_dynamic_embedding.py (TFRA's store) and test_native_tables.py (tf_psx's
own) import it.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

FIELDS, DIM, BATCH, STEPS = 5, 4, 16, 8


def keys_and_labels():
    """(vocab [40] int64, index [BATCH * STEPS, FIELDS] into vocab, labels): large, sparse keys, many duplicates.

    40 distinct keys (hashed categories), Zipf-like draws: every batch repeats keys.
    """
    rng = np.random.default_rng(7)
    vocab = (10**12 + rng.choice(10**9, size=40, replace=False)).astype(np.int64)
    probs = np.arange(1, 41) ** -1.2
    index = rng.choice(40, size=(BATCH * STEPS, FIELDS), p=probs / probs.sum())
    labels = (index[:, 0] % 3 == 0).astype(np.float32)
    return vocab, index, labels


def head(hidden):
    """Flatten + a seeded Dense(1, sigmoid): the same head in every model of a comparison."""
    dense = tf.keras.layers.Dense(1, activation="sigmoid",
                                  kernel_initializer=tf.keras.initializers.GlorotUniform(seed=3))
    return dense(tf.keras.layers.Flatten()(hidden))


def per_step_counts(index, vocab_size: int) -> np.ndarray:
    """[STEPS, vocab_size]: how often each key occurs in each batch of BATCH rows of `index`."""
    return np.stack([np.bincount(index[step * BATCH:(step + 1) * BATCH].ravel(), minlength=vocab_size)
                     for step in range(STEPS)])


def bfloat16(value):
    """`value` (float32) rounded to bfloat16, as float64."""
    return tf.cast(tf.cast(tf.constant(value, tf.float32), tf.bfloat16), tf.float32).numpy().astype(np.float64)


# The linear model of the wire tests: a sample's loss is C times the sum of its rows, so a key's gradient in a
# step is C / BATCH times its occurrences in the batch (summed once per key) whatever the rows are, and SGD's
# rows have a closed form. C and INIT round in opposite directions in bfloat16, so their errors add up.
WIRE_C, WIRE_LR, WIRE_INIT = 0.7, 0.5, 0.1


def linear_wire_model(wire_dtype, table=None):
    """(model, layer): a DynamicEmbedding (store `table`) with `wire_dtype` under the linear loss, compiled with SGD."""
    from tf_psx.layers import DynamicEmbedding  # pylint: disable=import-outside-toplevel

    inputs = tf.keras.Input((FIELDS,), dtype=tf.int64)
    layer = DynamicEmbedding(DIM, initializer=tf.keras.initializers.Constant(WIRE_INIT), wire_dtype=wire_dtype,
                             table=table)
    scaled = tf.keras.layers.Lambda(lambda rows: tf.reduce_sum(rows, axis=[1, 2])[:, None] * WIRE_C)(layer(inputs))
    model = tf.keras.Model(inputs, scaled)
    model.compile(tf.keras.optimizers.SGD(WIRE_LR), lambda _y, pred: tf.reduce_sum(pred, axis=-1))
    return model, layer
