"""Every private TF / tf-keras / TFRA hook of `tf_psx._tf` is where it was read (TF 2.16.2, tf-keras 2.16, TFRA 0.8.1).

One test per door module: an upgrade that moves a hook fails here, by name,
instead of somewhere deep in a training run.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import tensorflow as tf

from tf_psx._tf import keras as _tf_keras, runtime as _runtime, tfra as _tfra

pytestmark = pytest.mark.unit


def test_keras_routing():
    assert _tf_keras.tf_keras_is_legacy()
    assert tf.keras.Model is _tf_keras.keras().Model  # tf.keras is tf-keras


@pytest.mark.cluster
def test_runtime_hooks(ps_strategy):
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel

    assert hasattr(context.context(), "_context_handle") and hasattr(context.context(), "_server_def")
    assert _runtime.connected_to_cluster()
    assert _runtime.num_ps(ps_strategy) == 2  # extended._num_ps
    coordinator = _runtime.coordinator_of(ps_strategy)
    assert coordinator is _runtime.coordinator_of(ps_strategy)  # one per strategy
    assert hasattr(coordinator._cluster.closure_queue, "put_back")  # pylint: disable=protected-access
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    assert model in _runtime.flatten_layers(model)


def test_fit_hooks():
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    assert hasattr(model, "_training_state") and hasattr(model, "make_train_function")
    assert "_distributed_apply_gradients_fn" in type(model.optimizer).__mro__[1].__dict__


@pytest.mark.tfra
def test_tfra_and_shadow_hooks():
    de = _tfra.tfra()
    assert hasattr(de, "DynamicEmbeddingOptimizer") and hasattr(de, "Variable")
    from tensorflow_recommenders_addons.dynamic_embedding.python.ops import (  # pylint: disable=import-outside-toplevel
        shadow_embedding_ops,
    )
    from tensorflow.python.distribute import ps_values  # pylint: disable=import-outside-toplevel
    from tensorflow.python.distribute.coordinator import (  # pylint: disable=import-outside-toplevel
        cluster_coordinator,
        coordinator_context,
    )

    assert hasattr(shadow_embedding_ops, "ShadowVariable") and hasattr(shadow_embedding_ops, "DEResourceVariable")
    assert hasattr(cluster_coordinator.ClusterCoordinator, "_create_per_worker_resources")
    assert hasattr(coordinator_context, "get_current_dispatch_context")
    assert hasattr(ps_values, "PerWorkerVariableSpec")


def test_weights_checkpoint_and_auto_deps_hooks():
    from tensorflow.python.framework import auto_control_deps  # pylint: disable=import-outside-toplevel

    from tf_psx._tf import checkpoint, weights  # pylint: disable=import-outside-toplevel

    shards = [tf.Variable(tf.zeros([2, 2])), tf.Variable(tf.zeros([2, 2]))]
    sharded = tf.__internal__.distribute.ShardedVariable(shards)
    assert weights.sharded_container(shards[0]) is sharded  # the shard's _sharded_container
    assert callable(auto_control_deps.op_is_stateful)
    variable = tf.Variable(1.0)
    prefix = tf.train.Checkpoint(v=variable).write(os.path.join(tempfile.mkdtemp(), "ckpt"))
    status = tf.train.Checkpoint(v=variable).read(prefix)
    assert id(variable) in checkpoint.restored_ids(status)


def test_data_hook():
    from tf_psx._tf import data  # pylint: disable=import-outside-toplevel

    dataset = tf.data.Dataset.range(5).map(lambda x: x * 2)
    assert [int(x) for x in data.dataset_without_python_functions(dataset)] == [0, 2, 4, 6, 8]


@pytest.mark.smoke
def test_version_differences_hold_on_this_stack():
    # tf_psx._tf.versions, on the stack this runs on (CI runs the smoke tests on both).
    from tf_psx._tf import versions  # pylint: disable=import-outside-toplevel

    assert versions.xplane_pb2().XSpace() is not None  # the profiler proto, wherever this TF keeps it

    def tensor_loop(n):
        total = tf.constant(0, tf.int64)
        for i in tf.range(n):  # needs AutoGraph: a Python loop over a tensor
            total += i
        return total

    tensor_loop.__module__ = "tf_keras"  # a tf-keras function: allowlisted by TF 2.21's AutoGraph rules
    call_converted = versions.autograph_artifact(versions.call_converted)

    @tf.function
    def outer(n):
        return call_converted(tensor_loop, n)

    assert int(outer(tf.constant(4, tf.int64))) == 6

    def plain(n):
        return n

    assert versions.step_converted(plain) is plain  # a function AutoGraph converts anyway is left as it is
