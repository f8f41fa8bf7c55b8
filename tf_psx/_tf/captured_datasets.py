"""A `tf.data.Dataset` built on the coordinator and used inside a scheduled step: rebuilt in the step, or refused (TF 2.16.2-2.21).

A step function that iterates a dataset it did not build (TensorFlow
Recommenders' `FactorizedTopK` holds `candidates = movies.batch(128).map(movie_model)`
and reduces over it in every train and test step) captures the dataset's
variant, an eager tensor of the coordinator. TF cannot send a variant to a
worker: it logs "The Encode() method is not implemented for
DatasetVariantWrapper objects" and the step fails with "Unable to parse
tensor proto".

While tf_psx traces a scheduled step (a graph `mark_step_graph` marked), such a dataset is
rebuilt inside the step instead, when it is a `map` over finite data that
holds no resource (the usual shape: ids or rows in memory, batched, mapped
through a model): the input's elements are read once on the coordinator and
the map function (the user's Python function, a tower model) is called in
the step on each of them, so it reads the model's current variables on the
parameter servers and a lookup layer's per-worker table, as the dataset
would without a strategy. The elements, the order and the element spec are
the dataset's. Any other dataset is refused before the first step with
`CapturedDatasetError`, naming the layer that holds it and the fix.
"""

from __future__ import annotations

import threading
import weakref

from tf_psx.errors import CapturedDatasetError

# Elements of the input read on the coordinator, at most: each is a constant of every step's closure.
MAX_INPUT_ELEMENTS = 4096
_INSTALLED: dict = {}
# tf_psx's step graphs being traced -> the function that names a dataset's holder.
_MARKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# Set while a dataset's input is read on the coordinator: its own variants are used as they are.
_READING = threading.local()
# A step graph -> {id(dataset): (dataset, the dataset rebuilt in it)}.
_REBUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def mark_step_graph(owner_of=None) -> None:
    """Marks the graph being traced (a tf_psx runner's) so that coordinator datasets it uses are rebuilt in it.

    Kept per graph (weakly), not per thread: TF traces a scheduled function
    in the worker thread that first runs it.
    """
    from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel,no-name-in-module

    _MARKED[ops.get_default_graph()] = owner_of or (lambda _dataset: None)


def _step_graph_mark(graph):
    """The mark of the tf_psx step graph that `graph` is (or is nested in), or False."""
    while graph is not None:
        if graph in _MARKED:
            return _MARKED[graph]
        graph = getattr(graph, "outer_graph", None)
    return False


def install() -> None:
    """Patches `DatasetV2._variant_tensor` so that a step graph `mark_step_graph` marked rebuilds what it captures."""
    if _INSTALLED:
        return
    from tensorflow.python.data.ops import dataset_ops  # pylint: disable=import-outside-toplevel,no-name-in-module
    from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel,no-name-in-module

    original = dataset_ops.DatasetV2._variant_tensor  # pylint: disable=protected-access

    def getter(self):
        variant = original.fget(self)
        if not isinstance(variant, ops.EagerTensor) or getattr(_READING, "active", False):
            return variant
        graph = ops.get_default_graph()
        owner_of = _step_graph_mark(graph) if getattr(graph, "building_function", False) else False
        if owner_of is False:
            return variant
        cache = _REBUILT.setdefault(graph, {})
        if id(self) not in cache:
            cache[id(self)] = (self, _rebuilt_in_step(self, owner_of))
        return cache[id(self)][1]._variant_tensor  # pylint: disable=protected-access

    dataset_ops.DatasetV2._variant_tensor = property(getter, original.fset)  # pylint: disable=protected-access
    _INSTALLED["original"] = original


def _owner(dataset, owner_of) -> str:
    found = owner_of(dataset)
    return f"held by {found}" if found else "held by the model or its step function"


def _refuse(dataset, owner_of, why: str):
    raise CapturedDatasetError(
        f"The model's step uses a tf.data.Dataset built on the coordinator ({_owner(dataset, owner_of)}; element spec "
        f"{dataset.element_spec}). A dataset cannot be sent to a worker, and tf_psx rebuilds one in the step only "
        f"when it is a `map` over finite in-memory data of at most {MAX_INPUT_ELEMENTS} elements that holds no "
        f"resource; this one {why}. Fix: build it as `tf.data.Dataset.from_tensor_slices(values).batch(n)"
        f".map(model)` (what TensorFlow Recommenders' tutorials pass to FactorizedTopK), or compute what the step "
        f"needs from tensors inside the step."
    )


def _rebuilt_in_step(dataset, owner_of):
    """`dataset` built again in the graph being traced: its map applied in the step to its input's elements."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    wrapper = getattr(dataset, "_map_func", None)
    source = getattr(dataset, "_input_dataset", None)
    python_function = getattr(wrapper, "_func", None)
    if wrapper is None or source is None or python_function is None:
        _refuse(dataset, owner_of, f"is a {type(dataset).__name__}, not a map")
    _READING.active = True
    try:
        elements = _read_input(dataset, source, owner_of)
    finally:
        _READING.active = False
    spec = dataset.element_spec
    rebuilt = None
    for element in elements:
        args = element if isinstance(element, tuple) else (element,)
        value = python_function(*args)
        one = tf.data.Dataset.from_tensors(tf.nest.map_structure(tf.convert_to_tensor, value))
        rebuilt = one if rebuilt is None else rebuilt.concatenate(one)
    if rebuilt is None:
        rebuilt = tf.data.Dataset.from_tensors(
            tf.nest.map_structure(lambda s: tf.zeros([d or 0 for d in s.shape], s.dtype), spec)).take(0)
    return rebuilt


def _read_input(dataset, source, owner_of) -> list:
    """The elements of `source` (a map's input), read on the coordinator; refused when it holds state or is large."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.python.data.ops import options as options_lib  # pylint: disable=import-outside-toplevel,no-name-in-module
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel,no-name-in-module
    from tensorflow.python.framework import ops  # pylint: disable=import-outside-toplevel,no-name-in-module

    with ops.init_scope():
        if not context.executing_eagerly():
            _refuse(dataset, owner_of, "was not built eagerly")
        try:
            source._as_serialized_graph(  # pylint: disable=protected-access
                external_state_policy=options_lib.ExternalStatePolicy.FAIL)
        except (tf.errors.OpError, ValueError) as error:
            _refuse(dataset, owner_of, f"maps an input that holds a resource or state ({str(error).splitlines()[0][:160]})")
        count = int(source.cardinality())
        if count < 0 or count > MAX_INPUT_ELEMENTS:
            _refuse(dataset, owner_of, f"maps an input of {'unknown or infinite' if count < 0 else count} elements")
        return list(source)
