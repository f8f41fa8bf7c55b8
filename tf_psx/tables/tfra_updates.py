"""Exact updates of TFRA hash tables (`DynamicEmbedding`) under asynchronous workers: one unit per table shard.

TFRA trains a table through per-batch "shadow" buffers: the forward pass
copies the batch's rows into the shadow, the optimizer updates the shadow
(and one shadow per slot), and the result is written back to the table
(`upsert`, or with bp_v2 a delta). Written back as values, two workers that
looked up the same row both write their own "old row + my update", and one
update is lost (measured: 0.66 of the true SGD update with 2 workers). With
bp_v2 the row delta is exact for SGD, but the slots (Adagrad's accumulator,
Adam's moments) and new keys still race.

Here each shard of a table is updated as one unit on the ps task that owns
it, under that shard's lock (the lock protocol of tf_psx.training.exact_updates):
the worker splits the step's ids and gradient by the table's partition
function and sends each shard its part once, with the forward rows of the
keys that were absent at the lookup (TFRA draws a fresh random row per
lookup of an absent key; the lookup records which keys existed,
tf_psx._tf.tfra.install_prefetch); on the ps, under the lock, the shard's
rows and slots are read afresh, the optimizer's own update runs on
ps-resident buffers (tf_psx._tf.shadows.buffers_on), and rows and slots are
written back. Keys that are still absent keep the value the forward pass
used. Adam-family bias correction uses a per-shard step counter,
which counts the steps applied to the shard, as for ordinary variables.

A step the coordinator runs again after a worker failure carries the same
token (tf_psx.training.step_once): a shard that already applied it skips it, and a
shard's update cut off midway is undone from the shard's journal
(`_ShardJournal`: the keys, rows and slots it was about to overwrite) by
the next holder of the shard's lock, then applied once by the re-run.

A table with admission or eviction (tf_psx.tables.TablePolicy) or a TFRA
restrict policy is updated as one unit under one table lock instead
(`table_lock`, which eviction also takes), from its first ps task.

Called from tf_psx.training.exact_compile (the optimizer a model compiles with),
tf_psx.strategies and tf_psx.layers (the compile hook), tf_psx.tables (the
table lock). Importing this module imports TensorFlow.
"""

from __future__ import annotations

import contextlib
import re

import tensorflow as tf

from tf_psx._tf import exact_updates as _door, lock_release as _lock_release
from tf_psx._tf import shadows as _shadows, tfra as _tfra
from tf_psx.training import exact_compile as _exact_compile, exact_updates as _exact, step_once as _step_once

def _tfra_slots_of(optimizer, shadow):
    ids = shadow.ids
    return [
        slot
        for slot in _door.optimizer_variables(optimizer)
        if slot is not shadow and _tfra.is_tfra_shadow(slot) and getattr(slot, "ids", None) is ids
    ]


def _table_key(params) -> str:
    return f"tfra/{params.name}"


def _shard_key(params, index: int) -> str:
    return _table_key(params) if len(params.devices) == 1 else f"{_table_key(params)}/shard_{index}"


def _table_state(optimizer, params):
    """The (lock, step counter) of the TFRA table `params`, on the table's first ps task."""
    device = params.devices[0]
    return _exact.lock_state(optimizer, _table_key(params), lambda: tf.device(device), device)


def counter_names(params) -> list[str]:
    """The names the step counters of the TFRA table `params` may have: the whole table's, then each shard's."""
    names = [_exact.counter_name(_table_key(params))]
    if len(params.devices) > 1:
        names += [_exact.counter_name(_shard_key(params, index)) for index in range(len(params.devices))]
    return names


def counters_of(params, counters: dict) -> dict:
    """The entries of `counters` (by counter name) that are the TFRA table `params`' (whole or a shard's, any shard count)."""
    whole = _exact.counter_name(_table_key(params))
    shard = re.compile(rf"{re.escape(_exact.counter_name(f'{_table_key(params)}/shard_'))}\d+")
    return {name: value for name, value in counters.items() if name == whole or shard.fullmatch(name)}


