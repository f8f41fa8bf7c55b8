"""tf_psx: parameter-server training for TensorFlow models with huge sparse embeddings.

Importing tf_psx is quiet and cheap: TensorFlow is imported only when a name
that needs it is first used. The import routes `tf.keras` to tf-keras (see
`tf_psx/_tf/keras.py`).
"""

from __future__ import annotations

from tf_psx import _quiet

_quiet.quiet_cpp_logs()  # before TF loads: its C++ INFO lines (gRPC option dumps) off
_quiet.quiet_tensorflow_import()  # TF 2.21's native lines at import, which no log level reaches
import importlib
import importlib.abc
import importlib.util
import logging as _logging
import sys

from tf_psx._tf import keras as _tf_keras  # noqa: F401  (sets TF_USE_LEGACY_KERAS before tf.keras loads)

__version__ = "0.1.0"

# name -> module that defines it; loaded on first attribute access (PEP 562).
_EXPORTS = {
    "ClusterConfig": "tf_psx.cluster",
    "TFConfigError": "tf_psx.cluster",
    "LocalCluster": "tf_psx.cluster.local",
    "ParameterServerStrategy": "tf_psx.strategies",
    "CentralStorageStrategy": "tf_psx.strategies",
    "auto_strategy": "tf_psx.strategies",
    "LocalResourcesError": "tf_psx.strategies",
    "ClusterUnreachableError": "tf_psx.strategies",
    "Keras3Error": "tf_psx.errors",
    "DynamicEmbeddingSaveError": "tf_psx.errors",
    "TFPSXError": "tf_psx.errors",
    "ArgumentError": "tf_psx.errors",
    "export_serving": "tf_psx.export",
    "launched_or": "tf_psx.cluster.local",
    "unsharded_weights": "tf_psx.weights",
}
# name -> module: `tf_psx.local` is `tf_psx.cluster.local` since the cluster became a package.
_SUBMODULES = {name: f"tf_psx.{name}" for name in (
    "partitioners", "data", "cluster", "strategies", "optimizers", "layers", "tables", "callbacks", "launch", "weights", "errors")}
_SUBMODULES["local"] = "tf_psx.cluster.local"
# Modules that moved into packages, by their old names: `import tf_psx.stalls`,
# `from tf_psx import step_once` and `tf_psx.exact_updates.rerun_counts` still work.
_MOVED = {f"tf_psx.{name}": f"tf_psx.training.{name}" for name in (
    "exact_compile", "exact_updates", "step_once", "sync_training", "sync_accumulators", "stalls")}
_MOVED["tf_psx.exact_tables"] = "tf_psx.tables.tfra_updates"

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)

_logger = _logging.getLogger("tf_psx")
if not _logger.handlers:
    # Choices tf_psx makes for the user (which strategy, which cluster) are
    # shown at INFO; nothing is logged at import time.
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("tf_psx: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(_logging.INFO)
    _logger.propagate = False


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module's old name as the module itself (one module object, two names)."""

    def find_spec(self, fullname, path=None, target=None):  # pylint: disable=unused-argument
        return importlib.util.spec_from_loader(fullname, self) if fullname in _MOVED else None

    def create_module(self, spec):
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module):
        pass


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    if f"tf_psx.{name}" in _MOVED:
        return importlib.import_module(f"tf_psx.{name}")
    raise AttributeError(f"module 'tf_psx' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
