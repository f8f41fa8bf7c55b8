"""A streaming `tf.data` reader for the Criteo click logs.

Reads the Criteo Display Advertising layout (the Kaggle 11 GB and Terabyte
1 TB files: tab-separated, no header, `label, I1..I13, C1..C26`) and its
CSV-with-header variant (`label,I1,...,C26`, dense values written as floats).
Files are read line by line, never whole; each line is checked, and a bad
line is skipped, counted in `CriteoStats` and reported with its
`path:lineno`.

Note: the function `criteo` has the name of this module, so after
`import tf_psx.data` the attribute `tf_psx.data.criteo` is the function.
Module-level names are still reachable with
`from tf_psx.data.criteo import NUM_DENSE`.
"""

from __future__ import annotations

import csv
import dataclasses
import glob as _glob
import gzip
import math
import os
import threading
import warnings
from typing import IO, Any, Callable, Iterator, Literal, Sequence, Union, get_args

import numpy as np

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

# Enough lines to see what is wrong with a file without flooding a worker log
# when a 1 TB file is broken throughout; the rest are counted in one summary.
MAX_WARNINGS_PER_FILE = 10
# Rows per element handed from Python to tf.data when rows are shuffled: large
# enough to amortize the Python->tensor conversion, small enough that the
# shuffle buffer starts filling at once.
SHUFFLE_CHUNK_ROWS = 1024
# Longest excerpt of a bad header quoted in an error message.
_QUOTE_CHARS = 120

Format = Literal["auto", "tsv", "csv"]
FORMATS: tuple[str, ...] = get_args(Format)
_SEPARATORS = {"tsv": b"\t", "csv": b","}
# Labels as the two layouts write them ("0.0" appears in CSVs written by pandas).
_LABELS = {b"0": 0.0, b"1": 1.0, b"0.0": 0.0, b"1.0": 1.0}
_NAN = float("nan")
# What `graph_dataset` accepts as a dense value: what int() takes in the TSV
# layout, and a finite float in the CSV one (what `_rows` accepts, minus
# Python's underscores and surrounding spaces, which Criteo files never have).
_TSV_NUMBER = r"[+-]?[0-9]+"
_CSV_NUMBER = r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?"
_GLOB_CHARS = "*?["

PathLike = Union[str, "os.PathLike[str]"]


class CriteoMalformedLineWarning(UserWarning):
    """A line of a Criteo file was skipped because it is malformed.

    To stop at the first bad line instead, turn the warning into an error:
    `warnings.simplefilter("error", CriteoMalformedLineWarning)`.
    """


@dataclasses.dataclass
class CriteoStats:
    """Counters of one or more readers (thread-safe; may be shared).

    The counters move when the reader parses, which under `prefetch` and
    `shuffle` is ahead of what the model has consumed.

    Attributes:
      rows: well-formed rows parsed and handed to tf.data.
      malformed: lines skipped as malformed.
      files_read: file passes completed (a file read in 2 epochs counts 2).
      malformed_by_file: path -> lines skipped in that file.
    """

    rows: int = 0
    malformed: int = 0
    files_read: int = 0
    malformed_by_file: dict = dataclasses.field(default_factory=dict)
    _lock: Any = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def _add_rows(self, n: int) -> None:
        with self._lock:
            self.rows += n

    def _add_malformed(self, path: str) -> None:
        with self._lock:
            self.malformed += 1
            self.malformed_by_file[path] = self.malformed_by_file.get(path, 0) + 1

    def _add_file(self) -> None:
        with self._lock:
            self.files_read += 1


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
                f"{path}: format='tsv' but the file starts with a CSV header ({received[:_QUOTE_CHARS]!r}). "
                "Fix: pass format='csv' or format='auto'."
            )
        if received != CSV_HEADER:
            raise ValueError(
                f"{path}: the CSV header must be {CSV_HEADER!r} (columns are read by position); "
                f"received {received[:_QUOTE_CHARS]!r}. Fix: write the columns in this order."
            )
        return "csv", True
    if fmt != "auto":
        return fmt, False
    # A headerless file: tabs mean the original layout, commas a bare CSV.
    if b"\t" not in first and b"," in first:
        return "csv", False
    return "tsv", False


