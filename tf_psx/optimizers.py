"""Optimizers whose cost per step follows the rows touched, not the table size.

Stock tf-keras `Adam` and `SGD` take far longer per step at 2M rows than at
10k rows; bench/vocab_scaling.py measures how much, and docs/benchmarks.md
(vocab_scaling) has the numbers of the latest run. Their sparse branch still
does dense work on every step: `Adam` decays the whole `m` and `v` slots and
`SGD` always keeps a momentum slot and runs `m.assign(m * momentum)` and
`variable.assign_add(m)` over the whole table, even at momentum 0. Stock
`Adagrad` is already sparse.

Which optimizer for what:

| optimizer | use it for | cost per step |
|---|---|---|
| `tf_psx.optimizers.LazyAdam` | embeddings that want Adam (most CTR models) | rows touched |
| `tf_psx.optimizers.SGD` | plain or momentum SGD on embeddings | rows touched |
| `tf.keras.optimizers.Adagrad` | the classic choice for sparse CTR features | rows touched |
| stock `Adam` / `SGD` | dense-only models | whole table, every step |

`LazyAdam` and `SGD` take the arguments of their stock twins, in the same
order with the same defaults (but `jit_compile=False`), and behave exactly
like them on dense gradients; on sparse gradients (embeddings) they update,
and weight-decay, only the rows in the batch. That is the "lazy" rule of tensorflow-addons' LazyAdam (end of life,
no build for TF 2.16): a row's moments decay only on the steps that touch it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Union

import tensorflow as tf

from tf_psx._tf import keras as _tf_keras
from tf_psx.errors import ArgumentError, ArgumentTypeError

__all__ = ["LazyAdam", "SGD", "updates_touched_rows_only"]

_keras = _tf_keras.keras()

# What tf-keras accepts for a hyperparameter such as `learning_rate`.
_Hyperparameter = Union[float, tf.Tensor, Callable[[], float]]
_LearningRate = Union[_Hyperparameter, _keras.optimizers.schedules.LearningRateSchedule]

# Sparse updates gather and scatter a different number of rows every step, so
# an XLA-compiled update would be recompiled for each new row count; tf-keras
# defaults `jit_compile` to True (and turns it off itself where no GPU exists).
_JIT_COMPILE_DEFAULT = False

# Keyword arguments tf-keras 2.16's base optimizer takes besides the named ones
# (`_BaseOptimizer._process_kwargs`, `Optimizer.__init__`): `is_legacy_optimizer`
# is written by `get_config`, `lr` is a deprecated alias that tf-keras warns
# about and ignores, `mesh` is for DTensor. They pass through unchanged so that
# these optimizers do exactly what the stock ones do with them.
_PASS_THROUGH_KWARGS = ("is_legacy_optimizer", "lr", "mesh")

# Keras 2.10 optimizer arguments that tf-keras 2.16 refuses (with a ValueError
# that points at `tf.keras.optimizers.legacy.<name>`, which does not exist for
# these classes), and what replaces each.
_LEGACY_KWARGS = {
    "decay": (
        "use a learning-rate schedule, e.g. learning_rate=tf.keras.optimizers.schedules."
        "InverseTimeDecay(initial_learning_rate, decay_steps=1, decay_rate=decay)"
    ),
    "gradient_aggregator": (
        "aggregate the gradients yourself and call apply_gradients(grads_and_vars, skip_gradients_aggregation=True)"
    ),
    "gradient_transformers": (
        "use clipnorm, clipvalue or global_clipnorm, or transform the gradients before apply_gradients"
    ),
}


def _sparse(gradient) -> bool:
    return isinstance(gradient, tf.IndexedSlices)


def _check_kwargs(optimizer: Any, stock: str, kwargs: dict) -> None:
    """Refuses what `tf.keras.optimizers.<stock>` would refuse, naming the argument and the fix."""
    ours = type(optimizer).__name__
    for key, value in kwargs.items():
        if key in _PASS_THROUGH_KWARGS:
            continue
        if key in _LEGACY_KWARGS:
            raise ArgumentError(
                f"Argument `{key}` of {ours} is a legacy Keras optimizer argument that "
                f"tf.keras.optimizers.{stock} no longer takes. Received: {key}={value!r}. "
                f"Fix: {_LEGACY_KWARGS[key]}."
            )
        named = [
            name
            for name, parameter in inspect.signature(type(optimizer).__init__).parameters.items()
            if name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        # TypeError, as Python and tf-keras raise for an unexpected keyword.
        raise ArgumentTypeError(
            f"Argument `{key}` is not an argument of {ours} (nor of tf.keras.optimizers.{stock}). "
            f"Received: {key}={value!r}. Fix: remove it, or use one of: {', '.join(named)}."
        )


class _TouchedRowsWeightDecay:
    """Decoupled weight decay that, for a sparse gradient, decays only the touched rows.

    tf-keras 2.16 decays in `apply_gradients`, through `_apply_weight_decay`,
    every variable in full (`var -= lr * weight_decay * var`) before any
    update. That hook sees no gradients, so it cannot tell an embedding's
    sparse gradient from a dense one. Here the decay runs at the start of
    `update_step` instead, on the same variable and with the same formula:
    for a dense gradient on the whole variable (the stock result), for a
    sparse one on the rows in `gradient.indices` only. It is then part of the
    variable's own update (and of its lock under `exact_updates`).
    """

    def _apply_weight_decay(self, variables):
        del variables  # Decayed in update_step, see `_decay_weights`.

    def _decay_weights(self, gradient, variable) -> None:
        if self.weight_decay is None or not self._use_weight_decay(variable):
            return
        lr = tf.cast(self.learning_rate, variable.dtype)
        wd = tf.cast(self.weight_decay, variable.dtype)
        if _sparse(gradient):
            rows = gradient.indices
            variable.scatter_sub(tf.IndexedSlices(tf.gather(variable, rows) * wd * lr, rows))
        else:
            variable.assign_sub(variable * wd * lr)


class LazyAdam(_TouchedRowsWeightDecay, _keras.optimizers.Adam):
    """Adam that updates only the moments of the rows a sparse gradient touches.

    A drop-in for `tf.keras.optimizers.Adam`: the same arguments in the same
    order with the same defaults (except `jit_compile`, False here, and
    `name`), so code written for Adam runs with only the class swapped.
    Dense gradients get stock Adam. For a sparse gradient `g` over rows `idx`
    (duplicates already summed) at step `t` (one-based):

        var[idx] -= lr * weight_decay * var[idx]          # if weight_decay
        m[idx] = beta_1 * m[idx] + (1 - beta_1) * g
        v[idx] = beta_2 * v[idx] + (1 - beta_2) * g^2
        vhat[idx] = max(vhat[idx], v[idx])                # if amsgrad
        var[idx] -= lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) * m[idx] / (sqrt(vhat[idx] or v[idx]) + eps)

    where `eps` is `epsilon`, or `epsilon * sqrt(1 - beta_2^t)` with
    `adaptive_epsilon`. Other rows keep their values and their slots: no
    decay of moments, no weight decay. Stock Adam updates `m`, `v` (and
    `vhat`) and, with `weight_decay`, the weights of every row on every step.

    Gradient clipping (`clipnorm`, `clipvalue`, `global_clipnorm`) is
    tf-keras's own and runs before the update, on sparse gradients too.

    Known limitations:

    - As in tf-keras, clipping runs before duplicate rows are summed:
      `clipvalue` bounds each occurrence, so a row looked up k times in a
      batch can get up to k * clipvalue, and `clipnorm` takes the norm of
      the values as looked up.
    - A table partitioned over several ps reaches tf-keras as one gradient
      per shard, so `clipnorm` clips each shard's gradient separately (for
      stock optimizers too). `global_clipnorm` and `clipvalue` do not depend
      on the partitioning.
    - `use_ema` is tf-keras's: the moving average is updated over the whole
      variable every step, so with it the step cost grows with the table.
    - `jit_compile=True` is honoured (on GPU, as in tf-keras), but the sparse
      update is recompiled for each new number of unique rows.

    Example:

    >>> import tf_psx, tensorflow as tf
    >>> var = tf.Variable(tf.ones([4, 2]))
    >>> opt = tf_psx.optimizers.LazyAdam(learning_rate=0.1, weight_decay=0.5, amsgrad=True)
    >>> grad = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([2]), tf.constant([4, 2]))
    >>> _ = opt.apply_gradients([(grad, var)])
    >>> # Row 2: decayed to 1 - 0.1 * 0.5 * 1 = 0.95, then Adam's first step moves it by lr.
    >>> [round(float(x), 4) for x in var.numpy()[:, 0]]
    [1.0, 1.0, 0.85, 1.0]

    Args:
      learning_rate: A float, a scalar tensor, a
        `tf.keras.optimizers.schedules.LearningRateSchedule`, or a callable
        with no arguments that returns the value. Defaults to 0.001.
      beta_1: Decay rate of the first moment `m`. Defaults to 0.9.
      beta_2: Decay rate of the second moment `v`. Defaults to 0.999.
      epsilon: Added to `sqrt(v)` for numerical stability ("epsilon hat" in
        Kingma and Ba). Defaults to 1e-7.
      adaptive_epsilon: If True, use `epsilon * sqrt(1 - beta_2^t)` (Algorithm
        1 of Kingma and Ba). Defaults to False.
      amsgrad: If True, keep `vhat`, the running maximum of `v` (AMSGrad,
        Reddi et al. 2018), updated lazily like `m` and `v`. Adds one
        variable-shaped slot. Defaults to False.
      weight_decay: If set, decoupled weight decay (as in AdamW):
        `var -= learning_rate * weight_decay * var` before the update, on the
        touched rows only for a sparse gradient, on the whole variable for a
        dense one. `exclude_from_weight_decay()` is honoured.
      clipnorm: If set, each gradient is clipped to this norm.
      clipvalue: If set, each gradient is clipped to [-clipvalue, clipvalue].
      global_clipnorm: If set, all gradients together are clipped to this
        global norm. At most one of `clipnorm` and `global_clipnorm`.
      use_ema: If True, keep an exponential moving average of the weights
        (tf-keras's): `average = ema_momentum * average + (1 - ema_momentum) * var`
        after each step.
      ema_momentum: The moving average's momentum, in [0, 1]. Defaults to 0.99.
      ema_overwrite_frequency: With `use_ema`, every this many steps the
        weights are overwritten by their moving average. None: only when
        `finalize_variable_values()` is called (at the end of `fit`).
      jit_compile: If True, compile the update with XLA (used on GPU only, as
        in tf-keras). Defaults to False, unlike Adam: see the limitations.
      name: Name scope of the optimizer's variables. Defaults to "LazyAdam".
      **kwargs: What tf-keras's base optimizer also takes
        (`is_legacy_optimizer`, the deprecated `lr`, `mesh`).

    Raises:
      TypeError: For a keyword argument that tf.keras.optimizers.Adam does not take.
      ValueError: For a legacy argument (`decay`, `gradient_aggregator`,
        `gradient_transformers`), and where tf-keras raises (both `clipnorm`
        and `global_clipnorm`, `ema_momentum` outside [0, 1]).
    """

    # The defaults are tf-keras Adam's (tests pin them), except _JIT_COMPILE_DEFAULT.
    def __init__(
        self,
        learning_rate: _LearningRate = 0.001,
        beta_1: _Hyperparameter = 0.9,
        beta_2: _Hyperparameter = 0.999,
        epsilon: float = 1e-7,
        adaptive_epsilon: bool = False,
        amsgrad: bool = False,
        weight_decay: Optional[float] = None,
        clipnorm: Optional[float] = None,
        clipvalue: Optional[float] = None,
        global_clipnorm: Optional[float] = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: Optional[int] = None,
        jit_compile: bool = _JIT_COMPILE_DEFAULT,
        name: str = "LazyAdam",
        **kwargs,
    ):
        _check_kwargs(self, "Adam", kwargs)
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            adaptive_epsilon=adaptive_epsilon,
            amsgrad=amsgrad,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            jit_compile=jit_compile,
            name=name,
            **kwargs,
        )

    def update_step(self, gradient, variable):
        # Every op below reads or writes only `variable` and its own slots;
        # `self.iterations` is used through arithmetic only (it may be a
        # per-variable step tensor under tf_psx's exact updates).
        self._decay_weights(gradient, variable)
        if not _sparse(gradient):
            return super().update_step(gradient, variable)
        dtype = variable.dtype
        lr = tf.cast(self.learning_rate, dtype)
        step = tf.cast(self.iterations + 1, dtype)
        beta_1 = tf.cast(self.beta_1, dtype)
        beta_2 = tf.cast(self.beta_2, dtype)
        beta_2_power = tf.pow(beta_2, step)
        alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - tf.pow(beta_1, step))
        epsilon = tf.cast(self.epsilon, dtype)
        if self.adaptive_epsilon:
            epsilon = epsilon * tf.sqrt(1 - beta_2_power)
        index = self._index_dict[self._var_key(variable)]
        m, v = self._momentums[index], self._velocities[index]
        # apply_gradients has already summed duplicate indices.
        rows, values = gradient.indices, gradient.values
        m_rows = beta_1 * tf.gather(m, rows) + (1 - beta_1) * values
        v_rows = beta_2 * tf.gather(v, rows) + (1 - beta_2) * tf.square(values)
        m.scatter_update(tf.IndexedSlices(m_rows, rows))
        v.scatter_update(tf.IndexedSlices(v_rows, rows))
        if self.amsgrad:
            v_hat = self._velocity_hats[index]
            v_rows = tf.maximum(tf.gather(v_hat, rows), v_rows)
            v_hat.scatter_update(tf.IndexedSlices(v_rows, rows))
        variable.scatter_sub(tf.IndexedSlices(alpha * m_rows / (tf.sqrt(v_rows) + epsilon), rows))
        return None

    def get_config(self):
        config = super().get_config()
        # tf-keras 2.16's Adam.get_config leaves it out, so its round trip drops it.
        config["adaptive_epsilon"] = self.adaptive_epsilon
        return config


class SGD(_TouchedRowsWeightDecay, _keras.optimizers.SGD):
    """SGD whose sparse updates touch only the rows in the batch.

    A drop-in for `tf.keras.optimizers.SGD`: the same arguments in the same
    order with the same defaults (except `jit_compile`, False here, and
    `name`). Dense gradients get stock SGD. With `momentum=0` it keeps no
    slot at all (stock tf-keras SGD keeps a table-sized momentum slot and
    updates it every step). For a sparse gradient `g` over rows `idx`, a
    row's velocity decays only when the row is touched ("lazy" momentum):

        var[idx] -= lr * weight_decay * var[idx]      # if weight_decay
        m[idx] = momentum * m[idx] - lr * g
        var[idx] += m[idx]                            # or, with nesterov:
        var[idx] += momentum * m[idx] - lr * g

    Other rows keep their values and velocities. Stock SGD decays every
    row's velocity, adds it to every row, and weight-decays every row.

    Known limitations: as for `LazyAdam` (clipping before duplicate rows are
    summed, `clipnorm` per shard of a partitioned table, whole-variable
    `use_ema`, recompiles under `jit_compile=True`).

    Example:

    >>> import tf_psx, tensorflow as tf
    >>> var = tf.Variable(tf.ones([3, 1]))
    >>> grad = tf.IndexedSlices(tf.constant([[2.0]]), tf.constant([1]), tf.constant([3, 1]))
    >>> _ = tf_psx.optimizers.SGD(learning_rate=0.5, weight_decay=0.2).apply_gradients([(grad, var)])
    >>> [round(float(x), 4) for x in var.numpy().ravel()]  # row 1: 1 - 0.5 * 0.2 * 1 - 0.5 * 2
    [1.0, -0.1, 1.0]

    Args:
      learning_rate: A float, a scalar tensor, a
        `tf.keras.optimizers.schedules.LearningRateSchedule`, or a callable
        with no arguments that returns the value. Defaults to 0.01.
      momentum: Velocity decay, in [0, 1]. Defaults to 0 (no slot).
      nesterov: If True, Nesterov momentum (lazily, on sparse gradients too).
      weight_decay: If set, decoupled weight decay:
        `var -= learning_rate * weight_decay * var` before the update, on the
        touched rows only for a sparse gradient, on the whole variable for a
        dense one. `exclude_from_weight_decay()` is honoured.
      clipnorm: If set, each gradient is clipped to this norm.
      clipvalue: If set, each gradient is clipped to [-clipvalue, clipvalue].
      global_clipnorm: If set, all gradients together are clipped to this
        global norm. At most one of `clipnorm` and `global_clipnorm`.
      use_ema: If True, keep tf-keras's exponential moving average of the
        weights (see `LazyAdam`).
      ema_momentum: The moving average's momentum, in [0, 1]. Defaults to 0.99.
      ema_overwrite_frequency: With `use_ema`, every this many steps the
        weights are overwritten by their moving average.
      jit_compile: If True, compile the update with XLA (used on GPU only, as
        in tf-keras). Defaults to False, unlike tf-keras SGD.
      name: Name scope of the optimizer's variables. Defaults to "SGD".
      **kwargs: What tf-keras's base optimizer also takes
        (`is_legacy_optimizer`, the deprecated `lr`, `mesh`).

    Raises:
      TypeError: For a keyword argument that tf.keras.optimizers.SGD does not take.
      ValueError: For a legacy argument (`decay`, `gradient_aggregator`,
        `gradient_transformers`), and where tf-keras raises (`momentum`
        outside [0, 1], both `clipnorm` and `global_clipnorm`).
    """

    # The defaults are tf-keras SGD's (tests pin them), except _JIT_COMPILE_DEFAULT.
    def __init__(
        self,
        learning_rate: _LearningRate = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: Optional[float] = None,
        clipnorm: Optional[float] = None,
        clipvalue: Optional[float] = None,
        global_clipnorm: Optional[float] = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: Optional[int] = None,
        jit_compile: bool = _JIT_COMPILE_DEFAULT,
        name: str = "SGD",
        **kwargs,
    ):
        _check_kwargs(self, "SGD", kwargs)
        super().__init__(
            learning_rate=learning_rate,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            jit_compile=jit_compile,
            name=name,
            **kwargs,
        )

    def build(self, var_list):
        if self.momentum != 0:
            return super().build(var_list)
        # The base build() adds a momentum slot per variable even at
        # momentum 0; skip it, keep the iteration counter, the index and
        # the moving averages of `use_ema`.
        _keras.optimizers.Optimizer.build(self, var_list)  # pylint: disable=bad-super-call
        if getattr(self, "_built", False):
            return None
        self.momentums = [None] * len(var_list)
        self._built = True
        return None

    def update_step(self, gradient, variable):
        # Ops on `variable` and its own slot only (see LazyAdam.update_step).
        self._decay_weights(gradient, variable)
        lr = tf.cast(self.learning_rate, variable.dtype)
        if self.momentum == 0:
            if _sparse(gradient):
                variable.scatter_sub(tf.IndexedSlices(lr * gradient.values, gradient.indices))
            else:
                variable.assign_sub(lr * gradient)
            return None
        if not _sparse(gradient):
            return super().update_step(gradient, variable)
        m = self.momentums[self._index_dict[self._var_key(variable)]]
        momentum = tf.cast(self.momentum, variable.dtype)
        rows, values = gradient.indices, gradient.values
        m_rows = momentum * tf.gather(m, rows) - lr * values
        m.scatter_update(tf.IndexedSlices(m_rows, rows))
        step = momentum * m_rows - lr * values if self.nesterov else m_rows
        variable.scatter_add(tf.IndexedSlices(step, rows))
        return None


def updates_touched_rows_only(optimizer) -> bool:
    """True when a sparse gradient's update writes only its rows, in the variable and in its slots.

    So for `tf_psx.optimizers.LazyAdam` and `SGD`, and for tf-keras's own
    `Adagrad` without weight decay; never with `use_ema` (the moving average
    is updated over every row). Stock `Adam`, `SGD` (its momentum slot is
    decayed in full even at momentum 0) and the rest write every row whose
    state is not zero. `tf_psx.callbacks.PeriodicSync`'s delta snapshots use
    this to find the changed rows from the updates instead of by content.
    """
    if getattr(optimizer, "use_ema", False):
        return False
    if isinstance(optimizer, (LazyAdam, SGD)):
        return True
    return type(optimizer) is _keras.optimizers.Adagrad and getattr(optimizer, "weight_decay", None) is None
