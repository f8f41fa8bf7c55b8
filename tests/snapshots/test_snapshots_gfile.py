"""Snapshots on a tf.io.gfile filesystem without atomic renames (ram://): the manifest commits."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx import snapshots

pytestmark = pytest.mark.unit


def _ram_dir() -> str:
    return f"ram://tf_psx_tests/{uuid.uuid4().hex}"


def _write(prefix: str) -> None:
    with tf.io.gfile.GFile(prefix + ".index", "w") as handle:
        handle.write("index")


def _manifest(step: int) -> dict:
    return {"epoch": 0, "step_in_epoch": step, "steps_per_epoch": None, "seconds": 0.0}


class _Crash(RuntimeError):
    pass


def test_manifest_last_commit_prune_and_an_interrupted_write():
    directory = _ram_dir()
    store = snapshots.SnapshotStore(directory, max_to_keep=2)
    assert isinstance(store.fs, snapshots.GFileFS)
    for step in (10, 20, 30):
        path = store.commit(step, _write, _manifest(step))
        store.prune(step)
    assert path == f"{directory}/snapshot-000000000030"
    assert [s.step for s in store.snapshots()] == [20, 30]
    # Pruned snapshots are gone entirely, not only their manifest.
    assert sorted(tf.io.gfile.listdir(directory)) == ["snapshot-000000000020", "snapshot-000000000030"]

    def crash(path):
        raise _Crash(path)

    crashing = snapshots.SnapshotStore(directory, max_to_keep=2, before_commit=crash)
    with pytest.raises(_Crash):
        crashing.commit(40, _write, _manifest(40))
    # The checkpoint of step 40 is there, its manifest is not: never listed, named as incomplete.
    assert tf.io.gfile.exists(f"{directory}/snapshot-000000000040/ckpt.index")
    assert store.latest().step == 30
    assert store.incomplete() == [f"{directory}/snapshot-000000000040"]
    # A later write of the same step replaces the leftover.
    store.commit(40, _write, _manifest(40))
    assert store.latest().step == 40 and store.incomplete() == []


def test_a_manifest_without_its_checkpoint_is_not_a_snapshot():
    directory = _ram_dir()
    store = snapshots.SnapshotStore(directory, max_to_keep=3)
    store.commit(5, _write, _manifest(5))
    tf.io.gfile.remove(f"{directory}/snapshot-000000000005/ckpt.index")
    assert store.snapshots() == [] and store.incomplete() == [f"{directory}/snapshot-000000000005"]


def _model():
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile("sgd", "mse")
    return model


def test_periodic_sync_resumes_from_ram_and_skips_an_incomplete_snapshot(caplog):
    directory = _ram_dir()
    x, y = np.ones((40, 2)), np.ones(40)
    first = _model()
    first.fit(x, y, batch_size=4, epochs=1, verbose=0,
              callbacks=[tf_psx.callbacks.PeriodicSync(every_n_steps=4, directory=directory)])
    assert [s.step for s in tf_psx.callbacks.PeriodicSync.snapshots(directory)] == [4, 8, 10]
    # A write of step 12 that stopped before its manifest.
    tf.io.gfile.makedirs(f"{directory}/snapshot-000000000012")
    resumed = _model()
    sync = tf_psx.callbacks.PeriodicSync(4, directory)
    with caplog.at_level("WARNING", logger="tf_psx"):
        resumed.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[sync])
    assert sync.restored.step == 10
    assert "snapshot-000000000012: it has no manifest" in caplog.text
    np.testing.assert_allclose(resumed.get_weights()[0], first.get_weights()[0])


@pytest.mark.cluster
@pytest.mark.parametrize("background", [False, True])
def test_periodic_sync_on_ram_under_the_cluster_writes_through_the_coordinator(ps_strategy, background):
    directory = _ram_dir()
    x, y = np.ones((32, 2), np.float32), np.ones(32, np.float32)

    def dataset(_ctx=None):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()

    with ps_strategy.scope():
        model = _model()
    sync = tf_psx.callbacks.PeriodicSync(every_n_steps=3, directory=directory, background=background)
    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset), epochs=1, steps_per_epoch=6, verbose=0,
              callbacks=[sync])
    options = sync._engine.options  # pylint: disable=protected-access  (tf_psx's own class)
    assert options.experimental_io_device == "/job:chief/replica:0/task:0/device:CPU:0"
    assert options.experimental_enable_async_checkpoint == background
    assert [s.step for s in tf_psx.callbacks.PeriodicSync.snapshots(directory)] == [3, 6]
    with ps_strategy.scope():
        again = _model()
    sync = tf_psx.callbacks.PeriodicSync(3, directory)
    again.fit(tf.keras.utils.experimental.DatasetCreator(dataset), epochs=2, steps_per_epoch=6, verbose=0,
              callbacks=[sync])
    assert sync.restored.step == 6


def test_background_snapshot_holds_the_values_at_its_step(tmp_path):
    # The values are copied at the barrier: a change made right after the
    # callback returns is not in the snapshot, which is complete after fit.
    x, y = np.ones((16, 2)), np.ones(16)
    model = _model()

    class ZeroAfterSnapshot(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:  # right after the snapshot of step 2
                self.saved = [w.copy() for w in self.model.get_weights()]
                self.model.set_weights([np.full_like(w, 7.0) for w in self.model.get_weights()])

    zero = ZeroAfterSnapshot()
    sync = tf_psx.callbacks.PeriodicSync(every_n_steps=2, directory=tmp_path, background=True)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[sync, zero])
    assert [s.step for s in tf_psx.callbacks.PeriodicSync.snapshots(tmp_path)] == [2, 4]
    reader = tf.train.load_checkpoint(tf_psx.callbacks.PeriodicSync.snapshots(tmp_path)[0].checkpoint)
    kernel = reader.get_tensor("model/layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE")
    np.testing.assert_allclose(kernel, zero.saved[0])
    with pytest.raises(ValueError, match=r"`background` of PeriodicSync must be True or False\. Received: 'yes'"):
        tf_psx.callbacks.PeriodicSync(2, tmp_path, background="yes")
