"""`ShardedEmbedding`: a fixed-vocabulary embedding split over the ps tasks, balanced and deduplicated.

Also `balanced_permutation`, the numpy twin of the layer's row placement
(used by `tf_psx.partitioners.shard_load`).
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tf_psx import _checks, redaction as _redaction
from tf_psx._tf import keras as _tf_keras
from tf_psx.errors import ArgumentError
from tf_psx.layers.common import serializable
from tf_psx.layers.wire import as_wire_dtype, through_wire

__all__ = ["ShardedEmbedding", "balanced_permutation", "MAX_BALANCED_INPUT_DIM"]

_keras = _tf_keras.keras()

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
        raise ArgumentError(f"Argument `ids` of balanced_permutation must be integers. Received dtype: {ids.dtype}.")
    ids = ids.astype(np.int64)
    bad = ids[(ids < 0) | (ids >= input_dim)]
    if bad.size:
        raise ArgumentError(
            f"Argument `ids` of balanced_permutation must be in [0, input_dim={input_dim}); received id "
            f"{int(bad[0])}. {_RANGE_FIX}"
        )
    return (ids * _balance_multiplier(input_dim)) % input_dim


@serializable
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
        self.wire_dtype = as_wire_dtype(wire_dtype, type(self).__name__)
        if balance and input_dim > MAX_BALANCED_INPUT_DIM:
            raise ArgumentError(
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
            return through_wire(shards[0], rows, self.wire_dtype)
        sizes = [int(shard.shape[0]) for shard in shards]
        starts = tf.constant(np.cumsum([0] + sizes[:-1]), tf.int64)
        shard_of = tf.cast(tf.searchsorted(starts, rows, side="right") - 1, tf.int32)
        local = rows - tf.gather(starts, shard_of)
        parts = tf.dynamic_partition(local, shard_of, len(shards))
        positions = tf.dynamic_partition(tf.range(tf.size(rows)), shard_of, len(shards))
        gathered = [through_wire(shard, part, self.wire_dtype) for shard, part in zip(shards, parts)]
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
