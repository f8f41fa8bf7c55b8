"""Sparse-aware optimizers: exact maths against numpy and against their stock twins.

The numpy references below are written from the update rules in the
docstrings of tf_psx.optimizers (rows are unique: tf-keras sums duplicates
before update_step, see test_duplicate_rows_are_summed).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx.optimizers import SGD, LazyAdam

pytestmark = pytest.mark.unit


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


def test_lazy_adam_round_trips_through_config():
    opt = LazyAdam(0.02, beta_1=0.8)
    again = LazyAdam.from_config(opt.get_config())
    assert isinstance(again, LazyAdam) and again.beta_1 == pytest.approx(0.8)
    assert tf_psx.optimizers.LazyAdam is LazyAdam


def test_lazy_adam_config_round_trips_every_argument():
    opt = LazyAdam(0.02, 0.8, 0.9, 1e-5, True, True, 0.01, None, 0.5, None, True, 0.9, 3, False, "custom")
    again = LazyAdam.from_config(opt.get_config())
    assert again.get_config() == opt.get_config()
    assert again.amsgrad and again.adaptive_epsilon and again.weight_decay == pytest.approx(0.01)


# --- Reference implementations (numpy, float64) -----------------------------


class _LazyAdamReference:
    """The rule of LazyAdam's docstring, step by step, on unique rows."""

    def __init__(
        self, init, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7, *, amsgrad=False, adaptive_epsilon=False,
        weight_decay=None,
    ):
        self.var = np.array(init, np.float64)
        self.m, self.v, self.vhat = (np.zeros_like(self.var) for _ in range(3))
        self.lr, self.b1, self.b2, self.eps = lr, beta_1, beta_2, epsilon
        self.amsgrad, self.adaptive_epsilon, self.weight_decay = amsgrad, adaptive_epsilon, weight_decay
        self.t = 0

    def step(self, rows, grad):
        self.t += 1
        rows, grad = np.asarray(rows), np.asarray(grad, np.float64)
        if self.weight_decay:
            self.var[rows] -= self.lr * self.weight_decay * self.var[rows]
        self.m[rows] = self.b1 * self.m[rows] + (1 - self.b1) * grad
        self.v[rows] = self.b2 * self.v[rows] + (1 - self.b2) * grad**2
        v = self.v[rows]
        if self.amsgrad:
            self.vhat[rows] = np.maximum(self.vhat[rows], self.v[rows])
            v = self.vhat[rows]
        eps = self.eps * np.sqrt(1 - self.b2**self.t) if self.adaptive_epsilon else self.eps
        alpha = self.lr * np.sqrt(1 - self.b2**self.t) / (1 - self.b1**self.t)
        self.var[rows] -= alpha * self.m[rows] / (np.sqrt(v) + eps)


class _LazySGDReference:
    """The rule of SGD's docstring, step by step, on unique rows."""

    def __init__(self, init, lr, momentum=0.0, *, nesterov=False, weight_decay=None):
        self.var = np.array(init, np.float64)
        self.m = np.zeros_like(self.var)
        self.lr, self.momentum, self.nesterov, self.weight_decay = lr, momentum, nesterov, weight_decay

    def step(self, rows, grad):
        rows, grad = np.asarray(rows), np.asarray(grad, np.float64)
        if self.weight_decay:
            self.var[rows] -= self.lr * self.weight_decay * self.var[rows]
        self.m[rows] = self.momentum * self.m[rows] - self.lr * grad
        self.var[rows] += self.momentum * self.m[rows] - self.lr * grad if self.nesterov else self.m[rows]


def _run(opt, init, steps):
    """Applies sparse steps [(rows, values), ...] to a variable built from `init`; returns it."""
    var = tf.Variable(np.asarray(init, np.float32))
    for rows, values in steps:
        opt.apply_gradients([(_sparse(rows, values, list(var.shape)), var)])
    return var


_INIT = np.array([[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25], [2.0, 1.0]], np.float32)
# Steps touching different rows, row 3 never, so laziness shows.
_STEPS = [([0, 2], [[1.0, -2.0], [0.5, 0.3]]), ([1], [[-3.0, 0.1]]), ([2, 0], [[0.2, -0.4], [0.01, 0.5]])]


# --- Signatures: a drop-in takes what tf-keras takes -------------------------

# jit_compile defaults to False on purpose (see tf_psx.optimizers._JIT_COMPILE_DEFAULT);
# name defaults to the class's own name.
_OWN_DEFAULTS = {"jit_compile", "name"}


