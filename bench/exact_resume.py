"""A chief killed mid-epoch and relaunched by `tf-psx launch`: seconds to its first applied step, examples trained twice.

The chief of tests/scripts/exact_resume.py (960 numbered records, batch 8,
one 1-wide Embedding row per record, SGD, a loss linear in the rows: after
the run row r is -LR / BATCH times the number of times record r was
applied) under `tf-psx launch --workers 2 --ps 1`, PeriodicSync every 10
steps, 20 ms per step. The chief is killed (SIGKILL) about 5 batches after
the snapshot of step 40; the run is launched again, restores that snapshot
and continues the epoch at its step (the steps after it are rolled back
with the weights and fed again). Per round: seconds from the relaunch
command to the first step of the new run applied on the ps (the script
prints when `iterations` passes the snapshot's step), to its `fit` start
(the snapshot restored), and the records applied twice and never, from the
final rows. ROUNDS rounds, median and spread (min-max).

`python bench/exact_resume.py [--rounds N]`.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

ROUNDS = 3
RECORDS, BATCH, LR, EVERY = 960, 8, 0.5, 10  # tests/scripts/exact_resume.py
KILL_AFTER = 40  # the snapshot step the chief is killed after
START_RE = re.compile(r"^\[chief:0\] fit start step=(?P<step>\d+) pid=(?P<pid>\d+)")
APPLIED_RE = re.compile(r"^\[chief:0\] first applied step t=(?P<t>[\d.]+)")
RESULT_RE = re.compile(r"^\[chief:0\] RESULT (?P<json>\{.*\})$")


def one_round(directory: str) -> dict:
    """Kills the chief after the snapshot of KILL_AFTER, relaunches, and measures the resumed run."""
    import json  # pylint: disable=import-outside-toplevel

    from launch_harness import SCRIPTS, LaunchRun  # pylint: disable=import-outside-toplevel
    from tf_psx import snapshots  # pylint: disable=import-outside-toplevel

    script = [sys.executable, os.path.join(SCRIPTS, "exact_resume.py"), "--every", str(EVERY)]
    common = ["--workers", "2", "--ps", "1", "--snapshot-dir", os.path.join(directory, "snapshots")]
    snapshot = os.path.join(directory, "snapshots", f"{snapshots.SNAPSHOT_PREFIX}{KILL_AFTER:0{snapshots.STEP_DIGITS}d}")
    with LaunchRun([*common, "--log-dir", os.path.join(directory, "first")], [*script, "--step-sleep", "0.02"]) as run:
        _, start = run.wait_for(START_RE)
        deadline = time.monotonic() + 240
        while not os.path.exists(snapshot):
            if time.monotonic() > deadline:
                raise RuntimeError(f"exact_resume: no snapshot {snapshot} within 240 s:\n{run.output[-3000:]}")
            time.sleep(0.01)
        time.sleep(0.1)  # about 5 batches past the snapshot
        os.kill(int(start["pid"]), signal.SIGKILL)
        run.wait()
    relaunched = time.time()
    with LaunchRun([*common, "--log-dir", os.path.join(directory, "second")], script) as run:
        _, start = run.wait_for(START_RE)
        started = time.time()
        _, applied = run.wait_for(APPLIED_RE)
        code = run.wait()
        _, match = run.wait_for(RESULT_RE, timeout=1)
    if code != 0:
        raise RuntimeError(f"exact_resume: the relaunched run exited {code}:\n{run.output[-3000:]}")
    rows = json.loads(match["json"])["rows"]
    times = [round(-row * BATCH / LR) for row in rows]  # how many times each record was applied
    return {"resumed_at_step": int(start["step"]), "seconds_to_fit_start": started - relaunched,
            "seconds_to_first_applied_step": float(applied["t"]) - relaunched,
            "applied_twice_or_more": sum(1 for t in times if t >= 2), "never_applied": sum(1 for t in times if t == 0),
            "records": len(rows)}


def main() -> None:
    import argparse  # pylint: disable=import-outside-toplevel

    from _common import spread_text, write_result  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()
    runs = []
    for index in range(args.rounds):
        with tempfile.TemporaryDirectory() as directory:
            runs.append(one_round(directory))
        print(f"round {index + 1}/{args.rounds}: {runs[-1]}", flush=True)
    twice = max(run["applied_twice_or_more"] for run in runs)
    never = max(run["never_applied"] for run in runs)
    rows = [
        {"metric": "relaunch command -> first applied step, s",
         "value": spread_text([run["seconds_to_first_applied_step"] for run in runs])},
        {"metric": "relaunch command -> fit start (snapshot restored), s",
         "value": spread_text([run["seconds_to_fit_start"] for run in runs])},
        {"metric": "records trained twice (most in a round)", "value": twice, "target": "0", "ok": twice == 0},
        {"metric": "records never trained (most in a round)", "value": never, "target": "0", "ok": never == 0},
        {"metric": "step resumed at (the snapshot's)", "value": spread_text([run["resumed_at_step"] for run in runs])},
    ]
    write_result(
        "exact_resume",
        f"tf-psx launch --workers 2 --ps 1, the chief of tests/scripts/exact_resume.py ({RECORDS} records, batch "
        f"{BATCH}, `fit` of one epoch with PeriodicSync every {EVERY} steps, 20 ms per step) killed (SIGKILL) about "
        f"5 batches after the snapshot of step {KILL_AFTER}, then launched again on the same snapshot directory; "
        f"{args.rounds} rounds, median and spread (min-max); the loss is linear in each record's row, so the final "
        "rows count every record's applications.",
        rows,
        extra={"runs": runs},
    )


if __name__ == "__main__":
    main()
