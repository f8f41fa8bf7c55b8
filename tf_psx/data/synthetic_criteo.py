"""Criteo-layout files of synthetic clicks from a planted logistic model.

`write_criteo_sample` writes rows in either layout that `tf_psx.data.criteo`
reads: the Criteo Display Advertising layout of the Kaggle and Terabyte files
("tsv": tab-separated, no header, `label, I1..I13, C1..C26`, 8-hex-digit
categoricals, empty = missing) or the CSV with a header ("csv":
`label,I1..I13,C1..C26`, dense counts written as floats such as `260.0`).
The same seed gives the same rows in both layouts, so a test can check that
they read the same. It can mix in malformed lines, at known line numbers, of
kinds the reader must skip and count.

Tests, doctests and the examples read these files instead of the real Criteo
rows: those are under Criteo's non-commercial licence, and a clone of this
repository holds them only as an optional example input
(`examples/data/`).
"""

from __future__ import annotations

import dataclasses
import gzip
import os
from typing import Literal, Union, get_args

import numpy as np

from tf_psx import _checks
from tf_psx.data.layout import CSV_HEADER, NUM_CATEGORICAL, NUM_DENSE
from tf_psx.data.synthetic import roc_auc
from tf_psx.errors import ArgumentError

__all__ = ["CriteoSample", "write_criteo_sample"]

Layout = Literal["tsv", "csv"]
LAYOUTS: tuple[str, ...] = get_args(Layout)

# What each malformed line holds; every kind is refused by both CriteoReader
# paths (`dataset()` and `graph_dataset()`) in both layouts:
#   "field_count": the row without its last field (39 fields, not 40);
#   "label":       the label "2" (labels are 0 or 1);
#   "dense_text":  an integer field I1..I13 holding "abc";
#   "dense_nan":   an integer field holding "nan" (not an integer in the TSV
#                  layout, not a finite number in the CSV one).
# Lines get the kinds in this order, cycling, from the top of the file.
MalformedKind = Literal["field_count", "label", "dense_text", "dense_nan"]
MALFORMED_KINDS: tuple[str, ...] = get_args(MalformedKind)
_BAD_LABEL = "2"
_BAD_DENSE = {"dense_text": "abc", "dense_nan": "nan"}

# Per integer column I1..I13: (missing rate, mean, standard deviation of
# log1p(max(I, 0))), measured on DeepCTR's 200-row Criteo sample and rounded,
# so that the generated columns are as sparse and as spread as real ones.
_DENSE_SHAPE = (
    (0.45, 0.7, 0.9), (0.00, 2.1, 2.0), (0.17, 2.3, 1.3), (0.18, 1.8, 1.0), (0.03, 7.1, 3.0),
    (0.26, 3.5, 1.8), (0.05, 1.6, 1.3), (0.00, 2.0, 1.2), (0.05, 3.6, 1.7), (0.45, 0.4, 0.4),
    (0.05, 0.9, 0.8), (0.79, 0.3, 0.5), (0.18, 1.9, 1.1),
)
# I2 is the one column with negative values in Criteo: -1 on 15 of the 200
# sample rows (the reader clips it at 0).
_I2_NEGATIVE_RATE = 0.075
# Per categorical column C1..C26: the missing rate, measured on the same
# sample and rounded.
_CATEGORICAL_MISSING = (
    0.00, 0.00, 0.05, 0.05, 0.00, 0.16, 0.00, 0.00, 0.00, 0.00, 0.00, 0.05, 0.00,
    0.00, 0.00, 0.05, 0.00, 0.00, 0.41, 0.41, 0.05, 0.80, 0.00, 0.05, 0.41, 0.41,
)
# Values per categorical column: the distinct values the sample shows for its
# small columns (C9 has 2, C6 has 6), and _LARGE_VOCAB where it shows 89 or
# more in 200 rows (C3, C7, C11... hold millions of values in the full data).
_LARGE_VOCAB = 10_000
_CATEGORICAL_VOCAB = (
    27, _LARGE_VOCAB, _LARGE_VOCAB, _LARGE_VOCAB, 12, 6, _LARGE_VOCAB, 19, 2, _LARGE_VOCAB, _LARGE_VOCAB,
    _LARGE_VOCAB, _LARGE_VOCAB, 14, _LARGE_VOCAB, _LARGE_VOCAB, 9, _LARGE_VOCAB, 43, 3, _LARGE_VOCAB, 5,
    10, _LARGE_VOCAB, 19, _LARGE_VOCAB,
)
# Zipf exponent of categorical value frequencies, as in `synthetic_ctr`: a few
# values cover most rows, as in click logs.
_ZIPF = 1.05
# Planted weights: per standardized dense value, and per categorical value.
# With these and _BIAS, measured on 20 000 rows for seeds 0..5: a Bayes AUC
# of 0.77-0.82 (the best published models reach about 0.81 on Criteo) and
# 24-27 % clicks (49 of the sample's 200 rows are clicks).
_DENSE_WEIGHT_SCALE = 0.28
_CATEGORICAL_WEIGHT_SCALE = 0.2
_BIAS = -1.4
# Categoricals are 32-bit hashes written as 8 lowercase hex digits.
_HASH_SPACE = 2**32
# Independent random streams per seed: the well-formed rows do not depend on
# `malformed`, so a file with bad lines holds the rows of the clean file.
_ROWS_STREAM, _MALFORMED_STREAM = 0, 1

