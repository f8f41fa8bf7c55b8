"""Weights that move between a local model and a cluster model.

Under a partitioner a table is a `ShardedVariable`, and tf-keras lists every
shard as a weight of its own: `Embedding(100, 4)` with FixedShards(2) gives
`get_weights()` shapes `[(50, 4), (50, 4), (8, 1), (8, 1), (1,)]` for an
Embedding + Dense model, where the same model built without a strategy gives
`[(100, 4), (8, 1), (1,)]`. Raw TF then refuses
`ps_model.set_weights(local_model.get_weights())`.

* `unsharded_weights(model)` returns the list a local model has: each
  sharded variable's shards concatenated along axis 0.
* Once a `tf_psx.ParameterServerStrategy` exists in the process,
  `set_weights` of every tf-keras layer and model accepts either list: the
  shard list as TF makes it, or the unsharded list (split into the shards of
  each sharded variable). A local model's `set_weights` also takes a cluster
  model's shard list, joining consecutive shards whose rows add up to a
  weight's shape.
* Once such a strategy exists, `model.save` to `.keras` and `.h5` writes
  each sharded table (and its optimizer slots) whole, as a local model has
  it, and loading splits it into the shards of the model it loads into.
  tf-keras alone writes one entry per shard, which a local model refuses
  (`.keras`), or fails to write at all (`.h5`, "name already exists").

Example:

>>> import numpy as np, tf_psx, tensorflow as tf
>>> layer = tf.keras.layers.Dense(2)
>>> layer.build((None, 3))
>>> [w.shape for w in tf_psx.unsharded_weights(layer)]  # no sharding: get_weights()
[(3, 2), (2,)]
"""

from __future__ import annotations

import numpy as np

from tf_psx._tf.weights import sharded_container as _container
from tf_psx.errors import ArgumentError

__all__ = ["unsharded_weights", "convert"]

def _groups(params) -> list[tuple[object, list]]:
    """[(ShardedVariable or None, [its shards in order])] for a layer's weights."""
    groups: list[tuple[object, list]] = []
    for param in params:
        container = _container(param)
        if container is not None and groups and groups[-1][0] is container:
            groups[-1][1].append(param)
        else:
            groups.append((container, [param]))
    return groups


def unsharded_weights(layer) -> list[np.ndarray]:
    """The layer's or model's weights as numpy arrays, each sharded variable whole.

    Args:
      layer: a tf-keras layer or model (built).

    Returns:
      The list `get_weights()` returns for the same model built without a
      strategy: a sharded variable's shards are concatenated along axis 0.
      ShardedEmbedding's rows stay in its storage order (as in a local
      ShardedEmbedding), so the list loads into either.
    """
    values = layer.get_weights()
    out, index = [], 0
    for container, members in _groups(layer.weights):
        parts = values[index : index + len(members)]
        index += len(members)
        out.append(np.concatenate(parts, axis=0) if container is not None else parts[0])
    return out


def whole_values(params) -> list[np.ndarray]:
    """The values of `params` (variables, shards among them) as numpy arrays, each sharded variable's shards joined."""
    out = []
    for container, members in _groups(params):
        parts = [member.numpy() for member in members]
        out.append(np.concatenate(parts, axis=0) if container is not None else parts[0])
    return out


def split_unsharded(layer, params, weights):
    """The shard list for `weights` given as one array per (sharded) variable, or None."""
    groups = _groups(params)
    if len(groups) == len(params) or len(weights) != len(groups):
        return None
    expanded = []
    for (container, members), value in zip(groups, weights):
        if container is None:
            expanded.append(value)
            continue
        value = np.asarray(value)
        full = tuple(container.shape)
        if value.shape != full:
            raise ArgumentError(
                f"Layer {layer.name}: weight {container.name} is sharded in {len(members)} parts of total "
                f"shape {full}; received an array of shape {value.shape}. Fix: pass the whole {full} array "
                "(tf_psx.unsharded_weights gives that list) or the shard list of get_weights()."
            )
        bounds = np.cumsum([0] + [int(m.shape[0]) for m in members])
        expanded += [value[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return expanded


def join_shards(params, weights):
    """Joins consecutive arrays whose rows add up to each param's shape; None if they do not."""
    joined, index = [], 0
    for param in params:
        want = tuple(param.shape)
        if index >= len(weights):
            return None
        first = np.asarray(weights[index])
        if first.shape == want:
            joined.append(first)
            index += 1
            continue
        parts, rows = [], 0
        while index < len(weights) and rows < want[0]:
            part = np.asarray(weights[index])
            if part.ndim == 0 or part.shape[1:] != want[1:]:
                return None
            parts.append(part)
            rows += part.shape[0]
            index += 1
        if rows != want[0]:
            return None
        joined.append(np.concatenate(parts, axis=0))
    return joined if index == len(weights) else None


def convert(layer, params, weights):
    """The list `set_weights` should set for `weights`, or None to leave it as given.

    Unsharded lists are split into the shards of each sharded variable; a
    shard list given to an unsharded model is joined (see the module doc).
    """
    if len(weights) == len(params) or not all(hasattr(p, "shape") for p in params):
        return None
    converted = split_unsharded(layer, params, weights)
    if converted is None and len(weights) > len(params):
        converted = join_shards(params, weights)
    return converted
