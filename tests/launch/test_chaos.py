"""Chaos tests (process tier): kill -9 tasks of a `tf-psx launch` job and check the outcome.

Each test runs tests/scripts/launch_train.py (a 200-row embedding model with
a known optimum) under the launcher, follows its "tf_psx train step=N" lines
(N is `optimizer.iterations` read from the ps: steps applied, not steps
scheduled) and kills tasks at seeded random steps:

* a worker, 3 times: the run completes, every requested step returns its
  loss to the coordinator exactly once, and the ps step counter is the
  requested total plus at most one re-applied step per kill (TF re-runs
  closures at least once; see the test);
* a ps: the launcher restarts the ps tasks and the chief, which resumes from
  the newest PeriodicSync snapshot; the work redone is at most one snapshot
  interval and the final holdout loss is within 1.05x of an undisturbed run's;
* the chief: the launcher stops, and a second launch resumes from the
  snapshot.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from tf_psx import launch

from launch_harness import SCRIPTS, STEP_RE, LaunchRun, crash_under_launch, pid_alive

pytestmark = pytest.mark.processes

TRAIN = [sys.executable, os.path.join(SCRIPTS, "launch_train.py")]
# The kill points are drawn from this seed: a failure can be replayed.
SEED = 20240605
# Steps between snapshots, and the run: 3 epochs of 40 steps.
EVERY = 20
EPOCHS, STEPS = 3, 40
TOTAL = EPOCHS * STEPS
# The chief waits this long after each batch, so that a run lasts long enough
# to be hit at the chosen steps (a tiny step takes ~2 ms).
STEP_SLEEP_S = "0.05"
# The bound on the final holdout loss after a ps failure.
LOSS_TOLERANCE = 1.05
START_RE = re.compile(r"^\[chief:0\] tf_psx train start step=(?P<step>\d+) attempt=(?P<attempt>\d+) pid=(?P<pid>\d+)")
RESULT_RE = re.compile(r"^\[chief:0\] RESULT (?P<json>\{.*\})$")


def _train_args(epochs=EPOCHS, steps=STEPS, every=EVERY):
    return [*TRAIN, "--epochs", str(epochs), "--steps", str(steps), "--every", str(every), "--step-sleep", STEP_SLEEP_S]


def _result(run: LaunchRun) -> dict:
    _, match = run.wait_for(RESULT_RE, timeout=1)
    return json.loads(match["json"])


def _step(match) -> int:
    return int(match["step"])


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    """The result of the ps-kill test's run without any kill."""
    tmp = tmp_path_factory.mktemp("undisturbed")
    with LaunchRun(["--workers", "1", "--ps", "2", "--log-dir", str(tmp)], _train_args()) as run:
        code = run.wait()
    assert code == 0, run.output
    return _result(run)


@pytest.mark.slow  # over a minute of kills or scaling on 2 cores: the slow tier
def test_three_worker_kills_lose_no_step(tmp_path):
    rng = random.Random(SEED)
    epochs, steps = 3, 60
    total = epochs * steps
    # One kill point in each third of the run, so that a restarted worker is
    # back (it imports TF: seconds) before the next kill.
    thirds = [(10, 50), (70, 110), (130, 165)]
    points = [rng.randrange(low, high) for low, high in thirds]
    killed = []
    with LaunchRun(
        ["--workers", "2", "--ps", "1", "--max-restarts", "3", "--log-dir", str(tmp_path)],
        [*TRAIN, "--epochs", str(epochs), "--steps", str(steps), "--step-sleep", "0.25"],
    ) as run:
        index = 0
        for number, point in enumerate(points, start=1):
            index, match = run.wait_for(STEP_RE, start=index, predicate=lambda m, p=point: _step(m) >= p)
            victim = f"worker:{rng.randrange(2)}"
            pid = run.pids()[victim]
            os.kill(pid, signal.SIGKILL)
            killed.append((victim, pid, _step(match)))
            index, _ = run.wait_for(rf"^tf-psx launch: {victim} exited with status -9 \(killed by SIGKILL\); restarting it", start=index)
            if number < len(points):  # the run may end before the last restarted worker is up
                index, _ = run.wait_for(rf"^\[{victim}\] tf_psx.server ready", start=index)
        code = run.wait()
    assert code == 0, run.output
    # Every kill hit the run before its end, and each was seen and repaired.
    assert [step for _, _, step in killed] == sorted(step for _, _, step in killed)
    assert all(step < total for _, _, step in killed), killed
    assert run.output.count("restarting it (restart") == 3
    assert not any(pid_alive(pid) for _, pid, _ in killed)
    result = _result(run)
    # ClusterCoordinator re-ran the killed workers' steps elsewhere: fit ran
    # every epoch, and each of the requested steps returned its loss to the
    # coordinator exactly once.
    assert result["epochs_run"] == epochs
    assert result["steps_with_loss"] == total, (result, killed)
    # The counter on the ps: TF retries closures at least once, not exactly
    # once, so a step that a worker applied and then died before it answered
    # is applied again (measured: 181 of 180 in one run of 3 kills). At most
    # one step per kill can be counted twice.
    assert total <= result["iterations"] <= total + len(killed), (result, killed)


