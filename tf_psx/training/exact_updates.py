"""Exact optimizer updates under several asynchronous workers: the per-variable lock protocol.

tf-keras optimizers write a variable's update as several separate ops: SGD
runs `m.assign(m * momentum)`, `m.scatter_add(...)` and `var.assign_add(m)`
(even at momentum 0), Adam decays and scatters `m` and `v` and then reads
them back, and bias-corrects with the global `iterations`. With one worker
the ops of two steps never interleave. With several, they do, on the same
ps variable: measured with stock `SGD` and 2 workers, 1.2x to 1.4x of the
true update was applied (worker A's `var.assign_add(m)` adds worker B's
gradient, which B adds again).

Here each variable's update runs as one unit. Every trainable variable (each
shard of a sharded one) gets a `tf.CriticalSection` on its own ps task, and
the optimizer's `_update_step` for that variable runs inside it: the
gradient is first copied to the ps (so the lock is never held while data is
still in flight from a worker), then the optimizer's own ops run under the
lock, and the lock is released when every op they created has run. Locks
are per variable, so updates of different variables (and different shards)
still run in parallel; only two updates of the same shard wait on each other,
which is what the `use_locking` kernels of TF's fused optimizers do too.
An apply makes its dense updates as one unit per ps task instead, under
the task's lock (`grouped_apply`); sparse updates (embedding rows) keep
their variable's lock.

Adam-family optimizers bias-correct with the step number. Under several
workers the global `iterations` is read by two steps at once, so each
variable also gets its own step counter, colocated with it, read and
incremented under the lock; inside the update `optimizer.iterations` is that
counter. With one worker it equals the global count. The counters are
tracked by the optimizer (`_tf_psx_local_steps`), so they are checkpointed
and restored with it.

TFRA hash tables get the same protocol per table shard (tf_psx.tables.tfra_updates).
What a model's optimizer becomes at compile under a strategy with
`exact_updates` is tf_psx.training.exact_compile.

The patches this needs live in the door: `tf_psx._tf.exact_updates`
(tf-keras's `_update_step`, `Model.compile`, the private fields read here),
`tf_psx._tf.lock_release` (the release kept out of TF's op ordering).
`install` passes this module's functions to them.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import re
import threading

import tensorflow as tf

from tf_psx._tf import exact_updates as _door, lock_release as _lock_release
from tf_psx._tf import tfra as _tfra
from tf_psx.training import step_once as _step_once

# Attribute names on the optimizer instance.
_STATE_ATTR = "_tf_psx_update_locks"
_STEPS_ATTR = "_tf_psx_local_steps"
# Counter values to set when the counter is made (`restore_counter_later`).
_PENDING_ATTR = "_tf_psx_pending_steps"
# The lock of `iterations` (a step's token is recorded beside it): (lock, variable).
_ITERATIONS_LOCK_ATTR = "_tf_psx_iterations_lock"
# The grouped units that advance `iterations` too (`grouped_apply`): ring key -> the variable updates in the unit.
_ITERATIONS_UNITS_ATTR = "_tf_psx_iterations_units"
# Row marks (`register_row_marks`): variable key -> bool [rows], set by every update of the variable.
_MARKS_ATTR = "_tf_psx_row_marks"
# Mutexes are shared by name on their ps task; the counter keeps two
# optimizers (or two processes' variables of one name) apart.
_LOCK_PREFIX = "tf_psx_update_lock"
_ids = itertools.count()

# Read by tf_psx.callbacks (delta snapshots): which variables the optimizer updates, and their slots.
updates = _door.updates
slots_of = _door.slots_of


def strategy_wants_exact(optimizer) -> bool:
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    strategy = strategy or _door.strategy_of(optimizer)
    return bool(getattr(strategy, "exact_updates", False))


# tf_psx's native hash tables (tf_psx.tables.updates): the anchor variable's unique id -> its table's update,
# `update(optimizer, gradient)`. Registered by the layer (`register_table_anchor`).
_TABLE_ANCHORS: dict = {}


def register_table_anchor(anchor, update) -> None:
    """Makes an apply of `anchor`'s gradient run `update(optimizer, gradient)` instead, with or without a strategy."""
    install()
    _TABLE_ANCHORS[_door.variable_key(anchor)] = update


