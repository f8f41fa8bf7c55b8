"""FeatureEmbeddings (many features, one table) and wire_dtype: equality with separate tables, errors, bytes."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx.layers import FeatureEmbeddings, ShardedEmbedding

pytestmark = pytest.mark.unit

FEATURES = {"C1": 50, "C2": 30, "C3": 7}
DIM = 4
BATCH = 16


def _data(steps: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = BATCH * steps
    x = {"C1": rng.integers(0, 50, size=(n,)), "C2": rng.integers(0, 30, size=(n, 3)),
         "C3": rng.integers(0, 7, size=(n,))}
    y = ((x["C1"] + x["C3"]) % 2).astype(np.float32)
    return {k: v.astype(np.int64) for k, v in x.items()}, y


def _inputs():
    return {"C1": tf.keras.Input((), dtype=tf.int64, name="C1"), "C2": tf.keras.Input((3,), dtype=tf.int64, name="C2"),
            "C3": tf.keras.Input((), dtype=tf.int64, name="C3")}


def _head(vectors: dict):
    flat = tf.keras.layers.Concatenate()([tf.keras.layers.Flatten()(vectors[name]) for name in FEATURES])
    dense = tf.keras.layers.Dense(1, activation="sigmoid", kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1))
    return dense(flat)


def _separate_model(**kwargs):
    inputs = _inputs()
    layers = {name: ShardedEmbedding(size, DIM, name=f"sep_{name}", **kwargs) for name, size in FEATURES.items()}
    return tf.keras.Model(inputs, _head({name: layers[name](inputs[name]) for name in FEATURES})), layers


def _fused_model(**kwargs):
    inputs = _inputs()
    layer = FeatureEmbeddings(FEATURES, DIM, name="fused", **kwargs)
    return tf.keras.Model(inputs, _head(layer(inputs))), layer


def _copy_rows(separate: dict, fused: FeatureEmbeddings) -> None:
    """Gives the fused table the separate tables' rows, in its own storage order."""
    full = np.zeros((fused.input_dim, DIM), np.float32)
    storage = tf_psx.layers.balanced_permutation
    for name, layer in separate.items():
        ids = np.arange(FEATURES[name]) + fused.offsets[name]
        full[storage(ids, fused.input_dim)] = layer.lookup_table()
    fused.set_weights([full])


# -- unit: arguments and errors -------------------------------------------------------


@pytest.mark.parametrize("features,match", [
    ({}, r"`features` of FeatureEmbeddings must be a non-empty dict"),
    ([("C1", 3)], r"`features` of FeatureEmbeddings must be a non-empty dict"),
    ({"C1": 0}, r"Argument `features\['C1'\]` of FeatureEmbeddings must be an int >= 1\. Received: 0"),
    ({1: 10}, r"must have str names\. Received the key 1"),
])
def test_bad_features(features, match):
    with pytest.raises(ValueError, match=match):
        FeatureEmbeddings(features, 4)


@pytest.mark.parametrize("wire", ["int8", tf.float32, "float64", "half-ish"])
def test_wire_dtype_must_be_a_half_float(wire):
    with pytest.raises(ValueError, match=r"`wire_dtype` of (ShardedEmbedding|FeatureEmbeddings) must be None, "
                                         r"\"bfloat16\" or \"float16\"\. Received: .*Fix"):
        ShardedEmbedding(10, 2, wire_dtype=wire)
    with pytest.raises(ValueError, match=r"`wire_dtype` of FeatureEmbeddings must be"):
        FeatureEmbeddings({"a": 3}, 2, wire_dtype=wire)


def test_missing_and_unexpected_features_are_listed():
    layer = FeatureEmbeddings(FEATURES, DIM)
    with pytest.raises(ValueError, match=r"Missing: \['C3'\]\. Unexpected: \['C9'\]\. Declared: \['C1', 'C2', 'C3'\]"):
        layer({"C1": tf.constant([1]), "C2": tf.constant([1]), "C9": tf.constant([1])})
    with pytest.raises(ValueError, match=r"takes a dict \{name: ids\}\. Received: EagerTensor"):
        layer(tf.constant([1, 2]))


