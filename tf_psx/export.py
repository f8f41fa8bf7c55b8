"""Export a model trained on the cluster as a SavedModel that serves without it.

A model trained under `tf_psx.ParameterServerStrategy` keeps its variables on
the ps tasks, split into `ShardedVariable`s, and its `DynamicEmbedding` tables
in TFRA hash tables. What happens when it is saved as it is, measured with TF
2.16.2, tf-keras 2.16 and TFRA 0.8.1 (a 1-worker, 2-ps cluster):

* `tf.saved_model.save(model, path)` of a model with ShardedVariables but no
  TFRA table loads in a plain process and predicts the same (the public
  reports that it does not load are about older TF releases);
* with a DynamicEmbedding, both `tf.saved_model.save` and `model.save` write
  a graph that holds TFRA's custom ops, and loading it in a process without
  TFRA fails with "Op type not registered 'TFRA>DynamicPartition'" (or
  'TFRA>CuckooHashTableImport'); with TFRA loaded, the tables' devices name
  the ps tasks of the training cluster.

`export_serving` writes instead a copy made for serving:

* every variable is one plain, unsharded variable on the local CPU (the
  shards are read from the ps tasks and concatenated);
* every `DynamicEmbedding` becomes a core-TF `MutableHashTable` holding
  exactly the keys the trained table holds, with their rows;
* the graph uses core TensorFlow ops only: the serving process needs neither
  tf_psx nor tensorflow-recommenders-addons, and no cluster.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import numpy as np
import tensorflow as tf

from tf_psx import layers as _layers
from tf_psx._tf import keras as _tf_keras, runtime as _runtime
from tf_psx.errors import ArgumentError, ArgumentTypeError, PathExistsError, StateError
from tf_psx import trail as _trail

__all__ = ["export_serving", "UNSEEN_KEY_DEFAULT", "SERVING_SIGNATURE"]

logger = logging.getLogger("tf_psx")

_keras = _tf_keras.keras()

# The key under which TF Serving, `saved_model_cli` and `loaded.signatures`
# look for the default signature.
SERVING_SIGNATURE = tf.saved_model.DEFAULT_SERVING_SIGNATURE_DEF_KEY
# What a key never trained returns when served: the same row as
# DynamicEmbedding returns for it in evaluate and predict.
UNSEEN_KEY_DEFAULT = _layers.UNSEEN_KEY_DEFAULT
# The file that marks a directory as a SavedModel (the only kind of directory
# `overwrite=True` is allowed to replace).
_SAVED_MODEL_FILE = "saved_model.pb"
# The export is written to `<parent>/.<name><_WRITING>-<id>` and renamed to
# `path` once complete; a model it replaces is first renamed to
# `<parent>/.<name><_REPLACED>-<id>`, and deleted last. Hidden names in the
# same parent: a rename within one filesystem, never seen as a model.
_WRITING = ".tmp-export"
_REPLACED = ".old-export"


class _ServingDynamicEmbedding(_keras.layers.Layer):
    """A DynamicEmbedding frozen for serving: a core-TF hash table, no TFRA.

    Keys are hashed (string keys) or cast exactly as `DynamicEmbedding.call`
    does; keys missing from the table return `UNSEEN_KEY_DEFAULT` rows.
    """

    def __init__(self, output_dim: int, key_dtype: tf.DType, name: str | None = None, features=None):
        super().__init__(name=name, trainable=False)
        self.output_dim = int(output_dim)
        self.key_dtype = tf.as_dtype(key_dtype)
        # A DynamicFeatureEmbeddings: a dict of features folded into one table's keys.
        self.features = list(features) if features else None
        self.table = tf.lookup.experimental.MutableHashTable(
            key_dtype=tf.int64,
            value_dtype=tf.float32,
            default_value=tf.fill([self.output_dim], UNSEEN_KEY_DEFAULT),
            name=f"{name}_serving_table" if name else None,
        )

    def call(self, inputs):
        from tf_psx import layers  # pylint: disable=import-outside-toplevel

        if self.features is not None:
            layers.check_feature_dict("DynamicFeatureEmbeddings", self.name, inputs, self.features)
            keys, sizes = layers.fold_feature_keys(inputs, self.features, self.key_dtype)
            rows = self.table.lookup(keys)
            return layers.split_feature_rows(rows, inputs, self.features, sizes, self.output_dim)
        keys = layers.table_keys(inputs, self.key_dtype)
        rows = self.table.lookup(tf.reshape(keys, [-1]))
        return tf.reshape(rows, tf.concat([tf.shape(keys), [self.output_dim]], axis=0))


class _ServingModule(tf.Module):
    """The root object of the SavedModel: the variables, the tables and `serve`.

    Only these are saved, not the Keras model object: saving a Keras model
    also traces every layer's call (slow), and loading needs none of it.
    """

    def __init__(self, model, input_signature, output_names):
        super().__init__(name="tf_psx_serving")
        self._model = model
        self.model_variables = list(model.variables)
        self.tables = [layer.table for layer in _runtime.flatten_layers(model) if isinstance(layer, _ServingDynamicEmbedding)]
        self._output_names = list(output_names)
        self.serve = tf.function(self._serve, input_signature=[input_signature])

    def _serve(self, inputs):
        outputs = self._model(inputs, training=False)
        if isinstance(outputs, dict):
            return dict(outputs)
        flat = tf.nest.flatten(outputs)
        return dict(zip(self._output_names, flat))


def _check_model(model) -> None:
    _tf_keras.check_not_keras3(model, "model passed to export_serving")
    if not isinstance(model, _keras.Model):
        raise ArgumentTypeError(
            "Argument `model` of export_serving must be a tf-keras Model (tf.keras.Model after "
            f"`import tf_psx`). Received: {model!r} of type {type(model).__name__}."
        )
    if not getattr(model, "_is_graph_network", False):
        raise ArgumentError(
            "Argument `model` of export_serving must be a Functional or Sequential tf-keras model "
            f"with known inputs; received {type(model).__name__} `{model.name}`, a subclassed or "
            "unbuilt model. Fix: build it with the Functional API (tf.keras.Model(inputs, outputs)) "
            "or give the Sequential model an Input layer."
        )


def _check_path(path: str, overwrite: bool) -> tuple[str, bool]:
    """Returns (`path` as a str, whether it holds a SavedModel to replace); deletes nothing."""
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"Argument `path` of export_serving must be a str or os.PathLike directory path. Received: {path!r}.")
    path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise ArgumentError(f"Argument `path` of export_serving must be a non-empty directory path. Received: {path!r}.")
    if not tf.io.gfile.exists(path):
        return path, False
    if not tf.io.gfile.isdir(path):
        raise PathExistsError(
            f"Argument `path` of export_serving must be a directory that does not exist yet or is empty; "
            f"received {path!r}, which is a file. Fix: choose another path."
        )
    contents = tf.io.gfile.listdir(path)
    if not contents:
        return path, False
    if overwrite and _SAVED_MODEL_FILE in contents:
        return path, True
    hint = (
        "pass overwrite=True to replace it" if _SAVED_MODEL_FILE in contents
        else "it is not a SavedModel, so overwrite=True will not delete it; choose another path"
    )
    raise PathExistsError(
        f"Argument `path` of export_serving must be a directory that does not exist yet or is empty; "
        f"received {path!r}, which holds {len(contents)} entries (e.g. {sorted(contents)[0]!r}). "
        f"Fix: {hint}."
    )


def _beside(path: str, kind: str) -> str:
    """A new hidden path in the directory that holds `path`."""
    parent, name = os.path.split(path.rstrip("/"))
    return os.path.join(parent, f".{name}{kind}-{uuid.uuid4().hex[:8]}")


def _commit(written: str, path: str, replace: bool) -> None:
    """Moves the complete export `written` to `path`.

    A SavedModel already at `path` (`replace`) is renamed aside first and
    deleted only once the new one is in place; if the second rename fails it
    is renamed back. On a local or POSIX filesystem both are atomic renames:
    `path` holds the old model or the new one, never part of either (between
    the two renames it is briefly absent).
    """
    if not replace:
        # `path` is absent or an empty directory, which a rename replaces.
        tf.io.gfile.rename(written, path, overwrite=tf.io.gfile.exists(path))
        return
    old = _beside(path, _REPLACED)
    tf.io.gfile.rename(path, old)
    try:
        tf.io.gfile.rename(written, path)
    except (tf.errors.OpError, OSError):
        tf.io.gfile.rename(old, path)
        raise
    _remove(old, "the replaced model")


def _remove(path: str, what: str) -> None:
    """Deletes a directory tree; a failure is logged with its cause (the export itself is done or failed already)."""
    try:
        tf.io.gfile.rmtree(path)
    except (tf.errors.OpError, OSError) as error:
        logger.warning("export_serving: could not delete %s (%s): %s. Delete it by hand.", path, what, error)


def _clone_layer(layer):
    from tf_psx.layers import DynamicEmbedding  # pylint: disable=import-outside-toplevel

    if isinstance(layer, DynamicEmbedding):
        return _ServingDynamicEmbedding(layer.output_dim, layer.key_dtype, name=layer.name,
                                        features=getattr(layer, "features", None))
    if isinstance(layer, _keras.Model) and getattr(layer, "_is_graph_network", False):
        return _keras.models.clone_model(layer, clone_function=_clone_layer)
    return layer.__class__.from_config(layer.get_config())


def _sharded_owners(model) -> dict[int, Any]:
    """Maps id(shard) -> its ShardedVariable, for every ShardedVariable in `model`."""
    sharded_class = tf.__internal__.distribute.ShardedVariable
    owners = {}
    for obj in tf.train.TrackableView(model).descendants():
        if isinstance(obj, sharded_class):
            for shard in obj.variables:
                owners[id(shard)] = obj
    return owners


def _logical_weights(layer, owners: dict[int, Any]) -> list:
    """`layer.weights`, with the shards of each ShardedVariable replaced by the whole."""
    result, seen = [], set()
    for weight in layer.weights:
        owner = owners.get(id(weight))
        if owner is None:
            result.append(weight)
        elif id(owner) not in seen:
            seen.add(id(owner))
            result.append(owner)
    return result


def _value(variable) -> np.ndarray:
    """The whole value of a variable; a ShardedVariable's shards are concatenated (axis 0)."""
    shards = getattr(variable, "variables", None)
    if shards is not None and isinstance(variable, tf.__internal__.distribute.ShardedVariable):
        return np.concatenate([shard.numpy() for shard in shards], axis=0)
    return variable.numpy()


