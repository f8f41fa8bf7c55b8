"""How many times `model.fit` with no `steps_per_epoch` read each example, under several workers.

The model is one embedding row per example id (ids 0..N-1), dim 1, zeros,
and its loss is the row itself, weighted by the label's class weight: with
SGD at a learning rate of the batch size, every read of an example moves its
row by exactly -weight, whatever the interleaving. So `reads = -row /
weight` counts the reads of each example, exactly (small integers in
float32).

Two inputs, each for `--epochs` epochs:
- `arrays`: `fit(ids, labels, batch_size=B, shuffle=True, class_weight=...)`;
  worker w's part is the examples with id % W == w.
- `dataset`: `fit(Dataset.from_tensor_slices((ids, labels)).batch(B))`, not
  shuffled; worker w's part is the batches j with j % W == w, read in order.

Prints `RESULT {json}` per input: the reads of each id, the steps applied,
the epochs in the history and the workers.

Usage: fit_parts.py [--workers 2] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import sys

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    rows = args.workers * BATCHES_PER_WORKER * BATCH
    ids = np.arange(rows, dtype=np.int64)
    labels = labels_of(ids)
    with tf_psx.LocalCluster(num_workers=args.workers, num_ps=2) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, "fixed:2")
        runs = {
            "arrays": (lambda m: m.fit(ids, labels, batch_size=BATCH, epochs=args.epochs, shuffle=True,
                                       class_weight=CLASS_WEIGHT, verbose=0),
                       np.vectorize(CLASS_WEIGHT.get)(labels)),
            "dataset": (lambda m: m.fit(tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH),
                                        epochs=args.epochs, verbose=0),
                        np.ones(rows)),
        }
        for name, (fit, weights) in runs.items():
            model = build(strategy, rows)
            history = fit(model)
            print("RESULT " + json.dumps({
                "input": name, "workers": args.workers, "batch": BATCH, "epochs": len(history.history["loss"]),
                "steps": int(model.optimizer.iterations.numpy()), "reads": reads_of(model, ids, weights),
            }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
