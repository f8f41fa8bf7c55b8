"""Embedding layers for tables sharded over parameter servers.

* `ShardedEmbedding`: a fixed vocabulary, a drop-in for
  `tf.keras.layers.Embedding`, with shard-balanced row placement and
  deduplicated lookups.
* `DynamicEmbedding`: a TFRA hash table on the ps tasks, sized by the keys
  seen, not by a vocabulary.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import tensorflow as tf

from tf_psx import _checks, redaction as _redaction
from tf_psx._tf import keras as _tf_keras, runtime as _runtime, shadows as _shadows, tfra as _tfra

__all__ = ["ShardedEmbedding", "FeatureEmbeddings", "DynamicEmbedding", "DynamicFeatureEmbeddings",
           "balanced_permutation"]

_keras = _tf_keras.keras()
# Registered under this package, so `tf.keras.models.load_model` rebuilds the
# layers of a saved model (.keras, .h5, SavedModel) without custom_objects.
_serializable = _keras.utils.register_keras_serializable(package="tf_psx")

# The golden ratio conjugate. Multiplying ids by the integer nearest to
# N * phi (mod N) is a Weyl sequence: the first k ids land evenly over
# [0, N) for every k (the three-distance theorem), so hot, frequency-sorted
# ids spread evenly over any split of the table into contiguous shards, with
# no dependence on the shard count.
_PHI = (math.sqrt(5.0) - 1.0) / 2.0
# multiplier * id must fit in int64: multiplier < N, so N * N < 2**63.
MAX_BALANCED_INPUT_DIM = 3_037_000_499
_RANGE_FIX = "Fix: hash or clip the ids into [0, input_dim), or raise input_dim."


def _balance_multiplier(input_dim: int) -> int:
    """The integer nearest N * phi that is coprime with N (so ids map 1:1)."""
    if input_dim <= 2:
        return 1
    base = int(round(input_dim * _PHI))
    for delta in range(input_dim):
        for candidate in (base + delta, base - delta):
            if 0 < candidate < input_dim and math.gcd(candidate, input_dim) == 1:
                return candidate
    return 1


def balanced_permutation(ids: np.ndarray, input_dim: int) -> np.ndarray:
    """The row each id is stored in when `balance=True` (numpy twin of the layer).

    Example:

    >>> balanced_permutation(np.arange(5), 5).tolist()  # a bijection of [0, 5)
    [0, 3, 1, 4, 2]

    Args:
      ids: int array of ids in [0, input_dim).
      input_dim: the vocabulary size.

    Returns:
      int64 array of the same shape: the storage rows.

    Raises:
      ValueError: an id outside [0, input_dim) (it would wrap onto another id's row).
    """
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"Argument `ids` of balanced_permutation must be integers. Received dtype: {ids.dtype}.")
    ids = ids.astype(np.int64)
    bad = ids[(ids < 0) | (ids >= input_dim)]
    if bad.size:
        raise ValueError(
            f"Argument `ids` of balanced_permutation must be in [0, input_dim={input_dim}); received id "
            f"{int(bad[0])}. {_RANGE_FIX}"
        )
    return (ids * _balance_multiplier(input_dim)) % input_dim


@_serializable
class ShardedEmbedding(_keras.layers.Embedding):
    """`tf.keras.layers.Embedding` for tables split over parameter servers.

    Under `tf_psx.ParameterServerStrategy` with a partitioner, the table is a
    `ShardedVariable` whose rows are split into contiguous ranges. Two things
    go wrong with real CTR ids, and this layer fixes both:

    * Hot spots. Ids sorted by frequency put the head, and most of the
      traffic, on the first shard. With `balance=True` id k is stored in row
      `(k * M) mod input_dim`, where M is the integer nearest
      `input_dim * 0.618...` coprime with `input_dim`: a bijection that
      spreads any run of consecutive ids evenly over every contiguous split,
      whatever the shard count. Checkpoints hold the table in storage order,
      so they restore into any number of ps tasks.
    * Duplicate traffic. With `dedup=True` each distinct id of a batch is
      looked up once and the result is gathered back, so a row crosses the
      network once per batch, and its gradient arrives already summed.

    Ids outside `[0, input_dim)` raise an error that names the layer, the bad
    id and `input_dim` (on GPU, TF would silently return zeros).

    Example:

    >>> import tf_psx, tensorflow as tf
    >>> layer = tf_psx.layers.ShardedEmbedding(10, 2, embeddings_initializer="ones")
    >>> layer(tf.constant([[1, 1, 7]])).shape
    TensorShape([1, 3, 2])

    Args:
      input_dim: the vocabulary size (ids are in [0, input_dim)).
      output_dim: the embedding width.
      balance: store ids in the balanced order (see above).
      dedup: look up each distinct id of a batch once.
      wire_dtype: None, "bfloat16" or "float16": the rows a step reads are
        cast to this type on their ps task before they travel to the worker,
        and their gradients are cast to it on the worker before they travel
        back; the table, the optimizer and its slots stay float32 on the ps.
        Half the value bytes on the wire, at the precision of the type.
      **embedding_kwargs: any `tf.keras.layers.Embedding` argument
        (`embeddings_initializer`, `mask_zero`, ...).

    Input shape: int [batch, ...] ids. Output shape: [batch, ..., output_dim].

    Known limitations:
      * `balance=True` needs `input_dim <= 3_037_000_499` (int64 products).
      * `layer.embeddings` holds rows in storage order; use
        `lookup_table()` for the table in id order.
      * The range check costs one reduction over the batch's ids.
    """

    def __init__(self, input_dim: int, output_dim: int, balance: bool = True, dedup: bool = True,
                 wire_dtype=None, **embedding_kwargs):
        _checks.int_at_least(input_dim, 1, "input_dim", owner="ShardedEmbedding",
                             fix="pass the vocabulary size, e.g. ShardedEmbedding(10_000, 16)")
        self.wire_dtype = _wire_dtype(wire_dtype, type(self).__name__)
        if balance and input_dim > MAX_BALANCED_INPUT_DIM:
            raise ValueError(
                f"Argument `input_dim` of ShardedEmbedding must be <= {MAX_BALANCED_INPUT_DIM} with "
                f"balance=True. Received: {input_dim}. Fix: pass balance=False, or use "
                "tf_psx.layers.DynamicEmbedding for unbounded ids."
            )
        super().__init__(int(input_dim), output_dim, **embedding_kwargs)
        self.balance = bool(balance)
        self.dedup = bool(dedup)
        self._multiplier = _balance_multiplier(int(input_dim)) if self.balance else 1

    def _storage_rows(self, ids: tf.Tensor) -> tf.Tensor:
        if not self.balance:
            return ids
        return tf.math.floormod(ids * tf.constant(self._multiplier, tf.int64), self.input_dim)

    def _range_message(self) -> str:
        return f"ShardedEmbedding `{self.name}`: ids must be in [0, input_dim={self.input_dim}); received id"

    def _check_range(self, ids: tf.Tensor):
        bad = tf.logical_or(ids < 0, ids >= self.input_dim)
        first_bad = tf.boolean_mask(ids, bad)[:1]
        if tf.executing_eagerly():
            if bool(tf.reduce_any(bad)):
                raise tf.errors.InvalidArgumentError(
                    None, None, f"{self._range_message()} {_redaction.show(str(int(first_bad[0])))}. {_RANGE_FIX}"
                )
            return tf.no_op()
        shown = _redaction.REDACTED if _redaction.enabled() else first_bad
        return tf.debugging.Assert(
            tf.logical_not(tf.reduce_any(bad)),
            [self._range_message(), shown, _RANGE_FIX],
            summarize=1,
        )

    def call(self, inputs):
        ids = tf.cast(inputs, tf.int64)
        with tf.control_dependencies([self._check_range(ids)]):
            ids = tf.identity(ids)
        flat = tf.reshape(ids, [-1])
        if self.dedup:
            unique, position = tf.unique(flat)
            rows = self._gather(self._storage_rows(unique))
            out = tf.gather(rows, position)
        else:
            out = self._gather(self._storage_rows(flat))
        out = tf.reshape(out, tf.concat([tf.shape(ids), [self.output_dim]], axis=0))
        if self._dtype_policy.compute_dtype != self._dtype_policy.variable_dtype:
            out = tf.cast(out, self._dtype_policy.compute_dtype)
        return out

    def _gather(self, rows: tf.Tensor) -> tf.Tensor:
        """The table's rows `rows` (storage order): one gather per shard, on its ps task."""
        if self.wire_dtype is None:
            return tf.nn.embedding_lookup(self.embeddings, rows)
        shards = list(getattr(self.embeddings, "variables", [self.embeddings]))
        if len(shards) == 1:
            return _through_wire(shards[0], rows, self.wire_dtype)
        sizes = [int(shard.shape[0]) for shard in shards]
        starts = tf.constant(np.cumsum([0] + sizes[:-1]), tf.int64)
        shard_of = tf.cast(tf.searchsorted(starts, rows, side="right") - 1, tf.int32)
        local = rows - tf.gather(starts, shard_of)
        parts = tf.dynamic_partition(local, shard_of, len(shards))
        positions = tf.dynamic_partition(tf.range(tf.size(rows)), shard_of, len(shards))
        gathered = [_through_wire(shard, part, self.wire_dtype) for shard, part in zip(shards, parts)]
        return tf.dynamic_stitch(positions, gathered)

    def num_shards(self) -> int:
        """How many shards the table has (1 when it is not sharded)."""
        return len(getattr(self.embeddings, "variables", [self.embeddings]))

    def lookup_table(self) -> np.ndarray:
        """The whole table in id order, [input_dim, output_dim] (reads every shard)."""
        ids = tf.range(self.input_dim, dtype=tf.int64)
        return tf.nn.embedding_lookup(self.embeddings, self._storage_rows(ids)).numpy()

    def get_config(self):
        config = super().get_config()
        config.update({"balance": self.balance, "dedup": self.dedup,
                       "wire_dtype": None if self.wire_dtype is None else self.wire_dtype.name})
        return config


_WIRE_DTYPES = ("bfloat16", "float16")


def _wire_dtype(value, owner: str):
    """None, or tf.bfloat16 / tf.float16 from a name or dtype; anything else is an error."""
    if value is None:
        return None
    try:
        dtype = tf.as_dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in _WIRE_DTYPES:
        raise ValueError(
            f"Argument `wire_dtype` of {owner} must be None, \"bfloat16\" or \"float16\". Received: {value!r}. "
            "Fix: pass wire_dtype=\"bfloat16\" (the float32 range at 8 bits of precision) or leave it None."
        )
    return dtype


def _through_wire(shard, rows: tf.Tensor, wire_dtype) -> tf.Tensor:
    """`tf.gather(shard, rows)` cast to `wire_dtype` on the shard's task, float32 again on this one.

    The gradient takes the way back the same way: cast to `wire_dtype`
    here, to float32 on the shard's task, where the optimizer applies it.
    """
    device = shard.device

    @tf.custom_gradient
    def wire(values):
        with tf.device(device):
            narrow = tf.cast(values, wire_dtype)
        wide = tf.cast(narrow, values.dtype)

        def grad(upstream):
            narrow_grad = tf.cast(upstream, wire_dtype)
            with tf.device(device):
                return tf.cast(narrow_grad, values.dtype)

        return wide, grad

    with tf.device(device):
        values = tf.gather(shard, rows)
    return wire(values)


@_serializable
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
            raise ValueError(
                "Argument `features` of FeatureEmbeddings must be a non-empty dict {name: vocabulary size}. "
                f"Received: {features!r}. Fix: pass e.g. FeatureEmbeddings({{\"C1\": 1000, \"C2\": 50_000}}, 16)."
            )
        for name, size in features.items():
            if not isinstance(name, str):
                raise ValueError(f"Argument `features` of FeatureEmbeddings must have str names. Received the key "
                                 f"{name!r}. Fix: name each feature, e.g. \"C1\".")
            _checks.int_at_least(size, 1, f"features[{name!r}]", owner="FeatureEmbeddings",
                                 fix=f"pass the vocabulary size of feature {name!r}")
        if kwargs.get("mask_zero"):
            raise ValueError("Argument `mask_zero` of FeatureEmbeddings is not supported. Received: True. Fix: drop "
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
            raise ValueError(f"FeatureEmbeddings `{self.name}` has no feature {name!r}. Declared: {sorted(self.features)}.")
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


# TFRA keys are int64; strings are hashed into them (FarmHash Fingerprint64,
# as tf.strings.to_hash_bucket_fast). With this bucket count the chance that
# two of a billion distinct strings collide is about 1e-1; for fewer keys it
# is negligible.
STRING_KEY_BUCKETS = 2**63 - 1


def table_keys(inputs, key_dtype) -> tf.Tensor:
    """The int64 hash-table keys of `inputs`: strings hashed (STRING_KEY_BUCKETS), ints cast."""
    if key_dtype == tf.string:
        return tf.strings.to_hash_bucket_fast(inputs, STRING_KEY_BUCKETS)
    return tf.cast(inputs, tf.int64)
# What a key never trained reads outside training (evaluate, predict) and in
# the exported model: zeros, the "no information" row (it adds nothing to a
# dot product or a sum pooling). In training TFRA draws the initializer's
# row, different on every call, which cannot be served deterministically.
UNSEEN_KEY_DEFAULT = 0.0
# The spread of new rows: small, so that unseen keys barely move a prediction.
DEFAULT_INIT_STDDEV = 0.05


def _ps_devices() -> list[str] | None:
    """The ps task devices of the current ParameterServerStrategy, else None."""
    strategy = tf.distribute.get_strategy()
    if not _runtime.is_parameter_server_strategy(strategy):
        return None
    return [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(_runtime.num_ps(strategy))]


@_serializable
class DynamicEmbedding(_keras.layers.Layer):
    """A hash-table embedding (tensorflow-recommenders-addons) with no vocabulary size.

    The table holds one row per key seen, so it grows with the data: any
    int64 (hashed Criteo categories, user ids) or string key works, and keys
    never collide. Under `tf_psx.ParameterServerStrategy` the table is split
    over the ps tasks (TFRA's default key partition); with no strategy it
    lives on this machine.

    The optimizer needs TFRA's wrapping (`de.DynamicEmbeddingOptimizer`) to
    train these tables; `Model.compile` does it for any model holding a
    DynamicEmbedding (`_tfra.install_tfra_optimizer_hook`).

    Several workers may train at once: TFRA keeps the rows a step looked up
    in "shadow" buffers, which TFRA 0.8.1 alone puts on the coordinator,
    shared by every worker (with 2 workers, measured: Adagrad fails with
    "indices[10] = 10 is not in [0, 10)" in ResourceScatterAdd, and when the
    workers' batches have the same number of distinct keys SGD silently
    applies one worker's gradients to the other worker's rows). Under a
    ParameterServerStrategy each worker gets its own buffers
    (`_shadows.install_per_worker_shadows`); tested with 2 workers
    against the exact rows (tests/scripts/dynamic_two_workers.py).

    Example:

    >>> import tf_psx, tensorflow as tf
    >>> layer = tf_psx.layers.DynamicEmbedding(4, initializer=tf.keras.initializers.Zeros())
    >>> layer(tf.constant([[3, 10**15, 3]], dtype=tf.int64)).shape
    TensorShape([1, 3, 4])

    Args:
      output_dim: the embedding width.
      key_dtype: tf.int64 or tf.string (strings are hashed to int64 keys).
      initializer: the initializer of new rows; by default N(0, 0.05), drawn
        afresh for every new key.
      min_count: admission: a key gets a trainable row (and optimizer
        slots) only once training has seen it `min_count` times (occurrences,
        over all workers); before that it reads `UNSEEN_KEY_DEFAULT` rows and
        its gradient is dropped. 1 (the default) admits every key.
      max_age_steps: eviction by age: rows not used by a training step for
        more than this many optimizer steps (`iterations`) are removed, with
        their slots, when `tf_psx.callbacks.TableEviction` runs.
      max_rows: eviction by size: after each `TableEviction` run the table
        keeps its `max_rows` most recently used rows (LRU by step). Keys
        seen fewer than `min_count` times have a budget of their own of the
        same size.
      spill_dir: a directory for the disk tier: evicted rows and their slots
        are written there, and a key that comes back gets them again (at the
        next `TableEviction` run; until then it reads the default row).
      **tfra_kwargs: passed to `tfra.dynamic_embedding.keras.layers.Embedding`
        (e.g. `init_capacity`, `restrict_policy`, `kv_creator`).

    Input shape: [batch, ...] keys. Output shape: [batch, ..., output_dim].

    Known limitations:
      * Build the layer under the strategy's scope, and create the cluster
        and strategy before any DynamicEmbedding (see LocalResourcesError).
      * Optimizer slots of a key are created when the key is first trained.
      * A lookup alone does not insert a key; training does.
      * TFRA names checkpoint keys after the table, which is named after the
        layer: restore into a model built the same way (same layer names).
        A renamed layer restores nothing; check with
        `checkpoint.restore(path).assert_existing_objects_matched()`.
      * Correctness with duplicate ids in a batch relies on TFRA's
        `with_unique=True` (set here): lookups are deduplicated, so gradients
        of a key arrive summed. Tested against a plain Embedding.
      * Several async workers train one table exactly: under
        `tf_psx.ParameterServerStrategy(exact_updates=True)` (the default)
        each step's update of a table runs as one unit under a lock on the
        table's first ps task: rows and optimizer slots are read afresh from
        the table, updated by the optimizer's own rule, and written back
        (`tf_psx._tf.exact_updates`). TFRA alone writes back the rows it looked
        up before the step, so two workers training one key lost an update
        (measured: 0.66 of the true SGD move with 2 workers). Checked
        against the closed form for SGD, momentum SGD, Adagrad, Adam and
        LazyAdam with 2 and 3 workers (tests/test_exact_updates.py). The
        lock serialises the updates of one table (not of different tables).
      * A new key's Adagrad (or Ftrl) accumulator starts at the optimizer's
        `initial_accumulator_value`, as for a tf-keras variable; TFRA alone
        starts it at 0.
      * A key that was never trained reads the initializer's row (by
        default a fresh N(0, 0.05) draw per lookup) in training and
        evaluation; `export_serving` serves it zeros
        (`tf_psx.export.UNSEEN_KEY_DEFAULT`). Pass
        `initializer="zeros"` to make all three agree.
      * The per-worker buffers rely on private TF 2.16 hooks (call-time
        captures, `ClusterCoordinator._create_per_worker_resources`), kept in
        `tf_psx._tf.shadows`. Recovery of these buffers after a worker restart
        is TF's resource re-creation and is not tested here.
    """

    def __init__(self, output_dim: int, key_dtype=tf.int64, initializer=None, name: str | None = None, *,
                 min_count: int = 1, max_age_steps: int | None = None, max_rows: int | None = None,
                 spill_dir=None, **tfra_kwargs):
        super().__init__(name=name)
        _checks.int_at_least(output_dim, 1, "output_dim", owner="DynamicEmbedding",
                             fix="pass the embedding width, e.g. DynamicEmbedding(16)")
        _checks.int_at_least(min_count, 1, "min_count", owner="DynamicEmbedding",
                             fix="pass how many times a key must be seen before it gets a row, e.g. min_count=2")
        _checks.int_at_least(max_age_steps, 1, "max_age_steps", owner="DynamicEmbedding", or_none=True,
                             fix="pass a number of optimizer steps, e.g. max_age_steps=10_000, or None")
        _checks.int_at_least(max_rows, 1, "max_rows", owner="DynamicEmbedding", or_none=True,
                             fix="pass the rows to keep per table, e.g. max_rows=1_000_000, or None")
        if spill_dir is not None and max_age_steps is None and max_rows is None:
            raise ValueError(
                f"Argument `spill_dir` of DynamicEmbedding needs eviction (max_age_steps or max_rows). Received: "
                f"spill_dir={spill_dir!r} with neither. Fix: pass max_rows=... or max_age_steps=..., or drop spill_dir."
            )
        key_dtype = tf.as_dtype(key_dtype)
        if key_dtype not in (tf.int64, tf.string):
            raise ValueError(
                f"Argument `key_dtype` of DynamicEmbedding must be tf.int64 or tf.string. Received: {key_dtype!r}. "
                "Fix: cast int32 ids to tf.int64."
            )
        if tfra_kwargs.get("with_unique", True) is not True:
            raise ValueError(
                "Argument `with_unique` of DynamicEmbedding must be True (duplicate keys of a batch are "
                f"looked up once and their gradients summed; without it they are wrong). Received: "
                f"{tfra_kwargs['with_unique']!r}. Fix: drop the argument."
            )
        tfra_kwargs.pop("with_unique", None)
        de = _tfra.tfra()
        _tfra.install_tfra_optimizer_hook()
        _shadows.install_per_worker_shadows()
        self.output_dim = int(output_dim)
        self.key_dtype = key_dtype
        if initializer is None:
            # TFRA calls the initializer on every lookup of new keys. A tf-keras
            # initializer without a seed returns the same values on every call
            # (and warns), so new keys would all start alike; TF's own
            # initializer draws afresh each time.
            initializer = tf.random_normal_initializer(0.0, DEFAULT_INIT_STDDEV)
        elif isinstance(initializer, (str, dict)):
            # Keras names ("zeros", "ones", "uniform", ...) as tf.keras.layers.Embedding takes them.
            initializer = _keras.initializers.get(initializer)
        devices = tfra_kwargs.pop("devices", None) or _ps_devices()
        # TFRA names its table after the layer; two layers with TFRA's default
        # name would share one table, so the (unique) Keras name is passed on.
        self.embedding = de.keras.layers.Embedding(
            self.output_dim,
            key_dtype=tf.int64,
            initializer=initializer,
            devices=devices,
            name=f"{self.name}_table",
            with_unique=True,
            **tfra_kwargs,
        )
        self.policy = None
        if min_count > 1 or max_age_steps is not None or max_rows is not None:
            from tf_psx import tables as _tables  # pylint: disable=import-outside-toplevel

            self.policy = _tables.TablePolicy(
                self, min_count=min_count, max_age_steps=max_age_steps, max_rows=max_rows,
                spill_dir=None if spill_dir is None else str(spill_dir), devices=self.table.devices)
            _tfra.set_admission(self.table, self.policy.admitted)
            # Tracked by the layer, so checkpoints and snapshots hold the counts and ages.
            self.meta_table = self.policy.meta
        self._config = {"min_count": int(min_count), "max_age_steps": max_age_steps, "max_rows": max_rows,
                        "spill_dir": None if spill_dir is None else str(spill_dir)}

    def attach_optimizer(self, optimizer) -> None:
        """Called by `Model.compile`: the optimizer whose `iterations` ages this table's rows."""
        if self.policy is not None:
            self.policy.attach_optimizer(optimizer)

    def call(self, inputs, training=None):
        keys = table_keys(inputs, self.key_dtype)
        if training is False:
            # evaluate/predict: a lookup only, and a key never trained reads
            # the same row as in the exported model. None stays the training
            # path: custom loops often call model(x) without training=True.
            return self._lookup_only(keys)
        if self.policy is None:
            return self.embedding(keys)
        return self._admitted_lookup(keys)

    def _admitted_lookup(self, keys):
        """Training lookup with a policy: count the keys, then default rows for the ones not admitted."""
        flat = tf.reshape(keys, [-1])
        unique, position, occurrences = tf.unique_with_counts(flat)
        with tf.control_dependencies([self.policy.check_budget(unique)]):
            counts = self.policy.count(unique, occurrences)
        rows = self.embedding(unique)
        admitted = tf.reshape(counts >= self.policy.min_count, [-1, 1])
        rows = tf.where(admitted, rows, tf.fill(tf.shape(rows), tf.constant(UNSEEN_KEY_DEFAULT, rows.dtype)))
        out = tf.gather(rows, position)
        return tf.reshape(out, tf.concat([tf.shape(keys), [self.output_dim]], axis=0))

    def _lookup_only(self, keys):
        flat = tf.reshape(keys, [-1])
        unique, position = tf.unique(flat)
        values, exists = self.table.lookup(unique, return_exists=True)
        values = tf.where(tf.reshape(exists, [-1, 1]), values, tf.fill(tf.shape(values), UNSEEN_KEY_DEFAULT))
        out = tf.gather(values, position)
        return tf.reshape(out, tf.concat([tf.shape(keys), [self.output_dim]], axis=0))

    @property
    def table(self):
        """The TFRA `dynamic_embedding.Variable` behind the layer."""
        return self.embedding.params

    def size(self) -> int:
        """Rows in the table (keys seen so far), summed over every ps task."""
        return int(self.table.size())

    def get_config(self):
        config = super().get_config()
        config.update({"output_dim": self.output_dim, "key_dtype": self.key_dtype.name, **self._config})
        return config


# How the Model hooks of the door recognise this layer without importing it.
setattr(DynamicEmbedding, _tfra.HASH_TABLE_LAYER_ATTR, True)


# DynamicFeatureEmbeddings: feature i's keys live in [i << 56, (i + 1) << 56).
FEATURE_KEY_BITS = 56
MAX_DYNAMIC_FEATURES = 127  # (127 << 56) + 2**56 - 1 < 2**63


def check_feature_dict(owner: str, layer_name: str, inputs, features) -> None:
    """The error of a call whose input is not a dict with exactly `features` (both sets listed)."""
    if not isinstance(inputs, dict):
        raise ValueError(f"{owner} `{layer_name}` takes a dict {{name: ids}}. Received: {type(inputs).__name__}. "
                         f"Fix: pass {{{', '.join(repr(n) for n in features)}: ...}}.")
    missing = sorted(set(features) - set(inputs))
    unexpected = sorted(set(inputs) - set(features))
    if missing or unexpected:
        raise ValueError(
            f"{owner} `{layer_name}`: the input's features differ from the declared ones. Missing: {missing}. "
            f"Unexpected: {unexpected}. Declared: {sorted(features)}. Received: {sorted(inputs)}. Fix: pass "
            "exactly the declared features, or declare the others."
        )


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


@_serializable
class DynamicFeatureEmbeddings(DynamicEmbedding):
    """Many open-ended categorical features in one hash table: one lookup per step for all of them.

    The hash-table twin of `FeatureEmbeddings`: feature i's keys are folded
    into [i << 56, (i + 1) << 56) (their low 56 bits, after hashing string
    keys), so the features share one TFRA table split over the ps tasks, the
    keys of every feature of a batch are deduplicated together, and a step
    looks up and updates the table once. Everything else is
    `DynamicEmbedding`'s (admission, eviction, snapshots, export).

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
            raise ValueError(
                "Argument `features` of DynamicFeatureEmbeddings must be a non-empty list of feature names. "
                f"Received: {features!r}. Fix: pass e.g. DynamicFeatureEmbeddings([\"user\", \"item\"], 16)."
            )
        if len(features) > MAX_DYNAMIC_FEATURES or len(set(features)) != len(features) or not all(
                isinstance(name, str) for name in features):
            raise ValueError(
                f"Argument `features` of DynamicFeatureEmbeddings must hold at most {MAX_DYNAMIC_FEATURES} distinct "
                f"str names. Received: {list(features)!r}. Fix: use several layers for more features, and name "
                "each feature once."
            )
        super().__init__(output_dim, **kwargs)
        self.features = list(features)

    def call(self, inputs, training=None):
        check_feature_dict("DynamicFeatureEmbeddings", self.name, inputs, self.features)
        keys, sizes = fold_feature_keys(inputs, self.features, self.key_dtype)
        if training is False:
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
