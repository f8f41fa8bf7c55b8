"""Training stalled per PeriodicSync snapshot: synchronous writes against background writes, and fit time.

A 2,000,000 x 16 ShardedEmbedding (fixed:2) with Adagrad (so 2 x 128 MB of
table and slot) plus Dense(1), in-process LocalCluster with 1 worker and 2
ps, batch 256 x 4 ids; `model.fit` of STEPS steps with PeriodicSync every
EVERY steps to a local directory, and the same fit without snapshots.
Stall per snapshot = the seconds the callback holds the training loop
(`snapshot_seconds`), split by `snapshot_splits` into the barrier, the wait
for a background write still in flight, and the write (synchronous: all of
it; background: the copy of every variable beside itself on its ps task,
TF's async checkpoint, and the start of the write). The interval is longer
than one synchronous write (measured ~1.2 s here), as a user's would be: a
snapshot that comes while the previous background write still runs waits
for it, and that wait is reported on its own. The interleaved method of
bench/_common.py (modes none / sync / background in fresh processes, order
rotated, ROUNDS rounds); per round the stall is the median over the
snapshots after the first (the first also makes the copies).
Targets (issue 30): background stall <= 0.2x synchronous; fit with
background snapshots <= 1.05x the fit without snapshots. The fit's cost
is measured two ways: whole fits in separate processes (none /
background), and paired segments of one fit (`paired_child`: segments of
N steps that start with a background snapshot against the segments
between them, at N = EVERY and at N = 3,000 steps, ~25 s of training). Beside the
seconds, each fit's process CPU seconds: the cores the fit without
snapshots keeps busy, the CPU each snapshot adds, and from them the lowest
fit ratio a background write can reach on this machine (`_cpu_rows`).

`python bench/snapshot_stall.py [--rounds N] [--fit-only]` (--fit-only: the paired
segments only, the other rows kept from the last result).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROWS, DIM, IDS, BATCH, STEPS, EVERY = 2_000_000, 16, 4, 256, 1500, 300
# The paired fit measure: (steps per segment, pairs of segments). 300 steps is EVERY (a snapshot every ~2.5 s of
# training); 3,000 steps is a snapshot every ~25 s, still far more often than a run of hours needs.
PAIRED = ((EVERY, 8), (3000, 3))
TARGET, FIT_TARGET = 0.2, 1.05
CORES = os.cpu_count() or 2


def _traced_model():
    """(model, data, cluster): the benchmark's model, its first steps traced, its data, and its in-process cluster."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import sharded_table_model  # pylint: disable=import-outside-toplevel

    model, cluster = sharded_table_model(ROWS, DIM, IDS)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, size=(BATCH * 16, IDS))
    labels = rng.random(BATCH * 16).astype(np.float32)
    data = tf.keras.utils.experimental.DatasetCreator(
        lambda _: tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH))
    model.fit(data, epochs=1, steps_per_epoch=5, verbose=0)  # trace
    return model, data, cluster


def child(mode: str) -> None:
    if mode.startswith("paired:"):
        _, steps, pairs = mode.split(":")
        paired_child(int(steps), int(pairs))
        return
    import tf_psx  # pylint: disable=import-outside-toplevel

    model, data, _cluster = _traced_model()
    snapshot_cpu = _count_snapshot_cpu()
    with tempfile.TemporaryDirectory() as directory:
        callbacks = [] if mode == "none" else [
            tf_psx.callbacks.PeriodicSync(EVERY, directory, background=(mode == "background"))]
        start, cpu_start = time.perf_counter(), time.process_time()
        model.fit(data, epochs=1, steps_per_epoch=STEPS, verbose=0, callbacks=callbacks)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        count = len(tf_psx.callbacks.PeriodicSync.snapshots(directory))
    result = {"fit_seconds": seconds, "fit_cpu_seconds": cpu_seconds, "snapshots_kept": count,
              "snapshot_cpu_seconds": snapshot_cpu}
    if callbacks:
        splits = callbacks[0].snapshot_splits
        later = splits[1:]
        result.update(stall=statistics.median(callbacks[0].snapshot_seconds[1:]), stalls=callbacks[0].snapshot_seconds,
                      splits=splits, barrier=statistics.median(p["barrier"] for p in later),
                      previous_write=statistics.median(p["previous_write"] for p in later),
                      write=statistics.median(p["write"] for p in later))
    print(json.dumps(result), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)


