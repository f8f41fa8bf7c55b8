"""`model.fit` of arrays or of a finite dataset with no `steps_per_epoch`, and `*_on_batch`, under ParameterServerStrategy (tf-keras 2.16).

Under a ClusterCoordinator every worker reads its own copy of fit's input,
and an epoch is `steps_per_epoch` steps, which TF asks for:
- `fit(x_array, y_array, batch_size=..., epochs=...)`, the line most Keras
  scripts have, failed with tf-keras's "When using a DatasetCreator,
  `steps_per_epoch` ... must be provided" (tf-keras turns arrays into one);
- `fit(finite_dataset)` failed once a worker's copy ran out, with
  `CancelledError ... End of sequence` from deep inside TF.

Here such a fit runs one pass of the data per epoch, as it does without a
strategy:
- `steps_per_epoch` is the number of batches in one pass: `ceil(n /
  batch_size)` for arrays, the dataset's cardinality for a dataset.
- Worker w of W reads every W-th piece of the data from w on (examples of
  arrays, batches of a dataset), over and over, so that no worker runs out
  and two workers never read the same piece in one pass. Arrays are
  reshuffled on each pass when `shuffle` is true (fit's default), within the
  worker's part.
- `validation_split` and array `validation_data` become a dataset, which
  `tf_psx._tf.evaluation` evaluates exactly; `evaluate(x_array, y_array)`
  with no `steps` likewise.
- `class_weight`, which tf-keras drops without a word under a coordinator
  (`_ClusterCoordinatorDataHandler` never applies it), is applied to the
  batches of every input: arrays, datasets and `DatasetCreator`s.

`train_on_batch`, `test_on_batch` and `predict_on_batch` failed under a
coordinator too; here the first two run their step on a worker, and
`predict_on_batch` runs on the coordinator, as tf-keras's `predict` does.

Known limitations:
- Steps go to whichever worker is free. When workers do not keep pace, one
  epoch reads more of a fast worker's part (it starts its next pass) and
  less of a slow one's, which that worker reads in the next epoch. Every
  epoch has the same number of steps; with one worker, or workers of equal
  speed, each epoch reads each example once.
- A dataset shuffled with no seed is shuffled anew on each worker, so the
  workers' parts are not disjoint: each batch is then read once per epoch
  on average.
- A dataset of unknown or infinite size gets an error that names
  `steps_per_epoch` (an epoch would never end, or its length is unknown).
"""

from __future__ import annotations

import inspect
import math
import threading

import tensorflow as tf
from tensorflow.python.distribute import input_lib  # pylint: disable=no-name-in-module
from tensorflow.python.distribute.coordinator import values as coordinator_values  # pylint: disable=no-name-in-module
from tf_keras.src.engine import data_adapter

from tf_psx._tf.keras import keras, wrapped_like
from tf_psx._tf.runtime import is_parameter_server_strategy

_install_lock = threading.Lock()
_INSTALLED = False
# tf-keras's own default batch size for array inputs (Model.fit, Model.evaluate).
DEFAULT_BATCH_SIZE = 32


class _Parts(keras().utils.experimental.DatasetCreator):
    """fit's input cut into one endless part per worker: `make(index, count)` builds worker `index`'s dataset."""

    def __init__(self, make):
        super().__init__(self._not_called)
        self.make = make

    @staticmethod
    def _not_called(_context):
        raise RuntimeError("tf_psx: a per-worker input was read as a plain DatasetCreator")


