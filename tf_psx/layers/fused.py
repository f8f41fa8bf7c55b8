"""Many categorical features in one table: `FeatureEmbeddings` (sharded) and `DynamicFeatureEmbeddings` (hash table).

Each feature owns a range of the one table (rows for `FeatureEmbeddings`,
keys for `DynamicFeatureEmbeddings`), so a step looks up and updates the
table once for all the features, not once per feature.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_psx import _checks, redaction as _redaction
from tf_psx.errors import ArgumentError
from tf_psx.layers.common import serializable
from tf_psx.layers.hash_table import DynamicEmbedding, table_keys
from tf_psx.layers.sharded import ShardedEmbedding

__all__ = ["FeatureEmbeddings", "DynamicFeatureEmbeddings", "check_feature_dict", "fold_feature_keys",
           "split_feature_rows", "FEATURE_KEY_BITS", "MAX_DYNAMIC_FEATURES"]


def check_feature_dict(owner: str, layer_name: str, inputs, features) -> None:
    """The error of a call whose input is not a dict with exactly `features` (both sets listed)."""
    if not isinstance(inputs, dict):
        raise ArgumentError(f"{owner} `{layer_name}` takes a dict {{name: ids}}. Received: {type(inputs).__name__}. "
                            f"Fix: pass {{{', '.join(repr(n) for n in features)}: ...}}.")
    missing = sorted(set(features) - set(inputs))
    unexpected = sorted(set(inputs) - set(features))
    if missing or unexpected:
        raise ArgumentError(
            f"{owner} `{layer_name}`: the input's features differ from the declared ones. Missing: {missing}. "
            f"Unexpected: {unexpected}. Declared: {sorted(features)}. Received: {sorted(inputs)}. Fix: pass "
            "exactly the declared features, or declare the others."
        )


@serializable
class FeatureEmbeddings(ShardedEmbedding):
    """Many categorical features in one sharded table: one deduplicated gather and update per ps per step.

    A CTR model written the usual way has one `Embedding` per feature, so a
    step sends one gather and one update per feature per shard (26 features
    on 2 ps: 52 lookups and 52 updates, each its own RPC). This layer stores
    all features of one embedding width in one `ShardedEmbedding`: feature f
    owns rows [offset_f, offset_f + vocabulary_f), the ids of every feature of
    a batch are deduplicated together, and the table is read with one gather
    per shard; the optimizer then updates each shard once.

    Rows are placed with `balance=True` over the whole table, so hot ids of
    every feature spread over all shards. Use one layer per embedding width.

    Example:

    >>> import tf_psx, tensorflow as tf
    >>> layer = tf_psx.layers.FeatureEmbeddings({"C1": 10, "C2": 1000}, 4)
    >>> out = layer({"C1": tf.constant([1, 2]), "C2": tf.constant([[7, 7, 999]] * 2)})
    >>> out["C1"].shape, out["C2"].shape
    (TensorShape([2, 4]), TensorShape([2, 3, 4]))

    Args:
      features: {name: vocabulary size}; ids of feature `name` are in
        [0, vocabulary size).
      output_dim: the embedding width of every feature.
      **kwargs: `ShardedEmbedding`'s arguments (`balance`, `wire_dtype`,
        `embeddings_initializer`, ...).

    Input: a dict {name: int ids of any shape}, with exactly the declared
    features. Output: a dict {name: [ids shape..., output_dim]}.

    Attributes:
      features: {name: vocabulary size}, as declared.
      offsets: {name: the first row of the feature in the fused id space}.

    Raises:
      ValueError: an empty or malformed `features`; a call whose features
        differ from the declared ones (both sets are listed).
      tf.errors.InvalidArgumentError: an id outside its feature's range
        (naming the feature and the id), never a silent read of another
        feature's rows.

    Known limitations:
      * The checkpoint holds one table per layer; `feature_table(name)` and
        `feature_tables()` give each feature's rows in id order.
      * `mask_zero` is not supported (it would mask one feature's id 0 only).
    """

    def __init__(self, features: dict, output_dim: int, **kwargs):
        if not isinstance(features, dict) or not features:
            raise ArgumentError(
                "Argument `features` of FeatureEmbeddings must be a non-empty dict {name: vocabulary size}. "
                f"Received: {features!r}. Fix: pass e.g. FeatureEmbeddings({{\"C1\": 1000, \"C2\": 50_000}}, 16)."
            )
        for name, size in features.items():
            if not isinstance(name, str):
                raise ArgumentError(f"Argument `features` of FeatureEmbeddings must have str names. Received the key "
                                    f"{name!r}. Fix: name each feature, e.g. \"C1\".")
            _checks.int_at_least(size, 1, f"features[{name!r}]", owner="FeatureEmbeddings",
                                 fix=f"pass the vocabulary size of feature {name!r}")
        if kwargs.get("mask_zero"):
            raise ArgumentError("Argument `mask_zero` of FeatureEmbeddings is not supported. Received: True. Fix: drop "
                                "it, or use one ShardedEmbedding(mask_zero=True) for that feature.")
        self.features = {name: int(size) for name, size in features.items()}
        self.offsets = dict(zip(self.features, np.cumsum([0] + list(self.features.values())[:-1]).tolist()))
        super().__init__(int(sum(self.features.values())), output_dim, **kwargs)

    def build(self, input_shape=None):  # the input is a dict; the table's shape does not depend on it
        super().build(None)

    def _range_check(self, flat: list):
        """One check of every feature's ids (before their offsets); the first bad id of the first bad feature is named.

        The passing path costs two reductions per feature; the message's
        operands are computed only on the failing branch.
        """
        names = list(self.features)
        sizes = [self.features[name] for name in names]
        prefix = f"FeatureEmbeddings `{self.name}`: ids of feature"
        fix = "Fix: hash or clip the ids of that feature into its range, or declare a larger vocabulary for it."
        if tf.executing_eagerly():
            for name, size, part in zip(names, sizes, flat):
                ids = part.numpy()
                bad = ids[(ids < 0) | (ids >= size)]
                if bad.size:
                    raise tf.errors.InvalidArgumentError(
                        None, None, f"{prefix} `{name}` must be in [0, {size}); received id "
                        f"{_redaction.show(str(int(bad[0])))}. {fix}")
            return tf.no_op()
        lows = tf.stack([tf.reduce_min(part) for part in flat])
        highs = tf.stack([tf.reduce_max(part) for part in flat])
        bad = tf.logical_or(lows < 0, highs >= tf.constant(sizes, tf.int64))

        def fail():
            feature = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)
            firsts = tf.concat([tf.boolean_mask(part, tf.logical_or(part < 0, part >= size))[:1]
                                for part, size in zip(flat, sizes)], axis=0)
            shown = _redaction.REDACTED if _redaction.enabled() else firsts[0]
            assertion = tf.debugging.Assert(
                False, [prefix, tf.gather(tf.constant(names), feature), "must be in [0, size); size, received id:",
                        tf.gather(tf.constant(sizes, tf.int64), feature), shown, fix], summarize=1)
            with tf.control_dependencies([assertion]):
                return tf.constant(False)

        return tf.cond(tf.reduce_any(bad), fail, lambda: tf.constant(True))

    def call(self, inputs):
        check_feature_dict("FeatureEmbeddings", self.name, inputs, self.features)
        flat = [tf.reshape(tf.cast(inputs[name], tf.int64), [-1]) for name in self.features]
        with tf.control_dependencies([self._range_check(flat)]):
            every = tf.concat([part + offset for part, offset in zip(flat, self.offsets.values())], axis=0)
        unique, position = tf.unique(every)
        rows = tf.gather(self._gather(self._storage_rows(unique)), position)
        if self._dtype_policy.compute_dtype != self._dtype_policy.variable_dtype:
            rows = tf.cast(rows, self._dtype_policy.compute_dtype)
        parts = tf.split(rows, tf.stack([tf.size(part) for part in flat]), axis=0)
        return {name: tf.reshape(part, tf.concat([tf.shape(inputs[name]), [self.output_dim]], axis=0))
                for name, part in zip(self.features, parts)}

    def compute_output_shape(self, input_shape):
        return {name: tf.TensorShape(input_shape[name]).concatenate([self.output_dim]) for name in self.features}

    def feature_table(self, name: str) -> np.ndarray:
        """The rows of feature `name` in id order, [vocabulary, output_dim] (reads every shard)."""
        if name not in self.features:
            raise ArgumentError(f"FeatureEmbeddings `{self.name}` has no feature {name!r}. Declared: {sorted(self.features)}.")
        ids = tf.range(self.features[name], dtype=tf.int64) + self.offsets[name]
        return tf.nn.embedding_lookup(self.embeddings, self._storage_rows(ids)).numpy()

    def feature_tables(self) -> dict[str, np.ndarray]:
        """{name: feature_table(name)} for every feature."""
        return {name: self.feature_table(name) for name in self.features}

    def get_config(self):
        config = super().get_config()
        for key in ("input_dim", "batch_input_shape", "input_length"):
            config.pop(key, None)
        config.update({"features": dict(self.features)})
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        return cls(config.pop("features"), config.pop("output_dim"), **config)


# DynamicFeatureEmbeddings: feature i's keys live in [i << 56, (i + 1) << 56).
FEATURE_KEY_BITS = 56
MAX_DYNAMIC_FEATURES = 127  # (127 << 56) + 2**56 - 1 < 2**63


def fold_feature_keys(inputs: dict, features, key_dtype) -> tuple:
    """(flat int64 keys with each feature's index in the top bits, sizes): the keys of one fused hash table."""
    mask = tf.constant(2**FEATURE_KEY_BITS - 1, tf.int64)
    flat, sizes = [], []
    for index, name in enumerate(features):
        keys = table_keys(inputs[name], key_dtype)
        keys = tf.bitwise.bitwise_or(tf.bitwise.bitwise_and(tf.reshape(keys, [-1]), mask),
                                     tf.constant(index << FEATURE_KEY_BITS, tf.int64))
        flat.append(keys)
        sizes.append(tf.size(keys))
    return tf.concat(flat, axis=0), sizes


def split_feature_rows(rows, inputs: dict, features, sizes, output_dim: int) -> dict:
    """Rows of the folded keys back into {name: [ids shape..., output_dim]}."""
    parts = tf.split(rows, tf.stack(sizes), axis=0)
    return {name: tf.reshape(part, tf.concat([tf.shape(inputs[name]), [output_dim]], axis=0))
            for name, part in zip(features, parts)}


@serializable
class DynamicFeatureEmbeddings(DynamicEmbedding):
    """Many open-ended categorical features in one hash table: one lookup per step for all of them.

    The hash-table twin of `FeatureEmbeddings`: feature i's keys are folded
    into [i << 56, (i + 1) << 56) (their low 56 bits, after hashing string
    keys), so the features share one hash table split over the ps tasks, the
    keys of every feature of a batch are deduplicated together, and a step
    looks up and updates the table once. Everything else is
    `DynamicEmbedding`'s (its two stores, snapshots, export; admission and
    eviction on TFRA's store).

    Example:

    >>> import tf_psx, tensorflow as tf
    >>> layer = tf_psx.layers.DynamicFeatureEmbeddings(["user", "item"], 4, initializer="zeros")
    >>> out = layer({"user": tf.constant([10**12, 7], tf.int64), "item": tf.constant([[7, 7]] * 2, tf.int64)})
    >>> out["user"].shape, out["item"].shape
    (TensorShape([2, 4]), TensorShape([2, 2, 4]))

    Args:
      features: the feature names, at most 127.
      output_dim: the embedding width of every feature.
      **kwargs: `DynamicEmbedding`'s arguments.

    Input: a dict {name: keys of any shape}, with exactly the declared
    features. Output: a dict {name: [keys shape..., output_dim]}.

    Known limitations:
      * Keys are reduced to their low 56 bits: two keys of one feature that
        differ only above bit 55 share a row (string keys: 2**56 hash values).
      * The checkpoint and `table` hold one table for all features.
    """

    def __init__(self, features, output_dim: int, **kwargs):
        if isinstance(features, str) or not isinstance(features, (list, tuple)) or not features:
            raise ArgumentError(
                "Argument `features` of DynamicFeatureEmbeddings must be a non-empty list of feature names. "
                f"Received: {features!r}. Fix: pass e.g. DynamicFeatureEmbeddings([\"user\", \"item\"], 16)."
            )
        if len(features) > MAX_DYNAMIC_FEATURES or len(set(features)) != len(features) or not all(
                isinstance(name, str) for name in features):
            raise ArgumentError(
                f"Argument `features` of DynamicFeatureEmbeddings must hold at most {MAX_DYNAMIC_FEATURES} distinct "
                f"str names. Received: {list(features)!r}. Fix: use several layers for more features, and name "
                "each feature once."
            )
        super().__init__(output_dim, **kwargs)
        self.features = list(features)

    def call(self, inputs, training=None):
        check_feature_dict("DynamicFeatureEmbeddings", self.name, inputs, self.features)
        keys, sizes = fold_feature_keys(inputs, self.features, self.key_dtype)
        if self.store == "native":
            rows = self._native_call(keys, training)
        elif training is False:
            rows = self._lookup_only(keys)
        elif self.policy is None:
            rows = self.embedding(keys)
        else:
            rows = self._admitted_lookup(keys)
        return split_feature_rows(rows, inputs, self.features, sizes, self.output_dim)

    def get_config(self):
        config = super().get_config()
        config["features"] = list(self.features)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        return cls(config.pop("features"), config.pop("output_dim"), **config)