def test_ps_kill_resumes_from_the_newest_snapshot(tmp_path, undisturbed):
    rng = random.Random(SEED + 1)
    point = rng.randrange(EVERY * 2 + 5, TOTAL - EVERY - 5)
    victim = f"ps:{rng.randrange(2)}"
    with LaunchRun(
        ["--workers", "1", "--ps", "2", "--max-restarts", "2", "--log-dir", str(tmp_path)], _train_args()
    ) as run:
        index, first = run.wait_for(START_RE)
        assert (_step(first), first["attempt"]) == (0, "0")
        index, match = run.wait_for(STEP_RE, start=index, predicate=lambda m: _step(m) >= point)
        os.kill(run.pids()[victim], signal.SIGKILL)
        # The newest step the chief saw applied before the kill: a lower bound
        # of the work done, the snapshot must be at most EVERY behind it.
        before_kill = max(_step(m) for m in map(STEP_RE.match, run.lines[: index + 1]) if m)
        index, _ = run.wait_for(rf"^tf-psx launch: {victim} exited with status -9 \(killed by SIGKILL\); restarting the ps tasks", start=index)
        index, second = run.wait_for(START_RE, start=index)
        code = run.wait()
    assert code == 0, run.output
    resumed = _step(second)
    assert second["attempt"] == "1" and second["pid"] != first["pid"]
    # It resumed from a snapshot (not from 0), and redid at most one interval.
    assert resumed > 0 and resumed % EVERY == 0, resumed
    assert before_kill - resumed <= EVERY, (before_kill, resumed)
    result = _result(run)
    assert result["attempt"] == 1 and result["iterations"] == TOTAL, result
    assert result["holdout_loss"] <= LOSS_TOLERANCE * undisturbed["holdout_loss"], (result, undisturbed)


def test_chief_kill_then_launch_again_resumes(tmp_path):
    rng = random.Random(SEED + 2)
    point = rng.randrange(EVERY * 2 + 5, TOTAL - EVERY - 5)
    snapshots = tmp_path / "snapshots"
    common = ["--workers", "1", "--ps", "1", "--snapshot-dir", str(snapshots)]
    with LaunchRun([*common, "--log-dir", str(tmp_path / "first")], _train_args()) as run:
        index, start = run.wait_for(START_RE)
        index, _ = run.wait_for(STEP_RE, start=index, predicate=lambda m: _step(m) >= point)
        os.kill(int(start["pid"]), signal.SIGKILL)
        before_kill = max(_step(m) for m in map(STEP_RE.match, run.lines[: index + 1]) if m)
        code = run.wait()
    # A chief that dies by itself is not restarted: the status is its own.
    assert code == 128 + signal.SIGKILL, run.output
    assert f"chief:0 failed with exit status 137; logs in {tmp_path / 'first'}" in run.output
    assert not any(pid_alive(pid) for pid in run.pids().values())
    with LaunchRun([*common, "--log-dir", str(tmp_path / "second")], _train_args()) as run:
        _, start = run.wait_for(START_RE)
        code = run.wait()
    assert code == 0, run.output
    resumed = _step(start)
    assert resumed > 0 and resumed % EVERY == 0 and before_kill - resumed <= EVERY, (before_kill, resumed)
    result = _result(run)
    assert result["iterations"] == TOTAL and result["start_step"] == resumed, result
    assert launch.TRAINING_DONE_FILE not in os.listdir(snapshots)


