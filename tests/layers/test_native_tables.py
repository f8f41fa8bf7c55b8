"""DynamicEmbedding on tf_psx's own hash tables (`table="native"`, TF's DenseHashTable): both stacks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx.errors import ArgumentError
from tf_psx.layers import DynamicEmbedding
from tf_psx.tables import native

from conftest import run_script
from table_helpers import (BATCH, DIM, FIELDS, STEPS, WIRE_C, WIRE_INIT, WIRE_LR, bfloat16, head, keys_and_labels,
                           linear_wire_model, per_step_counts)

pytestmark = [pytest.mark.unit, pytest.mark.smoke]







def _native_model(initializer=None, name="items", wire_dtype=None):
    inputs = tf.keras.Input((FIELDS,), dtype=tf.int64)
    layer = DynamicEmbedding(DIM, initializer=initializer, name=name, table="native", wire_dtype=wire_dtype)
    return tf.keras.Model(inputs, head(layer(inputs))), layer


def _static_model(vocab_size, rows):
    inputs = tf.keras.Input((FIELDS,), dtype=tf.int64)
    layer = tf.keras.layers.Embedding(vocab_size, DIM, embeddings_initializer=tf.keras.initializers.Constant(rows))
    return tf.keras.Model(inputs, head(layer(inputs))), layer


# A table's rule is the lazy one (touched rows only): LazyAdam's for Adam, the same for SGD and Adagrad.
OPTIMIZERS = {
    "sgd": (lambda: tf.keras.optimizers.SGD(0.5), lambda: tf.keras.optimizers.SGD(0.5)),
    "adagrad": (lambda: tf.keras.optimizers.Adagrad(0.3), lambda: tf.keras.optimizers.Adagrad(0.3)),
    "adam": (lambda: tf.keras.optimizers.Adam(0.05), lambda: tf_psx.optimizers.LazyAdam(0.05)),
    "sgd_momentum": (lambda: tf.keras.optimizers.SGD(0.2, momentum=0.9),
                     lambda: tf_psx.optimizers.SGD(0.2, momentum=0.9)),
}


def _per_step_losses(model, data):
    # One step per epoch: the history then holds the loss of every step.
    history = model.fit(data, epochs=STEPS, steps_per_epoch=1, verbose=0)
    return np.array(history.history["loss"])


@pytest.mark.cluster
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_one_worker_equals_no_strategy_and_a_plain_embedding_with_duplicate_ids(ps_strategy, optimizer):
    vocab, index, labels = keys_and_labels()
    keys = vocab[index]
    make_table_opt, make_static_opt = OPTIMIZERS[optimizer]

    def dataset(_ctx=None):
        return tf.data.Dataset.from_tensor_slices((keys, labels)).batch(BATCH).repeat()

    # The default initializer, drawn per key from the layer's name: the same rows in every process.
    local, local_layer = _native_model()
    first_rows = local_layer.initial_rows(tf.constant(vocab)).numpy()
    assert 0.03 < first_rows.std() < 0.07  # N(0, 0.05)
    # Ground truth: a plain Embedding over the same keys renumbered 0..39, from the same rows.
    static, static_layer = _static_model(len(vocab), first_rows)
    static.compile(make_static_opt(), "binary_crossentropy")
    head = static.layers[-1].get_weights()
    truth = _per_step_losses(static, tf.data.Dataset.from_tensor_slices((index, labels)).batch(BATCH).repeat())

    local.layers[-1].set_weights(head)
    local.compile(make_table_opt(), "binary_crossentropy")
    no_strategy = _per_step_losses(local, dataset())

    with ps_strategy.scope():
        model, layer = _native_model()
        model.compile(make_table_opt(), "binary_crossentropy")
    model.layers[-1].kernel.assign(head[0])
    model.layers[-1].bias.assign(head[1])
    distributed = _per_step_losses(model, tf.keras.utils.experimental.DatasetCreator(dataset))

    assert truth[-1] < truth[0] - 1e-3, "the reference did not learn"
    np.testing.assert_allclose(no_strategy, truth, atol=1e-5)
    np.testing.assert_allclose(distributed, truth, atol=1e-5)
    # The rows read back through layer.export(): the plain Embedding's, key by key.
    expected = static_layer.embeddings.numpy()[np.argsort(vocab)]
    for table_layer in (local_layer, layer):
        exported_keys, rows = table_layer.export()
        np.testing.assert_array_equal(exported_keys, np.sort(vocab))
        np.testing.assert_allclose(rows, expected, atol=1e-5)
        assert table_layer.size() == len(vocab)


@pytest.mark.cluster
def test_each_shard_is_a_table_on_its_ps_task_and_keys_spread(ps_strategy):
    with ps_strategy.scope():
        model, layer = _native_model(initializer="zeros")
        model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy")
    table = layer.native_table
    assert table.devices == ["/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
    for shard, device in zip(table.shards, table.devices):
        assert tf.DeviceSpec.from_string(shard.resource_handle.device).task == tf.DeviceSpec.from_string(device).task
    # Consecutive ids, as sorted-by-frequency vocabularies give them: the key mix spreads them.
    keys = np.arange(1000, dtype=np.int64).reshape(200, 5)
    model.fit(tf.keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((keys, np.ones(200, np.float32))).batch(100)),
        epochs=1, steps_per_epoch=2, verbose=0)
    sizes = [int(shard.size()) for shard in table.shards]
    assert sum(sizes) == 1000 and min(sizes) > 440, sizes
    # Adagrad: one slot per key beside the row, and the bookkeeping (each key trained once, by step 0 or 1).
    assert table.slots == 1 and table.width == DIM * 2 + native.BOOKKEEPING
    _, values = table.export()
    # One Adagrad update from a zero row: acc = 0.1 + g^2 and row = -0.1 g / sqrt(acc), so row^2 acc / 0.01 = acc - 0.1
    # (to float32's resolution at 0.1, 7.5e-9, twice; g^2 is 1e-8 to 1e-6 here).
    accumulator, rows = values[:, DIM:2 * DIM].astype(np.float64), values[:, :DIM].astype(np.float64)
    assert (accumulator - 0.1 > 1e-7).mean() > 0.5
    np.testing.assert_allclose(rows**2 * (accumulator + 1e-7) / 0.01, accumulator - 0.1, atol=2e-8)
    updates = tf.bitcast(tf.constant(values[:, -3]), tf.int32).numpy()
    last = tf.bitcast(tf.constant(values[:, -2]), tf.int32).numpy()
    assert set(updates.tolist()) == {1} and set(last.tolist()) <= {0, 1}  # the steps applied before the one that used it


def test_string_keys_are_hashed_and_only_training_inserts():
    inputs = tf.keras.Input((3,), dtype=tf.string)
    layer = DynamicEmbedding(3, key_dtype=tf.string, table="native")
    model = tf.keras.Model(inputs, head(layer(inputs)))
    model.compile(tf.keras.optimizers.SGD(0.1), "binary_crossentropy")
    keys = np.array([["a", "b", "a"], ["zz", "b", "a"]])
    out = layer(tf.constant(keys)).numpy()
    assert out.shape == (2, 3, 3)
    np.testing.assert_array_equal(out[0, 0], out[0, 2])  # the same string, the same row
    assert layer.size() == 0  # a lookup alone inserts nothing
    model.fit(keys, np.array([1.0, 0.0]), epochs=1, verbose=0)
    assert layer.size() == 3  # "a", "b", "zz"
    hashed = tf_psx.layers.table_keys(tf.constant(["a", "b", "zz"]), tf.string).numpy()
    np.testing.assert_array_equal(layer.export()[0], np.sort(hashed))


def test_evaluation_reads_unseen_keys_as_zeros_and_training_reads_their_initial_row():
    layer = DynamicEmbedding(2, initializer="ones", table="native")
    keys = tf.constant([[4, 5]], tf.int64)
    np.testing.assert_array_equal(layer(keys, training=False).numpy(), np.zeros([1, 2, 2]))
    np.testing.assert_array_equal(layer(keys, training=True).numpy(), np.ones([1, 2, 2]))


def test_rows_are_drawn_per_key_whatever_the_batch():
    spec = native.initializer_spec(tf.keras.initializers.TruncatedNormal(0.0, 1.0), "T", 0.05)
    keys = tf.range(20_000, dtype=tf.int64)
    rows = native.draw_rows(keys, 8, spec, seed=5).numpy()
    # A key's row does not depend on the others drawn with it, and the seed changes it.
    np.testing.assert_array_equal(native.draw_rows(keys[7:9], 8, spec, seed=5).numpy(), rows[7:9])
    assert not np.array_equal(native.draw_rows(keys[7:9], 8, spec, seed=6).numpy(), rows[7:9])
    # 160,000 draws of N(0, 1) truncated at 2: within the bounds, mean 0 and std 0.880 (to 4 standard errors).
    assert np.abs(rows).max() <= 2.0
    assert abs(rows.mean()) < 4 * 0.88 / 400 and abs(rows.std() - 0.8796) < 0.01
    uniform = native.draw_rows(keys, 8, ("uniform", -1.0, 1.0, None), seed=5).numpy()
    assert uniform.min() >= -1.0 and uniform.max() <= 1.0 and abs(uniform.mean()) < 4 * 0.577 / 400


def test_a_layer_used_before_compile_keeps_its_rows_when_the_optimizer_adds_slots():
    inputs = tf.keras.Input((2,), dtype=tf.int64)
    layer = DynamicEmbedding(2, initializer="ones", table="native")
    model = tf.keras.Model(inputs, tf.keras.layers.Lambda(lambda r: tf.reduce_sum(r, axis=[1, 2]))(layer(inputs)))
    model.compile(tf.keras.optimizers.SGD(0.5), loss=lambda y, p: p)
    model.fit(np.array([[1, 2]]), np.zeros([1]), verbose=0)  # rows 1 - 0.5 = 0.5, no slots
    assert layer.native_table.slots == 0
    model.compile(tf.keras.optimizers.Adagrad(0.5, initial_accumulator_value=1.0), loss=lambda y, p: p)
    assert layer.native_table.slots == 1
    np.testing.assert_allclose(layer.export()[1], 0.5)
    model.fit(np.array([[1, 2]]), np.zeros([1]), verbose=0)
    # Adagrad from a fresh accumulator of 1.0: 0.5 - 0.5 * 1 / sqrt(1 + 1).
    np.testing.assert_allclose(layer.export()[1], 0.5 - 0.5 / np.sqrt(2.0), atol=1e-6)


def test_an_optimizer_without_a_table_rule_is_refused_at_compile_naming_those_that_work():
    _, layer = _native_model()
    model = tf.keras.Sequential([tf.keras.Input((FIELDS,), dtype=tf.int64), layer])
    with pytest.raises(ArgumentError, match=r"optimizer of a model with a DynamicEmbedding must be one whose update a "
                                            r"hash table applies exactly\. Received: .*RMSprop\. Fix: compile with one "
                                            r"of tf.keras.optimizers.SGD.*tf_psx.optimizers.LazyAdam"):
        model.compile(tf.keras.optimizers.RMSprop(0.1), loss="mse")


def test_bad_arguments_of_the_native_store():
    with pytest.raises(ArgumentError, match=r"`table` of DynamicEmbedding must be None, \"native\" or \"tfra\"\. "
                                            r"Received: 'redis'"):
        DynamicEmbedding(4, table="redis")
    with pytest.raises(ArgumentError, match=r"`initializer` of DynamicEmbedding must be one that a hash table can "
                                            r"draw per key.*Received: .*GlorotUniform.*Fix: pass"):
        DynamicEmbedding(4, initializer="glorot_uniform", table="native")
    with pytest.raises(ArgumentError, match=r"kv_creator of DynamicEmbedding need TFRA's tables"):
        DynamicEmbedding(4, kv_creator=None, table="native")
    layer = DynamicEmbedding(2, table="native")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"which the table reserves\. Fix: map these two ids"):
        layer(tf.constant([[native.EMPTY_KEY, 3]], tf.int64))
    with pytest.raises(tf_psx.errors.StateError, match=r"keeps its rows in tf_psx's own tables.*Fix: read rows with "
                                                       r"layer.export\(\)"):
        _ = layer.table


@pytest.mark.processes
def test_checkpoint_restores_rows_slots_and_bookkeeping_in_a_new_process(tmp_path):
    saved = run_script("dynamic_checkpoint.py", "save", str(tmp_path), "native")
    assert saved.returncode == 0, saved.stderr[-3000:]
    restored = run_script("dynamic_checkpoint.py", "restore", str(tmp_path), "native")
    assert restored.returncode == 0, restored.stdout[-2000:] + restored.stderr[-3000:]
    assert "rows, m and v restored: 40 keys" in restored.stdout


def _result(completed) -> dict:
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, completed.stdout[-2000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.processes
@pytest.mark.parametrize("ps", [3, 1])
def test_a_snapshot_restores_onto_another_number_of_ps_tasks_and_adam_counts_on(tmp_path, ps):
    # Saved after 6 Adam steps on 2 ps tasks: the table whole (keys, rows, slots, bookkeeping) and 2 shard
    # counters of 6. Restored onto 3 (or 1) ps tasks: every key found on its new shard with its row and
    # moments, and every shard's counter goes on from 6, so after 6 more steps each is 12 (a new shard's
    # counter started at 0 would bias-correct the restored moments as a first step's).
    saved = _result(run_script("table_restore.py", "save", str(tmp_path), "2", "native", "adam"))
    assert saved["size"] > 0
    restored = _result(run_script("table_restore.py", "restore", str(tmp_path), str(ps), "native", "adam"))
    assert restored["restored_step"] == 6, restored
    assert restored["size_restored"] == restored["size_saved"] and restored["exists_equal"], restored
    assert restored["rows_max_diff"] == 0.0 and restored["accumulators_equal"], restored
    assert restored["table_steps"] == {f"shard_{index}": 12 for index in range(ps)}, restored


def test_a_keras_file_holds_the_table_and_its_slots(tmp_path):
    layer = DynamicEmbedding(2, table="native", name="items")
    inputs = tf.keras.Input((2,), dtype="int64")
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(layer(inputs))))
    model.compile(tf.keras.optimizers.Adam(0.1), loss="mse")
    x = np.array([[3, 9], [4, 9]])
    model.fit(x, np.ones([2]), verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = tf.keras.models.load_model(tmp_path / "model.keras")
    keys, values = loaded.get_layer("items").native_table.export()
    want_keys, want_values = layer.native_table.export()
    np.testing.assert_array_equal(keys, [3, 4, 9])
    np.testing.assert_array_equal(keys, want_keys)
    np.testing.assert_array_equal(values, want_values)  # rows, Adam's moments, bookkeeping
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))


@pytest.mark.cluster
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_wire_dtype_rounds_gradients_on_the_wire_and_keeps_float32_rows(ps_strategy, local_cluster, sync):
    if sync:
        ps_strategy = tf_psx.ParameterServerStrategy(local_cluster, partitioner="fixed:2", sync=True)
    vocab, index, labels = keys_and_labels()
    keys = vocab[index]
    per_step = per_step_counts(index, len(vocab))

    def dataset(_ctx=None):
        return tf.data.Dataset.from_tensor_slices((keys, labels)).batch(BATCH)

    local, local_layer = linear_wire_model("bfloat16", table="native")
    local.fit(dataset(), epochs=1, verbose=0)
    with ps_strategy.scope():
        model, layer = linear_wire_model("bfloat16", table="native")
    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset), epochs=1, steps_per_epoch=STEPS, verbose=0)
    if sync:
        assert ps_strategy.sync_stats()["applied_steps"] == STEPS

    # A new key starts from the initializer's float32 row on its shard; each step subtracts LR x its gradient
    # rounded to bfloat16 on the way; the rows stay float32 on the ps.
    gradients = per_step.astype(np.float32) * (np.float32(WIRE_C) / BATCH)
    rounded = bfloat16(gradients)
    narrow = np.float32(WIRE_INIT) - WIRE_LR * rounded.sum(axis=0)
    wide = np.float32(WIRE_INIT) - WIRE_LR * gradients.astype(np.float64).sum(axis=0)
    assert np.abs(narrow - wide).max() > 1e-4  # the closed forms tell the two apart
    order = np.argsort(vocab)
    for table_layer in (local_layer, layer):
        exported_keys, rows = table_layer.export()
        np.testing.assert_array_equal(exported_keys, vocab[order])
        assert rows.dtype == np.float32
        np.testing.assert_allclose(rows, np.repeat(narrow[order, None], DIM, axis=1), atol=2e-6)
    # Evaluation reads the rows through the wire: each is its bfloat16 rounding.
    read = layer(tf.constant(vocab[None, :FIELDS]), training=False).numpy()[0]
    stored = dict(zip(*layer.export()))
    stored = np.stack([stored[key] for key in vocab[:FIELDS]])
    np.testing.assert_array_equal(read, tf.cast(tf.cast(stored, tf.bfloat16), tf.float32).numpy())
    assert not np.array_equal(read, stored)


TFRA_SNAPSHOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tfra_snapshot")


def _snapshot_model(strategy):
    """(model, layer): the model of tests/data/tfra_snapshot built on a native table, compiled in `strategy`."""
    with strategy.scope():
        inputs = tf.keras.Input((4,), dtype=tf.int64)
        layer = DynamicEmbedding(3, name="items", table="native", initializer="zeros")
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, name="head")(tf.keras.layers.Flatten()(layer(inputs))))
        model.compile(tf.keras.optimizers.Adam(0.05), "mse")
    return model, layer


@pytest.mark.cluster
def test_a_snapshot_of_tfra_tables_restores_into_native_tables(ps_strategy):
    # tests/data/tfra_snapshot: a TFRA-backed DynamicEmbedding(3, name="items") + Dense "head", Adam(0.05),
    # 6 steps on 1 worker and 2 ps tasks (2 shards of rows, m and v), written on the TFRA stack by
    # tests/scripts/make_tfra_snapshot.py with what it read from TFRA's tables.
    expected = np.load(os.path.join(TFRA_SNAPSHOT, "expected.npz"))
    model, layer = _snapshot_model(ps_strategy)
    loaded = tf_psx.tables.restore_from_tfra(model, os.path.join(TFRA_SNAPSHOT, "ckpt"))
    assert loaded == ["items"]
    keys, values = layer.native_table.export()
    np.testing.assert_array_equal(keys, expected["keys"])
    np.testing.assert_array_equal(values[:, :3], expected["rows"])
    np.testing.assert_array_equal(values[:, 3:6], expected["m"])
    np.testing.assert_array_equal(values[:, 6:9], expected["v"])
    np.testing.assert_array_equal(tf_psx.unsharded_weights(model.get_layer("head"))[0], expected["kernel"])
    assert int(model.optimizer.iterations.numpy()) == int(expected["iterations"]) == 6
    # Every shard's step counter goes on from the snapshot's 6 steps (Adam's bias correction).
    model.fit(np.asarray(expected["keys"][:4])[None, :], np.zeros([1]), verbose=0)
    assert tf_psx.tables.updates.shard_steps(model.optimizer, layer.native_table) == [7, 7]


@pytest.mark.cluster
def test_periodic_sync_resumes_a_snapshot_of_tfra_tables_into_native_tables(ps_strategy, tmp_path):
    # The committed TFRA checkpoint made into a PeriodicSync snapshot of step 6 (one epoch of 6 steps): fit
    # resumes from it, restoring the TFRA tables into the native table (tf_psx.tables.from_tfra), and has no
    # step left to run in that epoch.
    import glob  # pylint: disable=import-outside-toplevel
    import shutil  # pylint: disable=import-outside-toplevel

    from tf_psx.snapshots import store as snapshot_store  # pylint: disable=import-outside-toplevel

    def write(prefix):
        for path in glob.glob(os.path.join(TFRA_SNAPSHOT, "ckpt.*")):
            shutil.copy(path, prefix + path[len(os.path.join(TFRA_SNAPSHOT, "ckpt")):])

    directory = str(tmp_path / "snapshots")
    snapshot_store.SnapshotStore(directory, max_to_keep=2).commit(
        6, write, {"epoch": 0, "step_in_epoch": 6, "steps_per_epoch": 6, "seconds": 0.0})
    expected = np.load(os.path.join(TFRA_SNAPSHOT, "expected.npz"))
    model, layer = _snapshot_model(ps_strategy)
    sync = tf_psx.callbacks.PeriodicSync(every_n_steps=6, directory=directory)
    keys = np.asarray(expected["keys"][:4])[None, :].repeat(8, axis=0)
    model.fit(tf.keras.utils.experimental.DatasetCreator(
        lambda _: tf.data.Dataset.from_tensor_slices((keys, np.zeros(8, np.float32))).batch(8).repeat()),
        epochs=1, steps_per_epoch=6, verbose=0, callbacks=[sync])
    assert sync.restored is not None and sync.restored.step == 6
    exported_keys, values = layer.native_table.export()
    np.testing.assert_array_equal(exported_keys, expected["keys"])
    np.testing.assert_array_equal(values[:, :3], expected["rows"])
    np.testing.assert_array_equal(values[:, 3:6], expected["m"])
    assert int(model.optimizer.iterations.numpy()) == 6


@pytest.mark.cluster
def test_sync_switch_trains_a_native_table_by_the_closed_form_in_both_modes(local_cluster):
    # loss = mean over the batch of the sum of the rows: key k's gradient is (its occurrences per batch) / 8 in
    # every step, async or sync (a sync step of one worker applies that one gradient), so after S SGD steps its
    # row is -lr * S * that gradient, whichever mode applied each step.
    strategy = tf_psx.ParameterServerStrategy(local_cluster, sync="switchable")
    with strategy.scope():
        inputs = tf.keras.Input((2,), dtype=tf.int64)
        layer = DynamicEmbedding(2, initializer="zeros", name="switched", table="native")
        model = tf.keras.Model(inputs, tf.keras.layers.Lambda(lambda r: tf.reduce_sum(r, axis=[1, 2]))(layer(inputs)))
        model.compile(tf.keras.optimizers.SGD(0.1), loss=lambda y, p: p)
    x = np.array([[7, 7], [7, 9]] * 4, np.int64)  # per batch of 8: key 7 twelve times, key 9 four times
    data = tf.data.Dataset.from_tensor_slices((x, np.zeros(8, np.float32))).repeat().batch(8)
    switch = tf_psx.callbacks.SyncSwitch(to="sync", at_step=5)
    model.fit(data, epochs=2, steps_per_epoch=6, callbacks=[switch], verbose=0)
    stats = strategy.sync_stats()
    assert switch.switched_at_step == 5 and stats["applied_steps"] == 7, stats
    assert int(model.optimizer.iterations.numpy()) == 12
    keys, rows = layer.export()
    np.testing.assert_array_equal(keys, [7, 9])
    np.testing.assert_allclose(rows, [[-0.1 * 12 * 12 / 8] * 2, [-0.1 * 12 * 4 / 8] * 2], rtol=1e-6)


def test_an_h5_file_is_refused_for_a_native_table_naming_the_formats_that_hold_it(tmp_path):
    layer = DynamicEmbedding(2, table="native", name="items")
    inputs = tf.keras.Input((2,), dtype="int64")
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(layer(inputs))))
    model.compile(tf.keras.optimizers.SGD(0.1), loss="mse")
    model.fit(np.array([[3, 9]]), np.ones([1]), verbose=0)
    for save in (lambda: model.save(tmp_path / "model.h5"), lambda: model.save_weights(str(tmp_path / "w.h5"))):
        with pytest.raises(tf_psx.errors.StateError, match=r"an \.h5 file cannot hold.*Fix: model\.save\(\"model\.keras\"\)"):
            save()