def test_an_id_out_of_its_feature_range_names_the_feature():
    layer = FeatureEmbeddings(FEATURES, DIM)
    # 40 is a valid row of the fused table (C1's), never a silent read of it for C2.
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"ids of feature `C2` must be in \[0, 30\); received id 40\. Fix: hash or clip"):
        layer({"C1": tf.constant([1]), "C2": tf.constant([40]), "C3": tf.constant([0])})
    model, _ = _fused_model()
    model.compile("sgd", "binary_crossentropy")
    x, y = _data(1)
    x["C3"][3] = 7
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"ids of feature\] \[C3\] \[must be in \[0, size\); size, received id:\] \[7\] \[7\]"):
        model.fit(x, y, batch_size=BATCH, verbose=0)


def test_features_share_one_deduplicated_gather():
    layer = FeatureEmbeddings(FEATURES, DIM)
    specs = {"C1": tf.TensorSpec([None], tf.int64), "C2": tf.TensorSpec([None, 3], tf.int64),
             "C3": tf.TensorSpec([None], tf.int64)}
    graph = tf.function(layer).get_concrete_function(specs).graph
    gathers = [op for op in graph.get_operations() if op.type == "ResourceGather"]
    assert len(gathers) == 1
    assert sum(op.type == "Unique" for op in graph.get_operations()) == 1


def test_config_round_trip_and_feature_tables():
    layer = FeatureEmbeddings(FEATURES, DIM, wire_dtype="bfloat16", name="cfg")
    clone = FeatureEmbeddings.from_config(layer.get_config())
    assert clone.features == FEATURES and clone.wire_dtype == tf.bfloat16 and clone.input_dim == 87
    layer.build(None)
    tables = layer.feature_tables()
    assert {name: table.shape for name, table in tables.items()} == {"C1": (50, 4), "C2": (30, 4), "C3": (7, 4)}


# -- under the session cluster (1 worker, 2 ps, fixed:2) ----------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("optimizer", ["adagrad", "lazyadam"])
def test_fused_equals_separate_tables_after_training(ps_strategy, optimizer):
    make = {"adagrad": lambda: tf.keras.optimizers.Adagrad(0.3),
            "lazyadam": lambda: tf_psx.optimizers.LazyAdam(0.05)}[optimizer]
    with ps_strategy.scope():
        separate, tables = _separate_model()
        fused, layer = _fused_model()
    assert layer.num_shards() == 2
    _copy_rows(tables, layer)
    fused.layers[-1].set_weights(separate.layers[-1].get_weights())
    x, y = _data()
    for model in (separate, fused):
        with ps_strategy.scope():
            model.compile(make(), "binary_crossentropy")

        def dataset(_ctx=None):
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)

        model.fit(tf.keras.utils.experimental.DatasetCreator(dataset), epochs=1, steps_per_epoch=len(y) // BATCH,
                  verbose=0)
    for name, table in tables.items():
        np.testing.assert_allclose(layer.feature_table(name), table.lookup_table(), atol=1e-5)
    probe = {k: v[:BATCH] for k, v in x.items()}
    np.testing.assert_allclose(fused.predict(probe, verbose=0), separate.predict(probe, verbose=0), atol=1e-5)


