"""`PeriodicSync`: every N steps a barrier and an atomic snapshot; fit resumes from the newest.

A Keras adapter over the snapshot engine (`tf_psx.snapshots.engine`), as
tf-keras's `BackupAndRestore` is over `WorkerTrainingState`: this module
checks the arguments, counts fit's steps across epochs and decides when a
full or a delta snapshot is due; the engine restores, writes and commits.
"""

from __future__ import annotations

import logging
from typing import Literal

from tf_psx import _checks
from tf_psx._tf import fit_hooks as _fit_hooks
from tf_psx.callbacks.base import _SNAPSHOT_SECONDS, _RunCallback, _check_path
from tf_psx.errors import ArgumentError
from tf_psx.snapshots import restore as _restore
from tf_psx.snapshots.engine import SnapshotEngine, finish_snapshots_of
from tf_psx.snapshots.store import Snapshot

__all__ = ["PeriodicSync", "finish_snapshots_of"]

logger = logging.getLogger("tf_psx")


class PeriodicSync(_RunCallback):
    """Every N steps: a barrier, then an atomic snapshot; fit resumes from the newest.

    Every `every_n_steps` steps (counted over the whole run, across epochs):

    1. `coordinator.join()` waits until no step is in flight, so the
       snapshot holds the effect of exactly the steps done;
    2. the coordinator writes the model, the optimizer (slots and
       `iterations`) and every DynamicEmbedding table (their `tf.train.Checkpoint`
       dependencies) to `<directory>/.tmp-snapshot-<step>-<id>/`, then a
       manifest with the step counter, then renames the directory to
       `<directory>/snapshot-<step>`. A crash at any point leaves either no
       new snapshot or a temporary directory that is never restored;
    3. the steps scheduled next read the parameters as saved: every worker
       starts from the same state.

    When `fit` starts, the newest complete snapshot is restored (an older
    one if the files of the newest cannot be read, with a warning) and fit
    continues from its step, like `tf.keras.callbacks.BackupAndRestore`: the
    steps already done are not run again. A snapshot that can be read but
    does not hold every variable of the model and its optimizer (and every
    DynamicEmbedding table) is an error, not a partial restore: it was
    written by another model. Each snapshot is logged with its duration;
    `snapshot_seconds` keeps the durations.

    After each write, only the newest `max_to_keep` snapshots up to the step
    just written are kept. Snapshots with a higher step (an earlier run's in
    the same directory, or ones that could not be read) are never deleted and
    not counted: a warning names them, since a later fit tries them first.
    Replacing and pruning a snapshot are renames as well: a snapshot
    directory is complete or absent, never half deleted.

    Example:

    >>> import tempfile, numpy as np, tensorflow as tf, tf_psx
    >>> directory = tempfile.mkdtemp()
    >>> def build():
    ...     model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    ...     model.compile("sgd", "mse")
    ...     return model
    >>> x, y = np.ones((40, 2)), np.ones(40)
    >>> sync = tf_psx.callbacks.PeriodicSync(every_n_steps=4, directory=directory)
    >>> _ = build().fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[sync])
    >>> [s.step for s in tf_psx.callbacks.PeriodicSync.snapshots(directory)]
    [4, 8, 10]
    >>> resumed = build()
    >>> history = resumed.fit(x, y, batch_size=4, epochs=2, verbose=0,
    ...                       callbacks=[tf_psx.callbacks.PeriodicSync(4, directory)])
    >>> len(history.history["loss"]), int(resumed.optimizer.iterations.numpy())  # only epoch 2 ran
    (1, 20)

    Args:
      every_n_steps: int >= 1, steps between snapshots.
      directory: where snapshots go: a local path (the commit is a directory
        rename) or any `tf.io.gfile` URL (`gs://`, `s3://`, `hdfs://`,
        `ram://`; the manifest, written last, commits; under a
        ParameterServerStrategy every file is written by the coordinator).
        Use one directory per training run.
      max_to_keep: int >= 1, complete snapshots kept.
      background: write in the background (TF's async checkpoint,
        `CheckpointOptions(experimental_enable_async_checkpoint=True)`): the
        values are copied at the barrier, training resumes, and a thread
        writes the files, then the manifest. At most one snapshot is in
        flight: the next one, and the end of fit, wait for it. A model with
        a DynamicEmbedding is written synchronously (TF's async checkpoint
        copies variables only, not TFRA's hash tables), logged once.
      delta_every_n_steps: None (no deltas) or an int >= 1 below
        `every_n_steps`: steps between delta snapshots. A delta waits for a
        background full snapshot still being written.
      delta_rows_by: how a delta finds the changed rows of the tables. "auto":
        under a ParameterServerStrategy with exact updates and an optimizer
        whose update writes only the gradient's rows
        (`tf_psx.optimizers.updates_touched_rows_only`: LazyAdam, tf_psx's
        SGD, Adagrad), each update marks its rows beside the table, and a
        delta reads the marks; otherwise, and with "fingerprint", by content
        (a fingerprint per row). Marks are not used for a variable with a
        Keras constraint (applied to every row after the update) or one the
        optimizer was not built for, nor for a model with a `train_step` of
        its own. They miss values written outside the optimizer (`assign`,
        `set_weights`) between a full snapshot and a delta; fingerprints miss
        nothing.

    Attributes:
      restored: the `Snapshot` restored when the last fit started, or None.
      snapshot_seconds: seconds of each snapshot this callback wrote.
      snapshot_splits: where each snapshot's seconds went: {"step",
        "barrier", "previous_write" (waiting for a background write still in
        flight), "write" (the write; with background=True the copy on the
        ps tasks and the start of the write)}.
      delta_seconds: seconds of each delta (barrier, finding the rows, write).
      delta_rows: rows of the large variables in each delta.
      delta_tracking: how the changed rows of each large variable are found
        in this fit: "marks" or "fingerprint" (by checkpoint path).

    Raises:
      ValueError: bad arguments, BackupAndRestore in the same fit, or (when
        fit starts) a snapshot in `directory` that is not of this model.

    Delta snapshots (`delta_every_n_steps`): between two full snapshots,
    every `delta_every_n_steps` steps a barrier and a *delta*: the rows of the
    large variables (the tables and their optimizer slots) that changed since
    the last full snapshot, and every small variable whole, found by a
    fingerprint per row kept on each ps task (`tf_psx.snapshots.deltas`: exact for
    every optimizer), or, with an optimizer that writes only the gradient's
    rows, from marks that each update sets (`delta_rows_by`). A delta is a few files in the full snapshot's directory,
    the manifest last; only the newest is kept (they are cumulative). A fit
    that resumes restores the newest full snapshot, then its newest delta,
    and continues from the delta's step: a crash (a ps task's included)
    loses at most `delta_every_n_steps` steps instead of `every_n_steps`.
    A fit that starts with no snapshot to build on writes a full one at its
    first delta point. `delta_seconds` and `delta_rows` keep each delta's
    cost and size.

    Known limitations:
      * Delta snapshots are refused for a model with a DynamicEmbedding
        (a hash table has no row index to fingerprint): ValueError when fit
        starts.
      * The position in the input data is not saved: after a resume the
        dataset starts from its beginning. Use a shuffled, repeated dataset
        (any order is as good), or skip `PeriodicSync.latest(directory).step`
        batches yourself (docs/guides/staleness.md shows how).
      * A snapshot is also written at the end of fit (when its step is not
        one already); a fit whose snapshot is already at its last step runs
        no step and tf-keras raises "Unexpected result of train_function".
        Raise `epochs`, or use a fresh directory, to train again.
      * Under ParameterServerStrategy the barrier stalls the workers while
        the coordinator writes; the cost is in `snapshot_seconds`.
    """

    def __init__(self, every_n_steps: int, directory, max_to_keep: int = 3, background: bool = False,
                 delta_every_n_steps: int | None = None,
                 delta_rows_by: Literal["auto", "fingerprint"] = "auto"):
        super().__init__()
        if delta_rows_by not in ("auto", "fingerprint"):
            raise ArgumentError(f"Argument `delta_rows_by` of PeriodicSync must be 'auto' or 'fingerprint'. Received: "
                                f"{delta_rows_by!r}. Fix: pass delta_rows_by='fingerprint' to find changed rows by "
                                "content only, or leave the default.")
        self.delta_rows_by = delta_rows_by
        if not isinstance(background, bool):
            raise ArgumentError(f"Argument `background` of PeriodicSync must be True or False. Received: {background!r}. "
                                "Fix: pass background=True to write snapshots in the background.")
        self.background = background
        self.every_n_steps = _checks.int_at_least(every_n_steps, 1, "every_n_steps", owner="PeriodicSync",
                                        fix='pass e.g. PeriodicSync(every_n_steps=100, directory="/tmp/run1")')
        self.directory = _check_path("PeriodicSync", "directory", directory)
        self.max_to_keep = _checks.int_at_least(max_to_keep, 1, "max_to_keep", owner="PeriodicSync",
                                        fix='pass e.g. PeriodicSync(100, "/tmp/run1", max_to_keep=3)')
        self.delta_every_n_steps = None
        if delta_every_n_steps is not None:
            self.delta_every_n_steps = _checks.int_at_least(
                delta_every_n_steps, 1, "delta_every_n_steps", owner="PeriodicSync",
                fix="pass e.g. PeriodicSync(every_n_steps=500, directory=..., delta_every_n_steps=20)")
            if self.delta_every_n_steps >= self.every_n_steps:
                raise ArgumentError(
                    f"Argument `delta_every_n_steps` of PeriodicSync must be below `every_n_steps` "
                    f"({self.every_n_steps}): a delta holds what changed since the last full snapshot. Received: "
                    f"{delta_every_n_steps!r}. Fix: pass a smaller delta_every_n_steps, or None for full snapshots "
                    "only.")
        self.restored: Snapshot | None = None
        self.snapshot_seconds: list[float] = []
        self.delta_seconds: list[float] = []
        self.delta_rows: list[int] = []
        self.delta_tracking: dict[str, str] = {}
        self._last_delta = -1
        self._step = 0
        self._epoch = 0
        self._epoch_start = 0
        self._resume_in_epoch = 0
        self._last_saved = -1
        self._engine = SnapshotEngine(self.directory, self.max_to_keep, background=self.background,
                                      delta_every_n_steps=self.delta_every_n_steps, delta_rows_by=self.delta_rows_by)

    @property
    def snapshot_splits(self) -> list[dict]:
        """Where each full snapshot's seconds went (see the class's Attributes)."""
        return list(self._engine.splits)

    # -- finding snapshots (usable without a model) ---------------------------

    @staticmethod
    def snapshots(directory) -> list[Snapshot]:
        """The complete snapshots in `directory`, oldest first."""
        return _restore.snapshots(directory)

    @staticmethod
    def latest(directory) -> Snapshot | None:
        """Where a fit in `directory` resumes: the newest complete snapshot, or None.

        When that snapshot has a readable delta snapshot, its `step`, `epoch`
        and `step_in_epoch` are the delta's (`delta_of` is the full
        snapshot's step; `path` and `checkpoint` stay the full snapshot's).
        """
        return _restore.latest(directory)

    # -- fit hooks ------------------------------------------------------------

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        model = self.model
        self._seconds = _SNAPSHOT_SECONDS.setdefault(model, [])
        steps = (self.params or {}).get("steps")
        self.restored = self._engine.begin(model)
        if self.delta_every_n_steps is not None:
            self.delta_tracking = self._engine.delta_tracking
        self._step, self._resume_in_epoch = 0, 0
        if self.restored is not None:
            epoch, in_epoch = self.restored.resume_point(steps)
            _fit_hooks.set_initial_counters(model, epoch, in_epoch)
            self._step, self._resume_in_epoch = self.restored.step, in_epoch
            logger.info("PeriodicSync: restored %s (step %d); fit continues at epoch %d, step %d",
                        self.restored.path, self.restored.step, epoch + 1, in_epoch)
        self._last_saved = self._last_delta = self._step

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_start = self._step - self._resume_in_epoch
        self._resume_in_epoch = 0

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the index of the last step of the execution in this epoch.
        self._step = self._epoch_start + int(batch) + 1
        engine = self._engine
        if self._step // self.every_n_steps > self._last_saved // self.every_n_steps:
            self._snapshot()
        elif (engine.tracker is not None and engine.writes
              and self._step // self.delta_every_n_steps > self._last_delta // self.delta_every_n_steps):
            if engine.base is None:
                self._snapshot()  # the first delta point has nothing to be a delta of: a full snapshot
            else:
                self._delta()

    def on_train_end(self, logs=None):
        if self._step > self._last_saved:
            self._snapshot()
        self._engine.finish_pending()
        _fit_hooks.clear_initial_counters(self.model)

    # -- the writes (the engine's) --------------------------------------------

    def _position(self) -> dict:
        return {"epoch": self._epoch, "step_in_epoch": self._step - self._epoch_start,
                "steps_per_epoch": (self.params or {}).get("steps")}

    def _delta(self) -> None:
        step = self._step
        seconds, rows = self._engine.delta(step, self._position())
        self._last_delta = step
        self.delta_seconds.append(seconds)
        self.delta_rows.append(rows)

    def _snapshot(self) -> None:
        step = self._step
        seconds = self._engine.snapshot(step, self._position())
        self._last_saved = self._last_delta = step
        self.snapshot_seconds.append(seconds)
        self._seconds.append(seconds)
