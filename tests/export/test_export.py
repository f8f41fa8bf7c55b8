"""export_serving: a model trained on the cluster serves in a fresh process with no cluster."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx import export as export_module
from tf_psx.layers import DynamicEmbedding, ShardedEmbedding

from conftest import run_script

pytestmark = pytest.mark.unit

FIELDS, DIM, BATCH, STEPS = 3, 4, 32, 6
PLAIN_ROWS, SHARDED_ROWS = 60, 40
# float32 predictions of the same graph on the same values: equal up to
# rounding of a different op order, far below this.
TOLERANCE = 1e-6


def _model():
    ids = {
        "plain": tf.keras.Input((FIELDS,), dtype=tf.int64, name="plain"),
        "sharded": tf.keras.Input((FIELDS,), dtype=tf.int64, name="sharded"),
        "dynamic": tf.keras.Input((FIELDS,), dtype=tf.int64, name="dynamic"),
        "words": tf.keras.Input((1,), dtype=tf.string, name="words"),
    }
    vectors = [
        tf.keras.layers.Embedding(PLAIN_ROWS, DIM, name="plain_emb")(ids["plain"]),
        ShardedEmbedding(SHARDED_ROWS, DIM, name="sharded_emb")(ids["sharded"]),
        DynamicEmbedding(DIM, name="dynamic_emb")(ids["dynamic"]),
        DynamicEmbedding(DIM, key_dtype=tf.string, name="words_emb")(ids["words"]),
    ]
    flat = [tf.keras.layers.Flatten()(v) for v in vectors]
    hidden = tf.keras.layers.Concatenate()(flat)
    click = tf.keras.layers.Dense(1, activation="sigmoid", name="click")(hidden)
    # The dynamic embedding as a second output, so the test can see unseen keys' rows.
    return tf.keras.Model(ids, {"click": click, "dynamic_vec": flat[2]})


def _data(seed: int, num: int):
    rng = np.random.default_rng(seed)
    words = np.array([[w] for w in rng.choice(["cat", "dog", "emu", "yak"], num)])
    x = {
        "plain": rng.integers(0, PLAIN_ROWS, (num, FIELDS)),
        "sharded": rng.integers(0, SHARDED_ROWS, (num, FIELDS)),
        # Large, sparse keys, as hashed categories are.
        "dynamic": 10**12 + rng.integers(0, 50, (num, FIELDS)) * 7919,
        "words": words,
    }
    y = ((x["plain"][:, 0] + x["sharded"][:, 0]) % 2).astype(np.float32).reshape(-1, 1)
    return x, y


@pytest.fixture(scope="module")
def trained(ps_strategy):
    with ps_strategy.scope():
        model = _model()
        model.compile(tf.keras.optimizers.Adagrad(0.2), loss={"click": "binary_crossentropy"})
    x, y = _data(0, BATCH * STEPS)

    def dataset_fn(_ctx):
        return tf.data.Dataset.from_tensor_slices((x, {"click": y})).batch(BATCH).repeat()

    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=STEPS, verbose=0)
    return model, x


def _serve_in_fresh_process(path, inputs, tmp_path):
    inputs_path, outputs_path = tmp_path / "inputs.npz", tmp_path / "outputs.npz"
    np.savez(inputs_path, **inputs)
    result = run_script("export_serve.py", str(path), str(inputs_path), str(outputs_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1].splitlines()[0])
    return dict(np.load(outputs_path)), report


UNSEEN = 4  # rows of the served batch whose dynamic keys were never trained


@pytest.fixture(scope="module")
def served(trained, tmp_path_factory):
    """Exports the trained model once and serves, in a fresh process, seen rows then unseen rows."""
    model, train_x = trained
    tmp_path = tmp_path_factory.mktemp("export")
    path = tf_psx.export_serving(model, tmp_path / "served")
    inputs = {key: value[:BATCH + UNSEEN].copy() for key, value in train_x.items()}
    inputs["dynamic"][BATCH:] = np.arange(UNSEEN * FIELDS).reshape(UNSEEN, FIELDS)  # never trained
    inputs["words"][BATCH:] = [["gnu"], ["owl"], ["cat"], ["dog"]]  # the first two never trained
    outputs, report = _serve_in_fresh_process(path, inputs, tmp_path)
    return path, tmp_path, inputs, outputs, report


@pytest.mark.cluster
@pytest.mark.smoke  # DynamicEmbedding on tf_psx's own tables here, on TFRA's on the TFRA stack
def test_trained_on_ps_serves_in_a_fresh_process_with_the_same_predictions(trained, served):
    model, train_x = trained
    path, tmp_path, inputs, outputs, report = served
    sharded = tf.__internal__.distribute.ShardedVariable
    # The premise: the cluster really split these tables.
    assert isinstance(model.get_layer("plain_emb").embeddings, sharded)
    assert model.get_layer("sharded_emb").num_shards() == 2
    assert isinstance(model.get_layer("click").kernel, sharded)
    assert path == os.fspath(tmp_path / "served")

    # Seen keys here; unseen ones in test_unseen_dynamic_keys_serve_zero_rows.
    seen = {key: value[:BATCH] for key, value in inputs.items()}
    expected = {key: value.numpy() for key, value in model(seen, training=False).items()}
    for key in ("click", "dynamic_vec"):
        np.testing.assert_allclose(outputs[key][:BATCH], expected[key], atol=TOLERANCE, rtol=0)
        np.testing.assert_array_equal(outputs[f"serve/{key}"], outputs[key])
    assert report["signatures"] == ["serving_default"]
    assert report["signature_inputs"] == ["dynamic", "plain", "sharded", "words"]
    assert report["modules"] == []  # served with TensorFlow alone: no tf_psx, no TFRA
    assert report["remote_devices"] == []
    shapes = {name.split(":")[0]: shape for name, shape in report["variables"]}
    # Whole tables, one variable each (a 2-shard table would be two halves).
    assert shapes["plain_emb/embeddings"] == [PLAIN_ROWS, DIM]
    assert shapes["sharded_emb/embeddings"] == [SHARDED_ROWS, DIM]
    # plain, sharded and dynamic: FIELDS rows of DIM each; words: one row.
    assert shapes["click/kernel"] == [3 * FIELDS * DIM + DIM, 1]
    assert not any("part_" in name for name in shapes), shapes
    trained_sizes = [model.get_layer(name).size() for name in ("dynamic_emb", "words_emb")]
    assert report["table_sizes"] == trained_sizes
    assert trained_sizes[0] == len(np.unique(train_x["dynamic"])) and trained_sizes[1] == 4


@pytest.mark.cluster
@pytest.mark.smoke
def test_unseen_dynamic_keys_serve_zero_rows(trained, served):
    model, _ = trained
    _, _, inputs, outputs, _ = served
    unseen = {key: value[BATCH:] for key, value in inputs.items()}
    np.testing.assert_array_equal(outputs["dynamic_vec"][BATCH:], np.zeros((UNSEEN, FIELDS * DIM), np.float32))
    # Evaluation and prediction of the trained model read the same default row
    # as the exported model, so all rows agree, unseen keys included.
    evaluated = model(unseen, training=False)
    np.testing.assert_array_equal(evaluated["dynamic_vec"].numpy(), outputs["dynamic_vec"][BATCH:])
    np.testing.assert_allclose(evaluated["click"].numpy(), outputs["click"][BATCH:], atol=TOLERANCE, rtol=0)
    predicted = model.predict(unseen, verbose=0)
    np.testing.assert_allclose(predicted["click"], outputs["click"][BATCH:], atol=TOLERANCE, rtol=0)

    # The click worked out by hand: the unseen rows are UNSEEN_KEY_DEFAULT (0).
    plain = model.get_layer("plain_emb").embeddings
    plain_table = np.concatenate([v.numpy() for v in plain.variables])
    sharded_table = model.get_layer("sharded_emb").lookup_table()
    words_rows = model.get_layer("words_emb")(tf.constant(unseen["words"])).numpy()
    words_rows[:2] = export_module.UNSEEN_KEY_DEFAULT  # "gnu", "owl" were never trained
    kernel = np.concatenate([v.numpy() for v in model.get_layer("click").kernel.variables])
    bias = model.get_layer("click").bias.numpy()
    features = np.concatenate([
        plain_table[unseen["plain"]].reshape(UNSEEN, -1),
        sharded_table[unseen["sharded"]].reshape(UNSEEN, -1),
        np.zeros((UNSEEN, FIELDS * DIM), np.float32),
        words_rows.reshape(UNSEEN, -1),
    ], axis=1)
    expected_click = 1.0 / (1.0 + np.exp(-(features @ kernel + bias)))
    np.testing.assert_allclose(outputs["click"][BATCH:], expected_click, atol=1e-5, rtol=0)


def _constant_model(value: float):
    """ids -> `value` for every row (a Dense of zero kernel and bias `value`)."""
    ids = tf.keras.Input((2,), dtype=tf.int64, name="ids")
    dense = tf.keras.layers.Dense(1, name="out", kernel_initializer="zeros",
                                  bias_initializer=tf.keras.initializers.Constant(value))
    return tf.keras.Model(ids, dense(tf.cast(ids, tf.float32)))


def _served_value(path) -> float:
    out = tf.saved_model.load(str(path)).signatures["serving_default"](ids=tf.constant([[1, 2]], tf.int64))
    return float(out["out"].numpy()[0, 0])


def _tree(path) -> dict:
    """{relative file path: bytes} of every file under `path`."""
    return {os.path.relpath(os.path.join(root, name), path): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(path) for name in names}


def test_overwrite_replaces_only_a_saved_model(tmp_path):
    path = tmp_path / "served"
    tf_psx.export_serving(_constant_model(1.0), path)
    with pytest.raises(FileExistsError, match=r"holds \d+ entries .*pass overwrite=True"):
        tf_psx.export_serving(_constant_model(2.0), path)
    assert _served_value(path) == 1.0
    tf_psx.export_serving(_constant_model(2.0), path, overwrite=True)
    assert _served_value(path) == 2.0
    # Written beside, renamed into place, the old one deleted: nothing else is left.
    assert sorted(os.listdir(tmp_path)) == ["served"]

    empty = tmp_path / "empty"
    empty.mkdir()
    tf_psx.export_serving(_constant_model(3.0), empty)  # an empty directory is replaced
    assert _served_value(empty) == 3.0

    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"'keep.txt'.*not a SavedModel, so overwrite=True will not delete it"):
        tf_psx.export_serving(_constant_model(4.0), other, overwrite=True)
    assert (other / "keep.txt").read_text() == "mine"


class _Forgetful(tf.keras.layers.Layer):
    """A layer whose get_config() leaves out `units`: its serving copy has other weights."""

    def __init__(self, units=1, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(name="kernel", shape=(input_shape[-1], self.units))

    def call(self, inputs):
        return tf.matmul(inputs, self.kernel)

    def get_config(self):
        config = super().get_config()
        config.pop("units", None)  # tf-keras records __init__ arguments itself
        return config


def _copy_fails(monkeypatch):
    ids = tf.keras.Input((2,), dtype=tf.int64, name="ids")
    return tf.keras.Model(ids, _Forgetful(units=2, name="out")(tf.cast(ids, tf.float32))), ValueError, \
        r"weight .*kernel.* of layer `out` has shape \(2, 2\) but its serving copy has \(2, 1\)"


def _save_fails_halfway(monkeypatch):
    def save(obj, export_dir, signatures=None, **kwargs):  # pylint: disable=unused-argument
        os.makedirs(os.path.join(export_dir, "variables"))
        with open(os.path.join(export_dir, "saved_model.pb"), "wb") as handle:
            handle.write(b"torn")  # what a crash in the middle of the write leaves
        raise OSError("No space left on device")

    monkeypatch.setattr(tf.saved_model, "save", save)
    return _constant_model(2.0), OSError, r"No space left on device"


@pytest.mark.parametrize("make_failure", [_copy_fails, _save_fails_halfway], ids=["copy-fails", "save-fails-halfway"])
def test_failed_overwrite_leaves_the_old_model_as_it_was(make_failure, tmp_path, monkeypatch):
    path = tmp_path / "served"
    tf_psx.export_serving(_constant_model(1.0), path)
    before = _tree(path)
    model, error, match = make_failure(monkeypatch)
    with pytest.raises(error, match=match):
        tf_psx.export_serving(model, path, overwrite=True)
    monkeypatch.undo()
    assert _tree(path) == before  # every file, byte for byte
    assert _served_value(path) == 1.0
    assert sorted(os.listdir(tmp_path)) == ["served"]  # the partial write is gone


class _Subclassed(tf.keras.Model):
    def call(self, inputs):
        return inputs


def _keras3_model():
    keras = pytest.importorskip("keras")
    if not keras.__version__.startswith("3"):
        pytest.skip("Keras 3 is not installed")
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])


@pytest.mark.parametrize("make, error, match", [
    (lambda: tf.keras.layers.Dense(1), TypeError, r"must be a tf-keras Model .*Received: .*Dense"),
    (lambda: "model.h5", TypeError, r"must be a tf-keras Model .*Received: 'model.h5' of type str"),
    (_Subclassed, ValueError, r"Functional or Sequential .*_Subclassed .*Fix: build it with the Functional API"),
    (lambda: tf.keras.Sequential([tf.keras.layers.Dense(1)]), ValueError, r"unbuilt model.*Input layer"),
    (_keras3_model, tf_psx.Keras3Error, r"Keras 3 object"),
], ids=["layer", "string", "subclassed", "unbuilt-sequential", "keras3"])
def test_bad_models_are_refused_with_the_fix(make, error, match, tmp_path):
    with pytest.raises(error, match=match):
        tf_psx.export_serving(make(), tmp_path / "served")
    assert not (tmp_path / "served").exists()


@pytest.mark.cluster
def test_bad_paths_and_scope_are_refused(ps_strategy, tmp_path):
    ids = tf.keras.Input((2,), dtype=tf.int64, name="ids")
    model = tf.keras.Model(ids, tf.keras.layers.Dense(1)(tf.cast(ids, tf.float32)))
    a_file = tmp_path / "model.bin"
    a_file.write_text("x")
    with pytest.raises(FileExistsError, match=r"which is a file\. Fix: choose another path"):
        tf_psx.export_serving(model, a_file)
    with pytest.raises(TypeError, match=r"`path` .*Received: 3"):
        tf_psx.export_serving(model, 3)
    with ps_strategy.scope():
        with pytest.raises(RuntimeError, match=r"outside `strategy.scope\(\)`.*Fix: call it after"):
            tf_psx.export_serving(model, tmp_path / "served")
    assert not (tmp_path / "served").exists()
