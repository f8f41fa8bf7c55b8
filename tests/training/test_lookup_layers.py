"""Keras lookup layers under ParameterServerStrategy (session cluster).

A StringLookup made in the strategy's scope is a per-worker table. Its
handle was captured into the loop body of exact evaluation, and the step
failed on the worker with "You must feed a value for placeholder tensor
'.../string_lookup/None_Lookup/Placeholder' with dtype resource"
(tf_psx._tf.lookup_layers). Training with steps_per_execution > 1, also a
loop, is checked against one process as well.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_psx

pytestmark = pytest.mark.cluster

VOCABULARY = ["ads", "books", "cars", "dogs", "eggs"]
ROWS = 96
BATCH = 16


def _data():
    rng = np.random.default_rng(2)
    words = rng.choice(VOCABULARY + ["unknown"], size=(ROWS, 2))
    labels = (words[:, 0] == "cars").astype(np.float32)
    return words, labels


def _model(strategy=None, steps_per_execution: int = 1):
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        inputs = tf.keras.Input((2,), dtype=tf.string)
        ids = tf.keras.layers.StringLookup(vocabulary=VOCABULARY)(inputs)
        vectors = tf.keras.layers.Embedding(len(VOCABULARY) + 1, 4, embeddings_initializer="ones")(ids)
        out = tf.keras.layers.Dense(1, activation="sigmoid", kernel_initializer="ones")(tf.keras.layers.Flatten()(vectors))
        model = tf.keras.Model(inputs, out)
        model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy",
                      metrics=[tf.keras.metrics.AUC(name="auc")], steps_per_execution=steps_per_execution)
    return model


def test_a_lookup_model_is_evaluated_exactly(ps_strategy):
    words, labels = _data()
    dataset = tf.data.Dataset.from_tensor_slices((words, labels)).batch(BATCH)
    remote = _model(ps_strategy)
    got = remote.evaluate(dataset, verbose=0, return_dict=True)
    want = _model().evaluate(dataset, verbose=0, return_dict=True)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-5), (key, got, want)


def test_a_lookup_model_trains_with_steps_per_execution_like_one_process(ps_strategy):
    words, labels = _data()

    def dataset_fn(_context=None):
        return tf.data.Dataset.from_tensor_slices((words, labels)).batch(BATCH).repeat()

    remote = _model(ps_strategy, steps_per_execution=3)
    remote.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=6, verbose=0)
    local = _model(steps_per_execution=3)
    local.fit(dataset_fn(), epochs=1, steps_per_epoch=6, verbose=0)
    assert int(remote.optimizer.iterations.numpy()) == 6
    # One worker runs the steps in order on the same batches: the same weights.
    for got, want in zip(tf_psx.unsharded_weights(remote), local.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-5)
