"""A re-run step's updates applied once: per-variable rings of the step tokens already applied.

TF 2.16.2's `ClusterCoordinator` re-runs a closure whose worker failed, with
the same arguments, on another worker. A step is many ops on several ps
tasks: a worker killed mid-step can leave its update applied to some
variables and not to others, and the re-run then applied it again where the
first attempt got to (tests/launch/test_chaos.py measured 181 `iterations` for 180
steps after 3 kills; tests/scripts/exact_crash.py --no-tokens counts the
rows applied twice).

Each step that the coordinator feeds carries a token, the same in every
attempt (tf_psx._tf.step_tokens). Every update that runs under its
variable's lock (tf_psx.exact_updates) first looks the token up in a ring
of the tokens applied to that variable, colocated with it: an int64 vector
of `RING_SIZE` slots, token t in slot t % RING_SIZE. Found: the update is
skipped (this attempt's twin applied it here). Not found: applied, then
recorded. Two more slots count the skips and the look-ups that could not
tell (the slot holds a newer token, RING_SIZE steps or more after this one:
applied, as without a ring, and counted, never silent).

Cost: one gather, one compare and one scatter of a few int64s, on the
variable's ps task under the lock it already holds.
"""

from __future__ import annotations

import tensorflow as tf

from tf_psx._tf import step_tokens as _tokens

# Tokens kept per variable: more than the steps that can run between an
# attempt of a step and its re-run: a killed worker's step was re-run after its restart, 20 s
# and >4096 steps of the other workers later (tests/scripts/exact_crash.py, 3 workers). 512 KB a variable.
RING_SIZE = 65536
_SKIPPED = RING_SIZE  # slot: updates skipped (their step's twin applied them)
_UNSURE = RING_SIZE + 1  # slot: look-ups whose token was overwritten by a newer one (applied)
_VALUE = RING_SIZE + 2  # slot (counter rings only): the counter's value after its last bump (`once_counter`)
_RINGS_ATTR = "_tf_psx_token_rings"


def current():
    """The `(token, kind)` of the step being traced, or None (no token on this path)."""
    return _tokens.current()


def _ring(owner, key: str, kind: str, variable_scope, extra: int = 0):
    """The ring of `key`'s tokens of `kind` (and `extra` more slots), made on first use in `variable_scope()`.

    Not checkpointed.
    """
    rings = owner.__dict__.setdefault(_RINGS_ATTR, {})
    ring = rings.get((key, kind))
    if ring is None:
        name = key.replace("/", "_").replace(":", "_")
        with tf.init_scope(), variable_scope():
            ring = tf.Variable(tf.zeros([RING_SIZE + 2 + extra], tf.int64), trainable=False, name=f"{name}_{kind}_tokens",
                               aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        rings[(key, kind)] = ring
    return ring


def once(owner, key: str, variable_scope, apply, skip):
    """`apply()` unless the step being traced already applied here, then `skip()`; run it under `key`'s lock.

    Args:
      owner: the object whose rings these are (an optimizer, a sync controller).
      key: what the update writes (a variable's key, a table).
      variable_scope: a callable returning the context the ring is made in (beside the variable).
      apply: makes the update's ops; returns an int64 scalar tensor.
      skip: makes what stands for it when skipped; returns an int64 scalar tensor.

    Without a token (a path that has none: DatasetCreator, a custom loop),
    `apply()` as before.
    """
    step = current()
    if step is None:
        return apply()
    token, kind = step
    ring = _ring(owner, key, kind, variable_scope)
    # One gather and one scatter: the token's slot and the two counts (read and written under the lock).
    slots = tf.stack([tf.math.floormod(token, RING_SIZE), tf.constant(_UNSURE, tf.int64),
                      tf.constant(_SKIPPED, tf.int64)])
    held = ring.sparse_read(slots)

    def first():
        done = apply()
        with tf.control_dependencies([done]):
            unsure = held[1] + tf.cast(held[0] > token, tf.int64)
            record = ring.scatter_update(tf.IndexedSlices(tf.stack([token, unsure]), slots[:2]))
        with tf.control_dependencies([record]):
            return tf.identity(done)

    def twin():
        done = skip()
        with tf.control_dependencies([done]):
            count = ring.scatter_update(tf.IndexedSlices(held[2:] + 1, slots[2:]))
        with tf.control_dependencies([count]):
            return tf.identity(done)

    return tf.cond(tf.equal(held[0], token), twin, first)


def once_counter(owner, key: str, variable_scope, counter, delta):
    """`counter += delta` once per step token, with the token and the new value written by one kernel.

    Under `once` the update and the write of its token are two kernels. A
    worker killed mid-step can leave the step's function on the ps cancelled
    between them, and the re-run then applies the update again: measured,
    `iterations` 8,002 for 8,000 steps after 10 kills while every row was
    applied once (tests/scripts/exact_crash.py). Here one scatter writes the
    token and the counter's new value into the ring, and the counter is then
    *assigned* that value, which a twin simply does again: a cancel between
    the two writes loses nothing and counts nothing twice. The new value is
    max(counter, the ring's value) + delta: the counter may have been
    restored (a snapshot), or lag the ring by one cancelled assign.

    Args:
      owner, key, variable_scope: as `once`.
      counter: an int64 variable (the optimizer's `iterations`).
      delta: what one step adds.

    Returns:
      The counter's value after the step (an int64 scalar tensor).
    """
    step = current()
    if step is None:
        return counter.assign_add(tf.cast(delta, counter.dtype), read_value=True)
    token, kind = step
    ring = _ring(owner, key, kind, variable_scope, extra=1)
    slots = tf.stack([tf.math.floormod(token, RING_SIZE), tf.constant(_UNSURE, tf.int64),
                      tf.constant(_SKIPPED, tf.int64), tf.constant(_VALUE, tf.int64)])
    held = ring.sparse_read(slots)
    latest = tf.maximum(tf.cast(counter.read_value(), tf.int64), held[3])

    def first():
        new = latest + tf.cast(delta, tf.int64)
        unsure = held[1] + tf.cast(held[0] > token, tf.int64)
        record = ring.scatter_update(tf.IndexedSlices(tf.stack([token, unsure, new]), tf.gather(slots, [0, 1, 3])))
        with tf.control_dependencies([record]):
            return counter.assign(tf.cast(new, counter.dtype), read_value=True)

    def twin():
        count = ring.scatter_update(tf.IndexedSlices(held[2:3] + 1, slots[2:3]))
        with tf.control_dependencies([count]):
            return counter.assign(tf.cast(latest, counter.dtype), read_value=True)

    return tf.cond(tf.equal(held[0], token), twin, first)


def counts(owner) -> dict:
    """{"skipped": updates skipped as already applied, "unsure": look-ups that could not tell}, over `owner`'s rings."""
    return _sum(owner.__dict__.get(_RINGS_ATTR, {}).values())


def counts_of(owner, key: str) -> dict:
    """`counts` over the rings of `key` only (every kind)."""
    return _sum(ring for (ring_key, _), ring in owner.__dict__.get(_RINGS_ATTR, {}).items() if ring_key == key)


def _sum(rings) -> dict:
    skipped = unsure = 0
    for ring in rings:
        values = ring.sparse_read([_SKIPPED, _UNSURE]).numpy()
        skipped, unsure = skipped + int(values[0]), unsure + int(values[1])
    return {"skipped": skipped, "unsure": unsure}
