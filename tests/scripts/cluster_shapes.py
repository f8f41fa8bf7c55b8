"""Trains on LocalClusters of shapes (1w,1ps), (3w,2ps), (1w,1ps), one after another in one process.

This is a notebook user rerunning the cluster cell with another shape. In
TF 2.16 the second shape used to hang in its first step (a process-wide
thread pool sized by the first cluster). Prints `SHAPE workers ps iterations`
per cluster.

Usage: cluster_shapes.py [--processes]
"""

from __future__ import annotations

import sys

import numpy as np

import tf_psx
import tensorflow as tf

SHAPES = ((1, 1), (3, 2), (1, 1))
STEPS = 10


def main() -> int:
    processes = "--processes" in sys.argv[1:]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, (256, 4))
    labels = rng.random(256).astype("float32")
    for workers, ps in SHAPES:
        with tf_psx.LocalCluster(num_workers=workers, num_ps=ps, processes=processes) as cluster:
            strategy = tf_psx.ParameterServerStrategy(cluster, "fixed:2")
            with strategy.scope():
                model = tf.keras.Sequential([
                    tf.keras.Input((4,), dtype="int64"),
                    tf.keras.layers.Embedding(100, 4),
                    tf.keras.layers.Flatten(),
                    tf.keras.layers.Dense(1),
                ])
                model.compile("adagrad", "mse")
            dataset = tf.keras.utils.experimental.DatasetCreator(
                lambda _ctx: tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(32)
            )
            model.fit(dataset, epochs=1, steps_per_epoch=STEPS, verbose=0)
            print(f"SHAPE {workers} {ps} {int(model.optimizer.iterations.numpy())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
