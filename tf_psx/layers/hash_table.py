"""`DynamicEmbedding`: a hash-table embedding on the ps tasks, sized by the keys seen.

Two stores: tf_psx's own tables on TensorFlow's ops (`tf_psx.tables.native`,
the default without TFRA, `table="native"`), and TFRA's tables
(`table="tfra"`, the default where TFRA is installed, for the features
that still need them: admission, eviction, the disk tier).

Also the keys of a hash table (`table_keys`: strings hashed, ints cast) and
what a key never trained reads (`UNSEEN_KEY_DEFAULT`). The lifecycle of a
TFRA table (admission, eviction, the disk tier) is `tf_psx.tables.lifecycle`.
"""

from __future__ import annotations

import tensorflow as tf

import numpy as np

from tf_psx import _checks
from tf_psx._tf import keras as _tf_keras, runtime as _runtime, shadows as _shadows, tfra as _tfra
from tf_psx.errors import ArgumentError, StateError
from tf_psx.layers.common import serializable
from tf_psx.layers.wire import as_wire_dtype
from tf_psx.tables import tfra_updates as _tfra_updates
from tf_psx.tables import native as _native, updates as _table_updates
from tf_psx.training import exact_updates as _exact_updates

__all__ = ["DynamicEmbedding", "table_keys", "STRING_KEY_BUCKETS", "UNSEEN_KEY_DEFAULT", "DEFAULT_INIT_STDDEV",
           "TABLE_STORES"]

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


# `table=` of DynamicEmbedding: tf_psx's own tables on TF's ops, or TFRA's; None picks (`_pick_store`).
TABLE_STORES = ("native", "tfra")
# Layer arguments that only TFRA's tables implement in this release (none: every policy runs on both).
_TFRA_ONLY = ()
# Keyword arguments of every tf-keras layer that get_config writes and from_config passes back.
_KERAS_LAYER_KWARGS = ("trainable", "dtype")
# The dense shape of a table gradient's IndexedSlices: its indices are keys, any int64.
_KEY_SPACE = 2**63 - 1


def _pick_store(table, owner: str, needs_tfra: list[str]) -> str:
    """The store a DynamicEmbedding uses: `table` if given, else TFRA where installed, else native."""
    if table is not None and table not in TABLE_STORES:
        raise ArgumentError(
            f"Argument `table` of {owner} must be None, \"native\" or \"tfra\". Received: {table!r}. "
            "Fix: pass table=\"native\" (tf_psx's tables on TensorFlow's own ops) or leave it None.")
    if table is None:
        table = "tfra" if _tfra.tfra_installed() else "native"
    if table == "native" and needs_tfra:
        raise ArgumentError(
            f"Argument(s) {', '.join(needs_tfra)} of {owner} need TFRA's tables in this release; tf_psx's own "
            f"tables (table=\"native\") do not implement them yet. Received: table={table!r} with "
            f"{', '.join(needs_tfra)}. Fix: install the TFRA stack (pip install \"tf-psx[tfra]\") and pass "
            "table=\"tfra\", or drop these arguments.")
    return table


def _ps_devices() -> list[str] | None:
    """The ps task devices of the current ParameterServerStrategy, else None."""
    strategy = tf.distribute.get_strategy()
    if not _runtime.is_parameter_server_strategy(strategy):
        return None
    return [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(_runtime.num_ps(strategy))]