def carry_counters(optimizer, params, saved: dict) -> list[str]:
    """Starts the step counters of `params` that `saved` (a snapshot's counters of the table, by name) lacks.

    A snapshot written with another number of ps tasks, or with the table
    updated whole instead of per shard (an admission policy added or
    dropped), has counters under other names; a counter it lacks would start
    at 0, and Adam's bias correction would treat the restored rows' moments
    as a first step's. It starts at the largest saved counter of the table
    instead (every step counts on every shard). A saved counter of 0 beside
    larger ones is one the saved layout did not update (the whole table's
    lock, which eviction takes, has one too): it starts there as well.
    Returns the names started.
    """
    top = max((int(value) for value in saved.values()), default=0)
    if top == 0:
        return []
    started = [name for name in counter_names(params) if int(saved.get(name, 0)) == 0]
    for name in started:
        _exact.set_counter(optimizer, name, top)
    return started


def table_lock(optimizer, params):
    """The lock that `optimizer`'s updates of the TFRA table `params` run under (created on first use)."""
    return _table_state(optimizer, params)[0]


def run_locked(lock, fn):
    """`lock.execute(fn)` in a traced step, its release kept out of TF's program-order chain.

    The release is a control input of the returned value: whatever uses
    the value waits for it.
    """
    return _lock_release.run_unordered(lock, fn)


def _fresh_slot_rows(optimizer, slot, fresh, exists):
    """A slot's rows as looked up (`fresh`, `exists`); absent keys get the optimizer's initial slot value.

    TFRA builds a slot table's default from the shadow's initial value, an
    empty [0, dim] tensor, so Adagrad's and Ftrl's accumulators of new keys
    started at 0 instead of `initial_accumulator_value` (0.1 by default):
    measured 1.41x the true Adagrad move even with one worker.
    """
    initial = getattr(optimizer, "initial_accumulator_value", None)
    if initial is None or "accumulator" not in slot.params.name.rsplit("/", 1)[-1]:
        return fresh
    return tf.where(tf.reshape(exists, [-1, 1]), fresh, tf.cast(initial, fresh.dtype) * tf.ones_like(fresh))


# Each shard's update is made on the ps task that owns it, under its own
# lock (module docstring). False: the whole table as one unit under one
# lock on its first ps task (`TABLE_UPDATES_ON_PS`), as a table with a
# policy always is; for measuring.
TABLE_UPDATES_PER_SHARD = True

# The whole table's update is made on its first ps task (`_shadows.buffers_on`):
# the worker sends the step's ids, forward rows and gradient there once,
# before the lock. On the worker (False, and for shadows without
# worker-local copies), rows and slots went to the worker and back under
# the lock.
TABLE_UPDATES_ON_PS = True


def _narrowed(value, wire):
    """`value` (a tensor or an IndexedSlices' values) rounded to `wire` and back, here; as is when `wire` is None."""
    if wire is None:
        return value
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(_narrowed(value.values, wire), value.indices, value.dense_shape)
    return tf.cast(tf.cast(value, wire), value.dtype)


def _send(value, device: str, wire):
    """`value` (a tensor or an IndexedSlices) copied to `device`; with `wire`, its values cross as `wire`.

    Cast to `wire` here and back to their dtype on `device`, so the bytes
    in flight are `wire`'s (tf_psx.layers.DynamicEmbedding's `wire_dtype`).
    """
    if wire is None:
        return _exact.on_device(value, device)
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(_send(value.values, device, wire), _exact.on_device(value.indices, device),
                                value.dense_shape)
    narrow = tf.cast(value, wire)
    with tf.device(device):
        return tf.cast(narrow, value.dtype)


def _tfra_locked_update(original, optimizer, gradient, shadow):
    if not shadow.params.trainable:
        return tf.no_op()
    slots = _tfra_slots_of(optimizer, shadow)
    _shadows.track_optimizer_slots(shadow, slots)
    params = shadow.params
    local_copies = all(_shadows.has_per_worker_copies(buffer) for buffer in [shadow, *slots])
    if (TABLE_UPDATES_PER_SHARD and local_copies and _tfra.admission_of(params) is None
            and params.restrict_policy is None and all(_same_shards(slot.params, params) for slot in slots)):
        return _sharded_update(original, optimizer, gradient, shadow, slots)
    return _whole_table_update(original, optimizer, gradient, shadow, slots,
                               on_ps=TABLE_UPDATES_ON_PS and local_copies)


