"""What tf_psx keeps off the user's terminal by default, and how to get it back ($TF_PSX_VERBOSE=1).

A training script prints what a Keras user expects (the progress bar,
tf_psx's own one-line notices, real warnings once). TF, XLA and TFRA print
lines about things nobody running on a CPU cluster can act on: CUDA plugin
registration (three per process, even with TF_CPP_MIN_LOG_LEVEL=2), gRPC
server option dumps, TF's internal deprecations, a function cleanup after a
cluster changes shape (one line per function). Those are dropped:

* from the lines of task processes that `tf-psx launch` echoes (each task's
  log file keeps every line);
* from the "tensorflow" Python logger (a filter, installed when a
  `tf_psx.ParameterServerStrategy` is made);
* TF's C++ INFO lines are off by default (TF_CPP_MIN_LOG_LEVEL=1, set by
  `import tf_psx` when the user did not set it, before TF loads).

Nothing at ERROR level from Python, and no traceback, is ever dropped: the
patterns below match whole known messages only.
"""

from __future__ import annotations

import logging
import os
import re

VERBOSE_ENV = "TF_PSX_VERBOSE"
CPP_LOG_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
# TF's C++ logs at INFO (0) print gRPC server option dumps; 1 keeps warnings and errors.
QUIET_CPP_LOG_LEVEL = "1"

# Known lines nobody can act on here (each with where it comes from).
NOISE = re.compile("|".join([
    r"Unable to register cu(FFT|DNN|BLAS) factory",          # XLA at TF import, on a CPU build
    r"TF-TRT Warning: Could not find TensorRT",                # TF at import
    r"This TensorFlow binary is optimized to use available CPU instructions",
    r"To enable the following instructions: .*rebuild TensorFlow",
    r"oneDNN custom operations are on",
    r"Failed to remove function remotely due to Tried to remove non-existent function",  # cluster shape change
    r"Reduce to /device:CPU:0 then broadcast to",              # tf.distribute at INFO in notebooks
    r"Found source dataset of type .* This type is not efficiently shardable",
    r"_colocate_with \(from tensorflow\.python\.framework\.ops\) is deprecated",
    r"Colocations handled automatically by placer",
    r"An exception occurred when import horovod",             # TFRA at import
    r"dynamic_embedding\.GraphKeys has already been deprecated",  # TFRA
]))


def verbose() -> bool:
    """True when $TF_PSX_VERBOSE asks for everything."""
    return os.environ.get(VERBOSE_ENV, "").strip() not in ("", "0", "false", "False")


def is_noise(line: str) -> bool:
    """True for a known line nobody can act on (never when $TF_PSX_VERBOSE is set)."""
    return not verbose() and NOISE.search(line) is not None


class LineFilter:
    """One stream's lines (a task's output): drops the known noise, never a line of a traceback.

    From "Traceback (most recent call last):" to the exception's own line
    (the first line that starts with no space), every line is kept, even one
    whose text matches a noise pattern (an exception whose message quotes one).
    """

    def __init__(self):
        self._in_traceback = False

    def keep(self, line: str) -> bool:
        if line.startswith("Traceback (most recent call last)"):
            self._in_traceback = True
            return True
        if self._in_traceback:
            if line[:1] not in ("", " ", "\t"):
                self._in_traceback = False  # the exception line closes it
            return True
        return not is_noise(line)


def quiet_cpp_logs() -> None:
    """TF's C++ INFO lines off unless the user set the level or asked for everything (before TF loads)."""
    if not verbose():
        os.environ.setdefault(CPP_LOG_LEVEL_ENV, QUIET_CPP_LOG_LEVEL)


class _NoiseFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        try:
            message = record.getMessage()
        except Exception:  # pylint: disable=broad-except  (a record that cannot format is not ours to drop)
            return True
        return not is_noise(message)


_FILTER = _NoiseFilter()


def install_log_filter() -> None:
    """Drops the known noise from the "tensorflow" logger (idempotent; a no-op with $TF_PSX_VERBOSE)."""
    if verbose():
        return
    tf_logger = logging.getLogger("tensorflow")
    if _FILTER not in tf_logger.filters:
        tf_logger.addFilter(_FILTER)
