"""Synchronous steps (issue: sync mode, backup workers, async/sync switching).

The multi-worker runs live in tests/scripts (a process connects to one
cluster): sync_equivalence.py checks that a sync step of 2 workers equals
one sequential step of the concatenated batches, weight by weight;
exact_updates.py --sync checks the closed form under fit with
steps_per_execution; sync_failures.py covers backup workers, a slot that
never arrives, a worker killed with SIGKILL and every worker gone.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx.errors import TFConfigError

from conftest import layers_here, run_script, script_results, tfra_param

pytestmark = pytest.mark.processes

# The bound on the weights of the sync run against the 1-worker run.
EQUIVALENCE_TOLERANCE = 1e-5


# --- equivalence with one worker of the global batch ---------------------------


# Over two minutes on 2 cores (every layout and optimizer of the script): the slow tier.
@pytest.mark.slow
def test_sync_step_equals_one_step_of_the_concatenated_batches():
    # 61 batches on 2 workers: 30 steps of 2 and a flushed tail of 1. Both layers with
    # LazyAdam here; both layers with Adagrad in the schedule test below.
    layers = layers_here("sharded", "dynamic", "native")
    results = script_results(run_script("sync_equivalence.py", "--layer", *layers,
                                  "--optimizer", "lazyadam", "--batches", "61"))
    assert len(results) == len(layers)
    for result in results:
        assert result["max_weight_difference"] <= EQUIVALENCE_TOLERANCE, result
        assert result["rows_moved"] > 100 * EQUIVALENCE_TOLERANCE, result  # the rows did train
        assert result["sync_steps"] == 31 and result["batches_per_step"] == [1, 2], result
        assert result["iterations_sync"] == result["iterations_reference"] == 31, result
        assert result["applied_batches"] == 61 and result["dropped"] == 0, result


@pytest.mark.parametrize("schedule,layer", [("exponential", "sharded"), tfra_param("cosine", "dynamic")])
def test_learning_rate_schedules_follow_applied_steps(schedule, layer):
    results = script_results(run_script("sync_equivalence.py", "--layer", layer, "--optimizer", "adagrad",
                                  "--batches", "31", "--schedule", schedule))
    assert len(results) == 1
    assert results[0]["max_weight_difference"] <= EQUIVALENCE_TOLERANCE, results[0]
    assert results[0]["iterations_sync"] == 16, results[0]


@pytest.mark.smoke
def test_fit_with_steps_per_execution_matches_the_closed_form():
    steps = 41
    # Each layer with Adagrad (the hash table on TFRA's store where installed and on tf_psx's own); LazyAdam's sync step is checked by the equivalence test above.
    layers = layers_here("sharded", "dynamic", "native")
    results = script_results(run_script("exact_updates.py", "--layer", *layers, "--optimizer", "adagrad",
                                  "--workers", "2", "--steps", str(steps), "--spe", "2", "--sync"))
    assert len(results) == len(layers)
    for result in results:
        # Each sync step is the mean of 2 equal gradients; the tail step has 1.
        assert result["steps"] == math.ceil(steps / 2), result
        assert abs(result["share"] - 1.0) <= 1e-4 and result["max_row_error"] <= 1e-4, result
        assert result["sync"]["dropped"] == 0 and result["sync"]["pending"] == 0, result


# --- backup workers and failures ------------------------------------------------


def test_backup_workers_drop_and_count_late_gradients():
    (result,) = script_results(run_script("sync_failures.py", "backup"))
    assert result["applied_batches"] + result["dropped"] == result["scheduled"], result
    assert result["dropped"] > 0, result
    # Full steps apply 2 gradients; only the flushed tail may apply fewer.
    assert result["applied_batches"] >= 2 * (result["applied_steps"] - 1), result
    assert result["iterations"] == result["applied_steps"], result


def test_a_slot_that_never_arrives_is_reassigned_after_the_timeout():
    (result,) = script_results(run_script("sync_failures.py", "stuck"))
    assert result["failed_step_raised"], result
    assert result["reassigned"] == 1, result
    assert 2.5 <= result["seconds"] <= 30, result
    assert result["applied_batches"] == 6 and result["iterations"] == result["applied_steps"], result
    # SGD(0.5) on sum(w): each applied step moves every entry by -0.5.
    assert result["weight"] == [-0.5 * result["applied_steps"]] * 3, result


def test_a_worker_killed_mid_fit_does_not_stop_sync_training():
    (result,) = script_results(run_script("sync_failures.py", "kill"))
    assert result["epochs"] == 3, result
    # Every fit step is applied; a closure cut short after it arrived is run again (at most one extra).
    assert result["scheduled"] <= result["applied_batches"] <= result["scheduled"] + 1, result
    assert result["iterations"] == result["applied_steps"] >= result["min_steps"], result
    assert result["worker1_alive"], result


def test_all_workers_gone_raises_within_the_timeout():
    (result,) = script_results(run_script("sync_failures.py", "gone"))
    assert result["error"] == "SyncStepError", result
    assert "no worker of" in result["message"] and "Fix:" in result["message"], result
    # sync_timeout_s=5, plus the watchdog's poll and TF's own failure handling.
    assert result["seconds"] <= 60, result


# --- on the session cluster (1 worker) ---------------------------------------------


def _model(strategy):
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1, kernel_initializer="zeros")])
        model.compile(tf.keras.optimizers.SGD(0.1), "mse")
    return model


def _data():
    x = np.ones((64, 3), np.float32)
    return tf.data.Dataset.from_tensor_slices((x, np.ones(64, np.float32))).repeat().batch(8)


@pytest.mark.cluster
def test_sync_switch_changes_mode_inside_one_fit(local_cluster):
    strategy = tf_psx.ParameterServerStrategy(local_cluster, sync="switchable")
    model = _model(strategy)
    switch = tf_psx.callbacks.SyncSwitch(to="sync", at_step=5)
    history = model.fit(_data(), epochs=2, steps_per_epoch=6, callbacks=[switch], verbose=0)
    assert switch.switched_at_step == 5 and switch.switched_at_epoch == 0
    stats = strategy.sync_stats()
    # 5 async steps, then 7 sync steps of one worker's gradient each.
    assert stats["enabled"] and stats["applied_steps"] == 7 and stats["applied_batches"] == 7, stats
    assert int(model.optimizer.iterations.numpy()) == 12
    assert history.history["sync"] == [1.0, 1.0]

    back = tf_psx.callbacks.SyncSwitch(to="async", patience=1, min_delta=1.0)
    model.fit(_data(), epochs=2, steps_per_epoch=3, callbacks=[back], verbose=0)
    assert back.switched_at_epoch == 1 and not strategy.sync_stats()["enabled"]


@pytest.mark.cluster
def test_switching_while_a_snapshot_is_written_waits_for_it(local_cluster, tmp_path):
    strategy = tf_psx.ParameterServerStrategy(local_cluster, sync="switchable")
    model = _model(strategy)
    snapshots = tf_psx.callbacks.PeriodicSync(4, str(tmp_path), background=True)
    switch = tf_psx.callbacks.SyncSwitch(to="sync", at_step=4)
    model.fit(_data(), epochs=1, steps_per_epoch=8, callbacks=[snapshots, switch], verbose=0)
    # The snapshot of step 4 was being written in the background when the switch came.
    assert switch.snapshots_waited == 1 and switch.switched_at_step == 4
    steps = sorted(snapshot.step for snapshot in tf_psx.snapshots.SnapshotStore(str(tmp_path), 5).snapshots())
    assert steps == [4, 8], steps
    assert strategy.sync_stats()["applied_steps"] == 4


@pytest.mark.cluster
def test_a_snapshot_taken_in_sync_mode_resumes_in_async_mode(local_cluster, tmp_path):
    sync_strategy = tf_psx.ParameterServerStrategy(local_cluster, sync=True)
    model = _model(sync_strategy)
    model.fit(_data(), epochs=1, steps_per_epoch=8, verbose=0,
              callbacks=[tf_psx.callbacks.PeriodicSync(4, str(tmp_path))])
    saved = [np.array(w) for w in model.get_weights()]
    assert sync_strategy.sync_stats()["applied_steps"] == 8

    async_strategy = tf_psx.ParameterServerStrategy(local_cluster)
    resumed = _model(async_strategy)
    # The snapshot of step 8 ends epoch 0: nothing is left to train in it.
    resumed.fit(_data(), epochs=1, steps_per_epoch=8, verbose=0,
                callbacks=[tf_psx.callbacks.PeriodicSync(4, str(tmp_path))])
    for before, after in zip(saved, resumed.get_weights()):
        np.testing.assert_array_equal(before, after)
    assert int(resumed.optimizer.iterations.numpy()) == 8
    resumed.fit(_data(), epochs=2, steps_per_epoch=8, verbose=0,
                callbacks=[tf_psx.callbacks.PeriodicSync(4, str(tmp_path))])
    assert int(resumed.optimizer.iterations.numpy()) == 16


def _token_step(strategy, weight, optimizer, fail_at: str):
    """A sync step of `sum(weight)` under SGD that carries a step token, as fit's fed steps do.

    `fail_at` ("claim", "arrival" or "none") makes the step fail there when its
    `fail` argument is True: the first attempt of a step whose worker died
    at that point. Scheduling the same token again is its re-run.
    """
    from tf_psx._tf import step_tokens  # pylint: disable=import-outside-toplevel

    @tf.function
    def step(token, fail):
        def replica(fail):
            if fail_at == "claim":
                tf.debugging.assert_equal(fail, False, message="died after its claim")
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(weight)
            applied = optimizer.apply_gradients([(tape.gradient(loss, weight), weight)])
            if fail_at == "arrival":
                with tf.control_dependencies([applied]):
                    tf.debugging.assert_equal(fail, False, message="died after its arrival")

        with step_tokens.tracing_with(token, step_tokens.STEP):
            return strategy.run(replica, args=(fail,))

    def run(token: int, fail: bool = False):
        strategy.coordinator.schedule(step, args=(tf.constant(token, tf.int64), tf.constant(fail)))
        strategy.coordinator.join()

    return run


@pytest.mark.cluster
@pytest.mark.parametrize("fail_at", ["claim", "arrival"])
def test_a_rerun_sync_step_takes_its_twins_slot_or_applies_nothing(local_cluster, fail_at):
    # One worker, so each arrival completes a version. A first attempt that
    # died after its claim holds the version's only slot: without the token
    # its re-run would wait sync_timeout_s (60 s) for it to be reassigned; it
    # takes it over. One that died after its arrival was applied: its
    # re-run applies nothing.
    strategy = tf_psx.ParameterServerStrategy(local_cluster, sync=True, sync_timeout_s=60)
    with strategy.scope():
        weight = tf.Variable(tf.zeros([3]))
        optimizer = tf.keras.optimizers.SGD(0.5)
    run = _token_step(strategy, weight, optimizer, fail_at)
    run(1)
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"died after its {fail_at}"):
        run(2, fail=True)
    start = time.monotonic()
    run(2)  # the re-run
    run(3)
    stats = strategy.sync_stats()
    assert time.monotonic() - start < 30, stats  # no wait for the timeout
    assert stats["reassigned"] == 0 and stats["dropped"] == 0, stats
    # Steps 1, 2 and 3 applied once each: 3 steps of -0.5 on every entry.
    assert stats["applied_steps"] == stats["applied_batches"] == 3, stats
    np.testing.assert_allclose(weight.numpy(), [-1.5] * 3)
    assert int(optimizer.iterations.numpy()) == 3
    if fail_at == "claim":
        assert stats["claims_taken_over"] == 1 and stats["twins_skipped"] == 0, stats
    else:
        assert stats["twins_skipped"] == 1 and stats["claims_taken_over"] == 0, str(stats)


@pytest.mark.cluster
def test_an_arrival_cut_off_midway_counts_its_gradient_once(local_cluster, monkeypatch):
    # Two cuts of a sync arrival, as a worker killed there leaves them.
    # 1. Between the gradient's adds and the arrival's commit, then another
    #    step takes the slot after sync_timeout_s and completes the version:
    #    the cut adds must not be in that version (its mean would be of two
    #    gradients over a count of one), and the re-run adds all of its
    #    gradient to the next version.
    # 2. After the version was sealed and applied, before the header moved
    #    on: the next step finishes that version at its arrival (applying
    #    nothing again) and adds its own gradient to the next version, which
    #    the re-run (a twin) then applies.
    from tf_psx.training import sync_accumulators, sync_training  # pylint: disable=import-outside-toplevel

    strategy = tf_psx.ParameterServerStrategy(local_cluster, sync=True, sync_timeout_s=2)
    with strategy.scope():
        weight = tf.Variable(tf.zeros([3]))
        optimizer = tf.keras.optimizers.SGD(0.5)
        die_after_adds = tf.Variable(False, trainable=False)
        die_after_apply = tf.Variable(False, trainable=False)
    real_add, real_apply = sync_accumulators.DenseAccumulator.add, sync_training._Applier.apply  # pylint: disable=protected-access

    def add_then_maybe_die(accumulator, gradient):
        with tf.control_dependencies([real_add(accumulator, gradient)]):
            return tf.debugging.assert_equal(die_after_adds.read_value(), False, message="died after its adds")

    def apply_then_maybe_die(applier, count, version):
        with tf.control_dependencies([real_apply(applier, count, version)]):
            return tf.debugging.assert_equal(die_after_apply.read_value(), False, message="died after the apply")

    monkeypatch.setattr(sync_accumulators.DenseAccumulator, "add", add_then_maybe_die)
    monkeypatch.setattr(sync_training._Applier, "apply", apply_then_maybe_die)  # pylint: disable=protected-access
    run = _token_step(strategy, weight, optimizer, fail_at="none")
    run(1)
    for flag, message in [(die_after_adds, "died after its adds"), (die_after_apply, "died after the apply")]:
        flag.assign(True)
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            run(2 if flag is die_after_adds else 4)
        flag.assign(False)
        if flag is die_after_adds:
            run(3)  # waits sync_timeout_s for step 2's slot, then completes the version without it
            run(2)  # the re-run
        else:
            run(5)  # finishes step 4's version; with R = 1 its own is left sealed
            run(4)  # the re-run: its twin arrived; it finishes step 5's version
    # Steps 1 to 5 applied once each, one gradient per version: 5 steps of -0.5 on every entry.
    np.testing.assert_allclose(weight.numpy(), [-2.5] * 3)
    assert int(optimizer.iterations.numpy()) == 5
    stats = strategy.sync_stats()
    assert stats["applied_steps"] == stats["applied_batches"] == 5, stats
    assert stats["reassigned"] == 1 and stats["adds_rolled_back"] == 1 and stats["adds_unsure"] == 0, stats
    assert stats["twins_skipped"] == 1 and stats["dropped"] == 0, stats


@pytest.mark.cluster
def test_sync_arguments_are_checked(local_cluster):
    with pytest.raises(ValueError, match=r"`replicas_to_aggregate` must be an int from 1 to the number of workers \(1\)"):
        tf_psx.ParameterServerStrategy(local_cluster, sync=True, replicas_to_aggregate=2)
    with pytest.raises(ValueError, match="Received: 0"):
        tf_psx.ParameterServerStrategy(local_cluster, sync=True, replicas_to_aggregate=0)
    with pytest.raises(ValueError, match="needs sync=True"):
        tf_psx.ParameterServerStrategy(local_cluster, replicas_to_aggregate=1)
    with pytest.raises(ValueError, match='`sync` must be False, True or "switchable". Received: \'yes\''):
        tf_psx.ParameterServerStrategy(local_cluster, sync="yes")
    with pytest.raises(ValueError, match="`sync_timeout_s` must be a number of seconds > 0. Received: 0"):
        tf_psx.ParameterServerStrategy(local_cluster, sync=True, sync_timeout_s=0)
    plain = tf_psx.ParameterServerStrategy(local_cluster)
    with pytest.raises(ValueError, match="set_sync needs a strategy made with sync=True"):
        plain.set_sync(True)
    with pytest.raises(TypeError, match="SyncSwitch needs a tf_psx.ParameterServerStrategy made with sync=True"):
        _model(plain).fit(_data(), epochs=1, steps_per_epoch=1, verbose=0,
                          callbacks=[tf_psx.callbacks.SyncSwitch(at_step=1)])


@pytest.mark.unit
def test_sync_with_no_worker_is_refused():
    tf_config = {"cluster": {"ps": ["127.0.0.1:1"], "chief": ["127.0.0.1:2"]}, "task": {"type": "chief", "index": 0}}
    with pytest.raises(TFConfigError, match="worker"):
        tf_psx.ParameterServerStrategy(tf_config, sync=True)


@pytest.mark.unit
def test_sync_switch_needs_a_condition():
    with pytest.raises(ValueError, match="SyncSwitch needs `at_step` or `patience`"):
        tf_psx.callbacks.SyncSwitch(to="sync")
    with pytest.raises(ValueError, match='`to` of SyncSwitch must be "sync" or "async"'):
        tf_psx.callbacks.SyncSwitch(to="later", at_step=3)
