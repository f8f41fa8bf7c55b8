"""The snapshot store: format, atomic commit, listing, pruning, the newest (no TensorFlow to import).

It is what `tf_psx.snapshots.engine` (behind `tf_psx.callbacks.PeriodicSync`)
writes through, and what a reader that only lists snapshots uses.

A snapshot is a directory `<directory>/snapshot-<step, 12 digits>/` holding
a checkpoint (`ckpt.*`, written by the caller) and a manifest
(`snapshot.json`: the step, the epoch, the step in that epoch, fit's steps
per epoch, the seconds it took). A directory without a readable manifest, or
whose checkpoint index is missing, is not a snapshot.

On a local (POSIX) path it is written as `.tmp-snapshot-<step>-<id>/`, the
manifest last (flushed and fsynced), and then renamed into place: a reader
sees a whole snapshot or none. On any other `tf.io.gfile` filesystem
(`gs://`, `s3://`, `hdfs://`, `ram://`: object stores have no atomic rename)
it is written in place, the manifest last, so the manifest is what commits
it; pruning deletes the manifest first. `incomplete()` names the snapshot
directories without one. This module needs no TensorFlow for local paths
(tf.io.gfile is imported for the others) and no Keras; the caller passes
the function that writes the checkpoint.

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

__all__ = ["Snapshot", "SnapshotStore", "LocalFS", "GFileFS", "filesystem", "is_local", "SNAPSHOT_PREFIX", "TMP_PREFIX",
           "MANIFEST", "CHECKPOINT_NAME"]

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
      delta_of: for a resume point made of a full snapshot and a delta
        snapshot (`tf_psx.snapshots.deltas`), the full snapshot's step (`path` is
        its directory, `step` the delta's); None for a full snapshot.
    """

    path: str
    step: int
    epoch: int
    step_in_epoch: int
    steps_per_epoch: int | None
    seconds: float
    delta_of: int | None = None

    @property
    def checkpoint(self) -> str:
        """The checkpoint prefix inside the snapshot."""
        return filesystem(self.path).join(self.path, CHECKPOINT_NAME)

    def resume_point(self, steps_per_epoch: int | None) -> tuple[int, int]:
        """(epoch, step in epoch) at which fit continues after this snapshot."""
        if steps_per_epoch:
            return divmod(self.step, steps_per_epoch)
        if self.steps_per_epoch and self.step_in_epoch >= self.steps_per_epoch:
            return self.epoch + 1, 0
        return self.epoch, self.step_in_epoch


def is_local(path: str) -> bool:
    """True for a path of this machine's filesystem (no `scheme://`)."""
    return "://" not in os.fspath(path)


class _Text:
    """Text files as UTF-8 over a filesystem's `read_bytes` / `write_bytes`."""

    def read_text(self, path: str) -> str:
        return self.read_bytes(path).decode("utf-8")

    def write_text(self, path: str, text: str) -> None:
        self.write_bytes(path, text.encode("utf-8"))


