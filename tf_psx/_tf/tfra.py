"""TFRA (tensorflow-recommenders-addons 0.8.1) on TF 2.16.2: quiet import, ops on servers, Model hooks."""

from __future__ import annotations

import logging
import sys

from tf_psx._tf.keras import keras
from tf_psx.errors import DynamicEmbeddingSaveError, TFRAMissingError

# What a user without TFRA is told to install: the extra, and the stack it means.
TFRA_NEEDED = ("needs tensorflow-recommenders-addons (TFRA), which is not installed here. TFRA 0.8.1, its last "
               "release, runs only on TensorFlow 2.16.2 and Python 3.9-3.11: install that stack with "
               "`pip install \"tf-psx[tfra]\"` (or `make install-tfra`, which makes .venv-tfra); for a fixed "
               "vocabulary, tf_psx.layers.ShardedEmbedding and FeatureEmbeddings need no TFRA")


def tfra_installed() -> bool:
    """Whether tensorflow_recommenders_addons can be imported here (without importing it)."""
    import importlib.util  # pylint: disable=import-outside-toplevel

    return importlib.util.find_spec("tensorflow_recommenders_addons") is not None


def tfra(what: str = "this"):
    """Imports and returns `tensorflow_recommenders_addons.dynamic_embedding`.

    TFRA 0.8.1 prints "_SingleDeviceSaver removed after tf version 2.15" to
    stdout on import under TF 2.16, and logs a horovod warning; both are
    noise for tf_psx users, so the import runs with stdout captured.
    """
    import contextlib  # pylint: disable=import-outside-toplevel
    import io  # pylint: disable=import-outside-toplevel

    if "tensorflow_recommenders_addons.dynamic_embedding" not in sys.modules:
        if not tfra_installed():
            raise TFRAMissingError(f"{what} {TFRA_NEEDED}.")
        keras3_init = _keras3_variance_scaling()
        saved_call = keras3_init.__call__ if keras3_init is not None else None
        tf_logger = logging.getLogger("tensorflow")
        level = tf_logger.level
        tf_logger.setLevel(logging.ERROR)  # the horovod warning
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                import tensorflow_recommenders_addons.dynamic_embedding  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
        finally:
            tf_logger.setLevel(level)
        _patch_table_restore()
        if keras3_init is not None:
            # TFRA patches VarianceScaling.__call__ of every Keras it finds,
            # Keras 3 included, with a body that needs tf-keras internals:
            # afterwards any Keras 3 layer with a Glorot initializer fails
            # with "no attribute '_random_generator'". TFRA tables only work
            # with tf-keras, so Keras 3 gets its own method back.
            keras3_init.__call__ = saved_call
    return sys.modules["tensorflow_recommenders_addons.dynamic_embedding"]


def _patch_table_restore() -> None:
    """Lets a TFRA 0.8.1 table of dim > 1 restore where TF runs the import op's shape function.

    `CuckooHashTableImport`'s shape function merges the keys' shape [n] with
    the values' shape [n, dim], which fails for any dim > 1 when the shapes
    are known: measured under a ParameterServerStrategy with one ps task, a
    snapshot of a DynamicEmbedding could not be restored ("Shapes must be
    equal rank, but are 1 and 2 ... CuckooHashTableImport"). On that error
    the restore clears the table and inserts the saved rows, which leaves the
    same contents.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow_recommenders_addons.dynamic_embedding.python.ops import (  # pylint: disable=import-outside-toplevel
        cuckoo_hashtable_ops,
    )

    saveable = cuckoo_hashtable_ops.CuckooHashTable._Saveable  # pylint: disable=protected-access
    if getattr(saveable.restore, "__wrapped__", None) is not None:
        return
    original = saveable.restore

    def restore(self, restored_tensors, restored_shapes, name=None):
        try:
            return original(self, restored_tensors, restored_shapes, name=name)
        except (tf.errors.InvalidArgumentError, ValueError) as error:
            if "must be equal rank" not in str(error):
                raise
        table = self.op
        with tf.device(table.resource_handle.device):
            cleared = table.clear()
            with tf.control_dependencies([cleared]):
                return table.insert(restored_tensors[0], restored_tensors[1])

    restore.__wrapped__ = original
    saveable.restore = restore


def load_tfra_ops() -> bool:
    """Registers TFRA's custom ops in this process; False when TFRA is unusable.

    Servers (`python -m tf_psx.server`) must do this before they start, or the
    DynamicEmbedding tables that the coordinator places on them fail to be
    created (TF resolves an op on the task that runs it).
    """
    try:
        tfra()
    except Exception:  # pylint: disable=broad-except  (a missing or broken TFRA build)
        return False
    return True


def _keras3_variance_scaling():
    """Keras 3's VarianceScaling class, or None when Keras 3 is not installed."""
    try:
        import keras  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    if not str(getattr(keras, "__version__", "0")).startswith("3"):
        return None
    return keras.initializers.VarianceScaling