def _csv_float(text: bytes) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


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

    A line is malformed when it does not have 40 fields, its label is not
    0/1, or a dense field is neither empty nor an integer (a finite number
    in the CSV variant). It is skipped, counted in `stats`, and reported as a
    `CriteoMalformedLineWarning` "{path}:{lineno}: skipped malformed line:
    {reason}" (the first `MAX_WARNINGS_PER_FILE` of each file pass, then one
    summary). Categorical values are hashed as they are: a non-hex value is
    not an error.

    With an `input_context` the reader reads pipeline `input_pipeline_id`'s
    share: whole files when there are at least `num_input_pipelines` files
    (file i goes to pipeline i % num_input_pipelines), else lines (data line
    k of the concatenated files, header excluded, goes to pipeline
    k % num_input_pipelines).

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

    * `dataset()` parses in Python (`tf.data.Dataset.from_generator`), at
      roughly 10^5 rows/s per reader on one core. Under
      `ParameterServerStrategy` such a generator runs in the coordinator
      (chief) process, not on the workers (tensorflow/tensorflow#48957), and
      deleting the workers' iterators after `fit` deadlocked the chief's
      next eager op (measured: 3 runs in 5 of examples/criteo_ps.py). Use
      `graph_dataset()` there (`criteo_dataset_fn` does): TensorFlow ops
      only, parsed on the workers, but with no `stats` and no warnings.
    * Sharding by line makes every pipeline read every line (it parses only
      its own); give at least as many files as pipelines for real data.
    * Shuffling mixes rows within `shuffle_buffer`; the file order is kept.
    * `stats` counts what was parsed, which runs ahead of training.

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
        _check_int("batch_size", batch_size, 1)
        if format not in FORMATS:
            raise ValueError(f"Argument `format` must be one of {FORMATS}. Received: {format!r}.")
        if vocab_size is not None:
            _check_int("vocab_size", vocab_size, 1, "or None")
        _check_int("shuffle_buffer", shuffle_buffer, 0)
        if num_epochs is not None:
            _check_int("num_epochs", num_epochs, 1, "or None")
            if repeat:
                raise ValueError(
                    f"Arguments `repeat=True` and `num_epochs={num_epochs!r}` contradict each other. "
                    "Fix: pass repeat=True to read forever, or num_epochs=N to read N times."
                )
        if not isinstance(dense_missing_value, (int, float)) or not math.isfinite(dense_missing_value):
            raise ValueError(f"Argument `dense_missing_value` must be a finite number. Received: {dense_missing_value!r}.")
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
        """Returns the `tf.data.Dataset` of `(features, label)` batches."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        shuffled = self.shuffle_buffer > 0
        static_batch = self.batch_size if (self.drop_remainder and not shuffled) else None
        signature = (
            tf.TensorSpec([static_batch], tf.float32),
            tf.TensorSpec([static_batch, NUM_DENSE], tf.float32),
            tf.TensorSpec([static_batch, NUM_CATEGORICAL], tf.string),
        )
        if shuffled:
            ds = tf.data.Dataset.from_generator(lambda: self._batches(SHUFFLE_CHUNK_ROWS, False), output_signature=signature)
            ds = ds.unbatch().shuffle(self.shuffle_buffer, seed=self.seed).batch(self.batch_size, self.drop_remainder)
        else:
            ds = tf.data.Dataset.from_generator(
                lambda: self._batches(self.batch_size, self.drop_remainder), output_signature=signature
            )
        vocab_size = self.vocab_size

        def to_features(label, dense, cat):
            return {"dense": dense, "cat": criteo_keys(cat, vocab_size)}, label

        return ds.map(to_features, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)

    def graph_dataset(self):
        """Returns the same batches as `dataset()`, parsed by TensorFlow ops only.

        No Python runs per element: the pipeline is `TextLineDataset` and
        `tf.strings` ops, so it runs wherever tf.data places it, e.g. on a
        `ParameterServerStrategy` worker. `criteo_dataset_fn` uses it.

        The differences from `dataset()`: malformed lines are skipped by the
        same rules but neither counted in `stats` nor warned about (a worker
        cannot reach the coordinator's Python); a quoted CSV field is
        unquoted, and one holding a comma makes its line malformed; the
        shuffle order differs.

        Example:

        >>> import os, tempfile
        >>> from tf_psx.data import write_criteo_sample
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = os.path.join(tmp.name, "day_0.tsv")
        >>> sample = write_criteo_sample(path, 200, seed=0, malformed=3)
        >>> reader = CriteoReader(path, batch_size=64)
        >>> labels = [float(x) for _, label in reader.graph_dataset() for x in label]
        >>> len(labels), labels == sample.labels.tolist()  # the 3 bad lines skipped
        (200, True)
        >>> reader.stats.malformed  # not counted by graph_dataset
        0
        >>> tmp.cleanup()
        """
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        lines = None
        for path, (layout, has_header) in zip(self.files, self._layouts):
            file_lines = tf.data.TextLineDataset(path, compression_type="GZIP" if path.endswith(".gz") else None)
            if has_header:
                file_lines = file_lines.skip(1)
            is_csv = layout == "csv"
            file_lines = file_lines.map(lambda line, c=is_csv: (line, tf.constant(c)))
            lines = file_lines if lines is None else lines.concatenate(file_lines)
        num_pipelines, pipeline_id = self.line_shard
        if num_pipelines > 1:
            # The data-line index across one pass of the files, as `_rows` counts it.
            lines = lines.enumerate().filter(lambda index, _: index % num_pipelines == pipeline_id)
            lines = lines.map(lambda _, pair: pair)
        lines = lines.repeat(self.num_epochs)
        missing = self.dense_missing_value

        def parse(line, is_csv):
            line = tf.strings.regex_replace(line, r"[\r\n]+$", "")
            fields = tf.cond(
                is_csv,
                lambda: tf.strings.regex_replace(tf.strings.split(line, ","), '^"(.*)"$', "\\1"),
                lambda: tf.strings.split(line, "\t"),
            )
            ok = tf.equal(tf.size(fields), NUM_FIELDS)
            fields = tf.cond(ok, lambda: fields, lambda: tf.fill([NUM_FIELDS], ""))
            label_text, dense_text, cat = fields[0], fields[1 : 1 + NUM_DENSE], fields[1 + NUM_DENSE :]
            ok = ok & tf.reduce_any(tf.equal(label_text, list(_LABELS)))
            number = tf.where(is_csv, _CSV_NUMBER, _TSV_NUMBER)
            valid = tf.equal(dense_text, "") | tf.strings.regex_full_match(dense_text, number)
            ok = ok & tf.reduce_all(valid)
            safe = tf.where(valid & tf.not_equal(dense_text, ""), dense_text, "0")
            raw = tf.strings.to_number(safe, tf.float64)
            dense = tf.where(tf.equal(dense_text, ""), tf.constant(missing, tf.float64), tf.math.log1p(tf.maximum(raw, 0.0)))
            label = tf.strings.to_number(tf.where(ok, label_text, "0"), tf.float32)
            return ok, label, tf.cast(dense, tf.float32), cat

        rows = lines.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        rows = rows.filter(lambda ok, *_: ok).map(lambda _, label, dense, cat: (label, dense, cat))
        if self.shuffle_buffer > 0:
            rows = rows.shuffle(self.shuffle_buffer, seed=self.seed)
        vocab_size = self.vocab_size

        def to_features(label, dense, cat):
            return {"dense": dense, "cat": criteo_keys(cat, vocab_size)}, label

        ds = rows.batch(self.batch_size, self.drop_remainder)
        return ds.map(to_features, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)

    def _batches(self, rows_per_batch: int, drop_remainder: bool) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Yields (label [n], dense [n, 13], cat [n, 26] bytes) numpy batches."""
        labels: list[float] = []
        dense: list[list[float]] = []
        cat: list[list[bytes]] = []
        epoch = 0
        while self.num_epochs is None or epoch < self.num_epochs:
            # The data-line index across this epoch's files, for line sharding.
            position = [0]
            for path, (layout, has_header) in zip(self.files, self._layouts):
                for label, dense_row, cat_row in self._rows(path, layout, has_header, position):
                    labels.append(label)
                    dense.append(dense_row)
                    cat.append(cat_row)
                    if len(labels) == rows_per_batch:
                        yield self._to_arrays(labels, dense, cat)
                        labels, dense, cat = [], [], []
            epoch += 1
        if labels and not drop_remainder:
            yield self._to_arrays(labels, dense, cat)

    def _to_arrays(self, labels, dense, cat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        self.stats._add_rows(len(labels))  # pylint: disable=protected-access
        raw = np.asarray(dense, dtype=np.float64)  # missing = nan, which maximum and log1p keep
        out = np.log1p(np.maximum(raw, 0.0))
        out[np.isnan(raw)] = self.dense_missing_value
        return np.asarray(labels, np.float32), out.astype(np.float32), np.asarray(cat, dtype=object)

    def _rows(self, path: str, layout: str, has_header: bool, position: list) -> Iterator[tuple[float, list, list]]:
        """Yields the well-formed rows of this pipeline's share of one file.

        `position[0]` is the data-line index of the file's first data line; it
        is advanced past the file (a list, so that concurrent iterators of one
        reader keep their own count).
        """
        sep = _SEPARATORS[layout]
        # int() refuses "3.5", "nan" and "inf"; float() takes "nan" and "inf",
        # which the CSV check below refuses.
        to_number: Callable[[bytes], float] = int if layout == "tsv" else float
        check_finite = layout == "csv"
        num_pipelines, pipeline_id = self.line_shard
        index = position[0]
        bad = 0
        with _open(path) as f:
            lineno = 0
            if has_header:
                f.readline()
                lineno = 1
            for line in f:
                lineno += 1
                mine = index % num_pipelines == pipeline_id
                index += 1
                if not mine:
                    continue
                line = line.rstrip(b"\r\n")
                if layout == "csv" and b'"' in line:
                    fields = [v.encode() for v in next(csv.reader([line.decode("utf-8", "replace")]))]
                else:
                    fields = line.split(sep)
                reason = None
                label = _LABELS.get(fields[0])
                if len(fields) != NUM_FIELDS:
                    reason = f"expected {NUM_FIELDS} {layout.upper()} fields, found {len(fields)}"
                elif label is None:
                    reason = f"label must be 0 or 1; received {fields[0][:_QUOTE_CHARS].decode('utf-8', 'replace')!r}"
                else:
                    try:
                        dense_row = [to_number(v) if v else _NAN for v in fields[1 : 1 + NUM_DENSE]]
                        # Every spelling of nan and inf has an "n"; finite numbers have none.
                        if check_finite and b"n" in b"".join(fields[1 : 1 + NUM_DENSE]).lower():
                            _ = [_csv_float(v) for v in fields[1 : 1 + NUM_DENSE] if v]
                    except ValueError:
                        reason = _dense_reason(fields, _csv_float if check_finite else int, layout)
                if reason is not None:
                    bad += 1
                    self.stats._add_malformed(path)  # pylint: disable=protected-access
                    if bad <= MAX_WARNINGS_PER_FILE:
                        warnings.warn(
                            f"{path}:{lineno}: skipped malformed line: {reason}", CriteoMalformedLineWarning, stacklevel=2
                        )
                    continue
                yield label, dense_row, fields[1 + NUM_DENSE :]
        position[0] = index
        if bad > MAX_WARNINGS_PER_FILE:
            warnings.warn(
                f"{path}: skipped {bad} malformed lines in all; only the first {MAX_WARNINGS_PER_FILE} were shown.",
                CriteoMalformedLineWarning,
                stacklevel=2,
            )
        self.stats._add_file()  # pylint: disable=protected-access


def _dense_reason(fields: list[bytes], to_number: Callable[[bytes], float], layout: str) -> str:
    kind = "an integer" if layout == "tsv" else "a finite number"
    for name, value in zip(DENSE_NAMES, fields[1 : 1 + NUM_DENSE]):
        try:
            if value:
                to_number(value)
        except ValueError:
            return f"{name} must be {kind} or empty; received {value[:_QUOTE_CHARS].decode('utf-8', 'replace')!r}"
    return "a dense field is not a number"  # not reached: the caller saw a ValueError


def _check_int(name: str, value: Any, minimum: int, extra: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        suffix = f" {extra}" if extra else ""
        raise ValueError(f"Argument `{name}` must be an int >= {minimum}{suffix}. Received: {value!r}.")


def criteo(paths: PathLike | Sequence[PathLike], batch_size: int, **kwargs):
    """Returns a `tf.data.Dataset` of Criteo `(features, label)` batches.

    The same as `CriteoReader(paths, batch_size, **kwargs).dataset()`; pass
    `stats=CriteoStats()` to read the counters.

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

    Each worker reads its own share of `paths` (see `CriteoReader`), parsed
    by `CriteoReader.graph_dataset` (TensorFlow ops only, so it runs on the
    worker; malformed lines are skipped uncounted). Files are checked here,
    on the caller, before anything connects.

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
      **kwargs: the keyword arguments of `CriteoReader` but `input_context`
        and `stats`; pass repeat=True for ParameterServerStrategy's `fit`.

    Returns:
      A function of a `tf.distribute.InputContext` that returns the dataset.

    Raises:
      ValueError: for `input_context` or `stats` in kwargs, or what
        `CriteoReader` refuses.
      FileNotFoundError: when a path does not exist or a pattern matches
        nothing.
    """
    if "input_context" in kwargs:
        raise ValueError(
            "Argument `input_context` is given by DatasetCreator to the returned dataset_fn. "
            "Fix: drop it from criteo_dataset_fn's arguments."
        )
    if "stats" in kwargs:
        raise ValueError(
            "Argument `stats` cannot be counted by criteo_dataset_fn: its datasets are parsed by "
            f"TensorFlow ops on the workers, which cannot update a Python object. Received: {kwargs['stats']!r}. "
            "Fix: drop `stats`; to count malformed lines, read the files once with "
            "`criteo(paths, batch_size, stats=CriteoStats())`."
        )
    CriteoReader(paths, batch_size, **kwargs)  # validate now, on the coordinator

    def dataset_fn(input_context=None):
        # TensorFlow ops only: a from_generator dataset on a ParameterServerStrategy
        # worker calls back into the coordinator's Python, and deleting its
        # iterator after fit deadlocked the coordinator's next eager op.
        return CriteoReader(paths, batch_size, input_context=input_context, **kwargs).graph_dataset()

    return dataset_fn
