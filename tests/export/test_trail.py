"""The version trail of exports: manifest, verify, tf-psx export --verify, NAME/VERSION layout."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx import cli
from tf_psx import trail

pytestmark = pytest.mark.unit


def _model():
    ids = tf.keras.Input((2,), dtype=tf.int64, name="ids")
    vec = tf.keras.layers.Flatten()(tf_psx.layers.ShardedEmbedding(10, 3, name="emb")(ids))
    return tf.keras.Model(ids, tf.keras.layers.Dense(1, name="click")(vec))


def test_versions_manifest_and_verify(tmp_path, capsys):
    base = str(tmp_path / "ctr")
    model = _model()
    first = tf_psx.export_serving(model, f"{base}/{trail.next_version(base)}",
                                  metadata={"step": 1200, "metrics": {"auc": 0.71}, "data_position": {"rows": 5}})
    second = tf_psx.export_serving(model, f"{base}/{trail.next_version(base)}")
    assert (os.path.basename(first), os.path.basename(second)) == ("1", "2")
    manifest = trail.read_manifest(first)
    assert manifest["step"] == 1200 and manifest["metrics"] == {"auc": 0.71}
    assert manifest["versions"]["tensorflow"] == tf.__version__ and manifest["versions"]["tf_psx"] == tf_psx.__version__
    assert "saved_model.pb" in manifest["files"] and any(name.startswith("variables/") for name in manifest["files"])
    # TF writes a new graph each time (function names), so each export has its own hash.
    assert len(manifest["content_hash"]) == 64 and trail.read_manifest(second)["content_hash"] != manifest["content_hash"]
    assert trail.verify(first) == []
    assert cli.main(["export", "--verify", first]) == 0
    out = capsys.readouterr().out
    assert f"ok, content hash {manifest['content_hash']}" in out and '"step": 1200' in out
    # The served model still loads with the manifest in its directory.
    served = tf.saved_model.load(first)
    out = served.signatures["serving_default"](ids=tf.constant([[1, 2]], tf.int64))
    np.testing.assert_allclose(out["click"].numpy(), model(np.array([[1, 2]])).numpy(), atol=1e-6)


def test_verify_names_changed_missing_and_added_files(tmp_path, capsys):
    path = tf_psx.export_serving(_model(), str(tmp_path / "m"))
    data = [name for name in trail.read_manifest(path)["files"] if name.startswith("variables/variables.data")][0]
    with open(os.path.join(path, data), "r+b") as handle:
        handle.write(b"\x00\x01")
    os.remove(os.path.join(path, "saved_model.pb"))
    with open(os.path.join(path, "extra.txt"), "w") as handle:
        handle.write("x")
    # Sorted by file name.
    assert trail.verify(path) == ["not in the manifest: extra.txt", "missing: saved_model.pb", f"changed: {data}"]
    assert cli.main(["export", "--verify", path]) == 1
    assert "does not match its manifest" in capsys.readouterr().out
    manifest = json.loads(open(os.path.join(path, trail.MANIFEST_NAME)).read())
    manifest["files"]["saved_model.pb"] = "0" * 64
    with open(os.path.join(path, trail.MANIFEST_NAME), "w") as handle:
        json.dump(manifest, handle)
    assert "the manifest's content_hash does not match" in trail.verify(path)[0]


def test_verify_without_a_manifest_and_bad_metadata(tmp_path, capsys):
    os.makedirs(tmp_path / "plain")
    assert cli.main(["export", "--verify", str(tmp_path / "plain")]) == 2
    assert "Option `--verify`:" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"`metadata` must not set \['files'\]"):
        tf_psx.export_serving(_model(), str(tmp_path / "a"), metadata={"files": 1})
    with pytest.raises(ValueError, match=r"`metadata` must hold JSON values only.*Fix: convert numpy"):
        tf_psx.export_serving(_model(), str(tmp_path / "b"), metadata={"auc": object()})
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
