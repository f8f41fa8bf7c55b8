"""Synchronous parameter-server training: the sync controller of `ParameterServerStrategy(sync=...)`.

A sync step combines R gradients (R = `replicas_to_aggregate`), each from
its own batch and all computed from the same parameters, and applies their
mean once: with R workers of batch b it is one step of batch R*b. TF1's
`SyncReplicasOptimizer` did this with a gradient accumulator on the ps and a
token queue; here both are variables on a ps task, changed under one
`tf.CriticalSection` (the sync lock), and no op ever blocks without a bound.

The state is one float64 vector on a ps task (see the `_F_*` indices):
whether sync is on, the step's version, the slots taken and the gradients
arrived in this version, the late gradients dropped, the slots reassigned
after a timeout, when the version's last slot was taken, and the batches and
steps applied so far.

* **Claim.** `strategy.run` (so `model.fit`, `steps_per_execution > 1` and a
  custom `ClusterCoordinator` loop alike) first claims a slot of the current
  version under the lock, and only then reads any parameter: every op of the
  step function gets the claim as a control input. With all `num_workers`
  slots taken, the step polls (a sleep of `POLL_S` between tries) until the
  version moves on. A slot whose step has not arrived `timeout_s` after the
  last claim (its worker died) is given to the waiting step, so the version
  completes without the dead worker; a poll that lasts past three timeouts
  fails the step with an error that names the version.
* **Arrive.** The optimizer's apply (`_internal_apply_gradients`) adds the
  step's gradients to accumulators beside each variable under the lock, if
  its version is still the current one; a late gradient (its version was
  applied without it: a backup worker's, or one whose slot was reassigned)
  is dropped and counted. The R-th arrival applies the mean through the
  optimizer's own apply (so exact updates, TFRA tables, slots, `iterations`
  and learning-rate schedules behave as with one worker), clears the
  accumulators and starts the next version.
* **Accumulators** (tf_psx.training.sync_accumulators): a sum beside each
  variable (a TFRA table: a hash table of sums per key), which the R-th
  arrival's apply reads as the mean gradient.
* **A step run again.** TF re-runs a closure whose worker died, on
  another worker, with the same step token (tf_psx._tf.step_tokens). The
  state keeps three rings of tokens beside its header, written by the same
  scatter as the header they change: the step that claimed last in a slot,
  the version it claimed, and the step that arrived last. A re-run whose
  twin arrived applies nothing (`TWIN`); one whose twin claimed a slot of
  the current version and never arrived takes that slot over (no wait for
  the timeout). An arrival is one transaction under the lock: the rows
  its adds write are saved in journals beside the accumulators
  (`tf_psx.training.step_once.save_journal`), the header is marked pending, the
  adds run, and one scatter of the header commits it (the count of
  arrivals, the token's ring slot, the mark cleared). The next arrival
  or flush that finds the mark (an arrival cut off midway) writes the
  journals back first (claims write no accumulator), so a cut arrival's gradient is in no version's
  sums, and its re-run adds all of it to the version it then claims, even
  when the first attempt's slot was reassigned and its version completed
  without it. The R-th arrival's commit seals the version; a seal whose
  apply was cut off grants no new slot until an arrival, the re-run twin
  or a flush finishes it, the apply carrying the version as its token so
  no variable applies it twice. A gradient is then summed once, and a
  version applied once, whatever the point at which a worker was killed
  (tests/scripts/exact_crash.py --sync).
* **Flush.** `SyncController.flush` applies a partial step (fewer than R
  arrivals) once nothing is in flight: at the end of `fit`, before a
  snapshot and when switching mode, so every batch is applied exactly once.

"Sync" here is synchronous training only; snapshots are
`tf_psx.callbacks.PeriodicSync`. What this reaches into in TF, tf-keras
and TFRA lives in the door: `tf_psx._tf.sync_training` (the optimizer's
`_internal_apply_gradients`, the tail flush in `Model.fit`, the claim's
graph bookkeeping, the learning-rate schedule, the closure queue, tf.data's
sleep).
`install` passes `controller_of` to it; the strategy's `run` wraps each
step with `SyncController.wrap_step`.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref

import numpy as np
import tensorflow as tf

from tf_psx._tf import exact_updates as _optimizer_door, runtime as _runtime
from tf_psx._tf import step_tokens as _tokens, sync_training as _door, worker_scratch as _worker_scratch
from tf_psx.errors import SyncStepError
from tf_psx.training import exact_updates as _exact, step_once as _step_once, sync_accumulators as _accumulators

# Indices into the state vector's header.
(_F_ENABLED, _F_VERSION, _F_TAKEN, _F_ARRIVED, _F_DROPPED, _F_REASSIGNED, _F_STARTED, _F_BATCHES, _F_STEPS,
 _F_REUSED, _F_TWINS, _F_PENDING, _F_ROLLED_BACK, _F_UNSURE, _F_REASSIGNED_NOW) = range(15)
_HEADER = 15

# `make(optimizer, variable, state)` -> a hash table's accumulator, or None for a variable that is not a table's:
# registered by tf_psx.tables.sync (imported with tf_psx.tables), so the training core does not import the tables.
TABLE_ACCUMULATORS: list = []
# Past the header, three rings of step tokens (slot: token % RING): the token
# of the step that claimed last in that slot, the version it claimed, and the
# token of the step that arrived last in that slot (see "A step run again").
_RING = _step_once.RING_SIZE
_CLAIMED, _CLAIMED_VERSION, _ARRIVED = _HEADER, _HEADER + _RING, _HEADER + 2 * _RING
_STATE_SIZE = _HEADER + 3 * _RING
# Claim results besides a version >= 0.
ASYNC = -1
_WAIT = -2
TWIN = -3  # the step's twin (an earlier attempt of it) already arrived: nothing to apply
# A version sealed and not applied (its R-th arrival's worker died in the apply): the step finishes that
# version at its arrival, then adds its gradient to the version current then (`SyncController._arrive`).
FINISH = -4
# Seconds between two tries of a step that waits for a slot.
POLL_S = 0.002
STATE_DEVICE = "/job:ps/replica:0/task:0/device:CPU:0"
# How often the watchdog looks at the workers while steps are pending.
WATCHDOG_POLL_S = 1.0

_ids = itertools.count()


def _slots(token):
    """The state's indices of `token`'s claim, claimed version and arrival."""
    at = tf.math.floormod(tf.cast(token, tf.int64), _RING)
    return tf.stack([_CLAIMED + at, _CLAIMED_VERSION + at, _ARRIVED + at])


def _step_token(step):
    """The token of `step` (a `step_tokens.current()`) when it is a fed step's, else None."""
    return step[0] if step is not None and step[1] == _tokens.STEP else None


