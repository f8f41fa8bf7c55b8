"""`wire_dtype`: embedding rows and their gradients cast to a half float while they cross the network.

The table, the optimizer and its slots stay float32 on the ps task; only
the values in flight between the ps task and the worker are narrowed.
"""

from __future__ import annotations

import tensorflow as tf

from tf_psx.errors import ArgumentError

__all__ = ["WIRE_DTYPES", "as_wire_dtype", "through_wire"]

WIRE_DTYPES = ("bfloat16", "float16")


def as_wire_dtype(value, owner: str):
    """None, or tf.bfloat16 / tf.float16 from a name or dtype; anything else is an error."""
    if value is None:
        return None
    try:
        dtype = tf.as_dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in WIRE_DTYPES:
        raise ArgumentError(
            f"Argument `wire_dtype` of {owner} must be None, \"bfloat16\" or \"float16\". Received: {value!r}. "
            "Fix: pass wire_dtype=\"bfloat16\" (the float32 range at 8 bits of precision) or leave it None."
        )
    return dtype


def through_wire(shard, rows: tf.Tensor, wire_dtype) -> tf.Tensor:
    """`tf.gather(shard, rows)` cast to `wire_dtype` on the shard's task, float32 again on this one.

    The gradient takes the way back the same way: cast to `wire_dtype`
    here, to float32 on the shard's task, where the optimizer applies it.
    """
    device = shard.device

    @tf.custom_gradient
    def wire(values):
        with tf.device(device):
            narrow = tf.cast(values, wire_dtype)
        wide = tf.cast(narrow, values.dtype)

        def grad(upstream):
            narrow_grad = tf.cast(upstream, wire_dtype)
            with tf.device(device):
                return tf.cast(narrow_grad, values.dtype)

        return wide, grad

    with tf.device(device):
        values = tf.gather(shard, rows)
    return wire(values)