def _same_shards(table, params) -> bool:
    return list(table.devices) == list(params.devices) and table.partition_fn is params.partition_fn


# On the optimizer: table name -> the step counters of its shards, for a table updated per shard.
_SHARD_STEPS_ATTR = "_tf_psx_table_shard_steps"


def _shard_state(optimizer, params, index: int):
    """((lock, step counter), key) of shard `index` of the TFRA table `params`, on that shard's ps task.

    `key` names the shard's lock and counter, and its token ring.
    """
    device = params.devices[index]
    key = _shard_key(params, index)
    lock, step = _exact.lock_state(optimizer, key, lambda: tf.device(device), device)
    counters = optimizer.__dict__.setdefault(_SHARD_STEPS_ATTR, {}).setdefault(params.name, {})
    counters[index] = step
    return (lock, step), key


def shard_steps(optimizer, params) -> list[int] | None:
    """The updates applied to each shard of the TFRA table `params`, when it is updated per shard; else None.

    With an optimizer that bias-corrects by the step number (Adam), each
    shard counts the steps applied to it (every step updates every shard,
    one with no rows of the step too), so after S steps each is S; with
    others the counters stay 0.
    """
    counters = optimizer.__dict__.get(_SHARD_STEPS_ATTR, {}).get(params.name)
    if counters is None:
        return None
    return [int(counters[index].numpy()) for index in sorted(counters)]


def _split(params, ids, rows, absent, gradient):
    """The step's ids, forward rows, absent marks and gradient split by shard: (ids, rows, absent, gradient) per shard.

    An IndexedSlices gradient indexes the shadow's rows; each shard's part
    indexes that shard's rows.
    """
    count = len(params.devices)
    ids = tf.reshape(ids, [-1])
    if count == 1:
        return [(ids, rows, absent, gradient)]
    shard_of = params.partition_fn(ids, count)
    positions = tf.dynamic_partition(tf.range(tf.size(ids)), shard_of, count)
    parts_ids = tf.dynamic_partition(ids, shard_of, count)
    parts_rows = tf.dynamic_partition(rows, shard_of, count)
    parts_absent = tf.dynamic_partition(absent, shard_of, count)
    if isinstance(gradient, tf.IndexedSlices):
        # Each shadow row's index within its shard.
        local = tf.dynamic_stitch(positions, [tf.range(tf.size(part)) for part in positions])
        entry_shard = tf.gather(shard_of, gradient.indices)
        values = tf.dynamic_partition(gradient.values, entry_shard, count)
        indices = tf.dynamic_partition(tf.cast(tf.gather(local, gradient.indices), gradient.indices.dtype),
                                       entry_shard, count)
        tail = tf.shape(gradient.values, out_type=tf.int64)[1:]
        grads = [tf.IndexedSlices(value, index, tf.concat([tf.shape(part, out_type=tf.int64), tail], 0))
                 for value, index, part in zip(values, indices, parts_ids)]
    else:
        grads = tf.dynamic_partition(gradient, shard_of, count)
    return list(zip(parts_ids, parts_rows, parts_absent, grads))


