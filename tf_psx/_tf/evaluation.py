"""`model.evaluate` of a finite dataset under ParameterServerStrategy (tf-keras 2.16, TF 2.16.2).

Under a ClusterCoordinator, tf-keras evaluates a dataset with no `steps` by
scheduling steps until one of them runs out of data. The closures scheduled
after it are cancelled, and reading their logs raises
`CancelledError: The corresponding function is cancelled. Please reschedule
the function.` from deep inside TF: `model.evaluate(test_ds)`, the line every
Keras user writes after `fit`, failed. (With an infinite dataset and no
`steps` it never returned.)

tf-keras has a mode that evaluates a finite dataset correctly, "exact
evaluation" (`compile(pss_evaluation_shards=...)`): the dataset is cut into
shards, each shard is one closure, and every element is evaluated exactly
once, even when a worker fails. Here `evaluate` (and `fit`'s validation)
switches to it for the call when nothing else was chosen: no `steps`, the
model compiled without `pss_evaluation_shards`, and a `tf.data.Dataset`. Its
logs are tensors in tf-keras; they are returned as Python floats, as
`evaluate` returns them everywhere else.

Cases it cannot serve get an error that names `steps=N` instead, before
anything runs: an infinite dataset; a model with its own `test_step`,
`compute_loss` or `compute_metrics`, with regularization or `add_loss`
terms, or with `add_metric` metrics (exact evaluation computes the loss from
`compile`'s arguments alone); a model whose output or target shapes are
unknown before its first step. Known limitation: a dataset with no end that
TF cannot see as infinite (an endless generator, `repeat().filter(...)`)
evaluates forever, as `evaluate` without a strategy does.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import tensorflow as tf

from tensorflow.python.distribute import input_ops as _input_ops  # pylint: disable=no-name-in-module
from tensorflow.python.types.distribute import DistributedDatasetInterface as _DistributedDataset  # pylint: disable=no-name-in-module
from tf_keras.src.engine import compile_utils as _compile_utils
from tf_keras.src.metrics import base_metric as _base_metric
from tf_keras.src.utils import losses_utils as _losses_utils

from tf_psx._tf.keras import keras, wrapped_like
from tf_psx._tf.runtime import is_parameter_server_strategy

_install_lock = threading.Lock()
_INSTALLED = False
# tf-keras's own heuristic for pss_evaluation_shards="auto" (Model._infer_exact_eval_shards).
AUTO = "auto"


def _model_class():
    return keras().Model


def _finite_input(x) -> bool:
    """True for a tf.data.Dataset (of known or unknown size), the input exact evaluation takes.

    tf-keras's exact evaluation drops `y` of array inputs
    (`_ClusterCoordinatorExactEvalDataHandler.__init__`), so arrays are not
    switched: for them tf-keras's own error already asks for `steps`.
    """
    return isinstance(x, tf.data.Dataset)


def _refuse(what: str, why: str) -> ValueError:
    return ValueError(
        f"{what} under ParameterServerStrategy with a finite dataset and no steps needs tf-keras's exact "
        f"evaluation, which {why}. Received: steps=None. Fix: pass steps=N (the number of batches to evaluate)."
    )


def _check_evaluable(model, x, what: str) -> None:
    """Refuses what exact evaluation would get wrong or never finish (before anything runs)."""
    if isinstance(x, tf.data.Dataset) and int(x.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        raise ValueError(
            f"{what} under ParameterServerStrategy got an infinite dataset and no steps: it would never end. "
            f"Received: steps=None. Fix: pass steps=N, or a finite dataset (no .repeat())."
        )
    base = _model_class()
    for method in ("test_step", "compute_loss", "compute_metrics"):
        if getattr(type(model), method) is not getattr(base, method):
            raise _refuse(what, f"does not call the custom `{method}` of {type(model).__qualname__}")
    if model.losses:
        # The shard function rebuilds the loss from compile()'s config alone.
        raise _refuse(what, f"leaves out the model's {len(model.losses)} regularization or add_loss term(s) "
                            "from the loss")
    try:
        model._disallow_exact_eval_with_add_metrics()  # pylint: disable=protected-access
    except ValueError:
        raise _refuse(what, "cannot compute metrics added with Model.add_metric") from None


def _example_of(spec):
    """Zeros of one example of `spec`, or None when a dimension other than the batch is unknown."""
    dims = spec.shape.as_list() if spec.shape.rank is not None else None
    if not dims or any(dim is None for dim in dims[1:]):
        return None
    return tf.zeros([1] + dims[1:], spec.dtype)


def _build_metrics(model, x, y, what: str) -> None:
    """Builds the compiled loss and metrics from the data's target and the model's output specs (zeros).

    Exact evaluation clones `compiled_metrics.unweighted_metrics`, which
    tf-keras only fills on the first step of a fit or evaluate: before any,
    it failed with "'NoneType' object is not iterable".
    """
    metrics = model.compiled_metrics
    if metrics is None or metrics.built:
        return
    outputs = getattr(model, "_nested_outputs", None)
    if isinstance(x, tf.data.Dataset):
        _, target_spec, _ = keras().utils.unpack_x_y_sample_weight(x.element_spec)
        target = tf.nest.map_structure(_example_of, target_spec)
    else:
        target = tf.nest.map_structure(lambda value: tf.convert_to_tensor(value[:1]), y)
    predicted = None if outputs is None else tf.nest.map_structure(_example_of, outputs)
    if predicted is None or target is None or any(t is None for t in tf.nest.flatten([predicted, target])):
        # Metric names such as "accuracy" are resolved from these shapes: no guessing.
        raise _refuse(what, "needs the metrics built, and tf-keras builds them on the first step of "
                            f"{type(model).__qualname__} (its output or target shapes are not known before)")
    # Under the strategy's scope, as tf-keras builds them in a step: outside it a metric named in compile
    # ("AUC") got plain variables, and its copies in the shard function got the partitioner's shards
    # ("Expected 4 variables in result for metric auc, but found 8").
    with model.distribute_strategy.scope():
        if model.compiled_loss is not None and not model.compiled_loss.built:
            model.compiled_loss.build(predicted)  # its mean ("loss") is one of model.metrics once built
        metrics.build(predicted, target)


def _shard_by_data(dataset, num_shards, index, num_replicas_in_sync=None):  # pylint: disable=unused-argument
    """Stands in for TF's `input_ops.auto_shard_dataset` while exact evaluation is traced: by data, never by file.

    tf-keras's exact shard function cuts the dataset with it under TF's AUTO
    policy (the dataset is the function's argument there, so options set on it
    are lost). AUTO shards by file, and failed on the workers for a dataset of
    fewer batches than shards ("Could not apply FILE based sharding: the
    dataset only has 1 file(s), which is not enough for the required 10
    shards/workers"), as for a file dataset of fewer files than shards.
    `Dataset.shard` keeps every `num_shards`-th batch from `index` on: exact
    for any dataset. Each shard reads the dataset through.
    """
    if isinstance(dataset, _DistributedDataset):
        return dataset.auto_shard(num_shards, index)  # calls back here for each worker's dataset
    return dataset.shard(num_shards, index)


def _local_losses(model):
    """Stands in for `LossesContainer.from_config` in the shard function: a fresh container of the model's own losses.

    tf-keras rebuilt the worker's loss from `compiled_loss.get_config()`,
    which keeps neither a loss function it cannot look up by name (a lambda,
    a function of the user's: "Unknown loss function: '<lambda>'" on the
    worker) nor `loss_weights` and the output names (a weighted multi-output
    loss came out unweighted). The copy takes the objects given to `compile`,
    with a new total-loss mean, local to the worker like tf-keras's.

    It is built here, inside the shard function's local-variables scope:
    tf-keras built it on its first call, outside, so for a model with several
    outputs the per-output means ("click_loss") became variables of the first
    trace, and the next shard's retrace failed with "tf.function only supports
    singleton tf.Variables created on the first call".
    """
    compiled = model.compiled_loss
    outputs = getattr(model, "_nested_outputs", None)
    predicted = None if outputs is None else tf.nest.map_structure(_example_of, outputs)

    @tf.autograph.experimental.do_not_convert
    def from_config(_config):
        losses = _compile_utils.LossesContainer(
            compiled._user_losses, loss_weights=compiled._user_loss_weights,  # pylint: disable=protected-access
            output_names=compiled._output_names,  # pylint: disable=protected-access
            total_loss_mean=_base_metric.Mean(name=compiled._total_loss_mean.name))  # pylint: disable=protected-access
        if predicted is not None and all(p is not None for p in tf.nest.flatten(predicted)):
            losses.build(predicted)  # only the structure is read
        return losses

    return from_config


class _OneOutput:
    """A metric as tf-keras's `MetricsContainer` calls it: with its own output, its rank and dtype matched.

    tf-keras's exact shard function called every metric with the whole `y`
    and `y_pred`: models with several outputs failed ("Expected any
    non-tensor type, but got a tensor instead"), and labels of shape [batch]
    against predictions of [batch, 1] were not expanded as in `fit` and a
    local `evaluate`, so a metric function's mean over the last axis became
    one number per batch (off from a local evaluate when the last batch is
    short). The shard function reads only `update_state`, `name` and
    `weights`.
    """

    def __init__(self, metric, index: int):
        self._metric = metric
        self._index = index
        self.name = metric.name

    @property
    def weights(self):
        return self._metric.weights

    def _pick(self, values):
        return None if values is None else tf.nest.flatten(values)[self._index]

    @tf.autograph.experimental.do_not_convert
    def update_state(self, y_true, y_pred, sample_weight=None):
        if sample_weight is not None and len(tf.nest.flatten(sample_weight)) > 1:
            sample_weight = self._pick(sample_weight)
        y_true, y_pred, sample_weight = _compile_utils.match_dtype_and_rank(
            self._pick(y_true), self._pick(y_pred), sample_weight)
        sample_weight = _losses_utils.apply_mask(y_pred, sample_weight, _losses_utils.get_mask(y_pred))
        return self._metric.update_state(y_true, y_pred, sample_weight=sample_weight)


def _output_index(model) -> dict:
    """id(compiled metric) -> the index of its output (0 for a model with one)."""
    metrics = model.compiled_metrics
    count = len(metrics._metrics)  # pylint: disable=protected-access
    per_output = list(metrics._metrics) + list(metrics._weighted_metrics)  # pylint: disable=protected-access
    return {id(metric): index % count for index, objects in enumerate(per_output)
            for metric in tf.nest.flatten(objects) if metric is not None}


def _clone_metric(clone, model):
    """tf-keras's `clone_metric` for the shard function, which also copies the user's metric functions.

    A `MeanMetricWrapper` of a function tf-keras cannot look up by name
    (`metrics=[my_metric]`) failed to clone from its config on the worker.
    Each compiled metric is called as `_OneOutput` says.
    """
    outputs = _output_index(model)

    @tf.autograph.experimental.do_not_convert  # called in the traced shard function; as tf-keras's own code
    def clone_metric(metric):
        if type(metric) is _base_metric.MeanMetricWrapper:  # pylint: disable=unidiomatic-typecheck
            copy = _base_metric.MeanMetricWrapper(metric._fn, name=metric.name, dtype=metric.dtype,  # pylint: disable=protected-access
                                                  **metric._fn_kwargs)  # pylint: disable=protected-access
        else:
            copy = clone(metric)
        return _OneOutput(copy, outputs[id(metric)]) if id(metric) in outputs else copy

    return clone_metric


@contextlib.contextmanager
def _swapped(owner, name: str, value):
    saved = vars(owner)[name]  # a class's own classmethod object, not one bound to it
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


# Set on the model while tf_psx's exact evaluation is on (fit's validation reads it).
_ACTIVE_ATTR = "_tf_psx_exact_evaluation"


@contextlib.contextmanager
def _exact(model):
    """Exact evaluation for the block (the shards as tf-keras's 'auto' picks them); all put back after.

    tf-keras caches the exact shard function (`_shard_test_function`) and
    leaves it in `test_function`: both are dropped, so a later evaluate with
    `steps` gets its own function back, and a recompiled model's loss and
    metrics are traced anew.
    """
    model._pss_evaluation_shards = model._infer_exact_eval_shards(AUTO)  # pylint: disable=protected-access
    model._shard_test_function = None  # pylint: disable=protected-access
    setattr(model, _ACTIVE_ATTR, True)
    # The shard function is traced inside this block, and dropped at its end.
    with contextlib.ExitStack() as swaps:
        swaps.enter_context(_swapped(_input_ops, "auto_shard_dataset", _shard_by_data))
        swaps.enter_context(_swapped(_compile_utils.LossesContainer, "from_config", _local_losses(model)))
        swaps.enter_context(_swapped(_base_metric, "clone_metric", _clone_metric(_base_metric.clone_metric, model)))
        try:
            yield
        finally:
            model._pss_evaluation_shards = 0  # pylint: disable=protected-access
            model._eval_data_handler = None  # pylint: disable=protected-access
            model._shard_test_function = None  # pylint: disable=protected-access
            model.test_function = None
            setattr(model, _ACTIVE_ATTR, False)


def _python_numbers(logs):
    def number(value):
        if isinstance(value, (tf.Tensor, tf.Variable)) and value.shape.rank == 0:
            return value.numpy().item()
        return value

    if isinstance(logs, dict):
        return {key: number(value) for key, value in logs.items()}
    if isinstance(logs, list):
        return [number(value) for value in logs]
    return number(logs)


def _applies(model, steps) -> bool:
    strategy = model.distribute_strategy
    return (steps is None and is_parameter_server_strategy(strategy)
            and getattr(strategy, "exact_evaluation", False)
            and not getattr(model, "_pss_evaluation_shards", 0))


def install() -> None:
    """Routes tf-keras `Model.evaluate` and `fit`'s validation through exact evaluation where needed (once)."""
    global _INSTALLED  # pylint: disable=global-statement
    with _install_lock:
        if _INSTALLED:
            return
        model_class = _model_class()
        original_evaluate = model_class.evaluate
        original_fit = model_class.fit
        evaluate_signature = inspect.signature(original_evaluate)
        fit_signature = inspect.signature(original_fit)

        def evaluate(self, *args, **kwargs):
            call = evaluate_signature.bind(self, *args, **kwargs)
            bound = call.arguments
            cached = bound.get("kwargs", {}).get("_use_cached_eval_dataset", False)
            if cached and getattr(self, _ACTIVE_ATTR, False):
                # fit's validation: callbacks (CSVLogger, EarlyStopping) get numbers, not tensors.
                return _python_numbers(original_evaluate(self, *args, **kwargs))
            if cached or not _applies(self, bound.get("steps")) or not _finite_input(bound.get("x")):
                return original_evaluate(self, *args, **kwargs)
            _check_evaluable(self, bound.get("x"), "model.evaluate")
            _build_metrics(self, bound.get("x"), bound.get("y"), "model.evaluate")
            with _exact(self):
                return _python_numbers(original_evaluate(*call.args, **call.kwargs))

        def fit(self, *args, **kwargs):
            call = fit_signature.bind(self, *args, **kwargs)
            bound = call.arguments
            validation = bound.get("validation_data")
            if validation is None or not _applies(self, bound.get("validation_steps")):
                return original_fit(self, *args, **kwargs)
            x = validation[0] if isinstance(validation, tuple) else validation
            if not _finite_input(x):
                return original_fit(self, *args, **kwargs)
            _check_evaluable(self, x, "model.fit's validation")
            _build_metrics(self, x, validation[1] if isinstance(validation, tuple) else None, "model.fit's validation")
            with _exact(self):
                return original_fit(*call.args, **call.kwargs)

        model_class.evaluate = wrapped_like(evaluate, original_evaluate)
        model_class.fit = wrapped_like(fit, original_fit)
        _INSTALLED = True