@pytest.mark.parametrize(
    "ours, stock, own_name",
    [(LazyAdam, tf.keras.optimizers.Adam, "LazyAdam"), (SGD, tf.keras.optimizers.SGD, "SGD")],
    ids=["LazyAdam", "SGD"],
)
def test_signature_is_tf_keras(ours, stock, own_name):
    theirs = inspect.signature(stock.__init__).parameters
    mine = inspect.signature(ours.__init__).parameters
    assert list(mine) == list(theirs)  # names and order
    assert [p.kind for p in mine.values()] == [p.kind for p in theirs.values()]
    for name, parameter in theirs.items():
        if name not in _OWN_DEFAULTS:
            assert mine[name].default == parameter.default, name
    assert mine["jit_compile"].default is False and theirs["jit_compile"].default is True
    assert mine["name"].default == own_name


@pytest.mark.parametrize("cls", [LazyAdam, SGD])
def test_jit_compile_defaults_off(cls):
    assert cls().jit_compile is False and cls().get_config()["jit_compile"] is False


_POSITIONAL = {
    # Every argument positionally, none at its default. jit_compile=True: tf-keras keeps it
    # only where a GPU is present, for ours as for the stock class.
    # learning_rate, beta_1, beta_2, epsilon, adaptive_epsilon, amsgrad, weight_decay, clipnorm,
    # clipvalue, global_clipnorm, use_ema, ema_momentum, ema_overwrite_frequency, jit_compile, name
    "LazyAdam": (LazyAdam, "Adam", (0.02, 0.8, 0.95, 1e-5, True, True, 0.01, 0.5, 0.25, None, True, 0.9, 3, True, "o")),
    # learning_rate, momentum, nesterov, weight_decay, clipnorm, clipvalue, global_clipnorm,
    # use_ema, ema_momentum, ema_overwrite_frequency, jit_compile, name
    "SGD": (SGD, "SGD", (0.02, 0.5, True, 0.01, None, 0.25, 0.5, True, 0.9, 3, True, "o")),
}


@pytest.mark.parametrize("which", sorted(_POSITIONAL))
def test_positional_arguments_land_where_tf_keras_puts_them(which):
    cls, stock, args = _POSITIONAL[which]
    ours, theirs = cls(*args), getattr(tf.keras.optimizers, stock)(*args)
    want = theirs.get_config()
    assert {key: ours.get_config()[key] for key in want} == want
    # tf-keras's Adam.get_config leaves adaptive_epsilon out; compare the attribute.
    assert getattr(ours, "adaptive_epsilon", None) == getattr(theirs, "adaptive_epsilon", None)


def test_lazy_adam_sparse_update_runs_under_xla():
    # What jit_compile=True does on a GPU; forced here so that a CPU runs the XLA path too.
    # The row count changes between steps (2, 1, 2), as it does for embeddings.
    opt = LazyAdam(0.1, amsgrad=True, weight_decay=0.1)
    opt.jit_compile = True
    compiled = opt._update_step_xla  # pylint: disable=protected-access
    calls = []

    def counted(*args):
        calls.append(args)
        return compiled(*args)

    opt._update_step_xla = counted  # pylint: disable=protected-access
    ref = _LazyAdamReference(_INIT, 0.1, amsgrad=True, weight_decay=0.1)
    for rows, values in _STEPS:
        ref.step(rows, values)
    np.testing.assert_allclose(_run(opt, _INIT, _STEPS).numpy(), ref.var, rtol=1e-5, atol=1e-6)
    assert len(calls) == len(_STEPS)  # each step went through the XLA entry point


@pytest.mark.parametrize("cls, stock", [(LazyAdam, "Adam"), (SGD, "SGD")])
def test_unknown_keyword_is_refused_by_name_with_the_fix(cls, stock):
    with pytest.raises(TypeError, match=rf"Argument `betta_1` is not an argument of {cls.__name__} "
                       rf"\(nor of tf.keras.optimizers.{stock}\)\. Received: betta_1=0\.5\. "
                       r"Fix: remove it, or use one of: learning_rate, "):
        cls(betta_1=0.5)