@pytest.mark.cluster
def test_wire_dtype_halves_the_value_bytes_and_trains_close_to_float32(ps_strategy):
    with ps_strategy.scope():
        exact, exact_layer = _fused_model()
        narrow, narrow_layer = _fused_model(wire_dtype="bfloat16")
    narrow_layer.set_weights(exact_layer.get_weights())
    narrow.layers[-1].set_weights(exact.layers[-1].get_weights())
    x, y = _data()
    for model in (exact, narrow):
        with ps_strategy.scope():
            model.compile(tf.keras.optimizers.Adagrad(0.3), "binary_crossentropy")

        def dataset(_ctx=None):
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)

        model.fit(tf.keras.utils.experimental.DatasetCreator(dataset), epochs=1, steps_per_epoch=len(y) // BATCH,
                  verbose=0)
    # The table and its slots stay float32 on the ps; the rows moved as bfloat16.
    assert all(v.dtype == tf.float32 for v in narrow_layer.embeddings.variables)
    assert narrow_layer.embeddings.variables[0].device != narrow_layer.embeddings.variables[1].device
    a, b = exact_layer.feature_table("C1"), narrow_layer.feature_table("C1")
    assert 0 < np.abs(a - b).max() < 2e-2  # bfloat16 keeps 8 bits: close, not equal
    # The casts of the rows sit on the ps tasks.
    specs = {"C1": tf.TensorSpec([None], tf.int64), "C2": tf.TensorSpec([None, 3], tf.int64),
             "C3": tf.TensorSpec([None], tf.int64)}
    with ps_strategy.scope():
        graph = tf.function(narrow_layer).get_concrete_function(specs).graph
    casts = [op for op in graph.get_operations() if op.type == "Cast" and op.get_attr("DstT") == tf.bfloat16]
    assert len(casts) == 2 and all("/job:ps/" in op.device for op in casts), [op.device for op in casts]


# -- DynamicFeatureEmbeddings: many features in one hash table ---------------------------


@pytest.mark.parametrize("features,match", [
    ("user", r"`features` of DynamicFeatureEmbeddings must be a non-empty list"),
    ([], r"`features` of DynamicFeatureEmbeddings must be a non-empty list"),
    (["a", "a"], r"at most 127 distinct str names\. Received: \['a', 'a'\]"),
    ([f"f{i}" for i in range(128)], r"at most 127 distinct str names"),
])
def test_dynamic_features_bad_arguments(features, match):
    with pytest.raises(ValueError, match=match):
        tf_psx.layers.DynamicFeatureEmbeddings(features, 4)


@pytest.mark.tfra
def test_dynamic_features_fold_into_disjoint_key_ranges():
    layer = tf_psx.layers.DynamicFeatureEmbeddings(["user", "item"], 2, initializer="zeros", name="fold")
    with pytest.raises(ValueError, match=r"Missing: \['item'\]\. Unexpected: \[\]"):
        layer({"user": tf.constant([1], tf.int64)})
    keys, _ = tf_psx.layers.fold_feature_keys({"user": tf.constant([5, -1], tf.int64), "item": tf.constant([5])},
                                              ["user", "item"], tf.int64)
    # The same key in two features is two keys; a negative key keeps its low 56 bits.
    assert keys.numpy().tolist() == [5, 2**56 - 1, (1 << 56) + 5]


def _dynamic_models(strategy):
    names = ["user", "item"]
    with strategy.scope():
        inputs = {name: tf.keras.Input((2,), dtype=tf.int64, name=name) for name in names}
        separate = {name: tf_psx.layers.DynamicEmbedding(DIM, initializer="zeros", name=f"dyn_{name}") for name in names}
        fused = tf_psx.layers.DynamicFeatureEmbeddings(names, DIM, initializer="zeros", name="dyn_fused")

        def head(vectors):
            flat = tf.keras.layers.Concatenate()([tf.keras.layers.Flatten()(vectors[name]) for name in names])
            return tf.keras.layers.Dense(1, activation="sigmoid", kernel_initializer="ones")(flat)

        models = (tf.keras.Model(inputs, head({name: separate[name](inputs[name]) for name in names})),
                  tf.keras.Model(inputs, head(fused(inputs))))
        for model in models:
            model.compile(tf.keras.optimizers.Adagrad(0.2), "binary_crossentropy")
    return models, separate, fused