PathLike = Union[str, "os.PathLike[str]"]


@dataclasses.dataclass
class CriteoSample:
    """What `write_criteo_sample` wrote: the file and its well-formed rows.

    Attributes:
      path: the file written.
      layout: "tsv" or "csv" (what `CriteoReader.formats` reports for it).
      labels: float32 [rows], 0 or 1, in file order.
      dense: float64 [rows, 13], the integer counts I1..I13; nan = missing.
      cat: str [rows, 26] (object array), C1..C26; "" = missing.
      probs: float64 [rows], the planted click probabilities.
      malformed_lines: the 1-based line numbers of the malformed lines (the
        CSV header is line 1), ascending.
      malformed_kinds: the kind of each of them (see `MALFORMED_KINDS`).
      bayes_auc: the AUC of `probs` against `labels`, which no model beats
        but by chance; nan when the labels hold one class only.
    """

    path: str
    layout: str
    labels: np.ndarray
    dense: np.ndarray
    cat: np.ndarray
    probs: np.ndarray
    malformed_lines: tuple[int, ...]
    malformed_kinds: tuple[str, ...]
    bayes_auc: float

    @property
    def rows(self) -> int:
        """The number of well-formed rows."""
        return len(self.labels)


def _zipf_probs(size: int) -> np.ndarray:
    weights = np.arange(1, size + 1, dtype=np.float64) ** -_ZIPF
    return weights / weights.sum()