def _copy_weights(source, target, owners: dict[int, Any]) -> int:
    """Copies trained values from `source` layers into their serving clones; returns rows exported."""
    from tf_psx.layers import DynamicEmbedding  # pylint: disable=import-outside-toplevel

    exported_keys = 0
    for src, dst in zip(source.layers, target.layers):
        if isinstance(src, DynamicEmbedding):
            keys, values = src.export()  # the rows a lookup reads, either store (TFRA's or tf_psx's own)
            dst.table.insert(tf.constant(keys, tf.int64), tf.constant(values, tf.float32))
            exported_keys += int(keys.shape[0])
            continue
        if isinstance(src, _keras.Model) and isinstance(dst, _keras.Model) and getattr(src, "_is_graph_network", False):
            exported_keys += _copy_weights(src, dst, owners)
            continue
        src_weights, dst_weights = _logical_weights(src, owners), dst.weights
        if len(src_weights) != len(dst_weights):
            raise ArgumentError(
                f"export_serving: layer `{src.name}` has {len(src_weights)} weights but its serving copy "
                f"has {len(dst_weights)}. Its get_config() does not rebuild the same layer. Fix: make "
                "get_config()/from_config() round-trip the layer's constructor arguments."
            )
        for src_w, dst_w in zip(src_weights, dst_weights):
            value = _value(src_w)
            if tuple(value.shape) != tuple(dst_w.shape):
                raise ArgumentError(
                    f"export_serving: weight `{src_w.name}` of layer `{src.name}` has shape {value.shape} "
                    f"but its serving copy has {tuple(dst_w.shape)}. Fix: make get_config()/from_config() "
                    "round-trip the layer's constructor arguments."
                )
            dst_w.assign(value)
    return exported_keys


