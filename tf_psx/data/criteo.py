"""A streaming `tf.data` reader for the Criteo click logs.

Reads the Criteo Display Advertising layout (the Kaggle 11 GB and Terabyte
1 TB files: tab-separated, no header, `label, I1..I13, C1..C26`) and its
CSV-with-header variant (`label,I1,...,C26`, dense values written as floats).

Design: the dataset is built from TensorFlow ops only (`TextLineDataset` and
`tf.strings`), never from Python generators, so the same dataset works
wherever a user builds it: iterated in this process, or built inside a
`DatasetCreator`'s `dataset_fn`, whose dataset `ParameterServerStrategy`
runs on the workers. A Python-generator dataset (`from_generator`, the first
version of this reader) runs in the coordinator instead, and deleting a
worker's iterator of it after `fit` deadlocked the coordinator. A dataset
built eagerly is rebuilt from its serialized graph, so it holds no Python
function: one peeked before the cluster exists leaves the tasks nothing to
remove later ("Tried to remove non-existent function" errors).

Malformed lines are skipped by the pipeline and counted by the process that
builds it: a background thread reads each file once (`CriteoStats`), with the
same rules as the pipeline, and warns (`CriteoMalformedLineWarning`) with the
`path:lineno` of each bad line. A worker cannot report to the coordinator's
Python, so the count is of the lines in the files, not of the lines that
training has reached.

Note: the function `criteo` has the name of this module, so after
`import tf_psx.data` the attribute `tf_psx.data.criteo` is the function.
Module-level names are still reachable with
`from tf_psx.data.criteo import NUM_DENSE`.
"""

from __future__ import annotations

import atexit
import glob as _glob
import gzip
import math
import os
import queue
import re
import threading
import warnings
from typing import IO, Any, Callable, Literal, Sequence, Union, get_args

import numpy as np

from tf_psx import _checks, redaction as _redaction
from tf_psx._tf import data as _tf_data

__all__ = [
    "CriteoMalformedLineWarning",
    "CriteoReader",
    "CriteoStats",
    "criteo",
    "criteo_dataset_fn",
    "criteo_keys",
]

# The Criteo layout has 13 integer (count) features I1..I13 and 26 categorical
# features C1..C26 (32-bit hashes written as 8 hex digits); this is fixed by
# the published data set, for both the Kaggle and the Terabyte release.
NUM_DENSE = 13
NUM_CATEGORICAL = 26
# label + dense + categorical: the field count of every well-formed line.
NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL

DENSE_NAMES = tuple(f"I{i}" for i in range(1, NUM_DENSE + 1))
CATEGORICAL_NAMES = tuple(f"C{j}" for j in range(1, NUM_CATEGORICAL + 1))
# The header of the CSV variant (DeepCTR's criteo_sample.txt); columns are read
# by position, so any other header is refused rather than silently misread.
CSV_HEADER = ",".join(("label",) + DENSE_NAMES + CATEGORICAL_NAMES)
_HEADER_PREFIX = b"label,"

# Keys are Fingerprint64(salted value) mod 2**62: non-negative int64 keys
# (some hash tables reserve negative keys as empty/deleted markers) and, for
# the ~9e8 distinct values of Criteo Terabyte, about n**2 / 2**63 ~ 0.1
# expected colliding pairs in all.
HASH_KEY_SPACE = 2**62
# Hashed in place of an empty categorical field, so each column has its own
# "missing" key. Real values are 8 hex digits, so they never equal it.
MISSING_TOKEN = "<missing>"

# Enough lines to see what is wrong with a file without flooding the log
# when a 1 TB file is broken throughout; the rest are counted in one summary.
MAX_WARNINGS_PER_FILE = 10
# At exit, how long the file check may take to notice the stop flag (it looks
# at it once a line, so it stops within microseconds unless a read blocks).
CHECK_STOP_GRACE_S = 2.0
# Longest excerpt of a bad header or field quoted in a message.
_QUOTE_CHARS = 120

