"""Strategy wrappers on the session's in-process cluster (cluster tier), and their checks that need none (unit)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import sharded_variable

import tf_psx
from tf_psx._tf import keras as _tf_keras

from conftest import SCRIPT_TIMEOUT_S, run_script

pytestmark = pytest.mark.cluster

NUM_ROWS = 1000
DIM = 4
FIELDS = 3
BATCH = 32
STEPS = 12


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, NUM_ROWS, size=(BATCH * STEPS, FIELDS)).astype(np.int64)
    # Duplicate ids inside batches on purpose: sparse gradients must sum them.
    ids[:, 1] = ids[:, 0]
    labels = (ids.sum(axis=1) % 2).astype(np.float32)
    return ids, labels


def _model() -> tf.keras.Model:
    inputs = tf.keras.Input(shape=(FIELDS,), dtype=tf.int64)
    emb = tf.keras.layers.Embedding(NUM_ROWS, DIM, name="emb")(inputs)
    out = tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Flatten()(emb))
    return tf.keras.Model(inputs, out)


def _dense(var) -> np.ndarray:
    if isinstance(var, sharded_variable.ShardedVariable):
        return tf.concat(var.variables, axis=0).numpy()
    return var.numpy()


def _variables(model):
    """[embeddings, kernel, bias]: whole (possibly sharded) variables, in get_weights order."""
    dense = model.layers[-1]
    return [model.get_layer("emb").embeddings, dense.kernel, dense.bias]


def _dataset():
    ids, labels = _data()
    return tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH)


def test_is_a_tf_parameter_server_strategy(ps_strategy):
    assert isinstance(ps_strategy, tf.distribute.ParameterServerStrategy)
    assert isinstance(ps_strategy, tf.distribute.experimental.ParameterServerStrategy)


def test_coordinator_is_created_once_and_used_by_keras(ps_strategy):
    first = ps_strategy.coordinator
    assert ps_strategy.coordinator is first
    assert tf.distribute.experimental.coordinator.ClusterCoordinator(ps_strategy) is first


def test_fit_trains_and_shards_embedding_on_ps(ps_strategy):
    with ps_strategy.scope():
        model = _model()
        model.compile(tf.keras.optimizers.SGD(0.5), "binary_crossentropy")
    emb = model.get_layer("emb").embeddings
    assert isinstance(emb, sharded_variable.ShardedVariable)
    assert len(emb.variables) == 2
    assert sorted(v.device for v in emb.variables) == [
        "/job:ps/replica:0/task:0/device:CPU:0",
        "/job:ps/replica:0/task:1/device:CPU:0",
    ]
    before = _dense(emb).copy()
    history = model.fit(
        tf.keras.utils.experimental.DatasetCreator(lambda ctx: _dataset().repeat()),
        epochs=2, steps_per_epoch=STEPS, verbose=0,
    )
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations.numpy()) == 2 * STEPS
    assert not np.allclose(_dense(emb), before), "fit did not change the embedding"


OPTIMIZERS = {
    "sgd": lambda: tf.keras.optimizers.SGD(0.1),
    "adam": lambda: tf.keras.optimizers.Adam(0.01),
    "adagrad": lambda: tf.keras.optimizers.Adagrad(0.1),
    "lazy_adam": lambda: tf_psx.optimizers.LazyAdam(0.01),
    "psx_sgd_momentum": lambda: tf_psx.optimizers.SGD(0.1, momentum=0.9),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_one_worker_equals_no_strategy(ps_strategy, optimizer):
    # With one worker the coordinator runs the steps one after another, in
    # order, so every update must equal the single-process update: same
    # initial weights, same batches, same optimizer.
    tf.keras.utils.set_random_seed(1)
    reference = _model()
    reference.compile(OPTIMIZERS[optimizer](), "binary_crossentropy")
    initial = reference.get_weights()
    reference.fit(_dataset(), epochs=1, verbose=0, shuffle=False)

    with ps_strategy.scope():
        model = _model()
        model.compile(OPTIMIZERS[optimizer](), "binary_crossentropy")
    for var, value in zip(_variables(model), initial):
        var.assign(value)
    model.fit(
        tf.keras.utils.experimental.DatasetCreator(lambda ctx: _dataset()),
        epochs=1, steps_per_epoch=STEPS, verbose=0,
    )
    trained = reference.get_weights()
    assert not np.allclose(trained[0], initial[0]), "the reference did not train"
    for var, want in zip(_variables(model), trained):
        np.testing.assert_allclose(_dense(var), want, atol=1e-5)


@pytest.mark.parametrize("spec, shards", [("fixed:2", 2), ("per_ps", 2), ("max_ids:300", 4), ("min_size:1k", 2)])
def test_partitioner_specs_shard_the_table(local_cluster, spec, shards):
    strategy = tf_psx.ParameterServerStrategy(local_cluster, partitioner=spec)
    with strategy.scope():
        var = tf.Variable(tf.zeros([NUM_ROWS, DIM]))
    assert len(var.variables) == shards


def test_bad_partitioner_spec_is_rejected_before_connecting(local_cluster):
    with pytest.raises(ValueError, match=r"Partitioner spec must be one of fixed:N.*received 'fixed:zero'"):
        tf_psx.ParameterServerStrategy(local_cluster, partitioner="fixed:zero")


def test_cluster_argument_forms(local_cluster):
    for cluster in (local_cluster.config, local_cluster.resolver):
        strategy = tf_psx.ParameterServerStrategy(cluster)
        assert strategy.extended._num_ps == 2  # pylint: disable=protected-access
    with pytest.raises(TypeError, match="Argument `cluster_resolver` must be None"):
        tf_psx.ParameterServerStrategy(cluster=42)


@pytest.mark.unit
def test_cluster_without_ps_is_rejected():
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["127.0.0.1:1"]}), rpc_layer="grpc"
    )
    with pytest.raises(tf_psx.TFConfigError, match=r'at least one "ps" task'):
        tf_psx.ParameterServerStrategy(resolver)


@pytest.mark.unit
def test_evaluator_in_a_resolver_is_rejected():
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"], "evaluator": ["127.0.0.1:3"]}),
        rpc_layer="grpc",
    )
    with pytest.raises(tf_psx.TFConfigError, match="must not contain \"evaluator\".*46169"):
        tf_psx.ParameterServerStrategy(resolver)


def test_keras3_model_gets_a_clear_error(ps_strategy):
    import keras  # Keras 3, installed beside tf-keras by tensorflow 2.16

    k3_model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(tf_psx.Keras3Error, match=r"Keras 3 object.*import tf_keras as keras"):
        tf_psx.ParameterServerStrategy.check_model(k3_model)
    with ps_strategy.scope():
        k3_model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        k3_model.compile("sgd", "mse")
    with pytest.raises(tf_psx.Keras3Error, match=r"Keras 3 \(keras\.src.*called model\.fit.*tf-keras"):
        k3_model.fit(np.zeros((4, 2)), np.zeros((4, 1)), epochs=1, steps_per_epoch=1, verbose=0)
    tf_psx.ParameterServerStrategy.check_model(_model())  # tf-keras passes


@pytest.mark.unit
def test_tf_keras_is_routed_to_tf_keras():
    assert _tf_keras.tf_keras_is_legacy()
    assert tf.keras.layers.Dense.__module__.startswith("tf_keras")


# A user's script imports tensorflow first; TFRA (the first DynamicEmbedding)
# then runs `from tensorflow.keras.initializers import ...`. Before the fix
# that rebound `tf.keras` to Keras 3 mid-script, and the user's next
# `tf.keras.Model` failed ("All `inputs` values must be KerasTensors").
_TENSORFLOW_FIRST = """
import numpy as np
import tensorflow as tf
import tf_psx
before = tf.keras.Model
layer = tf_psx.layers.DynamicEmbedding(4, name="dyn")
assert tf.keras.Model is before and before.__module__.startswith("tf_keras"), tf.keras.Model
import tensorflow.keras.initializers as initializers
assert initializers.Zeros.__module__.startswith("tf_keras"), initializers.Zeros
inputs = tf.keras.Input((2,), dtype=tf.int64)
model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(layer(inputs))))
model.compile("adagrad", "mse")
model.fit(np.arange(16).reshape(8, 2), np.ones((8, 1)), epochs=1, verbose=0)
print("TRAINED", layer.size())
"""


@pytest.mark.processes
@pytest.mark.tfra
def test_tensorflow_imported_first_keeps_tf_keras_after_a_dynamic_embedding():
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    result = subprocess.run([sys.executable, "-c", _TENSORFLOW_FIRST], capture_output=True, text=True,
                            timeout=SCRIPT_TIMEOUT_S, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TRAINED 16" in result.stdout


@pytest.mark.unit
def test_auto_strategy_without_tf_config_is_default(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert tf_psx.auto_strategy() is tf.distribute.get_strategy()


def test_auto_strategy_with_ps_in_tf_config(local_cluster, caplog):
    strategy = tf_psx.auto_strategy({"cluster": local_cluster.config.as_dict()})
    assert isinstance(strategy, tf_psx.ParameterServerStrategy)
    assert "ps task(s): ParameterServerStrategy" in caplog.text


def test_strategy_in_a_worker_task_is_rejected(local_cluster):
    with pytest.raises(tf_psx.TFConfigError, match=r'task is "worker".*python -m tf_psx.server'):
        tf_psx.ParameterServerStrategy(local_cluster.config.tf_config("worker", 0))


@pytest.mark.processes
def test_central_storage_two_cpus_equals_one_device():
    # Runs in its own process: logical CPU devices must be configured before
    # TF initializes, and this process is already connected to a cluster.
    result = run_script("central_storage_equivalence.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "replicas=2 max_abs_diff=" in result.stdout


@pytest.mark.unit
def test_central_storage_rejects_empty_devices():
    with pytest.raises(ValueError, match=r"`compute_devices` must be a non-empty list"):
        tf_psx.CentralStorageStrategy(compute_devices=[])


def test_tf_signature_positional_and_keyword(local_cluster):
    """Code written for TF's class runs with only the class swapped."""
    resolver = local_cluster.resolver
    tf_params = list(__import__("inspect").signature(tf.distribute.ParameterServerStrategy.__init__).parameters)
    ours = list(__import__("inspect").signature(tf_psx.ParameterServerStrategy.__init__).parameters)
    assert ours[: len(tf_params)] == tf_params  # ['self', 'cluster_resolver', 'variable_partitioner']
    fixed = tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
    for strategy in (
        tf_psx.ParameterServerStrategy(resolver, variable_partitioner=None),
        tf_psx.ParameterServerStrategy(cluster_resolver=resolver),
        tf_psx.ParameterServerStrategy(resolver, None),
        tf_psx.ParameterServerStrategy(cluster_resolver=resolver, variable_partitioner=fixed),
        tf_psx.ParameterServerStrategy(resolver, "fixed:2"),
    ):
        with strategy.scope():
            var = tf.Variable(tf.zeros([10, 2]))
        sharded = isinstance(var, sharded_variable.ShardedVariable)
        # TF's meaning of None: no partitioning.
        assert sharded == (strategy.extended._variable_partitioner is not None)  # pylint: disable=protected-access
    with pytest.raises(TypeError, match=r"`cluster_resolver` and `cluster` name the same thing"):
        tf_psx.ParameterServerStrategy(resolver, cluster=resolver)
    with pytest.raises(TypeError, match=r"`variable_partitioner` and `partitioner` name the same thing"):
        tf_psx.ParameterServerStrategy(resolver, fixed, partitioner="fixed:2")
    with pytest.raises(TypeError, match=r"`exact_updates` must be True or False\. Received: 'yes'"):
        tf_psx.ParameterServerStrategy(resolver, exact_updates="yes")


