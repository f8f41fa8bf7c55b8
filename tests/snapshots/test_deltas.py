"""Delta snapshots (PeriodicSync(delta_every_n_steps=...)): what changed since the full snapshot, exactly."""

from __future__ import annotations

import json
import logging
import os
import uuid

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx.snapshots import deltas
from tf_psx.callbacks import PeriodicSync

from conftest import run_script

pytestmark = pytest.mark.unit

ROWS, DIM = 2048, 2


def _report(result) -> dict:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = [l for l in result.stdout.splitlines() if l.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT "):])


def test_a_row_fingerprint_catches_the_smallest_change_of_one_element():
    table = tf.Variable(np.random.default_rng(0).normal(size=(ROWS, 3)).astype(np.float32))
    bias = tf.Variable([0.5, 0.25])
    tracker = deltas.DeltaTracker({"table": table, "bias": bias}, tf.distribute.get_strategy())
    assert sorted(tracker.tracked) == ["table"] and sorted(tracker.whole) == ["bias"]
    assert tracker.fingerprint_bytes == 8 * ROWS
    tracker.rebase()
    rows, values = tracker.changed()["table"]
    assert rows.size == 0 and values.shape == (0, 3)

    before = table.numpy()
    # One ulp in one element of row 5; a sign flip of 0.0 -> -0.0 is a change of bits too.
    changed = before.copy()
    changed[5, 1] = np.nextafter(changed[5, 1], np.float32(np.inf))
    changed[1999, 2] = -changed[1999, 2]
    changed[2047] = changed[2047][::-1]  # the same values in another order
    table.assign(changed)
    found = tracker.changed()
    rows, values = found["table"]
    assert rows.tolist() == [5, 1999, 2047]
    np.testing.assert_array_equal(values, changed[[5, 1999, 2047]])
    assert found["bias"][0] is None and found["bias"][1].tolist() == [0.5, 0.25]
    tracker.rebase()
    assert tracker.changed()["table"][0].size == 0


def _linear_model(optimizer="adagrad"):
    """Loss linear in the looked-up rows: each touched row gets a constant gradient."""
    ids = tf.keras.Input((4,), dtype=tf.int64)
    rows = tf.keras.layers.Embedding(ROWS, DIM, embeddings_initializer="zeros", name="table")(ids)
    output = tf.keras.layers.Lambda(lambda x: tf.reduce_sum(x, axis=[1, 2]))(rows)
    model = tf.keras.Model(ids, output)
    model.compile(optimizer, lambda y, p: tf.reduce_mean(p) + 0.0 * tf.reduce_mean(y))
    return model


# Steps 1-10 touch rows 0..7, steps 11 on touch rows 100..111 (4 per example, 3 examples).
def _batches(steps: int, start: int = 0) -> tf.data.Dataset:
    first = np.tile(np.arange(8).reshape(2, 4), (1, 1))
    later = np.arange(100, 112).reshape(3, 4)
    xs = [first if k < 10 else later for k in range(start, steps)]
    return tf.data.Dataset.from_generator(lambda: ((x, np.zeros(len(x), np.float32)) for x in xs),
                                          output_signature=(tf.TensorSpec([None, 4], tf.int64),
                                                            tf.TensorSpec([None], tf.float32)))


class _Record(tf.keras.callbacks.Callback):
    def __init__(self, at: int):
        super().__init__()
        self.at, self.state = at, None

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.at:
            self.state = [v.numpy() for v in self.model.weights + self.model.optimizer.variables]


def _run_dir(kind: str, tmp_path) -> str:
    return str(tmp_path / "snaps") if kind == "local" else f"ram://tf_psx_tests/{uuid.uuid4().hex}"


@pytest.mark.parametrize("kind", ["local", "ram"])
def test_a_resume_applies_the_newest_delta_and_a_torn_one_falls_back(kind, tmp_path, caplog):
    directory = _run_dir(kind, tmp_path)
    model, record = _linear_model(), _Record(at=12)
    sync = PeriodicSync(every_n_steps=10, directory=directory, delta_every_n_steps=4)
    model.fit(_batches(14), epochs=1, steps_per_epoch=14, callbacks=[sync, record], verbose=0)
    # Full snapshots at 4 (the first delta point, with nothing to build on), 10
    # and 14 (the end of fit); deltas at 8 (on step 4) and 12 (on step 10).
    assert [s.step for s in PeriodicSync.snapshots(directory)] == [4, 10, 14]
    # Adagrad moves only the rows of the batches since the full snapshot, in
    # the table and the accumulator: rows 0..7, then rows 100..111.
    assert sync.delta_rows == [2 * 8, 2 * 12] and len(sync.delta_seconds) == 2
    fs = tf.io.gfile
    base = PeriodicSync.snapshots(directory)[1].path
    assert sorted(name for name in fs.listdir(PeriodicSync.snapshots(directory)[0].path)
                  if name.startswith("delta-")) == ["delta-000000000008.json", "delta-000000000008.npz"]
    assert sorted(name for name in fs.listdir(base) if name.startswith("delta-")) == [
        "delta-000000000012.json", "delta-000000000012.npz"]
    # A crash before the full snapshot of step 14 would have left this:
    fs.rmtree(PeriodicSync.snapshots(directory)[-1].path)

    resumed = _linear_model()
    sync = PeriodicSync(every_n_steps=10, directory=directory, delta_every_n_steps=4)
    seen = _Record(at=0)
    seen.on_train_begin = lambda logs=None: setattr(seen, "state", [
        v.numpy() for v in resumed.weights + resumed.optimizer.variables])
    resumed.fit(_batches(14, start=12), epochs=1, steps_per_epoch=14, callbacks=[sync, seen], verbose=0)
    assert sync.restored.step == 12 and sync.restored.delta_of == 10 and sync.restored.path == base
    # What a script reads to skip the batches already trained: the delta's step.
    fs.rmtree(PeriodicSync.snapshots(directory)[-1].path)  # the full snapshot of step 14 again
    latest = PeriodicSync.latest(directory)
    assert (latest.step, latest.delta_of, latest.path) == (12, 10, base)
    assert len(seen.state) == len(record.state)
    for got, want in zip(seen.state, record.state):
        np.testing.assert_array_equal(got, want)

    # A delta written before its full snapshot (a leftover of an earlier run) is never applied.
    caplog.set_level(logging.WARNING, logger="tf_psx")
    manifest_path = f"{base}/delta-000000000012.json"
    manifest = fs.GFile(manifest_path, "rb").read()
    fs.remove(manifest_path)
    with fs.GFile(manifest_path, "wb") as handle:
        handle.write(json.dumps({**json.loads(manifest), "time": 0.0}).encode())
    assert PeriodicSync.latest(directory).step == 10
    assert "written before its full snapshot" in caplog.text
    fs.remove(manifest_path)
    with fs.GFile(manifest_path, "wb") as handle:
        handle.write(manifest)
    assert PeriodicSync.latest(directory).step == 12

    # A torn delta (the rows file cut short) is skipped: the full snapshot is restored.
    npz = f"{base}/delta-000000000012.npz"
    data = fs.GFile(npz, "rb").read()
    fs.remove(npz)  # ram:// appends to a file opened for writing again
    with fs.GFile(npz, "wb") as handle:
        handle.write(data[: len(data) // 2])
    again = _linear_model()
    sync = PeriodicSync(every_n_steps=10, directory=directory, delta_every_n_steps=4)
    again.fit(_batches(14, start=10), epochs=1, steps_per_epoch=14, callbacks=[sync], verbose=0)
    assert sync.restored.step == 10 and sync.restored.delta_of is None
    assert "cannot read the delta of step 12" in caplog.text


@pytest.mark.tfra
def test_delta_arguments_and_hash_tables_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"`delta_every_n_steps` of PeriodicSync must be below `every_n_steps` \(10\)"
                                         r".*Received: 10"):
        PeriodicSync(10, str(tmp_path), delta_every_n_steps=10)
    with pytest.raises(ValueError, match="delta_every_n_steps"):
        PeriodicSync(10, str(tmp_path), delta_every_n_steps=0)
    with pytest.raises(ValueError, match="delta_every_n_steps"):
        PeriodicSync(10, str(tmp_path), delta_every_n_steps=2.5)

    with pytest.raises(ValueError, match=r"`delta_rows_by` of PeriodicSync must be 'auto' or 'fingerprint'. "
                                         r"Received: 'marks'"):
        PeriodicSync(10, str(tmp_path), delta_every_n_steps=2, delta_rows_by="marks")

    keys = tf.keras.Input((2,), dtype=tf.int64)
    rows = tf_psx.layers.DynamicEmbedding(2, name="hashed")(keys)
    model = tf.keras.Model(keys, tf.keras.layers.Lambda(lambda x: tf.reduce_sum(x, axis=[1, 2]))(rows))
    model.compile("sgd", "mse")
    data = tf.data.Dataset.from_tensor_slices((np.ones((4, 2), np.int64), np.ones(4, np.float32))).batch(2)
    with pytest.raises(ValueError, match=r"cannot write delta snapshots of model .*DynamicEmbedding layers \(hashed\)"
                                         r".*Fix: pass delta_every_n_steps=None"):
        model.fit(data, epochs=1, verbose=0,
                  callbacks=[PeriodicSync(4, str(tmp_path / "de"), delta_every_n_steps=2)])
    assert not os.path.exists(tmp_path / "de" / "snapshot-000000000004")


@pytest.mark.processes
def test_a_crash_after_a_delta_resumes_from_it_and_matches_an_uninterrupted_run(tmp_path):
    full = _report(run_script("delta_resume.py", "full", str(tmp_path / "unused"), str(tmp_path / "full.npz")))
    crashed = run_script("delta_resume.py", "interrupt", str(tmp_path / "snap"), str(tmp_path / "at35.npz"))
    assert crashed.returncode == 3 and "killed at step 38" in crashed.stdout, crashed.stderr[-3000:]
    # A full snapshot at 5 (the first delta point), deltas at 10 and 15, a full
    # snapshot at 20, deltas at 25, 30 and 35. Non-lazy Adam moves every row
    # ever touched (its moments decay), so each delta on step 20 holds more rows.
    written = json.loads(crashed.stdout.split("DELTAS ")[1].splitlines()[0])
    assert len(written) == 5 and written[2] < written[3] < written[4], written
    resumed = _report(run_script("delta_resume.py", "resume", str(tmp_path / "snap"), str(tmp_path / "res.npz")))

    assert resumed["restored_step"] == 35 and resumed["restored_delta_of"] == 20
    # Non-lazy Adam writes rows beyond the gradient's: its rows are found by content.
    assert set(resumed["tracking"].values()) == {"fingerprint"} and len(resumed["tracking"]) == 3, resumed
    assert resumed["first_batch_end"] == 36
    assert full["iterations"] == resumed["iterations"] == 60
    assert resumed["snapshots"] == [20, 40, 60]
    # Adam's per-variable step counters are in every snapshot, those written after the resume too.
    assert resumed["counters_per_snapshot"] == [5, 5, 5], resumed
    want, got = np.load(tmp_path / "full.npz"), np.load(tmp_path / "res.npz")
    assert sorted(want.files) == sorted(got.files) and len(want.files) == 12
    for name in want.files:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-6, err_msg=name)


def _state(model) -> dict[str, np.ndarray]:
    """The table, its Adagrad accumulator and the step count, each whole (shards concatenated)."""
    values = {"table": tf_psx.weights.unsharded_weights(model.get_layer("table"))[0],
              "iterations": model.optimizer.iterations.numpy()}
    slots = [v for v in model.optimizer.variables if deltas.full_shape(v) == (ROWS, DIM)]
    assert len(slots) == 1, slots
    values["accumulator"] = np.concatenate([shard.numpy() for shard, _ in deltas.shards_of(slots[0])])
    return values


@pytest.mark.cluster
@pytest.mark.parametrize("rows_by", ["auto", "fingerprint"])
def test_deltas_written_on_two_shards_restore_onto_an_unsharded_model(ps_strategy, tmp_path, rows_by):
    """Delta rows count across shards: a delta restores onto another number of ps tasks, like the full snapshot.

    With Adagrad under the cluster, "auto" finds the rows from the marks its
    updates set; "fingerprint" by content: the same rows either way.
    """
    first = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]])
    later = np.arange(100, 112).reshape(3, 4)

    def dataset_fn(_ctx):
        return tf.data.Dataset.range(14).map(
            lambda k: (tf.where(k < 10, tf.constant(first, tf.int64), tf.constant(later, tf.int64)), tf.zeros([3])))

    with ps_strategy.scope():
        model = _linear_model()
    assert len(deltas.shards_of(model.get_layer("table").embeddings)) == 2
    data = tf.keras.utils.experimental.DatasetCreator(dataset_fn)
    # A fit first, without deltas: its traced step sets no marks, and must be made again.
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    directory = str(tmp_path / "snaps")
    sync = PeriodicSync(every_n_steps=10, directory=directory, delta_every_n_steps=4, delta_rows_by=rows_by)

    class Record(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._supports_tf_logs = True
            self.state = None

        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 == 12:  # PeriodicSync's delta of step 12 has just joined: nothing in flight
                self.state = _state(self.model)

    record = Record()
    model.fit(data, epochs=1, steps_per_epoch=14, callbacks=[sync, record], verbose=0)
    how = "marks" if rows_by == "auto" else "fingerprint"
    assert sorted(sync.delta_tracking.items()) == [("model/layer-1/embeddings", how),
                                                   ("optimizer/_accumulators/0", how)], sync.delta_tracking
    # Rows 100..111 in both shards' terms: 12 table rows and 12 accumulator rows since step 10.
    assert sync.delta_rows == [2 * 8, 2 * 12]
    tf.io.gfile.rmtree(PeriodicSync.snapshots(directory)[-1].path)  # as if the job died before step 14's snapshot

    local = _linear_model()  # no strategy: one shard
    sync = PeriodicSync(every_n_steps=10, directory=directory, delta_every_n_steps=4)
    seen = {}

    class Seen(tf.keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.update(_state(self.model))

    local.fit(_batches(14, start=12), epochs=1, steps_per_epoch=14, callbacks=[sync, Seen()], verbose=0)
    assert sync.restored.step == 12 and sync.restored.delta_of == 10
    assert sorted(seen) == sorted(record.state)
    for name, want in record.state.items():
        np.testing.assert_array_equal(seen[name], want, err_msg=name)
    # Rows 100..111 moved; rows 0..7 kept the full snapshot's values; the rest are still zero.
    assert np.all(seen["table"][100:112] != 0) and np.all(seen["table"][8:100] == 0)


def test_which_optimizers_update_only_the_gradient_rows():
    touched = tf_psx.optimizers.updates_touched_rows_only
    assert touched(tf_psx.optimizers.LazyAdam()) and touched(tf_psx.optimizers.SGD(momentum=0.9))
    assert touched(tf.keras.optimizers.Adagrad())
    # Dense decay, a moving average over every row, moments decayed in full, a momentum slot decayed in full.
    assert not touched(tf.keras.optimizers.Adagrad(weight_decay=0.01))
    assert not touched(tf_psx.optimizers.LazyAdam(use_ema=True))
    assert not touched(tf.keras.optimizers.Adam()) and not touched(tf.keras.optimizers.SGD())


class _OwnStep(tf.keras.Model):
    def train_step(self, data):  # a train_step of its own: it could write the table any way it likes
        return super().train_step(data)


@pytest.mark.cluster
def test_marks_are_not_used_where_something_else_writes_the_rows(ps_strategy, tmp_path):
    """A Keras constraint rewrites the whole variable after the update; a train_step of one's own may write anything."""
    def dataset_fn(_ctx):
        return tf.data.Dataset.range(6).map(lambda k: (tf.reshape(tf.range(4, dtype=tf.int64) + k, [1, 4]),
                                                      tf.zeros([1])))

    def build(constraint=None, model_class=tf.keras.Model):
        ids = tf.keras.Input((4,), dtype=tf.int64)
        rows = tf.keras.layers.Embedding(ROWS, DIM, embeddings_initializer="zeros", name="table",
                                         embeddings_constraint=constraint)(ids)
        model = model_class(ids, tf.keras.layers.Lambda(lambda x: tf.reduce_sum(x, axis=[1, 2]))(rows))
        model.compile("adagrad", lambda y, p: tf.reduce_mean(p) + 0.0 * tf.reduce_mean(y))
        return model

    for name, kwargs in [("constraint", {"constraint": tf.keras.constraints.MaxNorm(1.0)}),
                         ("own train_step", {"model_class": _OwnStep})]:
        with ps_strategy.scope():
            model = build(**kwargs)
        sync = PeriodicSync(every_n_steps=4, directory=str(tmp_path / name), delta_every_n_steps=2)
        model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=6,
                  callbacks=[sync], verbose=0)
        assert set(sync.delta_tracking.values()) == {"fingerprint"}, (name, sync.delta_tracking)
        assert len(sync.delta_rows) == 1 and sync.delta_rows[0] > 0, (name, sync.delta_rows)


def test_a_delta_file_left_aside_by_a_crash_is_removed_by_the_next_delta(tmp_path):
    from tf_psx.snapshots import deltas  # pylint: disable=import-outside-toplevel

    leftover = tmp_path / "delta-000000000005.npz.tmp-0badc0de"
    leftover.write_bytes(b"half a delta")
    unrelated = tmp_path / "notes.tmp-0badc0de"  # not a delta's: kept
    unrelated.write_bytes(b"x")
    deltas.write_delta(str(tmp_path), 8, 4, {"table": (np.array([1, 3]), np.ones((2, 4), np.float32))}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "delta-000000000008.json", "delta-000000000008.npz", "notes.tmp-0badc0de"]
