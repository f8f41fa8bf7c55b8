"""Optimizers whose cost per step follows the rows touched, not the table size.

Measured here (TF 2.16.2, tf-keras 2.16, 1 worker, 2 ps, batch 256 x 8 ids,
dim 32): stock tf-keras `Adam` and `SGD` take 18x and 12x longer per step at
2M rows than at 10k rows (bench/vocab_scaling.py). Their sparse branch still
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

`LazyAdam` and `SGD` behave exactly like their stock twins on dense
gradients; on sparse gradients (embeddings) they update only the rows in the
batch. That is the "lazy" rule of tensorflow-addons' LazyAdam (end of life,
no build for TF 2.16): a row's moments decay only on the steps that touch it.
"""

from __future__ import annotations

import tensorflow as tf

from tf_psx import _compat

__all__ = ["LazyAdam", "SGD"]

_keras = _compat.keras()


def _sparse(gradient) -> bool:
    return isinstance(gradient, tf.IndexedSlices)


class LazyAdam(_keras.optimizers.Adam):
    """Adam that updates only the moments of the rows a sparse gradient touches.

    For a sparse gradient g over rows `idx` at step t (one-based):

        m[idx] = beta_1 * m[idx] + (1 - beta_1) * g
        v[idx] = beta_2 * v[idx] + (1 - beta_2) * g^2
        var[idx] -= lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) * m[idx] / (sqrt(v[idx]) + epsilon)

    Other rows keep their moments. Dense gradients get plain Adam.

    Example:

    >>> import tf_psx, tensorflow as tf
    >>> var = tf.Variable(tf.zeros([4, 2]))
    >>> opt = tf_psx.optimizers.LazyAdam(learning_rate=0.1)
    >>> grad = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([2]), tf.constant([4, 2]))
    >>> _ = opt.apply_gradients([(grad, var)])
    >>> [round(float(x), 4) for x in var.numpy()[:, 0]]  # only row 2 moved, by lr (first Adam step)
    [0.0, 0.0, -0.1, 0.0]

    Args:
      learning_rate, beta_1, beta_2, epsilon, **kwargs: as `tf.keras.optimizers.Adam`.
        `amsgrad=True` is not supported. `jit_compile` defaults to False:
        sparse updates have a different shape every step.

    Raises:
      ValueError: for `amsgrad=True`.
    """

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, name="LazyAdam", **kwargs):
        if kwargs.get("amsgrad"):
            raise ValueError(
                "Argument `amsgrad` of LazyAdam must be False. Received: True. "
                "Fix: use tf.keras.optimizers.Adam(amsgrad=True), which updates every row each step."
            )
        kwargs.setdefault("jit_compile", False)
        super().__init__(learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, name=name, **kwargs)

    def update_step(self, gradient, variable):
        if not _sparse(gradient):
            return super().update_step(gradient, variable)
        dtype = variable.dtype
        lr = tf.cast(self.learning_rate, dtype)
        step = tf.cast(self.iterations + 1, dtype)
        beta_1 = tf.cast(self.beta_1, dtype)
        beta_2 = tf.cast(self.beta_2, dtype)
        alpha = lr * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
        index = self._index_dict[self._var_key(variable)]
        m, v = self._momentums[index], self._velocities[index]
        # apply_gradients has already summed duplicate indices.
        rows, values = gradient.indices, gradient.values
        m_rows = beta_1 * tf.gather(m, rows) + (1 - beta_1) * values
        v_rows = beta_2 * tf.gather(v, rows) + (1 - beta_2) * tf.square(values)
        m.scatter_update(tf.IndexedSlices(m_rows, rows))
        v.scatter_update(tf.IndexedSlices(v_rows, rows))
        variable.scatter_sub(tf.IndexedSlices(alpha * m_rows / (tf.sqrt(v_rows) + self.epsilon), rows))
        return None


class SGD(_keras.optimizers.SGD):
    """SGD whose sparse updates touch only the rows in the batch.

    With `momentum=0` it keeps no slot at all (stock tf-keras SGD keeps a
    table-sized momentum slot and updates it every step). With momentum, a
    row's velocity decays only when the row is touched ("lazy" momentum):

        m[idx] = momentum * m[idx] - lr * g;   var[idx] += m[idx]

    Dense gradients get stock SGD (with nesterov, if asked).

    Example:

    >>> import tf_psx, tensorflow as tf
    >>> var = tf.Variable(tf.ones([3, 1]))
    >>> grad = tf.IndexedSlices(tf.constant([[2.0]]), tf.constant([1]), tf.constant([3, 1]))
    >>> _ = tf_psx.optimizers.SGD(learning_rate=0.5).apply_gradients([(grad, var)])
    >>> var.numpy().ravel().tolist()
    [1.0, 0.0, 1.0]

    Args:
      learning_rate, momentum, nesterov, **kwargs: as `tf.keras.optimizers.SGD`.
        Sparse updates ignore `nesterov`. `jit_compile` defaults to False.
    """

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, name="SGD", **kwargs):
        kwargs.setdefault("jit_compile", False)
        super().__init__(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, name=name, **kwargs)

    def build(self, var_list):
        if self.momentum != 0:
            return super().build(var_list)
        # The base build() adds a momentum slot per variable even at
        # momentum 0; skip it, keep the iteration counter and the index.
        _keras.optimizers.Optimizer.build(self, var_list)  # pylint: disable=bad-super-call
        if getattr(self, "_built", False):
            return None
        self.momentums = [None] * len(var_list)
        self._built = True
        return None

    def update_step(self, gradient, variable):
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
        rows = gradient.indices
        m_rows = momentum * tf.gather(m, rows) - lr * gradient.values
        m.scatter_update(tf.IndexedSlices(m_rows, rows))
        variable.scatter_add(tf.IndexedSlices(m_rows, rows))
        return None