def paired_child(steps: int, pairs: int) -> None:
    """One fit, its segments of `steps` steps timed: background snapshots every 2 x `steps`, and between them none.

    PeriodicSync(2 x steps, background=True) snapshots at steps 2s, 4s, ...;
    a callback before it marks every `steps` steps (after a join, so a
    segment ends when its steps are done). A segment that starts with a
    snapshot holds its stall and its whole background write (the copy and the
    write take well under one segment); the next one holds neither. Adjacent
    segments of one process share the machine's state, where fits in separate
    processes minutes apart did not (the fit without snapshots spread 9.7-11.9 s
    over 3 rounds). The first segment (the fit's start) and the first
    snapshot's (it also makes the copies) are left out. Prints the seconds and
    process CPU seconds of each kind of segment.
    """
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    model, data, _cluster = _traced_model()
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(model.distribute_strategy)
    marks: list = []

    class _Segments(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._supports_tf_logs = True  # no per-step fetch of the logs

        def _mark(self):
            coordinator.join()
            marks.append((time.perf_counter(), time.process_time()))

        def on_train_begin(self, logs=None):
            self._mark()

        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % steps == 0:
                self._mark()

    with tempfile.TemporaryDirectory() as directory:
        sync = tf_psx.callbacks.PeriodicSync(2 * steps, directory, background=True)
        model.fit(data, epochs=1, steps_per_epoch=2 * steps * (pairs + 1), verbose=0, callbacks=[_Segments(), sync])
    segments = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]
    # Segment i covers steps [i s, (i+1) s); a snapshot starts segments 2, 4, ...
    background = [segments[i] for i in range(4, len(segments), 2)]
    none = [segments[i] for i in range(3, len(segments), 2)]
    print(json.dumps({"background_seconds": [round(v[0], 4) for v in background],
                      "background_cpu_seconds": [round(v[1], 4) for v in background],
                      "none_seconds": [round(v[0], 4) for v in none],
                      "none_cpu_seconds": [round(v[1], 4) for v in none],
                      "fastest_ratio": min(v[0] for v in background) / min(v[0] for v in none),
                      "median_ratio": statistics.median(v[0] for v in background)
                      / statistics.median(v[0] for v in none),
                      "stalls": sync.snapshot_seconds}), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)


def _count_snapshot_cpu() -> list:
    """A list that gets the process CPU seconds of each snapshot call (the training loop held meanwhile).

    Synchronous: the barrier and the whole write, with training stopped, so
    nearly all of it is the write's. Background: the barrier and the copy.
    """
    from tf_psx.snapshots import engine  # pylint: disable=import-outside-toplevel

    seconds: list = []
    original = engine.SnapshotEngine.snapshot

    def counted(self, step, position):
        start = time.process_time()
        try:
            return original(self, step, position)
        finally:
            seconds.append(time.process_time() - start)

    engine.SnapshotEngine.snapshot = counted
    return seconds


def _cpu_rows(none: list, sync: list, background: list) -> list[dict]:
    """What the snapshots cost in CPU (the process's: the in-process cluster's tasks and the writes), per round.

    A write's CPU can run without slowing training only on core-seconds the
    fit without snapshots leaves idle (CORES x its seconds - its CPU
    seconds); the rest is taken from training, at best shared over the
    CORES cores. With the CPU of a synchronous snapshot call (training held:
    the write's) as what a write costs, the lowest fit ratio a background
    write can reach is 1 + max(0, snapshots x that CPU - idle) / CORES /
    the fit's seconds. The CPU above the fit without snapshots, a
    difference of two processes, is reported too; it spreads more.
    """
    from _common import per_round, spread_text  # pylint: disable=import-outside-toplevel

    rows = [{"metric": "fit CPU seconds (the process): none / synchronous / background",
             "value": " / ".join(spread_text(per_round(r, "fit_cpu_seconds")) for r in (none, sync, background))},
            {"metric": f"cores busy in the fit without snapshots (of {CORES})",
             "value": spread_text([run["fit_cpu_seconds"] / run["fit_seconds"] for run in none])}]
    for name, results in (("synchronous", sync), ("background", background)):
        extra = [(run["fit_cpu_seconds"] - base["fit_cpu_seconds"]) / len(run["stalls"])
                 for run, base in zip(results, none)]
        rows.append({"metric": f"{name}: CPU seconds above no snapshots, per snapshot", "value": spread_text(extra)})
    if not all(run.get("snapshot_cpu_seconds") for run in sync + background):
        return rows
    for name, results in (("synchronous", sync), ("background", background)):
        rows.append({"metric": f"{name}: CPU seconds of the snapshot call (training held), per snapshot",
                     "value": spread_text([statistics.median(run["snapshot_cpu_seconds"][1:]) for run in results])})
    floor = []
    for run, base in zip(sync, none):
        idle = CORES * base["fit_seconds"] - base["fit_cpu_seconds"]
        needed = statistics.median(run["snapshot_cpu_seconds"][1:]) * len(run["snapshot_cpu_seconds"])
        floor.append(1 + max(0.0, needed - idle) / CORES / base["fit_seconds"])
    rows.append({"metric": f"lowest fit ratio a background write of the synchronous write's CPU allows on {CORES} "
                           "cores (idle core-seconds of the fit without snapshots used first)",
                 "value": spread_text(floor)})
    return rows