class _PerWorkerParts(coordinator_values.PerWorkerDatasetFromDatasetFunction):
    """TF's per-worker dataset, but each worker's dataset function gets the worker's index.

    TF calls one dataset function, with no argument, on every worker. Here the
    index travels as the closure's argument, and TF keeps it: a worker that
    fails and comes back rebuilds the same part.
    """

    def __init__(self, make, coordinator):  # pylint: disable=super-init-not-called
        self._workers = list(coordinator._cluster.workers)  # pylint: disable=protected-access
        count = len(self._workers)

        def disallow_variable_creation(next_creator, **kwargs):  # as TF's per-worker datasets
            raise ValueError("Creating variables in fit's input is not allowed.")

        with tf.variable_creator_scope(disallow_variable_creation):
            self._dataset_fn = tf.function(lambda index: make(index, count)).get_concrete_function(
                tf.TensorSpec([], tf.int64))
        self._coordinator = coordinator
        self._element_spec = None

    def build(self):
        raise NotImplementedError("tf_psx: fit's per-worker input is only iterated")

    def __iter__(self):
        def make_iterator(index):
            return iter(self._dataset_fn(index))

        remote = tuple(worker.create_resource(make_iterator, args=(tf.constant(worker.worker_index, tf.int64),))
                       for worker in self._workers)
        spec = input_lib.get_iterator_spec_from_dataset(self._coordinator.strategy,
                                                         self._dataset_fn.structured_outputs)
        for value in remote:
            value._type_spec = spec  # pylint: disable=protected-access
        return coordinator_values.PerWorkerDistributedIterator(remote)


def _is_arrays(x, y) -> bool:
    return x is not None and data_adapter.TensorLikeDataAdapter.can_handle(x, y)


def _class_weighted(dataset: tf.data.Dataset, class_weight) -> tf.data.Dataset:
    return dataset if not class_weight else dataset.map(data_adapter._make_class_weight_map_fn(class_weight))  # pylint: disable=protected-access


def _array_dataset(x, y, sample_weight) -> tuple[tf.data.Dataset, int]:
    """One element per example, and the number of examples (tf-keras's conversions of arrays)."""
    arrays = data_adapter._process_tensorlike((x, y, sample_weight))  # pylint: disable=protected-access
    data_adapter._check_data_cardinality([a for a in arrays if a is not None])  # pylint: disable=protected-access
    count = int(tf.nest.flatten(arrays)[0].shape[0])
    return tf.data.Dataset.from_tensor_slices(data_adapter.pack_x_y_sample_weight(*arrays)), count


def _array_parts(x, y, sample_weight, batch_size, shuffle, class_weight) -> tuple[_Parts, int]:
    examples, count = _array_dataset(x, y, sample_weight)
    graph = coordinator_values.serialize_dataset_to_graph(examples)
    spec = examples.element_spec

    def make(index, workers):
        part = coordinator_values.deserialize_dataset_from_graph(graph, spec)
        if count >= workers:  # else every worker reads all of them (a part would be empty)
            part = part.shard(workers, index)
        if shuffle:
            part = part.shuffle(math.ceil(count / workers), reshuffle_each_iteration=True)
        return _class_weighted(part.batch(batch_size), class_weight).repeat().prefetch(tf.data.AUTOTUNE)

    return _Parts(make), math.ceil(count / batch_size)


def _dataset_steps(dataset: tf.data.Dataset, what: str) -> int:
    cardinality = int(dataset.cardinality())
    if cardinality == int(tf.data.INFINITE_CARDINALITY):
        raise ValueError(
            f"{what} under ParameterServerStrategy got an infinite dataset and no steps_per_epoch: its first "
            "epoch would never end. Received: steps_per_epoch=None. Fix: pass steps_per_epoch=N (the batches "
            "of one epoch).")
    if cardinality == int(tf.data.UNKNOWN_CARDINALITY):
        raise ValueError(
            f"{what} under ParameterServerStrategy needs the number of batches in one pass of the dataset, and "
            "TF cannot tell it (a filter, a file reader or a generator hides it). Received: steps_per_epoch=None. "
            "Fix: pass steps_per_epoch=N, or state the size with "
            "dataset.apply(tf.data.experimental.assert_cardinality(N)).")
    if cardinality == 0:
        raise ValueError(f"{what} got an empty dataset (0 batches). Fix: pass a dataset with at least one batch.")
    return cardinality


def _dataset_parts(dataset: tf.data.Dataset, class_weight) -> tuple[_Parts, int]:
    steps = _dataset_steps(dataset, "model.fit")
    graph = coordinator_values.serialize_dataset_to_graph(dataset)
    spec = dataset.element_spec

    def make(index, workers):
        whole = coordinator_values.deserialize_dataset_from_graph(graph, spec)
        # Fewer batches than workers: every worker reads all of them (a part would be empty).
        part = whole.shard(workers, index) if steps >= workers else whole
        return _class_weighted(part, class_weight).repeat().prefetch(tf.data.AUTOTUNE)

    return _Parts(make), steps