def _draw_rows(rows: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Returns (labels, dense counts with nan, cat strings, probs) of `rows` rows."""
    shape = np.asarray(_DENSE_SHAPE)
    missing_rate, mean, std = shape[:, 0], shape[:, 1], shape[:, 2]
    logs = np.maximum(rng.normal(mean, std, size=(rows, NUM_DENSE)), 0.0)
    counts = np.rint(np.expm1(logs))
    counts[:, 1] = np.where(rng.random(rows) < _I2_NEGATIVE_RATE, -1.0, counts[:, 1])
    dense_missing = rng.random((rows, NUM_DENSE)) < missing_rate
    dense = np.where(dense_missing, np.nan, counts)
    # The model sees what the file holds: the standardized log1p of the
    # written count, and 0 (the column mean) for a missing one.
    standardized = np.where(dense_missing, 0.0, (np.log1p(np.maximum(counts, 0.0)) - mean) / std)
    logits = _BIAS + standardized @ rng.normal(0.0, _DENSE_WEIGHT_SCALE, size=NUM_DENSE)

    cat = np.empty((rows, NUM_CATEGORICAL), dtype=object)
    for column, (vocab, missing) in enumerate(zip(_CATEGORICAL_VOCAB, _CATEGORICAL_MISSING)):
        # Distinct hashes: two values of a column never share a string.
        hashes = rng.choice(_HASH_SPACE, size=vocab, replace=False)
        # One weight per value, and the last one for "missing", centred on the
        # column's mean weight: else the few frequent values of a small column
        # move every row's logit, and the click rate with the seed.
        weights = rng.normal(0.0, _CATEGORICAL_WEIGHT_SCALE, size=vocab + 1)
        frequencies = np.append((1.0 - missing) * _zipf_probs(vocab), missing)
        weights -= frequencies @ weights
        ids = rng.choice(vocab, size=rows, p=_zipf_probs(vocab))
        ids = np.where(rng.random(rows) < missing, vocab, ids)
        logits += weights[ids]
        cat[:, column] = ["" if i == vocab else f"{hashes[i]:08x}" for i in ids]
    probs = 1.0 / (1.0 + np.exp(-logits))
    labels = (rng.random(rows) < probs).astype(np.float32)
    return labels, dense, cat, probs


def _dense_text(value: float, layout: str) -> str:
    if np.isnan(value):
        return ""
    return str(int(value)) if layout == "tsv" else repr(float(value))  # 260 / 260.0


def _fields(label: float, dense_row: np.ndarray, cat_row: np.ndarray, layout: str) -> list[str]:
    return [str(int(label))] + [_dense_text(v, layout) for v in dense_row] + list(cat_row)


def _damage(fields: list[str], kind: str, rng: np.random.Generator) -> list[str]:
    """Makes one row's fields malformed in the way `kind` names."""
    fields = list(fields)
    if kind == "field_count":
        return fields[:-1]
    if kind == "label":
        fields[0] = _BAD_LABEL
    else:
        fields[1 + int(rng.integers(NUM_DENSE))] = _BAD_DENSE[kind]
    return fields


def write_criteo_sample(
    path: PathLike,
    rows: int = 200,
    *,
    layout: Layout = "tsv",
    seed: int = 0,
    malformed: int = 0,
) -> CriteoSample:
    """Writes a Criteo-layout file of clicks drawn from a planted logistic model.

    Each row has the columns of the Criteo data: I1..I13 are integer counts
    (with the missing rates and spreads of the real columns, I2 sometimes
    -1), C1..C26 are 8-hex-digit values drawn with Zipf frequencies (some
    columns with a handful of values, most with thousands; some often
    missing). The label is 1 with probability sigmoid(bias + w . z +
    sum over columns of v[column, value]), where z is the standardized
    log1p(max(I, 0)) (0 when missing) and w, v are planted weights: a model
    trained on the rows can beat chance, up to `bayes_auc`.

    The same `seed` and `rows` give the same rows in both layouts and
    whatever `malformed` is; `malformed` lines are put at random places
    (the same places in both layouts, counted in data lines), with the kinds
    of `MALFORMED_KINDS` in turn. A path ending in ".gz" is gzip-compressed.

    Example:

    >>> import os, tempfile
    >>> from tf_psx.data import CriteoStats, criteo
    >>> tmp = tempfile.TemporaryDirectory()
    >>> path = os.path.join(tmp.name, "day_0.tsv")
    >>> sample = write_criteo_sample(path, 300, seed=1, malformed=4)
    >>> sample.rows, sample.malformed_kinds
    (300, ('field_count', 'label', 'dense_text', 'dense_nan'))
    >>> with open(path) as f:
    ...     lines = f.read().splitlines()
    >>> len(lines), len(lines[0].split("\\t"))
    (304, 40)
    >>> [len(lines[n - 1].split("\\t")) for n in sample.malformed_lines]
    [39, 40, 40, 40]
    >>> stats = CriteoStats()
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     labels = [lab for _, batch in criteo(path, 128, stats=stats) for lab in batch.numpy()]
    >>> stats.rows, stats.malformed, labels == sample.labels.tolist()
    (300, 4, True)
    >>> 0.6 < sample.bayes_auc < 0.95
    True
    >>> csv_path = os.path.join(tmp.name, "day_0.csv")
    >>> twin = write_criteo_sample(csv_path, 300, layout="csv", seed=1, malformed=4)
    >>> with open(csv_path) as f:
    ...     header = f.readline()
    >>> header.startswith("label,I1,I2,"), twin.labels.tolist() == sample.labels.tolist()
    (True, True)
    >>> [n - 1 for n in twin.malformed_lines] == list(sample.malformed_lines)  # after the header
    True
    >>> tmp.cleanup()

    Args:
      path: the file to write (replaced if it exists; its directory must
        exist). A name ending in ".gz" writes gzip.
      rows: well-formed rows to write (>= 1).
      layout: "tsv" (Kaggle/Terabyte: tab-separated, no header) or "csv"
        (`CSV_HEADER`, then comma-separated rows, dense counts as floats).
      seed: the random seed (>= 0).
      malformed: malformed lines to mix in (>= 0), in addition to `rows`.

    Returns:
      A `CriteoSample` with the rows written and where the bad lines are.

    Raises:
      ValueError: for an invalid argument.
    """
    _checks.int_at_least(rows, 1, "rows", fix="pass the number of well-formed rows to write, e.g. rows=200.")
    if layout not in LAYOUTS:
        raise ArgumentError(
            f"Argument `layout` must be one of {LAYOUTS}. Received: {layout!r}. "
            "Fix: pass 'tsv' for the Kaggle/Terabyte layout or 'csv' for the CSV with a header."
        )
    _checks.int_at_least(seed, 0, "seed", fix="pass a non-negative int; the same seed gives the same file.")
    _checks.int_at_least(malformed, 0, "malformed", fix="pass 0 for a clean file, or the number of bad lines to mix in.")
    path = os.fspath(path)
    sep = "\t" if layout == "tsv" else ","
    labels, dense, cat, probs = _draw_rows(rows, np.random.default_rng([seed, _ROWS_STREAM]))
    lines = [sep.join(_fields(labels[i], dense[i], cat[i], layout)) for i in range(rows)]

    bad_rng = np.random.default_rng([seed, _MALFORMED_STREAM])
    positions = sorted(int(p) for p in bad_rng.choice(rows + malformed, size=malformed, replace=False))
    kinds = tuple(MALFORMED_KINDS[k % len(MALFORMED_KINDS)] for k in range(malformed))
    for position, kind in zip(positions, kinds):
        base = int(bad_rng.integers(rows))
        fields = _damage(_fields(labels[base], dense[base], cat[base], layout), kind, bad_rng)
        # Inserting in ascending order puts each line at its final data-line index.
        lines.insert(position, sep.join(fields))

    header = [CSV_HEADER] if layout == "csv" else []
    text = "\n".join(header + lines) + "\n"
    if path.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8", newline="") as f:
            f.write(text)
    else:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    first_line = 1 + len(header)  # the 1-based line number of data line 0
    both_classes = 0 < labels.sum() < rows
    return CriteoSample(
        path=path,
        layout=layout,
        labels=labels,
        dense=dense,
        cat=cat,
        probs=probs,
        malformed_lines=tuple(first_line + p for p in positions),
        malformed_kinds=kinds,
        bayes_auc=roc_auc(labels, probs) if both_classes else float("nan"),
    )