def _arrived(held, token):
    """Whether `token`'s arrival slot (of `held`, from `_read`) holds it: an attempt of its step arrived."""
    return tf.equal(held[2], tf.cast(token, tf.float64))


def _read(state, token=None):
    """(the header, `token`'s three ring slots or None), read by one gather."""
    indices = tf.range(_HEADER, dtype=tf.int64)
    if token is None:
        return state.sparse_read(indices), None
    values = state.sparse_read(tf.concat([indices, _slots(token)], 0))
    return values[:_HEADER], values[_HEADER:]


def _write(state, header, token=None, held=None):
    """Writes `header` (and `token`'s slots `held`) with one scatter; returns `header` once written."""
    indices, values = tf.range(_HEADER, dtype=tf.int64), header
    if token is not None:
        indices, values = tf.concat([indices, _slots(token)], 0), tf.concat([header, held], 0)
    with tf.control_dependencies([state.scatter_update(tf.IndexedSlices(values, indices))]):
        return tf.identity(header)


def _set(vector, index: int, value):
    return tf.tensor_scatter_nd_update(vector, [[index]], tf.reshape(tf.cast(value, vector.dtype), [1]))


class _Applier:
    """What a flush needs to apply the accumulated gradients without a step's own gradients."""

    def __init__(self, optimizer, original, distribution, accumulators):
        self.optimizer, self.original, self.distribution = optimizer, original, distribution
        self.accumulators = accumulators
        # The traced flush of these accumulators (SyncController.flush), made on first use.
        self.flush_function = None

    def apply(self, count, version):
        """Applies the mean of `count` accumulated gradients, then clears them; returns a tensor.

        The apply carries `version` + 1 as its token (tf_psx.training.step_once): a
        re-run of a step whose first attempt applied this version to some
        variables and died before the state moved on skips those variables
        and `iterations`, so each version is applied once per variable.
        """
        optimizer = self.optimizer
        means = [accumulator.mean(count) for accumulator in self.accumulators]
        loads = [op for _, ops in means for op in ops]
        grads_and_vars = [(gradient, accumulator.variable) for (gradient, _), accumulator in
                          zip(means, self.accumulators)]
        with tf.control_dependencies(loads):
            rate = _door.learning_rate_update(optimizer)
        with tf.control_dependencies(loads + rate), _tokens.tracing_with(version + 1, _tokens.SYNC):
            applied = self.original(self.distribution, grads_and_vars)
        with tf.control_dependencies([applied]):
            clears = [accumulator.clear() for accumulator in self.accumulators]
        with tf.control_dependencies(clears):
            return tf.constant(0, tf.int64)