def _weighted_creator(creator, class_weight):
    def dataset_fn(context):
        return _class_weighted(creator(context), class_weight)

    return keras().utils.experimental.DatasetCreator(dataset_fn, input_options=creator.input_options)


def _batched(x, y, sample_weight, batch_size) -> tf.data.Dataset:
    examples, _ = _array_dataset(x, y, sample_weight)
    return examples.batch(batch_size or DEFAULT_BATCH_SIZE)


def _with_coordinator(model) -> bool:
    return is_parameter_server_strategy(model.distribute_strategy)


def _fit_arguments(arguments: dict) -> dict:
    """fit's arguments with its input made per-worker parts where tf-keras would fail or drop something."""
    x, y, sample_weight = arguments.get("x"), arguments.get("y"), arguments.get("sample_weight")
    class_weight = arguments.get("class_weight")
    changed = dict(arguments)
    if _is_arrays(x, y):
        validation_split = arguments.get("validation_split") or 0.0
        if validation_split and arguments.get("validation_data") is None:
            (x, y, sample_weight), changed["validation_data"] = data_adapter.train_validation_split(
                (x, y, sample_weight), validation_split=validation_split)
            changed["validation_split"] = 0.0
        batch_size = arguments.get("batch_size") or DEFAULT_BATCH_SIZE
        parts, steps = _array_parts(x, y, sample_weight, batch_size, bool(arguments.get("shuffle", True)),
                                    class_weight)
        changed.update(x=parts, y=None, sample_weight=None, batch_size=None, class_weight=None)
        if arguments.get("steps_per_epoch") is None:
            changed["steps_per_epoch"] = steps
    elif isinstance(x, tf.data.Dataset) and arguments.get("steps_per_epoch") is None:
        parts, steps = _dataset_parts(x, class_weight)
        changed.update(x=parts, class_weight=None, steps_per_epoch=steps)
    elif class_weight and isinstance(x, tf.data.Dataset):
        changed.update(x=_class_weighted(x, class_weight), class_weight=None)
    elif class_weight and isinstance(x, keras().utils.experimental.DatasetCreator):
        changed.update(x=_weighted_creator(x, class_weight), class_weight=None)
    validation = changed.get("validation_data")
    if validation is not None and not isinstance(validation, tf.data.Dataset):
        val_x, val_y, val_weight = data_adapter.unpack_x_y_sample_weight(validation)
        if _is_arrays(val_x, val_y):
            changed["validation_data"] = _batched(val_x, val_y, val_weight,
                                                  arguments.get("validation_batch_size") or arguments.get("batch_size"))
    return changed


def _per_worker_single_batch(coordinator):
    """tf-keras's `single_batch_iterator`, made for a coordinator: every worker can read the one batch.

    tf-keras distributed the batch with `experimental_distribute_dataset`,
    which ParameterServerStrategy refuses ("To use this dataset, you need to
    pass this dataset to ClusterCoordinator.create_per_worker_dataset"), so
    `train_on_batch` and `test_on_batch` failed. The step runs on whichever
    worker is free; the other workers' copies are never read and go with
    the iterator.
    """
    def single_batch_iterator(strategy, x, y=None, sample_weight=None, class_weight=None):  # pylint: disable=unused-argument
        arrays = data_adapter._process_tensorlike((x, y, sample_weight))  # pylint: disable=protected-access
        data = (arrays[0],) if arrays[1] is None else (arrays[:2] if arrays[2] is None else arrays)
        data_adapter._check_data_cardinality(data)  # pylint: disable=protected-access
        dataset = _class_weighted(tf.data.Dataset.from_tensors(data), class_weight)
        return iter(coordinator.create_per_worker_dataset(dataset))

    return single_batch_iterator