Format = Literal["auto", "tsv", "csv"]
FORMATS: tuple[str, ...] = get_args(Format)
_SEPARATORS = {"tsv": b"\t", "csv": b","}
# Labels as the two layouts write them ("0.0" appears in CSVs written by pandas).
_LABELS = (b"0", b"1", b"0.0", b"1.0")
# What a dense field must be, in both the pipeline (RE2) and the file check
# (Python re): an integer in the TSV layout, a decimal number in the CSV one.
# The exponent has at most 2 digits and the field at most _MAX_NUMBER_CHARS
# characters, so every accepted value converts to a finite float64 (at most
# 1e31 * 1e99): TensorFlow's StringToNumber stops the whole pipeline, rather
# than skipping the line, on a string of 32 characters or more, and "1e999"
# would be inf.
_TSV_NUMBER = r"[+-]?[0-9]+"
_CSV_NUMBER = r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]{1,2})?"
_MAX_NUMBER_CHARS = 31
_NUMBER_RE = {"tsv": re.compile(_TSV_NUMBER.encode()), "csv": re.compile(_CSV_NUMBER.encode())}
_NUMBER_KIND = {"tsv": "an integer", "csv": "a decimal number"}
# A CSV field in double quotes is read without them (no escapes: Criteo files
# have no quotes, and a quoted comma splits the field like any comma).
_QUOTED = r'^"(.*)"$'
_QUOTED_RE = re.compile(rb'"(.*)"')
_LINE_END = r"[\r\n]+$"
# Lines parsed together by one call of the parse function.
_PARSE_CHUNK = 1024
_GLOB_CHARS = "*?["

PathLike = Union[str, "os.PathLike[str]"]


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


class _CheckStopped(RuntimeError):
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
    if _is_remote(path):
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


def _watch(stats: CriteoStats, path: str, layout: str, has_header: bool) -> None:
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
    with _open(path) as f:
        lineno = 0
        if check.has_header:
            f.readline()
            lineno = 1
        for line in f:
            if _check_stop.is_set():
                raise _CheckStopped(f"{path}: the check stopped at line {lineno} because the process exits.")
            lineno += 1
            reason = _problem(line, layout)
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


def _split(line: bytes, layout: str) -> list[bytes]:
    """A line's fields, as the pipeline splits them (see `CriteoReader._parse`)."""
    line = line.rstrip(b"\r\n")
    fields = line.split(_SEPARATORS[layout])
    if layout == "csv":
        fields = [m.group(1) if (m := _QUOTED_RE.fullmatch(v)) else v for v in fields]
    return fields


def _problem(line: bytes, layout: str) -> str | None:
    """Why the pipeline skips `line`, or None when it reads it."""
    fields = _split(line, layout)
    if len(fields) != NUM_FIELDS:
        return f"expected {NUM_FIELDS} {layout.upper()} fields, found {len(fields)}"
    if fields[0] not in _LABELS:
        return f"label must be 0 or 1; received {_quote(fields[0])}"
    number = _NUMBER_RE[layout]
    for name, value in zip(DENSE_NAMES, fields[1 : 1 + NUM_DENSE]):
        if value and (len(value) > _MAX_NUMBER_CHARS or not number.fullmatch(value)):
            return (
                f"{name} must be {_NUMBER_KIND[layout]} of at most {_MAX_NUMBER_CHARS} characters, or empty; "
                f"received {_quote(value)}"
            )
    return None


def _quote(value: bytes) -> str:
    return _redaction.show(repr(value[:_QUOTE_CHARS].decode("utf-8", "replace")))


# --- keys and files ---


