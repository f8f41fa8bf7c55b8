"""Resuming from snapshots: the newest readable one restored into a model, then its newest delta.

`restore_newest` tries the complete snapshots of a directory, newest first:
one whose files cannot be read is skipped with a warning; one that can be
read but does not hold every variable of the model and its optimizer (and
every DynamicEmbedding table) is a ValueError, not a partial restore.
`apply_newest_delta` then writes the rows of the snapshot's newest delta
(`tf_psx.snapshots.deltas`) into the variables. `latest` says where a fit
in a directory resumes without a model. The messages name PeriodicSync,
the callback users meet (`tf_psx.snapshots.engine` runs this for it).
"""

from __future__ import annotations

import dataclasses
import logging
import re

import tensorflow as tf

from tf_psx import tables as _tables
from tf_psx._tf import checkpoint as _checkpoint, tfra as _tfra
from tf_psx.errors import DataError
from tf_psx.snapshots import deltas as _deltas, store as _store
from tf_psx.tables import from_tfra as _from_tfra
from tf_psx.training import exact_updates as _exact_updates

__all__ = ["restore_newest", "apply_newest_delta", "snapshots", "latest", "tfra_scratch_types"]

logger = logging.getLogger("tf_psx")

Snapshot = _store.Snapshot
# The tensor of a TF2 checkpoint that holds its object graph (TF's
# `trackable.base.OBJECT_GRAPH_PROTO_KEY`): reading it checks that the index
# and the data file can be opened before anything is restored.
_OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
# An error names at most this many objects a snapshot did not restore: enough
# to recognise the model, short enough to read in a log.
_NAMES_SHOWN = 10


def _is_sharded(variable) -> bool:
    return isinstance(variable, tf.__internal__.distribute.ShardedVariable)


# -- without a model ---------------------------------------------------------


def snapshots(directory) -> list[Snapshot]:
    """The complete snapshots in `directory`, oldest first."""
    return _store.SnapshotStore(directory, max_to_keep=1).snapshots()


def latest(directory) -> Snapshot | None:
    """Where a fit in `directory` resumes: the newest complete snapshot, or None.

    When that snapshot has a readable delta snapshot, its `step`, `epoch`
    and `step_in_epoch` are the delta's (`delta_of` is the full snapshot's
    step; `path` and `checkpoint` stay the full snapshot's).
    """
    found = snapshots(directory)
    if not found:
        return None
    delta = _deltas.latest_delta(found[-1].path, found[-1].step)
    return found[-1] if delta is None else _with_delta(found[-1], delta)


def _with_delta(snapshot: Snapshot, delta) -> Snapshot:
    """The resume point of a full snapshot and its delta."""
    manifest = delta.manifest
    return dataclasses.replace(snapshot, step=delta.step, epoch=int(manifest["epoch"]),
                               step_in_epoch=int(manifest["step_in_epoch"]),
                               steps_per_epoch=manifest.get("steps_per_epoch"), delta_of=snapshot.step)


# -- what a snapshot must hold -----------------------------------------------


def _unreadable(prefix: str) -> str | None:
    """Why the checkpoint at `prefix` cannot be opened, or None when it can.

    Only local files are read (the index and the object graph), so the
    errors caught here are about those files. TF 2.16's checkpoint reader
    raises a bare `tf.errors.OpError` (code UNKNOWN) for a missing or
    unparsable file or a bad checksum, and IndexError for a truncated data
    file.
    """
    try:
        # Not tf.train.load_checkpoint: on ram:// it takes the prefix for a directory.
        tf.compat.v1.train.NewCheckpointReader(prefix).get_tensor(_OBJECT_GRAPH_KEY)
    except (tf.errors.OpError, IndexError) as error:
        return f"{type(error).__name__}: {_store.first_line(error)}"
    return None