def _on_batch(original, coordinated: bool):
    """`train_on_batch` / `test_on_batch` (coordinated) or `predict_on_batch` for a model under a coordinator."""
    def on_batch(self, *args, **kwargs):
        if not _with_coordinator(self):
            return original(self, *args, **kwargs)
        if not coordinated:
            # As tf-keras's `predict`: the prediction runs on the coordinator, with the strategy set aside.
            strategy, coordinator = self._distribution_strategy, self._cluster_coordinator  # pylint: disable=protected-access
            self._distribution_strategy, self._cluster_coordinator = None, None  # pylint: disable=protected-access
            try:
                return original(self, *args, **kwargs)
            finally:
                self._distribution_strategy, self._cluster_coordinator = strategy, coordinator  # pylint: disable=protected-access
        if self._cluster_coordinator is None:  # pylint: disable=protected-access
            # tf-keras makes it in fit and evaluate only; without it the step ran on the coordinator.
            self._cluster_coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(  # pylint: disable=protected-access
                self.distribute_strategy)
        saved = data_adapter.single_batch_iterator
        data_adapter.single_batch_iterator = _per_worker_single_batch(self._cluster_coordinator)  # pylint: disable=protected-access
        try:
            return original(self, *args, **kwargs)
        finally:
            data_adapter.single_batch_iterator = saved

    return wrapped_like(on_batch, original)


def _configure_parts(original):
    def configure(self, strategy, x, steps_per_epoch, class_weight, distribute):
        if not isinstance(x, _Parts):
            return original(self, strategy, x, steps_per_epoch, class_weight, distribute)
        self._dataset = _PerWorkerParts(x.make, self._model._cluster_coordinator)  # pylint: disable=protected-access
        self._inferred_steps = steps_per_epoch
        return None

    return configure


def _named(signature, model, args, kwargs) -> tuple[dict, dict]:
    """A call's arguments by name (without `self`), and its extra `**kwargs` (tf-keras's private ones)."""
    arguments = dict(signature.bind(model, *args, **kwargs).arguments)
    arguments.pop("self")
    return arguments, arguments.pop("kwargs", {})


def install() -> None:
    """Wraps tf-keras `Model.fit`, `evaluate` (outside tf_psx._tf.evaluation's wrappers) and `*_on_batch` (once)."""
    global _INSTALLED  # pylint: disable=global-statement
    with _install_lock:
        if _INSTALLED:
            return
        model_class = keras().Model
        original_fit, original_evaluate = model_class.fit, model_class.evaluate
        fit_signature, evaluate_signature = inspect.signature(original_fit), inspect.signature(original_evaluate)

        def fit(self, *args, **kwargs):
            if not _with_coordinator(self):
                return original_fit(self, *args, **kwargs)
            arguments, extra = _named(fit_signature, self, args, kwargs)
            return original_fit(self, **_fit_arguments(arguments), **extra)

        def evaluate(self, *args, **kwargs):
            if not _with_coordinator(self):
                return original_evaluate(self, *args, **kwargs)
            arguments, extra = _named(evaluate_signature, self, args, kwargs)
            if arguments.get("steps") is None and _is_arrays(arguments.get("x"), arguments.get("y")):
                arguments["x"] = _batched(arguments.get("x"), arguments.get("y"), arguments.get("sample_weight"),
                                          arguments.get("batch_size"))
                arguments.update(y=None, sample_weight=None, batch_size=None)
            return original_evaluate(self, **arguments, **extra)

        model_class.fit = wrapped_like(fit, original_fit)
        model_class.evaluate = wrapped_like(evaluate, original_evaluate)
        model_class.train_on_batch = _on_batch(model_class.train_on_batch, coordinated=True)
        model_class.test_on_batch = _on_batch(model_class.test_on_batch, coordinated=True)
        model_class.predict_on_batch = _on_batch(model_class.predict_on_batch, coordinated=False)
        handler = data_adapter._ClusterCoordinatorDataHandler  # pylint: disable=protected-access
        handler._configure_dataset_and_inferred_steps = _configure_parts(  # pylint: disable=protected-access
            handler._configure_dataset_and_inferred_steps)  # pylint: disable=protected-access
        _INSTALLED = True
