"""A snapshot written by a TFRA-backed `DynamicEmbedding` restored into one on tf_psx's own tables.

TFRA saves a layer's rows as the table `<layer>_table-parameter` and each
optimizer slot as a table of its own
(`<layer>_table-parameter.SDynamicEmbedding.S<layer>_table-shadow.S<slot>`),
one checkpoint table per ps task (`tables_of_<name>/<i>/.ATTRIBUTES/table-keys`
and `table-values`). A native table holds a key's row and slots in one value
(tf_psx.tables.native). `restore_from_tfra` reads the TFRA tables of every
native `DynamicEmbedding` of a model (matched by the layer's name) from a
checkpoint, packs them per key in the layout of the optimizer the model is
compiled with, and loads them onto the table's shards (any number of ps
tasks). `PeriodicSync` does it by itself when the snapshot it resumes from
holds TFRA tables where the model has native ones (tf_psx.snapshots.restore).

Bookkeeping: every restored key counts one update, at the checkpoint's
`iterations`; the table's shard step counters (Adam's bias correction)
start at the largest step counter the checkpoint holds, or its
`iterations`.

Importing this module imports TensorFlow (not TFRA: the checkpoint is read
as plain tensors).
"""

from __future__ import annotations

import logging
import re

import numpy as np
import tensorflow as tf

from tf_psx.errors import DataError
from tf_psx.tables import native as _native
from tf_psx.training import exact_updates as _exact_updates

__all__ = ["restore_from_tfra", "holds_tfra_tables_of", "SLOT_NAMES"]

logger = logging.getLogger("tf_psx")

# The TFRA slot table names of each rule (tf_psx.tables.updates.TableRule.kind, slots), in the native layout's order.
SLOT_NAMES = {("sgd", 0): (), ("sgd", 1): ("m",), ("adagrad", 1): ("accumulator",), ("adam", 2): ("m", "v"),
              ("adam", 3): ("m", "v", "vhat")}
_TABLE_FILE = re.compile(r"tables_of_(?P<table>[^/]+)/(?P<shard>\d+)/\.ATTRIBUTES/table-keys$")
_ITERATIONS = re.compile(r"(?:^|/)_iterations/\.ATTRIBUTES/VARIABLE_VALUE$")


def _tfra_tables(reader) -> dict[str, list[str]]:
    """{checkpoint table name: its shards' key tensor names} of every TFRA table in a checkpoint."""
    tables: dict[str, list[str]] = {}
    for name in reader.get_variable_to_shape_map():
        match = _TABLE_FILE.search(name)
        if match:
            tables.setdefault(match.group("table"), []).append(name)
    return tables


