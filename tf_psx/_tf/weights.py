"""`Layer.set_weights` and the `.keras` format with unsharded lists (tf-keras 2.16, TF 2.16.2 ShardedVariable).

The logic lives in `tf_psx.weights`; this module only patches tf-keras and
reads the shard-to-container link that TF 2.16 keeps on each shard.

tf-keras's `.keras` format saves a layer through `Layer.save_own_variables`,
one entry per variable of `_trainable_weights + _non_trainable_weights`,
where a sharded table counts one entry per shard; `load_own_variables`
refuses any other count ("expected 1 variables, but received 2"). So a model
trained under a partitioner did not load into the same model built locally.
Patched, a sharded table is saved whole, and a load splits it into the
shards of the layer it loads into. The `.h5` format (`hdf5_format.
_legacy_weights`) listed every shard under the table's one name, and h5py
refused the second ("name already exists"); it now lists the table whole.
The optimizer's slots of a sharded table are `ShardedVariable`s, all named
"ShardedVariable", which h5py refused the same way; they are saved whole
under their first shard's name less "/part_0".
"""

from __future__ import annotations

import inspect
import threading

import tensorflow as tf

from tf_psx._tf.keras import keras

_install_lock = threading.Lock()
_INSTALLED = False


def sharded_container(variable):
    """The `ShardedVariable` that `variable` is a shard of, else None."""
    # TF 2.16's ShardedVariable sets a weak reference to itself on each shard.
    ref = getattr(variable, "_sharded_container", None)
    return ref() if ref is not None else None


def _containers_for_shards(weights: list) -> list:
    """`weights` with each run of one sharded variable's shards replaced by that `ShardedVariable` (named)."""
    out = []
    for weight in weights:
        container = sharded_container(weight)
        if container is None:
            out.append(weight)
        elif not (out and isinstance(out[-1], _Named) and out[-1].variable is container):
            out.append(_Named(container, _h5_name(container)))
    return out


def _install_h5() -> None:
    from tf_keras.src.saving.legacy import hdf5_format  # pylint: disable=import-outside-toplevel

    original = hdf5_format._legacy_weights  # pylint: disable=protected-access

    def _legacy_weights(layer):
        # A layer whose state an h5 file cannot hold says so (tf_psx's native hash tables: `h5_refusal`).
        refusal = getattr(layer, "h5_refusal", None)
        error = refusal() if callable(refusal) else None
        if error is not None:
            raise error
        weights = layer.trainable_weights + layer.non_trainable_weights
        if not any(sharded_container(weight) is not None for weight in weights):
            return original(layer)
        # A ShardedVariable reads (`numpy()`) and assigns whole, as h5 saving and loading use it.
        return _containers_for_shards(weights)

    _legacy_weights.__wrapped__ = original
    hdf5_format._legacy_weights = _legacy_weights  # pylint: disable=protected-access
    _install_h5_optimizer(hdf5_format)


class _Named:
    """A variable under another name, for h5 files (which name each dataset by `name`; all else passes through).

    TF names every `ShardedVariable` "ShardedVariable", so two in one layer
    (a sharded kernel and bias) or in one optimizer collided in the file.
    """

    def __init__(self, variable, name: str):
        self.variable = variable
        self.name = name

    def __getattr__(self, attribute):
        if attribute == "variable":  # not set yet (a copy being made)
            raise AttributeError(attribute)
        return getattr(self.variable, attribute)


class _OptimizerWeights:
    """What h5 saving reads of an optimizer that is not a tf-keras `Optimizer`: `weights`."""

    def __init__(self, weights: list):
        self.weights = weights


def _h5_name(variable) -> str:
    if isinstance(variable, tf.__internal__.distribute.ShardedVariable):
        return variable.variables[0].name.replace("/part_0", "", 1)
    return variable.name


def _optimizer_variables(optimizer) -> list:
    """The variables h5 saving reads: `variables` of a tf-keras optimizer, `weights()` of a legacy one."""
    variables = getattr(optimizer, "variables", None)
    if inspect.ismethod(variables):  # tf.keras.optimizers.legacy (a tf-keras optimizer's is a CallableList)
        variables = getattr(optimizer, "weights", None)
    return list(variables or [])


def _install_h5_optimizer(hdf5_format) -> None:
    original = hdf5_format.save_optimizer_weights_to_hdf5_group

    def save_optimizer_weights_to_hdf5_group(hdf5_group, optimizer):
        variables = _optimizer_variables(optimizer)
        if not any(isinstance(v, tf.__internal__.distribute.ShardedVariable) for v in variables):
            return original(hdf5_group, optimizer)
        return original(hdf5_group, _OptimizerWeights([_Named(v, _h5_name(v)) for v in variables]))

    save_optimizer_weights_to_hdf5_group.__wrapped__ = original
    hdf5_format.save_optimizer_weights_to_hdf5_group = save_optimizer_weights_to_hdf5_group


def install(convert, whole) -> None:
    """Patches tf-keras `Layer.set_weights`, `save_own_variables` and `load_own_variables` (once per process).

    Args:
      convert: `convert(layer, params, weights)` returns the list to set, or
        None to pass `weights` on unchanged (tf_psx.weights.convert).
      whole: `whole(params)` returns the values of `params` as numpy arrays,
        each sharded variable's shards joined (tf_psx.weights.whole_values).
    """
    global _INSTALLED  # pylint: disable=global-statement
    with _install_lock:
        if _INSTALLED:
            return
        layer_class = keras().layers.Layer
        original = layer_class.set_weights
        original_save = layer_class.save_own_variables
        original_load = layer_class.load_own_variables

        def set_weights(self, weights):
            weights = list(weights)
            converted = convert(self, self.weights, weights)
            return original(self, weights if converted is None else converted)

        def save_own_variables(self, store):
            for index, value in enumerate(whole(self._trainable_weights + self._non_trainable_weights)):
                store[f"{index}"] = value

        def load_own_variables(self, store):
            self._update_trackables()
            params = self._trainable_weights + self._non_trainable_weights
            values = [store[f"{index}"] for index in range(len(store.keys()))]
            converted = convert(self, params, values) if len(values) != len(params) else None
            if converted is None:
                return original_load(self, store)
            for param, value in zip(params, converted):
                param.assign(value)
            return None

        for patched, replaced in ((set_weights, original), (save_own_variables, original_save),
                                  (load_own_variables, original_load)):
            patched.__doc__ = replaced.__doc__
            patched.__wrapped__ = replaced
            setattr(layer_class, replaced.__name__, patched)
        _install_h5()
        _INSTALLED = True