def _state_name(obj) -> str:
    """A readable name for a variable, a ShardedVariable or a TFRA table."""
    if _is_sharded(obj) and obj.variables:
        obj = obj.variables[0]
    name = str(getattr(obj, "name", None) or type(obj).__name__)
    return re.sub(r"(/part_\d+)?:\d+$", "", name)


def tfra_scratch_types() -> tuple:
    """TFRA's per-step lookup buffers: variables that no snapshot can restore.

    A DynamicEmbedding's trainable weight is a ShadowVariable (a
    TrainableWrapper) with DEResourceVariable helpers; they hold the rows of
    the last batch, are written into snapshots, and are never matched on
    restore (TFRA 0.8.1). The state they stand for is the table.
    """
    if not _tfra.tfra_loaded():
        return ()
    de = _tfra.tfra()
    return (de.TrainableWrapper, de.shadow_ops.DEResourceVariable)


def _required_state(model) -> list:
    """What a snapshot of `model` must restore: every variable of the model and
    of its optimizer that exists now (shards as their ShardedVariable), and
    every DynamicEmbedding table. Optimizer slots made on the first apply do
    not exist yet and are restored when they are made (a deferred restore)."""
    from tf_psx.layers import DynamicEmbedding  # pylint: disable=import-outside-toplevel

    owners = {}
    for obj in tf.train.TrackableView(model).descendants():
        if _is_sharded(obj):
            for shard in obj.variables:
                owners[id(shard)] = obj
    scratch = tfra_scratch_types()
    candidates = list(model.variables)
    if model.optimizer is not None:
        candidates += list(model.optimizer.variables)
    required = {}
    for variable in candidates:
        if scratch and isinstance(variable, scratch):
            continue
        owner = owners.get(id(variable), variable)
        required.setdefault(id(owner), owner)
    for layer in model.submodules:
        if isinstance(layer, DynamicEmbedding):
            table = layer.native_table if layer.store == "native" else layer.table
            required.setdefault(id(table), table)
    return list(required.values())


def _restored_ids(status) -> set[int]:
    return _checkpoint.restored_ids(status)


def mismatch(snapshot: Snapshot, what: str, directory: str) -> str:
    """The error text for a snapshot in `directory` that holds `what` instead of this model's state."""
    return (
        f"PeriodicSync cannot resume from {snapshot.path} (step {snapshot.step}): it holds {what}. It was "
        "written by another model or optimizer, or the model changed since. fit stopped before its first step "
        f"rather than skip {snapshot.step} steps with weights it did not restore. Fix: point `directory` at "
        f"this model's own snapshots (one directory per training run), or delete the snapshot-* directories "
        f"of the other model from {directory} to train from step 0."
    )


# -- restoring -----------------------------------------------------------------


