"""Everything that depends on TF, Keras or TFRA versions and their private hooks.

This is the one place where tf_psx touches process-wide settings or private
TensorFlow attributes. Each item says which version it was written against
and why it exists.
"""

from __future__ import annotations

import inspect
import os
import sys
from types import ModuleType
from typing import Any

# TF 2.16: `tf.keras` is a lazy loader that reads TF_USE_LEGACY_KERAS the first
# time one of its attributes is used (tensorflow/python/util/lazy_loader.py,
# KerasLazyLoader._initialize). Keras 3 cannot run `model.fit` under
# ParameterServerStrategy, so tf_psx routes `tf.keras` to tf-keras (Keras 2).
# Setting the variable here, before anything touches `tf.keras`, is enough even
# when the user imported tensorflow first. An explicit user setting wins.
LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"
os.environ.setdefault(LEGACY_KERAS_ENV, "1")

# With GRPC_FAIL_FAST=use_caller a call to a dead task fails at once instead of
# waiting for the connection to come back, which is what lets ClusterCoordinator
# notice a failed worker and re-run its closure elsewhere (TF 2.16 PS guide).
GRPC_FAIL_FAST_ENV = "GRPC_FAIL_FAST"
GRPC_FAIL_FAST_VALUE = "use_caller"

KERAS3_FIX = (
    "Fix: use tf-keras (Keras 2), which tf_psx installs: write `import tf_keras as keras` "
    "or use `tf.keras` after `import tf_psx`, and build the model again. Keras 3 cannot run "
    "model.fit under ParameterServerStrategy."
)


class Keras3Error(TypeError):
    """A Keras 3 object was used where parameter-server training needs tf-keras."""


def set_grpc_fail_fast() -> None:
    """Sets GRPC_FAIL_FAST=use_caller unless the user set it already."""
    os.environ.setdefault(GRPC_FAIL_FAST_ENV, GRPC_FAIL_FAST_VALUE)


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


def tfra_loaded() -> bool:
    """True when tensorflow-recommenders-addons was imported in this process."""
    return "tensorflow_recommenders_addons" in sys.modules


def live_tfra_variables() -> int:
    """Counts the TFRA dynamic-embedding variables alive in this process.

    TFRA 0.8.1 tables built before the process connects to a cluster keep
    state on /job:localhost; a model built on the cluster afterwards fails
    every step with "/job:localhost/... unknown device", and
    ClusterCoordinator takes that for a worker failure and retries forever
    (measured: TF 2.16.2, TFRA 0.8.1, even after `del model; gc.collect()`,
    since TFRA keeps the variables alive). Counting the live variables is the
    reliable sign we found; it walks the GC's objects (about 40 ms for 360k
    objects), so it is only done once, before connecting.
    """
    if not tfra_loaded():
        return 0
    import gc  # pylint: disable=import-outside-toplevel

    from tensorflow_recommenders_addons.dynamic_embedding.python.ops import (  # pylint: disable=import-outside-toplevel
        dynamic_embedding_variable as de_variable,
    )

    return sum(1 for obj in gc.get_objects() if isinstance(obj, de_variable.Variable))


def eager_context_initialized() -> bool:
    """True when this process already ran TF ops eagerly (private: context handle)."""
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel

    ctx = context.context()
    return getattr(ctx, "_context_handle", None) is not None


def connected_to_cluster() -> bool:
    """True when the eager context has a server_def (connected to a cluster)."""
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel

    return getattr(context.context(), "_server_def", None) is not None
