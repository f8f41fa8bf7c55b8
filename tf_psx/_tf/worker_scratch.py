"""Scratch variables of a step made per worker: a variable the step overwrites before any read of it.

TensorFlow Recommenders' `Streaming` top-k layer (`FactorizedTopK`'s
default) keeps a row counter in a non-trainable variable: each call assigns
it 0, then a dataset map reads and advances it. Under a
ParameterServerStrategy the variable lives on a ps task, and two workers'
steps reset and advance it at once: `Requires start <= limit when delta > 0:
3346/18` in `enumerate_rows` (TF 2.21, TFRS 0.7.7, 2 workers). Such a
variable holds nothing from one step to the next, so each worker can have its
own.

The rule, read from the traced step (`scratch_variables`): a non-trainable
variable whose first op in the step, in program order, is an
`AssignVariableOp` (a whole overwrite, which cannot depend on a read of the
variable that comes after it). Metric totals (`assign_add` first), optimizer
state, moving averages (`assign_sub`), RNN states and random generators
(read first) stay where they are. A variable whose first use is inside a
nested function or a control-flow op is left as it is.

Such a variable gets a copy on every worker (tf_psx._tf.shadows'
per-worker handles, TF's `PerWorkerVariable` mechanism); reads outside a
dispatched step (eagerly on the coordinator, saving) see the original. The
step is then traced again (`Function._clone`), once.
"""

from __future__ import annotations

import logging
import weakref

logger = logging.getLogger("tf_psx")

# def_function.Function -> the function to schedule instead (itself when it has no scratch variable).
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# id(variable) -> weak reference: tf_psx's own variables that must stay where they are made (`keep_in_place`).
_KEPT: dict = {}


def keep_in_place(*variables) -> None:
    """Marks tf_psx's own variables (step-token rings, journals, sync state) as never per worker.

    A journal is written whole before the update it guards, so the rule
    would take it for scratch; a re-run on another worker must find it on
    the ps task.
    """
    for variable in variables:
        if variable is not None:
            inner = getattr(variable, "_v", variable)
            _KEPT[id(inner)] = weakref.ref(inner)


def _kept(variable) -> bool:
    ref = _KEPT.get(id(variable))
    return ref is not None and ref() is variable


def _variables_by_handle(graph) -> dict:
    """id(captured eager handle) -> the variable that owns it, for the variables the traced step touched."""
    found = {}
    for variable in graph.variables:
        inner = getattr(variable, "_v", variable)  # an AggregatingVariable wraps the ps variable
        handle = inner.__dict__.get("_handle")
        if handle is not None:
            found[id(handle)] = inner
    return found


def scratch_variables(graph) -> list:
    """The variables that `graph` (a traced step) overwrites whole before any other use of them."""
    from tf_psx._tf.shadows import _PerWorkerHandle  # pylint: disable=import-outside-toplevel

    owners = _variables_by_handle(graph)
    found = []
    for external, internal in graph.captures:
        variable = owners.get(id(external))
        if variable is None or variable.trainable or isinstance(variable, _PerWorkerHandle) or _kept(variable):
            continue
        consumers = internal.consumers()
        if not consumers:
            continue
        first = min(consumers, key=lambda op: op._id)  # pylint: disable=protected-access  (creation order)
        if first.type == "AssignVariableOp" and first.inputs[0] is internal:
            found.append(variable)
    return found


def _concrete(fn, args, kwargs):
    """`fn`'s concrete function for a schedule of `args`, `kwargs`: what `ClusterCoordinator.schedule` traces."""
    from tensorflow.python.distribute.coordinator import cluster_coordinator  # pylint: disable=import-outside-toplevel
    from tensorflow.python.util import nest  # pylint: disable=import-outside-toplevel

    as_spec = cluster_coordinator._maybe_as_type_spec  # pylint: disable=protected-access
    replica_args = cluster_coordinator._select_worker_slice(0, args or ())  # pylint: disable=protected-access
    replica_kwargs = cluster_coordinator._select_worker_slice(0, kwargs or {})  # pylint: disable=protected-access
    return fn.get_concrete_function(*nest.map_structure(as_spec, replica_args),
                                    **nest.map_structure(as_spec, replica_kwargs))


def checked(coordinator, fn, args, kwargs):
    """`fn`, or its retrace once its step's scratch variables are per worker (first schedule of each function)."""
    from tensorflow.python.eager.polymorphic_function import polymorphic_function  # pylint: disable=import-outside-toplevel

    if not isinstance(fn, polymorphic_function.Function):
        return fn
    done = _CHECKED.get(fn)
    if done is not None:
        return done
    from tf_psx._tf.shadows import _make_per_worker  # pylint: disable=import-outside-toplevel

    # Traced as `schedule` traces it: in the strategy's scope (slot variables made while tracing are placed by
    # it) and marked as being scheduled (else TF warns that the strategy is used outside `schedule`).
    extended = coordinator.strategy.extended
    with coordinator.strategy.scope():
        was = extended._being_scheduled  # pylint: disable=protected-access
        extended._being_scheduled = True  # pylint: disable=protected-access
        try:
            graph = _concrete(fn, args, kwargs).graph
        finally:
            extended._being_scheduled = was  # pylint: disable=protected-access
    found = scratch_variables(graph)
    replacement = fn
    if found:
        for variable in found:
            _make_per_worker(variable, coordinator.strategy)
        logger.info("Each step overwrites %s before reading it: every worker now has its own copy, so that two "
                    "workers' steps do not share it (the step was traced again, once).",
                    ", ".join(sorted(v.name for v in found)))
        replacement = fn._clone(python_function=None)  # pylint: disable=protected-access
        _CHECKED[replacement] = replacement
    _CHECKED[fn] = replacement
    return replacement