def restore_newest(store: _store.SnapshotStore, checkpoint: tf.train.Checkpoint, model,
                   options: tf.train.CheckpointOptions | None = None) -> Snapshot | None:
    """Restores the newest snapshot of `store` that can be read into `checkpoint`; None when there is none.

    A snapshot whose files cannot be read is skipped with a warning (an
    older one is tried). A snapshot that can be read but does not hold
    the state of `model` (the root of `checkpoint`) raises: an older one
    from the same directory would not either, and training on would skip
    the steps it records with weights it did not restore. Any other error
    (e.g. a ps task that is down) propagates.
    """
    for path in store.incomplete():
        logger.warning("PeriodicSync: skipping %s: it has no manifest or no checkpoint index (a write that did "
                       "not finish); it is never restored", path)
    for snapshot in reversed(store.snapshots()):
        cause = _unreadable(snapshot.checkpoint)
        if cause is None and _from_tfra.holds_tfra_tables_of(model, snapshot.checkpoint):
            # Written by this model with TFRA-backed hash tables, resumed on tf_psx's own (tf_psx.tables.from_tfra).
            loaded = _from_tfra.restore_from_tfra(model, snapshot.checkpoint)
            logger.info("PeriodicSync: %s (step %d) holds TFRA tables; restored into the native tables of %s",
                        snapshot.path, snapshot.step, ", ".join(loaded))
            return snapshot
        if cause is None:
            try:
                # `read` is the counterpart of `write` (no save_counter).
                status = checkpoint.read(snapshot.checkpoint, options=options)
            except tf.errors.DataLossError as error:  # a tensor whose checksum does not match
                cause = f"{type(error).__name__}: {_store.first_line(error)}"
            except ValueError as error:  # a tensor of another shape or dtype than the variable
                what = f"a value of another shape or dtype ({_store.first_line(error)})"
                raise DataError(mismatch(snapshot, what, store.directory)) from error
        if cause is not None:
            logger.warning("PeriodicSync: cannot read %s (%s); trying an older snapshot", snapshot.path, cause)
            continue
        # Values in the snapshot that nothing here takes are expected: TFRA's
        # lookup buffers, and slots that are made on the first apply (restored then).
        status.expect_partial()
        # Hash tables written with another number of ps tasks, and tables
        # restored without the admission counts their layer now keeps.
        _tables.restore_tables(model, snapshot.checkpoint)
        _tables.seed_policies(model, snapshot.step)
        restored = _restored_ids(status)
        required = _required_state(model)
        missing = [_state_name(obj) for obj in required if id(obj) not in restored]
        if missing:
            shown = ", ".join(missing[:_NAMES_SHOWN]) + (
                f" and {len(missing) - _NAMES_SHOWN} more" if len(missing) > _NAMES_SHOWN else "")
            raise DataError(mismatch(
                snapshot, f"{len(required) - len(missing)} of the {len(required)} variables and tables of this "
                f"model and its optimizer; not in it: {shown}", store.directory))
        return snapshot
    return None


def apply_newest_delta(snapshot: Snapshot, model, tracker: _deltas.DeltaTracker, directory: str) -> Snapshot:
    """Applies the newest readable delta of `snapshot` (restored into `model`); returns what fit resumes from.

    The variables are `tracker`'s (by checkpoint path); the rows written are
    marked in it, so that the next delta holds them.
    """
    delta = _deltas.latest_delta(snapshot.path, snapshot.step)
    if delta is None:
        return snapshot
    variables, unknown, counters = tracker.variables, [], {}
    for path, rows, values in delta.entries():
        counter = _exact_updates.counter_path_name(path)
        if counter is not None:
            counters[counter] = int(values)
        variable = variables.get(path)
        if variable is None:
            if counter is not None and model.optimizer is not None:
                # Made by the first update: set then.
                _exact_updates.restore_counter_later(model.optimizer, counter, values)
            else:
                unknown.append(path)
            continue
        full = _deltas.full_shape(variable)
        shape, got = (full[1:], values.shape[1:]) if rows is not None else (full, values.shape)
        if tuple(shape) != tuple(got) or (rows is not None and rows.size and int(rows.max()) >= full[0]):
            raise DataError(mismatch(snapshot, f"a delta ({delta.path}) with {path} of shape "
                                               f"{tuple(got)}{' per row' if rows is not None else ''} "
                                               f"where this model has {tuple(full)}", directory))
        # Rows count across all shards: the delta restores onto any number of ps tasks.
        _deltas.apply_rows(variable, rows, values)
        tracker.mark_written(path, rows)
    _tables.carry_step_counters(model, counters)  # a table's counters under another layout's names
    if unknown:
        # Variables made lazily by the first step (compiled metrics): the full snapshot's deferred restore
        # covers them, at the full snapshot's values.
        logger.warning("PeriodicSync: %d values of the delta %s have no variable here yet, and keep the values "
                       "of the full snapshot: %s", len(unknown), delta.path, ", ".join(unknown[:_NAMES_SHOWN]))
    logger.info("PeriodicSync: applied the delta of step %d (%d rows) on top of %s", delta.step,
                delta.manifest.get("rows", 0), snapshot.path)
    return _with_delta(snapshot, delta)