def _input_signature(model):
    def spec(tensor):
        return tf.TensorSpec(tensor.shape, tensor.dtype, name=tensor.name.split(":")[0])

    structure = model.input
    if isinstance(structure, dict):
        return {key: tf.TensorSpec(t.shape, t.dtype, name=key) for key, t in structure.items()}
    return tf.nest.map_structure(spec, structure)


def export_serving(model, path: str, *, overwrite: bool = False, metadata: dict | None = None) -> str:
    """Writes `model` as a SavedModel that serves in a plain process, with no cluster.

    Every variable is written whole (the shards of a `ShardedVariable` are
    concatenated), and each `tf_psx.layers.DynamicEmbedding` table is written
    as a core-TF hash table holding exactly the keys it learned. The graph
    uses core TensorFlow ops only; load it with `tf.saved_model.load` in any
    TensorFlow 2.16 process (tf_psx and TFRA need not be installed).

    The `serving_default` signature takes the model's inputs as named tensors
    (the keys of a dict input, otherwise the Input layers' names) and returns
    a dict of the model's outputs, keyed by output name. The loaded object's
    `serve(inputs)` takes the same structure as the model itself.

    Keys that a DynamicEmbedding never saw in training get rows of
    `UNSEEN_KEY_DEFAULT` (zeros) when served.

    Example:

    >>> import tempfile, tf_psx, tensorflow as tf
    >>> ids = tf.keras.Input((2,), dtype=tf.int64, name="ids")
    >>> vec = tf.keras.layers.Flatten()(tf_psx.layers.ShardedEmbedding(10, 3)(ids))
    >>> model = tf.keras.Model(ids, tf.keras.layers.Dense(1, name="click")(vec))
    >>> path = tf_psx.export_serving(model, tempfile.mkdtemp() + "/served")
    >>> loaded = tf.saved_model.load(path)
    >>> out = loaded.signatures["serving_default"](ids=tf.constant([[1, 2]], tf.int64))
    >>> sorted(out), out["click"].shape
    (['click'], TensorShape([1, 1]))

    Args:
      model: a Functional or Sequential tf-keras model, trained under any
        strategy (or none). It is not changed.
      path: the directory to write; it must not exist or be empty (local or
        any `tf.io.gfile` path such as gs://).
      overwrite: replace `path` when it already holds a SavedModel. The new
        model is written beside it first; the old one is deleted only once
        the new one is complete and renamed into place, so an export that
        fails leaves the old model as it was.
      metadata: JSON facts for the version trail (`tf_psx.trail`): e.g.
        `{"step": sync.restored.step, "metrics": {"auc": 0.79}}`. Every
        export writes `tf_psx_manifest.json` into `path`: these facts, the
        package versions, the SHA-256 of each file and a content hash;
        `tf-psx export --verify PATH` checks it. For TF Serving's
        `NAME/VERSION/` layout, export to
        `f"{base}/{tf_psx.trail.next_version(base)}"`.

    Returns:
      `path`.

    Raises:
      TypeError: `model` is not a tf-keras model (a Keras 3 model raises
        `tf_psx.Keras3Error`, a subclass).
      ValueError: `model` is subclassed or unbuilt, or a layer's config does
        not rebuild the same weights; `metadata` is not a dict of JSON values.
      FileExistsError: `path` is a file or a non-empty directory.
      RuntimeError: called inside a `strategy.scope()`.

    Known limitations:
      * Functional and Sequential models only (the model is rebuilt from its
        config to get plain variables): a subclassed model raises ValueError.
      * A DynamicEmbedding must be a layer of the model (or of a nested
        Functional model), not a sublayer inside a custom layer.
      * The whole model is copied into this process's memory on the way:
        a table of N rows of dim D needs N * D * 4 bytes here.
      * Optimizer state is not exported; for resuming training use
        checkpoints.
      * The write-then-rename is atomic on local and POSIX filesystems; on
        object stores (gs://) a rename is a copy, so a reader may see a
        partial model while it runs (the old model is still deleted only
        after the new one is complete).
    """
    _check_model(model)
    if tf.distribute.has_strategy():
        raise StateError(
            "export_serving must be called outside `strategy.scope()`: the serving copy must be built "
            "with plain local variables, not the strategy's. Fix: call it after the `with "
            "strategy.scope():` block (after model.fit)."
        )
    path, replace = _check_path(path, overwrite)
    metadata = _trail.check_metadata(metadata)
    owners = _sharded_owners(model)
    # Built on this process's CPU, whatever the cluster: the copy is what is
    # saved, and a saved device must exist wherever the model is loaded.
    with tf.device("/device:CPU:0"):
        serving = _keras.models.clone_model(model, clone_function=_clone_layer)
    from tf_psx.layers import DynamicEmbedding  # pylint: disable=import-outside-toplevel

    nested = [layer.name for layer in _runtime.flatten_layers(serving) if isinstance(layer, DynamicEmbedding)]
    if nested:
        raise ArgumentError(
            f"export_serving: DynamicEmbedding layer(s) {nested} sit inside a custom layer, where they "
            "cannot be replaced by a serving table. Fix: use the DynamicEmbedding as a layer of the "
            "Functional model itself."
        )
    with tf.device("/device:CPU:0"):
        exported_keys = _copy_weights(model, serving, owners)
        module = _ServingModule(serving, _input_signature(model), model.output_names)
        unsharded = sum(isinstance(w, tf.__internal__.distribute.ShardedVariable) for w in _logical_weights(model, owners))
        signature = module.serve.get_concrete_function()
        # Written beside `path`, then renamed into place: a failed write leaves
        # `path` as it was (an old model included), never a partial SavedModel.
        written = _beside(path, _WRITING)
        try:
            tf.saved_model.save(module, written, signatures={SERVING_SIGNATURE: signature})
            _trail.write_manifest(written, metadata)
            _commit(written, path, replace)
        finally:
            if tf.io.gfile.exists(written):  # the write or the commit failed
                _remove(written, "an incomplete export")
    logger.info(
        "export_serving: wrote %s (%d variables, %d sharded variables unsharded, %d dynamic-embedding keys)",
        path, len(module.model_variables), unsharded, exported_keys,
    )
    return path
