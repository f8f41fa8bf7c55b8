"""The step token: one int64 per scheduled step, the same in every attempt TF 2.16.2 makes of it.

TF 2.16.2's `ClusterCoordinator` runs a closure again when its worker fails
(`Worker._process_closure` -> `_ClosureQueue.put_back`): the same traced
function with the same arguments, on another worker. A step whose first
attempt already applied its update to some variables (a worker killed after
the ps ran part of the step) applies it there a second time. Giving each
scheduled step a token among its arguments (a tensor: a Python int would
retrace the step per value) lets an update see that a twin of its attempt
already ran: `tf_psx.training.step_once` keeps the tokens each variable applied.

`next_token(count)` numbers the steps of this process (from 1: a ring of
zeros holds no token; a closure of `count` steps takes `count` numbers);
`tracing_with(token, kind)` makes the token tensor visible to code traced
inside the block (the exact updates, the sync arrival), on
this thread; `current()` reads it. `kind` keeps tokens that number different
things (fit's steps, a sync step's version) in rings of their own.
"""

from __future__ import annotations

import contextlib
import threading

_counter_lock = threading.Lock()
_next = 1  # the next token `next_token` gives
_local = threading.local()

STEP = "step"  # a step fed by the coordinator (tf_psx._tf.fed_steps)
SYNC = "sync"  # the apply of one sync version (tf_psx.training.sync_training)


def next_token(count: int = 1) -> int:
    """The first of `count` consecutive numbers no other step of this process got (1, 2, ...)."""
    global _next  # pylint: disable=global-statement
    with _counter_lock:
        first, _next = _next, _next + count
    return first


@contextlib.contextmanager
def tracing_with(token, kind: str):
    """Makes `(token, kind)` what `current()` returns inside the block (this thread; blocks nest)."""
    stack = _local.__dict__.setdefault("stack", [])
    stack.append((token, kind))
    try:
        yield
    finally:
        stack.pop()


@contextlib.contextmanager
def without_token():
    """Inside the block `current()` is None (code traced there must not use an outer step's token)."""
    with tracing_with(None, ""):
        yield


def set_current(token, kind: str) -> None:
    """Makes `(token, kind)` the innermost entry of `tracing_with` (which must be open on this thread).

    For a loop whose steps read their tokens with their batches: each read
    replaces the token the rest of that step's trace sees.
    """
    _local.stack[-1] = (token, kind)


def current():
    """The innermost `(token tensor, kind)` of `tracing_with`, or None outside one."""
    stack = getattr(_local, "stack", None)
    if not stack or stack[-1][0] is None:
        return None
    return stack[-1]