def tfra_loaded() -> bool:
    """True when tensorflow-recommenders-addons was imported in this process."""
    return "tensorflow_recommenders_addons" in sys.modules


def live_tfra_variables() -> int:
    """Counts the TFRA dynamic-embedding variables alive in this process.

    TFRA 0.8.1 tables built before the process connects to a cluster keep
    state on /job:localhost; a model built on the cluster afterwards fails
    every step with "/job:localhost/... unknown device", and
    ClusterCoordinator takes that for a worker failure and retries forever
    (measured: TF 2.16.2, TFRA 0.8.1, even after `del model; gc.collect()`,
    since TFRA keeps the variables alive). Counting the live variables is the
    reliable sign we found; it walks the GC's objects (about 40 ms for 360k
    objects), so it is only done once, before connecting.
    """
    if not tfra_loaded():
        return 0
    import gc  # pylint: disable=import-outside-toplevel

    from tensorflow_recommenders_addons.dynamic_embedding.python.ops import (  # pylint: disable=import-outside-toplevel
        dynamic_embedding_variable as de_variable,
    )

    return sum(1 for obj in gc.get_objects() if isinstance(obj, de_variable.Variable))


def tfra_variable_class():
    """TFRA's `dynamic_embedding.Variable` class, or None when TFRA is not loaded."""
    if not tfra_loaded():
        return None
    return tfra().Variable


# Set on tf_psx.layers.DynamicEmbedding: the hooks recognise it without
# importing tf_psx.layers (which depends on this door, never the reverse).
HASH_TABLE_LAYER_ATTR = "_tf_psx_hash_table_layer"


# Set on a TFRA `dynamic_embedding.Variable` whose keys need admission: a
# function from a batch's keys to a bool per key (may it hold a row). The
# exact update writes rows and slots back only for admitted keys.
ADMISSION_ATTR = "_tf_psx_admission"


def set_admission(params, admitted) -> None:
    """Makes the optimizer write rows of `params` only for keys where `admitted(keys)` is True."""
    setattr(params, ADMISSION_ATTR, admitted)


def admission_of(params):
    """The admission function set on a TFRA variable, or None."""
    return getattr(params, ADMISSION_ATTR, None)


# Set on a TFRA `dynamic_embedding.Variable` whose rows and gradients cross
# the network as a half float (tf_psx.layers.DynamicEmbedding's `wire_dtype`).
WIRE_DTYPE_ATTR = "_tf_psx_wire_dtype"


def set_wire_dtype(params, dtype) -> None:
    """Makes the lookups of `params` (and tf_psx's updates of it) move values as `dtype` (None: its own)."""
    setattr(params, WIRE_DTYPE_ATTR, dtype)
    if dtype is not None:
        install_prefetch()


def wire_dtype_of(params):
    """The wire dtype set on a TFRA variable, or None."""
    return getattr(params, WIRE_DTYPE_ATTR, None)