@pytest.mark.cluster
@pytest.mark.tfra
def test_dynamic_features_equal_separate_tables_and_export(ps_strategy, tmp_path):
    (separate_model, fused_model), separate, fused = _dynamic_models(ps_strategy)
    rng = np.random.default_rng(3)
    x = {"user": rng.integers(0, 10**12, (64, 2)), "item": rng.integers(0, 20, (64, 2))}
    x["item"][:, 1] = x["user"][:, 0] % 20  # keys shared by both features
    y = (x["item"][:, 0] % 2).astype(np.float32)
    for model in (separate_model, fused_model):
        def dataset(_ctx=None):
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)

        model.fit(tf.keras.utils.experimental.DatasetCreator(dataset), epochs=1, steps_per_epoch=4, verbose=0)
    assert fused.size() == separate["user"].size() + separate["item"].size()
    for index, name in enumerate(["user", "item"]):
        keys = np.unique(x[name])
        folded = (keys & (2**56 - 1)) | (index << 56)
        np.testing.assert_allclose(fused.table.lookup(tf.constant(folded)).numpy(),
                                   separate[name].table.lookup(tf.constant(keys)).numpy(), atol=1e-6)
    probe = {k: v[:8] for k, v in x.items()}
    expected = separate_model.predict(probe, verbose=0)
    np.testing.assert_allclose(fused_model.predict(probe, verbose=0), expected, atol=1e-6)
    served = tf.saved_model.load(tf_psx.export_serving(fused_model, str(tmp_path / "served")))
    (out,) = served.serve({k: tf.constant(v) for k, v in probe.items()}).values()
    np.testing.assert_allclose(out.numpy().reshape(-1, 1), expected, atol=1e-6)


def test_redaction_keeps_the_id_out_of_the_range_error():
    from tf_psx import redaction  # pylint: disable=import-outside-toplevel

    layer = FeatureEmbeddings(FEATURES, DIM)
    with redaction.redacted():
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"ids of feature `C2` must be in \[0, 30\); received id <redacted>\. Fix: hash") as eager:
            layer({"C1": tf.constant([1]), "C2": tf.constant([40]), "C3": tf.constant([0])})
        traced = tf.function(layer)  # traced inside the block: the graph's message is redacted too
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"received id:\] \[30\] \[<redacted>\] \[Fix") as graph:
            traced({"C1": tf.constant([1]), "C2": tf.constant([40]), "C3": tf.constant([0])})
    assert "40" not in str(eager.value) and "[40]" not in str(graph.value)


@pytest.mark.cluster
@pytest.mark.parametrize("filename", ["model.keras", "model.h5", "saved_model"])
def test_a_cluster_model_saved_in_every_keras_format_loads_without_custom_objects(ps_strategy, tmp_path, filename):
    # The layers are registered ("tf_psx>FeatureEmbeddings"): before, load_model
    # failed with "Unknown layer" (.h5) or "'str' object is not callable" (.keras).
    with ps_strategy.scope():
        model, layer = _fused_model(wire_dtype="bfloat16")
        model.compile(tf.keras.optimizers.Adagrad(0.3), "binary_crossentropy")
    x, y = _data()
    model.fit(tf.keras.utils.experimental.DatasetCreator(
        lambda _ctx: tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH)), epochs=1, steps_per_epoch=4,
        verbose=0)
    assert layer.num_shards() == 2
    probe = {k: v[:BATCH] for k, v in x.items()}
    expected = model.predict(probe, verbose=0)
    model.save(str(tmp_path / filename))
    loaded = tf.keras.models.load_model(str(tmp_path / filename))  # no strategy, no custom_objects
    fused = loaded.get_layer("fused")
    assert type(fused) is FeatureEmbeddings and fused.features == FEATURES and fused.wire_dtype == tf.bfloat16
    np.testing.assert_allclose(loaded.predict(probe, verbose=0), expected, atol=1e-6)
    for name in FEATURES:
        np.testing.assert_array_equal(fused.feature_table(name), layer.feature_table(name))
    if filename == "saved_model":
        return  # tf-keras 2.16 loads a SavedModel with a fresh optimizer (a local model's too)
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 4
    # The optimizer's state comes back whole too (Adagrad's accumulators of the sharded table and kernel).
    saved_state = sorted((v.numpy() for v in model.optimizer.variables), key=np.size)
    loaded_state = sorted((v.numpy() for v in loaded.optimizer.variables), key=np.size)
    assert [v.shape for v in loaded_state] == [v.shape for v in saved_state]
    for loaded_value, saved_value in zip(loaded_state, saved_state):
        np.testing.assert_array_equal(loaded_value, saved_value)
