"""TFRA 0.8.1's shadow buffers under TF 2.16.2's ParameterServerStrategy: per-worker copies, and direct writes.

TFRA trains a table through per-batch "shadow" buffers. Here: each worker
gets its own copy of them (`install_per_worker_shadows`), and tf_psx's table
updates (tf_psx.training.exact_updates) and sync steps (tf_psx.training.sync_training) load a
buffer with rows of their own (`write_buffer`) and tie a shadow's checkpoint
to its slots (`track_optimizer_slots`), as TFRA's own apply does. Inside
`buffers_on(device, shadows)` the shadows read and write a buffer on a ps
task instead (a table's update made there, under its lock).
"""

from __future__ import annotations

import contextlib

from tf_psx._tf.runtime import is_parameter_server_strategy
from tf_psx._tf.tfra import install_prefetch, tfra

_PER_WORKER_SHADOWS_INSTALLED = False


# Prefix of the shared_name of a shadow's worker-local copy; the rest is the
# variable's unique id, so each shadow (and its ids, exists and slot shadows)
# gets its own resource on every worker.
_PER_WORKER_SHARED_NAME_PREFIX = "tf_psx_per_worker/"


_PER_WORKER_CLASSES: dict[type, type] = {}
# A shadow's buffer on a ps task while `buffers_on` holds it: the handle tensor of the traced step.
_ON_PS_ATTR = "_tf_psx_on_ps_handle"
# Prefix of that buffer's shared_name; the rest is the shadow's unique id.
_ON_PS_SHARED_NAME_PREFIX = "tf_psx_on_ps/"


def outermost_func_graph(graph):
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
        on_ps = self.__dict__.get(_ON_PS_ATTR)
        if on_ps is not None:  # inside `buffers_on`
            return on_ps
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

        graph = outermost_func_graph(tf.compat.v1.get_default_graph())
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


def per_worker_shadows_installed() -> bool:
    """True once `install_per_worker_shadows` ran in this process."""
    return _PER_WORKER_SHADOWS_INSTALLED


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
    # A lookup also records which keys existed: the exact update sends the forward rows of absent keys only.
    install_prefetch()
    _PER_WORKER_SHADOWS_INSTALLED = True


def write_buffer(buffer, value):
    """Writes `value` into a shadow buffer through its handle (in a dispatched step: that worker's copy).

    Returns the assign op; the optimizer's apply then reads the buffer as
    loaded here.
    """
    from tensorflow.python.ops import gen_resource_variable_ops  # pylint: disable=import-outside-toplevel

    return gen_resource_variable_ops.assign_variable_op(buffer.handle, value)


def track_optimizer_slots(shadow, slots: list) -> None:
    """As TFRA's own apply does: the shadow's checkpoint and restrict policy follow its slots."""
    shadow._track_optimizer_slots(slots)  # pylint: disable=protected-access


def has_per_worker_copies(buffer) -> bool:
    """True when `buffer` is a shadow switched to worker-local copies (`install_per_worker_shadows`)."""
    return isinstance(buffer, _PerWorkerHandle)


@contextlib.contextmanager
def buffers_on(device: str, buffers: list, tag: str = ""):
    """Inside, each of `buffers` (shadows with worker-local copies) is a buffer on `device` instead.

    One buffer per shadow and `tag` on the task (a `VarHandleOp` with a
    shared name, made in the graph being traced; a table shard's update
    passes its shard index as `tag`, so two shards on one task get their
    own): shared by every worker's steps, so its user holds a lock while it
    writes and reads it (the shard's, tf_psx.tables.tfra_updates). What the
    optimizer's ops on the shadows then read and write stays on `device`.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import gen_resource_variable_ops  # pylint: disable=import-outside-toplevel

    with tf.device(device):
        for buffer in buffers:
            buffer.__dict__[_ON_PS_ATTR] = gen_resource_variable_ops.var_handle_op(
                dtype=buffer.dtype, shape=None,
                shared_name=f"{_ON_PS_SHARED_NAME_PREFIX}{buffer._unique_id}{tag}")  # pylint: disable=protected-access
    try:
        yield
    finally:
        for buffer in buffers:
            buffer.__dict__.pop(_ON_PS_ATTR, None)


# Prefix of the shared_name of a buffer on a ps task that is no shadow's (`task_buffer`).
_TASK_BUFFER_PREFIX = "tf_psx_task_buffer/"


class TaskBuffer:
    """A buffer on a ps task of any shape (a `VarHandleOp` with a shared name, made in the graph being traced).

    Shared by every worker's steps on that task, like `buffers_on`'s: its
    user holds a lock while it writes and reads it. A tf.Variable of unknown
    shape fails TF 2.16's remote function calls; a raw handle does not.
    """

    def __init__(self, device: str, name: str, dtype):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        from tensorflow.python.ops import gen_resource_variable_ops  # pylint: disable=import-outside-toplevel

        self.dtype = dtype
        with tf.device(device):
            self.handle = gen_resource_variable_ops.var_handle_op(
                dtype=dtype, shape=None, shared_name=f"{_TASK_BUFFER_PREFIX}{name}")

    def write(self, value):
        return write_buffer(self, value)

    def read(self):
        from tensorflow.python.ops import gen_resource_variable_ops  # pylint: disable=import-outside-toplevel

        return gen_resource_variable_ops.read_variable_op(self.handle, self.dtype)

    def written(self):
        """A bool tensor: the buffer was ever written."""
        from tensorflow.python.ops import gen_resource_variable_ops  # pylint: disable=import-outside-toplevel

        return gen_resource_variable_ops.var_is_initialized_op(self.handle)
