"""Which objects a `tf.train.Checkpoint.read` matched (TF 2.16.2)."""

from __future__ import annotations


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
