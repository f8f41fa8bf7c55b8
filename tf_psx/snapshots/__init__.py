"""Snapshots of a training run: the files, the deltas between them, and the engine that writes and restores them.

`tf_psx.snapshots` (this package) is light: importing it imports no
TensorFlow. The names it has always had (`Snapshot`, `SnapshotStore`, the
file names and the filesystems) are the store's; the other modules, which
need TensorFlow, are imported by name:

* `store`: the snapshot format, atomic commit, listing, pruning, the newest;
* `deltas`: delta snapshots (row fingerprints or marks, the changed rows beside a full snapshot);
* `restore`: finding and restoring the newest readable snapshot (and its delta) into a model;
* `engine`: `SnapshotEngine`, the writes (full, delta, in the background) that
  `tf_psx.callbacks.PeriodicSync` drives from fit's hooks.
"""

from tf_psx.snapshots.store import (  # noqa: F401  (the names `tf_psx.snapshots.X` has always had)
    CHECKPOINT_NAME,
    MANIFEST,
    SNAPSHOT_PREFIX,
    SNAPSHOT_RE,
    STEP_DIGITS,
    TMP_PREFIX,
    GFileFS,
    LocalFS,
    Snapshot,
    SnapshotStore,
    filesystem,
    first_line,
    is_local,
    read_manifest,
    remove,
)

__all__ = ["Snapshot", "SnapshotStore", "LocalFS", "GFileFS", "filesystem", "is_local", "SNAPSHOT_PREFIX", "TMP_PREFIX",
           "MANIFEST", "CHECKPOINT_NAME"]
