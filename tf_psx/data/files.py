"""Criteo files: paths and glob patterns, opening them (gzip, `tf.io.gfile` paths), the layout of each.

A path with "://" (e.g. "gs://...") is read through `tf.io.gfile`; other
paths through Python's own file functions. Files ending in ".gz" are
decompressed.
"""

from __future__ import annotations

import glob as _glob
import gzip
import os
from typing import IO, Sequence, Union

from tf_psx import redaction as _redaction
from tf_psx.data.layout import CSV_HEADER, HEADER_PREFIX, QUOTE_CHARS
from tf_psx.errors import ArgumentError, DataError, MissingFileError

__all__ = ["PathLike", "expand", "open_file", "detect", "is_remote"]

_GLOB_CHARS = "*?["

PathLike = Union[str, "os.PathLike[str]"]


def is_remote(path: str) -> bool:
    """True for a path that `tf.io.gfile` reads (it names a scheme, e.g. "gs://")."""
    return "://" in path


def expand(paths: PathLike | Sequence[PathLike]) -> list[str]:
    """Paths and glob patterns -> file list (a pattern's matches are sorted)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise ArgumentError("Argument `paths` must name at least one file. Received: [].")
    files: list[str] = []
    for path in paths:
        if any(c in path for c in _GLOB_CHARS):
            if is_remote(path):
                import tensorflow as tf  # pylint: disable=import-outside-toplevel

                matches = sorted(tf.io.gfile.glob(path))
            else:
                matches = sorted(_glob.glob(path))
            if not matches:
                raise MissingFileError(f"No Criteo file matches the pattern {path!r}. Fix: check the pattern and the directory.")
            files.extend(matches)
            continue
        if is_remote(path):
            import tensorflow as tf  # pylint: disable=import-outside-toplevel

            exists = tf.io.gfile.exists(path)
        else:
            exists = os.path.isfile(path)
        if not exists:
            raise MissingFileError(f"Criteo file {path!r} does not exist. Fix: pass an existing file or a glob pattern.")
        files.append(path)
    return files


def open_file(path: str) -> IO[bytes]:
    """Opens a file for streaming binary reads (gzip when it ends in .gz)."""
    if is_remote(path):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        raw = tf.io.gfile.GFile(path, "rb")
        return gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")  # pylint: disable=consider-using-with


def detect(path: str, fmt: str) -> tuple[str, bool]:
    """Returns (layout, has_header) from the first line of `path`."""
    with open_file(path) as f:
        first = f.readline()
    is_header = first.startswith(HEADER_PREFIX)
    if is_header:
        received = first.rstrip(b"\r\n").decode("utf-8", "replace")
        if fmt == "tsv":
            raise DataError(
                f"{path}: format='tsv' but the file starts with a CSV header "
                f"({_redaction.show(repr(received[:QUOTE_CHARS]))}). "
                "Fix: pass format='csv' or format='auto'."
            )
        if received != CSV_HEADER:
            raise DataError(
                f"{path}: the CSV header must be {CSV_HEADER!r} (columns are read by position); "
                f"received {_redaction.show(repr(received[:QUOTE_CHARS]))}. Fix: write the columns in this order."
            )
        return "csv", True
    if fmt != "auto":
        return fmt, False
    # A headerless file: tabs mean the original layout, commas a bare CSV.
    if b"\t" not in first and b"," in first:
        return "csv", False
    return "tsv", False
