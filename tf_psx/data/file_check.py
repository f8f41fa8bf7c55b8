"""The check of the Criteo files: malformed lines counted (`CriteoStats`) and warned about, in the background.

Malformed lines are skipped by the pipeline and counted by the process that
builds it: a background thread reads each file once (`CriteoStats`), with the
same rules as the pipeline (`tf_psx.data.layout.problem`), and warns
(`CriteoMalformedLineWarning`) with the `path:lineno` of each bad line. A
worker cannot report to the coordinator's Python, so the count is of the
lines in the files, not of the lines that training has reached.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import warnings

from tf_psx.data.files import is_remote, open_file
from tf_psx.data.layout import problem
from tf_psx.errors import StateError

__all__ = ["CriteoMalformedLineWarning", "CriteoStats"]

# Enough lines to see what is wrong with a file without flooding the log
# when a 1 TB file is broken throughout; the rest are counted in one summary.
MAX_WARNINGS_PER_FILE = 10
# At exit, how long the file check may take to notice the stop flag (it looks
# at it once a line, so it stops within microseconds unless a read blocks).
CHECK_STOP_GRACE_S = 2.0


class CriteoMalformedLineWarning(UserWarning):
    """A line of a Criteo file is malformed; the reader skips it.

    Issued by the check of each file (see `CriteoStats`), once per file per
    process. To refuse files with malformed lines, make the warning an
    error: `warnings.simplefilter("error", CriteoMalformedLineWarning)`;
    reading the counts of a `CriteoStats` (or its `wait()`) then raises it.
    The pipeline itself never stops on a bad line.
    """


class CriteoStats:
    """What the check of the files of one or more readers found (thread-safe).

    A reader's `dataset()` starts a check of each of its files in a
    background thread of this process (the coordinator), which reads the
    file once with the pipeline's rules; the pipeline itself, which may run
    on a `ParameterServerStrategy` worker, cannot count into Python. So the
    counts are of the lines in the files: a line in a file read for 3 epochs
    is counted once, and the counts do not wait for training to reach it.
    Each file (path, size and modification time) is checked once per
    process; readers that share a `CriteoStats` count each file once.

    Reading a count waits until every file of the readers is checked (see
    `done` and `wait`).

    Example:

    >>> import os, tempfile, warnings
    >>> from tf_psx.data import criteo, write_criteo_sample
    >>> tmp = tempfile.TemporaryDirectory()
    >>> sample = write_criteo_sample(os.path.join(tmp.name, "day_0.tsv"), 200, seed=0, malformed=3)
    >>> stats = CriteoStats()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always", CriteoMalformedLineWarning)
    ...     batches = [int(label.shape[0]) for _, label in criteo(sample.path, 64, stats=stats)]
    ...     done = stats.wait()  # the warnings come from the check, in the background
    >>> batches, done, stats.rows, stats.malformed
    ([64, 64, 64, 8], True, 200, 3)
    >>> stats.malformed_by_file == {sample.path: 3}
    True
    >>> messages = [str(w.message) for w in caught if w.category is CriteoMalformedLineWarning]
    >>> messages[0] == f"{sample.path}:{sample.malformed_lines[0]}: skipped malformed line: expected 40 TSV fields, found 39"
    True
    >>> tmp.cleanup()

    Attributes:
      rows: well-formed lines in the checked files.
      malformed: malformed lines in them (which the reader skips).
      files_checked: files checked.
      malformed_by_file: path -> malformed lines, for files that have some.
      done: True when no check of the readers' files is pending.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rows = 0
        self._malformed = 0
        self._files = 0
        self._by_file: dict[str, int] = {}
        self._pending = 0
        self._counted: set = set()
        self._errors: list[BaseException] = []

    def __repr__(self) -> str:
        with self._cond:
            return (
                f"CriteoStats(rows={self._rows}, malformed={self._malformed}, files_checked={self._files}, "
                f"malformed_by_file={self._by_file!r}, done={self._pending == 0})"
            )

    @property
    def done(self) -> bool:
        """True when every file the readers read has been checked."""
        with self._cond:
            return self._pending == 0

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits until every file the readers read has been checked.

        Args:
          timeout_s: the longest wait in seconds; None waits as long as the
            check takes (about 10**5 lines/s for one file at a time).

        Returns:
          True when the check is done, False when `timeout_s` passed first.

        Raises:
          OSError: a file could not be read.
          CriteoMalformedLineWarning: when warnings of that class are errors.
        """
        with self._cond:
            done = self._cond.wait_for(lambda: self._pending == 0, timeout_s)
            if done and self._errors:
                raise self._errors[0]
            return done

    @property
    def rows(self) -> int:
        """Well-formed lines in the checked files (waits for the check)."""
        self.wait()
        return self._rows

    @property
    def malformed(self) -> int:
        """Malformed lines in the checked files (waits for the check)."""
        self.wait()
        return self._malformed

    @property
    def files_checked(self) -> int:
        """Files checked (waits for the check)."""
        self.wait()
        return self._files

    @property
    def malformed_by_file(self) -> dict:
        """Path -> malformed lines, for the checked files that have some (waits for the check)."""
        self.wait()
        with self._cond:
            return dict(self._by_file)

    def _subscribe(self) -> None:
        """Counts one more file check to wait for (called by the reader)."""
        with self._cond:
            self._pending += 1

    def _add(self, check: "_FileCheck", subscribed: bool) -> None:
        """Adds a finished file check's counts, once per file (called by the reader)."""
        with self._cond:
            if subscribed:
                self._pending -= 1
            if check.error is not None:
                self._errors.append(check.error)
            elif check.key not in self._counted:
                self._counted.add(check.key)
                self._rows += check.rows
                self._malformed += check.malformed
                self._files += 1
                if check.malformed:
                    self._by_file[check.path] = self._by_file.get(check.path, 0) + check.malformed
            self._cond.notify_all()


