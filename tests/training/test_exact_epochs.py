"""`model.fit(...)` under ParameterServerStrategy trains every example exactly once per epoch.

The check (tests/scripts/exact_epochs.py): one Adagrad row per example, a
loss linear in the rows, full batches only, so a row applied k times has a
closed form whatever the interleaving of the workers; `applications` reads
k back. Before the coordinator read the input, 2 workers of equal speed
trained 7 of 40 batches twice and 7 never in one epoch.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_psx

from conftest import run_script, script_results
from scripts import exact_epochs

pytestmark = pytest.mark.processes


def _applications(rows, grad: float) -> np.ndarray:
    return np.array([exact_epochs.applications(row, grad) for row in rows])


def _per_epoch(result) -> np.ndarray:
    """Applications of every example in each epoch (rows are cumulative)."""
    counts = np.array([_applications(rows, result["grad"]) for rows in result["rows"]])
    assert (counts >= 0).all(), "a row matches no whole number of applications"
    return np.diff(np.vstack([np.zeros_like(counts[:1]), counts]), axis=0)


def _results(*args: str) -> list[dict]:
    return script_results(run_script("exact_epochs.py", *args))


def _assert_exact(results: list[dict], inputs: set[str], epochs: int = 2) -> None:
    assert {r["input"] for r in results} == inputs, results
    for result in results:
        per_epoch = _per_epoch(result)
        assert per_epoch.shape == (epochs, result["batches"] * exact_epochs.BATCH), result["input"]
        once = (per_epoch == 1).sum(axis=1)
        assert (per_epoch == 1).all(), f"{result['input']}: examples trained once per epoch {once.tolist()}"
        assert result["epochs"] == epochs
        if not result["sync"]:
            assert result["steps"] == epochs * result["batches"]


@pytest.mark.unit
def test_closed_form_reads_back_the_applications():
    for k in range(6):
        assert exact_epochs.applications(exact_epochs.closed_form(k)) == k
    assert exact_epochs.applications(exact_epochs.closed_form(2) + 0.01) == -1


@pytest.mark.cluster
def test_a_broken_input_fails_the_check(ps_strategy):
    # One batch read twice and another never: the check must see it (the session cluster: 1 worker).
    model = exact_epochs.build(ps_strategy, exact_epochs.BATCHES * exact_epochs.BATCH)
    dataset, _ = exact_epochs.inputs_of("dataset", break_input=True)
    model.fit(dataset, epochs=1, verbose=0)
    result = {"input": "dataset", "rows": [tf_psx.unsharded_weights(model)[0][:, 0].tolist()], "epochs": 1,
              "sync": False, "steps": exact_epochs.BATCHES, "batches": exact_epochs.BATCHES, "grad": exact_epochs.GRAD}
    per_epoch = _per_epoch(result)
    batch = exact_epochs.BATCH
    assert (per_epoch[0, batch:2 * batch] == 2).all() and (per_epoch[0, 2 * batch:3 * batch] == 0).all()
    with pytest.raises(AssertionError, match="examples trained once per epoch"):
        _assert_exact([result], {"dataset"}, epochs=1)


def test_four_workers_async_train_every_example_once_per_epoch():
    _assert_exact(_results("--workers", "4", "--epochs", "2"), {"arrays", "dataset", "unknown"})


@pytest.mark.smoke
def test_two_workers_async_train_every_row_of_a_native_hash_table_once_per_epoch():
    # The rows are a DynamicEmbedding on tf_psx's own tables: each example's id is its key, read back with export().
    _assert_exact(_results("--workers", "2", "--epochs", "2", "--native", "--inputs", "arrays,dataset"),
                  {"arrays", "dataset"})


def test_three_workers_sync_with_steps_per_execution_train_every_example_once_per_epoch():
    results = _results("--workers", "3", "--sync", "--epochs", "2", "--steps-per-execution", "3", "--batches", "42",
                       "--inputs", "arrays,dataset")
    _assert_exact(results, {"arrays", "dataset"})


def test_a_3x_straggler_does_not_change_what_an_epoch_trains():
    _assert_exact(_results("--workers", "2", "--straggler", "--epochs", "2", "--inputs", "arrays,dataset"),
                  {"arrays", "dataset"})


def _crash(workers: int, *more: str) -> dict:
    (result,) = script_results(run_script("exact_crash.py", "--workers", str(workers), "--kills", "10",
                                          "--seed", str(workers), *more, timeout=CRASH_TIMEOUT_S))
    return result


# One crash fit: ~2 min on 2 cores (a restarted worker takes ~10 s to be back).
CRASH_TIMEOUT_S = 420


# A few minutes per run, so `make test` leaves it out; `make test-slow` (and CI) runs it.
# Before the journal of tf_psx.training.step_once a 2-worker run applied 18 of 64,000 rows
# twice; before tasks were forked from one long-lived thread, runs stalled (both
# workers died with the killer thread that had restarted them).
@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 3])
def test_worker_kills_mid_step_apply_every_example_exactly_once(workers):
    # A killer thread SIGKILLs a random worker at random times during one fit
    # and restarts it; TF re-runs the killed worker's step elsewhere with the
    # same batches and token. Without tokens (--no-tokens) a re-run step whose
    # first attempt had reached the ps was applied twice (rows with 2).
    _assert_every_step_once(_crash(workers))


def _assert_every_step_once(result: dict) -> None:
    """An async crash trial's result: the kills hit the fit, were reported, and every row and step applied once."""
    assert not result["killer_errors"], result
    assert len(result["kills"]) >= 2, result  # kills that hit the fit (each waits for the last restart: 14-40 s)
    assert result["closure_retries"] >= 1, result
    assert result["steps_rerun"] == [result["closure_retries"]], result  # reported in History, never silent
    assert result["counts"] == {"1": result["rows"]}, result  # every row checked: applied exactly once
    assert result["iterations"] == result["steps"], result
    # The model's dense offsets (a ps task's dense updates run as one unit): every step once.
    assert result["offset_steps"] == {str(result["steps"]): 8}, result
    assert result["caught"]["unsure"] == 0, result