@serializable
class DynamicEmbedding(_keras.layers.Layer):
    """A hash-table embedding with no vocabulary size.

    The table holds one row per key trained, so it grows with the data: any
    int64 (hashed Criteo categories, user ids) or string key works, and keys
    never collide. Under `tf_psx.ParameterServerStrategy` the table is split
    over the ps tasks; with no strategy it lives on this machine.

    Two stores (`table`): tf_psx's own tables on TensorFlow's ops
    (`"native"`: one `DenseHashTable` per ps task, a key's row, optimizer
    slots and bookkeeping in one value, updated per shard on its ps task
    under its lock: `tf_psx.tables`), the default without TFRA; and TFRA's
    tables (`"tfra"`), the default where TFRA is installed, which admission,
    eviction and the disk tier need in this release. `export()` and
    `size()` read either. docs/guides/hash_tables.md compares them.

    The rest of this docstring describes TFRA's store where it says so.

    TFRA's store: the optimizer needs TFRA's wrapping (`de.DynamicEmbeddingOptimizer`) to
    train these tables; `Model.compile` does it for any model holding a
    DynamicEmbedding (`_tfra_updates.install_tfra_optimizer_hook`).

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
      initializer: the initializer of new rows; by default N(0, 0.05). The
        native store draws it per key (the same row for a key in every
        process: `tf_psx.tables.native.draw_rows`), TFRA's afresh at every
        lookup of a new key.
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
      table: None, "native" or "tfra": the store (above). None: TFRA's
        where TFRA is installed, else tf_psx's own. `min_count`,
        `max_age_steps`, `max_rows`, `spill_dir` and `tfra_kwargs` need
        TFRA's store in this release.
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
        (`tf_psx.training.exact_updates`). TFRA alone writes back the rows it looked
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
                 spill_dir=None, wire_dtype=None, table: str | None = None, **tfra_kwargs):
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
        asked = {"min_count": min_count > 1, "max_age_steps": max_age_steps is not None,
                 "max_rows": max_rows is not None, "spill_dir": spill_dir is not None}
        keras_kwargs = {key: tfra_kwargs[key] for key in _KERAS_LAYER_KWARGS if key in tfra_kwargs}
        needs_tfra = [name for name in _TFRA_ONLY if asked[name]] + sorted(set(tfra_kwargs) - set(keras_kwargs))
        self.store = _pick_store(table, type(self).__name__, needs_tfra)
        if self.store == "native":
            # What tf-keras's get_config adds (from_config passes it back): the layer's, not the table's.
            self.trainable = bool(keras_kwargs.get("trainable", True))
            self._init_native(output_dim, key_dtype, initializer, wire)
            if any(asked.values()):
                from tf_psx.tables import native_policy  # pylint: disable=import-outside-toplevel

                self.policy = native_policy.NativePolicy(
                    self, min_count=min_count, max_age_steps=max_age_steps, max_rows=max_rows,
                    spill_dir=None if spill_dir is None else str(spill_dir))
            self._config.update({"min_count": int(min_count), "max_age_steps": max_age_steps, "max_rows": max_rows,
                                 "spill_dir": None if spill_dir is None else str(spill_dir)})
            return
        de = _tfra.tfra(type(self).__name__)
        # How the Model hooks of the door recognise a TFRA-backed layer without importing this module.
        setattr(self, _tfra.HASH_TABLE_LAYER_ATTR, True)
        _tfra_updates.install_tfra_optimizer_hook()
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

    # --- tf_psx's own tables (`table="native"`) ---

    def _init_native(self, output_dim, key_dtype, initializer, wire) -> None:
        if isinstance(initializer, (str, dict)):
            initializer = _keras.initializers.get(initializer)
        self.output_dim = int(output_dim)
        self.key_dtype = key_dtype
        self.wire_dtype = wire
        self.policy = None
        self._init_spec = _native.initializer_spec(initializer, type(self).__name__, DEFAULT_INIT_STDDEV)
        self._seed = self._init_spec[3] if self._init_spec[3] is not None else _native.layer_seed(self.name)
        self._rule = None
        self.native_table = None
        self._config = {"wire_dtype": None if wire is None else wire.name, "table": "native"}
        # The optimizer's update of the anchor is this table's update (tf_psx.tables.updates).
        _exact_updates.install()
        from tf_psx.training import exact_compile  # pylint: disable=import-outside-toplevel

        exact_compile.install_compile_warning()

    def build(self, input_shape):
        if self.store == "native" and self.native_table is None:
            # The gradient of every lookup reaches the optimizer as this scalar's (keys as indices).
            self.anchor = self.add_weight(name="table_anchor", shape=(), initializer="zeros", trainable=True)
            _exact_updates.register_table_anchor(self.anchor, self._apply_gradient)
            self._make_table(slots=0)
        super().build(input_shape)

    def _make_table(self, slots: int) -> None:
        devices = _ps_devices() or [None]
        # A table whose keys eviction removes is kept in MutableHashTables (tf_psx.tables.native.remove).
        removable = self.policy is not None and (self.policy.max_age_steps is not None
                                                  or self.policy.max_rows is not None)
        self.native_table = _native.NativeTable(f"{self.name}_table", self.output_dim, slots, devices,
                                                removable=removable)

    def rule_for(self, optimizer):
        """The `TableRule` of `optimizer`; the table is laid out for its slots first (`attach_optimizer`)."""
        if self._rule is None or self._rule.optimizer is not optimizer or self.native_table.slots != self._rule.slots:
            self.attach_optimizer(optimizer)  # also after a restore of another layout
        return self._rule

    def _apply_gradient(self, optimizer, gradient):
        return _table_updates.table_update(self, optimizer, gradient)

    def initial_rows(self, keys):
        """The rows [n, output_dim] a new key starts from: the initializer drawn for that key (native tables)."""
        return _native.draw_rows(keys, self.output_dim, self._init_spec, self._seed)

    def _relayout(self, slots: int) -> None:
        """The table with `slots` optimizer slots per key: rows and updates kept, slots started afresh."""
        old = self.native_table
        keys, values = old.export()
        self._make_table(slots)
        if keys.size:
            dim = self.output_dim
            fresh = self._rule.initial_slots(len(keys), dim).numpy() if slots else np.zeros([len(keys), 0], np.float32)
            packed = np.concatenate([values[:, :dim], fresh, values[:, -_native.BOOKKEEPING:]], axis=1)
            if self.policy is not None:
                self.policy.attach_optimizer(None)  # its locked functions belong to the old shards
            self.native_table.import_values(keys, packed)

    def attach_optimizer(self, optimizer) -> None:
        """Called by `Model.compile`: the optimizer that trains this table (native: checked, the table laid out for it)."""
        if self.store == "native":
            if not self.built:
                return
            self._rule = _table_updates.TableRule.for_optimizer(optimizer, type(self).__name__)
            if self.native_table.slots != self._rule.slots:
                with tf.init_scope():
                    self._relayout(self._rule.slots)
            if self.policy is not None:
                self.policy.attach_optimizer(optimizer)
            return
        if self.policy is not None:
            self.policy.attach_optimizer(optimizer)

    def _native_call(self, keys, training):
        flat = tf.reshape(keys, [-1])
        with tf.control_dependencies([_native.check_keys(flat)]):
            unique, position, occurrences = tf.unique_with_counts(flat)
        admitted = None
        if training is not False and self.policy is not None:
            # Counted on each shard under its lock; keys not admitted read the default row and get no gradient.
            with tf.control_dependencies([self.policy.check_budget(unique)]):
                rows, admitted, exists = self.policy.counted_lookup(unique, occurrences, self.wire_dtype)
            rows = tf.where(tf.reshape(admitted, [-1, 1]), rows, tf.fill(tf.shape(rows), UNSEEN_KEY_DEFAULT))
        else:
            rows, exists = self.native_table.find_rows(unique, self.wire_dtype)
        if training is False:
            rows = tf.where(tf.reshape(exists, [-1, 1]), rows, tf.fill(tf.shape(rows), UNSEEN_KEY_DEFAULT))
        else:
            starts = tf.logical_not(exists) if admitted is None else tf.logical_and(admitted, tf.logical_not(exists))
            absent = tf.where(starts)
            drawn = self.initial_rows(tf.gather_nd(unique, absent))
            if self.wire_dtype is not None:  # read as the table's rows are: through the wire
                drawn = tf.cast(tf.cast(drawn, self.wire_dtype), tf.float32)
            rows = tf.reshape(tf.tensor_scatter_nd_update(rows, absent, drawn), [-1, self.output_dim])
            rows = _to_anchor(rows, self.anchor.read_value(), unique, admitted)
        out = tf.gather(rows, position)
        return tf.reshape(out, tf.concat([tf.shape(keys), [self.output_dim]], axis=0))

    def export(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys [n] int64, rows [n, output_dim] float32) of every key in the table, sorted by key, as numpy.

        The rows a lookup reads (no optimizer slots, no bookkeeping), from
        any process that holds the model (the coordinator reads them from
        the ps tasks). String keys are returned as their int64 hashes
        (`table_keys`).

        Example:

        >>> import tf_psx, tensorflow as tf
        >>> layer = tf_psx.layers.DynamicEmbedding(2, initializer="ones", table="native")
        >>> model = tf.keras.Sequential([tf.keras.Input((2,), dtype="int64"), layer])
        >>> model.compile(tf.keras.optimizers.SGD(0.5), loss=lambda y, p: tf.reduce_sum(p, axis=[1, 2]))
        >>> _ = model.fit(tf.constant([[3, 9]], tf.int64), tf.zeros([1]), verbose=0)
        >>> keys, rows = layer.export()  # each row: 1 - 0.5 * 1 (the loss is the sum of the rows)
        >>> keys.tolist(), rows.tolist(), layer.size()
        ([3, 9], [[0.5, 0.5], [0.5, 0.5]], 2)
        """
        if self.store != "native":
            keys, rows = self.table.export()
            keys, rows = keys.numpy().reshape(-1), rows.numpy()
            order = np.argsort(keys, kind="stable")
            return keys[order], rows[order]
        if self.native_table is None:
            return np.zeros([0], np.int64), np.zeros([0, self.output_dim], np.float32)
        return self.native_table.export(columns=self.output_dim, trained_only=True)

    def h5_refusal(self):
        """The error an `.h5` file of this layer raises (tf_psx._tf.weights), or None: a native table has no h5 form."""
        if self.store != "native":
            return None
        return StateError(
            f"DynamicEmbedding {self.name} keeps its rows in a hash table, which an .h5 file cannot hold (it would "
            "hold the layer's scalar anchor only, and the rows would be lost). Received: an .h5 path. Fix: "
            "model.save(\"model.keras\") or model.save_weights(\"ckpt\") (TensorFlow's checkpoint format), or "
            "tf_psx.export_serving(model, path) for serving.")

    def save_own_variables(self, store):
        """The `.keras` file's entry of this layer: a native table's keys and whole values beside the anchor."""
        super().save_own_variables(store)
        if self.store == "native" and self.native_table is not None:
            keys, values = self.native_table.export()
            store["table_keys"], store["table_values"] = keys, values

    def load_own_variables(self, store):
        """Reads `save_own_variables`' entry: the anchor, then every key of a native table onto this table's shards."""
        if self.store != "native" or "table_keys" not in store:
            return super().load_own_variables(store)
        self.anchor.assign(store["0"][()] if hasattr(store["0"], "shape") else store["0"])
        keys, values = np.asarray(store["table_keys"]), np.asarray(store["table_values"])
        self.native_table.restore_tensors({"keys": tf.constant(keys, tf.int64),
                                           "values": tf.constant(values, tf.float32)})
        return None

    def call(self, inputs, training=None):
        keys = table_keys(inputs, self.key_dtype)
        if self.store == "native":
            return self._native_call(keys, training)
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
        """The TFRA `dynamic_embedding.Variable` behind the layer (`table="tfra"`)."""
        if self.store == "native":
            raise StateError(
                f"DynamicEmbedding {self.name} keeps its rows in tf_psx's own tables, not TFRA's: it has no "
                "`table` (a TFRA Variable). Received: table=\"native\". Fix: read rows with layer.export() and "
                "count them with layer.size(); pass table=\"tfra\" for a TFRA table.")
        return self.embedding.params

    def size(self) -> int:
        """Rows in the table (keys trained so far), summed over every ps task."""
        if self.store == "native":
            if self.native_table is None:
                return 0
            # With a policy the table also holds pending keys and disk-tier markers: only trained rows count.
            return self.native_table.trained_size() if self.policy is not None else int(self.native_table.size())
        return int(self.table.size())

    def get_config(self):
        config = super().get_config()
        config.update({"output_dim": self.output_dim, "key_dtype": self.key_dtype.name, **self._config})
        return config


def _to_anchor(rows, anchor_value, keys, admitted=None):
    """`rows`, whose gradient reaches `anchor_value` (the anchor's read) as an IndexedSlices keyed by `keys`.

    `admitted`: None, or a bool per key: only those keys' gradient rows are passed on.
    """

    @tf.custom_gradient
    def attach(rows, anchor_value):
        def gradient(upstream):
            upstream = tf.reshape(tf.convert_to_tensor(upstream), [-1, rows.shape[-1]])
            shape = tf.stack([tf.constant(_KEY_SPACE, tf.int64), tf.shape(upstream, out_type=tf.int64)[1]])
            if admitted is not None:
                return None, tf.IndexedSlices(tf.boolean_mask(upstream, admitted), tf.boolean_mask(keys, admitted),
                                              shape)
            return None, tf.IndexedSlices(upstream, keys, shape)

        del anchor_value
        return tf.identity(rows), gradient

    return attach(rows, anchor_value)



