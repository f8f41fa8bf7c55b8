"""tf_psx's errors: one base class, each error also the built-in it refines.

`except tf_psx.errors.TFPSXError` catches every error tf_psx raises on
purpose; each class also subclasses the matching built-in (`ValueError`,
`TypeError`, `RuntimeError`, `OSError` or one of its subclasses), so code
written against those keeps working. The general classes (`ArgumentError`,
`ArgumentTypeError`, `StateError`, `DataError`, `MissingFileError`,
`PathExistsError`, `NetworkSetupError`) are for errors no specific class names.
Every message names the field, the value received and the fix. This module
imports nothing heavy (no TensorFlow).

Example:

>>> from tf_psx import errors
>>> issubclass(errors.TFConfigError, ValueError) and issubclass(errors.TFConfigError, errors.TFPSXError)
True
"""

from __future__ import annotations

__all__ = [
    "TFPSXError",
    "ArgumentError",
    "ArgumentTypeError",
    "StateError",
    "DataError",
    "MissingFileError",
    "PathExistsError",
    "NetworkSetupError",
    "TFConfigError",
    "ClusterUnreachableError",
    "TaskFailedError",
    "LocalResourcesError",
    "Keras3Error",
    "DynamicEmbeddingSaveError",
    "ManifestError",
    "LaunchError",
    "CommandError",
    "SyncStepError",
    "MetricsPortError",
    "TFRAOptimizerError",
    "SnapshotDirectoryError",
    "TFRAMissingError",
    "CapturedDatasetError",
]


class TFPSXError(Exception):
    """Base class of every error tf_psx raises on purpose."""


class ArgumentError(TFPSXError, ValueError):
    """An argument (or the option or environment variable standing for one) has a value tf_psx cannot use."""


class ArgumentTypeError(TFPSXError, TypeError):
    """An argument is of a type tf_psx does not take."""


class StateError(TFPSXError, RuntimeError):
    """A call was made in a state where it cannot work (e.g. before the cluster starts); names the fix."""


class DataError(TFPSXError, ValueError):
    """Data tf_psx reads (an input file, a snapshot, a delta, a spill store) does not have the form it needs."""


class MissingFileError(TFPSXError, FileNotFoundError):
    """A file or directory tf_psx needs does not exist (or is a file where a directory is needed)."""


class PathExistsError(TFPSXError, FileExistsError):
    """A path tf_psx would write is taken (a file, or a directory that is not empty)."""


class NetworkSetupError(TFPSXError, OSError):
    """An address cannot be listened on, or a network namespace cannot be made; keeps the OS errno."""


class TFConfigError(TFPSXError, ValueError):
    """A TF_CONFIG or cluster description is malformed; names the JSON path and the fix."""


class ClusterUnreachableError(TFConfigError):
    """A worker or ps task did not accept connections in time."""


class TaskFailedError(TFPSXError, RuntimeError):
    """A task process exited before or while it was needed."""


class LocalResourcesError(TFPSXError, RuntimeError):
    """Resources made before the cluster connection would break the cluster's steps."""


class Keras3Error(TFPSXError, TypeError):
    """A Keras 3 object was used where parameter-server training needs tf-keras."""


class DynamicEmbeddingSaveError(TFPSXError, ValueError):
    """Model.save of a model with TFRA tables, which would not serve; names the alternatives."""


class TFRAOptimizerError(TFPSXError, TypeError):
    """A model with TFRA layers compiled with an optimizer tf_psx cannot make exact; names the fix."""


class TFRAMissingError(TFPSXError, RuntimeError):
    """A TFRA layer or optimizer was used where tensorflow-recommenders-addons is not installed; names the extra."""


class CapturedDatasetError(TFPSXError, ValueError):
    """A step uses a tf.data.Dataset of the coordinator that tf_psx cannot rebuild on the worker; names its holder."""


class SnapshotDirectoryError(TFPSXError, ValueError):
    """PeriodicSync's `directory` cannot be created or written; checked before the first step."""


class ManifestError(TFPSXError, ValueError):
    """An argument of `tfjob_manifest` or `operator_tf_config` is invalid.

    The message names the argument, the expected form, the value received and
    the fix. `argument` and `detail` let a command line name its own option:
    the message is "Argument `<argument>` <detail>".

    Example:

    >>> err = ManifestError("workers", "must be an int >= 1. Received: 0.")
    >>> str(err), err.renamed("Option `--workers`")
    ('Argument `workers` must be an int >= 1. Received: 0.', 'Option `--workers` must be an int >= 1. Received: 0.')
    """

    def __init__(self, argument: str, detail: str) -> None:
        super().__init__(f"Argument `{argument}` {detail}")
        self.argument = argument
        self.detail = detail

    def renamed(self, label: str) -> str:
        """The message with `label` (e.g. "Option `--workers`") naming the value."""
        return f"{label} {self.detail}"


class LaunchError(TFPSXError, ValueError):
    """`tf-psx launch` cannot start the job as asked."""


class CommandError(TFPSXError, ValueError):
    """A `tf-psx` command was given bad input; the CLI prints it and exits 2."""


class SyncStepError(TFPSXError, RuntimeError):
    """A synchronous step cannot complete (no worker reachable); names the workers and the fix."""


class MetricsPortError(TFPSXError, OSError):
    """The Prometheus metrics port cannot be served (in use); names the port and the fix."""