def _table_update_of(optimizer, variable):
    if not _TABLE_ANCHORS:
        return None
    return _TABLE_ANCHORS.get(_door.var_key(optimizer, variable))


def is_table_anchor(optimizer, variable) -> bool:
    """True for the anchor of a native hash table (its gradient is keyed by table keys)."""
    return _table_update_of(optimizer, variable) is not None


def _applies(optimizer, variable) -> bool:
    if _table_update_of(optimizer, variable) is not None:
        return True
    # TFRA's per-batch buffers are written back to the hash tables by the
    # table update below (or TFRA's own apply path).
    return (
        _door.has_unique_id(variable)
        and not _tfra.is_tfra_shadow(variable)
        and strategy_wants_exact(optimizer)
    )


def lock_state(optimizer, key: str, variable_scope, lock_device: str):
    """The (lock, step counter) stored under `key`, created on first use.

    Args:
      optimizer: the optimizer that owns them (the counters are tracked by it,
        so they are checkpointed with it).
      key: what the state belongs to (a variable's key, or a TFRA table).
      variable_scope: a callable returning the context in which the counter
        is created (where it is placed).
      lock_device: the device of the lock.
    """
    locks = optimizer.__dict__.setdefault(_STATE_ATTR, {})
    if key in locks:
        return locks[key]
    name = counter_name(key)
    with tf.init_scope():
        if not hasattr(optimizer, _STEPS_ATTR):
            # A tracked dict: the counters are saved with the optimizer.
            setattr(optimizer, _STEPS_ATTR, {})
            _door.keep_in_saved_children(optimizer, _STEPS_ATTR)
        with variable_scope():
            step = tf.Variable(
                tf.constant(0, tf.int64),
                trainable=False,
                name=f"{name}_local_step",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
        with tf.device(lock_device):
            lock = tf.CriticalSection(shared_name=f"{_LOCK_PREFIX}_{next(_ids)}")
        getattr(optimizer, _STEPS_ATTR)[name] = step
        pending = optimizer.__dict__.get(_PENDING_ATTR, {})
        if name in pending:
            # After the deferred restore (from the full snapshot) that tracking just ran.
            step.assign(pending.pop(name))
    locks[key] = (lock, step)
    return locks[key]


def lock_state_if_made(optimizer, key: str):
    """The (lock, step counter) stored under `key` by `lock_state`, or None when none was made."""
    return optimizer.__dict__.get(_STATE_ATTR, {}).get(key)


def register_row_marks(optimizer, variable, mask) -> bool:
    """Has every exact update of `variable` (a shard) set `mask[row]` for the rows it writes.

    Only updates traced after the registration set marks: the caller makes
    the train function again when this returns True (a new registration).

    Returns:
      True when `mask` was not registered for `variable` before.
    """
    marks = optimizer.__dict__.setdefault(_MARKS_ATTR, {})
    key = _door.var_key(optimizer, variable)
    new = marks.get(key) is not mask
    marks[key] = mask
    return new


def row_marks_of(optimizer, variable):
    """The mask registered for `variable`, or None."""
    return optimizer.__dict__.get(_MARKS_ATTR, {}).get(_door.var_key(optimizer, variable))


def counter_path_name(path: str) -> str | None:
    """The counter name in a checkpoint path `optimizer/_tf_psx_local_steps/<name>`, else None."""
    head = f"optimizer/{_STEPS_ATTR}/"
    return path[len(head):] if path.startswith(head) else None


def saved_counters(reader) -> dict:
    """{counter name: value} of the step counters in a checkpoint (a `NewCheckpointReader`)."""
    pattern = re.compile(rf"(?:^|/){_STEPS_ATTR}/([^/]+)/\.ATTRIBUTES/VARIABLE_VALUE$")
    saved = {}
    for key in reader.get_variable_to_shape_map():
        match = pattern.search(key)
        if match:
            # The checkpoint escapes "." in a name as "..".
            saved[match.group(1).replace("..", ".")] = int(reader.get_tensor(key))
    return saved


def restore_counter_later(optimizer, name: str, value) -> None:
    """Sets the step counter `name` to `value` when the first update creates it (a delta snapshot's value)."""
    optimizer.__dict__.setdefault(_PENDING_ATTR, {})[name] = int(value)


def counter_name(key: str) -> str:
    """The name of `key`'s step counter: its entry in the optimizer's saved counters (`lock_state`)."""
    return key.replace("/", "_").replace(":", "_")


def set_counter(optimizer, name: str, value) -> None:
    """Sets the step counter `name` to `value`: now if it exists, else when the first update creates it."""
    made = getattr(optimizer, _STEPS_ATTR, {})
    if name in made:
        made[name].assign(int(value))
    else:
        restore_counter_later(optimizer, name, value)


def beside(variable):
    """The context in which a variable colocated with `variable` is made (on its ps task).

    A variable the strategy did not make (an optimizer built outside
    `strategy.scope()` keeps its `iterations` on the coordinator) is passed
    to the strategy's creator as `colocate_with` directly: TF's
    `colocate_vars_with` refuses it.
    """
    strategy = tf.distribute.get_strategy()
    if not tf.distribute.has_strategy() or _door.made_by(strategy, variable):
        return lambda: strategy.extended.colocate_vars_with(variable)

    def colocated(next_creator, **kwargs):
        return next_creator(**{**kwargs, "colocate_with": variable})

    return lambda: tf.variable_creator_scope(colocated)


def _state_for(optimizer, variable):
    """The (lock, step counter) of `variable`, on its ps task."""
    return lock_state(optimizer, _door.var_key(optimizer, variable), beside(variable), variable.device)


def on_device(value, device: str):
    """`value` (a tensor or an IndexedSlices) copied to `device`."""
    with tf.device(device):
        if isinstance(value, tf.IndexedSlices):
            return tf.IndexedSlices(tf.identity(value.values), tf.identity(value.indices), value.dense_shape)
        return tf.identity(value)


def tensors_of(value) -> list:
    """The tensors of a gradient (an IndexedSlices' values and indices)."""
    if isinstance(value, tf.IndexedSlices):
        return [value.values, value.indices]
    return [value]


def execute_unordered(lock, update, step, ready=()):
    """`lock.execute(update)`, its release unordered (tf_psx._tf.lock_release), kept alive by a read of `step`.

    The read of the variable's counter is a resource op that the function
    must run, so the release it waits for runs too.

    `ready`: what the update reads from outside the lock (the gradient, on
    the variable's ps task). TF's `CriticalSection.execute` makes its
    `MutexLock` with no input, so on the ps the lock could be taken as soon
    as the step started and held while the worker computed the gradient
    (read from TF 2.16.2's critical_section_ops.py; a worker killed before
    sending it would leave the lock waiting on it). With `ready`, the lock
    is taken once they are on the ps.

    `ready` is joined first into one no-op on the caller's device, the
    only control input that every op of the update then gets: given as is,
    each op of the update got one control input per tensor of `ready`,
    O(ops x variables) edges in a grouped unit of many variables (FiBiNET's
    383 variables under Adam: a 33.6 MB step graph, 25 MB of it control
    inputs, and 6 GB of resident memory in a 2-worker in-process fit).
    """
    ready = list(ready)
    if len(ready) > 1 and not tf.executing_eagerly():
        with tf.control_dependencies(ready):
            ready = [tf.no_op(name="update_inputs_ready")]
    with tf.control_dependencies(ready):
        output = _lock_release.run_unordered(lock, update)
    with tf.control_dependencies([output]):
        return step.read_value()


_READS_ITERATIONS: dict[type, bool] = {}


def _reads_iterations(optimizer) -> bool:
    """True when the optimizer's `update_step` uses the step number (Adam's bias correction).

    Read from the source of the first `update_step` in the class's MRO and
    of the ones it may call up the chain; when the source cannot be read,
    True (the counter is then kept, which is always correct).
    """
    cls = type(optimizer)
    if cls not in _READS_ITERATIONS:
        try:
            sources = [inspect.getsource(klass.__dict__["update_step"]) for klass in cls.__mro__
                       if "update_step" in klass.__dict__]
            _READS_ITERATIONS[cls] = any("iterations" in source for source in sources)
        except (OSError, TypeError):
            _READS_ITERATIONS[cls] = True
    return _READS_ITERATIONS[cls]


def run_counted(optimizer, step, run):
    """Runs `run()` (the optimizer's own ops) and returns a tensor that waits for all of them.

    With an optimizer that bias-corrects by the step number, `iterations`
    reads the variable's own counter inside `run`, which is then advanced.
    """
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    before = set(graph.get_operations()) if graph is not None else set()
    counted = _reads_iterations(optimizer)
    if counted:
        with _door.iterations_as(optimizer, step.read_value()):
            run()
    else:
        run()
    created = [op for op in graph.get_operations() if op not in before] if graph is not None else []
    # The lock is released once the returned tensor exists: make it wait for
    # every op of the update.
    with tf.control_dependencies(created):
        return step.assign_add(1, read_value=True) if counted else tf.constant(0, tf.int64)


def _mark_rows(optimizer, gradient, variable) -> None:
    """Marks the rows this update writes, when marks are registered for `variable`."""
    mask = row_marks_of(optimizer, variable)
    if mask is None:
        return
    if isinstance(gradient, tf.IndexedSlices):
        mask.scatter_update(tf.IndexedSlices(tf.ones_like(gradient.indices, dtype=tf.bool), gradient.indices))
    else:
        mask.assign(tf.ones_like(mask, dtype=tf.bool))


def _locked_update(original, optimizer, gradient, variable):
    collector = getattr(_group, "apply", None)
    table_update = _table_update_of(optimizer, variable)
    if table_update is not None:
        # A native hash table's anchor: the table's own update, per shard under its locks (tf_psx.tables.updates).
        with tf.compat.v1.colocate_with(None, ignore_existing=True):
            output = table_update(optimizer, gradient)
        if collector is not None:
            collector.outputs.append(output)
        return output
    grouped = _is_grouped(optimizer, gradient, variable)
    if grouped and _collects(gradient):
        collector.pending.append((original, gradient, variable))
        return tf.constant(0, tf.int64)
    lock, step = _state_for(optimizer, variable)
    if grouped:
        lock = _device_lock(optimizer, variable.device)  # a grouped variable is updated under its ps task's lock only
    gradient = on_device(gradient, variable.device)

    def run():
        original(optimizer, gradient, variable)
        _mark_rows(optimizer, gradient, variable)

    # What the update writes, saved before it and restored if it is cut off midway (tf_psx.training.step_once).
    writes = [variable] + slots_of(optimizer, [variable]).get(id(variable), [])
    rows = gradient.indices if isinstance(gradient, tf.IndexedSlices) else None
    whole = [step] if _reads_iterations(optimizer) else []

    def update():
        # A step TF re-runs after a worker failure skips the variables its first attempt updated.
        return _step_once.once(optimizer, _door.var_key(optimizer, variable), beside(variable),
                               lambda: run_counted(optimizer, step, run), step.read_value,
                               writes=writes, rows=rows, whole=whole)

    output = execute_unordered(lock, update, step, ready=tensors_of(gradient))
    if collector is not None:
        collector.outputs.append(output)
    return output


# --- A step's dense updates, one unit per ps task ---
#
# Under a step token every exact update pays a ring look-up, a journal and
# two small conds (tf_psx.training.step_once), a few dozen small ops on its ps task:
# with FixedShards(2) splitting every dense variable, 18 such units a step
# on the 26-feature model (bench/exact_fit.py, exact_arrays against
# exact_arrays_notokens). The dense updates of one apply are made instead as
# one unit per ps task: one lock (the task's), one ring and one journal
# holding every variable of the unit. A step with no token (a DatasetCreator
# fit, a custom loop) is grouped too: one lock taken per ps task instead of
# one per variable shard. Measured on the 26-feature fused model (both ways
# in one process, windows interleaved): 0.94x the ms per step with 1 worker
# (twice), 0.98x with 2 workers, the 2 ps tasks' CPU 1.7-2.4 ms per step less.
# A variable is grouped or not from its first update on (`_GROUPED_ATTR`),
# and a grouped one is then always updated under its task's lock, alone or in
# a group, so that two paths never write it under two locks.
#
# Under a token, the step's `iterations` bump joins the unit of its ps task
# when that task has dense updates in the apply (`FOLD_ITERATIONS`): the
# unit's journal holds `iterations` too, so a re-run's twin writes it back
# like the variables. Apart, the bump took a lock, a ring and a token of its
# own on that task every step: about half of what the tokens cost
# (bench/exact_fit.py, exact_arrays against exact_arrays_notokens).

_GROUPED_ATTR = "_tf_psx_grouped"  # variable key -> True (grouped: its ps task's lock) or False (its own lock)
_DEVICE_LOCKS_ATTR = "_tf_psx_device_locks"  # ps device -> the lock of its grouped variables
# False: a step with no token (a DatasetCreator fit, a custom loop) updates each dense variable under its own
# lock, as before grouping (for measuring what grouping changes there).
GROUP_WITHOUT_TOKEN = True
# False: the `iterations` bump keeps its own lock and ring (`bump_iterations`), for measuring the fold.
FOLD_ITERATIONS = True
_group = threading.local()  # .apply: the `_Collector` of the apply being traced in this thread, or None


class _Collector:
    """What one apply with a step token collects: the dense updates to group (None: not grouped) and every output."""

    def __init__(self, grouping: bool):
        self.pending = [] if grouping else None
        self.outputs = _Outputs()
        self.bump = None  # (iterations, delta) when the step's bump joins the unit of iterations' ps task


class _Outputs(list):
    """A `grouped_apply`'s outputs; `iterations` is the counter's value after the apply when a unit advanced it."""

    iterations = None


def _same_device(a: str, b: str) -> bool:
    return tf.DeviceSpec.from_string(a).to_string() == tf.DeviceSpec.from_string(b).to_string()


def _device_lock(optimizer, device: str):
    """The lock of `optimizer`'s grouped variables on `device`, made on first use."""
    locks = optimizer.__dict__.setdefault(_DEVICE_LOCKS_ATTR, {})
    if device not in locks:
        with tf.init_scope(), tf.device(device):
            locks[device] = tf.CriticalSection(shared_name=f"{_LOCK_PREFIX}_{next(_ids)}")
    return locks[device]


def _collects(gradient) -> bool:
    """True when an update of `gradient` is collected into its ps task's unit (dense, inside a grouping `grouped_apply`)."""
    collector = getattr(_group, "apply", None)
    return collector is not None and collector.pending is not None and not isinstance(gradient, tf.IndexedSlices)


def _is_grouped(optimizer, gradient, variable) -> bool:
    """True when `variable` is updated under its ps task's lock: decided at its first update (`_collects`), then kept."""
    grouped = optimizer.__dict__.setdefault(_GROUPED_ATTR, {})
    key = _door.var_key(optimizer, variable)
    if key not in grouped:
        grouped[key] = _collects(gradient)
    return grouped[key]


@contextlib.contextmanager
def grouped_apply(optimizer):
    """Within it, the dense exact updates of an apply are collected; at its end, made one unit per ps task.

    Yields a list that holds, once the context has ended, the output of
    every exact update of the apply: whoever clears what the updates read
    (a sync step's accumulators, tf_psx.training.sync_training) waits for them, so a
    step cut off between the two leaves nothing cleared that a re-run still
    has to apply. Not grouped with an EMA (tf-keras reads the variables after
    their updates); inside another `grouped_apply`, the outer one collects.
    """
    if (not strategy_wants_exact(optimizer) or getattr(_group, "apply", None)
            or (_step_once.current() is None and not GROUP_WITHOUT_TOKEN)):
        yield []
        return
    _group.apply = collector = _Collector(grouping=not optimizer.use_ema)
    try:
        yield collector.outputs
    finally:
        _group.apply = None
    by_device: dict[str, list] = {}
    for entry in collector.pending or []:
        by_device.setdefault(entry[2].device, []).append(entry)
    for device, entries in by_device.items():
        bump = collector.bump if collector.bump is not None and _same_device(collector.bump[0].device, device) else None
        collector.outputs.append(_grouped_update(optimizer, device, entries, bump))
        if bump is not None:
            with tf.control_dependencies([collector.outputs[-1]]):
                collector.outputs.iterations = bump[0].read_value()


def after_updates(result, outputs):
    """`result`, once every tensor of `outputs` (a `grouped_apply`'s list) has run.

    When a unit advanced `iterations` (the step's bump joined it), the
    counter's value after the unit stands for `result` (what tf-keras's own
    `iterations.assign_add(1)` returns).
    """
    if getattr(outputs, "iterations", None) is not None:
        result = outputs.iterations
    if not outputs:
        return result
    with tf.control_dependencies(outputs):
        return tf.identity(result)


def grouped_variables(optimizer) -> list[str]:
    """The keys of `optimizer`'s variables updated in their ps task's unit (`grouped_apply`), sorted."""
    return sorted(key for key, grouped in optimizer.__dict__.get(_GROUPED_ATTR, {}).items() if grouped)


def iterations_in_unit(optimizer) -> bool:
    """True when the step's `iterations` bump is made in a ps task's unit of dense updates (`grouped_apply`)."""
    return bool(optimizer.__dict__.get(_ITERATIONS_UNITS_ATTR))


def _grouped_update(optimizer, device: str, entries: list, bump=None):
    """The updates `entries` [(original, gradient, variable)] of `device`'s variables as one unit under its lock.

    `bump`: None, or (iterations, delta) when the step's `iterations` bump
    is made in this unit (its ps task is `device`).
    """
    strategy = tf.distribute.get_strategy()
    variables = [variable for _, _, variable in entries]
    steps = [_state_for(optimizer, variable)[1] for variable in variables]
    gradients = [on_device(gradient, variable.device) for (_, gradient, variable) in entries]
    slots = slots_of(optimizer, variables)
    writes = [written for variable in variables for written in [variable] + slots.get(id(variable), [])]
    whole = steps if _reads_iterations(optimizer) else []
    keys = "|".join(_door.var_key(optimizer, variable) for variable in variables)
    # The ring and journal hold this set of variables (another set on the task gets its own).
    key = f"group_{hashlib.sha1(keys.encode()).hexdigest()[:12]}"
    if bump is not None:
        whole = whole + [bump[0]]
        key += "_iterations"
        optimizer.__dict__.setdefault(_ITERATIONS_UNITS_ATTR, {})[key] = len(entries)

    def apply():
        done = []
        for (original, _, variable), gradient, step in zip(entries, gradients, steps):
            def run(variable=variable, gradient=gradient, original=original):
                original(optimizer, gradient, variable)
                _mark_rows(optimizer, gradient, variable)

            # As tf-keras's apply makes each update (colocated, in the strategy's update context).
            done.append(strategy.extended.update(variable, lambda _, run=run, step=step: run_counted(
                optimizer, step, run), group=True))
        if bump is not None:
            iterations, delta = bump
            done.append(tf.cast(iterations.assign_add(tf.cast(delta, iterations.dtype), read_value=True), tf.int64))
        return tf.add_n(done)

    def skip():
        return tf.add_n([step.read_value() for step in steps])

    def update():
        return _step_once.once(optimizer, key, beside(variables[0]), apply, skip, writes=writes, whole=whole,
                               units=len(entries))

    ready = [tensor for gradient in gradients for tensor in tensors_of(gradient)]
    with tf.compat.v1.colocate_with(variables[0]):
        return execute_unordered(_device_lock(optimizer, device), update, steps[0], ready=ready)


def bump_iterations(optimizer):
    """A function of `delta` that advances `optimizer.iterations` once per step token; None without a token."""
    if _step_once.current() is None or not strategy_wants_exact(optimizer):
        return None
    iterations = optimizer.iterations

    def bump(delta):
        collector = getattr(_group, "apply", None)
        if (FOLD_ITERATIONS and collector is not None and collector.pending is not None
                and any(_same_device(variable.device, iterations.device) for _, _, variable in collector.pending)):
            collector.bump = (iterations, delta)  # made in that task's unit when the apply ends (`grouped_apply`)
            return tf.constant(0, tf.int64)  # `after_updates` returns the counter's value after the unit instead
        entry = optimizer.__dict__.get(_ITERATIONS_LOCK_ATTR)
        if entry is None or entry[1] is not iterations:
            with tf.init_scope(), tf.device(iterations.device):
                lock = tf.CriticalSection(shared_name=f"{_LOCK_PREFIX}_{next(_ids)}")
            entry = optimizer.__dict__[_ITERATIONS_LOCK_ATTR] = (lock, iterations)

        # The lock is taken once the step's token (and delta) are on the ps: a MutexLock with no input was
        # taken as soon as the ps began its part of the step, and held while a stalled worker had not yet
        # sent the token (bench/exact_fit.py, exact_arrays_straggler).
        with tf.device(iterations.device):
            ready = [tf.identity(value) for value in (_step_once.current()[0], delta) if tf.is_tensor(value)]

        def update():
            return _step_once.once_counter(optimizer, "iterations", beside(iterations), iterations, delta)

        return execute_unordered(entry[0], update, iterations, ready=ready)

    return bump


def rerun_counts(optimizer) -> dict:
    """What step tokens caught on this optimizer's variables since it was made (tf_psx.training.step_once).

    Returns:
      {"steps": re-run steps whose `iterations` bump was skipped (their first
      attempt had counted), "updates": variable and table updates skipped
      (applied by a first attempt), "unsure": look-ups that could not tell
      (applied; a re-run more than `step_once.RING_SIZE` steps late, or an
      update of a table with a policy cut off midway), "rolled_back":
      variable and table shard updates cut off midway and restored from
      their journal (then applied by the re-run)}.
    """
    everything = _step_once.counts(optimizer)
    apart = _step_once.counts_of(optimizer, "iterations")["skipped"]  # the bump's own ring
    # A unit that advanced `iterations` counts `units` skipped updates per skipped step.
    folded = sum(_step_once.counts_of(optimizer, key)["skipped"] // units
                 for key, units in optimizer.__dict__.get(_ITERATIONS_UNITS_ATTR, {}).items())
    return {"steps": apart + folded, "updates": everything["skipped"] - apart,
            "unsure": everything["unsure"], "rolled_back": everything["rolled_back"]}


def install() -> None:
    """Routes tf-keras optimizer updates through `_locked_update` (once per process).

    The patch is inert unless the strategy in scope has `exact_updates`
    set (tf_psx.ParameterServerStrategy does by default).
    """
    _door.install(_applies, _locked_update, bump_iterations, grouped_apply, after_updates)
