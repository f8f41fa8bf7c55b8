"""Weights between a local model and a sharded cluster model (session cluster, fixed:2)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_psx

pytestmark = pytest.mark.cluster


def _model(layer="stock"):
    inputs = tf.keras.Input((2,), dtype=tf.int64)
    if layer == "stock":
        emb = tf.keras.layers.Embedding(100, 4)
    else:
        emb = tf_psx.layers.ShardedEmbedding(100, 4)
    out = tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(emb(inputs)))
    return tf.keras.Model(inputs, out)


@pytest.mark.parametrize("layer", ["stock", "sharded"])
def test_local_and_cluster_models_exchange_weights(ps_strategy, layer):
    local = _model(layer)
    rng = np.random.default_rng(0)
    local.set_weights([rng.normal(size=w.shape).astype("float32") for w in local.get_weights()])
    with ps_strategy.scope():
        remote = _model(layer)
    # TF's own list: every shard separately (fixed:2 splits the table and the kernel).
    assert [w.shape for w in remote.get_weights()] == [(50, 4), (50, 4), (4, 1), (4, 1), (1,)]
    assert [w.shape for w in tf_psx.unsharded_weights(remote)] == [(100, 4), (8, 1), (1,)]

    # Local -> cluster with the unsharded list; the models then agree.
    remote.set_weights(local.get_weights())
    for got, want in zip(tf_psx.unsharded_weights(remote), local.get_weights()):
        np.testing.assert_array_equal(got, want)
    ids = rng.integers(0, 100, (16, 2))
    np.testing.assert_allclose(remote.predict(ids, verbose=0), local.predict(ids, verbose=0), atol=1e-6)

    # Cluster -> local, with TF's shard list and with the unsharded list.
    moved = [w + 1.0 for w in tf_psx.unsharded_weights(remote)]
    remote.set_weights(moved)
    fresh = _model(layer)
    fresh.set_weights(remote.get_weights())
    for got, want in zip(fresh.get_weights(), moved):
        np.testing.assert_array_equal(got, want)
    again = _model(layer)
    again.set_weights(tf_psx.unsharded_weights(remote))
    for got, want in zip(again.get_weights(), moved):
        np.testing.assert_array_equal(got, want)
    # TF's shard list still works on the cluster model.
    remote.set_weights(remote.get_weights())


def test_wrong_unsharded_shape_names_the_weight(ps_strategy):
    with ps_strategy.scope():
        remote = _model()
    weights = [np.zeros((99, 4), np.float32), np.zeros((8, 1), np.float32), np.zeros((1,), np.float32)]
    with pytest.raises(ValueError, match=r"sharded in 2 parts of total shape \(100, 4\); received an array of shape \(99, 4\)"):
        remote.set_weights(weights)


def _two_dense_model():
    inputs = tf.keras.Input((2,), dtype=tf.int64)
    hidden = tf.keras.layers.Dense(2)(tf.keras.layers.Flatten()(tf.keras.layers.Embedding(100, 4)(inputs)))
    return tf.keras.Model(inputs, tf.keras.layers.Dense(1)(hidden))


@pytest.mark.parametrize("filename", ["model.keras", "model.h5"])
def test_a_sharded_model_saves_whole_and_loads_both_ways(ps_strategy, tmp_path, filename):
    # tf-keras saved each shard as its own entry: .keras refused the local
    # load ("expected 2 variables, but received 3"), .h5 refused the save
    # ("name already exists"; TF names every sharded variable
    # "ShardedVariable", and Dense(2)'s kernel and bias are both sharded
    # here). Saved whole, the file loads locally and back into shards.
    rng = np.random.default_rng(1)
    with ps_strategy.scope():
        remote = _two_dense_model()
        remote.compile(tf.keras.optimizers.Adagrad(0.1), "mse")
    remote.fit(rng.integers(0, 100, (32, 2)), rng.normal(size=(32, 1)), batch_size=8, epochs=1, steps_per_epoch=2,
               verbose=0)
    remote.set_weights([rng.normal(size=w.shape).astype("float32") for w in tf_psx.unsharded_weights(remote)])
    whole = [(100, 4), (8, 2), (2,), (2, 1), (1,)]
    assert [w.shape for w in tf_psx.unsharded_weights(remote)] == whole
    remote.save(str(tmp_path / filename))
    local = tf.keras.models.load_model(str(tmp_path / filename))
    assert [w.shape for w in local.get_weights()] == whole
    for got, want in zip(local.get_weights(), tf_psx.unsharded_weights(remote)):
        np.testing.assert_array_equal(got, want)
    # The optimizer's slots too (Adagrad: the iteration count and an accumulator per weight).
    assert int(local.optimizer.iterations) == 2
    saved = sorted((v.numpy() for v in remote.optimizer.variables), key=lambda a: (a.size, a.shape))
    loaded = sorted((v.numpy() for v in local.optimizer.variables), key=lambda a: (a.size, a.shape))
    assert [a.shape for a in loaded] == [a.shape for a in saved]
    for got, want in zip(loaded, saved):
        np.testing.assert_array_equal(got, want)
    with ps_strategy.scope():
        back = tf.keras.models.load_model(str(tmp_path / filename))
    assert len(back.get_weights()) > len(whole)  # in shards again
    for got, want in zip(tf_psx.unsharded_weights(back), local.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_h5_of_a_local_model_with_a_legacy_optimizer(ps_strategy, tmp_path):  # pylint: disable=unused-argument
    # The h5 patch is process-wide once a strategy exists; a legacy optimizer's
    # `variables` is a method, which it must not iterate.
    model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    model.compile(tf.keras.optimizers.legacy.Adagrad(0.1), "mse")
    model.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=0)
    model.save(str(tmp_path / "legacy.h5"))
    loaded = tf.keras.models.load_model(str(tmp_path / "legacy.h5"))
    np.testing.assert_array_equal(loaded.get_weights()[0], model.get_weights()[0])
