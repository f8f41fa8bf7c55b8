"""Everything that depends on TF, Keras or TFRA versions and their private hooks.

This is the one place where tf_psx touches process-wide settings or private
TensorFlow attributes. Each item says which version it was written against
and why it exists.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from types import ModuleType
from typing import Any

# TF 2.16: `tf.keras` is a lazy loader that reads TF_USE_LEGACY_KERAS the first
# time one of its attributes is used (tensorflow/python/util/lazy_loader.py,
# KerasLazyLoader._initialize). Keras 3 cannot run `model.fit` under
# ParameterServerStrategy, so tf_psx routes `tf.keras` to tf-keras (Keras 2).
# Setting the variable here, before anything touches `tf.keras`, is enough even
# when the user imported tensorflow first. An explicit user setting wins.
LEGACY_KERAS_ENV = "TF_USE_LEGACY_KERAS"
os.environ.setdefault(LEGACY_KERAS_ENV, "1")

# With GRPC_FAIL_FAST=use_caller a call to a dead task fails at once instead of
# waiting for the connection to come back, which is what lets ClusterCoordinator
# notice a failed worker and re-run its closure elsewhere (TF 2.16 PS guide).
GRPC_FAIL_FAST_ENV = "GRPC_FAIL_FAST"
GRPC_FAIL_FAST_VALUE = "use_caller"

KERAS3_FIX = (
    "Fix: use tf-keras (Keras 2), which tf_psx installs: write `import tf_keras as keras` "
    "or use `tf.keras` after `import tf_psx`, and build the model again. Keras 3 cannot run "
    "model.fit under ParameterServerStrategy."
)


class Keras3Error(TypeError):
    """A Keras 3 object was used where parameter-server training needs tf-keras."""


def set_grpc_fail_fast() -> None:
    """Sets GRPC_FAIL_FAST=use_caller unless the user set it already."""
    os.environ.setdefault(GRPC_FAIL_FAST_ENV, GRPC_FAIL_FAST_VALUE)


def keras() -> ModuleType:
    """Returns the tf-keras module (Keras 2), whatever `tf.keras` resolves to."""
    import tf_keras  # pylint: disable=import-outside-toplevel

    return tf_keras


def tf_keras_is_legacy() -> bool:
    """True when `tf.keras` resolves (or will resolve) to tf-keras."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    loader = tf.__dict__.get("keras")
    # KerasLazyLoader stores the chosen package once it has initialized.
    version = getattr(loader, "__dict__", {}).get("_tfll_keras_version")
    if version is None:
        return os.environ.get(LEGACY_KERAS_ENV) in ("true", "True", "1")
    return version == "tf_keras"


def is_keras3_object(obj: Any) -> bool:
    """True for an instance of a Keras 3 class (its module lives under `keras.src`)."""
    for klass in type(obj).__mro__:
        module = getattr(klass, "__module__", "") or ""
        if module == "keras" or module.startswith("keras.src") or module.startswith("keras."):
            return True
    return False


def check_not_keras3(obj: Any, what: str = "model") -> None:
    """Raises Keras3Error when `obj` is a Keras 3 model, layer or optimizer."""
    if is_keras3_object(obj):
        raise Keras3Error(
            f"The {what} passed in is a Keras 3 object ({type(obj).__module__}."
            f"{type(obj).__qualname__}); tf_psx.ParameterServerStrategy needs tf-keras. "
            + KERAS3_FIX
        )


