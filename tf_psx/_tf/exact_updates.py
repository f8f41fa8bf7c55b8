"""The tf-keras 2.16 optimizer internals that tf_psx.training.exact_updates patches and reads.

The per-variable lock protocol itself is tf_psx.training.exact_updates; this module
only reaches into tf-keras, and runs what its caller passes in:

* `install(applies, locked_update, bump_iterations)`: `_BaseOptimizer._update_step` and
  `_update_step_xla` (`optimizers/optimizer.py`) call
  `locked_update(original, optimizer, gradient, variable)` when
  `applies(optimizer, variable)`; the XLA path then runs unjitted (a mutex
  cannot be compiled). `_distributed_apply_gradients_fn`'s
  `self.iterations.assign_add(1)` runs `bump_iterations(optimizer)` when
  that is not None (the step's token decides whether it counts); the apply
  runs inside `apply_context(optimizer)` when given.
* `install_compile_hook(after_compile)`: `Model.compile` calls
  `after_compile(model)` once the model is compiled.
* what the protocol reads: `_iterations` (swapped for a per-variable counter),
  `_var_key`, `_index_dict`, `_variables`, `_distribution_strategy`,
  `_coalesced_children`, the EMA update, a legacy optimizer's `_momentum`,
  and the slots by tf-keras's naming.

Written against tf-keras 2.16 and TF 2.16.2; tests/training/test_exact_updates.py
fails loudly if they move.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from tf_psx._tf import keras as _tf_keras

_install_lock = threading.Lock()
_INSTALLED = False
_COMPILE_HOOKED = False


def base_optimizer_class():
    """tf-keras 2.16's `_BaseOptimizer` (the base of `tf.keras.optimizers.Optimizer`)."""
    return _tf_keras.keras().optimizers.Optimizer.__mro__[1]


class _CountedIterations:
    """Stands in for `optimizer._iterations` during an apply: `assign_add` runs the caller's `bump`."""

    def __init__(self, variable, bump):
        self._variable, self._bump = variable, bump

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):  # pylint: disable=unused-argument
        return self._bump(delta)

    def __add__(self, other):  # tf-keras's EMA reads `self.iterations + 1`
        return self._variable + other

    def __getattr__(self, name):
        return getattr(self._variable, name)


def install(applies, locked_update, bump_iterations=None, apply_context=None, after_updates=None) -> None:
    """Routes tf-keras optimizer updates through `locked_update` where `applies` (once per process).

    Args:
      applies: `applies(optimizer, variable)`, True when the update of
        `variable` must run under its lock.
      locked_update: `locked_update(original, optimizer, gradient, variable)`
        runs `original(optimizer, gradient, variable)` (tf-keras's own
        `_update_step`) under the lock and returns a tensor.
      bump_iterations: `bump_iterations(optimizer)`, None or a function of
        `delta` that advances `optimizer.iterations` and returns a tensor:
        what `_distributed_apply_gradients_fn`'s final
        `self.iterations.assign_add(1)` runs instead.
      apply_context: `apply_context(optimizer)`, a context manager that
        `_distributed_apply_gradients_fn` runs in (the updates of one apply
        are made in it), whatever `bump_iterations` gave; it
        yields a list of tensors, and `after_updates(result, that list)` is
        then what the function returns.
    """
    global _INSTALLED  # pylint: disable=global-statement
    with _install_lock:
        if _INSTALLED:
            return
        base = base_optimizer_class()
        original_update = base._update_step  # pylint: disable=protected-access
        original_xla = base.__dict__["_update_step_xla"]

        def _update_step(self, gradient, variable):
            if not applies(self, variable):
                return original_update(self, gradient, variable)
            return locked_update(original_update, self, gradient, variable)

        def _update_step_xla(self, gradient, variable, key):
            # A mutex cannot be compiled by XLA: the exact path runs unjitted.
            if applies(self, variable):
                return _update_step(self, gradient, variable)
            return original_xla.__get__(self, type(self))(gradient, variable, key)

        _update_step.__wrapped__ = original_update
        _update_step_xla.__wrapped__ = original_xla
        base._update_step = _update_step  # pylint: disable=protected-access
        base._update_step_xla = _update_step_xla  # pylint: disable=protected-access
        if bump_iterations is not None:
            optimizer_class = _tf_keras.keras().optimizers.Optimizer  # the class that defines it (a subclass of base)
            original_apply = optimizer_class._distributed_apply_gradients_fn  # pylint: disable=protected-access

            def _distributed_apply_gradients_fn(self, distribution, grads_and_vars, **kwargs):
                bump = bump_iterations(self)
                context = apply_context(self) if apply_context is not None else contextlib.nullcontext([])
                counted = (contextlib.nullcontext() if bump is None
                           else iterations_as(self, _CountedIterations(self.__dict__["_iterations"], bump)))
                with counted, context as outputs:
                    result = original_apply(self, distribution, grads_and_vars, **kwargs)
                return after_updates(result, outputs) if after_updates is not None else result

            _distributed_apply_gradients_fn.__wrapped__ = original_apply
            optimizer_class._distributed_apply_gradients_fn = _distributed_apply_gradients_fn  # pylint: disable=protected-access
        _INSTALLED = True


