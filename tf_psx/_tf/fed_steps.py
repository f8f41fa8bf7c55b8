"""A fit step's batches sent with the step: `ClusterCoordinator.schedule` given a `FedIterator` (TF 2.16.2).

tf_psx._tf.fit_inputs makes the coordinator read fit's and evaluate's
input; each epoch's iterator is a `FedIterator`. tf-keras's train and test
functions schedule `fn(iterator, ...)` on the coordinator, and
`schedule_with_batches` (wrapping `ClusterCoordinator.schedule`), given a
`FedIterator`, reads the step's batches and schedules a runner of `fn`
with them as arguments instead: dense batches packed into one vector per
dtype (`_Layout`), several batches of one execution stacked, the runner
traced once per layout.

Each scheduled step also gets a step token (tf_psx._tf.step_tokens), an
int64 argument that is the same in every attempt TF makes of the closure.
The token is visible to the exact updates, which apply each token once per
variable (tf_psx.training.step_once): with steps_per_execution=1 the runner traces
tf-keras's step straight into itself, or, for a model with TFRA layers'
per-worker shadows, tf-keras's own train function inside the token's scope
(a nested tf.function, which captures it). With steps_per_execution > 1 the
closure takes one token per step and the tokens travel with the stacked
batches: tf-keras's loop reads each step's token with its batch
(`_TokenedBatches`); a batch that runs alone in a multi-step function (a
short last batch, or a batch with sparse or ragged parts, which are not
stacked) is a one-step dataset of its token and batch; a model with TFRA
parts gets that iterator in tf-keras's own multi-step function (nested).
Not reached: a TFRA model's train function first traced outside a runner
(`_token_reaches`). A re-run there may apply a step's
update twice where the first attempt got to (counted:
`cluster/closure_retries`).
"""

from __future__ import annotations

import inspect

import numpy as np
import tensorflow as tf

from tf_psx._tf import captured_datasets as _captured, step_tokens as _step_tokens, tfra as _tfra
from tf_psx._tf import versions as _versions, worker_scratch as _worker_scratch
from tf_psx._tf.keras import wrapped_like

# tf-keras's Python train / test function called from the runner's own tf.function, converted explicitly
# (TF 2.21's AutoGraph rules leave tf_keras unconverted: tf_psx._tf.versions.call_converted).
_call_converted = _versions.autograph_artifact(_versions.call_converted)

# Layouts kept per input (one per batch shape seen: the full batches and a short last one).
MAX_LAYOUTS = 64
# Fed steps kept queued ahead of the workers, per worker (at least MIN_AHEAD): enough that a worker that
# finishes a step finds the next one queued, few enough that the batches in the queue stay a few steps'
# worth (TF's queue holds 262,144 closures, so an epoch read faster than it trains was held in memory whole)
# and a barrier (`coordinator.join()`: a snapshot, the end of an epoch) waits for a few steps, not a backlog.
AHEAD_PER_WORKER = 2
MIN_AHEAD = 4