def _scale(log_dir, workers) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tf_psx.cli", "scale", str(log_dir), "--workers", str(workers)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_scale_two_to_four_to_one_workers_ends_at_the_exact_step(tmp_path):
    with LaunchRun(["--workers", "2", "--ps", "1", "--log-dir", str(tmp_path)], _train_args()) as run:
        index, first = run.wait_for(START_RE)
        servers = {name: pid for name, pid in run.pids().items() if name in ("ps:0", "worker:0", "worker:1")}
        index, _ = run.wait_for(STEP_RE, start=index, predicate=lambda m: _step(m) >= EVERY + 5)
        asked = _scale(tmp_path, 4)
        assert asked.returncode == 0 and "for 4 workers" in asked.stdout, asked.stderr
        index, _ = run.wait_for(r"^tf-psx launch: scaling from 2 to 4 workers", start=index)
        index, _ = run.wait_for(r"^\[worker:3\] tf_psx.server ready worker:3", start=index)
        index, second = run.wait_for(START_RE, start=index)
        # The first chief trains until it is stopped: its last step is the last one printed before this start.
        before = max(_step(m) for m in map(STEP_RE.match, run.lines[: index + 1]) if m)
        # The ps and the two workers that stay kept running; the chief was restarted.
        assert {name: run.pids()[name] for name in servers} == servers and len(servers) == 3
        assert int(second["pid"]) != int(first["pid"])
        index, _ = run.wait_for(STEP_RE, start=index, predicate=lambda m: _step(m) >= _step(second) + EVERY + 5)
        assert _scale(tmp_path, 1).returncode == 0
        index, _ = run.wait_for(r"^tf-psx launch: scaling from 4 to 1 workers", start=index)
        index, third = run.wait_for(START_RE, start=index)
        before_second = max(_step(m) for m in map(STEP_RE.match, run.lines[: index + 1]) if m)
        code = run.wait()
    assert code == 0, run.output
    # Each restart resumed from a snapshot and redid at most one interval.
    for start, seen in ((second, before), (third, before_second)):
        resumed = _step(start)
        assert resumed > 0 and resumed % EVERY == 0 and 0 <= seen - resumed <= EVERY, (resumed, seen)
    assert (first["attempt"], second["attempt"], third["attempt"]) == ("0", "1", "2")
    result = _result(run)
    assert result["iterations"] == TOTAL, result
    # The last cluster line names one worker; the removed workers' processes are gone.
    cluster = [line for line in run.lines if line.startswith("tf-psx launch: cluster:")][-1]
    assert "worker:0" in cluster and "worker:1" not in cluster
    pids = json.loads((tmp_path / launch.PIDS_FILE).read_text())
    assert pids.keys() == {"ps:0", "worker:0", "chief:0"}
    # One ps process and one worker process served all three coordinators.
    assert (pids["ps:0"], pids["worker:0"]) == (servers["ps:0"], servers["worker:0"])


def test_scaling_while_a_snapshot_is_written_resumes_from_the_one_before(tmp_path):
    """The chief stops between a snapshot's files and its commit: that snapshot never counts."""
    snapshots = tmp_path / "snapshots"
    args = [*_train_args(), "--slow-commit-at", str(2 * EVERY)]
    with LaunchRun(["--workers", "2", "--ps", "1", "--log-dir", str(tmp_path), "--snapshot-dir", str(snapshots)],
                   args) as run:
        index, _ = run.wait_for(START_RE)
        index, _ = run.wait_for(rf"^\[chief:0\] tf_psx committing snapshot step={2 * EVERY}$", start=index)
        assert _scale(tmp_path, 3).returncode == 0
        index, _ = run.wait_for(r"^tf-psx launch: scaling from 2 to 3 workers", start=index)
        index, second = run.wait_for(START_RE, start=index)
        code = run.wait()
    assert code == 0, run.output
    # The half-written snapshot of step 2 * EVERY was never committed: the resume is the one before.
    assert _step(second) == EVERY and second["attempt"] == "1", second
    assert _result(run)["iterations"] == TOTAL
    assert sorted(os.listdir(snapshots)) == [f"snapshot-{step:012d}" for step in (TOTAL - 2 * EVERY, TOTAL - EVERY,
                                                                                   TOTAL)]