def original_update_step():
    """tf-keras's own `_update_step(optimizer, gradient, variable)`, without the lock."""
    method = base_optimizer_class()._update_step  # pylint: disable=protected-access
    return getattr(method, "__wrapped__", method)


def update_step(optimizer, gradient, variable):
    """`optimizer._update_step(gradient, variable)`: locked when `install`'s `applies` says so."""
    return optimizer._update_step(gradient, variable)  # pylint: disable=protected-access


def update_moving_average(optimizer, variables: list) -> None:
    """The EMA update tf-keras runs after an apply when `use_ema` is set."""
    optimizer._update_model_variables_moving_average(variables)  # pylint: disable=protected-access


@contextlib.contextmanager
def iterations_as(optimizer, value):
    """Makes `optimizer.iterations` read `value` inside the block."""
    original = optimizer.__dict__["_iterations"]
    # object.__setattr__: a plain swap, not a new tracked dependency.
    object.__setattr__(optimizer, "_iterations", value)
    try:
        yield
    finally:
        object.__setattr__(optimizer, "_iterations", original)


def keep_in_saved_children(optimizer, name: str) -> None:
    """Makes the attribute `name` a saved child of the optimizer even when its children were listed before.

    tf-keras 2.16's `_BaseOptimizer._trackable_children` computes the
    children once and caches them (`_coalesced_children`); a checkpoint
    listed before the attribute was set (a restore, PeriodicSync's checks, a
    delta tracker) would otherwise leave it out of every later save.
    """
    cached = optimizer.__dict__.get("_coalesced_children")
    if cached is not None and name not in cached:
        cached[name] = getattr(optimizer, name)


def var_key(optimizer, variable) -> str:
    """The optimizer's key for `variable` (tf-keras `_var_key`)."""
    return optimizer._var_key(variable)  # pylint: disable=protected-access


def variable_key(variable):
    """What tf-keras's `Optimizer._var_key` returns for `variable` (its distributed container's `_unique_id`), with no optimizer."""
    if hasattr(variable, "_distributed_container"):
        variable = variable._distributed_container()  # pylint: disable=protected-access
    elif hasattr(variable, "handle") and hasattr(variable.handle, "_distributed_container"):
        variable = variable.handle._distributed_container()  # pylint: disable=protected-access
    return variable._unique_id  # pylint: disable=protected-access


def updates(optimizer, variable) -> bool:
    """True when `optimizer` was built for `variable` (it has a slot index for it)."""
    return optimizer._var_key(variable) in getattr(optimizer, "_index_dict", {})  # pylint: disable=protected-access


def optimizer_variables(optimizer) -> list:
    """Every variable the optimizer made (tf-keras `_variables`: slots, and TFRA's slot shadows)."""
    return optimizer._variables  # pylint: disable=protected-access


def strategy_of(optimizer):
    """The strategy the optimizer was made under, or None (tf-keras `_distribution_strategy`)."""
    return getattr(optimizer, "_distribution_strategy", None)


def made_by(strategy, variable) -> bool:
    """Whether `strategy` made `variable` (TF's `colocate_vars_with` refuses any other: `validate_colocate`)."""
    owner = getattr(variable, "_distribute_strategy", None)
    return owner is not None and owner.extended is strategy.extended


