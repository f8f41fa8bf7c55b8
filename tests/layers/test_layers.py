"""ShardedEmbedding: lookups, range errors, training equality and resharded restore."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx.layers import ShardedEmbedding, balanced_permutation

from conftest import run_script

pytestmark = pytest.mark.unit

ROWS, DIM, FIELDS, BATCH, STEPS = 500, 4, 6, 16, 10


@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("dedup", [True, False])
def test_lookups_match_a_plain_embedding(balance, dedup):
    table = np.random.default_rng(0).normal(size=(ROWS, DIM)).astype(np.float32)
    layer = ShardedEmbedding(ROWS, DIM, balance=balance, dedup=dedup)
    layer.build((None, FIELDS))
    # Storage row p(k) holds id k's vector.
    storage = np.empty_like(table)
    storage[balanced_permutation(np.arange(ROWS), ROWS) if balance else np.arange(ROWS)] = table
    layer.embeddings.assign(storage)
    ids = np.array([[0, 0, 499, 3, 3, 3], [7, 1, 0, 250, 499, 2]])
    np.testing.assert_array_equal(layer(tf.constant(ids)).numpy(), table[ids])
    np.testing.assert_array_equal(layer.lookup_table(), table)


@pytest.mark.parametrize("bad", [-1, ROWS, ROWS + 77])
def test_out_of_range_id_names_the_layer_the_id_and_input_dim(bad):
    layer = ShardedEmbedding(ROWS, DIM, name="user_emb")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=rf"ShardedEmbedding `user_emb`: ids must be in \[0, input_dim={ROWS}\); received id {bad}\. Fix: hash or clip"):
        layer(tf.constant([[1, bad, 2]]))


def test_bad_input_dim_is_rejected():
    with pytest.raises(ValueError, match=r"`input_dim` of ShardedEmbedding must be an int >= 1\. Received: 0"):
        ShardedEmbedding(0, 4)
    with pytest.raises(ValueError, match=r"must be <= 3037000499 with balance=True\. Received: 4000000000\. Fix: pass balance=False"):
        ShardedEmbedding(4_000_000_000, 4)


def _model(embedding_layer):
    inputs = tf.keras.Input((FIELDS,), dtype=tf.int64)
    hidden = tf.keras.layers.Flatten()(embedding_layer(inputs))
    return tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(hidden))


def _zipf_batches():
    rng = np.random.default_rng(4)
    probs = np.arange(1, ROWS + 1) ** -1.05
    ids = rng.choice(ROWS, size=(BATCH * STEPS, FIELDS), p=probs / probs.sum())  # many duplicates
    return ids, (ids[:, 0] < 3).astype(np.float32)


@pytest.mark.cluster
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_sharded_balanced_deduped_training_equals_plain_embedding(ps_strategy, optimizer):
    # Reference: a plain Embedding, no strategy. Under test: ShardedEmbedding
    # (balance + dedup) sharded over 2 ps with 1 worker. With the same
    # logical initial table the updates are the same maths, so the tables
    # must agree after training.
    ids, labels = _zipf_batches()
    tf.keras.utils.set_random_seed(2)
    reference = _model(tf.keras.layers.Embedding(ROWS, DIM, name="emb"))
    reference.compile(optimizer, "binary_crossentropy")
    initial = reference.get_weights()
    reference.fit(ids, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    with ps_strategy.scope():
        layer = ShardedEmbedding(ROWS, DIM, name="emb")
        model = _model(layer)
        model.compile(optimizer, "binary_crossentropy")
    assert layer.num_shards() == 2
    storage = np.empty_like(initial[0])
    storage[balanced_permutation(np.arange(ROWS), ROWS)] = initial[0]
    layer.embeddings.assign(storage)
    model.layers[-1].kernel.assign(initial[1])
    model.layers[-1].bias.assign(initial[2])
    model.fit(
        tf.keras.utils.experimental.DatasetCreator(
            lambda ctx: tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH)),
        epochs=1, steps_per_epoch=STEPS, verbose=0,
    )
    want = reference.get_layer("emb").get_weights()[0]
    assert not np.allclose(want, initial[0])
    np.testing.assert_allclose(layer.lookup_table(), want, atol=1e-5)


@pytest.mark.cluster
def test_out_of_range_id_under_the_strategy_fails_fit_with_the_layer_message(local_cluster):
    # A strategy of its own: the failed closure must not disturb the shared one.
    strategy = tf_psx.ParameterServerStrategy(local_cluster, partitioner="fixed:2")
    with strategy.scope():
        model = _model(ShardedEmbedding(ROWS, DIM, name="bad_ids"))
        model.compile("sgd", "binary_crossentropy")
    ids = np.full((BATCH, FIELDS), ROWS + 5)
    data = tf.keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((ids, np.zeros(BATCH, np.float32))).repeat().batch(BATCH))
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"ShardedEmbedding `bad_ids`.*input_dim={ROWS}.*{ROWS + 5}"):
        model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)


@pytest.mark.processes
def test_checkpoint_from_2_ps_restores_into_3_ps(tmp_path):
    saved = run_script("reshard_checkpoint.py", "save", str(tmp_path), "2")
    assert saved.returncode == 0, saved.stdout[-3000:] + saved.stderr[-3000:]
    restored = run_script("reshard_checkpoint.py", "restore", str(tmp_path), "3")
    assert restored.returncode == 0, restored.stdout[-3000:] + restored.stderr[-3000:]
    assert "shards=3 identical lookups" in restored.stdout


def test_balanced_permutation_refuses_ids_out_of_range():
    with pytest.raises(ValueError, match=r"must be in \[0, input_dim=5\); received id 7\. Fix: hash or clip"):
        tf_psx.layers.balanced_permutation(np.array([1, 7]), 5)
    with pytest.raises(ValueError, match=r"received id -1"):
        tf_psx.layers.balanced_permutation(np.array([-1]), 5)
    with pytest.raises(ValueError, match=r"must be integers\. Received dtype: float64"):
        tf_psx.layers.balanced_permutation(np.array([1.0]), 5)


def test_dynamic_embedding_without_unique_is_a_clear_error():
    with pytest.raises(ValueError, match=r"`with_unique` of DynamicEmbedding must be True.*Received: False\. Fix: drop"):
        tf_psx.layers.DynamicEmbedding(4, with_unique=False)


def test_redaction_keeps_the_id_out_of_the_sharded_range_error(monkeypatch):
    from tf_psx import redaction  # pylint: disable=import-outside-toplevel

    monkeypatch.setenv(redaction.ENV, "1")
    layer = tf_psx.layers.ShardedEmbedding(5, 2, name="users")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"ShardedEmbedding `users`: ids must be in \[0, input_dim=5\); received id <redacted>\. Fix"):
        layer(tf.constant([1, 7]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"received id\] \[<redacted>\] \[Fix"):
        tf.function(layer)(tf.constant([1, 7]))