def main() -> None:
    import argparse  # pylint: disable=import-outside-toplevel

    from _common import (  # pylint: disable=import-outside-toplevel
        ROUNDS, interleaved, kept_rows, per_round, ratio_row, ratios, saved_date, saved_raw, saved_runs, spread_text,
        write_result)

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--rows", action="store_true", help="rewrite the rows from the last result's runs (no run)")
    parser.add_argument("--fit-only", action="store_true",
                        help="run only the paired fit measure; keep the other rows of the last result")
    args = parser.parse_args()
    paired_variants = [(f"paired:{steps}:{pairs}",) for steps, pairs in PAIRED]
    if args.fit_only:
        paired = interleaved(__file__, paired_variants, args.rounds)
        rows = _paired_rows(paired)
        write_result("snapshot_stall", _setup(args.rounds), rows + kept_rows("snapshot_stall", rows),
                     extra={**saved_raw("snapshot_stall"), **{key[0]: value for key, value in paired.items()}})
        return
    if args.rows:
        runs = saved_runs("snapshot_stall", 1)
        args.rounds = len(runs[("none",)])
    else:
        runs = interleaved(__file__, [("none",), ("sync",), ("background",), *paired_variants], args.rounds)
    none, sync, background = runs[("none",)], runs[("sync",)], runs[("background",)]
    rows = []
    for name, results in (("synchronous", sync), ("background", background)):
        rows.append({"metric": f"{name}: stall per snapshot, s", "value": spread_text(per_round(results, "stall"))})
        rows.append({"metric": f"{name}: stall split, s: barrier / waiting for the previous write / write",
                     "value": " / ".join(spread_text(per_round(results, key))
                                         for key in ("barrier", "previous_write", "write"))})
    rows.append(ratio_row("background / synchronous stall", ratios(background, sync, "stall"), TARGET,
                          higher_is_better=False))
    rows.append({"metric": "fit seconds: none / synchronous / background",
                 "value": " / ".join(spread_text(per_round(r, "fit_seconds")) for r in (none, sync, background))})
    rows.append(ratio_row("fit seconds, background snapshots / no snapshots",
                          ratios(background, none, "fit_seconds"), FIT_TARGET, higher_is_better=False))
    for name, results in (("synchronous", sync), ("background", background)):
        # What a snapshot costs the run: the fit's seconds above the same round's fit without snapshots, per
        # snapshot (the barrier's own seconds are partly training: the steps queued before it run during it).
        lost = [(run["fit_seconds"] - base["fit_seconds"]) / len(run["stalls"]) for run, base in zip(results, none)]
        rows.append({"metric": f"{name}: fit seconds above no snapshots, per snapshot", "value": spread_text(lost)})
    if all("fit_cpu_seconds" in run for run in none + sync + background):
        rows.extend(_cpu_rows(none, sync, background))
    rows.extend(_paired_rows({variant: runs[variant] for variant in paired_variants if variant in runs}))
    write_result(
        "snapshot_stall",
        _setup(args.rounds),
        rows,
        extra={key[0]: value for key, value in runs.items()},
        date=saved_date("snapshot_stall") if args.rows else None,
    )


def _paired_rows(paired: dict) -> list[dict]:
    """The fit's cost of background snapshots, from paired segments of one fit (`paired_child`), per interval."""
    from _common import ratio_row, spread_text  # pylint: disable=import-outside-toplevel

    rows = []
    for (variant,), results in paired.items():
        steps = int(variant.split(":")[1])
        rows.append(ratio_row(f"fit seconds of {steps} steps, a background snapshot at their start / none "
                              "(paired segments of one fit, fastest of each)",
                              [run["fastest_ratio"] for run in results], FIT_TARGET, higher_is_better=False))
        rows.append({"metric": f"the same, median segment of each ({steps} steps)",
                     "value": spread_text([run["median_ratio"] for run in results])})
        rows.append({"metric": f"seconds of {steps} steps: with a background snapshot / none (median segment)",
                     "value": " / ".join(spread_text([statistics.median(run[key]) for run in results])
                                         for key in ("background_seconds", "none_seconds"))})
        rows.append({"metric": f"fit seconds lost per background snapshot ({steps}-step segments, medians)",
                     "value": spread_text([statistics.median(run["background_seconds"])
                                           - statistics.median(run["none_seconds"]) for run in results])})
    return rows


def _setup(rounds: int) -> str:
    return (
        f"PeriodicSync every {EVERY} steps over {STEPS} steps of a {ROWS:,} x {DIM} ShardedEmbedding (fixed:2) with "
        f"Adagrad + Dense(1), batch {BATCH} x {IDS} ids, steps_per_execution=1; in-process LocalCluster with 1 "
        "worker and 2 ps; local directory; stall = seconds the callback holds the training loop (per round the "
        f"median over the snapshots after the first); {rounds} interleaved rounds of fresh processes "
        "(none / sync / background), ratios per round, median and spread (min-max). The fit's cost is also "
        "taken from paired segments of one fit (paired_child): background snapshots every 2 x N steps, segments "
        f"of N steps ({', '.join(str(steps) for steps, _ in PAIRED)}) with a snapshot at their start against the "
        "segments without one, in the same rounds.")


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 1)
