"""The snapshot store behind `tf_psx.callbacks.PeriodicSync`: format, atomic commit, listing, pruning.

A snapshot is a directory `<directory>/snapshot-<step, 12 digits>/` holding
a checkpoint (`ckpt.*`, written by the caller) and a manifest
(`snapshot.json`: the step, the epoch, the step in that epoch, fit's steps
per epoch, the seconds it took). It is written as
`.tmp-snapshot-<step>-<id>/`, the manifest last (flushed and fsynced), and
then renamed into place: a reader sees a whole snapshot or none. A
directory without a readable manifest, or whose checkpoint index is missing,
is not a snapshot. This module needs no TensorFlow and no Keras; the caller
passes the function that writes the checkpoint.

Example:

>>> import os, tempfile
>>> store = SnapshotStore(tempfile.mkdtemp(), max_to_keep=2)
>>> def write(prefix):
...     open(prefix + ".index", "w").close()
>>> for step in (10, 20, 30):
...     _ = store.commit(step, write, {"epoch": 0, "step_in_epoch": step, "steps_per_epoch": None, "seconds": 0.1})
...     _ = store.prune(step)
>>> [s.step for s in store.snapshots()], store.latest().resume_point(None)
([20, 30], (0, 30))
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable

__all__ = ["Snapshot", "SnapshotStore", "SNAPSHOT_PREFIX", "TMP_PREFIX", "MANIFEST", "CHECKPOINT_NAME"]

logger = logging.getLogger("tf_psx")

# Directory names: snapshot-<step> sorts by step as text too (12 digits:
# a trillion steps).
SNAPSHOT_PREFIX = "snapshot-"
STEP_DIGITS = 12
SNAPSHOT_RE = re.compile(rf"^{SNAPSHOT_PREFIX}(\d{{{STEP_DIGITS}}})$")
# Where a snapshot is written, or an old one moved before it is deleted:
# never listed as a snapshot, removed at the next start.
TMP_PREFIX = ".tmp-snapshot-"
# The manifest is written last: its presence marks a complete snapshot.
MANIFEST = "snapshot.json"
# The checkpoint prefix inside a snapshot directory.
CHECKPOINT_NAME = "ckpt"


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A complete snapshot.

    Attributes:
      path: the snapshot directory.
      step: the global step it was taken after (steps done since step 0).
      epoch: the epoch that step belongs to (0-based).
      step_in_epoch: steps of `epoch` done at that point.
      steps_per_epoch: fit's steps per epoch then (None if unknown).
      seconds: how long the barrier and the write took.
    """

    path: str
    step: int
    epoch: int
    step_in_epoch: int
    steps_per_epoch: int | None
    seconds: float

    @property
    def checkpoint(self) -> str:
        """The checkpoint prefix inside the snapshot."""
        return os.path.join(self.path, CHECKPOINT_NAME)

    def resume_point(self, steps_per_epoch: int | None) -> tuple[int, int]:
        """(epoch, step in epoch) at which fit continues after this snapshot."""
        if steps_per_epoch:
            return divmod(self.step, steps_per_epoch)
        if self.steps_per_epoch and self.step_in_epoch >= self.steps_per_epoch:
            return self.epoch + 1, 0
        return self.epoch, self.step_in_epoch


