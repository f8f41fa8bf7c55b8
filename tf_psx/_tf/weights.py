"""`Layer.set_weights` that takes unsharded lists (tf-keras 2.16, TF 2.16.2 ShardedVariable).

The logic lives in `tf_psx.weights`; this module only patches tf-keras and
reads the shard-to-container link that TF 2.16 keeps on each shard.
"""

from __future__ import annotations

import threading

from tf_psx._tf.keras import keras

_install_lock = threading.Lock()
_INSTALLED = False


def sharded_container(variable):
    """The `ShardedVariable` that `variable` is a shard of, else None."""
    # TF 2.16's ShardedVariable sets a weak reference to itself on each shard.
    ref = getattr(variable, "_sharded_container", None)
    return ref() if ref is not None else None


def install(convert) -> None:
    """Makes tf-keras `Layer.set_weights` pass its list through `convert` first (once per process).

    Args:
      convert: `convert(layer, params, weights)` returns the list to set, or
        None to pass `weights` on unchanged (tf_psx.weights.convert).
    """
    global _INSTALLED  # pylint: disable=global-statement
    with _install_lock:
        if _INSTALLED:
            return
        layer_class = keras().layers.Layer
        original = layer_class.set_weights

        def set_weights(self, weights):
            weights = list(weights)
            converted = convert(self, self.weights, weights)
            return original(self, weights if converted is None else converted)

        set_weights.__doc__ = original.__doc__
        set_weights.__wrapped__ = original
        layer_class.set_weights = set_weights
        _INSTALLED = True