def test_tf_tutorial_code_with_the_class_swapped(local_cluster):
    """The TF parameter-server tutorial's Keras path, with tf_psx's class."""
    variable_partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=(256 << 10), max_shards=2
    )
    strategy = tf_psx.ParameterServerStrategy(local_cluster.resolver, variable_partitioner=variable_partitioner)

    def dataset_fn(input_context):
        global_batch_size = 64
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        x = tf.random.uniform((10, 10))
        y = tf.random.uniform((10,))
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
        dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return dataset.batch(batch_size).prefetch(2)

    dc = tf.keras.utils.experimental.DatasetCreator(dataset_fn)
    with strategy.scope():
        model = tf.keras.models.Sequential([tf.keras.layers.Dense(10)])
    model.compile(tf.keras.optimizers.legacy.SGD(), loss="mse", steps_per_execution=10)
    history = model.fit(dc, epochs=2, steps_per_epoch=20, verbose=0)
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations.numpy()) == 40


@pytest.mark.unit
def test_unreachable_cluster_raises_in_time():
    from tf_psx.cluster.ports import free_ports  # pylint: disable=import-outside-toplevel

    worker, ps = free_ports(2)
    config = tf_psx.ClusterConfig(workers=[f"127.0.0.1:{worker}"], ps=[f"127.0.0.1:{ps}"])
    start = __import__("time").monotonic()
    with pytest.raises(
        tf_psx.ClusterUnreachableError,
        match=rf"No connection to worker:0 at 127\.0\.0\.1:{worker}, ps:0 at 127\.0\.0\.1:{ps} within 1 s\. Fix:",
    ):
        tf_psx.ParameterServerStrategy(config, connect_timeout_s=1)
    assert __import__("time").monotonic() - start < 10