def _read(reader, key_names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """A TFRA table's (keys, values) from all of its saved shards, sorted by key."""
    keys, values = [], []
    for name in key_names:
        keys.append(np.asarray(reader.get_tensor(name)).reshape(-1))
        values.append(np.asarray(reader.get_tensor(name[: -len("table-keys")] + "table-values")))
    keys = np.concatenate(keys)
    values = np.concatenate(values).reshape(len(keys), -1)
    order = np.argsort(keys, kind="stable")
    return keys[order], values[order]


def _saved_step(reader) -> int:
    """The largest step counter or `iterations` the checkpoint holds."""
    steps = [int(value) for value in _exact_updates.saved_counters(reader).values()]
    for name in reader.get_variable_to_shape_map():
        if _ITERATIONS.search(name):
            steps.append(int(reader.get_tensor(name)))
    return max(steps, default=0)


def holds_tfra_tables_of(model, prefix: str) -> bool:
    """True when checkpoint `prefix` holds a TFRA table of a native DynamicEmbedding of `model` (by layer name)."""
    tables = _tfra_tables(tf.compat.v1.train.NewCheckpointReader(prefix))
    return any(f"{layer.name}_table-parameter" in tables for layer in model.submodules
               if getattr(layer, "store", None) == "native")


def _restore_optimizer(reader, optimizer) -> int:
    """The optimizer's variables from the checkpoint, by position, where the shapes agree; returns how many.

    A TFRA-backed layer's optimizer slots are per-batch buffers ([0, dim]) where a
    native layer has its anchor's scalar slots: they differ in shape and are
    left out (the table holds the real slots). The step counters are set by name.
    """
    shapes = reader.get_variable_to_shape_map()
    roots = [name[: -len("_iterations/.ATTRIBUTES/VARIABLE_VALUE")] for name in shapes if _ITERATIONS.search(name)]
    if not roots:
        return 0
    root = sorted(roots, key=len)[0]
    restored = 0
    for index, variable in enumerate(optimizer.variables):
        name = f"{root}_variables/{index}/.ATTRIBUTES/VARIABLE_VALUE"
        if index == 0:
            name = f"{root}_iterations/.ATTRIBUTES/VARIABLE_VALUE"
        if name in shapes and list(shapes[name]) == variable.shape.as_list():
            variable.assign(reader.get_tensor(name))
            restored += 1
    for name, value in _exact_updates.saved_counters(reader).items():
        _exact_updates.set_counter(optimizer, name, value)
    return restored


def restore_from_tfra(model, prefix: str) -> list[str]:
    """Restores checkpoint `prefix`, written by a model with TFRA-backed DynamicEmbedding layers, into `model`.

    `model` is the same model built with `table="native"` and compiled (the
    table's layout follows its optimizer). Restored: the model's weights
    (`tf.train.Checkpoint(model=model).read(prefix)`), the optimizer's
    variables where their shapes agree (by position, as the two models
    build them in the same order), the step counters, and each native
    table from the TFRA tables of the layer of the same name: rows and
    slots per key, onto any number of ps tasks.

    Returns:
      The names of the layers whose tables were loaded. A native layer
      whose table the checkpoint lacks is left as it is.

    Raises:
      DataError: an uncompiled model, or a saved table whose width does not fit the layer.
    """
    reader = tf.compat.v1.train.NewCheckpointReader(prefix)
    tables = _tfra_tables(reader)
    step = _saved_step(reader)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise DataError(
            f"restore_from_tfra: model {model.name} is not compiled, so the layout of its tables' optimizer slots "
            f"is unknown. Received: a checkpoint {prefix} with TFRA tables. Fix: compile the model with its "
            "optimizer first.")
    tf.train.Checkpoint(model=model).read(prefix).expect_partial()
    with model.distribute_strategy.scope():
        optimizer.build(model.trainable_variables)
    _restore_optimizer(reader, optimizer)
    loaded = []
    for layer in model.submodules:
        if getattr(layer, "store", None) != "native" or getattr(layer, "native_table", None) is None:
            continue
        rows_name = f"{layer.name}_table-parameter"
        if rows_name not in tables:
            continue
        rule = layer.rule_for(optimizer)
        keys, rows = _read(reader, tables[rows_name])
        if rows.shape[1] != layer.output_dim:
            raise DataError(
                f"restore_from_tfra: the TFRA table {rows_name} in {prefix} has rows of {rows.shape[1]} floats; "
                f"DynamicEmbedding {layer.name} has output_dim={layer.output_dim}. Fix: build the layer with the "
                "saved width.")
        parts = [rows]
        for slot in SLOT_NAMES[(rule.kind, rule.slots)]:
            saved = [name for name in tables if name.startswith(rows_name) and name.endswith(f".S{slot}")]
            slot_values = np.zeros_like(rows)
            if rule.kind == "adagrad":
                slot_values += float(optimizer.initial_accumulator_value)
            if saved:
                slot_keys, values = _read(reader, tables[saved[0]])
                slot_values[np.searchsorted(keys, slot_keys[np.isin(slot_keys, keys)])] = values[np.isin(slot_keys, keys)]
            else:
                logger.warning("restore_from_tfra: %s has no TFRA slot table %r in %s; it starts at its initial value",
                               layer.name, slot, prefix)
            parts.append(slot_values)
        counts = tf.ones([len(keys)], tf.int32)
        parts.append(_native.bookkeeping(counts, step).numpy())
        layer.native_table.restore_tensors({"keys": tf.constant(keys, tf.int64),
                                            "values": tf.constant(np.concatenate(parts, axis=1), tf.float32)})
        for index in range(layer.native_table.num_shards):
            name = _exact_updates.counter_name(f"native/{layer.native_table.name}/shard_{index}")
            _exact_updates.set_counter(optimizer, name, step)
        logger.info("restore_from_tfra: DynamicEmbedding %s: %d keys from TFRA's tables in %s (%d shards saved)",
                    layer.name, len(keys), prefix, len(tables[rows_name]))
        loaded.append(layer.name)
    return loaded
