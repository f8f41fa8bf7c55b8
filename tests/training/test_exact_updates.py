"""Exact embedding updates under several async workers (issue: exact updates).

The closed-form runs live in tests/scripts/exact_updates.py (a process
connects to one cluster): every batch holds the same keys, the loss is
linear in the looked-up rows, so after S applied steps every row must equal
S sequential applications of the same constant gradient by a fresh optimizer
on a local variable. Lost updates make the share of the move < 1, doubled
ones > 1 (measured before the fix with 2 workers: stock SGD 1.37, LazyAdam
1.02, DynamicEmbedding SGD 0.66).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx._tf import exact_updates as _exact_door
from tf_psx.tables import tfra_updates as _exact_tables
from tf_psx.training import exact_compile as _exact_compile, exact_updates as _exact_updates

from conftest import layers_here, run_script, script_results, tfra_param

pytestmark = pytest.mark.unit

# DynamicEmbedding on TFRA's tables on the TFRA stack (conftest), and on tf_psx's own ("native") on both.
LAYERS = layers_here("sharded", "stock", "dynamic", "native")
OPTIMIZERS = ("sgd", "sgd_momentum", "adagrad", "adam", "lazyadam", "psx_sgd", "psx_sgd_momentum")
STEPS = 40
# The target: the share of the true move is 1.0000 and no row is off
# by more than 1e-4 of the largest move.
TOLERANCE = 1e-4


def _check(results: list[dict], expected_pairs: int) -> None:
    assert len(results) == expected_pairs
    for result in results:
        assert result["steps"] == STEPS, result
        assert abs(result["share"] - 1.0) <= TOLERANCE, result
        assert result["max_row_error"] <= TOLERANCE, result
        if result["layer"] in ("dynamic", "native"):
            # The hash table holds exactly the keys trained.
            assert result["keys"] == result["keys_trained"], result
            if result["exact_updates"] and "min_count" not in result:
                # Updated per shard, each on its ps task under its own lock (tf_psx.tables.tfra_updates); with Adam
                # every shard's counter saw every step (its bias correction reads it).
                assert result["table_steps"] is not None and len(result["table_steps"]) == result["ps"], result
                if result["optimizer"] == "adam":
                    assert result["table_steps"] == [STEPS] * result["ps"], result


@pytest.mark.processes
@pytest.mark.smoke
def test_every_layer_and_optimizer_is_exact_with_two_workers():
    result = run_script(
        "exact_updates.py", "--layer", *LAYERS, "--optimizer", *OPTIMIZERS, "--workers", "2",
        "--steps", str(STEPS), "--warn-check",
    )
    _check(script_results(result), len(LAYERS) * len(OPTIMIZERS))
    lines = result.stdout.splitlines()
    warned = [line for line in lines if line.startswith("WARNED ")]
    replaced = [line for line in lines if line.startswith("INFO ") and "was replaced by" in line]
    # A legacy Adam is replaced by its current twin (said once); one with `decay` has no twin and is named
    # with its fix; the tf-keras Adam is not warned about.
    assert len(replaced) == 1 and "the legacy Adam was replaced by tf.keras.optimizers.Adam" in replaced[0], lines
    assert len(warned) == 1, warned
    assert "legacy optimizer Adam" in warned[0] and "Fix: use tf.keras.optimizers.Adam" in warned[0]


@pytest.mark.processes
def test_dense_updates_fed_by_the_coordinator_run_grouped_per_ps_task_and_exact():
    # fit of arrays: the steps carry tokens, so each ps task's dense updates of a step run as one unit
    # (tf_psx.training.exact_updates.grouped_apply): the Dense kernel and bias, split in 2 shards each.
    result = run_script("exact_updates.py", "--layer", "dense", "--optimizer", "adam", "sgd_momentum", "adagrad",
                        "--workers", "2", "--steps", str(STEPS), "--input", "arrays")
    results = script_results(result)
    _check(results, 3)
    assert [r["grouped"] for r in results] == [4, 4, 4], results
    # The step's `iterations` bump is made in the unit of its ps task (`_check`: iterations == STEPS).
    assert [r["iterations_in_unit"] for r in results] == [True, True, True], results


@pytest.mark.processes
def test_three_workers_on_task_processes_with_steps_per_execution():
    result = run_script(
        "exact_updates.py", "--layer", *LAYERS, "--optimizer", "adagrad", "lazyadam", "--workers", "3",
        "--processes", "--spe", "10", "--steps", str(STEPS),
    )
    _check(script_results(result), len(LAYERS) * 2)


@pytest.mark.tfra
def test_private_hooks_are_where_they_were_read():
    """Fails loudly when a TF / tf-keras / TFRA upgrade moves what tf_psx._tf.exact_updates patches."""
    _exact_updates.install()
    base = _exact_door.base_optimizer_class()
    assert base.__name__ == "_BaseOptimizer"
    assert "_update_step" in base.__dict__ and "_update_step_xla" in base.__dict__
    # The patched versions keep the originals.
    assert hasattr(base._update_step, "__wrapped__")  # pylint: disable=protected-access
    optimizer = tf.keras.optimizers.Adam()
    assert "_iterations" in optimizer.__dict__
    assert hasattr(tf, "CriticalSection")
    tfra_optimizer = _exact_tables.wrap_tfra_optimizer(tf.keras.optimizers.Adagrad())
    assert "_distributed_apply_gradients_fn" in tfra_optimizer.__dict__


def test_iterations_swap_restores_the_counter():
    optimizer = tf.keras.optimizers.Adam()
    counter = optimizer.iterations
    with _exact_door.iterations_as(optimizer, tf.constant(7, tf.int64)):
        assert int(optimizer.iterations) == 7
    assert optimizer.iterations is counter


@pytest.mark.cluster
def test_one_worker_never_warns(ps_strategy, caplog):
    with ps_strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.legacy.Adam(), "mse")
    assert _exact_compile.inexact_reason(model.optimizer, ps_strategy) is None
    assert ps_strategy.exact_updates is True


@pytest.mark.cluster
@pytest.mark.parametrize("rate", ["constant", "schedule"])
def test_an_optimizer_made_outside_the_scope_gets_its_step_and_rate_on_the_ps(ps_strategy, rate, caplog):
    # tf-keras makes `iterations` and the learning rate in the constructor: made outside strategy.scope()
    # they stayed on the coordinator, and every step read and bumped them there.
    learning_rate = 0.5 if rate == "constant" else tf.keras.optimizers.schedules.ExponentialDecay(0.5, 1, 0.5)
    optimizer = tf.keras.optimizers.SGD(learning_rate)
    assert "/job:chief/" in optimizer.iterations.device
    with ps_strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1, use_bias=False,
                                                                               kernel_initializer="zeros")])
    with caplog.at_level("INFO", logger="tf_psx"):
        model.compile(optimizer, "mse")
    assert model.optimizer is optimizer  # the user's object, its variables made again
    own = [optimizer.iterations] + [v for v in (optimizer.__dict__.get("_learning_rate"),
                                                optimizer.__dict__.get("_current_learning_rate"))
                                    if isinstance(v, tf.Variable)]
    assert len(own) == 2
    for variable in own:
        assert "/job:ps/" in variable.device, variable
    assert any(v is optimizer.iterations for v in optimizer.variables)
    assert "made outside strategy.scope()" in caplog.text
    # It trains on them: loss = (w - 1)^2 per example, so with SGD(0.5) one step moves w from 0 to 1 (the
    # schedule: rate 0.5 at step 0, 0.25 at step 1, so w = 1 and stays, the gradient being 0).
    x, y = np.ones((4, 1), np.float32), np.ones((4, 1), np.float32)
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert int(optimizer.iterations.numpy()) == 2
    np.testing.assert_allclose(model.layers[0].kernel.numpy(), [[1.0]], rtol=1e-6)
    # Once built (slots exist), nothing is made again.
    assert _exact_door.remake_in_scope(optimizer, ps_strategy) == []


@pytest.mark.cluster
@pytest.mark.parametrize("model_kind", ["plain", tfra_param("plain_with_tfra_shadows_installed"), tfra_param("dynamic_embedding")])
def test_every_step_of_a_multi_step_fit_carries_its_token_the_short_last_batch_too(ps_strategy, monkeypatch,
                                                                                    model_kind):
    # steps_per_execution=2 over 5 batches (9 rows, batch 2): two executions of 2 stacked batches, then the
    # short last batch alone. Every update records its step's token in its ring (tf_psx.training.step_once): each
    # variable's or group's, each table shard's, `iterations`'. A step without a token updates and records
    # nothing, and a re-run of it would be applied twice. A model without TFRA parts keeps its tokens in a
    # process where TFRA layers got per-worker shadows; a model with a TFRA table runs tf-keras's own
    # multi-step function, with the tokens too.
    from tf_psx.training import step_once  # pylint: disable=import-outside-toplevel
    from tf_psx._tf import shadows, step_tokens  # pylint: disable=import-outside-toplevel

    if model_kind == "plain_with_tfra_shadows_installed":
        monkeypatch.setattr(shadows, "_PER_WORKER_SHADOWS_INSTALLED", True)
    with ps_strategy.scope():
        if model_kind == "dynamic_embedding":
            inputs = tf.keras.Input((3,), dtype=tf.int64)
            rows = tf_psx.layers.DynamicEmbedding(2, name="short_last_batch")(inputs)
            model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(rows)))
            x = np.arange(9 * 3, dtype=np.int64).reshape(9, 3)
        else:
            model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1, use_bias=False)])
            x = np.arange(9, dtype=np.float32).reshape(9, 1)
        model.compile(tf.keras.optimizers.Adam(0.01), "mse", steps_per_execution=2)
    first = step_tokens.next_token() + 1
    model.fit(x, np.ones((9, 1), np.float32), batch_size=2, epochs=1, shuffle=False, verbose=0)
    last = step_tokens.next_token() - 1
    assert int(model.optimizer.iterations.numpy()) == 5
    tokens = list(range(first, last + 1))
    assert len(tokens) == 5, tokens  # fit took one token per step
    rings = {key: ring.numpy() for (key, kind), ring in model.optimizer.__dict__["_tf_psx_token_rings"].items()
             if kind == step_tokens.STEP}
    assert any("iterations" in key for key in rings), list(rings)
    if model_kind == "dynamic_embedding":
        assert sum(key.startswith("tfra/") for key in rings) == 2, list(rings)  # a ring per table shard
    for key, ring in rings.items():
        assert [int(ring[token % step_once.RING_SIZE]) for token in tokens] == tokens, key


@pytest.mark.cluster
def test_a_ring_is_made_beside_its_variable_whether_or_not_the_strategy_made_it(ps_strategy):
    # A token ring or counter is made `beside` the variable it guards. TF's colocate_vars_with refuses a
    # variable the strategy did not make (one made outside its scope, on the coordinator).
    outside = tf.Variable(1.0)
    with ps_strategy.scope():
        inside = tf.Variable(1.0)
        for variable in (outside, inside):
            with tf.init_scope(), _exact_updates.beside(variable)():
                ring = tf.Variable(tf.zeros([4], tf.int64))
            assert ring.device == variable.device, (ring.device, variable.device)
    assert "/job:chief/" in outside.device and "/job:ps/" in inside.device


def test_rerun_report_warns_per_epoch_and_fills_history_only_after_failures(caplog):
    from tf_psx._tf.fit_progress import RerunReport  # pylint: disable=import-outside-toplevel

    class Retries:  # the coordinator's counter of re-queued closures (tf_psx._tf.runtime.closure_retries)
        count = 5

    class History:
        history = {"loss": [1.0, 0.5, 0.25]}

    model = tf.keras.Sequential()
    model.history = History()
    report = RerunReport(Retries)
    report.set_model(model)
    with caplog.at_level("WARNING", logger="tf_psx"):
        for epoch, reruns in enumerate([0, 2, 1]):
            report.on_epoch_begin(epoch)
            Retries.count += reruns
            report.on_epoch_end(epoch)
    report.on_train_end()
    assert model.history.history["steps_rerun"] == [0, 2, 1]
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 2 and warnings[0].startswith("Epoch 2: 2 step(s) ran again after a worker failure")
    assert warnings[1].startswith("Epoch 3: 1 step(s)")

    quiet = RerunReport(Retries)
    model.history.history = {"loss": [1.0]}
    quiet.set_model(model)
    quiet.on_epoch_begin(0)
    quiet.on_epoch_end(0)
    quiet.on_train_end()
    assert model.history.history == {"loss": [1.0]}  # no failure: Keras's History keys unchanged


class _Owner:
    """What the token rings and journals of a test hang on (an optimizer in tf_psx)."""


def _counter_step(owner, counter):
    """A traced step that bumps `counter` once per token (tf_psx.training.step_once.once_counter), as `iterations` is."""
    import contextlib  # pylint: disable=import-outside-toplevel

    from tf_psx.training import step_once  # pylint: disable=import-outside-toplevel
    from tf_psx._tf import step_tokens  # pylint: disable=import-outside-toplevel

    @tf.function
    def step(token):
        with step_tokens.tracing_with(token, step_tokens.STEP):
            return step_once.once_counter(owner, "iterations", contextlib.nullcontext, counter, 1)

    return step


def test_a_counter_bumps_once_per_token_and_a_twin_only_counts():
    from tf_psx.training import step_once  # pylint: disable=import-outside-toplevel

    owner, counter = _Owner(), tf.Variable(tf.constant(0, tf.int64))
    step = _counter_step(owner, counter)
    for token in (1, 2, 2, 3, 1):  # 2 and 1 run again (a re-run's twin)
        step(tf.constant(token, tf.int64))
    assert int(counter.numpy()) == 3
    assert step_once.counts(owner) == {"skipped": 2, "unsure": 0, "rolled_back": 0}


def test_a_counter_cancelled_between_its_two_writes_is_bumped_once_by_the_rerun():
    from tf_psx.training import step_once  # pylint: disable=import-outside-toplevel

    owner, counter = _Owner(), tf.Variable(tf.constant(0, tf.int64))
    step = _counter_step(owner, counter)
    step(tf.constant(1, tf.int64))
    (ring,) = owner.__dict__["_tf_psx_token_rings"].values()  # a counter ring
    # The first attempt of token 2 wrote its token and the new value (2), then was cancelled before the assign.
    ring.scatter_update(tf.IndexedSlices(tf.constant([2, 2], tf.int64), tf.constant([2, step_once.RING_SIZE + 2])))
    assert int(counter.numpy()) == 1
    step(tf.constant(2, tf.int64))  # the re-run: assigns the recorded value, adds nothing
    assert int(counter.numpy()) == 2
    step(tf.constant(3, tf.int64))
    assert int(counter.numpy()) == 3
    # A counter restored from a snapshot (ahead of the ring) goes on from its own value.
    counter.assign(1000)
    step(tf.constant(4, tf.int64))
    assert int(counter.numpy()) == 1001


def _cut_step(owner, key, update, rows=(0,), layout="rows", **journal):
    """A traced update under `step_once.once`, cut off after it on request.

    `update(rows)` makes the update's ops and returns the last one; `cut`
    aborts the function once the update is done and before its token is
    recorded, as TF aborts a ps's part of a step whose worker died.
    `journal`: once's `writes` (and `units`). `layout`: "rows" (the step's rows go with
    them, their count known at run time only), "static" (the count is part of
    the signature, as in a fed step: the journal then surely holds the rows,
    and the update runs outside a cond, a twin undoing it) or "dense" (no
    rows: the whole variables are saved, also outside a cond).
    """
    import contextlib  # pylint: disable=import-outside-toplevel

    from tf_psx.training import step_once  # pylint: disable=import-outside-toplevel
    from tf_psx._tf import step_tokens  # pylint: disable=import-outside-toplevel

    @tf.function(input_signature=[tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.bool),
                                  tf.TensorSpec([len(rows) if layout == "static" else None], tf.int64)])
    def step(token, cut, step_rows):
        def apply():
            with tf.control_dependencies([update(step_rows)]):
                check = tf.debugging.Assert(tf.logical_not(cut), ["cut off after the update"])
            with tf.control_dependencies([check]):
                return tf.constant(0, tf.int64)

        with step_tokens.tracing_with(token, step_tokens.STEP):
            return step_once.once(owner, key, contextlib.nullcontext, apply, lambda: tf.constant(0, tf.int64),
                                  **(dict(journal, rows=None if layout == "dense" else step_rows) if journal else {}))

    return lambda token, cut=False, rows=rows: step(tf.constant(token, tf.int64), tf.constant(cut),
                                                    tf.constant(rows, tf.int64))


def _add_ones(variable, rows):
    """Adds 1 to each of `rows` of a [N, 1] variable (a row listed twice gets 2)."""
    return variable.scatter_add(tf.IndexedSlices(tf.ones_like(tf.cast(rows[:, None], tf.float32)), rows))


def _row_step(owner, table, accumulator, layout="rows"):
    """An Adagrad-like update of rows 0 and 2 (accumulator first, then the rows), cut off after it on request.

    `layout`: as `_cut_step`'s.
    """

    def update(rows):
        with tf.control_dependencies([_add_ones(accumulator, rows)]):
            return _add_ones(table, rows)

    units = {"units": 2} if layout == "dense" else {}
    return _cut_step(owner, "table", update, rows=(0, 2), layout=layout, writes=[table, accumulator], **units)


@pytest.mark.parametrize("layout", ["rows", "static", "dense"])
def test_an_update_cut_off_midway_is_rolled_back_and_applied_once_by_its_rerun(layout):
    from tf_psx.training import step_once  # pylint: disable=import-outside-toplevel

    owner = _Owner()
    table, accumulator = tf.Variable(tf.zeros([4, 1])), tf.Variable(tf.zeros([4, 1]))
    step = _row_step(owner, table, accumulator, layout)
    units = 2 if layout == "dense" else 1  # a ps task's group of updates counts each (exact_updates.grouped_apply)
    step(1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="cut off after the update"):
        step(2, cut=True)  # token 2's first attempt: rows and slots written, token not recorded
    assert table.numpy()[:, 0].tolist() == [2, 0, 2, 0]  # the cut attempt's update is there
    step(3)  # another step takes the lock first: it restores token 2's rows, then applies its own
    assert table.numpy()[:, 0].tolist() == [2, 0, 2, 0]
    step(2)  # token 2's re-run: applies once
    step(2)  # and its twin, if any, skips
    assert table.numpy()[:, 0].tolist() == [3, 0, 3, 0]
    assert accumulator.numpy()[:, 0].tolist() == [3, 0, 3, 0]
    assert step_once.counts(owner) == {"skipped": units, "unsure": 0, "rolled_back": units}


def test_an_update_without_journal_cut_off_midway_is_counted_unsure():
    # An update with no journal (a TFRA table with a policy): the re-run applies again, and
    # the count says so instead of staying silent.
    from tf_psx.training import step_once  # pylint: disable=import-outside-toplevel

    owner, value = _Owner(), tf.Variable(tf.constant(0, tf.int64))
    step = _cut_step(owner, "t", lambda _rows: value.assign_add(1))
    with pytest.raises(tf.errors.InvalidArgumentError, match="cut off after the update"):
        step(1, cut=True)
    step(1)
    assert int(value.numpy()) == 2  # applied twice: no journal to restore from
    assert step_once.counts(owner) == {"skipped": 0, "unsure": 1, "rolled_back": 0}


@pytest.mark.tfra
def test_a_table_shard_update_cut_off_midway_is_rolled_back_from_its_journal_and_applied_once():
    # tf_psx.tables.tfra_updates: a hash-table shard's update saves the rows and slots it is about to overwrite
    # (and which keys existed) with its token; an attempt cut off after its writes is undone by the next
    # lock holder: old values back, keys it added removed. Real TFRA tables on this process's CPU.
    import types  # pylint: disable=import-outside-toplevel

    from tf_psx.tables import tfra_updates as exact_tables  # pylint: disable=import-outside-toplevel
    from tf_psx.training import step_once  # pylint: disable=import-outside-toplevel
    from tf_psx._tf import step_tokens, tfra  # pylint: disable=import-outside-toplevel

    de = tfra.tfra()
    device = "/CPU:0"
    rows, slot = (de.Variable(key_dtype=tf.int64, value_dtype=tf.float32, dim=1, devices=[device], name=name,
                              initializer=0.0) for name in ("cut_rows", "cut_slot"))
    rows.upsert(tf.constant([1], tf.int64), tf.constant([[10.0]]))
    slot.upsert(tf.constant([1], tf.int64), tf.constant([[5.0]]))
    owner = _Owner()
    journal = exact_tables._ShardJournal(rows, [types.SimpleNamespace(params=slot)], 0, device)  # pylint: disable=protected-access

    @tf.function
    def step(token, keys, cut_after, cut_before):
        def apply():
            looked_up = [tfra.shard_lookup(table, 0, keys) for table in (rows, slot)]
            with tf.control_dependencies(looked_up[0]):
                before = tf.debugging.Assert(tf.logical_not(cut_before), ["cut off before its writes"])
            with tf.control_dependencies([before]):
                saved = journal.save(token, keys, looked_up)
            with tf.control_dependencies([saved]):
                writes = [tfra.shard_insert(table, 0, keys, value + 1.0)
                          for table, (value, _) in zip((rows, slot), looked_up)]
            with tf.control_dependencies(writes):
                after = tf.debugging.Assert(tf.logical_not(cut_after), ["cut off after its writes"])
            with tf.control_dependencies([after]):
                return tf.constant(0, tf.int64)

        with step_tokens.tracing_with(token, step_tokens.STEP):
            return step_once.once(owner, "shard", contextlib.nullcontext, apply, lambda: tf.constant(0, tf.int64),
                                  roll_back=journal.roll_back)

    def run(token, keys, cut_after=False, cut_before=False):
        return step(tf.constant(token, tf.int64), tf.constant(keys, tf.int64), tf.constant(cut_after),
                    tf.constant(cut_before))

    def table(variable):
        values, exists = variable.lookup(tf.constant([1, 2, 3], tf.int64), return_exists=True)
        return [value if found else None for value, found in zip(values.numpy()[:, 0].tolist(), exists.numpy())]

    run(1, [1, 2])
    assert table(rows) == [11.0, 1.0, None] and table(slot) == [6.0, 1.0, None]
    with pytest.raises(tf.errors.InvalidArgumentError, match="cut off after its writes"):
        run(2, [1, 3], cut_after=True)  # written back (key 3 added), token not recorded
    assert table(rows) == [12.0, 1.0, 1.0]
    run(4, [2])  # the next lock holder rolls token 2 back (key 3 removed), then applies its own
    assert table(rows) == [11.0, 2.0, None] and table(slot) == [6.0, 2.0, None]
    run(2, [1, 3])  # token 2's re-run applies once
    run(2, [1, 3])  # and a twin skips
    assert table(rows) == [12.0, 2.0, 1.0] and table(slot) == [7.0, 2.0, 1.0]
    assert step_once.counts(owner) == {"skipped": 1, "unsure": 0, "rolled_back": 1}
    # Cut off before its writes (the journal holds another token): nothing undone, the re-run applies once.
    with pytest.raises(tf.errors.InvalidArgumentError, match="cut off before its writes"):
        run(5, [1], cut_before=True)
    run(5, [1])
    assert table(rows) == [13.0, 2.0, 1.0] and table(slot) == [8.0, 2.0, 1.0]
    assert step_once.counts(owner) == {"skipped": 1, "unsure": 0, "rolled_back": 2}


def test_an_update_too_big_for_its_journal_cut_off_midway_is_counted_unsure(monkeypatch):
    # Rows of unknown count are journaled up to step_once.JOURNAL_ROWS; an
    # update with more is not saved, so cut off midway it is applied again by
    # its re-run, and counted.
    from tf_psx.training import step_once  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(step_once, "JOURNAL_ROWS", 1)
    owner, table = _Owner(), tf.Variable(tf.zeros([4, 1]))
    step = _cut_step(owner, "t", lambda rows: _add_ones(table, rows), writes=[table])
    with pytest.raises(tf.errors.InvalidArgumentError, match="cut off after the update"):
        step(1, cut=True, rows=[0])  # one row: journaled
    step(1, rows=[0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="cut off after the update"):
        step(2, cut=True, rows=[1, 2])  # two rows: too many
    step(2, rows=[1, 2])
    assert table.numpy()[:, 0].tolist() == [1, 2, 2, 0]
    assert step_once.counts(owner) == {"skipped": 0, "unsure": 1, "rolled_back": 1}
    # Repeated rows are saved once: two indices of one row fit a journal of one row.
    with pytest.raises(tf.errors.InvalidArgumentError, match="cut off after the update"):
        step(3, cut=True, rows=[3, 3])
    step(3, rows=[3, 3])
    assert table.numpy()[:, 0].tolist() == [1, 2, 2, 2]  # row 3: two indices per application, applied once
    assert step_once.counts(owner) == {"skipped": 0, "unsure": 1, "rolled_back": 2}


def test_without_the_journal_an_update_cut_off_midway_is_applied_again_and_counted(monkeypatch):
    # step_once.JOURNAL = False (for measuring the journal's cost): the
    # pending mark still tells, so the double application is counted.
    from tf_psx.training import step_once  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(step_once, "JOURNAL", False)
    owner = _Owner()
    table, accumulator = tf.Variable(tf.zeros([4, 1])), tf.Variable(tf.zeros([4, 1]))
    step = _row_step(owner, table, accumulator)
    with pytest.raises(tf.errors.InvalidArgumentError):
        step(1, cut=True)
    step(1)
    assert table.numpy()[:, 0].tolist() == [2, 0, 2, 0]
    assert step_once.counts(owner) == {"skipped": 0, "unsure": 1, "rolled_back": 0}
