"""The Criteo file layout: its fields, the CSV header, and what a well-formed line is.

The Criteo Display Advertising layout (the Kaggle 11 GB and Terabyte 1 TB
files: tab-separated, no header, `label, I1..I13, C1..C26`) and its
CSV-with-header variant (`label,I1,...,C26`, dense values written as floats).

A line's rules are written twice, side by side so that they cannot drift:
in TensorFlow ops for the pipeline (`parse_lines`, which may run on a
worker) and in Python for the check of the files (`problem`, which names
what is wrong with a line).
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from tf_psx import redaction as _redaction

__all__ = ["NUM_DENSE", "NUM_CATEGORICAL", "NUM_FIELDS", "DENSE_NAMES", "CATEGORICAL_NAMES", "CSV_HEADER",
           "Format", "FORMATS"]

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
HEADER_PREFIX = b"label,"
# Longest excerpt of a bad header or field quoted in a message.
QUOTE_CHARS = 120

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


def split_fields(line: bytes, layout: str) -> list[bytes]:
    """A line's fields, as the pipeline splits them (see `parse_lines`)."""
    line = line.rstrip(b"\r\n")
    fields = line.split(_SEPARATORS[layout])
    if layout == "csv":
        fields = [m.group(1) if (m := _QUOTED_RE.fullmatch(v)) else v for v in fields]
    return fields


def problem(line: bytes, layout: str) -> str | None:
    """Why the pipeline skips `line`, or None when it reads it."""
    fields = split_fields(line, layout)
    if len(fields) != NUM_FIELDS:
        return f"expected {NUM_FIELDS} {layout.upper()} fields, found {len(fields)}"
    if fields[0] not in _LABELS:
        return f"label must be 0 or 1; received {quote(fields[0])}"
    number = _NUMBER_RE[layout]
    for name, value in zip(DENSE_NAMES, fields[1 : 1 + NUM_DENSE]):
        if value and (len(value) > _MAX_NUMBER_CHARS or not number.fullmatch(value)):
            return (
                f"{name} must be {_NUMBER_KIND[layout]} of at most {_MAX_NUMBER_CHARS} characters, or empty; "
                f"received {quote(value)}"
            )
    return None


def quote(value: bytes) -> str:
    """An excerpt of a field for a message (hidden when redaction is on)."""
    return _redaction.show(repr(value[:QUOTE_CHARS].decode("utf-8", "replace")))


def parse_lines(line, is_csv, dense_missing_value: float):
    """A chunk of lines -> (ok [n], label [n], dense [n, 13], cat [n, 26]), by `problem`'s rules.

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
    dense = tf.where(empty, tf.constant(dense_missing_value, tf.float64), tf.math.log1p(tf.maximum(raw, 0.0)))
    label = tf.strings.to_number(tf.where(ok, label_text, "0"), tf.float32)
    return ok, label, tf.cast(dense, tf.float32), cat

