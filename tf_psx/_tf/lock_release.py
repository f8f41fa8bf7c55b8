"""A `tf.CriticalSection`'s release kept out of TF 2.16.2's program-order chain of stateful ops.

TF's automatic control dependencies run every stateful op that has no
resource input in program order, within a traced function
(`auto_control_deps.py`, `last_write_to_resource[None]`). The lock release
of a CriticalSection (`ConsumeMutexLock`, whose input is a variant) is such
an op, so the releases of all variables' locks were chained one after the
other, across ps tasks: measured 1.5x to 1.9x ms/step on a 26-table model
with 2 workers. The releases made through `run_unordered` need no order among
themselves (each waits for its own update through data edges); they are
exempted from that chain by wrapping `auto_control_deps.op_is_stateful` once.
The caller keeps each release alive (tf_psx.training.exact_updates reads the
variable's counter after it; a table policy uses the returned value).
"""

from __future__ import annotations

import threading
import weakref

_UNORDERED_RELEASES: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()
_PATCHED = False


def exempt_release_from_ordering(output) -> None:
    """Takes the `ConsumeMutexLock` ops that `output` depends on out of the program-order chain."""
    global _PATCHED  # pylint: disable=global-statement
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if tf.executing_eagerly():
        return
    from tensorflow.python.framework import auto_control_deps  # pylint: disable=import-outside-toplevel

    with _lock:
        if not _PATCHED:
            original = auto_control_deps.op_is_stateful

            def op_is_stateful(op):
                if op in _UNORDERED_RELEASES:
                    return False
                return original(op)

            op_is_stateful.__wrapped__ = original
            auto_control_deps.op_is_stateful = op_is_stateful
            _PATCHED = True
    for op in output.op.control_inputs:
        if op.type == "ConsumeMutexLock":
            _UNORDERED_RELEASES.add(op)


def run_unordered(lock, fn):
    """`lock.execute(fn)` in a traced step, its release kept out of TF's program-order chain.

    The release is a control input of the returned value: whatever uses
    the value waits for it.
    """
    output = lock.execute(fn, exclusive_resource_access=False)
    exempt_release_from_ordering(output)
    return output