@pytest.mark.parametrize("cls", [LazyAdam, SGD])
def test_legacy_decay_is_refused_with_the_schedule_to_use(cls):
    with pytest.raises(ValueError, match=r"Argument `decay` of .* Received: decay=0\.01\. Fix: use a learning-rate "
                       r"schedule, e.g\. learning_rate=tf.keras.optimizers.schedules.InverseTimeDecay"):
        cls(decay=0.01)


@pytest.mark.parametrize("cls, stock", [(LazyAdam, "Adam"), (SGD, "SGD")])
def test_keywords_tf_keras_also_takes_pass_through(cls, stock):
    # get_config() writes is_legacy_optimizer; tf-keras takes it back.
    assert cls(is_legacy_optimizer=False).get_config()["is_legacy_optimizer"] is False
    # tf-keras 2.16 warns about the deprecated `lr` and ignores it; so do we, for the same code.
    theirs = getattr(tf.keras.optimizers, stock)(lr=0.5)
    assert float(cls(lr=0.5).learning_rate) == float(theirs.learning_rate) != 0.5


# --- Clipping: tf-keras clips before update_step, sparse gradients included ----

# One sparse gradient over rows 0 and 2 of `_INIT`, values [[3, 4], [0, -12]]:
# its norm is sqrt(9 + 16 + 144) = 13.
_CLIP_ROWS, _CLIP_VALUES = [0, 2], [[3.0, 4.0], [0.0, -12.0]]
_CLIPPED = {
    # clipnorm=6.5: scaled by 6.5 / 13 = 0.5.
    "clipnorm": (6.5, [[1.5, 2.0], [0.0, -6.0]]),
    # clipvalue=3.5: each value into [-3.5, 3.5].
    "clipvalue": (3.5, [[3.0, 3.5], [0.0, -3.5]]),
    # global_clipnorm=2.6: this is the only gradient, so scaled by 2.6 / 13 = 0.2.
    "global_clipnorm": (2.6, [[0.6, 0.8], [0.0, -2.4]]),
}


@pytest.mark.parametrize("kind", sorted(_CLIPPED))
def test_clipping_applies_to_sparse_gradients(kind):
    limit, clipped = _CLIPPED[kind]
    steps = [(_CLIP_ROWS, _CLIP_VALUES), ([1, 2], [[-1.0, 0.0], [0.5, 2.0]])]
    # Step 2 has norm sqrt(1 + 0.25 + 4) = 2.29 < 2.6 and values within 3.5: every limit leaves it as is.
    ref_steps = [(_CLIP_ROWS, clipped), steps[1]]
    lazy = LazyAdam(0.1, beta_2=0.9, **{kind: limit})
    var = _run(lazy, _INIT, steps)
    ref = _LazyAdamReference(_INIT, 0.1, beta_2=0.9)
    for rows, values in ref_steps:
        ref.step(rows, values)
    np.testing.assert_allclose(var.numpy(), ref.var, rtol=1e-5, atol=1e-6)
    m = lazy._momentums[0].numpy()  # pylint: disable=protected-access
    np.testing.assert_allclose(m, ref.m, rtol=1e-5, atol=1e-7)
    # SGD without momentum shows the clipped gradient directly: var[rows] -= lr * clipped.
    sgd_var = _run(SGD(1.0, **{kind: limit}), _INIT, steps[:1])
    want = _INIT.copy()
    want[_CLIP_ROWS] -= np.array(clipped, np.float32)
    np.testing.assert_allclose(sgd_var.numpy(), want, rtol=1e-6)


def test_global_clipnorm_spans_sparse_and_dense_gradients():
    # Sparse [[3, 0]] on table row 1 and dense [0, 4] on a bias: global norm 5,
    # global_clipnorm=1 scales both by 1/5. SGD(lr=1): table row 1 -= [0.6, 0], bias -= [0, 0.8].
    table, bias = tf.Variable(np.zeros((3, 2), np.float32)), tf.Variable(np.zeros(2, np.float32))
    SGD(1.0, global_clipnorm=1.0).apply_gradients(
        [(_sparse([1], [[3.0, 0.0]], [3, 2]), table), (tf.constant([0.0, 4.0]), bias)]
    )
    np.testing.assert_allclose(table.numpy(), [[0, 0], [-0.6, 0], [0, 0]], rtol=1e-6)
    np.testing.assert_allclose(bias.numpy(), [0.0, -0.8], rtol=1e-6)


