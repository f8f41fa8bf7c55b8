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

import atexit
import contextlib
import faulthandler
import importlib.abc
import importlib.util
import logging
import os
import re
import subprocess
import sys
import tempfile

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
    # At exit, after the task processes (or a cluster of another shape) are gone: the coordinator's remote
    # functions cannot be released (one line per function, hundreds after a long fit).
    r"Failed to remove function remotely due to failed to connect to all addresses",
    r"Reduce to /device:CPU:0 then broadcast to",              # tf.distribute at INFO in notebooks
    r"Found source dataset of type .* This type is not efficiently shardable",
    r"_colocate_with \(from tensorflow\.python\.framework\.ops\) is deprecated",
    r"Colocations handled automatically by placer",
    r"An exception occurred when import horovod",             # TFRA at import
    r"dynamic_embedding\.GraphKeys has already been deprecated",  # TFRA
    # TF 2.21 logs through absl; its C++ lines at import come before absl::InitializeLog, so no log level
    # applies to them (they print with TF_CPP_MIN_LOG_LEVEL=3): dropped by `native_stderr_filtered`.
    r"All log messages before absl::InitializeLog\(\) is called are written to STDERR",
    r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine",
    r"failed call to cuInit: .*(UNKNOWN ERROR \(303\)|CUDA_ERROR_NO_DEVICE)",
    r"cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized",
    r"grpc_server_lib\.cc:\d+\] Started server with target: grpc://",  # INFO, each in-process server
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


@contextlib.contextmanager
def native_stderr_filtered():
    """Native lines written to file descriptor 2 inside the block are kept back, then echoed without the noise.

    TF's C++ writes straight to the descriptor (no Python logger sees it),
    and on TF 2.21 its lines at import precede absl's log setup, so no log
    level silences them. The lines go to a temporary file and are echoed when
    the block ends, in order, every line that is not known noise (an error
    inside the block: every line). A fatal signal inside the block still
    prints its Python stack: faulthandler writes to a copy of the real
    descriptor meanwhile. A no-op with $TF_PSX_VERBOSE, or where descriptor 2
    cannot be duplicated.
    """
    if verbose():
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    failed = True
    with tempfile.TemporaryFile(mode="w+b") as held:
        faulthandler_was_on = faulthandler.is_enabled()
        saved_file = os.fdopen(os.dup(saved), "w")
        try:
            if faulthandler_was_on:
                faulthandler.enable(file=saved_file)
            os.dup2(held.fileno(), 2)
            yield
            failed = False
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            if faulthandler_was_on:
                faulthandler.enable()
            saved_file.close()
            held.seek(0)
            text = held.read().decode("utf-8", "replace")
            kept = text.splitlines(keepends=True) if failed else list(kept_native_lines(text.splitlines(True)))
            if kept:
                os.write(2, "".join(kept).encode("utf-8"))


# Loads this file (argv[1]; it imports only the standard library) and copies stdin to stdout without the noise.
_EXIT_FILTER_CHILD = ("import importlib.util, sys\n"
                      "spec = importlib.util.spec_from_file_location('tf_psx_quiet', sys.argv[1])\n"
                      "quiet = importlib.util.module_from_spec(spec)\n"
                      "spec.loader.exec_module(quiet)\n"
                      "for line in quiet.kept_native_lines(sys.stdin):\n"
                      "    sys.stdout.write(line)\n"
                      "    sys.stdout.flush()\n")
_EXIT_FILTER: dict = {}


def filter_native_stderr_at_exit() -> None:
    """From this interpreter's exit on, the known noise on descriptor 2 is dropped (registered once per process).

    When a `LocalCluster` of task processes stops, the coordinator's remote
    functions outlive the tasks; TF releases them while the interpreter shuts
    down and logs one native "Failed to remove function remotely due to
    failed to connect to all addresses" error per function (hundreds after a
    long fit), after the script's last line. At exit, descriptor 2 is handed
    to a small child process that copies every other line to the real stderr
    and ends when this process does. A no-op with $TF_PSX_VERBOSE.
    """
    if verbose() or _EXIT_FILTER:
        return
    _EXIT_FILTER["registered"] = True
    atexit.register(_start_exit_filter)


def _start_exit_filter() -> None:
    try:
        sys.stderr.flush()
        real_stderr = os.dup(2)
        read_end, write_end = os.pipe()
        subprocess.Popen(  # pylint: disable=consider-using-with  (it ends on its own when this process does)
            [sys.executable, "-c", _EXIT_FILTER_CHILD, os.path.abspath(__file__)],
            stdin=read_end, stdout=real_stderr, stderr=real_stderr, close_fds=True, start_new_session=True)
        os.dup2(write_end, 2)
        for descriptor in (read_end, write_end, real_stderr):
            os.close(descriptor)
    except OSError:  # no process or pipe left to spare: the lines stay as they are
        pass


# The first line of a native log record: its level letter, date and time (absl's and TF's format).
_NATIVE_RECORD = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d")


def kept_native_lines(lines):
    """The native `lines` (an iterable) without known noise records and, at the C++ log level asked for, INFO ones.

    A native record is its first line (level letter, date, time) and the
    lines up to the next record (a SessionOptions dump; gRPC's "Additional
    GRPC error information" lines): a record is dropped whole. TF reads its
    C++ log level once, so in a process that imported TF before tf_psx set
    it INFO records still print; the level asked for ($TF_CPP_MIN_LOG_LEVEL,
    which `quiet_cpp_logs` sets to 1 unless the user set it) is applied
    here. Lines outside any record are dropped only when they are noise.
    """
    try:
        level = int(os.environ.get(CPP_LOG_LEVEL_ENV, "0"))
    except ValueError:
        level = 0
    dropping = False
    for line in lines:
        record = _NATIVE_RECORD.match(line)
        if record is not None:
            dropping = (record.group(1) == "I" and level >= 1) or is_noise(line)
        if not dropping and not is_noise(line):
            yield line


class _QuietTensorFlowImport(importlib.abc.MetaPathFinder):
    """Runs the first `import tensorflow` inside `native_stderr_filtered` (one use, then it removes itself)."""

    def find_spec(self, fullname, path=None, target=None):  # pylint: disable=unused-argument
        if fullname != "tensorflow":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _FilteredLoader(spec.loader)
        return spec


class _FilteredLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        with native_stderr_filtered():
            self._loader.exec_module(module)

    def __getattr__(self, name):  # is_package, get_code, get_source, ... as the real loader has them
        return getattr(self._loader, name)


def quiet_tensorflow_import() -> None:
    """The import of TensorFlow that follows (if any) prints no known noise; only before TF is imported."""
    if verbose() or "tensorflow" in sys.modules:
        return
    if not any(isinstance(finder, _QuietTensorFlowImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _QuietTensorFlowImport())


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
