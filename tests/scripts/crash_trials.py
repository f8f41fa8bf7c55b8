"""Repeats the crash trial of exact_crash.py: under LocalCluster(processes=True) and under `tf-psx launch`.

Each trial is one fit of the counting model while workers are killed with
SIGKILL at seeded random moments (exact_crash.py: a killer thread and
`LocalCluster.restart`; under launch: tests/launch_harness.crash_under_launch,
the launcher restarting them). A trial passes when every row was applied
exactly once and `iterations` is exact (sync: the sync steps, and
`applied_batches` equals the batches).

Prints one `TRIAL {json}` line per trial and a `SUMMARY {json}` line.

Usage: crash_trials.py [--by local,launch] [--workers 2,3] [--seeds 1,2,3] [--kills 10] [--sync]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from launch_harness import crash_under_launch  # noqa: E402  pylint: disable=wrong-import-position

TRIAL_TIMEOUT_S = 900


def passed(result: dict, workers: int, sync: bool) -> bool:
    """Every row applied once, and the step counts exact."""
    if result["counts"] != {"1": result["rows"]} or result["caught"]["unsure"]:
        return False
    steps = result["steps"] // workers if sync else result["steps"]
    if result["offset_steps"] != {str(steps): 8}:  # the 8 elements of the two dense offsets: every step once
        return False
    if not sync:
        return result["iterations"] == result["steps"]
    stats = result["sync"]
    return (stats["applied_batches"] == result["steps"] and stats["dropped"] == 0
            and result["iterations"] == stats["applied_steps"] == steps)


def local_trial(workers: int, seed: int, kills: int, sync: bool) -> dict:
    batches = (2000 if sync else 8000) // workers * workers
    out = subprocess.run([sys.executable, os.path.join(HERE, "exact_crash.py"), "--workers", str(workers),
                          "--kills", str(kills), "--seed", str(seed), "--batches", str(batches),
                          *(["--sync"] if sync else [])],
                         capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S, check=False, cwd=HERE)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"exact_crash.py printed no RESULT (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--by", default="local,launch")
    parser.add_argument("--workers", default="2,3")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--sync", action="store_true")
    args = parser.parse_args(argv)
    trials = []
    for by in args.by.split(","):
        for workers in map(int, args.workers.split(",")):
            for seed in map(int, args.seeds.split(",")):
                if by == "local":
                    result = local_trial(workers, seed, args.kills, args.sync)
                    kills = len(result["kills"])
                else:
                    with tempfile.TemporaryDirectory() as log_dir:
                        killed, result = crash_under_launch(log_dir, seed, workers, args.kills,
                                                            ("--sync",) if args.sync else (),
                                                            batches=2000 if args.sync else 8000)
                    kills = len(killed)
                trial = {"by": by, "workers": workers, "seed": seed, "sync": args.sync, "kills": kills,
                         "passed": passed(result, workers, args.sync), "counts": result["counts"],
                         "offset_steps": result["offset_steps"], "grouped": result["grouped"],
                         "iterations": result["iterations"], "closure_retries": result["closure_retries"],
                         "caught": result["caught"], "sync_stats": result.get("sync"), "seconds": result["seconds"]}
                trials.append(trial)
                print("TRIAL " + json.dumps(trial), flush=True)
    print("SUMMARY " + json.dumps({"trials": len(trials), "passed": sum(t["passed"] for t in trials)}), flush=True)
    return 0 if all(t["passed"] for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
