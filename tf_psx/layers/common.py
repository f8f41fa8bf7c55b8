"""What the embedding layers of `tf_psx.layers` share: their registration with tf-keras."""

from __future__ import annotations

from tf_psx._tf import keras as _tf_keras

__all__ = ["serializable"]

_keras = _tf_keras.keras()
# Registered under this package, so `tf.keras.models.load_model` rebuilds the
# layers of a saved model (.keras, .h5, SavedModel) without custom_objects.
# The registered name is "tf_psx>ClassName", whatever module defines the class.
serializable = _keras.utils.register_keras_serializable(package="tf_psx")
