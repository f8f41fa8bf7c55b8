"""TFRA's own layers and optimizers, written as TFRA's demos write them, under tf_psx's strategy.

TF alone: TFRA 0.8.1's movielens-1m-keras-ps demo fails with 2 workers in
every run (shape errors in `AssignSubVariableOp`, `ResourceScatterAdd`,
`CuckooHashTableInsert`): the workers share TFRA's shadow buffers, and the
legacy optimizer writes rows back outside any lock.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx.training import exact_compile as _exact_compile

from conftest import run_script
from test_exact_epochs import _assert_exact, _results

pytestmark = [pytest.mark.processes, pytest.mark.tfra]  # DynamicEmbedding and TFRA clients: the TFRA stack (make test-tfra)


def _result(*args: str) -> dict:
    result = run_script("tfra_demo_ps.py", *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")][0]


@pytest.mark.unit
def test_a_legacy_optimizer_has_a_current_twin_with_its_settings():
    legacy = tf.keras.optimizers.legacy.Adam(0.003, beta_1=0.8, epsilon=1e-5)
    current = _exact_compile.current_optimizer_for(legacy)
    assert type(current) is tf.keras.optimizers.Adam
    assert float(current.learning_rate) == pytest.approx(0.003) and current.beta_1 == 0.8 and current.epsilon == 1e-5
    # A setting the current class does not have: no twin.
    assert _exact_compile.current_optimizer_for(tf.keras.optimizers.legacy.Adam(0.01, decay=0.1)) is None


def test_tfra_demo_runs_with_two_workers_and_trains_exactly_the_batches_it_read():
    remote = _result("--workers", "2")
    local = _result("--local")
    for run in (remote, local):
        assert run["steps"] == 20
        # The tables hold exactly the ids of the 20 batches fit read (2 epochs of 10 steps of one pass):
        # per-worker copies of the dataset would have read 40 batches, and lost rows would be missing.
        assert run["user_keys"] == run["read_users"] and run["movie_keys"] == run["read_movies"]
    # The legacy Adam's current twin is made in the strategy's scope although the demo compiles outside it:
    # made on the coordinator, its `iterations` cost every step a round trip there.
    assert "/job:ps/" in remote["iterations_device"], remote["iterations_device"]
    # The loss of 20 steps of Adam(1e-3) from random weights: the runs differ only by their initial weights
    # and data order (the demo seeds neither); one-process runs spread by about 0.002 at this size.
    assert abs(remote["loss"][-1] - local["loss"][-1]) < 0.01, (remote["loss"], local["loss"])


def test_tfra_layers_with_a_legacy_optimizer_train_every_example_once_with_three_workers():
    # The closed form of tests/scripts/exact_epochs.py: TFRA's Embedding, de.DynamicEmbeddingOptimizer(legacy Adagrad).
    results = _results("--workers", "3", "--tfra", "--inputs", "dataset,arrays", "--epochs", "2")
    assert all(r["tfra"] for r in results)
    _assert_exact(results, {"dataset", "arrays"})


@pytest.mark.cluster
def test_a_legacy_optimizer_without_a_twin_is_refused_with_the_fix(ps_strategy):
    from tensorflow_recommenders_addons import dynamic_embedding as de  # pylint: disable=import-outside-toplevel

    def build(name):
        with ps_strategy.scope():
            inputs = tf.keras.Input((1,), dtype=tf.int64)
            layer = de.keras.layers.Embedding(1, initializer=tf.keras.initializers.Zeros(), name=name,
                                              devices=["/job:ps/replica:0/task:0/device:CPU:0"])
            return tf.keras.Model(inputs, tf.keras.layers.Flatten()(layer(inputs)))

    model = build("refused_rows")
    with pytest.raises(tf_psx.errors.TFRAOptimizerError,
                       match=r"has TFRA layers and the legacy optimizer Adam, which has no current tf\.keras twin "
                             r"with these settings.*Received: \{.*'decay': 0\.1.*Fix: compile with a "
                             r"tf\.keras\.optimizers optimizer"):
        model.compile(de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(0.01, decay=0.1)), "mse")
    # The fix: a current optimizer; it trains.
    model.compile(de.DynamicEmbeddingOptimizer(tf.keras.optimizers.Adam(0.01)), "mse")
    model.fit(np.arange(8, dtype=np.int64)[:, None], np.ones(8, np.float32), batch_size=4, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