def _wire_lookup(params, keys, wire_dtype, with_defaults: bool = True):
    """(values, exists) of the 1-D `keys` in the TFRA variable `params`, each shard's values narrowed where it lives.

    As TFRA 0.8.1's `Variable.lookup(keys, return_exists=True)` (its
    partition, its defaults for absent keys), except that each shard's
    values are cast to `wire_dtype` on the shard's task and back to the
    table's dtype here: the rows cross the network at half the bytes.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    keys = tf.convert_to_tensor(keys)
    count = len(params.devices)
    if count == 1:
        parts, positions = [keys], None
    else:
        shard_of = params.partition_fn(keys, count)
        parts = tf.dynamic_partition(keys, shard_of, count)
        positions = tf.dynamic_partition(tf.range(tf.shape(keys)[0]), shard_of, count)
    values, exists = [], []
    for index, part in enumerate(parts):
        value, found = shard_lookup(params, index, part, with_defaults=with_defaults)
        with tf.device(params.devices[index]):
            narrow = tf.cast(value, wire_dtype)
        values.append(tf.cast(narrow, params.value_dtype))
        exists.append(found)
    if positions is None:
        return values[0], exists[0]
    return tf.dynamic_stitch(positions, values), tf.dynamic_stitch(positions, exists)


def lookup(params, keys, with_defaults: bool = True):
    """(values, exists) of the 1-D `keys` in the TFRA variable `params`, through its wire dtype when it has one.

    `with_defaults=False` lets a table with a wire dtype skip the
    initializer's rows for absent keys (for a caller that replaces them).
    """
    wire = wire_dtype_of(params)
    if wire is None:
        return params.lookup(keys, return_exists=True)
    return _wire_lookup(params, keys, wire, with_defaults=with_defaults)


_PREFETCH_INSTALLED = False


def install_prefetch() -> None:
    """Patches TFRA 0.8.1's `ShadowVariable.prefetch_values` (a training lookup) once.

    The lookup also writes whether each key existed into the shadow's
    `exists` buffer (TFRA's own does so only with bp_v2): tf_psx's exact
    update then sends a shard the forward rows of the keys that were absent
    only (tf_psx.tables.tfra_updates). A table with a wire dtype is looked up
    through it (`lookup`).
    """
    global _PREFETCH_INSTALLED  # pylint: disable=global-statement
    if _PREFETCH_INSTALLED:
        return
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    tfra()
    from tensorflow_recommenders_addons.dynamic_embedding.python.ops import (  # pylint: disable=import-outside-toplevel
        shadow_embedding_ops,
    )

    klass = shadow_embedding_ops.ShadowVariable
    original = klass.prefetch_values

    def prefetch_values(self, update=False):
        with tf.device(self._handle.device):  # pylint: disable=protected-access
            values, exists = lookup(self.params, self.ids)
            self.exists.assign(exists)
            self.prefetch_values_op = self.transform(values)
        return self.prefetch_values_op

    prefetch_values.__wrapped__ = original
    klass.prefetch_values = prefetch_values
    _PREFETCH_INSTALLED = True


def forward_exists(shadow):
    """Whether each key of the shadow's last training lookup existed then (bool [keys]); `install_prefetch` writes it."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return tf.reshape(shadow.exists.read_value(), [-1])


def shard_lookup(params, index: int, keys, with_defaults: bool = True):
    """(values, exists) of `keys` in shard `index` of the TFRA variable `params`, made where that shard lives.

    As TFRA 0.8.1's `Variable.lookup` does for one of its shards: absent
    keys get the variable's initializer values (`with_defaults`), or the
    table's static default (cheaper, for a caller that replaces them).
    `keys` must all belong to the shard (`params.partition_fn`).
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    with tf.device(params.devices[index]):
        defaults = None
        if with_defaults:
            defaults = params._create_default_values_by_initializer(keys)  # pylint: disable=protected-access
            if defaults is not None:
                defaults = tf.cast(defaults, params.value_dtype)
        return params.tables[index].lookup(keys, dynamic_default_values=defaults, return_exists=True)


def shard_remove(params, index: int, keys):
    """Removes `keys` from shard `index` of the TFRA variable `params` (the keys belong to it)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    with tf.device(params.devices[index]):
        return params.tables[index].remove(keys)


def shard_insert(params, index: int, keys, values):
    """Upserts `keys` -> `values` into shard `index` of the TFRA variable `params` (the keys belong to it)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    with tf.device(params.devices[index]):
        return params.tables[index].insert(keys, values)


def model_has_dynamic_embedding(model) -> bool:
    return any(getattr(layer, HASH_TABLE_LAYER_ATTR, False) for layer in model._flatten_layers())  # pylint: disable=protected-access


# Set on an optimizer once tf_psx wrapped it for TFRA tables (`wrap_tfra_optimizer`).
WRAPPED_ATTR = "_tf_psx_tfra_wrapped"


def wrap_tfra_optimizer(optimizer, exact_apply, bp_v2: bool = False):
    """Applies TFRA's DynamicEmbeddingOptimizer to `optimizer` once (if the user did not), and `exact_apply`; returns it.

    Args:
      optimizer: a tf-keras optimizer, wrapped by TFRA already or not.
      exact_apply: `exact_apply(wrapped, tfra_fn)` returns the optimizer's
        `_distributed_apply_gradients_fn` given TFRA's own `tfra_fn`
        (tf_psx.tables.tfra_updates.tfra_apply_gradients_fn: TFRA's apply writes
        rows back as values, exact only with one worker; tf_psx's locks every
        table update under a strategy with exact_updates).
      bp_v2: TFRA's `bp_v2` (row deltas) when TFRA wraps it here.
    """
    if optimizer is None or getattr(optimizer, WRAPPED_ATTR, False):
        return optimizer
    wrapped = optimizer if _tfra_wrapped(optimizer) else tfra().DynamicEmbeddingOptimizer(optimizer, bp_v2=bp_v2)
    setattr(wrapped, WRAPPED_ATTR, True)
    tfra_fn = wrapped.__dict__["_distributed_apply_gradients_fn"]
    wrapped._distributed_apply_gradients_fn = exact_apply(wrapped, tfra_fn)  # pylint: disable=protected-access
    return wrapped


def wrapped_for_tables(optimizer) -> bool:
    """True once `wrap_tfra_optimizer` wrapped `optimizer`."""
    return bool(getattr(optimizer, WRAPPED_ATTR, False))


def bp_v2_of(optimizer) -> bool:
    """The `bp_v2` TFRA's `DynamicEmbeddingOptimizer` set on `optimizer` (False when TFRA did not wrap it)."""
    return bool(vars(optimizer).get("_bp_v2", False))


def _tfra_wrapped(optimizer) -> bool:
    """True once TFRA's `DynamicEmbeddingOptimizer` patched `optimizer` (it sets `_bp_v2` on the instance)."""
    return "_bp_v2" in vars(optimizer)


_MODULE = "tensorflow_recommenders_addons"


def is_tfra_shadow(variable) -> bool:
    """True for TFRA's per-batch buffers (shadows, their ids, slot shadows).

    They are written back to the hash tables by TFRA's own apply path, or by
    tf_psx.training.exact_updates' table update.
    """
    return type(variable).__module__.startswith(_MODULE)


def model_has_tfra_layers(model) -> bool:
    """True for a model with a layer of TFRA's own (`de.keras.layers.Embedding`, `SquashedEmbedding`, ...)."""
    return any(type(layer).__module__.startswith(_MODULE)
               for layer in model._flatten_layers())  # pylint: disable=protected-access


def _of_tfra(value) -> bool:
    """True for an object whose class, or a base of it, is TFRA's."""
    return any(cls.__module__.startswith(_MODULE) for cls in type(value).__mro__)


def model_has_tfra_parts(model) -> bool:
    """`model_has_tfra_layers`, also counting a layer that subclasses TFRA's or holds a TFRA object (a
    `de.Variable`) in an attribute (directly, or in a list, tuple or dict)."""
    for layer in model._flatten_layers(include_self=True):  # pylint: disable=protected-access
        if _of_tfra(layer):
            return True
        for value in vars(layer).values():
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            if any(_of_tfra(item) for item in values):
                return True
    return False


_TFRA_HOOK_INSTALLED = False


def install_tfra_optimizer_hook(wrap) -> None:
    """Makes tf-keras `Model.compile` wrap the optimizer for TFRA tables with `wrap(optimizer)`.

    TFRA 0.8.1 trains its tables only through an optimizer patched by
    `de.DynamicEmbeddingOptimizer`; a plain one fails or leaves the table
    untouched. Users of `tf_psx.layers.DynamicEmbedding` should not have to
    know that, so after `compile`, a model that holds a DynamicEmbedding gets
    its optimizer wrapped. Installed the first time a DynamicEmbedding is
    built (never on import); it wraps `tf_keras.Model.compile` once and
    changes nothing for models without TFRA layers.

    Args:
      wrap: returns the optimizer wrapped for the tables
        (tf_psx.tables.tfra_updates.wrap_tfra_optimizer); the first call's is kept.
    """
    global _TFRA_HOOK_INSTALLED  # pylint: disable=global-statement
    if _TFRA_HOOK_INSTALLED:
        return
    model_class = keras().Model
    original_compile = model_class.compile

    def compile(self, optimizer="rmsprop", *args, **kwargs):  # pylint: disable=redefined-builtin
        original_compile(self, optimizer, *args, **kwargs)
        if model_has_dynamic_embedding(self):
            self.optimizer = wrap(self.optimizer)
            for layer in self._flatten_layers():  # pylint: disable=protected-access
                if getattr(layer, HASH_TABLE_LAYER_ATTR, False):
                    layer.attach_optimizer(self.optimizer)

    compile.__doc__ = original_compile.__doc__
    compile.__wrapped__ = original_compile
    model_class.compile = compile

    # tf-keras's SavedModel of a model with TFRA tables loads only where the
    # TFRA ops are registered, and TF Serving has none: a model that cannot
    # serve, written without a word. Refuse and name the alternatives.
    original_save = model_class.save

    def save(self, filepath, *args, **kwargs):
        if model_has_dynamic_embedding(self):
            raise DynamicEmbeddingSaveError(
                f"Model {self.name} holds a tf_psx.layers.DynamicEmbedding; Model.save({str(filepath)!r}) would "
                "write a SavedModel that needs TFRA's ops to load and cannot serve in plain TensorFlow or TF "
                "Serving, or a .keras / .h5 file without the hash tables (they are not Keras weights). Fix: tf_psx.export_serving(model, path) for a model that serves anywhere; "
                "model.save_weights(path), tf.keras.callbacks.ModelCheckpoint(..., save_weights_only=True) or "
                "tf_psx.callbacks.PeriodicSync for checkpoints to resume from."
            )
        return original_save(self, filepath, *args, **kwargs)

    save.__doc__ = original_save.__doc__
    save.__wrapped__ = original_save
    model_class.save = save
    _TFRA_HOOK_INSTALLED = True