def test_scale_refuses_zero_workers_and_a_directory_without_a_launcher(tmp_path):
    result = _scale(tmp_path, 0)
    assert result.returncode == 2 and "Option `--workers` must be an int >= 1. Received: 0" in result.stderr
    result = _scale(tmp_path, 2)
    assert result.returncode == 2 and f"No running tf-psx launch has the log directory '{tmp_path}'" in result.stderr
    result = _scale(tmp_path, launch.MAX_WORKERS + 1)
    assert result.returncode == 2 and f"must be at most {launch.MAX_WORKERS}" in result.stderr


FEED = [sys.executable, os.path.join(SCRIPTS, "exact_resume.py")]
FEED_RECORDS, FEED_BATCH, FEED_LR, FEED_EVERY = 960, 8, 0.5, 10  # tests/scripts/exact_resume.py
FEED_START_RE = re.compile(r"^\[chief:0\] fit start step=(?P<step>\d+) pid=(?P<pid>\d+)")
FEED_RESULT_RE = re.compile(r"^\[chief:0\] RESULT (?P<json>\{.*\})$")


def test_a_chief_killed_mid_epoch_resumes_fit_with_every_record_applied_once(tmp_path):
    snapshots = tmp_path / "snapshots"
    common = ["--workers", "2", "--ps", "1", "--snapshot-dir", str(snapshots)]
    # 20 ms per step: the kill lands between two snapshots, after steps that were applied
    # and must be rolled back with the weights and fed again (fit continues the epoch at the snapshot's step).
    args = [*FEED, "--every", str(FEED_EVERY), "--step-sleep", "0.02"]
    with LaunchRun([*common, "--log-dir", str(tmp_path / "first")], args) as run:
        _, start = run.wait_for(FEED_START_RE)
        _wait_for_file(_snapshot_path(snapshots, 40), run)
        time.sleep(0.1)  # about 5 batches past the checkpoint
        os.kill(int(start["pid"]), signal.SIGKILL)
        code = run.wait()
    assert code == 128 + signal.SIGKILL, run.output[-3000:]
    with LaunchRun([*common, "--log-dir", str(tmp_path / "second")], [*FEED, "--every", str(FEED_EVERY)]) as run:
        _, start = run.wait_for(FEED_START_RE)
        code = run.wait()
        _, match = run.wait_for(FEED_RESULT_RE, timeout=1)
    assert code == 0, run.output[-3000:]
    result = json.loads(match["json"])
    resumed = int(start["step"])
    assert resumed >= 40 and resumed % FEED_EVERY == 0, resumed
    assert result["done"] == FEED_RECORDS // FEED_BATCH and result["epochs"] == 1
    _assert_every_record_once(result)


def test_a_ps_killed_mid_epoch_resumes_fit_with_every_record_applied_once(tmp_path):
    # A ps task killed between two snapshots: its variables are gone, so the
    # launcher restarts the ps tasks and the chief, which restores the newest
    # snapshot and continues the epoch at its step. Every record must be in
    # the final model exactly once (rows -LR / BATCH), none lost with the ps.
    snapshots = tmp_path / "snapshots"
    args = [*FEED, "--every", str(FEED_EVERY), "--step-sleep", "0.02"]
    with LaunchRun(["--workers", "2", "--ps", "2", "--max-restarts", "2", "--snapshot-dir", str(snapshots),
                    "--log-dir", str(tmp_path)], args) as run:
        index, first = run.wait_for(FEED_START_RE)
        _wait_for_file(_snapshot_path(snapshots, 40), run)
        time.sleep(0.1)  # about 5 batches past the snapshot
        os.kill(run.pids()["ps:1"], signal.SIGKILL)
        index, _ = run.wait_for(r"^tf-psx launch: ps:1 exited with status -9 \(killed by SIGKILL\); restarting the ps tasks",
                                start=index)
        index, second = run.wait_for(FEED_START_RE, start=index)
        code = run.wait()
        _, match = run.wait_for(FEED_RESULT_RE, start=index, timeout=1)
    assert code == 0, run.output[-3000:]
    resumed = int(second["step"])
    assert second["pid"] != first["pid"] and resumed >= 40 and resumed % FEED_EVERY == 0, (first, second)
    result = json.loads(match["json"])
    assert result["done"] == FEED_RECORDS // FEED_BATCH and result["epochs"] == 1
    _assert_every_record_once(result)


