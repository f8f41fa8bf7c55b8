"""tf_psx.callbacks: StalenessBound, PeriodicSync, ClusterMonitor.

Tiers: argument checks and snapshot listing need no servers; the 1-worker
tests share the session cluster; resume after a crash and the 3-worker
staleness run use fresh processes (tests/scripts/callbacks_*.py).
"""

from __future__ import annotations

import glob
import json
import logging
import os

import re

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx import callbacks as cb
from tf_psx.callbacks import probe
from tf_psx.snapshots import engine

from conftest import run_script, tfra_param

pytestmark = pytest.mark.unit

FIELDS, ROWS, DIM, BATCH = 4, 1000, 8, 16
# Every batch holds exactly DISTINCT ids of the static embedding (see _data),
# so a step touches DISTINCT / ROWS of its rows.
DISTINCT = 8


# --- arguments (no servers) -------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: cb.StalenessBound(-1), r"`max_staleness` of StalenessBound must be an int >= 0\. Received: -1"),
    (lambda: cb.StalenessBound(1.5), r"`max_staleness`.*Received: 1\.5"),
    (lambda: cb.StalenessBound(True), r"`max_staleness`.*Received: True"),
    (lambda: cb.StalenessBound(1, policy="skip"), r"`policy` of StalenessBound must be one of 'drop', 'scale'\. Received: 'skip'"),
    (lambda: cb.PeriodicSync(0, "/tmp/x"), r"`every_n_steps` of PeriodicSync must be an int >= 1\. Received: 0"),
    (lambda: cb.PeriodicSync("10", "/tmp/x"), r"`every_n_steps`.*Received: '10'"),
    (lambda: cb.PeriodicSync(10, ""), r"`directory` of PeriodicSync must be a non-empty directory path"),
    (lambda: cb.PeriodicSync(10, None), r"`directory`.*Received: None"),
    (lambda: cb.PeriodicSync(10, "/tmp/x", max_to_keep=0), r"`max_to_keep` of PeriodicSync must be an int >= 1\. Received: 0"),
    (lambda: cb.ClusterMonitor(""), r"`log_dir` of ClusterMonitor"),
    (lambda: cb.ClusterMonitor("/tmp/x", every_n_steps=0), r"`every_n_steps` of ClusterMonitor.*Received: 0"),
    (lambda: cb.ClusterMonitor("/tmp/x", cluster="ps0"), r"`cluster` of ClusterMonitor must be None or a tf_psx.LocalCluster"),
])
def test_bad_arguments_name_the_field_and_the_fix(make, match):
    with pytest.raises(ValueError, match=match) as error:
        make()
    assert "Fix:" in str(error.value)


def test_public_signatures():
    import inspect

    assert str(inspect.signature(cb.PeriodicSync)) == (
        "(every_n_steps: 'int', directory, max_to_keep: 'int' = 3, background: 'bool' = False, "
        "delta_every_n_steps: 'int | None' = None, delta_rows_by: \"Literal['auto', 'fingerprint']\" = 'auto')")
    assert str(inspect.signature(cb.StalenessBound)) == "(max_staleness: 'int', policy: 'Policy' = 'drop')"
    assert "callbacks" in tf_psx.__all__ and tf_psx.callbacks is cb


def _fake_snapshot(directory, step, manifest=True, index=True):
    path = os.path.join(directory, f"snapshot-{step:012d}")
    os.makedirs(path)
    if index:
        open(os.path.join(path, "ckpt.index"), "w").close()
    if manifest:
        with open(os.path.join(path, cb.MANIFEST), "w") as handle:
            json.dump({"step": step, "epoch": 0, "step_in_epoch": step, "steps_per_epoch": None}, handle)
    return path


def test_only_complete_snapshots_are_listed(tmp_path):
    _fake_snapshot(tmp_path, 10)
    _fake_snapshot(tmp_path, 30)
    _fake_snapshot(tmp_path, 40, manifest=False)  # crashed before the manifest
    _fake_snapshot(tmp_path, 50, index=False)  # checkpoint files missing
    os.makedirs(tmp_path / f"{cb.TMP_PREFIX}000000000060-abcd")  # an interrupted write
    with open(_fake_snapshot(tmp_path, 70, manifest=False) + "/" + cb.MANIFEST, "w") as handle:
        handle.write('{"step": 7')  # a torn manifest
    assert [s.step for s in cb.PeriodicSync.snapshots(tmp_path)] == [10, 30]
    assert cb.PeriodicSync.latest(tmp_path).step == 30
    assert cb.PeriodicSync.latest(tmp_path / "missing") is None


