"""tf-keras routing and Keras 3 detection (TF 2.16.2, tf-keras 2.16, Keras 3.x).

Imported by `tf_psx/__init__.py` before anything else: it sets
TF_USE_LEGACY_KERAS so that `tf.keras` is tf-keras.
"""

from __future__ import annotations

import inspect
import os
from types import ModuleType
from typing import Any

from tf_psx.errors import Keras3Error

# TF 2.16: `tf.keras` is a lazy loader that reads TF_USE_LEGACY_KERAS the first
# time one of its attributes is used (tensorflow/python/util/lazy_loader.py,
# KerasLazyLoader._initialize). Keras 3 cannot run `model.fit` under
# ParameterServerStrategy, so tf_psx routes `tf.keras` to tf-keras (Keras 2).
# Setting the variable here, before anything touches `tf.keras`, is enough even
# when the user imported tensorflow first. An explicit user setting wins.
LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"
os.environ.setdefault(LEGACY_KERAS_ENV, "1")


KERAS3_FIX = (
    "Fix: use tf-keras (Keras 2), which tf_psx installs: write `import tf_keras as keras` "
    "or use `tf.keras` after `import tf_psx`, and build the model again. Keras 3 cannot run "
    "model.fit under ParameterServerStrategy."
)


def keras() -> ModuleType:
    """Returns the tf-keras module (Keras 2), whatever `tf.keras` resolves to."""
    import tf_keras  # pylint: disable=import-outside-toplevel

    return tf_keras


def tf_keras_is_legacy() -> bool:
    """True when `tf.keras` resolves (or will resolve) to tf-keras."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    loader = tf.__dict__.get("keras")
    # KerasLazyLoader stores the chosen package once it has initialized.
    version = getattr(loader, "__dict__", {}).get("_tfll_keras_version")
    if version is None:
        return os.environ.get(LEGACY_KERAS_ENV) in ("true", "True", "1")
    return version == "tf_keras"


def is_keras3_object(obj: Any) -> bool:
    """True for an instance of a Keras 3 class (its module lives under `keras.src`)."""
    for klass in type(obj).__mro__:
        module = getattr(klass, "__module__", "") or ""
        if module == "keras" or module.startswith("keras.src") or module.startswith("keras."):
            return True
    return False


def check_not_keras3(obj: Any, what: str = "model") -> None:
    """Raises Keras3Error when `obj` is a Keras 3 model, layer or optimizer."""
    if is_keras3_object(obj):
        raise Keras3Error(
            f"The {what} passed in is a Keras 3 object ({type(obj).__module__}."
            f"{type(obj).__qualname__}); tf_psx.ParameterServerStrategy needs tf-keras. "
            + KERAS3_FIX
        )


def keras3_caller() -> str | None:
    """Returns the Keras 3 module on the call stack, if any.

    TF's ParameterServerStrategy rejects `experimental_distribute_dataset` with a
    message about ClusterCoordinator that does not tell a Keras 3 user what is
    wrong. Keras 3's `fit` calls that method from `keras.src.trainers`, so the
    stack tells us who called.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            name = frame.f_globals.get("__name__", "") or ""
            if name.startswith("keras.src"):
                return name
            frame = frame.f_back
    finally:
        del frame
    return None