def _assert_every_record_once(result: dict) -> None:
    """Every record of tests/scripts/exact_resume.py applied exactly once: each row is -LR / BATCH.

    A record fed twice would read -2 LR / BATCH, one skipped 0.
    """
    rows = result["rows"]
    assert len(rows) == FEED_RECORDS
    assert max(abs(row + FEED_LR / FEED_BATCH) for row in rows) <= 1e-6, sorted(set(rows))


def _snapshot_path(directory, step: int):
    """The committed snapshot of `step` in `directory` (PeriodicSync's naming)."""
    from tf_psx import snapshots as _snapshots  # pylint: disable=import-outside-toplevel

    return directory / f"{_snapshots.SNAPSHOT_PREFIX}{step:0{_snapshots.STEP_DIGITS}d}"


def _wait_for_file(path, run: LaunchRun, timeout: float = 240) -> None:

    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.exists(), f"no {path} after {timeout} s:\n" + run.output[-3000:]


@pytest.mark.slow  # over a minute of kills or scaling on 2 cores: the slow tier
def test_scaling_a_fit_two_to_four_to_one_trains_every_record_once(tmp_path):
    """After each rescale the resumed fit feeds the batches not yet trained to the workers there are now."""
    snapshots = tmp_path / "snapshots"
    args = [*FEED, "--every", str(FEED_EVERY), "--step-sleep", "0.05"]
    with LaunchRun(["--workers", "2", "--ps", "1", "--snapshot-dir", str(snapshots), "--log-dir", str(tmp_path)],
                   args) as run:
        index, first = run.wait_for(FEED_START_RE)
        _wait_for_file(_snapshot_path(snapshots, 20), run)
        assert _scale(tmp_path, 4).returncode == 0
        index, _ = run.wait_for(r"^tf-psx launch: scaling from 2 to 4 workers", start=index)
        index, _ = run.wait_for(r"^\[worker:3\] tf_psx.server ready worker:3", start=index)
        index, second = run.wait_for(FEED_START_RE, start=index)
        resumed = int(second["step"])
        _wait_for_file(_snapshot_path(snapshots, resumed + 20), run)
        assert _scale(tmp_path, 1).returncode == 0
        index, _ = run.wait_for(r"^tf-psx launch: scaling from 4 to 1 workers", start=index)
        index, third = run.wait_for(FEED_START_RE, start=index)
        code = run.wait()
        _, match = run.wait_for(FEED_RESULT_RE, start=index, timeout=1)
    assert code == 0, run.output[-3000:]
    assert int(first["step"]) == 0 and 20 <= resumed < int(third["step"]), (first, second, third)
    result = json.loads(match["json"])
    assert result["done"] == FEED_RECORDS // FEED_BATCH
    # Every record applied exactly once in the final model (see the test above): none
    # skipped by a rescale, none trained twice although steps were redone.
    _assert_every_record_once(result)


# One crash fit under the launcher: ~2-3 min on 2 cores.
CRASH_KILLS = 8


@pytest.mark.slow
def test_worker_kills_under_launch_apply_every_example_exactly_once(tmp_path):
    # The crash trial of tests/scripts/exact_crash.py (one Adagrad row per
    # example, so a row's value counts its applications) as the chief of a
    # `tf-psx launch` job: workers are killed with SIGKILL at seeded random
    # moments of the fit and restarted by the launcher, one down at a time.
    killed, result = crash_under_launch(str(tmp_path), seed=SEED + 1, workers=2, kills=CRASH_KILLS)
    assert len(killed) >= 2, (killed, result)
    assert result["closure_retries"] >= 1, result
    assert result["steps_rerun"] == [result["closure_retries"]], result  # reported in History, never silent
    assert result["counts"] == {"1": result["rows"]}, result  # every row checked: applied exactly once
    assert result["iterations"] == result["steps"], result
    assert result["offset_steps"] == {str(result["steps"]): 8}, result  # the dense offsets: every step once
    assert result["caught"]["unsure"] == 0, result
