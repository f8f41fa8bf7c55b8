"""`verbose=1` under a ClusterCoordinator: a throttled tf-keras 2.16 progress bar that never waits for a step.

tf-keras refuses `verbose=1` under ParameterServerStrategy because its bar
reads every step's logs, which waits for that step. `with_progbar` (used by
tf_psx._tf.fit_inputs' `fit` and `evaluate`) turns tf-keras's bar off and
adds `CoordinatorProgbar`, which reads the logs of the newest step already
finished (a RemoteValue's private status event), at most once a second.
"""

from __future__ import annotations

import collections
import logging
import time

import numpy as np
from tf_keras.src.utils import tf_utils as _tf_utils

from tf_psx._tf.keras import keras

# The progress bar reads a finished step's logs at most this often (reading a pending one would wait for it).
PROGBAR_INTERVAL_S = 1.0
# The newest steps whose logs the progress bar may read (the oldest finished one of them is shown).
PROGBAR_WINDOW = 64


class CoordinatorProgbar(keras().callbacks.ProgbarLogger):
    """Keras's progress bar under a coordinator, updated at most every `PROGBAR_INTERVAL_S` from finished steps.

    tf-keras refuses `verbose=1` under ParameterServerStrategy because its
    bar reads every step's logs, which waits for that step. This bar reads
    the logs of the newest step already finished, once a second: it never
    waits for a step in flight.
    """

    def __init__(self, count_mode: str = "steps"):
        super().__init__(count_mode)
        self._supports_tf_logs = True  # the logs stay RemoteValues: nothing waits
        self._recent: collections.deque = collections.deque(maxlen=PROGBAR_WINDOW)
        self._last_shown = 0.0

    def set_params(self, params):
        super().set_params(params)
        self.verbose = 1  # fit ran with verbose=0 so that tf-keras adds no bar of its own

    def _batch_update_progbar(self, batch, logs=None):
        self._maybe_init_progbar()
        self.seen = batch + 1
        if logs is not None:
            self._recent.append(logs)
        now = time.monotonic()
        last = self.target is not None and self.seen >= self.target
        if now - self._last_shown < PROGBAR_INTERVAL_S and not last:
            return
        self._last_shown = now
        shown = None
        while self._recent:
            candidate = self._recent.pop()  # newest first
            if not _is_remote(candidate) or _ready(candidate):
                shown = candidate
                break
        self._recent.clear()
        values = [] if shown is None else list(_numbers(shown).items())
        self.progbar.update(self.seen, values, finalize=False)

    def _finalize_progbar(self, logs, counter):
        self._recent.clear()
        super()._finalize_progbar(logs, counter)


def _is_remote(value) -> bool:
    return hasattr(value, "fetch") and hasattr(value, "_status_available_event")


def _ready(value) -> bool:
    return value._status_available_event.is_set()  # pylint: disable=protected-access


def _numbers(logs) -> dict:
    value = logs.fetch() if _is_remote(logs) else logs
    value = _tf_utils.sync_to_numpy_or_python_type(value)
    if not isinstance(value, dict):
        return {}
    return {key: float(np.asarray(v)) for key, v in value.items() if np.size(v) == 1}


def with_progbar(arguments: dict, count_mode: str = "steps") -> dict:
    """verbose=1 under a coordinator: tf-keras's bar off (it would refuse), tf_psx's throttled bar on."""
    if arguments.get("verbose", "auto") != 1:
        return arguments
    return _with_callback(dict(arguments, verbose=0), CoordinatorProgbar(count_mode))


def _with_callback(arguments: dict, callback) -> dict:
    """`arguments` of a fit or evaluate with `callback` after the caller's callbacks (a CallbackList gets it appended)."""
    callbacks = arguments.get("callbacks")
    if isinstance(callbacks, keras().callbacks.CallbackList):
        callbacks.append(callback)
        return arguments
    return dict(arguments, callbacks=list(callbacks or []) + [callback])


class RerunReport(keras().callbacks.Callback):
    """Says when steps of an epoch ran again after a worker failure (never silent).

    TF's coordinator re-runs a closure whose worker failed
    (tf_psx._tf.runtime.closure_retries counts them). At the end of an epoch
    with re-runs this logs a warning, and at the end of a fit with any,
    `history.history["steps_rerun"]` holds the count of every epoch (a fit
    without failures keeps Keras's History keys unchanged). Whether a re-run
    step's update was applied once is what the exact updates' step tokens
    decide; `tf_psx.training.exact_updates.rerun_counts(model.optimizer)` counts the
    updates they skipped.
    """

    def __init__(self, retries):
        super().__init__()
        self._retries = retries
        self._start = 0
        self.by_epoch: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self._retries.count

    def on_epoch_end(self, epoch, logs=None):
        count = self._retries.count - self._start
        self.by_epoch.append(count)
        if count:
            logging.getLogger("tf_psx").warning(
                "Epoch %d: %d step(s) ran again after a worker failure (the coordinator re-runs a failed worker's "
                "step on another worker). tf_psx.training.exact_updates.rerun_counts(model.optimizer) counts the updates "
                "skipped as already applied; history.history['steps_rerun'] holds the count per epoch.",
                epoch + 1, count)

    def on_train_end(self, logs=None):
        history = getattr(self.model, "history", None)
        if any(self.by_epoch) and hasattr(history, "history"):
            history.history["steps_rerun"] = list(self.by_epoch)


def with_rerun_report(arguments: dict, retries) -> dict:
    """`arguments` of a fit with a `RerunReport` over the retry counter `retries` among its callbacks."""
    return _with_callback(arguments, RerunReport(retries))
