"""A streaming `tf.data` reader for the Criteo click logs: `CriteoReader`, `criteo`, `criteo_dataset_fn`.

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

The reader's parts live beside it: the layout and a line's rules in
`tf_psx.data.layout`, the keys of categorical values (`criteo_keys`) in
`tf_psx.data.keys`, files and patterns in `tf_psx.data.files`, and the
check that counts malformed lines (`CriteoStats`) in
`tf_psx.data.file_check`. Their public names are also importable from here.

Note: the function `criteo` has the name of this module, so after
`import tf_psx.data` the attribute `tf_psx.data.criteo` is the function.
Module-level names are still reachable with
`from tf_psx.data.layout import NUM_DENSE` (or, as before,
`from tf_psx.data.criteo import NUM_DENSE`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from tf_psx import _checks
from tf_psx._tf import data as _tf_data
# Also the names `from tf_psx.data.criteo import X` has always given (noqa: F401).
from tf_psx.data.file_check import (  # noqa: F401
    CHECK_STOP_GRACE_S,
    MAX_WARNINGS_PER_FILE,
    CriteoMalformedLineWarning,
    CriteoStats,
    watch,
)
from tf_psx.data.files import PathLike, detect, expand
from tf_psx.data.keys import HASH_KEY_SPACE, MISSING_TOKEN, criteo_keys  # noqa: F401
from tf_psx.data.layout import (  # noqa: F401
    CATEGORICAL_NAMES,
    CSV_HEADER,
    DENSE_NAMES,
    FORMATS,
    NUM_CATEGORICAL,
    NUM_DENSE,
    NUM_FIELDS,
    Format,
    parse_lines,
)
from tf_psx.errors import ArgumentError, ArgumentTypeError

__all__ = [
    "CriteoMalformedLineWarning",
    "CriteoReader",
    "CriteoStats",
    "criteo",
    "criteo_dataset_fn",
    "criteo_keys",
]

# Lines parsed together by one call of the parse function.
_PARSE_CHUNK = 1024


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
            raise ArgumentError(f"Argument `format` must be one of {FORMATS}. Received: {format!r}.")
        _checks.int_at_least(vocab_size, 1, "vocab_size", or_none=True)
        _checks.int_at_least(shuffle_buffer, 0, "shuffle_buffer")
        _checks.int_at_least(num_epochs, 1, "num_epochs", or_none=True)
        if num_epochs is not None:
            if repeat:
                raise ArgumentError(
                    f"Arguments `repeat=True` and `num_epochs={num_epochs!r}` contradict each other. "
                    "Fix: pass repeat=True to read forever, or num_epochs=N to read N times."
                )
        if not isinstance(dense_missing_value, (int, float)) or not math.isfinite(dense_missing_value):
            raise ArgumentError(f"Argument `dense_missing_value` must be a finite number. Received: {dense_missing_value!r}.")
        if stats is not None and not isinstance(stats, CriteoStats):
            raise ArgumentTypeError(
                f"Argument `stats` must be a tf_psx.data.CriteoStats or None. Received: {stats!r}. "
                "Fix: pass stats=tf_psx.data.CriteoStats(), and read its counts after reading the data."
            )
        all_files = expand(paths)
        num_pipelines, pipeline_id = 1, 0
        if input_context is not None:
            num_pipelines = input_context.num_input_pipelines
            pipeline_id = input_context.input_pipeline_id
            if not 0 <= pipeline_id < num_pipelines:
                raise ArgumentError(
                    f"input_context.input_pipeline_id must be in [0, {num_pipelines}). Received: {pipeline_id!r}."
                )
        if len(all_files) >= num_pipelines:
            self.files = tuple(all_files[pipeline_id::num_pipelines])
            self.line_shard = (1, 0)
        else:
            self.files = tuple(all_files)
            self.line_shard = (num_pipelines, pipeline_id)
        self._layouts = tuple(detect(path, format) for path in self.files)
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
            watch(self.stats, path, layout, has_header)
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
        """A chunk of lines -> (ok, label, dense, cat): `tf_psx.data.layout.parse_lines`."""
        return parse_lines(line, is_csv, self.dense_missing_value)


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
        raise ArgumentError(
            "Argument `input_context` is given by DatasetCreator to the returned dataset_fn. "
            "Fix: drop it from criteo_dataset_fn's arguments."
        )
    CriteoReader(paths, batch_size, **kwargs)  # validate now, on the coordinator

    def dataset_fn(input_context=None):
        return criteo(paths, batch_size, input_context=input_context, **kwargs)

    return dataset_fn