class SyncController:
    """The sync state of one `tf_psx.ParameterServerStrategy` (see the module docstring).

    Args:
      strategy: the strategy; its variables are made in its scope.
      enabled: whether steps start in sync mode.
      replicas_to_aggregate: R, the gradients one step applies.
      timeout_s: how long a slot may stay without its gradient.
      worker_addresses: host:port of each worker, for the watchdog.
      address_listens: a function of "host:port", True when it accepts
        connections (the watchdog's test of a worker).
    """

    def __init__(self, strategy, *, enabled: bool, replicas_to_aggregate: int, timeout_s: float,
                 worker_addresses: list[str], address_listens):
        self.strategy = strategy
        self.num_workers = len(worker_addresses)
        self.replicas_to_aggregate = int(replicas_to_aggregate)
        self.timeout_s = float(timeout_s)
        self.worker_addresses = list(worker_addresses)
        self.address_listens = address_listens
        initial = np.zeros(_STATE_SIZE, np.float64)
        initial[_F_ENABLED] = 1.0 if enabled else 0.0
        # A plain variable on the first ps task (made outside the strategy's
        # scope, so its partitioner never splits it).
        with tf.init_scope(), tf.device(STATE_DEVICE):
            self.state = tf.Variable(tf.constant(initial, tf.float64), trainable=False, name="tf_psx_sync_state")
            self.lock = tf.CriticalSection(shared_name=f"tf_psx_sync_lock_{next(_ids)}")
        _worker_scratch.keep_in_place(self.state)
        self._claims = _door.StepClaims()
        self._accumulators: dict = {}
        # (accumulator ids) -> (the number a pending mark names them by, the accumulators): `_accumulator_set`.
        self._accumulator_sets: dict = {}
        self._applier: _Applier | None = None
        _Watchdog(self)

    # --- inside a step --------------------------------------------------

    def _try_claim(self, token=None):
        s, held = _read(self.state, token)
        now = tf.cast(tf.timestamp(), tf.float64)
        enabled = s[_F_ENABLED] > 0
        if token is None:
            twin = reuse = tf.constant(False)
        else:
            mine = tf.cast(token, tf.float64)
            # A twin of this step arrived: its gradient is in; this attempt applies nothing.
            twin = _arrived(held, token)
            # A twin claimed a slot of the current version and never arrived (its worker died): this attempt takes it.
            # Not once a slot of this version was reassigned: it may have been this one (its reassigned
            # holder's gradient would then be late, and dropped).
            reuse = (enabled & ~twin & tf.equal(held[0], mine) & tf.equal(held[1], s[_F_VERSION])
                     & tf.equal(s[_F_REASSIGNED_NOW], 0))
        # A version whose R gradients arrived and whose apply was cut off (the lock is held from the R-th
        # arrival to the header's next write, so a claim sees it only after a cut): the step is to finish it.
        sealed = s[_F_ARRIVED] >= self.replicas_to_aggregate
        reuse = reuse & ~sealed
        fresh = enabled & ~twin & ~reuse
        finish = fresh & sealed
        fresh = fresh & ~sealed
        free = s[_F_TAKEN] < self.num_workers
        expired = now - s[_F_STARTED] > self.timeout_s
        claimed = reuse | (fresh & (free | expired))
        reassigned = fresh & ~free & expired
        new = _set(s, _F_TAKEN, s[_F_TAKEN] + tf.cast(fresh & free, tf.float64))
        new = _set(new, _F_REASSIGNED, s[_F_REASSIGNED] + tf.cast(reassigned, tf.float64))
        new = _set(new, _F_REASSIGNED_NOW, s[_F_REASSIGNED_NOW] + tf.cast(reassigned, tf.float64))
        new = _set(new, _F_REUSED, s[_F_REUSED] + tf.cast(reuse, tf.float64))
        new = _set(new, _F_TWINS, s[_F_TWINS] + tf.cast(twin, tf.float64))
        restart = fresh & claimed & (tf.equal(s[_F_TAKEN], 0) | reassigned)
        new = _set(new, _F_STARTED, tf.where(restart, now, s[_F_STARTED]))
        if token is not None:
            held = tf.stack([tf.where(claimed, mine, held[0]), tf.where(claimed, s[_F_VERSION], held[1]), held[2]])
        with tf.control_dependencies([_write(self.state, new, token, held)]):
            version = tf.cast(s[_F_VERSION], tf.int64)
            return tf.where(twin, tf.constant(TWIN, tf.int64), tf.where(finish, tf.constant(FINISH, tf.int64), tf.where(
                enabled, tf.where(claimed, version, tf.constant(_WAIT, tf.int64)), tf.constant(ASYNC, tf.int64))))

    def _locked(self, fn):
        """`fn` under the sync lock. The release stays in TF's program-order
        chain of stateful ops, so it runs even when nothing uses the result
        (an unused release is pruned and the lock then excludes nothing)."""
        return self.lock.execute(fn, exclusive_resource_access=False)

    def claim(self, token=None):
        """A slot of the current version (>= 0), `ASYNC` or `TWIN` (for the step of `token`, an int64 tensor or
        None); waits, bounded, while every slot is taken."""
        first = self._locked(lambda: self._try_claim(token))
        # Bounded by time, not by a count of polls: a poll on a loaded machine takes longer than POLL_S.
        deadline = tf.timestamp() + 3 * self.timeout_s

        def waiting(version):
            return tf.equal(version, _WAIT) & (tf.timestamp() < deadline)

        def poll(version):  # pylint: disable=unused-argument
            with tf.control_dependencies([_door.sleep(POLL_S)]):
                return self._locked(lambda: self._try_claim(token))

        version = tf.while_loop(waiting, poll, [first])
        check = tf.debugging.assert_none_equal(
            version, tf.constant(_WAIT, tf.int64),
            message=(f"tf_psx sync: a step waited {3 * self.timeout_s:.0f} s for a slot of a sync step whose "
                     "gradients never arrived, even after its slots were reassigned. Fix: check that the "
                     "workers are alive (tf-psx doctor), or raise ParameterServerStrategy(sync_timeout_s=...)."))
        with tf.control_dependencies([check]):
            return tf.identity(version)

    def wrap_step(self, fn):
        """`fn` run after a claim: every op it makes waits for the claim (`strategy.run` calls this).

        The step's token is read here, on the thread that traces the step:
        tf.distribute may run `fn` on a thread of its own, where
        `step_tokens.current()` does not see it; `fn` is traced there with it.
        """
        step = _tokens.current()
        token = _step_token(step)

        def with_token(*args, **kwargs):
            if step is None:
                return fn(*args, **kwargs)
            with _tokens.tracing_with(*step):
                return fn(*args, **kwargs)

        return self._claims.wrap(with_token, lambda: self.claim(token))

    def current_version(self):
        """The version claimed by the step being traced (an int64 tensor), or None outside one."""
        return self._claims.current()

    def _accumulator(self, optimizer, gradient, variable):
        key = (id(optimizer), _optimizer_door.var_key(optimizer, variable))
        accumulator = self._accumulators.get(key)
        if accumulator is None:
            accumulator = next(filter(None, (make(optimizer, variable, self.state) for make in TABLE_ACCUMULATORS)), None)
            if accumulator is None and isinstance(gradient, tf.IndexedSlices):
                accumulator = _accumulators.SparseAccumulator(self.strategy, variable)
            elif accumulator is None:
                accumulator = _accumulators.DenseAccumulator(self.strategy, variable)
            self._accumulators[key] = accumulator
        return accumulator

    def apply_gradients_fn(self, optimizer, original):
        """A `_distributed_apply_gradients_fn` for a step traced after its claim (`wrap_step`).

        It accumulates when the claim is a version (sync), applies through
        `original` when it is `ASYNC`, and when it is `TWIN` only finishes
        a version its twin sealed (`_arrive`).
        """

        def apply_gradients_fn(distribution, grads_and_vars, **kwargs):
            version = self.current_version()
            grads_and_vars = list(grads_and_vars)
            accumulators = [self._accumulator(optimizer, g, v) for g, v in grads_and_vars]
            applier = _Applier(optimizer, lambda d, gv: original(d, gv, **kwargs), distribution, accumulators)
            self._applier = applier
            gradients = [gradient for gradient, _ in grads_and_vars]
            token = _step_token(_tokens.current())

            def synchronous():
                return self._locked(lambda: self._arrive(version, token, applier, gradients))

            def asynchronous():
                with tf.control_dependencies([original(distribution, grads_and_vars, **kwargs)]):
                    return tf.constant(ASYNC, tf.int64)

            return tf.cond(tf.equal(version, ASYNC), asynchronous, synchronous)

        return apply_gradients_fn

    def _arrive(self, version, token, applier, gradients):
        """Under the sync lock: adds this step's gradients to the current version; returns the version after.

        An arrival is one transaction, committed by the header's write (the
        arrival count and the token's ring slot, one scatter): the adds'
        rows are saved in journals beside the accumulators (tf_psx.training.step_once.
        save_journal) and the header marked pending first, so an arrival
        cut off between the mark and the commit is rolled back by the next
        holder of the lock (`_recover`) and its gradient is in no version's
        sums: its re-run adds all of it, to whichever version it then claims.
        The R-th arrival's commit seals the version (its R gradients are
        fixed); its apply and clears follow, and the header's next write
        starts the next version. A seal whose apply was cut off is finished
        by the next arrival: a step that claimed while it was sealed
        (`FINISH`: it finishes it, then adds its own gradient to the version
        current then), the re-run twin (`TWIN`) or a flush. The apply carries
        the version as its token, so no variable applies it twice. One
        apply site: an arrival never completes two versions (with R = 1, a
        `FINISH` step's own version is left sealed for the next arrival).
        """
        set_id = self._accumulator_set(applier.accumulators)
        s, held = _read(self.state, token)
        s = self._recover(s)
        arrived_before = tf.constant(False) if token is None else _arrived(held, token)
        sealed = s[_F_ARRIVED] >= self.replicas_to_aggregate
        claimed = version >= 0
        # A step that claimed a slot of the current version.
        normal = claimed & ~arrived_before & tf.equal(tf.cast(s[_F_VERSION], tf.int64), version) & ~sealed
        # A step that claimed while a version was sealed: its gradient goes to the version current after the
        # seal is finished (now, when nothing is sealed; else after the apply below).
        carried = tf.equal(version, FINISH) & ~arrived_before
        late = claimed & ~normal & ~arrived_before  # its version was applied without it, or sealed

        def arrival(header, taken):
            """Adds the gradients and commits: the header with one more arrival (and `taken` more slots)."""
            saves = [_step_once.save_journal(self, _accumulators.journal_key(acc), acc.scope, acc.writes, _accumulators.rows_written(gradient))
                     for acc, gradient in zip(applier.accumulators, gradients) if acc.writes]
            with tf.control_dependencies(saves):
                marked = _write(self.state, _set(header, _F_PENDING, set_id))
            with tf.control_dependencies([marked]):
                adds = [acc.add(gradient) for acc, gradient in zip(applier.accumulators, gradients)]
            with tf.control_dependencies(adds):
                new = _set(header, _F_ARRIVED, header[_F_ARRIVED] + 1)
                new = _set(new, _F_TAKEN, header[_F_TAKEN] + taken)
                new = _set(new, _F_PENDING, 0)
                # The commit: the arrival's token is recorded by the same scatter as the count it changes.
                ring = None if token is None else tf.stack([held[0], held[1], tf.cast(token, tf.float64)])
                return _write(self.state, new, token, ring)

        counted = _set(s, _F_DROPPED, s[_F_DROPPED] + tf.cast(late, tf.float64))
        counted = _set(counted, _F_TWINS, s[_F_TWINS] + tf.cast(claimed & arrived_before, tf.float64))
        first = tf.cond(normal | (carried & ~sealed), lambda: arrival(counted, tf.cast(carried, tf.float64)),
                        lambda: _write(self.state, counted))
        applied = tf.cond(first[_F_ARRIVED] >= self.replicas_to_aggregate,
                          lambda: self._complete(first, first[_F_ARRIVED], applier), lambda: tf.identity(first))
        after = tf.cond(carried & sealed, lambda: arrival(applied, 1.0), lambda: tf.identity(applied))
        return tf.cast(after[_F_VERSION], tf.int64)

    def _accumulator_set(self, accumulators) -> int:
        """The number (>= 1) a pending mark names `accumulators` by: what a roll-back restores."""
        key = tuple(id(accumulator) for accumulator in accumulators)
        sets = self._accumulator_sets
        if key not in sets:
            sets[key] = (len(sets) + 1, list(accumulators))
        return sets[key][0]

    def _recover(self, s):
        """Under the lock: rolls back an arrival cut off between its pending mark and its commit; returns the header.

        Its accumulators go back to their journals (nothing else wrote them
        since: the lock was held). A hash table's sums keep no journal: such
        a roll-back is counted "unsure" (the cut arrival's adds stay, and its
        re-run adds again).
        """
        sets = list(self._accumulator_sets.values())

        def restore():
            restored = tf.constant(False)
            for number, accumulators in sets:
                def restore_set(accumulators=accumulators):
                    results = [_step_once.restore_journal(self, _accumulators.journal_key(acc), acc.writes)
                               if acc.writes else tf.constant(False) for acc in accumulators]
                    return tf.reduce_all(tf.stack(results)) if results else tf.constant(True)
                restored = tf.cond(tf.equal(s[_F_PENDING], number), restore_set,
                                   lambda restored=restored: tf.identity(restored))
            fixed = tf.cast(restored, tf.float64)
            new = _set(s, _F_PENDING, 0)
            new = _set(new, _F_ROLLED_BACK, s[_F_ROLLED_BACK] + fixed)
            new = _set(new, _F_UNSURE, s[_F_UNSURE] + 1 - fixed)
            return _write(self.state, new)

        return tf.cond(s[_F_PENDING] > 0, restore, lambda: tf.identity(s))

    def _complete(self, s, arrived, applier, enable=None):
        """Applies `arrived` gradients and starts the next version; returns the new header."""
        with tf.control_dependencies([applier.apply(arrived, tf.cast(s[_F_VERSION], tf.int64))]):
            new = _set(s, _F_VERSION, s[_F_VERSION] + 1)
            new = _set(new, _F_TAKEN, 0)
            new = _set(new, _F_ARRIVED, 0)
            new = _set(new, _F_REASSIGNED_NOW, 0)
            new = _set(new, _F_STARTED, tf.cast(tf.timestamp(), tf.float64))
            new = _set(new, _F_BATCHES, s[_F_BATCHES] + arrived)
            new = _set(new, _F_STEPS, s[_F_STEPS] + 1)
            if enable is not None:
                new = _set(new, _F_ENABLED, enable)
            return _write(self.state, new)

    # --- from the coordinator ---------------------------------------------

    def _header(self):
        return self.state.sparse_read(tf.range(_HEADER)).numpy().copy()

    def stats(self) -> dict:
        """The state as numbers: enabled, version, arrived, dropped, reassigned, applied batches and steps,
        and what the step tokens caught of steps run again (module docstring)."""
        s = self._header()
        return {
            "enabled": bool(s[_F_ENABLED]),
            "version": int(s[_F_VERSION]),
            "pending": int(s[_F_ARRIVED]),
            "dropped": int(s[_F_DROPPED]),
            "reassigned": int(s[_F_REASSIGNED]),
            "applied_batches": int(s[_F_BATCHES]),
            "applied_steps": int(s[_F_STEPS]),
            "claims_taken_over": int(s[_F_REUSED]),
            "twins_skipped": int(s[_F_TWINS]),
            "adds_rolled_back": int(s[_F_ROLLED_BACK]),
            "adds_unsure": int(s[_F_UNSURE]),
        }

    def flush(self, enable: bool | None = None) -> None:
        """Waits for the steps in flight, applies a partial step, then sets the mode (None: unchanged).

        The partial step's mean is over the gradients that arrived (fewer
        than R), so each batch is applied once.
        """
        coordinator = _runtime.coordinator_of(self.strategy)
        coordinator.join()
        applier = self._applier
        s = self._header()
        if applier is None or (s[_F_ARRIVED] == 0 and s[_F_PENDING] == 0):
            if enable is not None:
                s[_F_ENABLED] = 1.0 if enable else 0.0
                s[_F_TAKEN] = 0.0
                self.state.scatter_update(tf.IndexedSlices(s, tf.range(_HEADER)))
            return
        if applier.flush_function is None:
            applier.flush_function = self._flush_function(applier)
        function = applier.flush_function
        flag = tf.constant(-1.0 if enable is None else float(enable), tf.float64)
        with self.strategy.scope():
            coordinator.schedule(function, args=(flag,))
        coordinator.join()

    def _flush_function(self, applier):
        controller = self

        def locked(flag):
            s, _ = _read(controller.state)
            s = controller._recover(s)  # pylint: disable=protected-access  (tf_psx's own class)
            enable = tf.where(flag < 0, s[_F_ENABLED], flag)
            return tf.cond(s[_F_ARRIVED] > 0,
                           lambda: controller._complete(s, s[_F_ARRIVED], applier, enable),  # pylint: disable=protected-access  (tf_psx's own class)
                           lambda: _write(controller.state, _set(_set(s, _F_ENABLED, enable), _F_TAKEN, 0)))

        @tf.function
        def flush(flag):
            return controller._locked(lambda: locked(flag))[_F_VERSION]  # pylint: disable=protected-access  (tf_psx's own class)

        return flush


