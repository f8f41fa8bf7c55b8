"""model.fit of arrays or of a finite dataset with no steps_per_epoch, and evaluate of arrays, under ParameterServerStrategy.

TF alone: fit(x_array, y_array) fails with tf-keras's "When using a
DatasetCreator, steps_per_epoch ... must be provided", and fit(finite
dataset) fails once a worker's copy runs out (CancelledError, End of
sequence). The counting model: one row per example id, loss = the row,
weighted by the label's class weight, SGD at lr = batch size, so every read
of an example moves its row by exactly -weight (tests/scripts/fit_parts.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf

import tf_psx

from scripts import fit_parts

pytestmark = pytest.mark.cluster

ROWS = 72  # 9 batches of 8
BATCH = fit_parts.BATCH
EPOCHS = 2
CLASS_WEIGHT = fit_parts.CLASS_WEIGHT


def _ids_labels(rows: int = ROWS):
    ids = np.arange(rows, dtype=np.int64)
    return ids, fit_parts.labels_of(ids)


def _weights(labels):
    return np.vectorize(CLASS_WEIGHT.get)(labels)


def _table(model):
    return tf_psx.unsharded_weights(model)[0][:, 0]


def test_fit_of_arrays_without_steps_reads_each_example_once_per_epoch(ps_strategy):
    ids, labels = _ids_labels()
    remote = fit_parts.build(ps_strategy, ROWS)
    history = remote.fit(ids, labels, batch_size=BATCH, epochs=EPOCHS, class_weight=CLASS_WEIGHT, verbose=0)
    assert len(history.history["loss"]) == EPOCHS
    assert int(remote.optimizer.iterations.numpy()) == EPOCHS * math.ceil(ROWS / BATCH)
    # One worker reads its part (everything) once per epoch: row = -EPOCHS * class weight, exactly.
    np.testing.assert_array_equal(_table(remote), -EPOCHS * _weights(labels))
    # The same fit without a strategy ends at the same table (the loss is linear: order does not matter).
    local = fit_parts.build(tf.distribute.get_strategy(), ROWS)
    local.fit(ids, labels, batch_size=BATCH, epochs=EPOCHS, class_weight=CLASS_WEIGHT, verbose=0)
    np.testing.assert_array_equal(_table(remote), local.get_weights()[0][:, 0])


def test_fit_of_a_finite_dataset_without_steps_runs_one_pass_per_epoch(ps_strategy):
    ids, labels = _ids_labels(ROWS + 3)  # a short last batch: ids 72-74
    dataset = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH)
    remote = fit_parts.build(ps_strategy, ROWS + 3)
    history = remote.fit(dataset, epochs=EPOCHS, verbose=0)
    assert len(history.history["loss"]) == EPOCHS
    assert int(remote.optimizer.iterations.numpy()) == EPOCHS * int(dataset.cardinality())
    # The short batch's loss is its mean too: its rows move by BATCH / 3 per read.
    want = -float(EPOCHS) * np.where(ids >= ROWS, BATCH / 3, 1.0)
    np.testing.assert_allclose(_table(remote), want, rtol=1e-6)


def test_validation_split_and_array_validation_are_evaluated_exactly(ps_strategy):
    ids, labels = _ids_labels(80)
    remote = fit_parts.build(ps_strategy, 80)
    history = remote.fit(ids, labels, batch_size=BATCH, epochs=EPOCHS, validation_split=0.5, verbose=0)
    split = 40  # 5 full batches: every row moves by 1 per read
    # Trained on the first half only (as without a strategy), each read once per epoch.
    np.testing.assert_array_equal(_table(remote), np.where(ids < split, -float(EPOCHS), 0.0))
    assert history.history["val_loss"] == [0.0, 0.0]  # the held-out rows were never trained
    history = remote.fit(ids[:split], labels[:split], batch_size=BATCH, epochs=1, verbose=0,
                         validation_data=(ids[:16], labels[:16]))
    # After three reads the first 16 rows are -3: the mean of the loss over them.
    assert history.history["val_loss"] == [pytest.approx(-3.0)]


def test_evaluate_of_arrays_without_steps_equals_one_process(ps_strategy):
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 40, size=(150, 2)).astype(np.int64)  # 9 batches of 16 and one of 6
    labels = (rng.random(150) < 0.4).astype(np.float32)
    with ps_strategy.scope():
        remote = _classifier()
    remote.set_weights([rng.normal(size=w.shape).astype(np.float32) for w in tf_psx.unsharded_weights(remote)])
    local = _classifier()
    local.set_weights(tf_psx.unsharded_weights(remote))
    got = remote.evaluate(ids, labels, batch_size=16, verbose=0, return_dict=True)
    want = local.evaluate(ids, labels, batch_size=16, verbose=0, return_dict=True)
    assert set(got) == {"loss", "auc"} and all(isinstance(v, float) for v in got.values()), got
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-5), (key, got, want)


def _classifier():
    inputs = tf.keras.Input((2,), dtype=tf.int64)
    vectors = tf_psx.layers.ShardedEmbedding(40, 4)(inputs)
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Flatten()(vectors)))
    model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy", metrics=[tf.keras.metrics.AUC(name="auc")])
    return model


def test_class_weight_is_applied_to_a_dataset_creator(ps_strategy):
    # tf-keras drops class_weight under a coordinator: both rows would move by 1 per step.
    ids = np.array([0, 1], dtype=np.int64)
    labels = np.array([1.0, 0.0], dtype=np.float32)
    creator = tf.keras.utils.experimental.DatasetCreator(
        lambda _ctx: tf.data.Dataset.from_tensor_slices((ids, labels)).batch(2).repeat())
    remote = fit_parts.build(ps_strategy, 2)
    # lr = BATCH, batch 2: a read moves a row by BATCH / 2 * weight.
    remote.fit(creator, epochs=1, steps_per_epoch=4, class_weight={0: 1.0, 1: 3.0}, verbose=0)
    np.testing.assert_array_equal(_table(remote), [-4 * 3.0 * BATCH / 2, -4 * 1.0 * BATCH / 2])


@pytest.mark.parametrize("dataset, match", [
    (tf.data.Dataset.range(4).map(lambda i: (i, tf.cast(i, tf.float32))).batch(2).repeat(),
     r"model\.fit got an infinite dataset and no `steps_per_epoch`: its first epoch would never end\. "
     r"Received: steps_per_epoch=None\. Fix: pass steps_per_epoch=N"),
    (tf.data.Dataset.range(0).map(lambda i: (i, tf.cast(i, tf.float32))).batch(2),
     r"model\.fit got an empty dataset \(0 batches\)\. Fix: pass a dataset with at least one batch"),
], ids=["infinite", "empty"])
def test_a_dataset_fit_cannot_count_is_refused_with_the_fix(ps_strategy, dataset, match):
    remote = fit_parts.build(ps_strategy, 4)
    with pytest.raises(ValueError, match=match):
        remote.fit(dataset, epochs=1, verbose=0)
    # With steps_per_epoch the infinite one trains, as TF documents.
    if int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        remote.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
        assert int(remote.optimizer.iterations.numpy()) == 2


def test_a_dataset_of_unknown_size_runs_one_pass_per_epoch(ps_strategy):
    # As without a strategy: an epoch ends where the data does (TF alone needs steps_per_epoch).
    ids = np.arange(10, dtype=np.int64)
    dataset = tf.data.Dataset.from_tensor_slices((ids, fit_parts.labels_of(ids))).filter(lambda i, _y: i < 7).batch(2)
    assert int(dataset.cardinality()) == int(tf.data.UNKNOWN_CARDINALITY)
    remote = fit_parts.build(ps_strategy, 10)
    history = remote.fit(dataset, epochs=3, verbose=0, validation_data=dataset)
    assert len(history.history["loss"]) == len(history.history["val_loss"]) == 3
    assert int(remote.optimizer.iterations.numpy()) == 3 * 4  # 4 batches (2, 2, 2, 1) per pass
    # Every read moves a row by BATCH / (its batch's size); ids 0-5 in batches of 2, id 6 alone.
    want = -3.0 * np.where(ids < 6, BATCH / 2, np.where(ids == 6, BATCH, 0.0))
    np.testing.assert_allclose(_table(remote), want, rtol=1e-6)


def test_steps_per_epoch_beyond_the_data_is_keras_s_warning_not_a_crash(ps_strategy, caplog):
    # keras-io's "follow the fix" case: steps_per_epoch larger than one pass of a finite dataset.
    ids = np.arange(8, dtype=np.int64)
    dataset = tf.data.Dataset.from_tensor_slices((ids, fit_parts.labels_of(ids))).batch(BATCH // 2)  # 2 batches
    remote = fit_parts.build(ps_strategy, 8)
    history = remote.fit(dataset, epochs=3, steps_per_epoch=3, verbose=0)
    assert "Your input ran out of data" in caplog.text
    assert int(remote.optimizer.iterations.numpy()) == 2 and len(history.history["loss"]) == 1


def test_train_test_and_predict_on_batch_equal_one_process(ps_strategy):
    # TF alone: "To use this dataset, you need to pass this dataset to ClusterCoordinator.create_per_worker_dataset".
    rng = np.random.default_rng(11)
    with ps_strategy.scope():
        remote = _classifier()  # a fresh model: no fit has made its coordinator
    local = _classifier()
    local.set_weights(tf_psx.unsharded_weights(remote))
    for step in range(3):
        ids = rng.integers(0, 40, size=(16, 2)).astype(np.int64)
        labels = (rng.random(16) < 0.5).astype(np.float32)
        got = remote.train_on_batch(ids, labels, class_weight={0: 1.0, 1: 2.0}, return_dict=True)
        want = local.train_on_batch(ids, labels, class_weight={0: 1.0, 1: 2.0}, return_dict=True)
        assert got == pytest.approx(want, abs=1e-5), (step, got, want)
    assert int(remote.optimizer.iterations.numpy()) == 3
    assert remote._cluster_coordinator is not None  # pylint: disable=protected-access  (the steps ran on a worker)
    for got_w, want_w in zip(tf_psx.unsharded_weights(remote), local.get_weights()):
        np.testing.assert_allclose(got_w, want_w, atol=1e-6)
    ids = rng.integers(0, 40, size=(16, 2)).astype(np.int64)
    labels = (rng.random(16) < 0.5).astype(np.float32)
    assert remote.test_on_batch(ids, labels) == pytest.approx(local.test_on_batch(ids, labels), abs=1e-5)
    np.testing.assert_allclose(remote.predict_on_batch(ids), local.predict_on_batch(ids), atol=1e-6)
    assert int(remote.optimizer.iterations.numpy()) == 3  # test and predict applied nothing
    # fit afterwards still runs on the workers.
    remote.fit(ids, labels, batch_size=8, epochs=1, verbose=0)
    assert int(remote.optimizer.iterations.numpy()) == 5


def test_verbose_1_shows_keras_progress_bar_under_the_strategy(ps_strategy, capsys):
    # tf-keras alone: "`verbose=1` is not allowed with `ParameterServerStrategy` for performance reasons".
    ids = np.arange(40, dtype=np.int64)
    remote = fit_parts.build(ps_strategy, 40)
    history = remote.fit(ids, fit_parts.labels_of(ids), batch_size=8, epochs=2, verbose=1,
                         validation_data=(ids[:16], fit_parts.labels_of(ids[:16])))
    out = capsys.readouterr().out
    # Keras's bar: the epoch line, then "5/5 [====...] - ... - loss: ... - val_loss: ..." at the epoch's end.
    assert "Epoch 1/2" in out and "Epoch 2/2" in out, out
    last_lines = [line for line in out.replace("\r", "\n").splitlines() if line.startswith("5/5 [")]
    assert len(last_lines) == 2 and all("loss:" in line and "val_loss:" in line for line in last_lines), out
    # The bar's numbers are the epoch's logs.
    final = float(last_lines[-1].split(" - loss: ")[1].split()[0])
    assert final == pytest.approx(history.history["loss"][-1], abs=1e-3)
    # evaluate(verbose=1) too.
    remote.evaluate(ids, fit_parts.labels_of(ids), batch_size=8, verbose=1)
    assert "5/5 [" in capsys.readouterr().out


def test_a_batch_level_callback_runs_and_sees_every_step(ps_strategy, caplog):
    # tf-keras alone: "Batch-level `Callback`s are not supported with `ParameterServerStrategy`".
    seen = []

    class Losses(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((batch, float(logs["loss"])))

    ids = np.arange(24, dtype=np.int64)
    remote = fit_parts.build(ps_strategy, 24)
    remote.fit(ids, fit_parts.labels_of(ids), batch_size=8, epochs=2, verbose=0, callbacks=[Losses()])
    assert [batch for batch, _ in seen] == [0, 1, 2, 0, 1, 2]
    assert "Batch-level callbacks ['Losses'] read every step's logs" in caplog.text


def test_fit_keeps_a_few_steps_queued_ahead_of_the_workers_not_the_epoch(ps_strategy, monkeypatch):
    # A worker slower than the coordinator's reading (a sleep in its step).
    # Without a bound, TF's queue (262,144 closures) took each step with its
    # batches as fast as the coordinator read them: measured, 345 steps
    # queued after 20 s of an epoch of arrays, and a barrier (a snapshot)
    # then waited for all of them.
    from tf_psx._tf import fed_steps, sync_training as door  # pylint: disable=import-outside-toplevel

    queue = ps_strategy.coordinator._cluster.closure_queue  # pylint: disable=protected-access
    depths = []
    real_put = queue.put

    def put(closure, tag=None):
        real_put(closure, tag=tag)
        depths.append(queue._queue.qsize())  # pylint: disable=protected-access

    monkeypatch.setattr(queue, "put", put)
    with ps_strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((1,)),
            tf.keras.layers.Lambda(lambda x: x + 0.0 * tf.cast(door.sleep(0.05), x.dtype)),
            tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.SGD(0.01), "mse")
    steps = 40
    x = np.ones((steps * 4, 1), np.float32)
    history = model.fit(x, x[:, 0], batch_size=4, epochs=1, verbose=0)
    assert len(history.history["loss"]) == 1 and int(model.optimizer.iterations.numpy()) == steps
    assert len(depths) == steps, depths
    # 1 worker: MIN_AHEAD closures at most wait in the queue when the next is put.
    assert max(depths) <= fed_steps.MIN_AHEAD, depths
    # A DatasetCreator (each worker reads its own dataset; tf-keras schedules with a per-worker iterator).
    depths.clear()
    creator = tf.keras.utils.experimental.DatasetCreator(
        lambda _: tf.data.Dataset.from_tensor_slices((x, x[:, 0])).repeat().batch(4))
    model.fit(creator, epochs=1, steps_per_epoch=steps, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2 * steps
    assert len(depths) >= steps and max(depths) <= fed_steps.MIN_AHEAD, depths


@pytest.mark.unit
def test_batches_packed_by_the_pipeline_come_back_whole():
    # fit's input pipeline packs each batch into one vector per dtype
    # (tf_psx._tf.fed_steps.Packer); the step unpacks it by its layout. A
    # short last batch has a layout of its own; an input with a ragged
    # component is sent as it is.
    from tf_psx._tf import fed_steps  # pylint: disable=import-outside-toplevel

    features = {"ids": np.arange(20, dtype=np.int64).reshape(10, 2), "dense": np.linspace(0, 1, 30, dtype=np.float32).reshape(10, 3),
                "flag": np.arange(10) % 2 == 0}
    labels = np.arange(10, dtype=np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(4)
    packer = fed_steps.Packer(dataset.element_spec)
    assert packer.usable
    received = [packer.received(element) for element in packer.apply(dataset)]
    assert [batch.layout.parts[0][2][0] for batch in received] == [4, 4, 2]  # "dense"'s rows per batch
    assert len({batch.layout for batch in received}) == 2  # two full batches share a layout
    assert [len(batch.parts) for batch in received] == [3, 3, 3]  # float32, int64, bool
    for batch, original in zip(received, dataset):
        back = batch.layout.unpack(batch.parts)
        tf.nest.assert_same_structure(back, original)
        for got, want in zip(tf.nest.flatten(back), tf.nest.flatten(original)):
            np.testing.assert_array_equal(got.numpy(), want.numpy())
    ragged = tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1], [2, 3]])).batch(2)
    assert not fed_steps.Packer(ragged.element_spec).usable
    assert fed_steps.Packer(ragged.element_spec).apply(ragged) is ragged