def keras3_caller() -> str | None:
    """Returns the Keras 3 module on the call stack, if any.

    TF's ParameterServerStrategy rejects `experimental_distribute_dataset` with a
    message about ClusterCoordinator that does not tell a Keras 3 user what is
    wrong. Keras 3's `fit` calls that method from `keras.src.trainers`, so the
    stack tells us who called.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            name = frame.f_globals.get("__name__", "") or ""
            if name.startswith("keras.src"):
                return name
            frame = frame.f_back
    finally:
        del frame
    return None


def tfra():
    """Imports and returns `tensorflow_recommenders_addons.dynamic_embedding`.

    TFRA 0.8.1 prints "_SingleDeviceSaver removed after tf version 2.15" to
    stdout on import under TF 2.16, and logs a horovod warning; both are
    noise for tf_psx users, so the import runs with stdout captured.
    """
    import contextlib  # pylint: disable=import-outside-toplevel
    import io  # pylint: disable=import-outside-toplevel

    if "tensorflow_recommenders_addons.dynamic_embedding" not in sys.modules:
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
        if keras3_init is not None:
            # TFRA patches VarianceScaling.__call__ of every Keras it finds,
            # Keras 3 included, with a body that needs tf-keras internals:
            # afterwards any Keras 3 layer with a Glorot initializer fails
            # with "no attribute '_random_generator'". TFRA tables only work
            # with tf-keras, so Keras 3 gets its own method back.
            keras3_init.__call__ = saved_call
    return sys.modules["tensorflow_recommenders_addons.dynamic_embedding"]


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


def eager_context_initialized() -> bool:
    """True when this process already ran TF ops eagerly (private: context handle)."""
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel

    ctx = context.context()
    return getattr(ctx, "_context_handle", None) is not None


def connected_to_cluster() -> bool:
    """True when the eager context has a server_def (connected to a cluster)."""
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel

    return getattr(context.context(), "_server_def", None) is not None


def _model_has_dynamic_embedding(model) -> bool:
    from tf_psx.layers import DynamicEmbedding  # pylint: disable=import-outside-toplevel

    return any(isinstance(layer, DynamicEmbedding) for layer in model._flatten_layers())  # pylint: disable=protected-access


def wrap_tfra_optimizer(optimizer):
    """Applies TFRA's DynamicEmbeddingOptimizer to `optimizer` once; returns it."""
    if optimizer is None or getattr(optimizer, "_tf_psx_tfra_wrapped", False):
        return optimizer
    wrapped = tfra().DynamicEmbeddingOptimizer(optimizer)
    wrapped._tf_psx_tfra_wrapped = True  # pylint: disable=protected-access
    # TFRA's apply writes rows back as values: exact only with one worker.
    # tf_psx's locks every table update under a strategy with exact_updates.
    from tf_psx import _exact_updates  # pylint: disable=import-outside-toplevel

    _exact_updates.install()
    tfra_fn = wrapped.__dict__["_distributed_apply_gradients_fn"]
    wrapped._distributed_apply_gradients_fn = _exact_updates.tfra_apply_gradients_fn(wrapped, tfra_fn)  # pylint: disable=protected-access
    return wrapped


_TFRA_HOOK_INSTALLED = False


def install_tfra_optimizer_hook() -> None:
    """Makes tf-keras `Model.compile` wrap the optimizer for TFRA tables.

    TFRA 0.8.1 trains its tables only through an optimizer patched by
    `de.DynamicEmbeddingOptimizer`; a plain one fails or leaves the table
    untouched. Users of `tf_psx.layers.DynamicEmbedding` should not have to
    know that, so after `compile`, a model that holds a DynamicEmbedding gets
    its optimizer wrapped. Installed the first time a DynamicEmbedding is
    built (never on import); it wraps `tf_keras.Model.compile` once and
    changes nothing for models without TFRA layers.
    """
    global _TFRA_HOOK_INSTALLED  # pylint: disable=global-statement
    if _TFRA_HOOK_INSTALLED:
        return
    model_class = keras().Model
    original_compile = model_class.compile

    def compile(self, optimizer="rmsprop", *args, **kwargs):  # pylint: disable=redefined-builtin
        original_compile(self, optimizer, *args, **kwargs)
        if _model_has_dynamic_embedding(self):
            self.optimizer = wrap_tfra_optimizer(self.optimizer)

    compile.__doc__ = original_compile.__doc__
    compile.__wrapped__ = original_compile
    model_class.compile = compile

    # tf-keras's SavedModel of a model with TFRA tables loads only where the
    # TFRA ops are registered, and TF Serving has none: a model that cannot
    # serve, written without a word. Refuse and name the alternatives.
    original_save = model_class.save

    def save(self, filepath, *args, **kwargs):
        if _model_has_dynamic_embedding(self):
            raise DynamicEmbeddingSaveError(
                f"Model {self.name} holds a tf_psx.layers.DynamicEmbedding; Model.save({str(filepath)!r}) would "
                "write a SavedModel that needs TFRA's ops to load and cannot serve in plain TensorFlow or TF "
                "Serving. Fix: tf_psx.export_serving(model, path) for a model that serves anywhere; "
                "model.save_weights(path), tf.keras.callbacks.ModelCheckpoint(..., save_weights_only=True) or "
                "tf_psx.callbacks.PeriodicSync for checkpoints to resume from."
            )
        return original_save(self, filepath, *args, **kwargs)

    save.__doc__ = original_save.__doc__
    save.__wrapped__ = original_save
    model_class.save = save
    _TFRA_HOOK_INSTALLED = True


