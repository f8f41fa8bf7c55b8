"""Sparse-aware optimizers: exact maths against numpy and against their stock twins."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx.optimizers import SGD, LazyAdam


def _sparse(rows, values, shape):
    return tf.IndexedSlices(tf.constant(values, tf.float32), tf.constant(rows), tf.constant(shape))


def test_lazy_adam_updates_only_touched_rows_exactly():
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-7
    var = tf.Variable(np.zeros((3, 1), np.float32))
    opt = LazyAdam(lr, beta_1=b1, beta_2=b2, epsilon=eps)
    opt.apply_gradients([(_sparse([0], [[1.0]], [3, 1]), var)])   # step 1 touches row 0
    opt.apply_gradients([(_sparse([1], [[2.0]], [3, 1]), var)])   # step 2 touches row 1
    # Row 0, step 1: m = 0.1, v = 0.001; alpha = lr*sqrt(1-b2)/(1-b1) = 0.1*0.0316228/0.1;
    # update = alpha * m / (sqrt(v) + eps) = 0.1 (Adam's first step moves by lr).
    # Row 1, step 2: m = 0.2, v = 0.004; alpha = 0.1*sqrt(1-b2^2)/(1-b1^2) = 0.1*0.0447102/0.19;
    # update = alpha * 0.2 / 0.0632456 = 0.0744153.
    # Row 2 is never touched and stays 0; row 0's moments do not decay on step 2.
    want_row1 = 0.1 * np.sqrt(1 - b2**2) / (1 - b1**2) * 0.2 / (np.sqrt(0.004) + eps)
    np.testing.assert_allclose(var.numpy().ravel(), [-0.1, -want_row1, 0.0], rtol=1e-5)
    m = opt._momentums[0].numpy().ravel()  # pylint: disable=protected-access
    np.testing.assert_allclose(m, [0.1, 0.2, 0.0], rtol=1e-6)


def test_lazy_adam_equals_adam_when_every_row_is_touched():
    # When all rows are in every batch, "lazy" and dense decay coincide.
    rng = np.random.default_rng(0)
    init = rng.normal(size=(4, 3)).astype(np.float32)
    lazy_var, adam_var = tf.Variable(init), tf.Variable(init)
    lazy, adam = LazyAdam(0.05), tf.keras.optimizers.Adam(0.05)
    for _ in range(5):
        values = rng.normal(size=(4, 3)).astype(np.float32)
        lazy.apply_gradients([(_sparse([3, 1, 0, 2], values[[3, 1, 0, 2]], [4, 3]), lazy_var)])
        adam.apply_gradients([(tf.constant(values), adam_var)])
    np.testing.assert_allclose(lazy_var.numpy(), adam_var.numpy(), rtol=1e-5, atol=1e-6)


def test_lazy_adam_dense_gradients_are_plain_adam():
    init = np.ones((2, 2), np.float32)
    a, b = tf.Variable(init), tf.Variable(init)
    grad = tf.constant([[0.5, -1.0], [2.0, 0.0]])
    LazyAdam(0.01).apply_gradients([(grad, a)])
    tf.keras.optimizers.Adam(0.01).apply_gradients([(grad, b)])
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


def test_duplicate_rows_are_summed():
    var = tf.Variable(np.zeros((2, 1), np.float32))
    SGD(1.0).apply_gradients([(_sparse([1, 1], [[1.0], [2.0]], [2, 1]), var)])
    np.testing.assert_allclose(var.numpy().ravel(), [0.0, -3.0])


def test_sgd_without_momentum_keeps_no_slot_and_matches_stock():
    init = np.arange(6, dtype=np.float32).reshape(3, 2)
    ours, stock = tf.Variable(init), tf.Variable(init)
    opt = SGD(0.5)
    grad = _sparse([2], [[1.0, -1.0]], [3, 2])
    opt.apply_gradients([(grad, ours)])
    stock_opt = tf.keras.optimizers.SGD(0.5)
    stock_opt.apply_gradients([(grad, stock)])
    np.testing.assert_allclose(ours.numpy(), stock.numpy())
    assert len(opt.variables) == 1  # the iteration counter only
    assert len(stock_opt.variables) == 2  # stock keeps a table-sized momentum slot


def test_sgd_lazy_momentum():
    var = tf.Variable(np.zeros((2, 1), np.float32))
    opt = SGD(0.1, momentum=0.5)
    opt.apply_gradients([(_sparse([0], [[1.0]], [2, 1]), var)])  # m0 = -0.1, var0 = -0.1
    opt.apply_gradients([(_sparse([1], [[1.0]], [2, 1]), var)])  # m1 = -0.1; row 0 untouched
    opt.apply_gradients([(_sparse([0], [[1.0]], [2, 1]), var)])  # m0 = 0.5*-0.1 - 0.1 = -0.15
    np.testing.assert_allclose(var.numpy().ravel(), [-0.25, -0.1], rtol=1e-6)


def test_amsgrad_is_refused():
    with pytest.raises(ValueError, match=r"`amsgrad` of LazyAdam must be False\. Received: True\. Fix: use tf.keras.optimizers.Adam"):
        LazyAdam(amsgrad=True)


def test_lazy_adam_round_trips_through_config():
    opt = LazyAdam(0.02, beta_1=0.8)
    again = LazyAdam.from_config(opt.get_config())
    assert isinstance(again, LazyAdam) and again.beta_1 == pytest.approx(0.8)
    assert tf_psx.optimizers.LazyAdam is LazyAdam
