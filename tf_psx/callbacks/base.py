"""What every tf_psx callback shares: the base class whose batch hooks run under ParameterServerStrategy.

Also the check of a directory argument, and the seconds of the snapshots
`PeriodicSync` wrote for a model (which `ClusterMonitor` reports).
"""

from __future__ import annotations

import os
import uuid
import weakref
from typing import Any

from tf_psx._tf import keras as _tf_keras
from tf_psx.errors import ArgumentError

_keras = _tf_keras.keras()

# Seconds of every snapshot PeriodicSync wrote for a model (ClusterMonitor reads them).
_SNAPSHOT_SECONDS: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def _check_path(owner: str, name: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ArgumentError(
            f"Argument `{name}` of {owner} must be a non-empty directory path (str or os.PathLike). "
            f"Received: {value!r}. Fix: pass e.g. {name}=\"/tmp/run1\"."
        )
    return os.fspath(value)


class _RunCallback(_keras.callbacks.Callback):
    """A callback whose batch hooks run under ParameterServerStrategy."""

    def __init__(self):
        super().__init__()
        # tf-keras skips batch hooks of callbacks that need numpy logs under
        # ParameterServerStrategy; ours never read the logs' values.
        self._supports_tf_logs = True
        self._run_id = None

    def on_train_begin(self, logs=None):
        self._run_id = uuid.uuid4().hex
