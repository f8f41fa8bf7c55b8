"""The Keras snippets users bring (ModelCheckpoint, model.save, TensorBoard) under the strategy.

Each works with ShardedEmbedding and DynamicEmbedding, or raises an error
that names the alternative (session cluster: 1 worker, 2 ps, fixed:2).
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from conftest import tfra_param

pytestmark = pytest.mark.cluster

ROWS = 100
FIELDS = 3


def _model(strategy, kind):
    with strategy.scope():
        inputs = tf.keras.Input((FIELDS,), dtype=tf.int64)
        if kind == "sharded":
            emb = tf_psx.layers.ShardedEmbedding(ROWS, 4, name="emb")
        else:
            emb = tf_psx.layers.DynamicEmbedding(4, name="emb")
        out = tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Flatten()(emb(inputs)))
        model = tf.keras.Model(inputs, out)
        model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy")
    return model


def _data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, (256, FIELDS))
    labels = (ids[:, 0] % 2).astype("float32")
    return ids, labels


def _fit(model, callbacks, epochs=2):
    ids, labels = _data()
    dataset = tf.keras.utils.experimental.DatasetCreator(
        lambda _ctx: tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(32)
    )
    return model.fit(dataset, epochs=epochs, steps_per_epoch=4, verbose=0, callbacks=callbacks)


def test_sharded_model_checkpoint_best_only_and_save_serve(ps_strategy, tmp_path):
    model = _model(ps_strategy, "sharded")
    path = str(tmp_path / "best")
    _fit(model, [tf.keras.callbacks.ModelCheckpoint(path, save_best_only=True, monitor="loss")])
    assert os.path.exists(os.path.join(path, "saved_model.pb"))
    saved = str(tmp_path / "saved")
    model.save(saved, save_format="tf")
    served = tf.saved_model.load(saved).signatures["serving_default"]
    ids = _data()[0][:16]
    got = list(served(tf.constant(ids)).values())[0].numpy()
    np.testing.assert_allclose(got, model.predict(ids, verbose=0), atol=1e-6)


@pytest.mark.parametrize("kind", ["sharded", tfra_param("dynamic")])
def test_tensorboard_histograms(ps_strategy, tmp_path, kind):
    model = _model(ps_strategy, kind)
    _fit(model, [tf.keras.callbacks.TensorBoard(str(tmp_path), histogram_freq=1)], epochs=1)
    tags = set()
    for event_file in glob.glob(str(tmp_path / "train" / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(event_file):
            tags.update(value.tag for value in event.summary.value)
    # The dense head's histograms are there whatever the embedding is.
    assert any(tag.startswith("dense") and "kernel" in tag for tag in tags), sorted(tags)
    if kind == "sharded":
        assert any("emb" in tag and "embeddings" in tag for tag in tags), sorted(tags)


@pytest.mark.tfra
def test_dynamic_model_save_names_export_serving(ps_strategy, tmp_path):
    model = _model(ps_strategy, "dynamic")
    with pytest.raises(tf_psx.DynamicEmbeddingSaveError, match=r"Fix: tf_psx\.export_serving\(model, path\)"):
        model.save(str(tmp_path / "saved"), save_format="tf")
    # ModelCheckpoint saves the whole model through Model.save: the same error, naming the alternatives.
    with pytest.raises(tf_psx.DynamicEmbeddingSaveError, match=r"ModelCheckpoint\(\.\.\., save_weights_only=True\)"):
        _fit(model, [tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "best"), save_best_only=True, monitor="loss")])
    # The alternative it names works.
    prefix = str(tmp_path / "weights" / "ckpt")
    _fit(model, [tf.keras.callbacks.ModelCheckpoint(prefix, save_best_only=True, save_weights_only=True, monitor="loss")])
    assert os.path.exists(prefix + ".index")
