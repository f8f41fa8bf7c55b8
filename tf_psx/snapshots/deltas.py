"""Delta snapshots: the rows changed since the last full snapshot, written between full ones.

A full snapshot (`tf_psx.callbacks.PeriodicSync`) writes every variable; on
a large embedding table that takes seconds, so it is written every few
hundred steps, and a crash loses every update since. A delta holds only
what changed since the last full snapshot (its *base*): for each large
variable (the tables and their optimizer slots) the rows whose values
differ, and every small variable whole. A resume restores the base and then
its newest delta, so a crash loses at most the steps since that delta.

Which rows changed is found by content, not by hooking the optimizer: each
large variable has an int64 fingerprint per row, on its own ps task, taken
when the base is written. A delta recomputes them there and sends back the
rows whose fingerprint moved. The fingerprint of a row is the sum over its
elements of (the element's bits x an odd constant) modulo 2^64: any change of
one element changes it, so no changed row is missed (two changed elements
cancel out with odds of about 2^-64). So it is exact for every optimizer,
including those whose sparse update writes rows beyond the batch's (SGD
with momentum, non-lazy Adam): those rows did change and are sent. The
price is a pass over each table per delta, on its ps task, and 8 bytes per
row of memory there.

Where every update goes through tf_psx's exact-update lock and writes only
its gradient's rows (`tf_psx.optimizers.updates_touched_rows_only`), the
updates mark their rows in a bool mask beside each table instead
(`row_marks`), and a delta reads the marks: no pass over the rows.

Deltas are cumulative (each holds everything changed since the base, not
since the previous delta), so only the newest is kept and a torn one costs
the step range back to the one before it, never a wrong restore. They are
files in the base's snapshot directory:
`delta-<step, 12 digits>.npz` (the rows) and `delta-<step>.json` (the
manifest, written last: it commits the delta; a pruned base takes its deltas
with it).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import time
import uuid

import numpy as np
import tensorflow as tf

from tf_psx.errors import DataError
from tf_psx.snapshots import store as _store

__all__ = ["DeltaTracker", "Delta", "write_delta", "latest_delta", "variables_by_path", "apply_rows", "shards_of",
           "full_shape", "MIN_ROWS"]

logger = logging.getLogger("tf_psx")

# Variables with fewer rows (and every non-float one) go whole into each delta.
MIN_ROWS = 1024
DELTA_PREFIX = "delta-"
DELTA_RE = re.compile(rf"^{DELTA_PREFIX}(\d{{{_store.STEP_DIGITS}}})\.json$")
# A delta file written aside ("<name>.tmp-<8 hex>") whose writer died before the rename.
DELTA_TMP_RE = re.compile(rf"^{DELTA_PREFIX}\d{{{_store.STEP_DIGITS}}}\.(npz|json)\.tmp-[0-9a-f]{{8}}$")
# Paths of the checkpoint root that are not training state.
_SKIPPED_CHILDREN = {"save_counter"}
_BITS = {tf.float16: tf.int16, tf.bfloat16: tf.int16, tf.float32: tf.int32, tf.float64: tf.int64}


def _is_sharded(obj) -> bool:
    return isinstance(obj, tf.__internal__.distribute.ShardedVariable)


def variables_by_path(root, skip: tuple = ()) -> dict:
    """Every variable reachable from `root`, by its object path: a tf.Variable or a ShardedVariable.

    The path is the chain of checkpoint dependency names ("model/
    layer_with_weights-0/embeddings"), so it is the same in every process that
    builds the same model, whatever the number of shards. Objects of a type
    in `skip` are left out (with what hangs below them).
    """
    found: dict = {}
    seen = {id(root)}
    queue = [("", root)]
    while queue:
        prefix, obj = queue.pop(0)
        children = tf.train.TrackableView.children(obj)
        for name in sorted(children):
            child = children[name]
            if id(child) in seen or (not prefix and name in _SKIPPED_CHILDREN) or (skip and isinstance(child, skip)):
                continue
            seen.add(id(child))
            path = f"{prefix}{name}"
            if _is_sharded(child) or isinstance(child, tf.Variable):
                found[path] = child
            else:
                queue.append((f"{path}/", child))
    # A shard reached on its own, as well as through its ShardedVariable, counts once (as part of it).
    shards = {id(shard) for value in found.values() if _is_sharded(value) for shard in value.variables}
    return {path: value for path, value in found.items() if id(value) not in shards}


def shards_of(value) -> list[tuple[tf.Variable, int]]:
    """(shard, its first row) for each shard of a ShardedVariable (split along rows), or [(value, 0)]."""
    if not _is_sharded(value):
        return [(value, 0)]
    out, offset = [], 0
    for shard in value.variables:
        out.append((shard, offset))
        offset += int(shard.shape[0])
    return out


def full_shape(value) -> tuple:
    """The shape of a variable, or of all the shards of a ShardedVariable together."""
    parts = shards_of(value)
    first = tuple(parts[0][0].shape)
    if not first:
        return first
    return (sum(int(shard.shape[0]) for shard, _ in parts), *first[1:])


def _weights(columns: int) -> np.ndarray:
    # Odd constants, so that (bits x constant) mod 2^64 is a bijection of bits.
    draws = np.random.default_rng(20261203).integers(1, 2**62, size=max(columns, 1), dtype=np.int64)
    return draws * 2 + 1


def _fingerprint(value, weights):
    """One int64 per row of `value`: sum of (element bits x odd constant), wrapping modulo 2^64."""
    rows = tf.shape(value)[0]
    bits = tf.bitcast(tf.reshape(value, [rows, -1]), _BITS[value.dtype.base_dtype])
    return tf.reduce_sum(tf.cast(bits, tf.int64) * weights, axis=1)


class DeltaTracker:
    """Finds the rows of a model's state that changed since the last `rebase()`.

    Args:
      variables: path -> variable or ShardedVariable (`variables_by_path`).
      strategy: the strategy the variables were made under (fingerprints are
        made beside each shard, on its ps task).
      min_rows: variables with fewer rows (all shards together) are written whole.
      row_marks: id(shard) -> a bool [rows] mask that every update of the
        shard sets for the rows it writes (`tf_psx.training.exact_updates.
        register_row_marks`). A large variable whose every shard has one is
        tracked by its marks (a pass over the marks, not the rows); the others
        by fingerprints.
    """

    def __init__(self, variables: dict, strategy, min_rows: int = MIN_ROWS, row_marks: dict | None = None):
        self.variables = dict(variables)
        self.tracked = {}
        for path, value in self.variables.items():
            shape = full_shape(value)
            if shape and shape[0] >= min_rows and value.dtype.base_dtype in _BITS:
                self.tracked[path] = value
        self.whole = {path: value for path, value in self.variables.items() if path not in self.tracked}
        row_marks = row_marks or {}
        self.marked = {path: [row_marks[id(shard)] for shard, _ in shards_of(value)]
                       for path, value in self.tracked.items()
                       if all(id(shard) in row_marks for shard, _ in shards_of(value))}
        self._masks = list({id(mask): mask for masks in self.marked.values() for mask in masks}.values())
        self._prints: dict[tuple[str, int], tf.Variable] = {}
        self._weights: dict[str, tf.Tensor] = {}
        for path, value in self.tracked.items():
            if path in self.marked:
                continue
            shape = full_shape(value)
            self._weights[path] = tf.constant(_weights(int(np.prod(shape[1:])) if len(shape) > 1 else 1))
            for index, (shard, _) in enumerate(shards_of(value)):
                with strategy.scope(), strategy.extended.colocate_vars_with(shard):
                    self._prints[(path, index)] = tf.Variable(tf.zeros([shard.shape[0]], tf.int64), trainable=False,
                                                              name="tf_psx_row_fingerprints")
        self._rebase = tf.function(self._rebase_fn, autograph=False)
        self._changed = tf.function(self._changed_fn, autograph=False)

    def add_new(self, variables: dict) -> list[str]:
        """Adds the variables made since (by the first step: counters, metrics); they go whole into deltas.

        Returns:
          Their paths.
        """
        new = {path: value for path, value in variables.items() if path not in self.variables}
        if new:
            self.variables.update(new)
            self.whole.update(new)
            self._changed = tf.function(self._changed_fn, autograph=False)
        return sorted(new)

    @property
    def fingerprint_bytes(self) -> int:
        """Memory the fingerprints take on the ps tasks."""
        return sum(8 * int(full_shape(value)[0]) for path, value in self.tracked.items() if path not in self.marked)

    def _rebase_fn(self):
        for mask in self._masks:
            with tf.device(mask.device):
                mask.assign(tf.zeros_like(mask))
        for path, value in self.tracked.items():
            if path in self.marked:
                continue
            for index, (shard, _) in enumerate(shards_of(value)):
                with tf.device(shard.device):
                    self._prints[(path, index)].assign(_fingerprint(shard.read_value(), self._weights[path]))

    def _changed_fn(self):
        out = []
        for path, value in self.tracked.items():
            for index, (shard, _) in enumerate(shards_of(value)):
                with tf.device(shard.device):
                    if path in self.marked:
                        where = tf.where(self.marked[path][index].read_value())[:, 0]
                        out.append((where, tf.gather(shard, where)))
                        continue
                    rows = shard.read_value()
                    moved = tf.not_equal(_fingerprint(rows, self._weights[path]), self._prints[(path, index)])
                    where = tf.where(moved)[:, 0]
                    out.append((where, tf.gather(rows, where)))
        for value in self.whole.values():
            out.append([shard.read_value() for shard, _ in shards_of(value)])
        return out

    def rebase(self) -> None:
        """Takes the current values as the base (right after a full snapshot or its restore)."""
        if self.tracked:
            self._rebase()

    def mark_written(self, path: str, rows: np.ndarray | None) -> None:
        """Counts rows written outside the optimizer (a delta applied on resume) as changed since the base.

        Fingerprinted variables need nothing (their content shows it).
        """
        if path not in self.marked:
            return
        for (shard, offset), mask in zip(shards_of(self.tracked[path]), self.marked[path]):
            if rows is None:
                mask.assign(tf.ones_like(mask))
                continue
            mine = rows[(rows >= offset) & (rows < offset + int(shard.shape[0]))] - offset
            if mine.size:
                mask.scatter_update(tf.IndexedSlices(tf.ones([mine.size], tf.bool), tf.constant(mine)))

    def changed(self) -> dict[str, tuple[np.ndarray | None, np.ndarray]]:
        """path -> (changed rows, their values) for tracked variables, (None, value) for the rest.

        Rows count across all shards of a ShardedVariable (row r of shard i
        is its first row + r), so a delta restores onto any number of shards.
        """
        out = list(self._changed()) if self.variables else []
        result: dict[str, tuple[np.ndarray | None, np.ndarray]] = {}
        for path, value in self.tracked.items():
            rows, values = [], []
            for _, offset in shards_of(value):
                where, gathered = out.pop(0)
                rows.append(where.numpy() + offset)
                values.append(gathered.numpy())
            result[path] = (np.concatenate(rows), np.concatenate(values))
        for path, value in self.whole.items():
            parts = [part.numpy() for part in out.pop(0)]
            result[path] = (None, np.concatenate(parts) if _is_sharded(value) else parts[0])
        return result


def apply_rows(value, rows: np.ndarray | None, values: np.ndarray) -> None:
    """Writes a delta's entry into a variable or ShardedVariable, whatever its number of shards now.

    Args:
      value: the variable or ShardedVariable.
      rows: the rows (across all shards), or None for a whole value.
      values: their values (or the whole value).
    """
    for shard, offset in shards_of(value):
        count = int(shard.shape[0]) if shard.shape.rank else None
        if rows is None:
            shard.assign(values[offset:offset + count] if _is_sharded(value) else values)
            continue
        mine = (rows >= offset) & (rows < offset + count)
        if mine.any():
            shard.scatter_update(tf.IndexedSlices(tf.constant(values[mine], shard.dtype),
                                                  tf.constant(rows[mine] - offset)))


class Delta:
    """A committed delta read back: its manifest and its arrays."""

    def __init__(self, path: str, manifest: dict, arrays: dict[str, np.ndarray]):
        self.path = path
        self.manifest = manifest
        self.step = int(manifest["step"])
        self.base_step = int(manifest["base_step"])
        self._arrays = arrays

    def entries(self):
        """(path, rows or None, values) for each variable in the delta."""
        for index, entry in enumerate(self.manifest["variables"]):
            rows = self._arrays[f"r{index}"] if entry["rows"] else None
            yield entry["path"], rows, self._arrays[f"v{index}"]


def _names(step: int) -> tuple[str, str]:
    stem = f"{DELTA_PREFIX}{step:0{_store.STEP_DIGITS}d}"
    return stem + ".npz", stem + ".json"


def write_delta(snapshot_dir: str, step: int, base_step: int, changed: dict, manifest: dict) -> dict:
    """Writes the delta of `step` into the base's directory, manifest last; removes the older ones.

    Returns:
      The manifest written (with the row and byte counts).
    """
    fs = _store.filesystem(snapshot_dir)
    arrays, entries, rows = {}, [], 0
    for index, (path, (changed_rows, values)) in enumerate(changed.items()):
        entries.append({"path": path, "rows": changed_rows is not None, "shape": list(values.shape)})
        arrays[f"v{index}"] = values
        if changed_rows is not None:
            arrays[f"r{index}"] = changed_rows
            rows += int(changed_rows.size)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    data = buffer.getvalue()
    record = {"step": step, "base_step": base_step, **manifest, "rows": rows, "bytes": len(data),
              "variables": entries, "time": time.time()}
    npz_name, json_name = _names(step)
    npz, final = fs.join(snapshot_dir, npz_name), fs.join(snapshot_dir, json_name)
    if fs.atomic_rename:
        # Each file is written aside and renamed into place: never half a file under its name.
        for name, payload in ((npz, data), (final, json.dumps(record).encode())):
            tmp = f"{name}.tmp-{uuid.uuid4().hex[:8]}"
            fs.write_bytes(tmp, payload)
            os.rename(tmp, name)
    else:
        if fs.exists(final) or fs.exists(npz):
            # A leftover of an earlier run at this step (tf.io.gfile's ram:// appends to a file written again).
            _remove_delta(snapshot_dir, step, fs)
        fs.write_bytes(npz, data)
        fs.write_bytes(final, json.dumps(record).encode())
    for older in _delta_steps(snapshot_dir, fs):
        if older < step:
            _remove_delta(snapshot_dir, older, fs)
    if fs.atomic_rename:
        # A file written aside by a process that died before its rename.
        for name in fs.listdir(snapshot_dir):
            if DELTA_TMP_RE.match(name):
                _remove_quietly(fs, fs.join(snapshot_dir, name))
    return record


def _delta_steps(snapshot_dir: str, fs) -> list[int]:
    if not fs.isdir(snapshot_dir):
        return []
    return sorted(int(match.group(1)) for match in map(DELTA_RE.match, fs.listdir(snapshot_dir)) if match)


def _remove_quietly(fs, path: str) -> bool:
    """Removes `path` if it exists; False (with a warning) if that fails."""
    try:
        if fs.exists(path):
            fs.remove_file(path)
    except Exception as error:  # pylint: disable=broad-except  (OSError, or tf.errors.OpError from gfile)
        logger.warning("PeriodicSync: could not delete the old delta file %s: %s", path, _store.first_line(error))
        return False
    return True


def _remove_delta(snapshot_dir: str, step: int, fs) -> None:
    # The manifest first: from then on it is not a delta.
    for name in reversed(_names(step)):
        if not _remove_quietly(fs, fs.join(snapshot_dir, name)):
            return


def latest_delta(snapshot_dir: str, base_step: int) -> Delta | None:
    """The newest delta of the snapshot in `snapshot_dir` that can be read, or None.

    A delta whose files cannot be read, that names another base, or that was
    written before its base was (a leftover of an earlier run whose snapshot
    of the same step was replaced in place, on a filesystem without renames)
    is skipped with a warning, and an older one is tried.
    """
    fs = _store.filesystem(snapshot_dir)
    try:
        base_time = float(json.loads(fs.read_text(fs.join(snapshot_dir, _store.MANIFEST))).get("time", 0.0))
    except Exception:  # pylint: disable=broad-except  (no readable manifest: no base to apply a delta to)
        return None
    for step in reversed(_delta_steps(snapshot_dir, fs)):
        npz_name, json_name = _names(step)
        try:
            manifest = json.loads(fs.read_bytes(fs.join(snapshot_dir, json_name)))
            if int(manifest["base_step"]) != base_step or int(manifest["step"]) != step:
                raise DataError(f"it names base step {manifest['base_step']} and step {manifest['step']}")
            if float(manifest.get("time", 0.0)) < base_time:
                raise DataError("it was written before its full snapshot: a leftover of an earlier run")
            with np.load(io.BytesIO(fs.read_bytes(fs.join(snapshot_dir, npz_name)))) as loaded:
                arrays = {name: loaded[name] for name in loaded.files}
            delta = Delta(fs.join(snapshot_dir, json_name), manifest, arrays)
            list(delta.entries())  # every array the manifest names is there
        except Exception as error:  # pylint: disable=broad-except  (a torn or foreign file, or a gfile error)
            logger.warning("PeriodicSync: cannot read the delta of step %d in %s (%s: %s); trying an older one",
                           step, snapshot_dir, type(error).__name__, _store.first_line(error))
            continue
        return delta
    return None