@pytest.mark.parametrize("cls", [SGD, tf.keras.optimizers.SGD], ids=["ours", "stock"])
def test_clipvalue_bounds_each_occurrence_before_duplicates_are_summed(cls):
    # The limitation in LazyAdam's docstring, as tf-keras does it: row 1 is looked up twice
    # with gradient 5; each occurrence is clipped to 1, then summed: SGD(lr=1) moves it by 2.
    var = _run(cls(1.0, clipvalue=1.0), np.zeros((2, 1)), [([1, 1], [[5.0], [5.0]])])
    np.testing.assert_allclose(var.numpy().ravel(), [0.0, -2.0])


# --- Weight decay: only the touched rows of a sparse gradient -----------------


@pytest.mark.parametrize(
    "make, make_ref",
    [
        (lambda: LazyAdam(0.1, weight_decay=0.2), lambda: _LazyAdamReference(_INIT, 0.1, weight_decay=0.2)),
        (lambda: SGD(0.1, weight_decay=0.2), lambda: _LazySGDReference(_INIT, 0.1, weight_decay=0.2)),
        (
            lambda: SGD(0.1, momentum=0.5, weight_decay=0.2),
            lambda: _LazySGDReference(_INIT, 0.1, momentum=0.5, weight_decay=0.2),
        ),
    ],
    ids=["LazyAdam", "SGD", "SGD-momentum"],
)
def test_weight_decay_touches_only_rows_in_the_batch(make, make_ref):
    var = _run(make(), _INIT, _STEPS)
    ref = make_ref()
    for rows, values in _STEPS:
        ref.step(rows, values)
    np.testing.assert_allclose(var.numpy(), ref.var, rtol=1e-5, atol=1e-6)
    # Row 3 is never touched: not decayed (stock decays it by (1 - 0.1 * 0.2) per step).
    np.testing.assert_array_equal(var.numpy()[3], _INIT[3])


def test_weight_decay_first_step_by_hand():
    # SGD(lr=0.5, weight_decay=0.1), sparse gradient [[1, 1]] on row 1 of [[1, 1], [2, 4], [3, 3]]:
    # row 1 decays to [2, 4] - 0.5 * 0.1 * [2, 4] = [1.9, 3.8], then -= 0.5 * [1, 1] -> [1.4, 3.3].
    # Stock tf-keras SGD also decays rows 0 and 2 by 5 %.
    init = np.array([[1, 1], [2, 4], [3, 3]], np.float32)
    ours = _run(SGD(0.5, weight_decay=0.1), init, [([1], [[1.0, 1.0]])])
    np.testing.assert_allclose(ours.numpy(), [[1, 1], [1.4, 3.3], [3, 3]], rtol=1e-6)
    stock = _run(tf.keras.optimizers.SGD(0.5, weight_decay=0.1), init, [([1], [[1.0, 1.0]])])
    np.testing.assert_allclose(stock.numpy(), [[0.95, 0.95], [1.4, 3.3], [2.85, 2.85]], rtol=1e-6)


@pytest.mark.parametrize(
    "ours, stock",
    [
        (lambda: LazyAdam(0.1, weight_decay=0.3), lambda: tf.keras.optimizers.Adam(0.1, weight_decay=0.3)),
        (lambda: SGD(0.1, 0.9, weight_decay=0.3), lambda: tf.keras.optimizers.SGD(0.1, 0.9, weight_decay=0.3)),
    ],
    ids=["LazyAdam", "SGD"],
)
def test_weight_decay_on_dense_gradients_is_stock(ours, stock):
    a, b = tf.Variable(_INIT), tf.Variable(_INIT)
    ours, stock = ours(), stock()
    for scale in (1.0, -0.5):
        grad = tf.constant(_INIT * scale + 0.25)
        ours.apply_gradients([(grad, a)])
        stock.apply_gradients([(grad, b)])
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


