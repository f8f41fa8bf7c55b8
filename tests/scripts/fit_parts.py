"""The counting model of tests/training/test_fit_inputs.py: how many times `model.fit` read each example.

The model is one embedding row per example id (ids 0..N-1), dim 1, zeros,
and its loss is the row itself, weighted by the label's class weight: with
SGD at a learning rate of the batch size, every read of an example moves its
row by exactly -weight, whatever the interleaving. So `reads = -row /
weight` counts the reads of each example, exactly (small integers in
float32).

(tests/scripts/exact_epochs.py checks several workers, with a closed form under Adagrad.)
"""

from __future__ import annotations

import numpy as np

import tf_psx  # noqa: F401  (routes tf.keras to tf-keras)
import tensorflow as tf

BATCH = 8
BATCHES_PER_WORKER = 5
CLASS_WEIGHT = {0: 1.0, 1: 2.0}


def labels_of(ids: np.ndarray) -> np.ndarray:
    return ((ids // 3) % 2).astype(np.float32)  # not aligned with any worker's part


def build(strategy, rows: int):
    with strategy.scope():
        inputs = tf.keras.Input((1,), dtype=tf.int64)
        vectors = tf.keras.layers.Embedding(rows, 1, embeddings_initializer="zeros", name="rows")(inputs)
        model = tf.keras.Model(inputs, tf.keras.layers.Flatten()(vectors))
        # Loss = the row; mean over the batch, so SGD(lr=BATCH) moves a row by -weight per read.
        model.compile(tf.keras.optimizers.SGD(float(BATCH)), loss=lambda _y, rows_: tf.reduce_sum(rows_, axis=-1))
    return model


def reads_of(model, ids: np.ndarray, weights: np.ndarray) -> list[float]:
    table = tf_psx.unsharded_weights(model)[0][:, 0]
    return (-table[ids] / weights).tolist()
