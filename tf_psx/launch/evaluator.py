"""The side-car evaluator of `tf-psx launch --evaluator`: `run_sidecar_evaluator`.

The training command, run as `evaluator:0` (`task_type() == "evaluator"`),
builds the model and its holdout data and calls `run_sidecar_evaluator`,
which runs tf-keras' `SidecarEvaluator` on each new `PeriodicSync` snapshot
until the launcher writes `TRAINING_DONE` and the newest snapshot is
evaluated. Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time

from tf_psx._tf import keras as _tf_keras
from tf_psx.errors import LaunchError
from tf_psx.launch.contract import SNAPSHOT_DIR_ENV, TRAINING_DONE_FILE, snapshot_dir

__all__ = ["run_sidecar_evaluator"]

# How often the evaluator looks for a new snapshot and for TRAINING_DONE:
# it bounds how late a snapshot is evaluated, at the cost of a directory listing.
EVALUATOR_POLL_S = 1.0
# How long a named snapshot may wait for SidecarEvaluator to start on it
# before the next one is named: restoring a big model takes seconds, a
# snapshot pruned before it was read is never evaluated.
EVALUATOR_UNCONSUMED_S = 60.0


def run_sidecar_evaluator(model, data, steps: int | None = None, directory: str | None = None, callbacks=None) -> int:
    """Evaluates every new PeriodicSync snapshot with tf-keras' `SidecarEvaluator` until training is done.

    Call it in the evaluator branch of a training command (see the module
    docstring): build and compile the model as the chief does, but with no
    strategy, then call this. It returns once the launcher has written
    TRAINING_DONE and the newest snapshot has been evaluated.

    `SidecarEvaluator` follows a directory's `checkpoint` state file, which
    PeriodicSync does not write (each snapshot is a `snapshot-<step>/`
    directory, committed by a rename). A thread of this function therefore
    keeps a private directory whose state file names the newest complete
    snapshot, and `SidecarEvaluator` follows that.

    Args:
      model: a compiled tf-keras model with the chief's architecture.
      data: the holdout data for `model.evaluate` (a `tf.data.Dataset`).
      steps: evaluation steps per snapshot; None evaluates all of `data`.
      directory: the PeriodicSync directory; `$TF_PSX_SNAPSHOT_DIR` when None.
      callbacks: extra callbacks for `model.evaluate`.

    Returns:
      The number of distinct snapshots evaluated.

    Raises:
      LaunchError: if no snapshot directory is given or set.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tf_psx.snapshots import SnapshotStore  # pylint: disable=import-outside-toplevel

    keras = _tf_keras.keras()
    directory = directory or snapshot_dir()
    if not directory:
        raise LaunchError(
            f"run_sidecar_evaluator needs the snapshot directory; received directory=None and "
            f"${SNAPSHOT_DIR_ENV} is unset. Fix: run it under `tf-psx launch --evaluator`, or pass "
            "directory=<the PeriodicSync directory>."
        )
    done = os.path.join(directory, TRAINING_DONE_FILE)
    view = tempfile.mkdtemp(prefix="tf_psx_evaluator_")
    evaluated: list[str] = []
    stop = threading.Event()
    # "consumed": SidecarEvaluator has begun evaluating the named snapshot.
    # The name only moves on after that, so that each evaluation is recorded
    # under the snapshot it really restored.
    state = {"named": None, "woken": False, "consumed": True, "since": 0.0}

    def _name(path: str) -> None:
        # The `checkpoint` file is a CheckpointState text proto; written to a
        # temporary name and renamed, so that a reader never sees half of it.
        text = f'model_checkpoint_path: {json.dumps(path)}\nall_model_checkpoint_paths: {json.dumps(path)}\n'
        tmp = os.path.join(view, "checkpoint.tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
        state.update(named=path, consumed=False, since=time.monotonic())
        os.replace(tmp, os.path.join(view, "checkpoint"))

    def _follow() -> None:
        while not stop.wait(EVALUATOR_POLL_S):
            latest = SnapshotStore(directory, max_to_keep=1).latest()
            # A named snapshot that fails to restore (pruned meanwhile) is
            # never consumed; after a while the name moves on anyway.
            waiting = not state["consumed"] and time.monotonic() - state["since"] < EVALUATOR_UNCONSUMED_S
            if latest is None or waiting:
                continue
            if state["named"] is None or os.path.normpath(state["named"]) != latest.checkpoint:
                _name(latest.checkpoint)
            elif os.path.exists(done) and evaluated and evaluated[-1] == latest.checkpoint and not state["woken"]:
                # Training is over and the newest snapshot is evaluated, but
                # SidecarEvaluator waits for a new one: name the same snapshot
                # by another path ("dir/./ckpt") to wake it; the callback ends it.
                state["woken"] = True
                _name(os.path.join(os.path.dirname(latest.checkpoint), ".", os.path.basename(latest.checkpoint)))

    class _StopWhenDone(keras.callbacks.Callback):
        def on_test_begin(self, logs=None):
            evaluated.append(os.path.normpath(state["named"] or ""))
            state["consumed"] = True

        def on_test_end(self, logs=None):
            print(f"tf_psx evaluator: evaluated {evaluated[-1]}: {logs}", flush=True)
            latest = SnapshotStore(directory, max_to_keep=1).latest()
            if os.path.exists(done) and (latest is None or evaluated[-1] == latest.checkpoint):
                raise _TrainingDone()

    evaluator = keras.utils.SidecarEvaluator(
        model, data, checkpoint_dir=view, steps=steps, callbacks=[*(callbacks or []), _StopWhenDone()]
    )
    follower = threading.Thread(target=_follow, name="tf-psx-evaluator-follow", daemon=True)
    follower.start()
    try:
        evaluator.start()
    except _TrainingDone:
        pass
    finally:
        stop.set()
        follower.join()
        shutil.rmtree(view, ignore_errors=True)
    return len(set(evaluated))


class _TrainingDone(Exception):
    """Raised from a callback to end SidecarEvaluator's loop."""