def test_exclude_from_weight_decay_is_honoured():
    decayed = tf.Variable(np.ones((2, 1), np.float32), name="table")
    kept = tf.Variable(np.ones((2, 1), np.float32), name="bias")
    opt = SGD(0.5, weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    grad = _sparse([0], [[0.0]], [2, 1])  # a zero gradient: only the decay moves row 0
    opt.apply_gradients([(grad, decayed), (grad, kept)])
    np.testing.assert_allclose(decayed.numpy().ravel(), [0.95, 1.0], rtol=1e-6)  # 1 - 0.5 * 0.1
    np.testing.assert_array_equal(kept.numpy().ravel(), [1.0, 1.0])


# --- AMSGrad, lazily ----------------------------------------------------------


def test_amsgrad_keeps_the_max_of_v_on_touched_rows_by_hand():
    # lr=0.1, beta_1=beta_2=0.5, eps=0. Row 0 gets g=2 then g=0:
    #   step 1: m = 1, v = 0.5 * 4 = 2, vhat = 2; alpha = 0.1 * sqrt(0.5) / 0.5; var -= alpha * 1 / sqrt(2) = 0.1
    #   step 2: m = 0.5, v = 1, vhat = max(2, 1) = 2; alpha = 0.1 * sqrt(0.75) / 0.75;
    #           var -= alpha * 0.5 / sqrt(2) = 0.0408248 (without AMSGrad: alpha * 0.5 / 1 = 0.0577350).
    opt = LazyAdam(0.1, beta_1=0.5, beta_2=0.5, epsilon=0.0, amsgrad=True)
    var = _run(opt, np.zeros((3, 1)), [([0], [[2.0]]), ([0], [[0.0]])])
    step2 = 0.1 * np.sqrt(0.75) / 0.75 * 0.5 / np.sqrt(2)
    np.testing.assert_allclose(var.numpy().ravel(), [-0.1 - step2, 0.0, 0.0], rtol=1e-6)
    v_hat = opt._velocity_hats[0].numpy()  # pylint: disable=protected-access
    np.testing.assert_allclose(v_hat.ravel(), [2.0, 0.0, 0.0])


@pytest.mark.parametrize("adaptive_epsilon", [False, True])
def test_amsgrad_matches_numpy_over_several_steps(adaptive_epsilon):
    # epsilon=1e-2 so that adaptive_epsilon (eps * sqrt(1 - beta_2^t)) changes the result visibly.
    steps = _STEPS + [([0], [[0.0, 0.0]]), ([2, 1], [[-0.1, 0.1], [0.0, -0.2]])]
    kwargs = dict(beta_1=0.8, beta_2=0.6, epsilon=1e-2, adaptive_epsilon=adaptive_epsilon)
    opt = LazyAdam(0.05, amsgrad=True, **kwargs)
    var = _run(opt, _INIT, steps)
    ref = _LazyAdamReference(_INIT, 0.05, amsgrad=True, **kwargs)
    for rows, values in steps:
        ref.step(rows, values)
    np.testing.assert_allclose(var.numpy(), ref.var, rtol=1e-5, atol=1e-6)
    v_hat = opt._velocity_hats[0].numpy()  # pylint: disable=protected-access
    np.testing.assert_allclose(v_hat, ref.vhat, rtol=1e-5, atol=1e-7)
    assert not np.allclose(ref.vhat, ref.v)  # the max was taken somewhere


def test_amsgrad_equals_stock_when_every_row_is_touched():
    rng = np.random.default_rng(1)
    lazy_var, adam_var = tf.Variable(_INIT), tf.Variable(_INIT)
    lazy, adam = LazyAdam(0.05, amsgrad=True), tf.keras.optimizers.Adam(0.05, amsgrad=True)
    for _ in range(5):
        values = (rng.normal(size=_INIT.shape) * rng.choice([0.1, 3.0])).astype(np.float32)
        lazy.apply_gradients([(_sparse([2, 0, 3, 1], values[[2, 0, 3, 1]], list(_INIT.shape)), lazy_var)])
        adam.apply_gradients([(tf.constant(values), adam_var)])
    np.testing.assert_allclose(lazy_var.numpy(), adam_var.numpy(), rtol=1e-5, atol=1e-6)


# --- EMA: tf-keras's, on top of the lazy update ------------------------------


@pytest.mark.parametrize(
    "make, make_ref",
    [
        (lambda **kw: LazyAdam(0.1, **kw), lambda: _LazyAdamReference(_INIT, 0.1)),
        (lambda **kw: SGD(0.1, **kw), lambda: _LazySGDReference(_INIT, 0.1)),
    ],
    ids=["LazyAdam", "SGD"],
)
def test_use_ema_averages_and_overwrites_as_tf_keras(make, make_ref):
    # After each step: average = 0.5 * average + 0.5 * var (over the whole variable);
    # on steps 2 and 4 (ema_overwrite_frequency=2) var is overwritten by the average.
    # After step 5 they differ until finalize_variable_values() overwrites var by the average.
    opt = make(use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2)
    steps = _STEPS + [([3], [[1.0, 1.0]]), ([1, 3], [[0.5, -0.5], [2.0, 0.0]])]
    var = _run(opt, _INIT, steps)
    ref, average = make_ref(), _INIT.astype(np.float64)
    for t, (rows, values) in enumerate(steps, start=1):
        ref.step(rows, values)
        average = 0.5 * average + 0.5 * ref.var
        if t % 2 == 0:
            ref.var = average.copy()
    np.testing.assert_allclose(var.numpy(), ref.var, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ref.var, average)
    opt.finalize_variable_values([var])
    np.testing.assert_allclose(var.numpy(), average, rtol=1e-5, atol=1e-6)


# --- SGD with Nesterov momentum, lazily --------------------------------------


def test_sgd_nesterov_is_lazy_and_matches_numpy():
    opt = SGD(0.1, momentum=0.9, nesterov=True)
    var = _run(opt, _INIT, _STEPS)
    ref = _LazySGDReference(_INIT, 0.1, 0.9, nesterov=True)
    for rows, values in _STEPS:
        ref.step(rows, values)
    np.testing.assert_allclose(var.numpy(), ref.var, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(var.numpy()[3], _INIT[3])


def test_sgd_nesterov_equals_stock_when_every_row_is_touched():
    rng = np.random.default_rng(2)
    ours_var, stock_var = tf.Variable(_INIT), tf.Variable(_INIT)
    ours, stock = SGD(0.1, 0.9, True), tf.keras.optimizers.SGD(0.1, 0.9, True)
    for _ in range(4):
        values = rng.normal(size=_INIT.shape).astype(np.float32)
        grad = _sparse([1, 3, 0, 2], values[[1, 3, 0, 2]], list(_INIT.shape))
        ours.apply_gradients([(grad, ours_var)])
        stock.apply_gradients([(grad, stock_var)])
    np.testing.assert_allclose(ours_var.numpy(), stock_var.numpy(), rtol=1e-5, atol=1e-6)


# --- A tf-keras program, with only the class swapped -------------------------

_VOCAB, _UNUSED_ROW = 8, 7  # every sample looks up rows 0..6, never row 7


def _fit(optimizer):
    """Fits Embedding(8, 4) -> mean -> Dense(1) for 8 steps; returns the initial and final weights."""
    rng = np.random.default_rng(3)
    x = np.stack([rng.permutation(_UNUSED_ROW) for _ in range(16)]).astype(np.int32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    inputs = tf.keras.Input((_UNUSED_ROW,), dtype=tf.int32)
    hidden = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(_VOCAB, 4)(inputs))
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(hidden))
    init = [rng.normal(size=w.shape).astype(np.float32) for w in model.get_weights()]
    model.set_weights(init)
    model.compile(optimizer, "mse")
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert len(history.history["loss"]) == 2 and np.isfinite(history.history["loss"]).all()
    return init, model.get_weights()


_KERAS_PROGRAMS = {
    # (ours, stock, args, kwargs): the same call, only the class differs.
    "LazyAdam-keywords": (
        LazyAdam,
        tf.keras.optimizers.Adam,
        (),
        dict(learning_rate=0.02, beta_1=0.85, beta_2=0.99, epsilon=1e-5, amsgrad=False, weight_decay=0.01,
             global_clipnorm=0.5, use_ema=False, jit_compile=False, name="keywords"),
    ),
    # learning_rate, beta_1, beta_2, epsilon, adaptive_epsilon, amsgrad, weight_decay, clipnorm, clipvalue,
    # global_clipnorm, use_ema, ema_momentum, ema_overwrite_frequency, jit_compile, name
    "LazyAdam-positional": (
        LazyAdam,
        tf.keras.optimizers.Adam,
        (0.01, 0.8, 0.95, 1e-6, True, True, 0.05, None, 0.5, None, True, 0.9, 3, False, "positional"),
        {},
    ),
    "SGD-keywords": (
        SGD,
        tf.keras.optimizers.SGD,
        (),
        dict(learning_rate=0.1, momentum=0.0, weight_decay=0.02, clipnorm=1.0, name="keywords"),
    ),
    # learning_rate, momentum, nesterov, weight_decay, clipnorm, clipvalue, global_clipnorm, use_ema,
    # ema_momentum, ema_overwrite_frequency, jit_compile, name
    "SGD-positional": (
        SGD,
        tf.keras.optimizers.SGD,
        (0.05, 0.9, True, 0.01, None, 0.5, None, True, 0.9, 2, False, "positional"),
        {},
    ),
}


@pytest.mark.parametrize("program", sorted(_KERAS_PROGRAMS))
def test_a_tf_keras_program_runs_with_only_the_class_swapped(program):
    ours, stock, args, kwargs = _KERAS_PROGRAMS[program]
    (init, mine), (_, theirs) = _fit(ours(*args, **kwargs)), _fit(stock(*args, **kwargs))
    init_table = init[0]
    # Rows 0..6 are in every batch, where lazy and stock updates coincide; so do the Dense weights.
    np.testing.assert_allclose(mine[0][:_UNUSED_ROW], theirs[0][:_UNUSED_ROW], rtol=1e-4, atol=1e-5)
    for a, b in zip(mine[1:], theirs[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # Row 7 is never looked up: ours leaves it alone, stock weight-decays it.
    np.testing.assert_array_equal(mine[0][_UNUSED_ROW], init_table[_UNUSED_ROW])
    assert not np.allclose(theirs[0][_UNUSED_ROW], init_table[_UNUSED_ROW])


# --- Under tf_psx.ParameterServerStrategy (the session's in-process cluster) ---

_PS_ROWS, _PS_TOUCHED, _PS_BATCH, _PS_STEPS = 40, 30, 8, 6  # rows 30..39 are never looked up
_PS_OPTIMIZERS = {
    # global_clipnorm, not clipnorm: tf-keras sees one gradient per shard and
    # clipnorm clips each separately (a limitation in LazyAdam's docstring).
    "LazyAdam": lambda: LazyAdam(0.05, amsgrad=True, adaptive_epsilon=True, weight_decay=0.1, global_clipnorm=0.5),
    "SGD": lambda: SGD(0.1, 0.9, True, weight_decay=0.1, clipvalue=0.05),
}


def _ps_dataset():
    rng = np.random.default_rng(4)
    ids = rng.integers(0, _PS_TOUCHED, size=(_PS_BATCH * _PS_STEPS, 3)).astype(np.int64)
    ids[:, 1] = ids[:, 0]  # duplicate ids in every row: apply_gradients sums them
    labels = rng.integers(0, 2, size=(_PS_BATCH * _PS_STEPS, 1)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((ids, labels)).batch(_PS_BATCH)


def _ps_model():
    inputs = tf.keras.Input((3,), dtype=tf.int64)
    emb = tf.keras.layers.Embedding(_PS_ROWS, 4, name="emb")(inputs)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(emb)))


def _whole(var) -> np.ndarray:
    shards = getattr(var, "variables", [var])  # a ShardedVariable's shards, in row order
    return tf.concat(list(shards), axis=0).numpy()


@pytest.mark.cluster
@pytest.mark.parametrize("which", sorted(_PS_OPTIMIZERS))
def test_one_worker_under_the_ps_strategy_equals_no_strategy(ps_strategy, which):
    # The table is split over 2 ps (fixed:2) and each shard's update runs under
    # its lock with its own step counter (exact updates). With one worker the
    # steps run in order, so the result must equal the single-process one.
    tf.keras.utils.set_random_seed(5)
    reference = _ps_model()
    initial = reference.get_weights()
    reference.compile(_PS_OPTIMIZERS[which](), "mse")
    reference.fit(_ps_dataset(), epochs=1, verbose=0)
    with ps_strategy.scope():
        model = _ps_model()
        model.compile(_PS_OPTIMIZERS[which](), "mse")
    table = model.get_layer("emb").embeddings
    assert len(getattr(table, "variables", [])) == 2, "the table should be sharded"
    weights = [table, model.layers[-1].kernel, model.layers[-1].bias]  # whole (maybe sharded) variables
    for var, value in zip(weights, initial):
        var.assign(value)
    model.fit(
        tf.keras.utils.experimental.DatasetCreator(lambda _: _ps_dataset()),
        epochs=1, steps_per_epoch=_PS_STEPS, verbose=0,
    )
    trained = reference.get_weights()
    np.testing.assert_array_equal(trained[0][_PS_TOUCHED:], initial[0][_PS_TOUCHED:])  # lazy, decay included
    assert not np.allclose(trained[0][:_PS_TOUCHED], initial[0][:_PS_TOUCHED])
    for var, want in zip(weights, trained):
        np.testing.assert_allclose(_whole(var), want, rtol=1e-5, atol=1e-6)
