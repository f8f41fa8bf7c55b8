"""`DynamicEmbedding`: a TFRA hash-table embedding on the ps tasks, sized by the keys seen.

Also the keys of a hash table (`table_keys`: strings hashed, ints cast) and
what a key never trained reads (`UNSEEN_KEY_DEFAULT`). The lifecycle of the
table (admission, eviction, the disk tier) is `tf_psx.tables`.
"""

from __future__ import annotations

import tensorflow as tf

from tf_psx import _checks, exact_tables as _exact_tables
from tf_psx._tf import keras as _tf_keras, runtime as _runtime, shadows as _shadows, tfra as _tfra
from tf_psx.errors import ArgumentError
from tf_psx.layers.common import serializable
from tf_psx.layers.wire import as_wire_dtype

__all__ = ["DynamicEmbedding", "table_keys", "STRING_KEY_BUCKETS", "UNSEEN_KEY_DEFAULT", "DEFAULT_INIT_STDDEV"]

_keras = _tf_keras.keras()

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


@serializable
class DynamicEmbedding(_keras.layers.Layer):
    """A hash-table embedding (tensorflow-recommenders-addons) with no vocabulary size.

    The table holds one row per key seen, so it grows with the data: any
    int64 (hashed Criteo categories, user ids) or string key works, and keys
    never collide. Under `tf_psx.ParameterServerStrategy` the table is split
    over the ps tasks (TFRA's default key partition); with no strategy it
    lives on this machine.

    The optimizer needs TFRA's wrapping (`de.DynamicEmbeddingOptimizer`) to
    train these tables; `Model.compile` does it for any model holding a
    DynamicEmbedding (`_exact_tables.install_tfra_optimizer_hook`).

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
      wire_dtype: None, "bfloat16" or "float16": the rows a lookup reads are
        cast to it on the ps task that holds them, and the gradients (and
        the forward rows of new keys that an exact update sends back) are cast to it before
        they leave the worker; the table and the optimizer's slots stay
        float32 on the ps tasks. Half the value bytes on the wire, at
        `wire_dtype`'s precision. Without a strategy the same casts are
        made on this machine, so a model trains alike with and without one.
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
        (`tf_psx.exact_updates`). TFRA alone writes back the rows it looked
        up before the step, so two workers training one key lost an update
        (measured: 0.66 of the true SGD move with 2 workers). Checked
        against the closed form for SGD, momentum SGD, Adagrad, Adam and
        LazyAdam with 2 and 3 workers (tests/training/test_exact_updates.py). The
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
      * `wire_dtype` narrows what tf_psx's exact update sends (the default
        under `tf_psx.ParameterServerStrategy`). With `exact_updates=False`
        TFRA's own apply runs on the worker and writes rows and slots back
        as float32 (the gradient is still rounded to `wire_dtype`, so the
        arithmetic is the same); under sync training the gradients reach
        the ps accumulators as float32 and their mean is rounded once. The exported model reads float32.
    """

    def __init__(self, output_dim: int, key_dtype=tf.int64, initializer=None, name: str | None = None, *,
                 min_count: int = 1, max_age_steps: int | None = None, max_rows: int | None = None,
                 spill_dir=None, wire_dtype=None, **tfra_kwargs):
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
            raise ArgumentError(
                f"Argument `spill_dir` of DynamicEmbedding needs eviction (max_age_steps or max_rows). Received: "
                f"spill_dir={spill_dir!r} with neither. Fix: pass max_rows=... or max_age_steps=..., or drop spill_dir."
            )
        wire = as_wire_dtype(wire_dtype, type(self).__name__)
        key_dtype = tf.as_dtype(key_dtype)
        if key_dtype not in (tf.int64, tf.string):
            raise ArgumentError(
                f"Argument `key_dtype` of DynamicEmbedding must be tf.int64 or tf.string. Received: {key_dtype!r}. "
                "Fix: cast int32 ids to tf.int64."
            )
        if tfra_kwargs.get("with_unique", True) is not True:
            raise ArgumentError(
                "Argument `with_unique` of DynamicEmbedding must be True (duplicate keys of a batch are "
                f"looked up once and their gradients summed; without it they are wrong). Received: "
                f"{tfra_kwargs['with_unique']!r}. Fix: drop the argument."
            )
        tfra_kwargs.pop("with_unique", None)
        de = _tfra.tfra(type(self).__name__)
        _exact_tables.install_tfra_optimizer_hook()
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
        self.wire_dtype = wire
        _tfra.set_wire_dtype(self.table, wire)
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
                        "spill_dir": None if spill_dir is None else str(spill_dir),
                        "wire_dtype": None if wire is None else wire.name}

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
        values, exists = _tfra.lookup(self.table, unique, with_defaults=False)
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
