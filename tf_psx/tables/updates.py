"""A training step's update of a native hash table: per shard, one find and one insert on its ps task, under its lock.

The gradient of a lookup reaches the optimizer as the gradient of the
layer's anchor (a scalar variable: `tf_psx.layers.DynamicEmbedding`), an
`IndexedSlices` whose indices are the keys. tf-keras clips and deduplicates
it as any sparse gradient; its `_update_step` for the anchor then runs
`table_update` (the routing is `tf_psx.training.exact_updates`), which for each
shard of the table:

1. sends the shard its keys and their gradient rows (cast to the layer's
   `wire_dtype` for the trip, when set), and the learning rate;
2. on the shard's ps task, under the shard's lock: finds the keys' values
   (row, optimizer slots, bookkeeping), starts absent keys from the
   initializer's row for that key (`tf_psx.tables.native.draw_rows`, the
   same row the forward pass read) and the optimizer's initial slots,
   applies the optimizer's rule (`TableRule`) and inserts the new values.

So every update of a row is applied once, whatever the number of async
workers: closed forms hold (tests/training/test_native_tables.py). Every
step updates every shard (one with no keys of the step too), so each
shard's step counter, which Adam's bias correction reads, counts the
steps; with one worker it equals `iterations`.

A step the coordinator runs again after a worker failure carries the same
token (tf_psx.training.step_once): a shard that applied it skips it, and a shard's
update cut off midway is undone from the shard's journal (the keys, their
values before and whether they existed) by the next holder of its lock.

The rules are the optimizers' own formulas, applied to the touched rows
only ("lazy", as `tf_psx.optimizers.LazyAdam`): stock tf-keras `Adam` and
`SGD` with momentum decay every row of a variable on every step, which a
table of unseen size cannot do. An optimizer with no rule here is refused
when the model is compiled (`TableRule.for_optimizer`).

Importing this module imports TensorFlow.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from tf_psx._tf import keras as _tf_keras, shadows as _shadows
from tf_psx.errors import ArgumentError
from tf_psx.tables import native as _native
from tf_psx.training import exact_updates as _exact, step_once as _step_once

__all__ = ["TableRule", "table_update", "shard_steps", "shard_state", "SUPPORTED_OPTIMIZERS"]

_keras = _tf_keras.keras()

# The optimizers a hash table trains exactly, by what the error names.
SUPPORTED_OPTIMIZERS = ("tf.keras.optimizers.SGD (momentum and nesterov too)", "tf.keras.optimizers.Adagrad",
                        "tf.keras.optimizers.Adam (amsgrad too)", "tf_psx.optimizers.LazyAdam",
                        "tf_psx.optimizers.SGD")


class TableRule:
    """An optimizer's update of table rows: how many slots a key keeps, their start, and the rule.

    Build with `TableRule.for_optimizer`.
    """

    def __init__(self, kind: str, slots: int, optimizer):
        self.kind, self.slots, self.optimizer = kind, slots, optimizer

    @classmethod
    def for_optimizer(cls, optimizer, owner: str = "DynamicEmbedding") -> "TableRule":
        """The rule of `optimizer`.

        Raises:
          ArgumentError: for an optimizer with no rule here (naming those that work).
        """
        keras_opts = _keras.optimizers
        kind = None
        if type(optimizer).update_step in (keras_opts.SGD.update_step, _lazy_sgd_step()):
            kind = "sgd"
        elif type(optimizer).update_step is keras_opts.Adagrad.update_step:
            kind = "adagrad"
        elif type(optimizer).update_step in (keras_opts.Adam.update_step, _lazy_adam_step()):
            kind = "adam"
        if kind is None or getattr(optimizer, "use_ema", False):
            what = "use_ema=True" if kind is not None else type(optimizer).__module__ + "." + type(optimizer).__qualname__
            raise ArgumentError(
                f"The optimizer of a model with a {owner} must be one whose update a hash table applies exactly. "
                f"Received: {what}. Fix: compile with one of {', '.join(SUPPORTED_OPTIMIZERS)}"
                + (" without use_ema (a table has no moving average of its rows)." if kind is not None else
                   "; a legacy optimizer (tf.keras.optimizers.legacy.*) becomes its current twin of the same name.")
            )
        if kind == "sgd":
            slots = 1 if float(optimizer.momentum) != 0.0 else 0
        elif kind == "adagrad":
            slots = 1
        else:
            slots = 3 if optimizer.amsgrad else 2
        return cls(kind, slots, optimizer)

    def initial_slots(self, count, dim: int):
        """The slots [count, slots * dim] of a key the table has not seen."""
        value = 0.0
        if self.kind == "adagrad":
            value = float(self.optimizer.initial_accumulator_value)
        return tf.fill(tf.stack([count, self.slots * dim]), tf.constant(value, tf.float32))

    def apply(self, rows, slots, grad, lr, step, dim: int):
        """(new rows, new slots) of the touched rows; `step` is the one-based step number (float32)."""
        opt = self.optimizer
        if getattr(opt, "weight_decay", None):
            rows = rows - lr * tf.cast(opt.weight_decay, tf.float32) * rows
        if self.kind == "sgd":
            if self.slots == 0:
                return rows - lr * grad, slots
            momentum = tf.cast(opt.momentum, tf.float32)
            velocity = momentum * slots - lr * grad
            move = momentum * velocity - lr * grad if opt.nesterov else velocity
            return rows + move, velocity
        if self.kind == "adagrad":
            accumulator = slots + tf.square(grad)
            return rows - lr * grad / tf.sqrt(accumulator + tf.cast(opt.epsilon, tf.float32)), accumulator
        beta_1, beta_2 = tf.cast(opt.beta_1, tf.float32), tf.cast(opt.beta_2, tf.float32)
        beta_2_power = tf.pow(beta_2, step)
        alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - tf.pow(beta_1, step))
        epsilon = tf.cast(opt.epsilon, tf.float32)
        if getattr(opt, "adaptive_epsilon", False):
            epsilon = epsilon * tf.sqrt(1 - beta_2_power)
        m = beta_1 * slots[:, :dim] + (1 - beta_1) * grad
        v = beta_2 * slots[:, dim:2 * dim] + (1 - beta_2) * tf.square(grad)
        parts = [m, v]
        denominator = v
        if self.slots == 3:
            denominator = tf.maximum(slots[:, 2 * dim:], v)
            parts.append(denominator)
        return rows - alpha * m / (tf.sqrt(denominator) + epsilon), tf.concat(parts, axis=1)


def _lazy_adam_step():
    from tf_psx import optimizers  # pylint: disable=import-outside-toplevel

    return optimizers.LazyAdam.update_step


def _lazy_sgd_step():
    from tf_psx import optimizers  # pylint: disable=import-outside-toplevel

    return optimizers.SGD.update_step


def _dedup(gradient):
    """(keys, summed rows) of an IndexedSlices keyed by table keys."""
    keys = tf.reshape(gradient.indices, [-1])
    values = tf.convert_to_tensor(gradient.values)
    unique, position = tf.unique(keys)
    return unique, tf.math.unsorted_segment_sum(values, position, tf.size(unique))


def _send(value, device, wire):
    """`value` copied to `device`, crossing as `wire` when given (float32 again on arrival)."""
    if wire is not None:
        value = tf.cast(value, wire)
    with tf.device(device):
        return tf.cast(tf.identity(value), tf.float32)


class _Journal:
    """What one shard's update is about to overwrite, kept on its ps task (tf_psx.training.step_once's roll-back)."""

    def __init__(self, table, index: int, device: str):
        name = f"native_journal/{table.name}/{index}"
        self.shard, self.device, self.width = table.shards[index], device, table.width
        self.token = _shadows.TaskBuffer(device, f"{name}/token", tf.int64)
        self.keys = _shadows.TaskBuffer(device, f"{name}/keys", tf.int64)
        self.values = _shadows.TaskBuffer(device, f"{name}/values", tf.float32)

    def save(self, token, keys, values):
        with tf.control_dependencies([self.keys.write(keys), self.values.write(values)]):
            return self.token.write(token)

    def roll_back(self, pending):
        def undo():
            keys = tf.reshape(self.keys.read(), [-1])
            values = tf.reshape(self.values.read(), [-1, self.width])
            existed = _native.updates_of(values) > 0
            # A key the attempt added goes back to the absent value (zeros) rather than being erased: an erase
            # leaves a DenseHashTable tombstone (tf_psx.tables.native.remove). It then reads as absent.
            writes = [self.shard.insert(keys, tf.where(tf.reshape(existed, [-1, 1]), values, tf.zeros_like(values)))]
            with tf.control_dependencies(writes):
                return tf.constant(True)

        def saved_by_pending():
            return tf.cond(tf.equal(self.token.read(), pending), undo, lambda: tf.constant(True))

        with tf.device(self.device):
            return tf.cond(self.token.written(), saved_by_pending, lambda: tf.constant(True))


def shard_state(optimizer, table, index: int):
    """((lock, step counter), key) of shard `index` of `table`, on its ps task."""
    device = table.devices[index]
    key = f"native/{table.name}/shard_{index}"
    scope = (lambda: tf.device(device)) if device is not None else contextlib.nullcontext
    return _exact.lock_state(optimizer, key, scope, device or ""), key


def table_update(layer, optimizer, gradient):
    """The ops of one apply of `gradient` (an IndexedSlices keyed by table keys) to `layer`'s table.

    Returns a tensor that waits for every shard's update.
    """
    rule = layer.rule_for(optimizer)
    table = layer.native_table
    dim, wire = table.dim, layer.wire_dtype
    keys, values = _dedup(gradient)
    lr = tf.cast(optimizer.learning_rate, tf.float32)
    positions, parts = table.split(keys)
    token = _step_once.current()
    done = []
    for index, (shard, device, position, shard_keys) in enumerate(
            zip(table.shards, table.devices, positions, parts)):
        (lock, step), key = shard_state(optimizer, table, index)
        with tf.device(device):
            shard_keys = tf.identity(shard_keys)
            shard_lr = tf.identity(lr)
        grad = _send(tf.gather(values, position), device, wire)
        journal = _Journal(table, index, device) if token is not None and device is not None else None

        def update(shard=shard, device=device, step=step, keys=shard_keys, grad=grad, lr=shard_lr,
                   journal=journal):
            with tf.device(device):
                found = tf.reshape(shard.lookup(keys), [-1, table.width])
                present = _native.updates_of(found) > 0
                # Absent keys start from their initial row (drawn for those keys only) and the initial slots.
                absent = tf.where(tf.logical_not(present))
                rows = tf.tensor_scatter_nd_update(found[:, :dim], absent,
                                                   layer.initial_rows(tf.gather_nd(keys, absent)))
                slots = found[:, dim:dim * (1 + rule.slots)]
                if rule.slots and rule.kind == "adagrad":  # the other rules' slots start at 0, as absent values do
                    slots = tf.where(tf.reshape(present, [-1, 1]), slots,
                                     rule.initial_slots(tf.size(keys), dim))
                number = step.assign_add(1, read_value=True)
                new_rows, new_slots = rule.apply(rows, slots, grad, lr, tf.cast(number, tf.float32), dim)
                # `last step`: the steps the shard had applied when this one used the key (`iterations` at
                # the lookup with one worker), as a policy's counting lookup writes it.
                kept = _native.bookkeeping(_native.updates_of(found) + 1, number - 1, _native.seen_of(found))
                value = tf.concat([new_rows, new_slots, kept], axis=1)
                saved = [journal.save(token[0], keys, found)] if journal is not None else []
                with tf.control_dependencies(saved):
                    write = shard.insert(keys, value)
                with tf.control_dependencies([write]):
                    return tf.identity(number)

        def once(key=key, update=update, step=step, journal=journal):
            return _step_once.once(optimizer, key, _exact.beside(step), update, step.read_value,
                                   roll_back=journal.roll_back if journal is not None else None)

        # The lock is taken once the shard's keys and gradient are on its ps task.
        done.append(_exact.execute_unordered(lock, once, step, ready=[shard_keys, grad, shard_lr]))
    return tf.group(done)


def shard_steps(optimizer, table) -> list[int] | None:
    """The updates each shard of `table` (a NativeTable) applied with `optimizer`, or None before its first."""
    steps = []
    for index in range(table.num_shards):
        state = _exact.lock_state_if_made(optimizer, f"native/{table.name}/shard_{index}")
        if state is None:
            return None
        steps.append(int(state[1].numpy()))
    return steps