class DynamicEmbeddingSaveError(ValueError):
    """Model.save of a model with TFRA tables, which would not serve; names the alternatives."""


# --- Hooks for tf_psx.callbacks (written against tf-keras 2.16, TF 2.16.2) ---


def wrap_train_step(model, make_wrapper):
    """Replaces `model.train_step` on the instance by `make_wrapper(original)`.

    Returns a function that puts the original back. tf-keras 2.16's
    `make_train_function` calls `model.train_step(data)` inside
    `strategy.run`, so an instance attribute is picked up on the next trace;
    call `rebuild_train_function` after wrapping.
    """
    had_own = "train_step" in model.__dict__
    original = model.train_step
    model.__dict__["train_step"] = make_wrapper(original)

    def undo():
        if had_own:
            model.__dict__["train_step"] = original
        else:
            model.__dict__.pop("train_step", None)

    return undo


def wrap_optimizer_apply(optimizer, make_wrapper):
    """Wraps the optimizer's cross-replica apply, `_distributed_apply_gradients_fn`.

    tf-keras 2.16 `Optimizer.apply_gradients` aggregates the gradients
    (a `merge_call`), builds the slots, then calls
    `_distributed_apply_gradients_fn(distribution, grads_and_vars, **kwargs)`,
    which updates every variable and `iterations`. Wrapping that function
    (and not `apply_gradients`) lets the wrapper put the whole update under a
    `tf.cond`: a `merge_call` inside a `tf.cond` is refused by
    tf.distribute. TFRA 0.8.1's `DynamicEmbeddingOptimizer` sets its own
    version of this function on the instance; the wrapper wraps whichever
    is there. Returns a function that puts the original back.
    """
    name = "_distributed_apply_gradients_fn"
    if not hasattr(optimizer, name):
        raise TypeError(
            f"The optimizer {type(optimizer).__qualname__} has no `{name}`: it is not a tf-keras 2.16 "
            "optimizer (tf.keras.optimizers.*). Fix: compile the model with a tf.keras optimizer; legacy "
            "optimizers (tf.keras.optimizers.legacy.*) are not supported by tf_psx.callbacks."
        )
    had_own = name in optimizer.__dict__
    original = getattr(optimizer, name)
    setattr(optimizer, name, make_wrapper(original))

    def undo():
        if had_own:
            setattr(optimizer, name, original)
        else:
            optimizer.__dict__.pop(name, None)

    return undo


def rebuild_train_function(model) -> None:
    """Makes `fit` use a new train function, traced again on its next call.

    tf-keras 2.16's `fit` reads `model.train_function` on every step, so a
    rebuild in `on_train_begin` takes effect for the first step.
    """
    model.train_function = None
    model.make_train_function(force=True)


def forget_train_function(model) -> None:
    """Makes the next `fit` build (and trace) its train function again."""
    model.train_function = None


class _InitialCounters:
    """Stands in for tf-keras's WorkerTrainingState during one `fit`.

    tf-keras 2.16 `Model.fit` calls
    `model._training_state.maybe_load_initial_counters_from_ckpt(...)` right
    after `on_train_begin` and starts its epoch and step loops from what it
    returns (BackupAndRestore works this way): steps already done are skipped.
    """

    def __init__(self, epoch: int, step: int):
        self.epoch, self.step = int(epoch), int(step)

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode=None):  # pylint: disable=unused-argument
        return self.epoch, self.step