# The variables a tf-keras optimizer makes in its constructor: the step count and the learning rate.
_CONSTRUCTOR_VARIABLES = ("_iterations", "_learning_rate", "_current_learning_rate")


def remake_in_scope(optimizer, strategy) -> list[str]:
    """Remakes the variables an unbuilt tf-keras optimizer made in its constructor under `strategy`; returns their names.

    tf-keras makes `iterations` and a constant learning rate where the
    optimizer is constructed (`_create_iteration_variable`,
    `_build_learning_rate`, under `tf.init_scope()`) and keeps the strategy
    it finds then (`_distribution_strategy`). An optimizer constructed
    outside `strategy.scope()` and passed to `compile` kept them on the
    coordinator, and every step read and bumped them there. Each is made
    again in the scope, with its value; the optimizer's variable list and
    its strategy follow. Nothing is done once the optimizer is built (its
    slots exist): [] then.
    """
    if getattr(optimizer, "_built", False) or not isinstance(optimizer, base_optimizer_class()):
        return []
    remade = []
    with tf.init_scope(), strategy.scope():
        for name in _CONSTRUCTOR_VARIABLES:
            old = optimizer.__dict__.get(name)
            if not isinstance(old, tf.Variable) or made_by(strategy, old):
                continue
            new = tf.Variable(old.read_value(), name=old.name.split(":")[0], dtype=old.dtype, trainable=False)
            setattr(optimizer, name, new)  # tracked under the same name: a checkpoint keeps its key
            listed = optimizer._variables  # pylint: disable=protected-access
            for index, variable in enumerate(listed):
                if variable is old:
                    listed[index] = new
            remade.append(old.name.split(":")[0])
    if remade:
        optimizer._distribution_strategy = strategy  # pylint: disable=protected-access
    return remade


def has_unique_id(variable) -> bool:
    """True for a variable with its own resource (tf `_unique_id`); False for containers such as TFRA's."""
    return getattr(variable, "_unique_id", None) is not None


def legacy_momentum(optimizer) -> bool:
    """True when a legacy (`tf.keras.optimizers.legacy`) optimizer has momentum (its `_momentum`)."""
    return bool(getattr(optimizer, "_momentum", False))


def slots_of(optimizer, variables: list) -> dict[int, list]:
    """The optimizer slots made for each variable (shard): id(variable) -> its slot shards.

    tf-keras 2.16 names a slot `<optimizer name>/<slot name>/<variable's
    shared name>` (`add_variable_from_reference`); a slot whose name, shape
    or device does not match exactly is left out (the caller treats the
    variables it cannot pair by content).
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    names = [variable.name.split(":")[0] for variable in variables]
    # A name two variables share pairs with neither: their slots are fingerprinted.
    by_name = {name: variable for name, variable in zip(names, variables) if names.count(name) == 1}
    prefix = f"{optimizer.name}/"
    out: dict[int, list] = {}
    for value in optimizer.variables:
        shards = list(value.variables) if isinstance(value, tf.__internal__.distribute.ShardedVariable) else [value]
        for slot in shards:
            name = slot.name.split(":")[0]
            if not name.startswith(prefix) or "/" not in name[len(prefix):]:
                continue
            owner = by_name.get(name[len(prefix):].split("/", 1)[1])
            if owner is not None and slot.shape == owner.shape and slot.device == owner.device:
                out.setdefault(id(owner), []).append(slot)
    return out


def install_compile_hook(after_compile) -> None:
    """Makes tf-keras `Model.compile` call `after_compile(model)` once the model is compiled (once per process)."""
    global _COMPILE_HOOKED  # pylint: disable=global-statement
    with _install_lock:
        if _COMPILE_HOOKED:
            return
        model_class = _tf_keras.keras().Model
        original_compile = model_class.compile

        def compile(self, *args, **kwargs):  # pylint: disable=redefined-builtin
            result = original_compile(self, *args, **kwargs)
            after_compile(self)
            return result

        compile.__doc__ = original_compile.__doc__
        compile.__wrapped__ = original_compile
        model_class.compile = compile
        _COMPILE_HOOKED = True