class _ShardJournal:
    """What one shard's update is about to overwrite, kept on its ps task so a cut-off attempt can be undone.

    Under the shard's lock, after the update looked up its keys' rows and
    slots and before it writes them back, it saves the keys, the values and
    whether each key existed (per table: the rows' and each slot's), then
    the step's token. A step cut off midway (its worker killed) leaves the
    ring's pending mark (tf_psx.training.step_once); the next lock holder then calls
    `roll_back(pending)`: when the journal holds that token, the attempt may
    have written back, so the saved values go back and keys that did not
    exist are removed; otherwise the attempt stopped before its writes.
    Either way the re-run then applies the step once.
    """

    def __init__(self, params, slots, index: int, device: str):
        self.index = index
        name = f"table_journal/{params.name}/{index}"
        self.token = _shadows.TaskBuffer(device, f"{name}/token", tf.int64)
        self.keys = _shadows.TaskBuffer(device, f"{name}/keys", params.key_dtype)
        self.tables = [(table, _shadows.TaskBuffer(device, f"{name}/{number}/exists", tf.bool),
                        _shadows.TaskBuffer(device, f"{name}/{number}/values", table.value_dtype))
                       for number, table in enumerate([params] + [slot.params for slot in slots])]

    def save(self, token, keys, looked_up: list):
        """The ops that save `keys` and `looked_up` ((values, exists) per table, the rows' first), then `token`."""
        data = [self.keys.write(keys)]
        for (_, exists, values), (value, found) in zip(self.tables, looked_up):
            data += [exists.write(found), values.write(value)]
        with tf.control_dependencies(data):
            return self.token.write(token)

    def roll_back(self, pending):
        """Undoes the writes of the attempt `pending` if it got as far as saving; a bool tensor (always True)."""

        def undo():
            keys = self.keys.read()
            writes = []
            for table, exists, values in self.tables:
                found = tf.reshape(exists.read(), [-1])
                old = values.read()
                writes.append(_tfra.shard_insert(table, self.index, tf.boolean_mask(keys, found),
                                                 tf.boolean_mask(old, found)))
                writes.append(_tfra.shard_remove(table, self.index, tf.boolean_mask(keys, tf.logical_not(found))))
            with tf.control_dependencies(writes):
                return tf.constant(True)

        def saved_by_pending():
            return tf.cond(tf.equal(self.token.read(), pending), undo, lambda: tf.constant(True))

        return tf.cond(self.token.written(), saved_by_pending, lambda: tf.constant(True))


def _sharded_update(original, optimizer, gradient, shadow, slots):
    """Each shard's update as one unit on its ps task, under its lock (module docstring)."""
    params = shadow.params
    wire = _tfra.wire_dtype_of(params)
    # Read from the worker's buffers before the locks; each shard gets its part once.
    absent = tf.logical_not(_tfra.forward_exists(shadow))
    parts = _split(params, shadow.ids.read_value(), shadow.read_value(do_prefetch=False), absent, gradient)
    step_token = _step_once.current()
    done = []
    for index, (ids, rows, absent, grad) in enumerate(parts):
        device = params.devices[index]
        (lock, step), key = _shard_state(optimizer, params, index)
        ids, absent = _exact.on_device(ids, device), _exact.on_device(absent, device)
        # The forward rows of the keys absent at the lookup only: a key that existed is read afresh there.
        rows = _send(tf.boolean_mask(rows, absent), device, wire)
        grad = _send(grad, device, wire)
        # With a step token, a journal to undo an attempt cut off midway (None: no token, no re-run to tell).
        journal = _ShardJournal(params, slots, index, device) if step_token is not None else None

        def update(index=index, device=device, step=step, ids=ids, rows=rows, absent=absent, grad=grad,
                   journal=journal):
            with _shadows.buffers_on(device, [shadow, *slots], tag=f"/{index}"), tf.device(device):
                looked_up = [_tfra.shard_lookup(params, index, ids, with_defaults=False)]
                looked_up += [_tfra.shard_lookup(slot.params, index, ids) for slot in slots]
                fresh, exists = looked_up[0]
                # A key absent now keeps the row its forward pass read (a key that existed then but was
                # removed since, by a roll-back, starts from zeros).
                forward = tf.scatter_nd(tf.where(absent), rows, tf.shape(fresh, out_type=tf.int64))
                loads = [_shadows.write_buffer(shadow, tf.where(tf.reshape(exists, [-1, 1]), fresh, forward))]
                for slot, (value, found) in zip(slots, looked_up[1:]):
                    loads.append(_shadows.write_buffer(slot, _fresh_slot_rows(optimizer, slot, value, found)))
                with tf.control_dependencies(loads):
                    counted = _exact.run_counted(optimizer, step, lambda: original(optimizer, grad, shadow))
                saved = [journal.save(step_token[0], ids, looked_up)] if journal is not None else []
                with tf.control_dependencies([counted, *saved]):
                    writes = [_tfra.shard_insert(params, index, ids, shadow.read_value(do_prefetch=False))]
                    writes += [_tfra.shard_insert(slot.params, index, ids, slot.read_value(do_prefetch=False))
                               for slot in slots]
                with tf.control_dependencies(writes):
                    return tf.identity(counted)

        def once(key=key, update=update, step=step, device=device, journal=journal):
            def roll_back(pending):
                with tf.device(device):
                    return journal.roll_back(pending)

            # The token ring beside the shard's counter (colocated: not split by the strategy's partitioner).
            return _step_once.once(optimizer, key, _exact.beside(step), update, step.read_value,
                                   roll_back=roll_back if journal is not None else None)

        # The lock waits for the shard's ids, rows and gradient on its ps task.
        done.append(_exact.execute_unordered(lock, once, step, ready=[ids, rows, absent, *_exact.tensors_of(grad)]))
    return tf.group(done)