class LocalFS(_Text):
    """This machine's filesystem: atomic renames, fsync."""

    atomic_rename = True
    join = staticmethod(os.path.join)
    exists = staticmethod(os.path.exists)
    isdir = staticmethod(os.path.isdir)
    listdir = staticmethod(os.listdir)
    rename = staticmethod(os.rename)

    @staticmethod
    def makedirs(path: str) -> None:
        os.makedirs(path, exist_ok=True)

    @staticmethod
    def read_bytes(path: str) -> bytes:
        with open(path, "rb") as handle:
            return handle.read()

    @staticmethod
    def write_bytes(path: str, data: bytes) -> None:
        with open(path, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    @staticmethod
    def remove_file(path: str) -> None:
        os.remove(path)

    @staticmethod
    def rmtree(path: str) -> None:
        shutil.rmtree(path)


class GFileFS(_Text):
    """Any `tf.io.gfile` filesystem (gs://, s3://, hdfs://, ram://): no atomic rename is assumed."""

    atomic_rename = False

    @staticmethod
    def _gfile():
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        return tf.io.gfile

    @staticmethod
    def join(*parts: str) -> str:
        return "/".join([parts[0].rstrip("/")] + [part.strip("/") for part in parts[1:]])

    def exists(self, path: str) -> bool:
        return self._gfile().exists(path)

    def isdir(self, path: str) -> bool:
        return self._gfile().isdir(path)

    def listdir(self, path: str) -> list[str]:
        return [name.rstrip("/") for name in self._gfile().listdir(path)]

    def makedirs(self, path: str) -> None:
        self._gfile().makedirs(path)

    def read_bytes(self, path: str) -> bytes:
        with self._gfile().GFile(path, "rb") as handle:
            return handle.read()

    def write_bytes(self, path: str, data: bytes) -> None:
        with self._gfile().GFile(path, "wb") as handle:
            handle.write(data)

    def remove_file(self, path: str) -> None:
        self._gfile().remove(path)

    def rmtree(self, path: str) -> None:
        self._gfile().rmtree(path)


def filesystem(path: str):
    """`LocalFS` for a local path, else `GFileFS`."""
    return LocalFS() if is_local(path) else GFileFS()


def read_manifest(path: str, fs=None) -> Snapshot | None:
    """The snapshot at `path`, or None when it is not a complete snapshot."""
    fs = fs or filesystem(path)
    try:
        data = json.loads(fs.read_text(fs.join(path, MANIFEST)))
        snapshot = Snapshot(path=path, step=int(data["step"]), epoch=int(data["epoch"]),
                            step_in_epoch=int(data["step_in_epoch"]),
                            steps_per_epoch=data.get("steps_per_epoch"), seconds=float(data.get("seconds", 0.0)))
    except (FileNotFoundError, NotADirectoryError):
        return None  # no manifest: the write was interrupted (or the name is not a snapshot)
    except (ValueError, KeyError, TypeError):
        return None  # a torn or foreign manifest (json.JSONDecodeError is a ValueError)
    except Exception as error:  # pylint: disable=broad-except  (tf.errors.NotFoundError and kin, from gfile)
        if type(error).__name__ in ("NotFoundError", "FailedPreconditionError", "PermissionDeniedError"):
            return None
        raise
    if not fs.exists(fs.join(path, CHECKPOINT_NAME) + ".index"):
        return None
    return snapshot


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type when it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def remove(path: str, why: str, fs=None) -> None:
    """Deletes a directory tree; a failure is logged with its cause, not raised."""
    try:
        (fs or filesystem(path)).rmtree(path)
    except Exception as error:  # pylint: disable=broad-except  (OSError, or tf.errors.OpError from gfile)
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
        self.fs = filesystem(self.directory)
        self.max_to_keep = max_to_keep
        self._before_commit = before_commit
        self._warned_newer: set[str] = set()

    def _snapshot_dirs(self) -> list[str]:
        if not self.fs.isdir(self.directory):
            return []
        return sorted(self.fs.join(self.directory, name) for name in self.fs.listdir(self.directory)
                      if SNAPSHOT_RE.match(name))

    def snapshots(self) -> list[Snapshot]:
        """The complete snapshots, oldest first."""
        found = []
        for path in self._snapshot_dirs():
            snapshot = read_manifest(path, self.fs)
            if snapshot is not None:
                found.append(snapshot)
        return sorted(found, key=lambda s: s.step)

    def incomplete(self) -> list[str]:
        """Snapshot directories without a readable manifest or checkpoint index (never restored)."""
        return [path for path in self._snapshot_dirs() if read_manifest(path, self.fs) is None]

    def latest(self) -> Snapshot | None:
        """The newest complete snapshot, or None."""
        found = self.snapshots()
        return found[-1] if found else None

    def clean_temporaries(self) -> None:
        """Creates the directory; removes what an interrupted write or prune left."""
        self.fs.makedirs(self.directory)
        for name in self.fs.listdir(self.directory):
            if name.startswith(TMP_PREFIX):
                remove(self.fs.join(self.directory, name), "left by an interrupted write", self.fs)

    def commit(self, step: int, write: Callable[[str], None], manifest: dict,
               wait: Callable[[], None] | None = None) -> str:
        """Writes the snapshot of `step` beside, then renames it into place.

        Args:
          step: the global step.
          write: called with the checkpoint prefix inside the temporary directory.
          manifest: epoch, step_in_epoch, steps_per_epoch and seconds (step and
            time are added).
          wait: called after `write` and before the manifest: returns once the
            checkpoint's files are complete (for a write that runs in the background).

        Returns:
          The snapshot's directory.
        """
        wait = wait or (lambda: None)
        final = self.path_of(step)
        record = json.dumps({"step": step, **manifest, "time": time.time()})
        if not self.fs.atomic_rename:
            # No atomic rename (object stores): written in place, the manifest
            # last; until it exists the directory is not a snapshot.
            if self.fs.exists(final):
                remove(final, "replaced by a new snapshot of the same step", self.fs)
            self.fs.makedirs(final)
            write(self.fs.join(final, CHECKPOINT_NAME))
            wait()
            if self._before_commit is not None:
                self._before_commit(final)
            self.fs.write_text(self.fs.join(final, MANIFEST), record)
            return final
        tmp = self._tmp_path(step)
        self.fs.makedirs(tmp)
        write(os.path.join(tmp, CHECKPOINT_NAME))
        wait()
        self.fs.write_text(os.path.join(tmp, MANIFEST), record)
        if self._before_commit is not None:
            self._before_commit(tmp)
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
            if not self.fs.atomic_rename:
                # The manifest goes first: from then on it is not a snapshot.
                try:
                    self.fs.remove_file(self.fs.join(snapshot.path, MANIFEST))
                except Exception as error:  # pylint: disable=broad-except  (tf.errors.OpError from gfile)
                    logger.warning("PeriodicSync: could not prune %s: %s", snapshot.path, first_line(error))
                    continue
                remove(snapshot.path, f"pruned snapshot of step {snapshot.step}", self.fs)
                continue
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

    def path_of(self, step: int) -> str:
        """The directory of the snapshot of `step` (once committed)."""
        return self.fs.join(self.directory, f"{SNAPSHOT_PREFIX}{step:0{STEP_DIGITS}d}")

    def _tmp_path(self, step: int) -> str:
        return os.path.join(self.directory, f"{TMP_PREFIX}{step:0{STEP_DIGITS}d}-{uuid.uuid4().hex[:8]}")
