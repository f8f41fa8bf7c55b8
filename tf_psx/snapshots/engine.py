"""The snapshot engine: one run's snapshots of one model, restored at the start, written at a barrier.

`SnapshotEngine` is what `tf_psx.callbacks.PeriodicSync` (a Keras adapter
that decides *when*) drives, as tf-keras's `BackupAndRestore` drives its
`WorkerTrainingState`:

* `begin(model)`: checks the directory can be written, removes what an
  interrupted write left, restores the newest readable snapshot and its
  newest delta (`tf_psx.snapshots.restore`), and sets up the row tracking
  for deltas (`tf_psx.snapshots.deltas`);
* `snapshot(step, position)`: a barrier (no step in flight; a partial sync
  step applied), then a full snapshot, committed atomically by the store
  (`tf_psx.snapshots.store`), synchronously or in the background
  (`_BackgroundCommit`: TF's async checkpoint, then the manifest and the
  prune on a thread of its own);
* `delta(step, position)`: a barrier, then the rows changed since the full
  snapshot;
* `finish_pending()`: waits for the background snapshot in flight.
  `finish_snapshots_of(strategy)` does it for every engine of a strategy
  (a switch of the sync mode waits for them).

Its messages name PeriodicSync, the callback users meet.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

import tensorflow as tf

from tf_psx import optimizers as _optimizers, tables as _tables
from tf_psx._tf import fit_hooks as _fit_hooks, keras as _tf_keras
from tf_psx._tf import runtime as _runtime
from tf_psx.errors import ArgumentError, SnapshotDirectoryError
from tf_psx.snapshots import deltas as _deltas, restore as _restore, store as _store
from tf_psx.training import exact_updates as _exact_updates

__all__ = ["SnapshotEngine", "finish_snapshots_of"]

logger = logging.getLogger("tf_psx")
_keras = _tf_keras.keras()

Snapshot = _store.Snapshot
# The file the engine writes and removes to check its directory before the first step.
_WRITE_CHECK_NAME = ".tf_psx-write-check"
# Engines with a background snapshot in flight, and their strategy.
_WRITING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _hook_before_commit(path: str) -> None:  # pylint: disable=unused-argument
    """Called after a snapshot is written and before it is renamed (a seam for crash tests)."""


def _check_writable(directory, store) -> None:
    """Raises SnapshotDirectoryError, naming PeriodicSync and the argument, when `directory` cannot be written.

    A path under a file, under /proc, or an unreachable bucket failed at the
    first snapshot with the filesystem's own text (NotADirectoryError,
    FileNotFoundError, libcurl), which named neither.
    """
    probe = store.fs.join(directory, f"{_WRITE_CHECK_NAME}-{os.getpid()}")
    try:
        store.fs.makedirs(directory)
        store.fs.write_bytes(probe, b"")
        store.fs.remove_file(probe)
    except Exception as err:  # pylint: disable=broad-except  (any filesystem's error: OSError, tf.errors, ...)
        text = str(err).strip()
        first = text.splitlines()[0][:200] if text else ""
        raise SnapshotDirectoryError(
            f"Argument `directory` of PeriodicSync cannot be written: {directory!r} ({type(err).__name__}: "
            f"{first}). fit stopped before its first step. Fix: pass a directory this process can create and "
            "write: a local path whose parents are directories, or a reachable gs://, s3:// or hdfs:// location."
        ) from None


def finish_snapshots_of(strategy) -> int:
    """Waits for the background snapshots being written under `strategy`; returns how many there were."""
    writers = [engine for engine, owner in list(_WRITING.items()) if owner is strategy]
    for engine in writers:
        engine.finish_pending()
    return len(writers)


class _BackgroundCommit:
    """One background snapshot: the async write starts on the caller's thread, the commit finishes on its own."""

    def __init__(self, store, step: int, checkpoint, options, manifest: dict):
        self.error: BaseException | None = None
        self._store, self._step, self._checkpoint = store, step, checkpoint
        self._options, self._manifest = options, manifest
        self._started = threading.Event()
        self._prefix: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"tf_psx-snapshot-{step}", daemon=True)

    def start_write(self) -> None:
        """Returns once the values are copied and the files are being written (the training stall)."""
        self._thread.start()
        self._started.wait()
        if self.error is not None:
            self.join()
            raise self.error

    def _write(self, prefix: str) -> None:
        try:
            self._checkpoint.write(prefix, options=self._options)
        finally:
            self._started.set()

    def _run(self) -> None:
        try:
            self._store.commit(self._step, self._write, self._manifest, wait=self._checkpoint.sync)
            self._store.prune(self._step)
        except BaseException as error:  # pylint: disable=broad-except  (raised on the training thread)
            self.error = error
        finally:
            self._started.set()

    def join(self) -> None:
        self._thread.join()