# Before a TFRA model's fed steps carried step tokens (tf_psx._tf.fed_steps ran
# its tf-keras train function without one), the trial with the rows in a TFRA
# table over 2 ps tasks (2 workers, 5 kills, 2,000 batches) applied 16 rows
# twice, with 2,005 iterations for 2,000 steps; with tokens but no journal for
# table shards (10 kills, 3,000 batches), 5 rows twice: one shard update cut
# off after its writes, counted unsure. At steps_per_execution=10, before the
# tokens reached a TFRA model's multi-step function: 5 kills, 160 rows of
# 24,000 twice, 3,021 iterations for 3,000 steps.
@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("steps_per_execution", ["1", "10"])
@pytest.mark.tfra
def test_worker_kills_with_a_tfra_table_apply_every_example_exactly_once(steps_per_execution):
    # every row of the hash table
    _assert_every_step_once(_crash(2, "--tfra", "--batches", "3000", "--steps-per-execution", steps_per_execution))


# Before the steps of one execution carried a token each (tf_psx._tf.fed_steps ran
# tf-keras's multi-step train function without one), the trial at
# steps_per_execution=10 (2 workers, 3 kills, 3,000 batches) applied 196 rows
# of 24,000 twice, with 3,026 iterations for 3,000 steps.
@pytest.mark.processes
@pytest.mark.slow
def test_worker_kills_with_steps_per_execution_apply_every_example_exactly_once():
    _assert_every_step_once(_crash(2, "--steps-per-execution", "10", "--batches", "3000"))


# Before sync arrivals carried step tokens (tf_psx.training.sync_training, "A step run
# again"), the same trial (2 workers, 10 kills, 2,000 batches) ended with
# 16 rows applied twice, 8 never, 8 in a partial step, and 2,001 batches
# applied for 2,000 scheduled.
@pytest.mark.processes
@pytest.mark.slow
def test_worker_kills_in_sync_mode_apply_every_example_exactly_once():
    result = _crash(2, "--sync", "--batches", "2000")
    assert not result["killer_errors"] and len(result["kills"]) >= 2, result
    assert result["closure_retries"] >= 1 and result["steps_rerun"] == [result["closure_retries"]], result
    # Every sync step applied the mean of one batch per worker, so each row's
    # closed form is that of one application of GRAD / 2: exactly once.
    assert result["counts"] == {"1": result["rows"]}, result
    sync = result["sync"]
    assert sync["applied_batches"] == result["steps"] and sync["dropped"] == 0, result
    assert result["iterations"] == sync["applied_steps"] == result["steps"] // 2, result
    # The dense offsets, which every batch updates: every sync step once, with the mean of its gradients
    # (an arrival cut off after some adds is rolled back, docs/guides/sync.md).
    assert result["offset_steps"] == {str(result["steps"] // 2): 8}, result
    assert sync["adds_unsure"] == 0, result
