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
variable's lock (tf_psx.training.exact_updates) first looks the token up in a ring
of the tokens applied to that variable, colocated with it: an int64 vector
of `RING_SIZE` slots, token t in slot t % RING_SIZE. Found: the update is
skipped (this attempt's twin applied it here). Not found: applied, then
recorded. Two more slots count the skips and the look-ups that could not
tell (the slot holds a newer token, RING_SIZE steps or more after this one:
applied, as without a ring, and counted, never silent).

An update cut off midway. The update and the record of its token are
several kernels, and the ps runs a step's part as one function that TF
aborts as a whole when the step fails elsewhere (a killed worker's tensor
that never comes): the update can be done, or half done (Adagrad's
accumulator and not the row), with no token recorded, and the re-run then
applied it again. Measured with tests/scripts/exact_crash.py (2 workers,
10 kills): 18 of 64,000 rows applied twice while the tokens caught 7 other
updates. So an update with a journal (`writes`) runs as:

  1. save the rows it will write (the gradient's rows of the variable and
     of its slots; all of a dense variable) into a journal beside them;
  2. mark the ring "pending: token";
  3. apply; 4. record the token and clear "pending" with one kernel.

Whoever takes the lock next and finds "pending" (an attempt cut off
between 2 and 4: nothing else can have written those rows, the lock was
held) restores the journal's rows, clears the mark and counts a roll-back;
the step's re-run then applies the update afresh. A cut before 2 wrote
nothing that counts; a cut after 4 is a finished update. An update without
a journal (a TFRA table: its rows live in the table) counts a mark it
finds as "unsure": applied again, and reported.

Where the journal surely holds what the update writes (a dense update, or
a sparse one whose row count is static and fits: a fed step's is), the
update is not put inside a cond: it is applied whatever the ring says, and
a twin then writes the journal back (counted as skipped). The optimizer's
ops inside a cond branch were most of what the tokens cost
(bench/exact_fit.py, exact_arrays against exact_arrays_notokens); the undo
costs only the rare re-run.

A step's dense updates on one ps task run as one such update
(tf_psx.training.exact_updates.grouped_apply): one ring, one journal holding every
variable and slot they write, one lock; the ring's few dozen small ops
were then paid once per task instead of once per variable (18 times a
step on the 26-feature benchmark model, FixedShards(2) splitting every
dense variable).

Cost: one gather, two small conds and two scatters of a few int64s, plus
the copy of the rows the update writes (a dense variable's copy is its
whole value), on the variable's ps task under the lock it already holds.
"""

from __future__ import annotations

import tensorflow as tf

from tf_psx._tf import step_tokens as _tokens, worker_scratch as _worker_scratch

# Tokens kept per variable: more than the steps that can run between an
# attempt of a step and its re-run: a killed worker's step was re-run after its restart, 20 s
# and >4096 steps of the other workers later (tests/scripts/exact_crash.py, 3 workers). 512 KB a variable.
RING_SIZE = 65536
_SKIPPED = RING_SIZE  # slot: updates skipped (their step's twin applied them)
_UNSURE = RING_SIZE + 1  # slot: look-ups whose token was overwritten by a newer one (applied)
_VALUE = RING_SIZE + 2  # slot (counter rings only): the counter's value after its last bump (`once_counter`)
_PENDING = RING_SIZE + 2  # slot (update rings only): the token of an update begun and not recorded, or 0
_ROLLED_BACK = RING_SIZE + 3  # slot (update rings only): updates cut off midway and restored from the journal
_UPDATE_EXTRA = 2  # the slots update rings have past the counts: _PENDING, _ROLLED_BACK
_RINGS_ATTR = "_tf_psx_token_rings"
_JOURNALS_ATTR = "_tf_psx_journals"
# Rows a sparse update's journal holds when the gradient's row count is not
# static (a variable holds at most its own rows). 16384 rows of 16 float32s
# are 1 MB per written variable.
JOURNAL_ROWS = 16384
# False turns the journal off (an update cut off midway is then applied again
# by its re-run and counted "unsure"): for measuring what the journal costs.
JOURNAL = True


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
        _worker_scratch.keep_in_place(ring)
        rings[(key, kind)] = ring
    return ring


def _capacity(writes, rows) -> int:
    """Rows a sparse journal holds: the gradient's row count when it is static, else JOURNAL_ROWS; never more than the variable's."""
    static = _static_rows(rows)
    rows_of_variable = min(int(variable.shape[0]) for variable in writes)
    return max(1, min(rows_of_variable, static if static is not None else JOURNAL_ROWS))


def _journal(owner, key: str, kind: str, variable_scope, writes, whole, rows):
    """The journal of `key`'s updates: (saved row indices, or None for a dense update; a saved value per variable).

    Shapes are static (a variable of unknown shape in a step's function made
    TF 2.16.2's workers abort: "Check failed: size >= 0 (0 vs. -1)"): a
    sparse journal holds `_capacity` rows, and its last index slot the count
    saved (-1: the update did not fit, nothing saved).
    """
    journals = owner.__dict__.setdefault(_JOURNALS_ATTR, {})
    journal = journals.get((key, kind))
    if journal is None:
        name = key.replace("/", "_").replace(":", "_")
        capacity = _capacity(writes, rows) if rows is not None and writes else None
        with tf.init_scope(), variable_scope():
            indices = None if capacity is None else tf.Variable(
                tf.fill([capacity + 1], tf.constant(-1, tf.int64)), trainable=False, name=f"{name}_{kind}_journal_rows",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            values = []
            for index, variable in enumerate(list(writes) + list(whole)):
                by_rows = capacity is not None and index < len(writes)
                shape = [capacity, *variable.shape[1:]] if by_rows else variable.shape
                values.append(tf.Variable(tf.zeros(shape, variable.dtype), trainable=False,
                                          name=f"{name}_{kind}_journal_{index}",
                                          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA))
        _worker_scratch.keep_in_place(indices, *values)
        journal = journals[(key, kind)] = (indices, values)
    return journal


def _pairs(journal, writes, whole):
    """(variable, saved) pairs of the journal: (those saved by rows, those saved whole)."""
    indices, values = journal
    variables = list(writes) + list(whole)
    by_rows = len(writes) if indices is not None else 0
    return list(zip(variables[:by_rows], values[:by_rows])), list(zip(variables[by_rows:], values[by_rows:]))


def _save(journal, writes, whole, rows):
    """Copies what the update will write into the journal (rows: the gradient's indices, or None); returns the op."""
    indices, _ = journal
    row_pairs, entire_pairs = _pairs(journal, writes, whole)
    entire = [saved.assign(variable.read_value(), read_value=False) for variable, saved in entire_pairs]
    if indices is None:
        return tf.group(entire)
    capacity = int(indices.shape[0]) - 1
    rows = tf.cast(rows, tf.int64)
    count = tf.size(rows, out_type=tf.int64)

    def by_rows(chosen, number):
        positions = tf.range(number)
        ops = [saved.scatter_update(tf.IndexedSlices(variable.sparse_read(chosen), positions))
               for variable, saved in row_pairs]
        ops.append(indices.scatter_update(tf.IndexedSlices(chosen, positions)))
        with tf.control_dependencies(ops + entire):  # the count last: it says the rows are there
            return indices.scatter_update(tf.IndexedSlices(tf.reshape(number, [1]), [capacity])).op

    def nothing():
        return indices.scatter_update(tf.IndexedSlices(tf.constant([-1], tf.int64), [capacity])).op

    def deduplicated():
        # Repeated rows (a batch's ids) are saved once: a small table fits whatever the batch.
        unique = tf.unique(rows).y
        number = tf.size(unique, out_type=tf.int64)
        return tf.cond(number <= capacity, lambda: by_rows(unique, number), nothing)

    static = _static_rows(rows)
    if static is not None and static <= capacity:  # known to fit (a fed step's shapes are static): no cond
        return by_rows(rows, count)
    return tf.cond(count <= capacity, lambda: by_rows(rows, count), deduplicated)


def _restore(journal, writes, whole):
    """Writes the journal back (an update cut off midway); returns True, or False when nothing was saved."""
    indices, _ = journal
    row_pairs, entire_pairs = _pairs(journal, writes, whole)

    def write_back(positions=None):
        ops = [variable.assign(saved.read_value(), read_value=False) for variable, saved in entire_pairs]
        if positions is not None:
            rows = indices.sparse_read(positions)
            ops += [variable.scatter_update(tf.IndexedSlices(saved.sparse_read(positions), rows))
                    for variable, saved in row_pairs]
        with tf.control_dependencies(ops):
            return tf.constant(True)

    if indices is None:
        return write_back()
    count = indices.sparse_read([int(indices.shape[0]) - 1])[0]
    return tf.cond(count >= 0, lambda: write_back(tf.range(count)), lambda: tf.constant(False))


def once(owner, key: str, variable_scope, apply, skip, writes=(), rows=None, whole=(), units=1, roll_back=None):
    """`apply()` unless the step being traced already applied here, then `skip()`; run it under `key`'s lock.

    Args:
      owner: the object whose rings these are (an optimizer, a sync controller).
      key: what the update writes (a variable's key, a table).
      variable_scope: a callable returning the context the ring is made in (beside the variable).
      apply: makes the update's ops; returns an int64 scalar tensor.
      skip: makes what stands for it when skipped; returns an int64 scalar tensor.
      writes: the variables `apply` writes (the variable and its optimizer
        slots), saved before it runs and restored if it is cut off midway
        (module docstring); () for an update with no journal.
      rows: the rows of `writes` the update writes (a sparse gradient's
        indices), or None: all of them. More distinct rows than the journal
        holds (`JOURNAL_ROWS` when their number is not static) are not
        saved: cut off midway, such an update counts as "unsure".
      whole: more variables `apply` writes, saved whole whatever `rows`
        (a per-variable step counter).
      units: the updates `apply` makes (a ps task's group of dense
        updates: tf_psx.training.exact_updates.grouped_apply); a skip or a roll-back
        counts that many.
      roll_back: for an update with no journal of variables (`writes` empty):
        a function of the token of an attempt cut off midway that undoes
        what that attempt wrote and returns a bool tensor, True when the
        writes are as before it (undone, or never made); made under the
        lock. A TFRA table shard's update keeps a journal of its own
        (tf_psx.tables.tfra_updates). None: such an attempt counts as "unsure".

    Without a token (a path that has none: DatasetCreator, a custom loop),
    `apply()` as before. Every call for one `key` passes the same `writes`.
    """
    step = current()
    if step is None:
        return apply()
    token, kind = step
    writes, whole = (list(writes), list(whole)) if JOURNAL else ([], [])
    ring = _ring(owner, key, kind, variable_scope, extra=_UPDATE_EXTRA)
    journal = _journal(owner, key, kind, variable_scope, writes, whole, rows) if writes + whole else None
    # One gather and one scatter: the token's slot, the counts and the pending mark (read and written under the lock).
    slots = tf.stack([tf.math.floormod(token, RING_SIZE), tf.constant(_UNSURE, tf.int64),
                      tf.constant(_SKIPPED, tf.int64), tf.constant(_PENDING, tf.int64),
                      tf.constant(_ROLLED_BACK, tf.int64)])
    held = ring.sparse_read(slots)

    def rolled_back():
        # An attempt was cut off between its pending mark and its record: its rows go back.
        if journal is not None:
            restored = _restore(journal, writes, whole)
        else:
            restored = roll_back(held[3]) if roll_back is not None else tf.constant(False)
        restored = tf.cast(restored, tf.int64)
        unsure = held[1] + units * (1 - restored)
        cleared = ring.scatter_update(tf.IndexedSlices(tf.stack([unsure, held[4] + units * restored,
                                                                 tf.constant(0, tf.int64)]),
                                                       tf.gather(slots, [1, 4, 3])))
        with tf.control_dependencies([cleared]):
            return tf.identity(unsure)

    # The "unsure" count once a cut-off attempt is resolved. (One four-way
    # `switch_case` for both conds was slower: 0.88-0.98x exact_arrays'
    # examples/s in an A/B of 3 rounds, bench/exact_fit.py.)
    unsure_now = tf.cond(held[3] > 0, rolled_back, lambda: tf.identity(held[1]))

    def count_twin():
        return ring.scatter_update(tf.IndexedSlices(held[2:3] + units, slots[2:3]))

    def first(undo_a_twin=False):
        saved = [_save(journal, writes, whole, rows)] if journal is not None else []
        with tf.control_dependencies(saved):
            mark = ring.scatter_update(tf.IndexedSlices(tf.reshape(token, [1]), slots[3:4]))
        with tf.control_dependencies([mark]):
            done = apply()
        settled = done
        if undo_a_twin:
            # Applied whatever the ring says; a twin writes the journal back. Between the apply and the undo
            # the variable holds the update twice, as async readers can see any variable mid-update; a cut
            # there leaves the pending mark, and the next lock holder rolls it back.
            def undo():
                restored = _restore(journal, writes, whole)
                with tf.control_dependencies([restored]):
                    count = count_twin()
                with tf.control_dependencies([count]):
                    return tf.constant(True)

            with tf.control_dependencies([done]):
                settled = tf.cond(tf.equal(held[0], token), undo, lambda: tf.constant(False))
        with tf.control_dependencies([settled]):
            # A twin writes back what its slot holds: its own token, "unsure" unchanged.
            unsure = unsure_now + units * tf.cast(held[0] > token, tf.int64)
            record = ring.scatter_update(tf.IndexedSlices(tf.stack([token, unsure, tf.constant(0, tf.int64)]),
                                                          tf.gather(slots, [0, 1, 3])))
        with tf.control_dependencies([record]):
            return tf.identity(done)

    def twin():
        done = skip()
        with tf.control_dependencies([done]):
            count = count_twin()
        with tf.control_dependencies([count]):
            return tf.identity(done)

    with tf.control_dependencies([unsure_now]):
        if journal is not None and _fits(journal, rows):
            # The optimizer's ops inside a cond branch cost more than the ring, the journal and the cond
            # together (bench/exact_fit.py, exact_arrays against exact_arrays_notokens); a twin is rare
            # (a step TF re-ran), so it pays the undo instead.
            return first(undo_a_twin=True)
        return tf.cond(tf.equal(held[0], token), twin, first)


def save_journal(owner, key: str, variable_scope, writes, rows=None):
    """Saves the rows of `writes` that an update at `rows` (None: all of them) will write into `key`'s journal.

    For an update that is not a `once` of its own but one part of a larger
    transaction under a lock the caller holds (a sync arrival's adds,
    tf_psx.training.sync_training): the caller marks its transaction pending after
    this, and whoever finds the mark restores with `restore_journal`. The
    journal is made on first use in `variable_scope()`; a journal made for
    rows saves nothing when given `rows=None` (restoring it then returns
    False). Returns the op.
    """
    journal = _journal(owner, key, "journal", variable_scope, writes, (), rows)
    indices, _ = journal
    if indices is not None and rows is None:
        capacity = int(indices.shape[0]) - 1
        return indices.scatter_update(tf.IndexedSlices(tf.constant([-1], tf.int64), [capacity])).op
    return _save(journal, writes, (), rows)


def restore_journal(owner, key: str, writes):
    """Writes back what `save_journal` saved for `key`: True, or False when nothing was saved (a bool tensor)."""
    journal = owner.__dict__.get(_JOURNALS_ATTR, {}).get((key, "journal"))
    if journal is None:
        return tf.constant(False)
    return _restore(journal, writes, ())


def _static_rows(rows):
    """The row count of a rank-1 `rows` when known at trace time, else None."""
    return rows.shape[0] if rows.shape.rank == 1 else None


def _fits(journal, rows) -> bool:
    """True when the journal surely holds every row the update writes (a dense update, or a static row count that fits)."""
    indices, _ = journal
    if indices is None:
        return True
    static = _static_rows(rows)
    return static is not None and static <= int(indices.shape[0]) - 1


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
    """{"skipped": updates skipped as already applied, "unsure": look-ups that could not tell,
    "rolled_back": updates cut off midway and restored}, over `owner`'s rings."""
    return _sum(owner.__dict__.get(_RINGS_ATTR, {}).values())


def counts_of(owner, key: str) -> dict:
    """`counts` over the rings of `key` only (every kind)."""
    return _sum(ring for (ring_key, _), ring in owner.__dict__.get(_RINGS_ATTR, {}).items() if ring_key == key)


def _sum(rings) -> dict:
    skipped = unsure = rolled_back = 0
    for ring in rings:
        is_update_ring = ring.shape[0] == RING_SIZE + 2 + _UPDATE_EXTRA
        values = ring.sparse_read([_SKIPPED, _UNSURE] + ([_ROLLED_BACK] if is_update_ring else [])).numpy()
        skipped, unsure = skipped + int(values[0]), unsure + int(values[1])
        rolled_back += int(values[2]) if is_update_ring else 0
    return {"skipped": skipped, "unsure": unsure, "rolled_back": rolled_back}
