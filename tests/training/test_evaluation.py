"""model.evaluate and fit's validation of finite datasets under ParameterServerStrategy (session cluster)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_psx

pytestmark = pytest.mark.cluster

ROWS = 150  # 9 full batches of 16 and one of 6: every row counts once, the short batch too
BATCH = 16


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 40, size=(ROWS, 2)).astype(np.int64)
    labels = (rng.random(ROWS) < 0.4).astype(np.float32)
    return ids, labels


def _model():
    inputs = tf.keras.Input((2,), dtype=tf.int64)
    vectors = tf_psx.layers.ShardedEmbedding(40, 4, name="emb")(inputs)
    out = tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Flatten()(vectors))
    return tf.keras.Model(inputs, out)


def _compiled(strategy=None):
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        model = _model()
        model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy",
                      metrics=[tf.keras.metrics.BinaryAccuracy(name="acc"), tf.keras.metrics.AUC(name="auc")])
    return model


def _evaluates_like_one_process(remote, local, dataset, rel=None) -> dict:
    """Random weights in `remote`, copied to the one-process `local`; both evaluate `dataset` alike (1e-5, or `rel`)."""
    rng = np.random.default_rng(3)
    remote.set_weights([rng.normal(size=w.shape).astype(np.float32) for w in tf_psx.unsharded_weights(remote)])
    local.set_weights(tf_psx.unsharded_weights(remote))
    got = remote.evaluate(dataset, verbose=0, return_dict=True)
    want = local.evaluate(dataset, verbose=0, return_dict=True)
    assert set(got) == set(want) and all(isinstance(v, float) for v in got.values()), (got, want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=rel, abs=1e-5), (key, got, want)
    return want


def _same_weights(remote):
    local = _compiled()
    local.set_weights(tf_psx.unsharded_weights(remote))
    return local


def test_evaluate_of_a_finite_dataset_equals_one_process(ps_strategy):
    # tf-keras alone: CancelledError "The corresponding function is cancelled".
    remote = _compiled(ps_strategy)
    ids, labels = _data()
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH)
    want = _evaluates_like_one_process(remote, _compiled(), dataset)
    assert set(want) == {"loss", "acc", "auc"}, want
    # The list form.
    listed = remote.evaluate(dataset, verbose=0)
    assert listed == pytest.approx([want["loss"], want["acc"], want["auc"]], abs=1e-5)


def test_fit_validates_on_a_finite_dataset_each_epoch(ps_strategy):
    remote = _compiled(ps_strategy)
    ids, labels = _data()
    validation = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH)

    def train(_ctx):
        return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH)

    history = remote.fit(tf.keras.utils.experimental.DatasetCreator(train), epochs=2, steps_per_epoch=5,
                         validation_data=validation, verbose=0)
    assert len(history.history["val_loss"]) == 2 and all(isinstance(v, float) for v in history.history["val_loss"])
    # The last validation saw the final weights: it equals a one-process evaluate of them.
    want = _same_weights(remote).evaluate(validation, verbose=0, return_dict=True)
    assert history.history["val_loss"][-1] == pytest.approx(want["loss"], abs=1e-5)
    assert history.history["val_auc"][-1] == pytest.approx(want["auc"], abs=1e-5)


def test_evaluate_with_steps_is_left_to_tf_keras(ps_strategy):
    remote = _compiled(ps_strategy)
    ids, labels = _data()
    repeated = tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH)
    logs = remote.evaluate(repeated, steps=3, verbose=0, return_dict=True)
    assert remote._pss_evaluation_shards == 0  # pylint: disable=protected-access
    assert np.isfinite(logs["loss"])


def test_an_infinite_dataset_without_steps_is_an_error_not_a_hang(ps_strategy):
    remote = _compiled(ps_strategy)
    ids, labels = _data()
    repeated = tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH)
    with pytest.raises(ValueError, match=r"model\.evaluate got an infinite dataset and no `steps`: it would never "
                                         r"end\. Received: steps=None\. Fix: pass steps=N"):
        remote.evaluate(repeated, verbose=0)
    # The printed fix works.
    assert np.isfinite(remote.evaluate(repeated, steps=3, verbose=0)).all()


class _OwnTestStep(tf.keras.Model):
    def test_step(self, data):  # counts its calls in a metric of its own: the result says how many batches ran
        result = super().test_step(data)
        self.batches.update_state(1.0)
        return dict(result, batches=self.batches.result())

    def build_counter(self):
        self.batches = tf.keras.metrics.Sum(name="batches")


def _own_test_step_model(strategy=None):
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        inputs = tf.keras.Input((2,), dtype=tf.int64)
        out = tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(tf.keras.layers.Embedding(
            40, 4, embeddings_regularizer="l2")(inputs)))
        model = _OwnTestStep(inputs, out)
        model.build_counter()
        model.compile("adagrad", "mse")
    return model


def test_a_custom_test_step_and_a_regularizer_evaluate_like_one_process(ps_strategy):
    # The coordinator feeds tf-keras's own test function: a custom test_step and the regularization term
    # count as without a strategy (exact evaluation's shard function left both out, so they were refused).
    remote, local = _own_test_step_model(ps_strategy), _own_test_step_model()
    ids, labels = _data()
    finite = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH)
    want = _evaluates_like_one_process(remote, local, finite)
    assert want["batches"] == 10.0  # every batch once: 9 of 16 and 1 of 6
    # With steps it reads the first `steps` batches, as without a strategy.
    repeated = tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH)
    assert remote.evaluate(repeated, steps=2, verbose=0, return_dict=True)["batches"] == 2.0


def test_after_exact_evaluation_steps_and_a_recompile_work(ps_strategy):
    remote = _compiled(ps_strategy)
    ids, labels = _data()
    finite = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH)
    remote.evaluate(finite, verbose=0)
    # tf-keras left its shard function in test_function: a steps= evaluate then failed with a TypeError.
    repeated = tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH)
    assert np.isfinite(remote.evaluate(repeated, steps=2, verbose=0, return_dict=True)["loss"])
    # A recompiled model is evaluated with its new loss (the cached shard function had the old one).
    with ps_strategy.scope():
        remote.compile(tf.keras.optimizers.Adagrad(0.1), "mse")
    got = remote.evaluate(finite, verbose=0, return_dict=True)
    local = _same_weights(remote)
    local.compile(tf.keras.optimizers.Adagrad(0.1), "mse")
    assert set(got) == {"loss"}
    assert got["loss"] == pytest.approx(local.evaluate(finite, verbose=0), abs=1e-5)


def test_validation_logs_reach_callbacks_as_numbers(ps_strategy, tmp_path):
    remote = _compiled(ps_strategy)
    ids, labels = _data()

    def train(_ctx):
        return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH)

    path = tmp_path / "log.csv"
    remote.fit(tf.keras.utils.experimental.DatasetCreator(train), epochs=2, steps_per_epoch=3, verbose=0,
               validation_data=tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH),
               callbacks=[tf.keras.callbacks.CSVLogger(str(path))])  # it failed on tensors
    rows = path.read_text().strip().splitlines()
    assert len(rows) == 3 and "val_loss" in rows[0]
    assert all(np.isfinite(float(value)) for value in rows[-1].split(","))


def _doubled_error(y_true, y_pred):  # a metric function tf-keras cannot look up by name
    return 2.0 * tf.reduce_mean(tf.abs(y_true - y_pred), axis=-1)


def _two_outputs(strategy=None):
    scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
    with scope:
        inputs = tf.keras.Input((2,), dtype=tf.int64)
        flat = tf.keras.layers.Flatten()(tf_psx.layers.ShardedEmbedding(40, 4)(inputs))
        click = tf.keras.layers.Dense(1, activation="sigmoid", name="click")(flat)
        value = tf.keras.layers.Dense(1, name="value")(flat)
        model = tf.keras.Model(inputs, {"click": click, "value": value})
        # A lambda loss and loss_weights: tf-keras rebuilt the worker's loss from its config, which failed
        # on the lambda ("Unknown loss function") and dropped the weights.
        model.compile("adagrad", loss={"click": "binary_crossentropy", "value": lambda y, p: tf.square(y - p)},
                      loss_weights={"click": 1.0, "value": 3.0}, metrics={"value": [_doubled_error]})
    return model


def test_a_weighted_multi_output_model_with_own_functions_evaluates_like_one_process(ps_strategy):
    ids, labels = _data()
    targets = {"click": labels, "value": np.random.default_rng(7).normal(size=ROWS).astype(np.float32)}
    dataset = tf.data.Dataset.from_tensor_slices((ids, targets)).batch(BATCH)
    _evaluates_like_one_process(_two_outputs(ps_strategy), _two_outputs(), dataset, rel=1e-5)


def test_a_dataset_of_fewer_batches_than_shards_is_evaluated(ps_strategy):
    # Exact evaluation cuts 5 shards per worker; TF's AUTO sharding failed on 2 batches
    # ("Could not apply FILE based sharding: the dataset only has 1 file(s)").
    remote = _compiled(ps_strategy)
    ids, labels = _data()
    small = tf.data.Dataset.from_tensor_slices((ids[:20], labels[:20])).batch(BATCH)
    got = remote.evaluate(small, verbose=0, return_dict=True)
    want = _same_weights(remote).evaluate(small, verbose=0, return_dict=True)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-5), (key, got, want)


def test_metrics_named_in_compile_are_built_under_the_strategy(ps_strategy):
    # "AUC" is built by tf_psx before the first step. Outside the strategy's scope it got 4 plain variables,
    # while its copies in the shard function got the partitioner's 2 shards each: "Expected 4 variables in
    # result for metric auc, but found 8".
    def build(strategy=None):
        scope = strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()
        with scope:
            model = _model()
            model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy", metrics=["AUC"])
        return model

    ids, labels = _data()
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH)
    assert len(_evaluates_like_one_process(build(ps_strategy), build(), dataset)) == 2