@pytest.mark.parametrize("step, steps_per_epoch, expected", [
    (60, 20, (3, 0)), (65, 20, (3, 5)), (20, None, (1, 0)), (7, None, (0, 7)),
])
def test_resume_point(step, steps_per_epoch, expected):
    # Saved with 20 steps per epoch: step 20 is the end of epoch 0.
    snapshot = cb.Snapshot("/x", step, (step - 1) // 20, (step - 1) % 20 + 1, 20, 0.0)
    assert snapshot.resume_point(steps_per_epoch) == expected


@pytest.fixture
def psx_log(caplog):
    """caplog, receiving the "tf_psx" logger (which does not propagate to the root)."""
    logger = logging.getLogger("tf_psx")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.mark.parametrize("staleness, expected", [
    # max_staleness=2: up to 2 the gradient keeps its weight; above, 1 / (1 + s).
    (0, 1.0), (2, 1.0), (3, 0.25), (9, 0.1),
])
def test_scale_factor_only_scales_above_the_bound(staleness, expected):
    factor = probe._scale_factor(tf.constant(staleness, tf.int64), 2)
    assert factor.dtype == tf.float64
    assert float(factor) == pytest.approx(expected)


# --- PeriodicSync under the default strategy (no servers) ---------------------

SMALL_BATCH = 2


def _small(names=("first",), inputs=2):
    model = tf.keras.Sequential([tf.keras.Input((inputs,))] + [tf.keras.layers.Dense(1, name=n) for n in names])
    model.compile(tf.keras.optimizers.Adam(0.1), "mse")
    return model


class _Batches(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def _fit_small(model, sync, steps):
    """Fits `steps` steps (one epoch); returns the batch indices that ran."""
    batches = _Batches()
    inputs = model.input_shape[-1]
    model.fit(np.ones((steps * SMALL_BATCH, inputs)), np.ones(steps * SMALL_BATCH), batch_size=SMALL_BATCH,
              epochs=1, verbose=0, callbacks=[sync, batches])
    return batches.ends


def _steps(directory):
    return [s.step for s in cb.PeriodicSync.snapshots(directory)]


def _foreign_snapshot(directory, step):
    """A complete, readable snapshot of something else: one variable named `net`."""
    path = _fake_snapshot(directory, step, index=False)
    tf.train.Checkpoint(net=tf.Variable([1.0])).write(os.path.join(path, cb.CHECKPOINT_NAME))
    return path


@pytest.mark.parametrize("case, make, match", [
    # The snapshot (of Dense "first", Adam) holds first's kernel and bias, iterations and their 4 slots;
    # "second" and its 4 slots are not in it: 7 of 13.
    ("one-layer-more", lambda: _small(("first", "second")),
     r"holds 7 of the 13 variables and tables of this model and its optimizer; "
     r"not in it: second/kernel, second/bias, Adam/m/second/kernel"),
    ("another-shape", lambda: _small(("first",), inputs=3),
     r"holds a value of another shape or dtype \(Received incompatible tensor with shape \(2, 1\)"),
    ("nothing-matches", lambda: _small(("first",)),
     r"holds 0 of the 7 variables and tables of this model and its optimizer; not in it: first/kernel, first/bias"),
], ids=["one-layer-more", "another-shape", "nothing-matches"])
def test_a_snapshot_of_another_model_is_an_error_and_not_a_partial_restore(case, make, match, tmp_path):
    directory = tmp_path / "snap"
    if case == "nothing-matches":
        newest = _foreign_snapshot(directory, 4)
    else:
        _fit_small(_small(("first",)), cb.PeriodicSync(2, directory), steps=4)
        newest = cb.PeriodicSync.latest(directory).path
    before = sorted(os.listdir(directory))

    model = make()
    batches = _Batches()
    expected = rf"PeriodicSync cannot resume from {re.escape(newest)} \(step 4\): it {match}"
    with pytest.raises(ValueError, match=expected) as error:
        model.fit(np.ones((8, model.input_shape[-1])), np.ones(8), batch_size=SMALL_BATCH, verbose=0,
                  callbacks=[cb.PeriodicSync(2, directory), batches])
    assert "rather than skip 4 steps" in str(error.value)
    assert "Fix: point `directory` at this model's own snapshots" in str(error.value)
    assert batches.ends == []  # no step ran
    assert sorted(os.listdir(directory)) == before  # nothing written, nothing pruned

    if case != "nothing-matches":
        # The control: the model that wrote the snapshots resumes from them.
        again = _small(("first",))
        sync = cb.PeriodicSync(2, directory)
        assert _fit_small(again, sync, steps=6) == [4, 5]
        assert sync.restored.step == 4 and int(again.optimizer.iterations.numpy()) == 6


@pytest.mark.parametrize("damage, cause", [
    ("missing-data", r"OpError: .*ckpt\.data-00000-of-00001; No such file or directory"),
    ("flipped-byte", r"Checksum does not match"),
], ids=["missing-data", "flipped-byte"])
def test_a_snapshot_that_cannot_be_read_is_skipped_with_a_warning(damage, cause, tmp_path, psx_log):
    directory = tmp_path / "snap"
    _fit_small(_small(), cb.PeriodicSync(2, directory), steps=4)
    newest = cb.PeriodicSync.latest(directory)
    data = glob.glob(newest.checkpoint + ".data-*")[0]
    if damage == "missing-data":
        os.remove(data)
    else:
        with open(data, "r+b") as handle:
            first = handle.read(1)
            handle.seek(0)
            handle.write(bytes([first[0] ^ 0xFF]))

    model, sync = _small(), cb.PeriodicSync(2, directory)
    assert _fit_small(model, sync, steps=6) == [2, 3, 4, 5]
    assert sync.restored.step == 2
    assert f"cannot read {newest.path}" in psx_log.text
    assert re.search(cause, psx_log.text), psx_log.text
    # Step 4 was written again over the damaged one (renamed aside, then deleted).
    assert _steps(directory) == [2, 4, 6]
    assert not glob.glob(str(directory / f"{cb.TMP_PREFIX}*"))
    assert cb.PeriodicSync.latest(directory).step == 6


def test_other_restore_errors_propagate(tmp_path, monkeypatch):
    directory = tmp_path / "snap"
    _fit_small(_small(), cb.PeriodicSync(2, directory), steps=2)

    def read(self, save_path, options=None):  # what a ps task that is down gives
        raise tf.errors.UnavailableError(None, None, "ps task 0 is down")

    monkeypatch.setattr(tf.train.Checkpoint, "read", read)
    with pytest.raises(tf.errors.UnavailableError, match="ps task 0 is down"):
        _fit_small(_small(), cb.PeriodicSync(2, directory), steps=4)
    assert _steps(directory) == [2]  # not treated as unreadable: nothing was trained over it


def test_pruning_keeps_the_snapshot_just_written_and_never_deletes_newer_ones(tmp_path, psx_log):
    directory = tmp_path / "snap"
    directory.mkdir()
    # An earlier run's snapshots at higher steps, which cannot be read (empty checkpoint index).
    for step in (100, 200):
        _fake_snapshot(directory, step)
    sync = cb.PeriodicSync(2, directory, max_to_keep=1)
    assert _fit_small(_small(), sync, steps=6) == [0, 1, 2, 3, 4, 5]
    assert sync.restored is None  # both could not be read: training started at step 0
    # max_to_keep=1 counts the snapshots up to the one just written: 2 and 4 were pruned, 6 kept,
    # 100 and 200 left alone.
    assert _steps(directory) == [6, 100, 200]
    assert sorted(os.listdir(directory)) == [f"snapshot-{step:012d}" for step in (6, 100, 200)]
    warning = ("holds snapshots newer than the one just written (step 2): "
               "snapshot-000000000100, snapshot-000000000200")
    assert psx_log.text.count(warning) == 1  # named once, not at every snapshot
    assert "Fix: delete them if they are stale" in psx_log.text


# --- the session cluster (1 worker, 2 ps) ------------------------------------


def _data(steps):
    # Batch b uses ids {8b .. 8b+7} mod ROWS (each twice per row of 4 fields
    # across the batch), so every batch touches exactly DISTINCT rows.
    rows = np.arange(steps * BATCH * FIELDS) // (BATCH * FIELDS // DISTINCT) % DISTINCT
    base = (np.arange(steps * BATCH * FIELDS) // (BATCH * FIELDS)) * DISTINCT
    ids = ((base + rows) % ROWS).reshape(steps * BATCH, FIELDS).astype(np.int64)
    keys = ids + 10**12
    labels = (ids[:, 0] % 3 == 0).astype(np.float32)
    return ids, keys, labels


def _model(strategy):
    with strategy.scope():
        ids = tf.keras.Input((FIELDS,), dtype=tf.int64, name="ids")
        keys = tf.keras.Input((FIELDS,), dtype=tf.int64, name="keys")
        static = tf.keras.layers.Embedding(ROWS, DIM, name="static")(ids)
        dynamic = tf_psx.layers.DynamicEmbedding(DIM, name="dyn")(keys)
        hidden = tf.keras.layers.Concatenate()([tf.keras.layers.Flatten()(static), tf.keras.layers.Flatten()(dynamic)])
        model = tf.keras.Model([ids, keys], tf.keras.layers.Dense(1, activation="sigmoid")(hidden))
        model.compile(tf.keras.optimizers.Adam(0.01), "binary_crossentropy", steps_per_execution=2)
    return model


def _creator(steps):
    ids, keys, labels = _data(steps)

    def dataset_fn(_ctx):
        return tf.data.Dataset.from_tensor_slices(({"ids": ids, "keys": keys}, labels)).batch(BATCH).repeat()

    return tf.keras.utils.experimental.DatasetCreator(dataset_fn)


def _events(log_dir):
    values: dict[str, list[float]] = {}
    for path in glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                number = value.simple_value if value.HasField("simple_value") else float(tf.make_ndarray(value.tensor))
                values.setdefault(value.tag, []).append(number)
    return values


@pytest.mark.cluster
@pytest.mark.tfra
def test_one_worker_has_no_staleness_and_the_monitor_writes_every_tag(ps_strategy, tmp_path):
    epochs, steps = 2, 6
    model = _model(ps_strategy)
    bound = cb.StalenessBound(0, "drop")
    sync = cb.PeriodicSync(4, tmp_path / "snap")
    monitor = cb.ClusterMonitor(tmp_path / "logs", every_n_steps=2)
    history = model.fit(_creator(epochs * steps), epochs=epochs, steps_per_epoch=steps,
                        callbacks=[bound, sync, monitor], verbose=0)

    # One worker: steps run one after another, nothing is stale, all apply.
    assert history.history["staleness_max"] == [0, 0]
    assert history.history["staleness_mean"] == [0.0, 0.0]
    assert history.history["dropped_gradients"] == [0, 0]
    assert "steps_rerun" not in history.history  # no worker failed
    assert bound.histogram[0] == epochs * steps and bound.histogram[1:].sum() == 0
    assert int(model.optimizer.iterations.numpy()) == epochs * steps
    # steps_per_execution=2, snapshots every 4 steps: at 4, 8 and 12 (the end).
    assert [s.step for s in cb.PeriodicSync.snapshots(tmp_path / "snap")] == [4, 8, 12]
    assert len(sync.snapshot_seconds) == 3 and min(sync.snapshot_seconds) > 0
    # Each snapshot's seconds split into barrier, waiting for a previous write, and the write; nothing else.
    assert [split["step"] for split in sync.snapshot_splits] == [4, 8, 12]
    for seconds, split in zip(sync.snapshot_seconds, sync.snapshot_splits):
        parts = split["barrier"] + split["previous_write"] + split["write"]
        assert split["previous_write"] < 0.05  # synchronous: nothing in flight
        assert abs(parts - seconds) < 0.05 and min(split["barrier"], split["write"]) > 0

    events = _events(tmp_path / "logs")
    expected = {"throughput/examples_per_sec", "throughput/step_time_ms", "sparsity/static", "sparsity/dyn",
                "staleness/mean", "staleness/max", "staleness/dropped", "sync/snapshot_seconds",
                "cluster/closure_retries", "ps/0/variable_bytes", "ps/1/variable_bytes",
                "ps/0/table_bytes", "ps/1/table_bytes"}
    assert expected <= set(events), sorted(expected - set(events))
    assert all(v > 0 for v in events["throughput/examples_per_sec"])
    assert all(v > 0 for v in events["throughput/step_time_ms"])
    # Every batch touches DISTINCT of the ROWS static rows.
    np.testing.assert_allclose(events["sparsity/static"], DISTINCT / ROWS, rtol=1e-6)
    # The dynamic table holds the keys seen so far; a batch touches DISTINCT of them.
    assert all(0 < v <= 1 for v in events["sparsity/dyn"])
    assert events["staleness/max"] == [0.0] * len(events["staleness/max"])
    assert events["cluster/closure_retries"][-1] == 0
    assert max(events["sync/snapshot_seconds"]) > 0
    # The static table (ROWS x DIM float32) and its Adam m and v are on the ps
    # tasks, in 2 shards: at least 3 * ROWS * DIM * 4 bytes over both.
    dense = events["ps/0/variable_bytes"][-1] + events["ps/1/variable_bytes"][-1]
    assert 3 * ROWS * DIM * 4 <= dense < 3 * ROWS * DIM * 4 + 200_000
    # The dynamic table: keys seen * (8 key bytes + DIM * 4), times 3 (Adam m, v).
    keys_seen = model.get_layer("dyn").size()
    tables = events["ps/0/table_bytes"][-1] + events["ps/1/table_bytes"][-1]
    assert tables == 3 * keys_seen * (8 + DIM * 4)
    assert events["ps/0/table_bytes"][-1] > 0 and events["ps/1/table_bytes"][-1] > 0


class _Bumping(tf.keras.Model):
    """A model whose step adds `bump` to StalenessBound's version counter after it read the
    parameters and before its apply: the step's staleness is `bump`, as if `bump` updates of
    other workers had landed meanwhile."""

    bump = 0

    def train_step(self, data):
        x, y = data
        version = probe._PROBES[self].version
        with tf.control_dependencies([version.assign_add(self.bump)]):
            x = tf.identity(x)  # the gradients, so the apply's read of the version, come after
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {"loss": loss}


@pytest.mark.cluster
@pytest.mark.parametrize("bump, factor", [(2, 1.0), (3, 0.25)])
def test_scale_policy_scales_only_gradients_staler_than_the_bound(ps_strategy, bump, factor):
    with ps_strategy.scope():
        x = tf.keras.Input((1,))
        model = _Bumping(x, tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(x))
        model.compile(tf.keras.optimizers.SGD(1.0))
    model.bump = bump

    def dataset_fn(_ctx):
        return tf.data.Dataset.from_tensors((tf.ones([4, 1]), tf.ones([4, 1]))).repeat()

    history = model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=1,
                        callbacks=[cb.StalenessBound(2, "scale")], verbose=0)
    assert history.history["staleness_max"] == [bump]
    assert history.history["dropped_gradients"] == [0]
    # w = 0, x = y = 1: loss = (w - 1)^2, gradient 2 (w - 1) = -2; SGD(1.0) sets
    # w = 0 - factor * -2 = 2 * factor (factor 1 up to the bound 2, 1 / (1 + 3) at 3).
    kernel = sum(float(np.sum(v.numpy())) for v in model.trainable_variables)
    assert kernel == pytest.approx(2.0 * factor)


class _Crash(Exception):
    pass


@pytest.mark.cluster
@pytest.mark.tfra
def test_crash_during_a_snapshot_restores_the_newest_complete_one(ps_strategy, tmp_path, monkeypatch):
    directory = tmp_path / "snap"
    steps = 8
    model = _model(ps_strategy)
    saved = {}

    class Remember(tf.keras.callbacks.Callback):
        def __init__(self, sync):
            super().__init__()
            self._supports_tf_logs = True
            self.sync = sync

        def on_train_batch_end(self, batch, logs=None):
            # Runs after PeriodicSync (later in the list): right after a
            # snapshot nothing is in flight, so these are the saved weights.
            saved.setdefault(self.sync._last_saved, [w.copy() for w in model.get_weights()[:2]])

    def crash_at_step_6(path):
        if "000000000006" in path:
            raise _Crash(path)

    monkeypatch.setattr(engine, "_hook_before_commit", crash_at_step_6)
    sync = cb.PeriodicSync(2, directory)
    with pytest.raises(_Crash):
        model.fit(_creator(steps), epochs=1, steps_per_epoch=steps, callbacks=[sync, Remember(sync)], verbose=0)
    monkeypatch.undo()
    assert [s.step for s in cb.PeriodicSync.snapshots(directory)] == [2, 4]
    assert glob.glob(str(directory / f"{cb.TMP_PREFIX}000000000006-*"))  # the torn write is there...
    _fake_snapshot(directory, 8, manifest=False)  # ...and a final-named one without manifest

    resumed = _model(ps_strategy)
    restored = {}

    class Capture(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._supports_tf_logs = True
            self.batch_ends = []

        def on_train_begin(self, logs=None):
            restored["weights"] = [w.copy() for w in resumed.get_weights()[:2]]

        def on_train_batch_end(self, batch, logs=None):
            self.batch_ends.append(batch)

    capture = Capture()
    again = cb.PeriodicSync(2, directory)
    resumed.fit(_creator(steps), epochs=1, steps_per_epoch=steps, callbacks=[again, capture], verbose=0)
    assert again.restored.step == 4
    for got, want in zip(restored["weights"], saved[4]):
        np.testing.assert_array_equal(got, want)
    # Steps 5..8 ran (steps_per_execution=2: batch ends 5 and 7, 0-based).
    assert capture.batch_ends == [5, 7]
    assert int(resumed.optimizer.iterations.numpy()) == steps
    assert not glob.glob(str(directory / f"{cb.TMP_PREFIX}*"))
    assert [s.step for s in cb.PeriodicSync.snapshots(directory)] == [4, 6, 8]


# --- fresh processes -----------------------------------------------------------


def _report(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = [l for l in result.stdout.splitlines() if l.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT "):])


@pytest.mark.processes
@pytest.mark.parametrize("store", [tfra_param("tfra"), pytest.param("native", marks=pytest.mark.smoke)])
def test_interrupted_run_resumes_at_the_last_snapshot_and_matches_an_uninterrupted_one(tmp_path, store):
    full = _report(run_script("callbacks_resume.py", "full", str(tmp_path / "unused"), str(tmp_path / "full.npz"),
                              store))
    crashed = run_script("callbacks_resume.py", "interrupt", str(tmp_path / "snap"), str(tmp_path / "x.npz"), store)
    assert crashed.returncode == 3 and "killed at step 70" in crashed.stdout, crashed.stderr[-3000:]
    resumed = _report(run_script("callbacks_resume.py", "resume", str(tmp_path / "snap"), str(tmp_path / "res.npz"),
                                 store))

    assert resumed["restored_step"] == 60
    # steps_per_execution=5: the first execution after the resume ends at step 65.
    assert resumed["first_batch_end"] == 65 and resumed["executions"] == 8
    assert full["iterations"] == resumed["iterations"] == 100
    assert resumed["snapshots"] == [60, 80, 100]
    want, got = np.load(tmp_path / "full.npz"), np.load(tmp_path / "res.npz")
    assert sorted(want.files) == sorted(got.files) and "table" in want.files and "slot1" in want.files
    for name in want.files:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, err_msg=name)


@pytest.mark.processes
def test_three_workers_one_slow_gives_stale_gradients_and_drop_counts_them(tmp_path):
    report = _report(run_script("callbacks_stale.py", str(tmp_path)))
    drop, scale = report["drop"], report["scale"]
    # Stale gradients appear, and drop skips exactly those above the bound (1).
    assert drop["stale_above_bound"] > 0, drop
    assert sum(drop["dropped"]) == drop["stale_above_bound"]
    assert drop["applied"] == drop["steps"] - sum(drop["dropped"])
    assert drop["histogram_total"] == drop["steps"]  # every step was measured once
    assert max(drop["staleness_max"]) >= 2
    # scale drops nothing.
    assert sum(scale["dropped"]) == 0 and scale["applied"] == scale["steps"]
    assert max(scale["staleness_max"]) >= 1
    assert scale["monitor"]["ps/0/rss_bytes"] > 50e6  # a TF process holds at least 50 MB
    for run in (drop, scale):
        _assert_staleness_mean_agrees_with_the_histogram(run)
    # The monitor's mean covers the steps since its previous write: within the epoch's range.
    assert 0 <= scale["monitor"]["staleness/mean"] <= max(scale["staleness_max"])


def _assert_staleness_mean_agrees_with_the_histogram(run: dict) -> None:
    """The epochs' `staleness_mean` is the mean of the staleness histogram of their steps.

    Each of the 2 epochs measures its STEPS steps (`histogram_total` is 2 *
    STEPS), so the mean of the two epoch means is sum(s * count[s]) / total.
    The report holds count[s] for s < 12 only; the steps at 12 or more (`rest`)
    add between 12 and the largest staleness seen each.
    """
    counts = run["histogram"]
    seen = len(counts)
    total, rest = run["histogram_total"], run["histogram_total"] - sum(counts)
    below = sum(staleness * count for staleness, count in enumerate(counts))
    low, high = (below + seen * rest) / total, (below + max(max(run["staleness_max"]), seen) * rest) / total
    mean = sum(run["staleness_mean"]) / len(run["staleness_mean"])
    assert len(run["staleness_mean"]) == 2 and total == run["steps"]
    assert low - 1e-6 <= mean <= high + 1e-6, (mean, low, high, run)
    # Stale gradients were seen (staleness_max >= 1 above), so the mean is not 0.
    assert mean > 0