def read_manifest(path: str) -> Snapshot | None:
    """The snapshot at `path`, or None when it is not a complete snapshot."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as handle:
            data = json.load(handle)
        snapshot = Snapshot(path=path, step=int(data["step"]), epoch=int(data["epoch"]),
                            step_in_epoch=int(data["step_in_epoch"]),
                            steps_per_epoch=data.get("steps_per_epoch"), seconds=float(data.get("seconds", 0.0)))
    except (FileNotFoundError, NotADirectoryError):
        return None  # no manifest: the write was interrupted (or the name is not a snapshot)
    except (ValueError, KeyError, TypeError):
        return None  # a torn or foreign manifest (json.JSONDecodeError is a ValueError)
    if not os.path.exists(snapshot.checkpoint + ".index"):
        return None
    return snapshot


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type when it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def remove(path: str, why: str) -> None:
    """Deletes a directory tree; a failure is logged with its cause, not raised."""
    try:
        shutil.rmtree(path)
    except OSError as error:
        logger.warning("PeriodicSync: could not delete %s (%s): %s. It is never restored; delete it by hand.",
                       path, why, first_line(error))


class SnapshotStore:
    """The snapshots of one directory.

    Args:
      directory: where the snapshots live (created on the first commit).
      max_to_keep: how many snapshots up to the newest written one to keep.
      before_commit: called with the temporary directory once it is fully
        written and before it is renamed (a seam for crash tests).
    """

    def __init__(self, directory, max_to_keep: int, before_commit: Callable[[str], None] | None = None):
        self.directory = os.fspath(directory)
        self.max_to_keep = max_to_keep
        self._before_commit = before_commit
        self._warned_newer: set[str] = set()

    def snapshots(self) -> list[Snapshot]:
        """The complete snapshots, oldest first."""
        if not os.path.isdir(self.directory):
            return []
        found = []
        for name in os.listdir(self.directory):
            if SNAPSHOT_RE.match(name):
                snapshot = read_manifest(os.path.join(self.directory, name))
                if snapshot is not None:
                    found.append(snapshot)
        return sorted(found, key=lambda s: s.step)

    def latest(self) -> Snapshot | None:
        """The newest complete snapshot, or None."""
        found = self.snapshots()
        return found[-1] if found else None

    def clean_temporaries(self) -> None:
        """Creates the directory; removes what an interrupted write or prune left."""
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):
            if name.startswith(TMP_PREFIX):
                remove(os.path.join(self.directory, name), "left by an interrupted write")

    def commit(self, step: int, write: Callable[[str], None], manifest: dict) -> str:
        """Writes the snapshot of `step` beside, then renames it into place.

        Args:
          step: the global step.
          write: called with the checkpoint prefix inside the temporary directory.
          manifest: epoch, step_in_epoch, steps_per_epoch and seconds (step and
            time are added).

        Returns:
          The snapshot's directory.
        """
        tmp = self._tmp_path(step)
        os.makedirs(tmp)
        write(os.path.join(tmp, CHECKPOINT_NAME))
        record = {"step": step, **manifest, "time": time.time()}
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as handle:
            json.dump(record, handle)
            handle.flush()
            os.fsync(handle.fileno())
        if self._before_commit is not None:
            self._before_commit(tmp)
        final = os.path.join(self.directory, f"{SNAPSHOT_PREFIX}{step:0{STEP_DIGITS}d}")
        if os.path.exists(final):
            # A leftover of an earlier run at this step (without manifest, or one
            # that could not be read): moved aside in one rename, deleted once
            # the new one is in place, so the name never holds a partial snapshot.
            aside = self._tmp_path(step)
            os.rename(final, aside)
            os.rename(tmp, final)
            remove(aside, "replaced by a new snapshot of the same step")
        else:
            os.rename(tmp, final)
        return final

    def prune(self, written: int) -> list[Snapshot]:
        """Keeps the newest `max_to_keep` snapshots up to step `written` (the one just written).

        Snapshots newer than `written` are never deleted; each is named once
        in a warning.

        Returns:
          The snapshots newer than `written`.
        """
        found = self.snapshots()
        newer = [s for s in found if s.step > written]
        upto = [s for s in found if s.step <= written]  # the one just written is the last
        for snapshot in upto[:-self.max_to_keep]:
            # Renamed first (one atomic step: it is no longer listed), then deleted;
            # a crash in between leaves a temporary directory, removed at the next start.
            aside = self._tmp_path(snapshot.step)
            try:
                os.rename(snapshot.path, aside)
            except OSError as error:  # training goes on; the snapshot stays, complete
                logger.warning("PeriodicSync: could not prune %s: %s", snapshot.path, first_line(error))
                continue
            remove(aside, f"pruned snapshot of step {snapshot.step}")
        unwarned = [s for s in newer if s.path not in self._warned_newer]
        if unwarned:
            self._warned_newer.update(s.path for s in unwarned)
            logger.warning(
                "PeriodicSync: %s holds snapshots newer than the one just written (step %d): %s. They were left by "
                "an earlier run or could not be read; they are kept (never pruned, not counted in max_to_keep=%d), "
                "and a later fit in this directory tries them first. Fix: delete them if they are stale, and use "
                "one directory per training run.",
                self.directory, written, ", ".join(os.path.basename(s.path) for s in unwarned), self.max_to_keep)
        return newer

    def _tmp_path(self, step: int) -> str:
        return os.path.join(self.directory, f"{TMP_PREFIX}{step:0{STEP_DIGITS}d}-{uuid.uuid4().hex[:8]}")
