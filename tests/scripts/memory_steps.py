"""Resident memory of a `fit` after warm-up, then after 5x and 50x more steps (in-process LocalCluster, 2 workers).

A model of the shape that grew (many small dense variables beside a
partitioned embedding, Adam, exact updates), `fit` on a `DatasetCreator`.
RSS (psutil, current, not peak) is read after a warm-up fit that traced the
step, after `--steps` more steps and after 10x that many more. Prints
`RESULT {json}` with the three readings in MB.

Usage: memory_steps.py [--steps 150] [--dense 24]
"""

from __future__ import annotations

import argparse
import gc
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import psutil  # noqa: E402  pylint: disable=wrong-import-position

import tf_psx  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position
import tensorflow as tf  # noqa: E402  pylint: disable=wrong-import-position


def _rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--dense", type=int, default=24)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 500, (4096, 8))
    labels = (rng.random(4096) < 0.3).astype("float32")

    def dataset_fn(_context):
        return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(64)

    with tf_psx.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
        with strategy.scope():
            inputs = tf.keras.Input((8,), dtype="int64")
            hidden = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(500, 4)(inputs))
            for _ in range(args.dense):
                hidden = tf.keras.layers.Dense(8, activation="relu")(hidden)
            model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(hidden))
            model.compile(tf.keras.optimizers.Adam(0.01), "binary_crossentropy")
        data = tf.keras.utils.experimental.DatasetCreator(dataset_fn)
        readings = []
        for steps in (20, args.steps, 10 * args.steps):
            model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
            readings.append(round(_rss_mb(), 1))
        print("RESULT " + json.dumps({"rss_mb": readings, "steps": [20, args.steps, 10 * args.steps]}), flush=True)


if __name__ == "__main__":
    main()
