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


def _route_tensorflow_keras_imports() -> None:
    """Makes `import tensorflow.keras.X` find tf-keras when tensorflow was imported before tf_psx.

    The lazy `tf.keras` reads the variable on first use, but TF 2.16's
    `tensorflow/__init__.py` also reads it once at import, to put the
    package that `import tensorflow.keras...` finds first on
    `tensorflow.__path__`: Keras 3's (`keras/_tf_keras`) when it was unset.
    A module that then runs `from tensorflow.keras.initializers import ...`
    (TFRA 0.8.1 does, so the first DynamicEmbedding did) imports Keras 3's
    `tensorflow.keras`, and Python binds `tf.keras` to it: after that,
    `tf.keras.Model` in the user's own code was Keras 3. Here the tf-keras
    directory is put first, as TF does when the variable is set before it is
    imported.
    """
    import importlib.util  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    tensorflow = sys.modules.get("tensorflow")
    if (tensorflow is None or "tensorflow.keras" in sys.modules
            or os.environ.get(LEGACY_KERAS_ENV) not in ("true", "True", "1")):
        return
    loader = tensorflow.__dict__.get("keras")
    if getattr(loader, "__dict__", {}).get("_tfll_keras_version") not in (None, "tf_keras"):
        return  # tf.keras already resolved to Keras 3 before tf_psx: left as the user has it
    spec = importlib.util.find_spec("tf_keras")  # found, not imported
    if spec is None or spec.origin is None:
        return
    legacy_dir = os.path.join(os.path.dirname(spec.origin), "api", "_v2")
    path = getattr(tensorflow, "__path__", None)
    if isinstance(path, list) and os.path.isdir(os.path.join(legacy_dir, "keras")) and path[:1] != [legacy_dir]:
        path.insert(0, legacy_dir)


_route_tensorflow_keras_imports()


def _warn_if_keras3_was_chosen() -> None:
    """Warns at `import tf_psx` when `tf.keras` already resolved to Keras 3 (something used it first).

    TF 2.16's lazy `tf.keras` picks its package on first use: a script that
    touched `tf.keras` before `import tf_psx` got Keras 3, and its first
    `fit` under the strategy raised `Keras3Error`, whose fix ("import tf_psx
    first") the user thought they had followed.
    """
    import sys  # pylint: disable=import-outside-toplevel
    import warnings  # pylint: disable=import-outside-toplevel

    tensorflow = sys.modules.get("tensorflow")
    resolved = tensorflow.__dict__.get("keras") if tensorflow is not None else None
    # Once used, TF replaces its lazy loader by the module it chose: Keras 3's is "keras._tf_keras.keras".
    name = getattr(resolved, "__name__", "") if isinstance(resolved, type(sys)) else ""
    if name.startswith("keras"):
        warnings.warn(
            "tf.keras already resolved to Keras 3 before `import tf_psx` (this script used tf.keras first), so "
            "models built with tf.keras are Keras 3 and cannot train under tf_psx.ParameterServerStrategy. Fix: "
            "put `import tf_psx` before any use of tf.keras (or set TF_USE_LEGACY_KERAS=1 before Python starts), "
            "or build models with `import tf_keras as keras`.", stacklevel=4)


_warn_if_keras3_was_chosen()


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


def wrapped_like(patched, original):
    """Gives a wrapper of a tf-keras method the method's doc, signature and `__wrapped__`; returns it."""
    patched.__doc__ = original.__doc__
    patched.__wrapped__ = original
    patched.__signature__ = inspect.signature(original)
    return patched
