"""DynamicEmbedding (TFRA hash tables): correctness with duplicate ids, PS placement, checkpoints."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx._tf import shadows as _shadows
from tf_psx.layers import DynamicEmbedding

from conftest import run_script
from table_helpers import (BATCH, DIM, FIELDS, STEPS, WIRE_C, WIRE_LR, bfloat16, head, keys_and_labels,
                           linear_wire_model, per_step_counts)

pytestmark = [pytest.mark.unit, pytest.mark.tfra]  # DynamicEmbedding and TFRA clients: the TFRA stack (make test-tfra)

INIT = 0.1






def _dynamic_model():
    inputs = tf.keras.Input((FIELDS,), dtype=tf.int64)
    layer = DynamicEmbedding(DIM, initializer=tf.keras.initializers.Constant(INIT))
    return tf.keras.Model(inputs, head(layer(inputs))), layer


def _static_model(vocab_size):
    inputs = tf.keras.Input((FIELDS,), dtype=tf.int64)
    layer = tf.keras.layers.Embedding(vocab_size, DIM, embeddings_initializer=tf.keras.initializers.Constant(INIT))
    return tf.keras.Model(inputs, head(layer(inputs)))


OPTIMIZERS = {
    # TFRA's wrapped Adam creates and updates slots only for the keys looked
    # up, which is LazyAdam's rule; SGD has no slots.
    "sgd": (lambda: tf.keras.optimizers.SGD(0.5), lambda: tf.keras.optimizers.SGD(0.5)),
    "adam": (lambda: tf.keras.optimizers.Adam(0.05), lambda: tf_psx.optimizers.LazyAdam(0.05)),
}


def _per_step_losses(model, data):
    # One step per epoch: the history then holds the loss of every step.
    history = model.fit(data, epochs=STEPS, steps_per_epoch=1, verbose=0)
    return np.array(history.history["loss"])


@pytest.mark.cluster
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_one_worker_losses_equal_no_strategy_with_duplicate_ids(ps_strategy, optimizer):
    vocab, index, labels = keys_and_labels()
    keys = vocab[index]
    make_de_opt, make_static_opt = OPTIMIZERS[optimizer]

    def dataset(_ctx=None):
        return tf.data.Dataset.from_tensor_slices((keys, labels)).batch(BATCH).repeat()

    # Ground truth: a plain Embedding over the same keys renumbered 0..39.
    static = _static_model(len(vocab))
    static.compile(make_static_opt(), "binary_crossentropy")
    head = static.layers[-1].get_weights()
    truth = _per_step_losses(static, tf.data.Dataset.from_tensor_slices((index, labels)).batch(BATCH).repeat())

    local, _ = _dynamic_model()
    local.layers[-1].set_weights(head)
    local.compile(make_de_opt(), "binary_crossentropy")
    no_strategy = _per_step_losses(local, dataset())

    with ps_strategy.scope():
        model, layer = _dynamic_model()
        model.compile(make_de_opt(), "binary_crossentropy")
    model.layers[-1].kernel.assign(head[0])
    model.layers[-1].bias.assign(head[1])
    distributed = _per_step_losses(model, tf.keras.utils.experimental.DatasetCreator(dataset))

    assert truth[-1] < truth[0] - 1e-3, "the reference did not learn"
    np.testing.assert_allclose(no_strategy, truth, atol=1e-5)
    np.testing.assert_allclose(distributed, truth, atol=1e-5)
    assert layer.size() == len(vocab)


@pytest.mark.cluster
def test_table_lives_on_the_ps_tasks_and_keys_spread(ps_strategy):
    with ps_strategy.scope():
        model, layer = _dynamic_model()
        model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy")
    devices = layer.table.devices
    assert devices == ["/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
    keys = np.arange(1000, dtype=np.int64).reshape(200, 5) * 7919
    model.fit(tf.keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((keys, np.ones(200, np.float32))).batch(100)),
        epochs=1, steps_per_epoch=2, verbose=0)
    sizes = [int(t.size()) for t in layer.table._tables]  # pylint: disable=protected-access
    assert sum(sizes) == 1000 and min(sizes) > 400  # TFRA splits keys by key % num_ps
    # The step's buffers (the shadow of the rows looked up, its ids and
    # exists, and Adagrad's slot shadow) are per-worker copies, not one
    # variable on the coordinator that every worker would share.
    shadow = layer.embedding.shadow
    slots = shadow._tracked_slots  # pylint: disable=protected-access
    assert len(slots) == 1  # Adagrad's accumulator
    for buffer in [shadow, shadow.ids, shadow.exists, *slots]:
        assert isinstance(buffer, _shadows._PerWorkerHandle), type(buffer).__mro__  # pylint: disable=protected-access


@pytest.mark.cluster
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_wire_dtype_rounds_rows_and_gradients_alike_with_and_without_a_strategy(ps_strategy, local_cluster, sync):
    # sync: the step's gradients reach the ps accumulators in float32, and
    # their mean (here one worker's, so the same sum per key) is rounded once
    # on its way to the shard: the closed form is the same.
    if sync:
        ps_strategy = tf_psx.ParameterServerStrategy(local_cluster, partitioner="fixed:2", sync=True)
    vocab, index, labels = keys_and_labels()
    keys = vocab[index]
    per_step = per_step_counts(index, len(vocab))

    def dataset(_ctx=None):
        return tf.data.Dataset.from_tensor_slices((keys, labels)).batch(BATCH)

    local, local_layer = linear_wire_model("bfloat16")
    local.fit(dataset(), epochs=1, verbose=0)
    with ps_strategy.scope():
        model, layer = linear_wire_model("bfloat16")
    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset), epochs=1, steps_per_epoch=STEPS, verbose=0)
    if sync:
        assert ps_strategy.sync_stats()["applied_steps"] == STEPS

    # A new key's row is the initializer's, read through the wire (rounded),
    # then each step subtracts LR x its rounded gradient; float32 on the ps.
    gradients = per_step.astype(np.float32) * (np.float32(WIRE_C) / BATCH)
    narrow = bfloat16(INIT) - WIRE_LR * bfloat16(gradients).sum(axis=0)
    wide = INIT - WIRE_LR * gradients.astype(np.float64).sum(axis=0)
    assert np.abs(narrow - wide).min() > 1e-4  # the closed forms tell the two apart for every key
    for table_layer in (local_layer, layer):
        rows = table_layer.table.lookup(tf.constant(vocab)).numpy()
        assert rows.dtype == np.float32 and table_layer.table.value_dtype == tf.float32
        np.testing.assert_allclose(rows, np.repeat(narrow[:, None], DIM, axis=1), atol=2e-5)
    # Evaluation reads the rows through the wire too: each is its bfloat16 rounding.
    read = layer(tf.constant(vocab[None, :FIELDS]), training=False).numpy()[0]
    stored = layer.table.lookup(tf.constant(vocab[:FIELDS])).numpy()
    np.testing.assert_array_equal(read, tf.cast(tf.cast(stored, tf.bfloat16), tf.float32).numpy())
    assert not np.array_equal(read, stored)
    assert layer.get_config()["wire_dtype"] == "bfloat16"


def test_wire_dtype_of_a_hash_table_must_be_a_half_float():
    with pytest.raises(ValueError, match=r"`wire_dtype` of DynamicEmbedding must be None, \"bfloat16\" or "
                                         r"\"float16\"\. Received: 'int8'\. Fix: pass wire_dtype="):
        DynamicEmbedding(4, wire_dtype="int8")


def test_string_keys_are_hashed_and_grow_the_table():
    inputs = tf.keras.Input((3,), dtype=tf.string)
    layer = DynamicEmbedding(3, key_dtype=tf.string)
    model = tf.keras.Model(inputs, head(layer(inputs)))
    model.compile(tf.keras.optimizers.SGD(0.1), "binary_crossentropy")
    keys = np.array([["a", "b", "a"], ["zz", "b", "a"]])
    out = layer(tf.constant(keys)).numpy()
    assert out.shape == (2, 3, 3)
    np.testing.assert_array_equal(out[0, 0], out[0, 2])  # the same string, the same row
    assert layer.size() == 0  # a lookup alone inserts nothing
    model.fit(keys, np.array([1.0, 0.0]), epochs=1, verbose=0)
    assert layer.size() == 3  # "a", "b", "zz"


def test_shadows_without_a_strategy_stay_plain_variables():
    layer = DynamicEmbedding(2)
    assert not isinstance(layer.embedding.shadow, _shadows._PerWorkerHandle)  # pylint: disable=protected-access
    assert not isinstance(layer.embedding.shadow.ids, _shadows._PerWorkerHandle)  # pylint: disable=protected-access


TWO_WORKER_OPTIMIZERS = ("sgd", "adagrad", "adam")


@pytest.mark.processes
def test_two_workers_train_each_workers_rows_correctly():
    # TFRA 0.8.1 alone (the script's --raw mode) fails here: its shadow
    # buffers live on the coordinator and both workers' steps share them
    # ("indices[10] = 10 is not in [0, 10)" in Adagrad, shape errors in SGD
    # and Adam, and with equal batch shapes SGD silently applies one worker's
    # gradients to the other's rows). The script derives the exact rows
    # (SGD, Adagrad) or an equality that mixed rows break (Adam).
    result = run_script("dynamic_two_workers.py", *TWO_WORKER_OPTIMIZERS)
    report = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, report
    for name in TWO_WORKER_OPTIMIZERS:
        assert f"RESULT {name}: OK" in result.stdout, report


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"`key_dtype` of DynamicEmbedding must be tf.int64 or tf.string\. Received: tf.int32.*Fix: cast"):
        DynamicEmbedding(4, key_dtype=tf.int32)
    with pytest.raises(ValueError, match=r"`output_dim` of DynamicEmbedding must be an int >= 1\. Received: 0"):
        DynamicEmbedding(0)


@pytest.mark.processes
def test_checkpoint_restores_tables_and_slots_in_a_new_process(tmp_path):
    # TFRA names checkpoint keys after the table, so the restore runs where
    # a restarted job would: a new process that builds the same model.
    saved = run_script("dynamic_checkpoint.py", "save", str(tmp_path))
    assert saved.returncode == 0, saved.stdout[-3000:] + saved.stderr[-3000:]
    restored = run_script("dynamic_checkpoint.py", "restore", str(tmp_path))
    assert restored.returncode == 0, restored.stdout[-3000:] + restored.stderr[-3000:]
    assert "rows, m and v restored: 40 keys" in restored.stdout


# In a fresh Python: the check is of TFRA imported through tf_psx, and a test that imported TFRA itself
# before (as TFRA's demos do) leaves Keras 3 patched in its process, whatever this test does.
_KERAS3_AFTER_TFRA = """
import numpy as np
import keras  # Keras 3
from tf_psx._tf import tfra
tfra.tfra()
print("SHAPE", tuple(keras.layers.Dense(2, kernel_initializer="glorot_uniform")(np.ones((1, 3), "float32")).shape))
"""


@pytest.mark.processes
def test_tfra_import_leaves_keras3_initializers_working():
    result = subprocess.run([sys.executable, "-c", _KERAS3_AFTER_TFRA], capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0 and "SHAPE (1, 2)" in result.stdout, result.stdout[-2000:] + result.stderr[-3000:]
