"""TF's checkpoint internals: which objects a `tf.train.Checkpoint.read` matched, and a trackable saved whole (TF 2.16.2-2.21)."""

from __future__ import annotations

from tensorflow import __internal__ as _internal

_tracking = _internal.tracking


def restored_ids(status) -> set[int]:
    """ids of the Python objects that a `tf.train.Checkpoint.read` matched.

    TF 2.16 keeps them in `status._checkpoint.object_by_proto_id` (a
    WeakValueDictionary: node of the saved object graph -> the object it was
    restored into). `status.assert_existing_objects_matched()` reads the same
    map but cannot be used as it is: it also fails on TFRA's lookup buffers,
    which no snapshot restores, and names at most ten objects, by their full
    values.
    """
    return {id(obj) for obj in status._checkpoint.object_by_proto_id.values()}  # pylint: disable=protected-access


class SavedWhole(_tracking.Trackable):
    """A trackable whose checkpoint value is what `tensors_to_save()` returns, restored by `restore_tensors`.

    TF 2.16-2.21's checkpoint protocol (`Trackable._serialize_to_tensors`,
    `_restore_from_tensors`): a subclass saves named tensors under its own
    object path, in whatever layout it chooses (tf_psx.tables.native saves a
    hash table's keys and values whole, whatever its shard count).
    """

    def tensors_to_save(self) -> dict:  # pragma: no cover - overridden
        raise NotImplementedError

    def restore_tensors(self, tensors: dict):  # pragma: no cover - overridden
        raise NotImplementedError

    def _serialize_to_tensors(self):
        return self.tensors_to_save()

    def _restore_from_tensors(self, restored_tensors):
        return self.restore_tensors(dict(restored_tensors))