def criteo_keys(cat, vocab_size: int | None = None):
    """Turns raw Criteo categorical strings into int64 keys.

    key = Fingerprint64(f"C{j}:{value}") mod (vocab_size or 2**62) for column
    j in 1..26, with `value` = "<missing>" for an empty field. The column salt
    keeps equal strings in different columns apart; Fingerprint64
    (`tf.strings.to_hash_bucket_fast`) is stable across platforms and TF
    versions, so serving can call this function on raw strings and get the
    training keys.

    Example:

    >>> import tensorflow as tf
    >>> keys = criteo_keys(tf.constant([["05db9164"] * 26, [""] * 26]), vocab_size=1000)
    >>> keys.shape, keys.dtype.name
    (TensorShape([2, 26]), 'int64')
    >>> bool(keys[0, 0] != keys[0, 1])  # same string, columns C1 and C2
    True
    >>> int(keys[1, 0]) == int(tf.strings.to_hash_bucket_fast("C1:<missing>", 1000))
    True

    Args:
      cat: string [..., 26], the values of C1..C26 (empty = missing).
      vocab_size: None for keys in [0, 2**62) (for a hash-table embedding), or
        N for keys in [0, N) (for a fixed-size embedding table).

    Returns:
      int64 [..., 26].
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    cat = tf.convert_to_tensor(cat, dtype=tf.string)
    prefixes = tf.constant([f"{name}:" for name in CATEGORICAL_NAMES])
    values = tf.where(tf.equal(cat, ""), MISSING_TOKEN, cat)
    salted = tf.strings.join([tf.broadcast_to(prefixes, tf.shape(values)), values])
    return tf.strings.to_hash_bucket_fast(salted, HASH_KEY_SPACE if vocab_size is None else vocab_size)


def _is_remote(path: str) -> bool:
    return "://" in path


def _expand(paths: PathLike | Sequence[PathLike]) -> list[str]:
    """Paths and glob patterns -> file list (a pattern's matches are sorted)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise ValueError("Argument `paths` must name at least one file. Received: [].")
    files: list[str] = []
    for path in paths:
        if any(c in path for c in _GLOB_CHARS):
            if _is_remote(path):
                import tensorflow as tf  # pylint: disable=import-outside-toplevel

                matches = sorted(tf.io.gfile.glob(path))
            else:
                matches = sorted(_glob.glob(path))
            if not matches:
                raise FileNotFoundError(f"No Criteo file matches the pattern {path!r}. Fix: check the pattern and the directory.")
            files.extend(matches)
            continue
        if _is_remote(path):
            import tensorflow as tf  # pylint: disable=import-outside-toplevel

            exists = tf.io.gfile.exists(path)
        else:
            exists = os.path.isfile(path)
        if not exists:
            raise FileNotFoundError(f"Criteo file {path!r} does not exist. Fix: pass an existing file or a glob pattern.")
        files.append(path)
    return files


def _open(path: str) -> IO[bytes]:
    """Opens a file for streaming binary reads (gzip when it ends in .gz)."""
    if _is_remote(path):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        raw = tf.io.gfile.GFile(path, "rb")
        return gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")  # pylint: disable=consider-using-with


def _detect(path: str, fmt: str) -> tuple[str, bool]:
    """Returns (layout, has_header) from the first line of `path`."""
    with _open(path) as f:
        first = f.readline()
    is_header = first.startswith(_HEADER_PREFIX)
    if is_header:
        received = first.rstrip(b"\r\n").decode("utf-8", "replace")
        if fmt == "tsv":
            raise ValueError(
                f"{path}: format='tsv' but the file starts with a CSV header "
                f"({_redaction.show(repr(received[:_QUOTE_CHARS]))}). "
                "Fix: pass format='csv' or format='auto'."
            )
        if received != CSV_HEADER:
            raise ValueError(
                f"{path}: the CSV header must be {CSV_HEADER!r} (columns are read by position); "
                f"received {_redaction.show(repr(received[:_QUOTE_CHARS]))}. Fix: write the columns in this order."
            )
        return "csv", True
    if fmt != "auto":
        return fmt, False
    # A headerless file: tabs mean the original layout, commas a bare CSV.
    if b"\t" not in first and b"," in first:
        return "csv", False
    return "tsv", False


class CriteoReader:
    """Streams Criteo files into `({"dense", "cat"}, label)` batches.

    Each element is `(features, label)`:

    * `features["dense"]`: float32 [batch, 13], log1p(max(I, 0)) for
      I1..I13. Negative counts (I2 has -1, -2, -3) are clipped at 0 first;
      a missing value becomes `dense_missing_value` (default 0, which is also
      what a zero count gives).
    * `features["cat"]`: int64 [batch, 26], see `criteo_keys`: keys in
      [0, 2**62) for a hash-table embedding, or [0, vocab_size).
    * `label`: float32 [batch], 0 or 1 (Keras losses broadcast it against
      a [batch, 1] prediction).

    The dataset is made of TensorFlow ops only (`TextLineDataset`,
    `tf.strings`), so it can be built anywhere: iterated here, or built in a
    `DatasetCreator`'s `dataset_fn`, where `ParameterServerStrategy` runs it
    on each worker, before or after the cluster is created.

    A line is malformed when it does not have 40 fields, its label is not
    0/1 (or 0.0/1.0), or a dense field is neither empty nor an integer (a
    decimal number in the CSV variant, exponent of at most 2 digits) of at
    most 31 characters. The pipeline skips it; `dataset()` also starts a
    check of the files in this process that counts such lines in `stats`
    and warns about each (`CriteoMalformedLineWarning` "{path}:{lineno}:
    skipped malformed line: {reason}", the first `MAX_WARNINGS_PER_FILE` of
    each file, then one summary). Categorical values are hashed as they are:
    a non-hex value is not an error. A CSV field in double quotes is read
    without them.

    With an `input_context` the reader reads pipeline `input_pipeline_id`'s
    share: whole files when there are at least `num_input_pipelines` files
    (file i goes to pipeline i % num_input_pipelines), else lines (data line
    k of the concatenated files, header excluded, goes to pipeline
    k % num_input_pipelines). `ParameterServerStrategy` gives every worker
    a pipeline of one, so every worker reads all files; with
    `shuffle_buffer` > 0 each worker has its own order unless `seed` (or
    `tf.random.set_seed`) fixes one for all.

    Example:

    >>> import os, tempfile
    >>> from tf_psx.data import write_criteo_sample
    >>> tmp = tempfile.TemporaryDirectory()
    >>> sample = write_criteo_sample(os.path.join(tmp.name, "day_0.tsv"), 200, seed=0)
    >>> reader = CriteoReader(sample.path, batch_size=64)
    >>> features, label = next(iter(reader.dataset()))
    >>> features["dense"].shape, features["cat"].dtype.name, label.shape
    (TensorShape([64, 13]), 'int64', TensorShape([64]))
    >>> label.numpy().tolist() == sample.labels[:64].tolist()  # in file order
    True
    >>> sum(int(lab.shape[0]) for _, lab in reader.dataset()), reader.stats.malformed
    (200, 0)
    >>> tmp.cleanup()

    Known limitations:

    * `stats` counts the lines of whole files, read once by this process
      (about 10**5 lines/s, one file at a time, in the background): not
      what training has consumed, and for terabytes of data it is ready
      hours after training starts. The files must be readable here too.
    * Sharding by line makes every pipeline read every line (it parses only
      its own); give at least as many files as pipelines for real data.
    * Shuffling mixes rows within `shuffle_buffer`; the file order is kept.

    Args:
      paths: a file, a glob pattern, or a list of them (".gz" files are
        decompressed; "gs://"-style paths go through `tf.io.gfile`).
      batch_size: rows per batch this dataset yields (>= 1): the per-worker
        batch under ParameterServerStrategy.
      format: "auto" (per file: a "label," header means CSV, else TSV),
        "tsv" or "csv".
      vocab_size: None for keys in [0, 2**62), or N >= 1 for keys in [0, N).
      shuffle_buffer: rows in the shuffle buffer; 0 keeps the file order.
      repeat: read the files forever (what ParameterServerStrategy's `fit`
        needs, with `steps_per_epoch`).
      num_epochs: read the files this many times (>= 1); default 1. Batches
        run across epoch boundaries.
      drop_remainder: drop the last batch when it has fewer rows.
      dense_missing_value: the dense output for a missing value.
      input_context: a `tf.distribute.InputContext`, or None to read all.
      seed: the shuffle seed.
      stats: a `CriteoStats` to count into (may be shared by readers);
        default a new one.

    Raises:
      ValueError: for an invalid argument, or a CSV file whose header is not
        `CSV_HEADER`.
      FileNotFoundError: when a path does not exist or a pattern matches
        nothing.
    """

    def __init__(
        self,
        paths: PathLike | Sequence[PathLike],
        batch_size: int,
        *,
        format: Format = "auto",  # pylint: disable=redefined-builtin
        vocab_size: int | None = None,
        shuffle_buffer: int = 0,
        repeat: bool = False,
        num_epochs: int | None = None,
        drop_remainder: bool = False,
        dense_missing_value: float = 0.0,
        input_context: Any = None,
        seed: int | None = None,
        stats: CriteoStats | None = None,
    ):
        _checks.int_at_least(batch_size, 1, "batch_size")
        if format not in FORMATS:
            raise ValueError(f"Argument `format` must be one of {FORMATS}. Received: {format!r}.")
        _checks.int_at_least(vocab_size, 1, "vocab_size", or_none=True)
        _checks.int_at_least(shuffle_buffer, 0, "shuffle_buffer")
        _checks.int_at_least(num_epochs, 1, "num_epochs", or_none=True)
        if num_epochs is not None:
            if repeat:
                raise ValueError(
                    f"Arguments `repeat=True` and `num_epochs={num_epochs!r}` contradict each other. "
                    "Fix: pass repeat=True to read forever, or num_epochs=N to read N times."
                )
        if not isinstance(dense_missing_value, (int, float)) or not math.isfinite(dense_missing_value):
            raise ValueError(f"Argument `dense_missing_value` must be a finite number. Received: {dense_missing_value!r}.")
        if stats is not None and not isinstance(stats, CriteoStats):
            raise TypeError(
                f"Argument `stats` must be a tf_psx.data.CriteoStats or None. Received: {stats!r}. "
                "Fix: pass stats=tf_psx.data.CriteoStats(), and read its counts after reading the data."
            )
        all_files = _expand(paths)
        num_pipelines, pipeline_id = 1, 0
        if input_context is not None:
            num_pipelines = input_context.num_input_pipelines
            pipeline_id = input_context.input_pipeline_id
            if not 0 <= pipeline_id < num_pipelines:
                raise ValueError(
                    f"input_context.input_pipeline_id must be in [0, {num_pipelines}). Received: {pipeline_id!r}."
                )
        if len(all_files) >= num_pipelines:
            self.files = tuple(all_files[pipeline_id::num_pipelines])
            self.line_shard = (1, 0)
        else:
            self.files = tuple(all_files)
            self.line_shard = (num_pipelines, pipeline_id)
        self._layouts = tuple(_detect(path, format) for path in self.files)
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.shuffle_buffer = shuffle_buffer
        self.num_epochs = None if repeat else (num_epochs or 1)
        self.drop_remainder = drop_remainder
        self.dense_missing_value = float(dense_missing_value)
        self.seed = seed
        self.stats = stats if stats is not None else CriteoStats()

    @property
    def formats(self) -> tuple[str, ...]:
        """The layout ("tsv" or "csv") of each file in `files`."""
        return tuple(layout for layout, _ in self._layouts)

    def dataset(self):
        """Returns the `tf.data.Dataset` of `(features, label)` batches.

        Also starts the check of the files that fills `stats` (once per file
        per process). Built eagerly, the dataset is returned detached from
        the Python functions it was built with, so that it may outlive a
        later connection to a cluster; in a graph (a `dataset_fn` that
        `ParameterServerStrategy` traces) it is returned as built.
        """
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        for path, (layout, has_header) in zip(self.files, self._layouts):
            _watch(self.stats, path, layout, has_header)
        if tf.executing_eagerly():
            return _tf_data.dataset_without_python_functions(self._pipeline())
        return self._pipeline()

    def graph_dataset(self):
        """The same as `dataset()` (the name from when `dataset()` parsed in Python)."""
        return self.dataset()

    def _pipeline(self):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        num_pipelines, pipeline_id = self.line_shard
        if num_pipelines > 1:
            chunks = self._sharded_chunks(num_pipelines, pipeline_id)
        else:
            # Each file in chunks of its own, parsed by the ops of its layout only.
            chunks = None
            for path, (layout, has_header) in zip(self.files, self._layouts):
                file_lines = self._file_lines(path, has_header)
                file_chunks = file_lines.batch(_PARSE_CHUNK).map(
                    lambda lines, csv=(layout == "csv"): self._parse_many(lines, csv),
                    num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
                chunks = file_chunks if chunks is None else chunks.concatenate(file_chunks)
        chunks = chunks.repeat(self.num_epochs)

        def keep(ok, label, dense, cat):
            return tf.boolean_mask(label, ok), tf.boolean_mask(dense, ok), tf.boolean_mask(cat, ok)

        rows = chunks.map(keep, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if self.shuffle_buffer > 0:
            ds = rows.unbatch().shuffle(self.shuffle_buffer, seed=self.seed).batch(self.batch_size, self.drop_remainder)
        else:
            ds = rows.rebatch(self.batch_size, self.drop_remainder)
        vocab_size = self.vocab_size

        def to_features(label, dense, cat):
            return {"dense": dense, "cat": criteo_keys(cat, vocab_size)}, label

        return ds.map(to_features, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)

    @staticmethod
    def _file_lines(path: str, has_header: bool):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        lines = tf.data.TextLineDataset(path, compression_type="GZIP" if path.endswith(".gz") else None)
        return lines.skip(1) if has_header else lines

    def _sharded_chunks(self, num_pipelines: int, pipeline_id: int):
        """Chunks of this pipeline's lines when they are split by line (data line k of all files -> k % n)."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        lines = None
        for path, (layout, has_header) in zip(self.files, self._layouts):
            is_csv = layout == "csv"
            file_lines = self._file_lines(path, has_header).map(lambda line, c=is_csv: (line, tf.constant(c)))
            lines = file_lines if lines is None else lines.concatenate(file_lines)
        # The data-line index across one pass of the files, as the check counts lines.
        lines = lines.enumerate().filter(lambda index, _: index % num_pipelines == pipeline_id)
        lines = lines.map(lambda _, pair: pair)
        return lines.batch(_PARSE_CHUNK).map(self._parse_many, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    def _parse_many(self, line, is_csv):
        """A chunk of lines -> (ok [n], label [n], dense [n, 13], cat [n, 26]), by `_problem`'s rules.

        One string op per chunk instead of one per line (tf.data runs a
        map's function once per element).
        """
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        line = tf.strings.regex_replace(line, _LINE_END, "")
        width = NUM_FIELDS + 1  # one more than needed: a longer line is seen as longer

        def by_comma():
            split = tf.strings.split(line, ",")
            fields = tf.strings.regex_replace(split.to_tensor("", shape=[None, width]), _QUOTED, "\\1")
            return split.row_lengths(), fields

        def by_tab():
            split = tf.strings.split(line, "\t")
            return split.row_lengths(), split.to_tensor("", shape=[None, width])

        if isinstance(is_csv, bool):  # one file's chunk: only its layout's ops
            count, fields = by_comma() if is_csv else by_tab()
        else:
            (comma_count, comma_fields), (tab_count, tab_fields) = by_comma(), by_tab()
            count = tf.where(is_csv, comma_count, tab_count)
            fields = tf.where(tf.reshape(is_csv, [-1, 1]), comma_fields, tab_fields)
        fields = fields[:, :NUM_FIELDS]
        ok = tf.equal(count, NUM_FIELDS)
        label_text, dense_text, cat = fields[:, 0], fields[:, 1 : 1 + NUM_DENSE], fields[:, 1 + NUM_DENSE :]
        labels = tf.constant([v.decode() for v in _LABELS])
        ok = ok & tf.reduce_any(tf.equal(tf.reshape(label_text, [-1, 1]), labels), axis=1)
        if isinstance(is_csv, bool):
            matches = tf.strings.regex_full_match(dense_text, _CSV_NUMBER if is_csv else _TSV_NUMBER)
        else:
            matches = tf.where(tf.reshape(is_csv, [-1, 1]), tf.strings.regex_full_match(dense_text, _CSV_NUMBER),
                               tf.strings.regex_full_match(dense_text, _TSV_NUMBER))
        empty = tf.equal(dense_text, "")
        valid = empty | ((tf.strings.length(dense_text) <= _MAX_NUMBER_CHARS) & matches)
        ok = ok & tf.reduce_all(valid, axis=1)
        raw = tf.strings.to_number(tf.where(valid & ~empty, dense_text, "0"), tf.float64)
        dense = tf.where(empty, tf.constant(self.dense_missing_value, tf.float64), tf.math.log1p(tf.maximum(raw, 0.0)))
        label = tf.strings.to_number(tf.where(ok, label_text, "0"), tf.float32)
        return ok, label, tf.cast(dense, tf.float32), cat


def criteo(paths: PathLike | Sequence[PathLike], batch_size: int, **kwargs):
    """Returns a `tf.data.Dataset` of Criteo `(features, label)` batches.

    The same as `CriteoReader(paths, batch_size, **kwargs).dataset()`: TF
    ops only, so it may be iterated here, or built inside a
    `DatasetCreator`'s `dataset_fn` for `ParameterServerStrategy`, and a
    batch of it may be peeked before or after the cluster exists. Pass `stats=CriteoStats()` to read how many
    lines the files hold and how many are malformed (skipped), per file.

    Example:

    >>> import os, tempfile
    >>> from tf_psx.data import write_criteo_sample
    >>> tmp = tempfile.TemporaryDirectory()
    >>> path = os.path.join(tmp.name, "day_0.csv")
    >>> _ = write_criteo_sample(path, 200, layout="csv", seed=0)
    >>> stats = CriteoStats()
    >>> ds = criteo(path, 128, vocab_size=1000, stats=stats)
    >>> [int(label.shape[0]) for _, label in ds]
    [128, 72]
    >>> stats.rows, stats.malformed
    (200, 0)
    >>> tmp.cleanup()

    Args:
      paths: files or glob patterns (see `CriteoReader`).
      batch_size: rows per batch.
      **kwargs: the keyword arguments of `CriteoReader`.

    Returns:
      A dataset of ({"dense": float32 [batch, 13], "cat": int64 [batch, 26]},
      float32 [batch]).
    """
    return CriteoReader(paths, batch_size, **kwargs).dataset()


def criteo_dataset_fn(paths: PathLike | Sequence[PathLike], batch_size: int, **kwargs) -> Callable[[Any], Any]:
    """Returns `dataset_fn(input_context)` for `DatasetCreator`.

    Each call builds `criteo(paths, batch_size, input_context=input_context,
    **kwargs)`, so each worker reads its own share of `paths` (see
    `CriteoReader`). The arguments, paths and CSV headers are validated
    here, on the caller, before anything connects. `stats`, when given,
    counts the malformed lines (see `CriteoStats`).

    Example:

    >>> import os, tempfile, tensorflow as tf
    >>> from tf_psx.data import write_criteo_sample
    >>> tmp = tempfile.TemporaryDirectory()
    >>> sample = write_criteo_sample(os.path.join(tmp.name, "day_0.tsv"), 200, seed=0)
    >>> fn = criteo_dataset_fn(sample.path, 50)
    >>> half = fn(tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1))
    >>> labels = [float(x) for _, label in half for x in label]
    >>> len(labels), labels == sample.labels[1::2].tolist()  # data lines 1, 3, 5, ...
    (100, True)
    >>> tmp.cleanup()

    Args:
      paths: files or glob patterns.
      batch_size: rows per batch on each worker.
      **kwargs: the keyword arguments of `CriteoReader` but `input_context`;
        pass repeat=True for ParameterServerStrategy's `fit`.

    Returns:
      A function of a `tf.distribute.InputContext` that returns the dataset.

    Raises:
      ValueError: for `input_context` in kwargs, or what `CriteoReader`
        refuses.
      FileNotFoundError: when a path does not exist or a pattern matches
        nothing.
    """
    if "input_context" in kwargs:
        raise ValueError(
            "Argument `input_context` is given by DatasetCreator to the returned dataset_fn. "
            "Fix: drop it from criteo_dataset_fn's arguments."
        )
    CriteoReader(paths, batch_size, **kwargs)  # validate now, on the coordinator

    def dataset_fn(input_context=None):
        return criteo(paths, batch_size, input_context=input_context, **kwargs)

    return dataset_fn