def _whole_table_update(original, optimizer, gradient, shadow, slots, on_ps: bool):
    """The table's update as one unit under the table's lock (a table with a policy; `TABLE_UPDATES_PER_SHARD`)."""
    lock, step = _table_state(optimizer, shadow.params)
    params = shadow.params
    admission = _tfra.admission_of(params)
    device = params.devices[0]
    wire = _tfra.wire_dtype_of(params)
    if on_ps:
        # Read from the worker's buffers before the lock, sent once.
        step_ids = _exact.on_device(shadow.ids.read_value(), device)
        step_rows = _send(shadow.read_value(do_prefetch=False), device, wire)
        gradient = _send(gradient, device, wire)
        ready = [step_ids, step_rows, *_exact.tensors_of(gradient)]
    else:
        gradient = _narrowed(gradient, wire)
        ready = _exact.tensors_of(gradient)

    def update():
        with (_shadows.buffers_on(device, [shadow, *slots]) if on_ps else contextlib.nullcontext()), \
                (tf.device(device) if on_ps else contextlib.nullcontext()):
            return locked(*((step_ids, step_rows) if on_ps else (shadow.ids.read_value(),
                                                                  shadow.read_value(do_prefetch=False))))

    def locked(ids, forward_rows):
        fresh, exists = params.lookup(ids, return_exists=True)
        rows = tf.where(tf.reshape(exists, [-1, 1]), fresh, forward_rows)
        loads = [_shadows.write_buffer(shadow, rows)]
        for slot in slots:
            loads.append(_shadows.write_buffer(
                slot, _fresh_slot_rows(optimizer, slot, *slot.params.lookup(ids, return_exists=True))))
        with tf.control_dependencies(loads):
            done = _exact.run_counted(optimizer, step, lambda: original(optimizer, gradient, shadow))
        with tf.control_dependencies([done]):
            new_rows = shadow.read_value(do_prefetch=False)
            new_slots = [slot.read_value(do_prefetch=False) for slot in slots]
            if admission is not None:
                # Only admitted keys get a row and slots (tf_psx.tables.TablePolicy).
                keep = tf.reshape(admission(ids), [-1])
                ids = tf.reshape(ids, [-1])
                ids = tf.boolean_mask(ids, keep)
                new_rows = tf.boolean_mask(new_rows, keep)
                new_slots = [tf.boolean_mask(value, keep) for value in new_slots]
            writes = [params.upsert(ids, new_rows)]
            writes += [slot.params.upsert(ids, value) for slot, value in zip(slots, new_slots)]
            if params.restrict_policy is not None:
                writes.append(params.restrict_policy.apply_update(ids))
        with tf.control_dependencies(writes):
            return tf.identity(done)

    def once():
        return _step_once.once(optimizer, f"tfra/{params.name}", _exact.beside(step), update, step.read_value)

    # The lock waits for the gradient (the forward and backward pass), and on the ps for the step's ids and rows.
    return _exact.execute_unordered(lock, once, step, ready=ready)