class SnapshotEngine:
    """The snapshots of one training run in one directory (see the module docstring).

    The arguments are PeriodicSync's, checked by it.

    Args:
      directory: where snapshots go: a local path or any `tf.io.gfile` URL.
      max_to_keep: complete snapshots kept.
      background: write full snapshots in the background (not for a model
        with a DynamicEmbedding: TF's async checkpoint does not copy hash
        tables).
      delta_every_n_steps: None (no deltas), or the steps between deltas.
      delta_rows_by: "auto" (row marks where the updates allow, else
        fingerprints) or "fingerprint".

    Attributes (set by `begin`):
      model: the model of the current fit.
      checkpoint: its `tf.train.Checkpoint` (model and optimizer).
      options: the `tf.train.CheckpointOptions` of every read and write.
      writes: whether this process writes (a ParameterServerStrategy's
        `should_checkpoint`).
      tracker: the `DeltaTracker`, or None without deltas.
      base: the full snapshot deltas are written against, or None.
      delta_tracking: how the changed rows of each large variable are
        found: "marks" or "fingerprint" (by checkpoint path).
    """

    def __init__(self, directory: str, max_to_keep: int, background: bool = False,
                 delta_every_n_steps: int | None = None, delta_rows_by: str = "auto"):
        self.directory, self.max_to_keep = directory, max_to_keep
        self.background, self.delta_every_n_steps, self.delta_rows_by = background, delta_every_n_steps, delta_rows_by
        self.store = _store.SnapshotStore(directory, max_to_keep, before_commit=lambda path: _hook_before_commit(path))
        self.model = None
        self.checkpoint: tf.train.Checkpoint | None = None
        self.options: tf.train.CheckpointOptions | None = None
        self.is_ps = False
        self.writes = True
        self.tracker: _deltas.DeltaTracker | None = None
        self.base: Snapshot | None = None
        self.delta_tracking: dict[str, str] = {}
        self._background = background
        self._pending: _BackgroundCommit | None = None  # the thread finishing the last background snapshot
        # Per full snapshot, where its seconds went: {"step", "barrier", "previous_write" (waiting for the
        # background write still in flight), "write" (synchronous: the whole write; background: the copy)}.
        self.splits: list[dict] = []

    # -- the start of a fit ---------------------------------------------------

    def begin(self, model) -> Snapshot | None:
        """Prepares the snapshots of `model` and restores the newest; returns what fit resumes from, or None.

        Raises:
          ValueError: deltas asked of a model with a DynamicEmbedding, or a
            snapshot in the directory that is not of this model.
          SnapshotDirectoryError: the directory cannot be written.
        """
        self.model = model
        strategy = model.distribute_strategy
        self.is_ps = _runtime.is_parameter_server_strategy(strategy)
        self.writes = bool(getattr(strategy.extended, "should_checkpoint", True))
        if model.optimizer is not None and not getattr(model.optimizer, "_built", False):
            # Slots must exist before a restore so that it fills them now.
            # The name scope gives the slots the names apply_gradients would.
            with strategy.scope(), tf.name_scope(model.optimizer.name):
                model.optimizer.build(model.trainable_variables)
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        self.options = None
        if self.is_ps and not _store.is_local(self.directory):
            # The ps tasks would write their own shards through their own
            # filesystem; on a remote one every file goes through the coordinator.
            resolver = strategy.cluster_resolver
            job, task = getattr(resolver, "task_type", None) or "chief", getattr(resolver, "task_id", None) or 0
            device = f"/job:{job}/replica:0/task:{task}/device:CPU:0"
            self.options = tf.train.CheckpointOptions(experimental_io_device=device)
        if self.delta_every_n_steps is not None and _tables.table_layers(model):
            names = ", ".join(layer.name for layer in _tables.table_layers(model))
            raise ArgumentError(
                f"PeriodicSync(delta_every_n_steps={self.delta_every_n_steps}) cannot write delta snapshots of model "
                f"{model.name}: its DynamicEmbedding layers ({names}) are hash tables, which have no row index to "
                "find the changed rows by. Fix: pass delta_every_n_steps=None (full snapshots only, e.g. more "
                "often with background=True), or use tf_psx.layers.ShardedEmbedding for these features.")
        self._background = self.background
        if self._background and _tables.table_layers(model):
            logger.info("PeriodicSync: model %s holds DynamicEmbedding tables, which TF's async checkpoint does not "
                        "copy; its snapshots are written synchronously", model.name)
            self._background = False
        if self._background:
            self.options = tf.train.CheckpointOptions(
                experimental_io_device=getattr(self.options, "experimental_io_device", None),
                experimental_enable_async_checkpoint=True)
        if self.writes:
            _check_writable(self.directory, self.store)
            self.store.clean_temporaries()
        restored = _restore.restore_newest(self.store, self.checkpoint, model, self.options)
        self.base, self.tracker = restored, None
        if self.delta_every_n_steps is not None:
            variables = _deltas.variables_by_path(self.checkpoint, skip=_restore.tfra_scratch_types())
            marks = self._row_marks(variables) if self.delta_rows_by == "auto" else {}
            self.tracker = _deltas.DeltaTracker(variables, strategy, row_marks=marks)
            self.delta_tracking = {path: "marks" if path in self.tracker.marked else "fingerprint"
                                   for path in self.tracker.tracked}
            if restored is not None:
                self.tracker.rebase()  # the full snapshot is the base; its delta is applied on top
                restored = _restore.apply_newest_delta(restored, model, self.tracker, self.directory)
        return restored

    def _row_marks(self, variables: dict) -> dict:
        """Masks of the rows each update writes, for the large trainable variables and their slots.

        Only where an update writes nothing but its gradient's rows
        (`tf_psx.optimizers.updates_touched_rows_only`) and runs through the
        exact-update lock (a ParameterServerStrategy with `exact_updates`);
        otherwise {} (every large variable is fingerprinted). A new mask makes
        the train function again, so that its updates set it.
        """
        model, strategy = self.model, self.model.distribute_strategy
        optimizer = model.optimizer
        if not (self.is_ps and getattr(strategy, "exact_updates", False) and optimizer is not None
                and _optimizers.updates_touched_rows_only(optimizer)):
            return {}
        large = {id(shard) for value in variables.values()
                 if _deltas.full_shape(value) and _deltas.full_shape(value)[0] >= _deltas.MIN_ROWS
                 for shard, _ in _deltas.shards_of(value)}
        if type(model).train_step is not _keras.Model.train_step:
            # A train_step of its own may write the tables otherwise (another optimizer, a direct assign).
            return {}
        # Marked: what the optimizer updates and nothing rewrites in full afterwards (a Keras constraint
        # is applied to the whole variable after the update).
        trainable = [variable for variable in model.trainable_variables
                     if id(variable) in large and getattr(variable, "constraint", None) is None
                     and _exact_updates.updates(optimizer, variable)]
        slots = _exact_updates.slots_of(optimizer, trainable)
        marks, new = {}, False
        for variable in trainable:
            mask = _exact_updates.row_marks_of(optimizer, variable)
            if mask is None:
                with strategy.scope(), strategy.extended.colocate_vars_with(variable):
                    mask = tf.Variable(tf.zeros([variable.shape[0]], tf.bool), trainable=False,
                                       name="tf_psx_row_marks")
            new = _exact_updates.register_row_marks(optimizer, variable, mask) or new
            for shard in [variable, *slots.get(id(variable), [])]:
                marks[id(shard)] = mask
        if new:
            _fit_hooks.rebuild_train_function(model)
        return marks

    # -- writes -----------------------------------------------------------------

    def barrier(self) -> None:
        """Returns once no step is in flight (and a partial sync step is applied)."""
        if self.is_ps:
            strategy = self.model.distribute_strategy
            tf.distribute.experimental.coordinator.ClusterCoordinator(strategy).join()
            controller = getattr(strategy, "sync_controller", None)
            if controller is not None:
                # A partial sync step is applied first: the snapshot holds every batch trained before it.
                controller.flush()

    def finish_pending(self) -> None:
        """Waits for the background snapshot in flight (if any); its error is raised here."""
        pending, self._pending = self._pending, None
        _WRITING.pop(self, None)
        if pending is None:
            return
        pending.join()
        if pending.error is not None:
            raise pending.error

    def snapshot(self, step: int, position: dict) -> float:
        """A barrier, then the full snapshot of `step`; returns its seconds.

        Args:
          step: the global step.
          position: the manifest's `epoch`, `step_in_epoch` and `steps_per_epoch`.
        """
        start = time.perf_counter()
        self.barrier()
        barrier = time.perf_counter() - start
        self.finish_pending()
        waited = time.perf_counter() - start - barrier
        if self.writes:
            manifest = {**position, "seconds": time.perf_counter() - start}
            if self._background:
                # The values are copied now; the files, the manifest and the prune follow in a thread.
                self._pending = _BackgroundCommit(self.store, step, self.checkpoint, self.options, manifest)
                _WRITING[self] = self.model.distribute_strategy
                self._pending.start_write()
            else:
                self.store.commit(step, lambda prefix: self.checkpoint.write(prefix, options=self.options), manifest)
                self.store.prune(step)
            if self.tracker is not None:
                # The values just saved (still, under the barrier) are the new base.
                self.tracker.rebase()
                self.base = Snapshot(path=self.store.path_of(step), step=step, epoch=position["epoch"],
                                     step_in_epoch=manifest["step_in_epoch"],
                                     steps_per_epoch=manifest["steps_per_epoch"], seconds=0.0)
        seconds = time.perf_counter() - start
        self.splits.append({"step": step, "barrier": barrier, "previous_write": waited,
                            "write": seconds - barrier - waited})
        logger.info("PeriodicSync: snapshot of step %d in %.2f s (barrier %.2f s, waiting for the previous "
                    "background write %.2f s)", step, seconds, barrier, waited)
        return seconds

    def delta(self, step: int, position: dict) -> tuple[float, int]:
        """A barrier, then the delta of `step` on the base; returns its seconds and rows."""
        start = time.perf_counter()
        self.barrier()
        self.finish_pending()  # the base must be committed first
        record = {"rows": 0, "bytes": 0}
        if self.writes:
            self.tracker.add_new(_deltas.variables_by_path(self.checkpoint, skip=_restore.tfra_scratch_types()))
            record = _deltas.write_delta(self.base.path, step, self.base.step, self.tracker.changed(),
                                         {**position, "seconds": time.perf_counter() - start})
        seconds = time.perf_counter() - start
        logger.info("PeriodicSync: delta of step %d on the snapshot of step %d: %d rows, %d bytes, in %.2f s",
                    step, self.base.step, record["rows"], record["bytes"], seconds)
        return seconds, int(record["rows"])