def test_per_ps_partitioner_is_not_bound_in_place(local_cluster):
    partitioner = tf_psx.partitioners.PerPSPartitioner()
    strategy = tf_psx.ParameterServerStrategy(local_cluster, partitioner)
    assert partitioner.num_ps is None
    assert strategy.extended._variable_partitioner.num_ps == 2  # pylint: disable=protected-access


@pytest.mark.unit
def test_central_storage_tf_signature_and_usage():
    import inspect  # pylint: disable=import-outside-toplevel

    tf_params = inspect.signature(tf.distribute.experimental.CentralStorageStrategy.__init__).parameters
    ours = inspect.signature(tf_psx.CentralStorageStrategy.__init__).parameters
    assert [(n, p.default) for n, p in ours.items()] == [(n, p.default) for n, p in tf_params.items()]
    # TF's documented usage, the class swapped: positional and keyword forms.
    for strategy in (tf_psx.CentralStorageStrategy(["/cpu:0"], "/cpu:0"),
                     tf_psx.CentralStorageStrategy(compute_devices=None, parameter_device=None)):
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
            model.compile(tf.keras.optimizers.SGD(0.1), "mse")
        x = np.ones((32, 3), np.float32)
        history = model.fit(x, 3 * x[:, :1], epochs=2, batch_size=8, verbose=0)
        assert history.history["loss"][-1] < history.history["loss"][0]