class _Watchdog(threading.Thread):
    """Fails `join()` when steps are pending and no worker has listened for `timeout_s`.

    TF 2.16's ClusterCoordinator waits for a failed worker to come back
    without a bound; a sync step cannot complete without workers, so the
    wait ends with an error that names them. The thread holds its
    controller weakly and ends once the controller is gone (a notebook that
    makes a new strategy does not keep the old one alive).
    """

    def __init__(self, controller: SyncController):
        super().__init__(name="tf_psx-sync-watchdog", daemon=True)
        self._controller_ref = weakref.ref(controller)
        self.start()

    def run(self) -> None:
        down_since = None
        while True:
            time.sleep(WATCHDOG_POLL_S)
            controller = self._controller_ref()
            if controller is None:
                return
            down_since = _watch_once(controller, down_since)
            del controller  # not held while sleeping


def _watch_once(controller: SyncController, down_since: float | None) -> float | None:
    """One look of the watchdog; returns since when no worker listens (None: one does, or nothing pends)."""
    if not _door.steps_pending(controller.strategy):
        return None
    if any(controller.address_listens(address) for address in controller.worker_addresses):
        return None
    now = time.monotonic()
    down_since = down_since or now
    if now - down_since < controller.timeout_s:
        return down_since
    _door.fail_steps(controller.strategy, SyncStepError(
        f"tf_psx sync: no worker of {controller.worker_addresses} has listened for "
        f"{controller.timeout_s:.0f} s, so the sync step in progress cannot complete. Fix: restart "
        "the workers (tf-psx launch restarts them), then call fit again; the state is as after the "
        "last applied sync step."))
    return None


# --- the strategy's controller, and the hooks that reach it -------------------

CONTROLLER_ATTR = "sync_controller"


def controller_of(strategy) -> SyncController | None:
    """The strategy's `SyncController` (`strategy.sync_controller`), or None."""
    return getattr(strategy, CONTROLLER_ATTR, None)


def install() -> None:
    """Routes the tf-keras optimizer apply through the strategy's controller, and flushes at fit's end (once)."""
    _door.install(controller_of)
