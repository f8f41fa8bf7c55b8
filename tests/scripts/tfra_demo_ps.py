"""TFRA 0.8.1's own parameter-server demo (demo/dynamic_embedding/movielens-1m-keras-ps), strategy line changed.

The model, the optimizer, the dataset pipeline and the `fit` call are the
demo's (`DualChannelsDeepModel` with two `de.keras.layers.SquashedEmbedding`
on the ps devices, `de.DynamicEmbeddingOptimizer(legacy Adam(1e-3))`,
`strategy.experimental_distribute_dataset(dataset)`, `fit(epochs=2,
steps_per_epoch=10)`); the data is synthetic with MovieLens-1M's schema
(user ids 1-6040, movie ids 1-3952, ratings 1-5) instead of the download.
With 2 workers it failed under TF alone in every run, with shape errors in
`AssignSubVariableOp`, `ResourceScatterAdd` and `CuckooHashTableInsert`.

Prints `RESULT {json}`: the steps applied, the device of the optimizer's
`iterations`, the loss per epoch, the keys of
each table, and the distinct ids of the batches `fit` read (the first 20 of
the dataset, in its fixed order).

Usage: tfra_demo_ps.py [--workers 2] [--local]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import tf_psx
import tensorflow as tf
from tensorflow_recommenders_addons import dynamic_embedding as de

try:
    from tensorflow.keras.optimizers.legacy import Adam
except ImportError:
    from tensorflow.keras.optimizers import Adam

EXAMPLES = 4096


class DualChannelsDeepModel(tf.keras.Model):
    """The demo's model, as written there."""

    def __init__(self, devices=(), user_embedding_size=1, movie_embedding_size=1, embedding_initializer=None):
        super().__init__()
        self.devices = list(devices)
        if embedding_initializer is None:
            embedding_initializer = tf.keras.initializers.Zeros()
        self.user_embedding = de.keras.layers.SquashedEmbedding(
            user_embedding_size, initializer=embedding_initializer, devices=self.devices, name="user_embedding")
        self.movie_embedding = de.keras.layers.SquashedEmbedding(
            movie_embedding_size, initializer=embedding_initializer, devices=self.devices, name="movie_embedding")
        normal = tf.keras.initializers.RandomNormal
        self.dnn1 = tf.keras.layers.Dense(64, activation="relu", kernel_initializer=normal(0.0, 0.1),
                                          bias_initializer=normal(0.0, 0.1))
        self.dnn2 = tf.keras.layers.Dense(16, activation="relu", kernel_initializer=normal(0.0, 0.1),
                                          bias_initializer=normal(0.0, 0.1))
        self.dnn3 = tf.keras.layers.Dense(5, activation="softmax", kernel_initializer=normal(0.0, 0.1),
                                          bias_initializer=normal(0.0, 0.1))
        self.bias_net = tf.keras.layers.Dense(5, activation="softmax", kernel_initializer=normal(0.0, 0.1),
                                              bias_initializer=normal(0.0, 0.1))

    @tf.function
    def call(self, features):
        user_id = tf.reshape(features["user_id"], (-1, 1))
        movie_id = tf.reshape(features["movie_id"], (-1, 1))
        latent = tf.concat([self.user_embedding(user_id), self.movie_embedding(movie_id)], axis=1)
        x = self.dnn3(self.dnn2(self.dnn1(latent)))
        return 0.2 * x + 0.8 * self.bias_net(latent)


def get_dataset(batch_size: int) -> tf.data.Dataset:
    """The demo's pipeline over synthetic ratings of MovieLens-1M's schema (string ids, as TFDS gives them)."""
    rng = np.random.default_rng(0)
    raw = tf.data.Dataset.from_tensor_slices({
        "user_id": rng.integers(1, 6041, EXAMPLES).astype(str),
        "movie_id": rng.integers(1, 3953, EXAMPLES).astype(str),
        "user_rating": rng.integers(1, 6, EXAMPLES).astype(np.float32),
    })
    features = raw.map(lambda x: {"movie_id": tf.strings.to_number(x["movie_id"], tf.int64),
                                  "user_id": tf.strings.to_number(x["user_id"], tf.int64)})
    ratings = raw.map(lambda x: tf.one_hot(tf.cast(x["user_rating"] - 1, dtype=tf.int64), 5))
    dataset = tf.data.Dataset.zip((features, ratings))
    dataset = dataset.shuffle(4096, reshuffle_each_iteration=False)
    return dataset.batch(batch_size)


def train(strategy, num_ps: int) -> dict:
    dataset = get_dataset(64)
    read = list(dataset.take(20))  # the batches fit reads: 2 epochs of 10 steps, one pass in its fixed order
    if strategy is not None:
        dataset = strategy.experimental_distribute_dataset(dataset)
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        devices = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(num_ps)] if strategy else []
        model = DualChannelsDeepModel(devices, 32, 32, tf.keras.initializers.RandomNormal(0.0, 0.5))
        optimizer = de.DynamicEmbeddingOptimizer(Adam(1e-3))
        auc = tf.keras.metrics.AUC(num_thresholds=1000)
    model.compile(optimizer=optimizer, loss=tf.keras.losses.MeanSquaredError(), metrics=[auc])
    history = model.fit(dataset, epochs=2, steps_per_epoch=10, verbose=0)

    def keys(layer):
        return sorted(int(k) for k in layer.params.export()[0].numpy())

    return {"steps": int(model.optimizer.iterations.numpy()), "iterations_device": model.optimizer.iterations.device,
            "loss": history.history["loss"],
            "user_keys": keys(model.user_embedding), "movie_keys": keys(model.movie_embedding),
            "read_users": sorted({int(u) for f, _ in read for u in f["user_id"].numpy()}),
            "read_movies": sorted({int(m) for f, _ in read for m in f["movie_id"].numpy()})}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--local", action="store_true", help="no strategy (the one-process run)")
    args = parser.parse_args(argv)
    if args.local:
        result = train(None, 0)
    else:
        with tf_psx.LocalCluster(num_workers=args.workers, num_ps=1) as cluster:
            strategy = tf_psx.ParameterServerStrategy(cluster)  # the line the demo's script changes
            result = train(strategy, 1)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
