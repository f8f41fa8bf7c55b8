"""`model.fit`, `evaluate` and `*_on_batch` under ParameterServerStrategy: the coordinator reads the input (tf-keras 2.16).

Under a ClusterCoordinator, tf-keras gives every worker its own copy of the
input and schedules each step on whichever worker is free; the step reads
the next batch of *that worker's* copy. TF refuses most of what Keras users
pass (arrays, finite datasets with no `steps_per_epoch`, `verbose=1`), and a
split of the data into per-worker parts does not give one pass per epoch:
with 2 workers of equal speed and 40 batches, 7 batches were trained twice
and 7 never in one epoch, because the steps do not alternate between the
workers.

Here the coordinator reads the input itself, exactly as tf-keras reads it
without a strategy (tf-keras's own `DataHandler`, with its adapters for
arrays, datasets, generators and `Sequence`s, `class_weight`,
`steps_per_epoch`, `steps_per_execution` and its "ran out of data"
handling), and sends the batches of each step *with* the step, as the
arguments of the scheduled function. So:
- an epoch trains every example exactly once, whatever the number and the
  speed of the workers (a step is one closure that carries its batches);
- a step that TF re-runs after a worker failure re-runs with the same
  batches;
- a dataset of unknown size runs one pass per epoch, and `evaluate` and
  fit's validation visit each batch once, for any model (subclassed, custom
  `test_step`, `add_loss`, `add_metric`), since they run tf-keras's own
  `test_function`; the metric variables live on the ps tasks and every
  update of them is an atomic add;
- a resumed `fit` (`PeriodicSync`, `BackupAndRestore`) continues at the
  step it stopped at, in the same order: arrays are shuffled with a seed
  per epoch number (`shuffle_seed`), and a dataset is skipped to the step.

Mechanics: `get_data_handler` returns `_FedDataHandler` (a local tf-keras
`DataHandler`, not distributed) under a coordinator; each epoch's iterator
is wrapped in a `FedIterator`; tf-keras's train and test functions schedule
`fn(iterator, ...)` on the coordinator, and `ClusterCoordinator.schedule`,
given a `FedIterator`, reads the step's batches and schedules a runner of
`fn` with the batches as its arguments instead (tf_psx._tf.fed_steps).

`train_on_batch` and `test_on_batch` run their step on a worker, and
`predict_on_batch` on the coordinator, as tf-keras's `predict` does.
`verbose=1` gives a progress bar (tf_psx._tf.fit_progress), which
tf-keras refuses under a coordinator.

Known limitations:
- The batches travel from the coordinator to the workers, so the input rate
  is bounded by one process's reading (docs/guides/input.md says how to put
  the reading on other hosts with the tf.data service).
- A dataset shuffled with no seed is reshuffled by tf.data on every pass,
  so a resumed fit skips to the right step of a different order; give the
  shuffle a seed for an exact resume.
- `DatasetCreator` keeps TF's meaning: each worker runs the function and
  reads its own dataset, and `steps_per_epoch` is required.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute.coordinator import cluster_coordinator as _cluster_coordinator  # pylint: disable=no-name-in-module
from tensorflow.python.distribute.coordinator import values as _coordinator_values  # pylint: disable=no-name-in-module
from tf_keras.src.engine import data_adapter

from tf_psx._tf import fed_steps as _fed_steps, fit_progress as _fit_progress
from tf_psx._tf.keras import keras, wrapped_like
from tf_psx._tf.runtime import closure_retries, is_parameter_server_strategy
from tf_psx.errors import ArgumentError

logger = logging.getLogger("tf_psx")

_install_lock = threading.Lock()
_INSTALLED = False
# tf-keras's own default batch size for array inputs (Model.fit, Model.evaluate).
DEFAULT_BATCH_SIZE = 32
# The shuffle of arrays in epoch e uses the seed (SHUFFLE_SEED, e): the same order on a resume.
SHUFFLE_SEED = 20_240_601


class _FedDataHandler(data_adapter.DataHandler):
    """tf-keras's local `DataHandler`, read by the coordinator: batches go to the workers with their steps."""

    def __init__(self, x=None, y=None, sample_weight=None, batch_size=None, steps_per_epoch=None, initial_epoch=0,
                 epochs=1, shuffle=False, class_weight=None, max_queue_size=10, workers=1, use_multiprocessing=False,
                 model=None, steps_per_execution=None, distribute=True, pss_evaluation_shards=0):  # pylint: disable=unused-argument
        self._stream = None
        if _is_arrays(x, y):
            batch_size = batch_size or DEFAULT_BATCH_SIZE
            self._stream, count = _array_stream(x, y, sample_weight, batch_size, shuffle)
            per_pass = math.ceil(count / batch_size)
            steps_per_epoch = steps_per_epoch or per_pass
            x, y, sample_weight, batch_size = self._stream(0), None, None, None
        elif isinstance(x, tf.data.Dataset):
            _check_countable(x, steps_per_epoch, _call_of(model))
        super().__init__(x=x, y=y, sample_weight=sample_weight, batch_size=batch_size,
                         steps_per_epoch=steps_per_epoch, initial_epoch=initial_epoch, epochs=epochs,
                         shuffle=shuffle, class_weight=class_weight, max_queue_size=max_queue_size,
                         workers=workers, use_multiprocessing=use_multiprocessing, model=model,
                         steps_per_execution=steps_per_execution, distribute=False)
        self._requested_initial_epoch = initial_epoch
        self._class_weight = class_weight
        self.fed = 0  # batches fed in this epoch
        self._epoch_start = 0
        self.layouts: dict = {}  # the batch layouts of this input (tf_psx._tf.fed_steps)
        self._packer = None  # packs this input's batches in its pipeline (tf_psx._tf.fed_steps.Packer)

    def _positioned(self, epoch: int, fresh_each_epoch: bool):
        """This epoch's iterator, at the step fit starts from (after a resume); its batches packed by the pipeline."""
        start = self._initial_step
        if self._stream is not None:
            stream = self._stream(epoch * self._inferred_steps + start)
            if self._class_weight:
                stream = stream.map(data_adapter._make_class_weight_map_fn(self._class_weight))  # pylint: disable=protected-access
            return iter(self._packed(stream))
        if not fresh_each_epoch and self._inferred_steps:
            # One iterator for all epochs: the epochs a resume skipped were read from it too.
            start += (epoch - self._requested_initial_epoch) * self._inferred_steps
        return _local_iterator(self._packed(self._dataset.skip(start) if start else self._dataset))

    def _packed(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        if self._packer is None:
            self._packer = _fed_steps.Packer(dataset.element_spec)
        return self._packer.apply(dataset)

    def enumerate_epochs(self):
        """Yields `(epoch, FedIterator)`, as tf-keras's `enumerate_epochs` yields its iterators."""
        with self._truncate_execution_to_epoch():
            iterator = None
            for epoch in range(self._initial_epoch, self._epochs):
                if self._insufficient_data:  # set by catch_stop_iteration
                    break
                fresh = self._adapter.should_recreate_iterator()
                if iterator is None or fresh:
                    iterator = self._positioned(epoch, fresh)
                self.fed, self._epoch_start = 0, self._initial_step
                packer = self._packer if self._packer is not None and self._packer.usable else None
                yield epoch, _fed_steps.FedIterator(iterator, self, packer)
                self._adapter.on_epoch_end()

    @contextlib.contextmanager
    def catch_stop_iteration(self):
        """As tf-keras's, and the steps fed before the end are waited for and counted."""
        with super().catch_stop_iteration():
            try:
                yield
            except (StopIteration, tf.errors.OutOfRangeError):
                self.sync()  # tf-keras skips it on this path: the steps in flight are this epoch's
                self._current_step = self._epoch_start + self.fed  # tf-keras counted whole executions
                raise

    def sync(self):
        self._model._cluster_coordinator.join()  # pylint: disable=protected-access


# The call whose input a handler reads, and the name of its steps argument (set by the fit and evaluate wrappers).
_CALL_ATTR = "_tf_psx_call"
_STEPS_ARGUMENT = {"model.fit": "steps_per_epoch", "model.fit's validation": "validation_steps",
                   "model.evaluate": "steps"}


def _local_iterator(dataset: tf.data.Dataset):
    """`iter(dataset)` on the coordinator, also for a dataset made before the strategy connected.

    Such a dataset's ops sit on `/job:localhost`, which is gone once the
    process joins the cluster: iterating it failed with
    "/job:localhost/replica:0/task:0/device:CPU:0 unknown device". It is
    rebuilt here from its graph (as TF ships datasets to workers).
    """
    try:
        return iter(dataset)
    except tf.errors.InvalidArgumentError as error:
        if "unknown device" not in str(error):
            raise
    graph = _coordinator_values.serialize_dataset_to_graph(dataset)
    return iter(_coordinator_values.deserialize_dataset_from_graph(graph, dataset.element_spec))


def _call_of(model) -> str:
    """"model.fit" for fit's first handler, then "model.fit's validation"; "model.evaluate" otherwise."""
    call = getattr(model, _CALL_ATTR, None) or "model.evaluate"
    if call == "model.fit":
        setattr(model, _CALL_ATTR, "model.fit's validation")
    return call


def _check_countable(dataset: tf.data.Dataset, steps, call: str) -> None:
    """An infinite dataset with no steps, or an empty one: an error that names the call's own argument."""
    cardinality = int(dataset.cardinality())
    argument = _STEPS_ARGUMENT[call]
    if cardinality == int(tf.data.INFINITE_CARDINALITY) and steps is None:
        never = "its first epoch would never end" if call == "model.fit" else "it would never end"
        raise ArgumentError(
            f"{call} got an infinite dataset and no `{argument}`: {never}. Received: {argument}=None. "
            f"Fix: pass {argument}=N (the batches of one {'epoch' if call == 'model.fit' else 'evaluation'}), "
            "or a finite dataset (no .repeat()).")
    if cardinality == 0:
        raise ArgumentError(f"{call} got an empty dataset (0 batches). Fix: pass a dataset with at least one batch.")


def _is_arrays(x, y) -> bool:
    return x is not None and not isinstance(x, tf.data.Dataset) and data_adapter.TensorLikeDataAdapter.can_handle(x, y)


def _array_stream(x, y, sample_weight, batch_size: int, shuffle):
    """`stream(position)`: the batches of arrays from batch `position` on, pass after pass; and the examples.

    Pass p is shuffled with the seed (SHUFFLE_SEED, p) when `shuffle`
    (tf-keras's "batch" mode shuffles whole examples here too), so a stream
    rebuilt at a position continues the same order.
    """
    arrays = data_adapter._process_tensorlike((x, y, sample_weight))  # pylint: disable=protected-access
    data_adapter._check_data_cardinality([a for a in arrays if a is not None])  # pylint: disable=protected-access
    arrays = data_adapter.pack_x_y_sample_weight(*arrays)
    count = int(tf.nest.flatten(arrays)[0].shape[0])
    per_pass = math.ceil(count / batch_size)
    values = tf.nest.map_structure(tf.convert_to_tensor, arrays)

    def order(index):
        if not shuffle:
            return tf.range(count, dtype=tf.int64)
        seed = tf.stack([tf.constant(SHUFFLE_SEED, tf.int64), index])
        return tf.random.experimental.stateless_shuffle(tf.range(count, dtype=tf.int64), seed=seed)

    def take(indices):
        return tf.nest.map_structure(lambda value: tf.gather(value, indices), values)

    def stream(position: int):
        first, skip = divmod(int(position), per_pass)
        passes = tf.data.Dataset.range(first, np.iinfo(np.int64).max)
        batches = passes.flat_map(lambda p: tf.data.Dataset.from_tensor_slices(order(p)).batch(batch_size))
        return batches.skip(skip).map(take).prefetch(tf.data.AUTOTUNE)

    return stream, count


def _weighted_creator(creator, class_weight):
    def dataset_fn(context):
        dataset = creator(context)
        return dataset.map(data_adapter._make_class_weight_map_fn(class_weight))  # pylint: disable=protected-access

    return keras().utils.experimental.DatasetCreator(dataset_fn, input_options=creator.input_options)


def _with_coordinator(model) -> bool:
    return is_parameter_server_strategy(model.distribute_strategy)


def _fed_input(x):
    """What the coordinator reads for `x`, or None for TF's per-worker path (a `DatasetCreator`).

    `strategy.experimental_distribute_dataset(dataset)` (TFRA's demo passes
    it to fit) gave every worker its own copy of the whole dataset; its
    dataset is read by the coordinator instead, like any other.
    """
    if isinstance(x, keras().utils.experimental.DatasetCreator):
        return None
    if data_adapter._is_distributed_dataset(x):  # pylint: disable=protected-access
        return getattr(x, "_original_dataset", None)  # None: already built on the workers, TF's path
    return x


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
        dataset = tf.data.Dataset.from_tensors(data)
        if class_weight:
            dataset = dataset.map(data_adapter._make_class_weight_map_fn(class_weight))  # pylint: disable=protected-access
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


def _named(signature, model, args, kwargs) -> tuple[dict, dict]:
    """A call's arguments by name (without `self`), and its extra `**kwargs` (tf-keras's private ones)."""
    arguments = dict(signature.bind(model, *args, **kwargs).arguments)
    arguments.pop("self")
    return arguments, arguments.pop("kwargs", {})


def _get_data_handler(original):
    def get_data_handler(*args, **kwargs):
        model = kwargs.get("model")
        x = kwargs["x"] if "x" in kwargs else (args[0] if args else None)
        if getattr(model, "_cluster_coordinator", None) is not None and not kwargs.get("pss_evaluation_shards"):
            fed = _fed_input(x)
            if fed is not None:
                if "x" in kwargs:
                    kwargs["x"] = fed
                else:
                    args = (fed,) + tuple(args[1:])
                return _FedDataHandler(*args, **kwargs)
        return original(*args, **kwargs)

    return get_data_handler


def _allow_batch_hooks(original):
    """tf-keras refuses batch-level callbacks under a coordinator; under tf_psx's strategy they run, with a warning.

    Their logs are read for every step, so the coordinator waits for each
    step before the next is scheduled (keras-io's callbacks, a user's
    `on_train_batch_end`): correct, and slower. A callback that reads no
    logs can say so with `self._supports_tf_logs = True`.
    """
    def disallow_batch_hooks_in_ps_strategy(self):
        strategy = tf.distribute.get_strategy()
        if not hasattr(strategy, "exact_updates"):  # TF's own class: TF's refusal
            return original(self)
        slow = [type(cb).__name__ for cb in self.callbacks
                if not getattr(cb, "_supports_tf_logs", False)
                and (cb._implements_train_batch_hooks() or cb._implements_test_batch_hooks())]  # pylint: disable=protected-access
        if slow:
            logger.warning(
                "Batch-level callbacks %s read every step's logs, so the coordinator waits for each step before "
                "scheduling the next. Fix (if a callback reads no logs): set `self._supports_tf_logs = True` in "
                "its __init__.", slow)
        return None

    return disallow_batch_hooks_in_ps_strategy


def install() -> None:
    """Makes the coordinator read fit's and evaluate's input, and wraps `*_on_batch` (once)."""
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
            x, class_weight = arguments.get("x"), arguments.get("class_weight")
            if class_weight and isinstance(x, keras().utils.experimental.DatasetCreator):
                # tf-keras drops class_weight under a coordinator (_ClusterCoordinatorDataHandler never applies it).
                arguments.update(x=_weighted_creator(x, class_weight), class_weight=None)
            setattr(self, _CALL_ATTR, "model.fit")
            try:
                # The strategy's one coordinator (fit itself makes it otherwise).
                coordinator = _cluster_coordinator.ClusterCoordinator(self.distribute_strategy)
                arguments = _fit_progress.with_rerun_report(arguments, closure_retries(coordinator))
                return original_fit(self, **_fit_progress.with_progbar(arguments), **extra)
            finally:
                setattr(self, _CALL_ATTR, None)

        def evaluate(self, *args, **kwargs):
            if not _with_coordinator(self):
                return original_evaluate(self, *args, **kwargs)
            arguments, extra = _named(evaluate_signature, self, args, kwargs)
            if extra.get("_use_cached_eval_dataset"):  # fit's validation
                return original_evaluate(self, **arguments, **extra)
            call = getattr(self, _CALL_ATTR, None)
            setattr(self, _CALL_ATTR, "model.evaluate")
            try:
                return original_evaluate(self, **_fit_progress.with_progbar(arguments), **extra)
            finally:
                setattr(self, _CALL_ATTR, call)

        model_class.fit = wrapped_like(fit, original_fit)
        model_class.evaluate = wrapped_like(evaluate, original_evaluate)
        model_class.train_on_batch = _on_batch(model_class.train_on_batch, coordinated=True)
        model_class.test_on_batch = _on_batch(model_class.test_on_batch, coordinated=True)
        model_class.predict_on_batch = _on_batch(model_class.predict_on_batch, coordinated=False)
        data_adapter.get_data_handler = _get_data_handler(data_adapter.get_data_handler)
        callback_list = keras().callbacks.CallbackList
        callback_list._disallow_batch_hooks_in_ps_strategy = _allow_batch_hooks(  # pylint: disable=protected-access
            callback_list._disallow_batch_hooks_in_ps_strategy)  # pylint: disable=protected-access
        coordinator_class = _cluster_coordinator.ClusterCoordinator
        coordinator_class.schedule = _fed_steps.schedule_with_batches(coordinator_class.schedule)
        _INSTALLED = True