def set_initial_counters(model, epoch: int, step: int) -> None:
    """Makes the running `fit` start at (epoch, step in that epoch)."""
    current = getattr(model, "_training_state", None)
    if current is not None and not isinstance(current, _InitialCounters):
        raise ValueError(
            "tf.keras.callbacks.BackupAndRestore and tf_psx.callbacks.PeriodicSync were both passed "
            "to fit; both decide where fit resumes. Fix: keep only PeriodicSync (it saves between "
            "epochs too, and its batch-level snapshots work under ParameterServerStrategy)."
        )
    model._training_state = _InitialCounters(epoch, step)  # pylint: disable=protected-access


def clear_initial_counters(model) -> None:
    """Undoes `set_initial_counters` (leaves BackupAndRestore's state alone)."""
    if isinstance(getattr(model, "_training_state", None), _InitialCounters):
        model._training_state = None  # pylint: disable=protected-access


class ClosureRetries:
    """Counts the closures a ClusterCoordinator put back in its queue to run again."""

    def __init__(self):
        self.count = 0


def closure_retries(coordinator) -> ClosureRetries:
    """Returns the retry counter of `coordinator`, installing it on first use.

    TF 2.16's `ClusterCoordinator` re-queues a closure that failed on a
    worker (a worker failure, or a transient error) with
    `coordinator._cluster.closure_queue.put_back(closure)`; nothing public
    counts those. The counter wraps `put_back` on that queue instance, once.
    Retries before the counter was installed are not counted.
    """
    queue = coordinator._cluster.closure_queue  # pylint: disable=protected-access
    counter = queue.__dict__.get("_tf_psx_retries")
    if counter is None:
        counter = ClosureRetries()
        original = queue.put_back

        def put_back(closure):
            counter.count += 1
            return original(closure)

        queue.put_back = put_back
        queue._tf_psx_retries = counter  # pylint: disable=protected-access
    return counter


def is_parameter_server_strategy(strategy) -> bool:
    """True for strategies whose steps run through a ClusterCoordinator."""
    return bool(getattr(strategy, "_should_use_with_coordinator", False))


def tfra_variable_class():
    """TFRA's `dynamic_embedding.Variable` class, or None when TFRA is not loaded."""
    if not tfra_loaded():
        return None
    return tfra().Variable


# --- Per-worker TFRA shadows (written against TFRA 0.8.1, TF 2.16.2) ---

_PER_WORKER_SHADOWS_INSTALLED = False
# Prefix of the shared_name of a shadow's worker-local copy; the rest is the
# variable's unique id, so each shadow (and its ids, exists and slot shadows)
# gets its own resource on every worker.
_PER_WORKER_SHARED_NAME_PREFIX = "tf_psx_per_worker/"
_PER_WORKER_CLASSES: dict[type, type] = {}


def _outermost_func_graph(graph):
    """The tf.function graph that `graph` is nested in (itself when not nested)."""
    from tensorflow.python.framework import func_graph  # pylint: disable=import-outside-toplevel

    while isinstance(getattr(graph, "outer_graph", None), func_graph.FuncGraph):
        graph = graph.outer_graph
    return graph