class FedIterator:
    """One epoch's iterator on the coordinator; `ClusterCoordinator.schedule` sends its batches with the step."""

    def __init__(self, iterator, handler, packer=None):
        self._iterator = iterator
        self._handler = handler
        self._ended = False
        self.layouts = handler.layouts
        self._packer = packer  # a `Packer` when the pipeline packs its batches

    def take(self, count: int) -> list:
        """The next `count` batches (fewer at the end); StopIteration when none is left."""
        batches = []
        while not self._ended and len(batches) < count:
            try:
                element = next(self._iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                self._ended = True
            else:
                batches.append(self._packer.received(element) if self._packer is not None else element)
        if not batches:
            raise StopIteration
        self._handler.fed += len(batches)
        return batches

    def __iter__(self):
        return self

    def __next__(self):  # a caller that reads it as an iterator (a custom loop) gets batches
        batch = self.take(1)[0]
        return batch.layout.unpack(batch.parts) if isinstance(batch, Packed) else batch


def _dense(value) -> bool:
    return isinstance(value, (tf.Tensor, np.ndarray)) or np.isscalar(value)


class _Layout:
    """How a batch's dense components travel: one flat vector per dtype, and where each component sits in it.

    Sending a batch of 28 tensors (26 id features, the dense features, the
    labels) cost the coordinator 2.4 ms per step in `schedule` and each
    tensor its own transfer; packed into one vector per dtype, 1.3 ms.
    Hashable: a runner is traced once per layout.
    """

    def __init__(self, structure, components):
        """`structure`: the batch's nest (leaves None); `components`: (shape, dtype) of each leaf, flattened."""
        self.structure = structure
        dtypes: list = []
        offsets: dict = {}
        self.parts = []  # (dtype index, start, shape, dtype) per component
        for shape, dtype in components:
            dtype = tf.as_dtype(dtype)
            if dtype not in dtypes:
                dtypes.append(dtype)
            start = offsets.get(dtype, 0)
            shape = tuple(int(d) for d in shape)
            offsets[dtype] = start + int(np.prod(shape, dtype=np.int64))
            self.parts.append((dtypes.index(dtype), start, shape, dtype))
        self.dtypes = tuple(dtypes)
        self._key = (repr(self.structure), tuple(self.parts))

    @classmethod
    def of(cls, batch) -> "_Layout":
        return cls(tf.nest.map_structure(lambda _: None, batch),
                   [(value.shape, value.dtype) for value in tf.nest.flatten(batch)])

    def __eq__(self, other):
        return isinstance(other, _Layout) and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def pack(self, batch) -> tuple:
        """One tensor per dtype (numpy concatenation on the coordinator: no TF op per component)."""
        if isinstance(batch, Packed):  # packed by the pipeline already
            return batch.parts
        flat = [np.asarray(value).reshape(-1) for value in tf.nest.flatten(batch)]
        groups = [[] for _ in self.dtypes]
        for (index, _, _, _), value in zip(self.parts, flat):
            groups[index].append(value)
        return tuple(tf.constant(np.concatenate(group) if len(group) > 1 else group[0], dtype)
                     for group, dtype in zip(groups, self.dtypes))

    def unpack(self, packed):
        """The batch back from `pack`'s tensors (in a traced function: slices and reshapes)."""
        values = [tf.reshape(packed[index][start:start + int(np.prod(shape, dtype=np.int64))], shape)
                  for index, start, shape, _ in self.parts]
        return tf.nest.pack_sequence_as(self.structure, values)


def _shape_of(value):
    shape_tuple = getattr(value, "_shape_tuple", None)  # an EagerTensor's, without building a TensorShape
    return shape_tuple() if shape_tuple is not None else np.shape(value)


def _layout_of(batch, layouts: dict):
    """The batch's `_Layout`, or None when a component is not dense (sparse, ragged): it travels as it is.

    `layouts` caches them for one input, whose batches share one structure,
    by the components' shapes and dtypes (building one costs 0.4 ms for 28
    components; looking it up, 0.03 ms).
    """
    if isinstance(batch, Packed):
        return batch.layout
    flat = tf.nest.flatten(batch)
    if not flat or not all(_dense(value) for value in flat):
        return None
    key = tuple((_shape_of(value), getattr(value, "dtype", None)) for value in flat)
    layout = layouts.get(key)
    if layout is None:
        if len(layouts) >= MAX_LAYOUTS:
            layouts.clear()
        layout = layouts[key] = _Layout.of(batch)
    return layout


class Packed:
    """A batch the input pipeline packed (`Packer`): its layout and one tensor per dtype."""

    __slots__ = ("layout", "parts")

    def __init__(self, layout: _Layout, parts: tuple):
        self.layout, self.parts = layout, parts


class Packer:
    """Packs a dataset's batches into `_Layout`'s vectors inside its own pipeline.

    The coordinator then only schedules each step: the copies run in
    tf.data's threads, ahead of the step (measured in bench/exact_fit.py:
    the coordinator's CPU per step of a 28-component batch, packed in numpy
    after reading, against packed by the pipeline). Each element becomes
    (every component's shape, one vector per dtype); `received` turns it
    into a `Packed`, its layout found by the shapes (a short last batch has
    a layout of its own). Only for batches of dense tensors of known rank
    (`usable`); other inputs are read and sent as they are.
    """

    def __init__(self, element_spec):
        flat = tf.nest.flatten(element_spec)
        self.usable = bool(flat) and all(
            type(spec) is tf.TensorSpec and spec.shape.rank is not None for spec in flat)  # pylint: disable=unidiomatic-typecheck  (not a subclass: sparse, ragged)
        self._structure = tf.nest.map_structure(lambda _: None, element_spec)
        self._dtypes = [spec.dtype for spec in flat]
        self._ranks = [spec.shape.rank for spec in flat] if self.usable else []
        order: list = []
        for dtype in self._dtypes:
            if dtype not in order:
                order.append(dtype)
        self._groups = [[i for i, dtype in enumerate(self._dtypes) if dtype == wanted] for wanted in order]
        self._layouts: dict = {}

    def apply(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """`dataset` with its batches packed (unchanged when not `usable`)."""
        if not self.usable:
            return dataset

        def pack(*element):
            flat = tf.nest.flatten(element[0] if len(element) == 1 else element)
            shapes = tf.concat([tf.shape(value, out_type=tf.int64) for value in flat] + [tf.zeros([0], tf.int64)], 0)
            parts = tuple(tf.concat([tf.reshape(flat[i], [-1]) for i in group], 0) for group in self._groups)
            return (shapes,) + parts

        return dataset.map(pack, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).prefetch(tf.data.AUTOTUNE)

    def received(self, element) -> Packed:
        """The `Packed` batch of one element of `apply`'s dataset."""
        shapes, parts = element[0], tuple(element[1:])
        key = shapes.numpy().tobytes()
        layout = self._layouts.get(key)
        if layout is None:
            values, components, at = shapes.numpy().tolist(), [], 0
            for rank, dtype in zip(self._ranks, self._dtypes):
                components.append((values[at:at + rank], dtype))
                at += rank
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[key] = _Layout(self._structure, components)
        return Packed(layout, parts)


class _TokenedBatches:
    """The iterator tf-keras's multi-step train function reads: each step's batch, its token set as it is read.

    Wraps an iterator of (token, batch); tf-keras reads the batch
    (`next(iterator)`) before the step's `strategy.run`, so the step traced
    after the read sees its own token (`step_tokens.set_current`).
    """

    def __init__(self, iterator):
        self._iterator = iterator

    def __iter__(self):
        return self

    def __next__(self):
        token, batch = next(self._iterator)
        _step_tokens.set_current(token, _step_tokens.STEP)
        return batch


class _OneBatch:
    """The iterator tf-keras's train and test functions read: its one batch (steps_per_execution=1)."""

    def __init__(self, batch):
        self._batch = batch

    def __iter__(self):
        return self

    def __next__(self):
        return self._batch


def _model_of(fn):
    """The tf-keras model whose train or test function is `fn` (read from its closure), or None."""
    python_function = getattr(fn, "python_function", None)
    if python_function is None or not getattr(python_function, "__closure__", None):
        return None
    try:
        model = inspect.getclosurevars(python_function).nonlocals.get("self")
    except (TypeError, ValueError):  # not a plain Python function
        return None
    return model if hasattr(model, "_flatten_layers") else None


def _shadows_in_use(fn) -> bool:
    """Whether the model of tf-keras's train or test function `fn` may use TFRA's per-worker shadows.

    Their handles are captured into the outermost traced function; traced
    straight into the runner, a model whose `call` is its own tf.function
    (TFRA's demo) failed with "cannot be accessed from here, because it was
    defined in FuncGraph(name=run)". Through tf-keras's own train function
    (the dataset path) it trains. Only a model with TFRA parts takes that
    path: the others keep their step tokens in a process that imported TFRA
    too. When `fn`'s model cannot be read (not tf-keras's function), every
    model does once shadows were installed (tf_psx._tf.shadows).
    """
    from tf_psx._tf import shadows  # pylint: disable=import-outside-toplevel

    if not shadows.per_worker_shadows_installed():
        return False
    known = fn.__dict__.get("_tf_psx_tfra_parts")
    if known is None:
        model = _model_of(fn)
        known = _tfra.model_has_tfra_parts(model) if model is not None else True
        fn.__dict__["_tf_psx_tfra_parts"] = known
    return known


def _dataset_owner_finder(fn):
    """A function naming the layer (and attribute) of `fn`'s model that holds a given dataset, or None."""

    def owner_of(dataset):
        model = _model_of(fn)
        if model is None:
            return None
        for layer in model._flatten_layers(include_self=True):  # pylint: disable=protected-access
            for name, value in vars(layer).items():
                if value is dataset:
                    return f"layer {layer.name!r} ({type(layer).__name__}), attribute {name!r}"
        return None

    return owner_of


def _token_reaches(fn) -> bool:
    """Whether tf-keras's one-step train function `fn` may see a step token when traced into a runner.

    True when its first trace is a runner's: the exact updates make their
    token rings in the trace that first sees a token, and tf.function
    refuses a variable made in any trace but its first ("only supports
    singleton tf.Variables created on the first call"). A train function
    first traced elsewhere (a `DatasetCreator` fit) keeps running without
    tokens.
    """
    reaches = fn.__dict__.get("_tf_psx_token_reaches")
    if reaches is None:
        reaches = fn.__dict__["_tf_psx_token_reaches"] = fn.experimental_get_tracing_count() == 0
    return reaches


def _runner(fn, layout, stacked: bool):
    """`fn(iterator, *rest)` made a function of a step token and the step's batches, traced once per (layout, stacked).

    steps_per_execution=1: `fn`'s Python function reads the batch directly
    (no dataset built per step on the worker). Otherwise `fn`'s loop reads a
    dataset of the batches (stacked when there are several).
    """
    cache = fn.__dict__.setdefault("_tf_psx_runners", {})
    key = (layout, stacked)
    if key not in cache:
        python_function = getattr(fn, "python_function", None)

        def run(token, batches, *rest):
            _captured.mark_step_graph(_dataset_owner_finder(fn))  # a dataset of the coordinator: rebuilt here
            if not stacked and not rest and python_function is not None and not _shadows_in_use(fn):
                batch = layout.unpack(batches) if layout is not None else batches
                with _step_tokens.tracing_with(token, _step_tokens.STEP):
                    return _call_converted(python_function, _OneBatch(batch), *rest)
            tfra = _shadows_in_use(fn)
            if (stacked or rest) and python_function is not None and (not tfra or _token_reaches(fn)):
                # Several steps in one execution, each with its own token (the closure's `count` numbers from
                # `token`): the tokens travel with the batches, and tf-keras's loop reads one per step. A lone
                # batch of a multi-step function (a short last batch, a batch of sparse or ragged parts) is a
                # one-element dataset of its token and batch. A model with TFRA parts runs tf-keras's own
                # multi-step function (a nested tf.function: `_shadows_in_use`), given the same iterator.
                if stacked:
                    count = tf.shape(batches[0], out_type=tf.int64)[0]
                    data = tf.data.Dataset.from_tensor_slices((token + tf.range(count), batches))
                    data = data.map(lambda step_token, parts: (step_token, layout.unpack(parts)))
                else:
                    data = tf.data.Dataset.from_tensors((token, layout.unpack(batches) if layout is not None else batches))
                with _step_tokens.tracing_with(None, ""):
                    if tfra:
                        return fn(_TokenedBatches(iter(data)), *rest)
                    return _call_converted(python_function, _TokenedBatches(iter(data)), *rest)
            if stacked:
                data = tf.data.Dataset.from_tensor_slices(batches)
                if layout is not None:
                    data = data.map(lambda *parts: layout.unpack(parts))  # a tuple element: one argument each
                return fn(iter(data), *rest)
            data = tf.data.Dataset.from_tensors(layout.unpack(batches) if layout is not None else batches)
            if rest or not _token_reaches(fn):
                return fn(iter(data), *rest)
            # One step (a TFRA model's) through tf-keras's own train function: it carries the token too, so a
            # re-run after a worker failure applies its updates once (tests/scripts/exact_crash.py --tfra).
            with _step_tokens.tracing_with(token, _step_tokens.STEP):
                return fn(iter(data))

        cache[key] = tf.function(run, reduce_retracing=True)
    return cache[key]


def _groups(batches: list, layouts: dict) -> list[tuple]:
    """(layout, batches) of consecutive batches with one layout (None: not dense), in order."""
    groups: list[tuple] = []
    for batch in batches:
        layout = _layout_of(batch, layouts)
        if groups and layout is not None and groups[-1][0] == layout:
            groups[-1][1].append(batch)
        else:
            groups.append((layout, [batch]))
    return groups


def wait_for_room(coordinator) -> None:
    """Returns once fewer than `ahead` closures are queued (not yet taken by a worker), or the queue failed or stopped.

    Woken by every closure a worker takes (TF's queue notifies its free-slot
    condition then). It waits as long as `coordinator.join()` would for the
    same closures, and no longer: a failed closure (the queue's error)
    returns at once, and the `schedule` that follows raises it. A worker
    that stops taking closures is reported by the stall doctor
    (tf_psx.training.stalls) and, in sync mode, failed by the sync watchdog, as a
    `join()` is.
    """
    queue = coordinator._cluster.closure_queue  # pylint: disable=protected-access
    ahead = max(MIN_AHEAD, AHEAD_PER_WORKER * len(coordinator._cluster.workers))  # pylint: disable=protected-access

    def room() -> bool:
        return (queue._queue.qsize() < ahead or queue._error is not None  # pylint: disable=protected-access
                or not queue._should_process_closures)  # pylint: disable=protected-access

    with queue._queue_lock:  # pylint: disable=protected-access
        while not room():
            # A timeout only re-checks: a notify meant for TF's own `put` (a full queue) is not lost to it.
            queue._queue_free_slot_condition.wait(timeout=1.0)  # pylint: disable=protected-access


def _schedule_fed(coordinator, schedule, fn, fed: FedIterator, rest: tuple):
    """Reads the step's batches and schedules `fn` with them; returns the last step's RemoteValue."""
    count = int(rest[0]) if rest else 1  # tf-keras passes steps_per_execution when it is not 1
    wait_for_room(coordinator)
    result = None
    for layout, group in _groups(fed.take(count), fed.layouts):
        if layout is None:
            singles = [((batch,), False) for batch in group]
        elif len(group) == 1:
            singles = [((layout.pack(group[0]),), False)]
        else:
            packed = [layout.pack(batch) for batch in group]
            singles = [((tuple(tf.stack(parts) for parts in zip(*packed)),), True)]
        for args, stacked in singles:
            steps = len(group) if stacked else 1
            if rest:
                args += (tf.constant(steps, tf.convert_to_tensor(rest[0]).dtype),)
            token = tf.constant(_step_tokens.next_token(steps), tf.int64)
            result = schedule(coordinator, _runner(fn, layout, stacked), args=(token,) + args)
    return result


def _keras_step_of_worker_data(fn, args) -> bool:
    """Whether `fn` is tf-keras's train or test function given a per-worker iterator (fit of a `DatasetCreator`).

    Only those wait for room: a custom loop's `schedule` keeps TF's
    meaning (it returns at once; TF's fault-tolerance tests schedule while
    a worker is down and restart it afterwards).
    """
    from tensorflow.python.distribute.coordinator import values  # pylint: disable=import-outside-toplevel,no-name-in-module

    name = getattr(getattr(fn, "_python_function", None), "__name__", None)
    return (name in ("train_function", "test_function") and bool(args)
            and isinstance(args[0], values.PerWorkerDistributedIterator))


def schedule_with_batches(original):
    """`ClusterCoordinator.schedule` that, given a `FedIterator` first, reads the step's batches and sends them with it."""

    def checked(self, fn, args=None, kwargs=None):
        # A step's scratch variables get a copy per worker before its first dispatch (tf_psx._tf.worker_scratch).
        return original(self, _worker_scratch.checked(self, fn, args, kwargs), args=args, kwargs=kwargs)

    def schedule(self, fn, args=None, kwargs=None):
        if args and isinstance(args[0], FedIterator) and not kwargs:
            return _schedule_fed(self, checked, fn, args[0], tuple(args[1:]))
        if _keras_step_of_worker_data(fn, args):
            wait_for_room(self)  # fit or evaluate of a DatasetCreator: bounded ahead too
        return checked(self, fn, args=args, kwargs=kwargs)

    return wrapped_like(schedule, original)