def _tfra_apply_wide(tfra_fn, distribution, grads_and_vars, **kwargs):
    """TFRA's own apply; a table with a wire dtype first gets its rows as stored and its gradient rounded.

    TFRA's apply updates the rows the forward pass read and writes them
    back: read through the wire, they are rounded, and the table would lose
    its float32 precision at every step. So the shadow is loaded with the
    table's rows (the forward's rows for keys still absent) and the gradient
    rounded as tf_psx's exact update sends it: the same arithmetic as there.
    """
    loads, narrowed = [], []
    for grad, var in grads_and_vars:
        wire = _tfra.wire_dtype_of(var.params) if _tfra.is_tfra_shadow(var) else None
        if wire is not None:
            ids = tf.reshape(var.ids.read_value(), [-1])
            stored, exists = var.params.lookup(ids, return_exists=True)
            forward = var.read_value(do_prefetch=False)
            loads.append(_shadows.write_buffer(var, tf.where(tf.reshape(exists, [-1, 1]), stored, forward)))
            grad = _narrowed(grad, wire)
        narrowed.append((grad, var))
    with tf.control_dependencies(loads):
        return tfra_fn(distribution, narrowed, **kwargs)


def tfra_apply_gradients_fn(optimizer, tfra_fn):
    """An exact `_distributed_apply_gradients_fn` for a TFRA-wrapped optimizer.

    Args:
      optimizer: a tf-keras optimizer already wrapped by TFRA's
        `DynamicEmbeddingOptimizer`.
      tfra_fn: TFRA's own function, used when the strategy in scope does not
        ask for exact updates.

    Returns:
      A function with the signature of tf-keras's
      `_distributed_apply_gradients_fn(distribution, grads_and_vars, **kwargs)`.
    """

    def apply_gradients_fn(distribution, grads_and_vars, **kwargs):
        grads_and_vars = list(grads_and_vars)
        with_policy = any(_tfra.is_tfra_shadow(var) and _tfra.admission_of(var.params) is not None
                          for _, var in grads_and_vars)
        if not _exact.strategy_wants_exact(optimizer) and not with_policy:
            # Tables with admission always take the path below, which writes admitted keys only.
            return _tfra_apply_wide(tfra_fn, distribution, grads_and_vars, **kwargs)
        original = _door.original_update_step()

        def apply_one(var, grad):
            if _tfra.is_tfra_shadow(var):
                return _tfra_locked_update(original, optimizer, grad, var)
            return _door.update_step(optimizer, grad, var)

        with _exact.grouped_apply(optimizer) as outputs:
            for grad, var in grads_and_vars:
                if _tfra.is_tfra_shadow(var):
                    # TFRA's shadows report the coordinator's device; their
                    # update runs where the handles live, not "colocated".
                    with tf.compat.v1.colocate_with(None, ignore_existing=True):
                        apply_one(var, grad)
                else:
                    distribution.extended.update(var, apply_one, args=(grad,), group=False)
            bump = _exact.bump_iterations(optimizer)
            if not optimizer.use_ema:  # inside the apply, the bump can join a unit (`grouped_apply`)
                counted = optimizer.iterations.assign_add(1) if bump is None else bump(1)
        if optimizer.use_ema:
            _door.update_moving_average(optimizer, [var for _, var in grads_and_vars])
            counted = optimizer.iterations.assign_add(1) if bump is None else bump(1)
        return _exact.after_updates(counted, outputs)

    return apply_gradients_fn


def _exact_apply(optimizer, tfra_fn):
    """`tfra_apply_gradients_fn`, with the variables' locked updates installed (the table apply runs them too)."""
    _exact.install()
    return tfra_apply_gradients_fn(optimizer, tfra_fn)


def wrap_tfra_optimizer(optimizer, bp_v2: bool = False):
    """Applies TFRA's DynamicEmbeddingOptimizer to `optimizer` once (if the user did not), and the exact apply; returns it."""
    return _tfra.wrap_tfra_optimizer(optimizer, _exact_apply, bp_v2=bp_v2)


def install_tfra_optimizer_hook() -> None:
    """Makes tf-keras `Model.compile` wrap the optimizer of a model with a DynamicEmbedding (tf_psx._tf.tfra)."""
    _tfra.install_tfra_optimizer_hook(wrap_tfra_optimizer)


_exact_compile.register_tfra_wrapper(wrap_tfra_optimizer)
