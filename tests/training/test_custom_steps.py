"""A model's own `train_step` / `test_step` under the strategy, as it runs with no strategy.

What TensorFlow Recommenders' models do, in plain tf-keras: Python control
flow on tensors in the step (AutoGraph must convert the user's step on every
TF version, TF 2.21's rule for tf_keras notwithstanding), and a loss object of
default reduction called inside the step (tf-keras refuses that under any
strategy; each worker's step is one replica). Session cluster: 1 worker, so
the steps apply in order and the trained weights equal a one-process run
with the same batches (the closed form of this test).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_psx

pytestmark = pytest.mark.cluster

ROWS = 40
DIM = 4
BATCH = 16
STEPS = 6


class ClippedStep(tf.keras.Model):
    """A model whose train_step branches in Python on a tensor and calls a default-reduction loss object."""

    def __init__(self):
        super().__init__()
        self.embedding = tf.keras.layers.Embedding(ROWS, DIM, embeddings_initializer="ones")
        self.dense = tf.keras.layers.Dense(1, kernel_initializer="ones")
        self.loss_object = tf.keras.losses.MeanSquaredError()  # default reduction (AUTO)
        self.loss_tracker = tf.keras.metrics.Mean(name="loss")

    def call(self, ids):
        return self.dense(tf.reduce_sum(self.embedding(ids), axis=1))

    def train_step(self, data):
        ids, labels = data
        with tf.GradientTape() as tape:
            loss = self.loss_object(labels, self(ids, training=True))
            if loss > 100.0:  # Python `if` on a tensor: needs AutoGraph's conversion of this step
                loss = loss / 100.0
        self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    def test_step(self, data):
        ids, labels = data
        loss = self.loss_object(labels, self(ids, training=False))
        for _ in tf.range(2):  # a Python loop over a tensor range: converted, or it fails
            loss = loss + 0.0
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    @property
    def metrics(self):
        return [self.loss_tracker]


def _data():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, ROWS, (BATCH * STEPS, 3))
    labels = rng.normal(size=(BATCH * STEPS, 1)).astype("float32") * 30.0
    return ids, labels


def _trained(strategy, steps_per_execution, run_eagerly=False):
    ids, labels = _data()
    with strategy.scope():
        model = ClippedStep()
        model.compile(tf.keras.optimizers.SGD(0.01), steps_per_execution=steps_per_execution, run_eagerly=run_eagerly)
    history = model.fit(ids, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    evaluated = model.evaluate(ids, labels, batch_size=BATCH, verbose=0)
    return model, history.history["loss"][-1], evaluated


@pytest.mark.smoke
@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_custom_step_with_python_control_flow_and_default_loss_matches_one_process(ps_strategy, steps_per_execution):
    # The reference runs eagerly: on TF 2.21 + tf-keras 2.21 a traced fit of this model fails even with no
    # strategy (tf-keras's run_step is left unconverted, and the user's step with it; tf_psx._tf.versions).
    local, local_loss, local_eval = _trained(tf.distribute.get_strategy(), steps_per_execution, run_eagerly=True)
    distributed, loss, evaluated = _trained(ps_strategy, steps_per_execution)
    # The branch fired (the planted labels make the first losses > 100), so the conversion ran.
    assert local_loss < 100.0
    for mine, theirs in zip(tf_psx.unsharded_weights(distributed), local.get_weights()):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, local_loss, rtol=1e-5)
    np.testing.assert_allclose(evaluated, local_eval, rtol=1e-5)


@pytest.mark.unit
def test_default_reduction_loss_is_still_refused_under_other_strategies():
    # tf_psx lifts tf-keras's guard for its own parameter-server strategy only; other strategies keep it.
    loss = tf.keras.losses.MeanSquaredError()
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope(), pytest.raises(ValueError, match="Reduction.SUM"):
        loss(tf.ones((2, 1)), tf.zeros((2, 1)))
