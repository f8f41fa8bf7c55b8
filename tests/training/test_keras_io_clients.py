"""keras-io client code, written as keras-io writes it, under tf_psx's strategy (session cluster), against one process.

* "Collaborative filtering for movie recommendations": a subclassed
  `RecommenderNet` (two Embeddings, a dot product),
  `fit(x, y, batch_size=64, epochs=..., verbose=1, validation_data=(x_val, y_val))`.
  TF alone refuses verbose=1; tf_psx refused the validation before.
* "Wide, deep and cross networks": a `make_csv_dataset`-style pipeline of
  unknown size, `validation_data`, several models fitted in turn. tf_psx
  asked for steps_per_epoch before, and the advice led into OutOfRangeError.

The session cluster has one worker, so a run applies the same steps in the
same order as one process: the results must match to float precision.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_psx

pytestmark = pytest.mark.cluster


class RecommenderNet(tf.keras.Model):
    """keras-io's model, as written there (tf.keras instead of keras)."""

    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super().__init__(**kwargs)
        self.user_embedding = tf.keras.layers.Embedding(
            num_users, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=tf.keras.regularizers.l2(1e-6))
        self.user_bias = tf.keras.layers.Embedding(num_users, 1)
        self.movie_embedding = tf.keras.layers.Embedding(
            num_movies, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=tf.keras.regularizers.l2(1e-6))
        self.movie_bias = tf.keras.layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = tf.tensordot(user_vector, movie_vector, 2)
        x = dot_user_movie + user_bias + movie_bias
        return tf.nn.sigmoid(x)


def _ratings(seed=0, rows=1000):
    rng = np.random.default_rng(seed)
    x = np.stack([rng.integers(0, 60, rows), rng.integers(0, 90, rows)], axis=1).astype(np.int64)
    y = rng.random(rows).astype(np.float32)
    return x, y


def _recommender(strategy):
    with strategy.scope():
        model = RecommenderNet(60, 90, 8)
        model.compile(loss=tf.keras.losses.BinaryCrossentropy(),
                      optimizer=tf.keras.optimizers.Adam(learning_rate=0.001))
    return model


def test_collaborative_filtering_runs_as_written_and_matches_one_process(ps_strategy, capsys):
    x, y = _ratings()
    x_train, x_val, y_train, y_val = x[:900], x[900:], y[:900], y[900:]
    remote = _recommender(ps_strategy)
    local = _recommender(tf.distribute.get_strategy())
    with ps_strategy.scope():  # built in the scope, as fit would build it (outside, its variables are not the ps's)
        remote(x[:2])
    local(x[:2])
    local.set_weights(tf_psx.unsharded_weights(remote))
    kwargs = dict(batch_size=64, epochs=2, verbose=1, validation_data=(x_val, y_val), shuffle=False)
    got = remote.fit(x_train, y_train, **kwargs).history
    want = local.fit(x_train, y_train, **kwargs).history
    assert "Epoch 2/2" in capsys.readouterr().out  # the progress bar
    for key in ("loss", "val_loss"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, err_msg=key)


def _csv_dataset(path, batch_size=32, shuffle=False):
    """keras-io's `get_dataset_from_csv`: tf.data.experimental.make_csv_dataset, one pass (unknown size)."""
    return tf.data.experimental.make_csv_dataset(
        str(path), batch_size=batch_size, column_names=["a", "b", "c", "label"],
        column_defaults=[0.0, 0.0, 0.0, 0.0], label_name="label", num_epochs=1, header=False, shuffle=shuffle)


def _wide_deep(strategy, seed):
    with strategy.scope():
        inputs = {name: tf.keras.Input((), name=name) for name in "abc"}
        stacked = tf.keras.layers.Lambda(lambda d: tf.stack([d["a"], d["b"], d["c"]], axis=1))(inputs)
        deep = tf.keras.layers.Dense(8, activation="relu", kernel_initializer=tf.keras.initializers.GlorotUniform(seed))(stacked)
        merged = tf.keras.layers.concatenate([stacked, deep])
        out = tf.keras.layers.Dense(1, activation="sigmoid",
                                    kernel_initializer=tf.keras.initializers.GlorotUniform(seed + 1))(merged)
        model = tf.keras.Model(inputs, out)
        model.compile(tf.keras.optimizers.Adam(0.01), tf.keras.losses.BinaryCrossentropy(),
                      metrics=[tf.keras.metrics.BinaryAccuracy()])
    return model


def test_wide_deep_csv_pipeline_of_unknown_size_runs_as_written(ps_strategy, tmp_path):
    rng = np.random.default_rng(1)
    rows = rng.random((300, 3))
    labels = (rows.sum(axis=1) > 1.5).astype(float)
    path = tmp_path / "train.csv"
    np.savetxt(path, np.column_stack([rows, labels]), delimiter=",", fmt="%.6f")
    train, test = _csv_dataset(path), _csv_dataset(path, batch_size=64)
    assert int(train.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    for seed in (0, 10, 20):  # keras-io fits its models in turn
        remote, local = _wide_deep(ps_strategy, seed), _wide_deep(tf.distribute.get_strategy(), seed)
        local.set_weights(tf_psx.unsharded_weights(remote))  # a sharded kernel initializes per shard
        got = remote.fit(train, epochs=3, validation_data=test, verbose=0).history
        want = local.fit(train, epochs=3, validation_data=test, verbose=0).history
        assert len(got["loss"]) == 3
        # Sharded kernels sum their parts in another order: float32 rounding grows to ~1e-3 relative over 30
        # Adam steps (measured up to 1.1e-3); an accuracy may flip the few rows predicted that close to 0.5
        # (1% = 3 of 300 rows).
        for key in ("loss", "val_loss"):
            np.testing.assert_allclose(got[key], want[key], rtol=3e-3, atol=1e-6, err_msg=f"{seed} {key}")
        for key in ("binary_accuracy", "val_binary_accuracy"):
            np.testing.assert_allclose(got[key], want[key], atol=0.01, err_msg=f"{seed} {key}")
        _, accuracy = remote.evaluate(test, verbose=0)
        assert accuracy == pytest.approx(local.evaluate(test, verbose=0)[1], abs=1e-2)  # 300 rows: a row at most