# --- the check of the files, in a background thread of this process ---


class _CheckStopped(StateError):
    """The process exits before the check of a file ended."""


class _FileCheck:
    """One pass over one file: its counts, and the stats waiting for them."""

    def __init__(self, key: tuple, path: str, layout: str, has_header: bool):
        self.key = key
        self.path = path
        self.layout = layout
        self.has_header = has_header
        self.rows = 0
        self.malformed = 0
        self.error: BaseException | None = None
        self.done = False
        self.subscribers: list[CriteoStats] = []


# One check per file version in the process; later readers reuse its counts.
_file_checks: dict[tuple, _FileCheck] = {}
_file_checks_lock = threading.Lock()
_check_queue: "queue.SimpleQueue[_FileCheck | None]" = queue.SimpleQueue()
_check_stop = threading.Event()
_checker: list[threading.Thread] = []  # the one checker thread, once started


def _file_key(path: str, layout: str, has_header: bool) -> tuple:
    """Identifies a version of a file: a rewritten file is checked again."""
    # A file gone since construction gets no version; its check reports it.
    version = None
    if is_remote(path):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        try:
            stat = tf.io.gfile.stat(path)
            version = (stat.length, stat.mtime_nsec)
        except tf.errors.OpError:
            pass
    else:
        try:
            stat = os.stat(path)
            version = (stat.st_size, stat.st_mtime_ns)
        except OSError:
            pass
    return (path, layout, has_header, version)


def watch(stats: CriteoStats, path: str, layout: str, has_header: bool) -> None:
    """Counts `path` into `stats`, checking it first unless that was done."""
    key = _file_key(path, layout, has_header)
    with _file_checks_lock:
        check = _file_checks.get(key)
        if check is None:
            check = _file_checks[key] = _FileCheck(key, path, layout, has_header)
            _check_queue.put(check)
            _start_checker()
        subscribed = not check.done
        if subscribed:
            check.subscribers.append(stats)
            stats._subscribe()  # pylint: disable=protected-access  (tf_psx's own class)
    if not subscribed:
        stats._add(check, subscribed=False)  # pylint: disable=protected-access  (tf_psx's own class)


def _start_checker() -> None:
    """Starts the checker thread (called with _file_checks_lock held)."""
    if _checker:
        return
    # A daemon thread, stopped at exit: a check of a 1 TB file must not keep
    # the process alive, and it only reads files (no TensorFlow op), so it
    # cannot race TensorFlow's own shutdown.
    thread = threading.Thread(target=_check_files, name="tf_psx-criteo-check", daemon=True)
    thread.start()
    _checker.append(thread)
    atexit.register(_stop_checker)


def _stop_checker() -> None:
    _check_stop.set()
    _check_queue.put(None)
    _checker[0].join(CHECK_STOP_GRACE_S)


def _check_files() -> None:
    while True:
        check = _check_queue.get()
        if check is None:
            return
        try:
            _scan(check)
        except Exception as err:  # pylint: disable=broad-except  # handed to every reader of the counts
            check.error = err
        finally:
            _finish(check)


def _finish(check: _FileCheck) -> None:
    with _file_checks_lock:
        check.done = True
        subscribers, check.subscribers = check.subscribers, []
        if check.error is not None and _file_checks.get(check.key) is check:
            del _file_checks[check.key]  # the next reader checks the file again
    for stats in subscribers:
        stats._add(check, subscribed=True)  # pylint: disable=protected-access  (tf_psx's own class)


def _scan(check: _FileCheck) -> None:
    """Counts the well-formed and malformed lines of one file; warns about the latter."""
    layout, path = check.layout, check.path
    rows = bad = 0
    with open_file(path) as f:
        lineno = 0
        if check.has_header:
            f.readline()
            lineno = 1
        for line in f:
            if _check_stop.is_set():
                raise _CheckStopped(f"{path}: the check stopped at line {lineno} because the process exits.")
            lineno += 1
            reason = problem(line, layout)
            if reason is None:
                rows += 1
                continue
            bad += 1
            if bad <= MAX_WARNINGS_PER_FILE:
                warnings.warn(f"{path}:{lineno}: skipped malformed line: {reason}", CriteoMalformedLineWarning, stacklevel=1)
    if bad > MAX_WARNINGS_PER_FILE:
        warnings.warn(
            f"{path}: skipped {bad} malformed lines in all; only the first {MAX_WARNINGS_PER_FILE} were shown.",
            CriteoMalformedLineWarning,
            stacklevel=1,
        )
    check.rows, check.malformed = rows, bad