class _PerWorkerHandle:
    """Mixin: inside a step scheduled on a worker, the buffer is that worker's own.

    TFRA 0.8.1's keras Embedding keeps the rows looked up in a step in
    "shadow" variables (`de.shadow_ops.ShadowVariable`, its `ids` and
    `exists` buffers, and one shadow per optimizer slot) that the optimizer
    then writes back to the table. Under TF 2.16's ParameterServerStrategy
    these are ordinary variables on the coordinator (/job:chief/...), so
    every worker's step reads and writes the same buffers: with 2 workers
    one worker's gradients are applied to the other worker's rows
    (measured; tests/scripts/dynamic_two_workers.py). This mixin gives each
    worker its own copy (a `VarHandleOp` run on every worker through
    `ClusterCoordinator._create_per_worker_resources`, written by TFRA before
    each read), and in a traced function the handle is a call-time capture
    that resolves to the copy of the worker the step is dispatched to: the
    mechanism TF 2.16 uses for `PerWorkerVariable`. Outside a dispatched
    step (eagerly on the coordinator: saving, direct calls) the original
    handle is used. One placeholder per variable and traced function, so
    GradientTape matches the reads with the watched variable.
    """

    @property
    def _handle(self):
        eager_handle = self.__dict__["_tf_psx_eager_handle"]
        from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
        from tensorflow.python.saved_model import save_context  # pylint: disable=import-outside-toplevel

        if context.executing_eagerly() or save_context.in_save_context():
            return eager_handle
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        from tensorflow.python.distribute import ps_values  # pylint: disable=import-outside-toplevel
        from tensorflow.python.distribute.coordinator import coordinator_context  # pylint: disable=import-outside-toplevel

        per_worker = self.__dict__["_tf_psx_per_worker_handles"]

        def closure():
            dispatch = coordinator_context.get_current_dispatch_context()
            if dispatch is None:
                return eager_handle
            remote = per_worker._values[dispatch.worker_index]  # pylint: disable=protected-access
            return dispatch.maybe_get_remote_value(remote)

        graph = _outermost_func_graph(tf.compat.v1.get_default_graph())
        with graph.as_default():
            return graph.capture_call_time_value(
                closure, ps_values.PerWorkerVariableSpec(value=eager_handle), key=("tf_psx_per_worker", id(self))
            )

    @_handle.setter
    def _handle(self, value):
        self.__dict__["_tf_psx_eager_handle"] = value

    @property
    def device(self):
        # tf.distribute reduces gradients "to" the variable's device and
        # refuses an empty one, so the coordinator's device is reported.
        # Only that identity is placed by it; the reads and updates of the
        # buffer run where its (worker-local) handle lives.
        return self.__dict__["_tf_psx_eager_handle"].device


def _make_per_worker(variable, strategy) -> None:
    """Switches one TFRA shadow buffer to worker-local copies (see _PerWorkerHandle)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import gen_resource_variable_ops  # pylint: disable=import-outside-toplevel

    cls = type(variable)
    if issubclass(cls, _PerWorkerHandle):
        return
    per_worker_cls = _PER_WORKER_CLASSES.get(cls)
    if per_worker_cls is None:
        per_worker_cls = type(cls.__name__, (_PerWorkerHandle, cls), {"__module__": cls.__module__})
        _PER_WORKER_CLASSES[cls] = per_worker_cls
    eager_handle = variable.__dict__.pop("_handle")
    shared_name = f"{_PER_WORKER_SHARED_NAME_PREFIX}{variable._unique_id}"  # pylint: disable=protected-access
    dtype = variable.dtype

    @tf.function(autograph=False)
    def create_handle():
        return gen_resource_variable_ops.var_handle_op(dtype=dtype, shape=None, shared_name=shared_name)

    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    variable.__dict__["_tf_psx_eager_handle"] = eager_handle
    variable.__dict__["_tf_psx_per_worker_handles"] = coordinator._create_per_worker_resources(create_handle)  # pylint: disable=protected-access
    variable.__class__ = per_worker_cls


def install_per_worker_shadows() -> None:
    """Makes TFRA shadows built under a ParameterServerStrategy worker-local.

    Wraps `__init__` of TFRA 0.8.1's `shadow_ops.ShadowVariable` and of its
    `DEResourceVariable` (the ids/exists buffers) once: an instance built
    while a ParameterServerStrategy is current gets `_PerWorkerHandle`.
    Instances built without such a strategy are left alone.
    """
    global _PER_WORKER_SHADOWS_INSTALLED  # pylint: disable=global-statement
    if _PER_WORKER_SHADOWS_INSTALLED:
        return
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    tfra()
    from tensorflow_recommenders_addons.dynamic_embedding.python.ops import (  # pylint: disable=import-outside-toplevel
        shadow_embedding_ops,
    )

    for klass in (shadow_embedding_ops.ShadowVariable, shadow_embedding_ops.DEResourceVariable):
        original_init = klass.__init__

        def __init__(self, *args, _original_init=original_init, **kwargs):
            _original_init(self, *args, **kwargs)
            if tf.distribute.has_strategy() and is_parameter_server_strategy(tf.distribute.get_strategy()):
                _make_per_worker(self, tf.distribute.get_strategy())

        __init__.__wrapped__ = original_init
        klass.__init__ = __init__
    _PER_WORKER_SHADOWS_INSTALLED = True
