"""Worker kill -9 at random points of `model.fit`: how many times each example's gradient was applied.

One fit of one pass (the counting model of tests/scripts/exact_epochs.py:
one Adagrad row per example, a loss linear in the rows, so a row's value
says how many times its example was applied). While it runs, a killer
thread SIGKILLs a random worker at random times (up to `--kills` times,
seeded) and restarts it on its port (LocalCluster(processes=True)); every worker is
busy (fit queues its steps ahead), so a kill lands inside a step.

Prints `RESULT {json}`: the applications of every example (`counts`: how
many rows were applied 0, 1, 2, ... times), `iterations`, the steps each
element of the model's dense offsets was updated by (`offset_steps`: steps
-> elements; each must have every step once), the coordinator's
closure retries and what the step tokens caught
(`tf_psx.training.exact_updates.rerun_counts`). `--no-tokens` turns the tokens off
(the behaviour before them), for the comparison.

With `--sync` the strategy is `sync=True` (`sync_timeout_s=30`): a sync
step applies the mean of one batch per worker, so an example's gradient is
1 / workers of a batch's, and `--batches` must be divisible by the workers
(no partial step flushed). The RESULT then carries `sync_stats()`.

With `--launched` it runs as the chief of a `tf-psx launch` job (the
cluster of TF_CONFIG): no killer thread; the test kills workers through the
launcher's pids and the launcher restarts them. It prints
"tf_psx crash fit started" once the first step is done.

With `--tfra` the rows are a TFRA hash table over the 2 ps tasks (exact_epochs.py's
`--tfra` model): each shard's update is made on its ps task under its own
lock (tf_psx.tables.tfra_updates), so a step cut off between the two shards'
updates must apply the missing one once and the other not again.

Usage: exact_crash.py --workers 2 [--kills 10] [--batches 8000] [--seed 1] [--no-tokens] [--sync] [--launched] [--tfra]
                      [--steps-per-execution N]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import threading
import time

import numpy as np

import tf_psx
import tensorflow as tf

from exact_epochs import BATCH, GRAD, applications, build, rows_of, steps_of  # pylint: disable=wrong-import-position

# Seconds between two kills (uniform), after the restarted worker listens again.
GAP_S = (0.3, 2.0)
# Longest wait for a restarted worker at the end.
RESTART_WAIT_S = 120
# Longest the killer waits for fit to start its steps.
START_WAIT_S = 120


class Killer(threading.Thread):
    """Kills a random worker `kills` times at random moments, each restarted on its port before the next kill.

    One worker down at a time: with two down at once TF 2.16.2's recovery
    of the first ("Cluster update failed with error: failed to connect to
    all addresses") waited for the second and fit stopped progressing.
    """

    def __init__(self, cluster, workers: int, kills: int, seed: int, running: threading.Event):
        super().__init__(daemon=True)
        self.cluster, self.workers, self.kills = cluster, workers, kills
        self.rng, self.running, self.done = random.Random(seed), running, threading.Event()
        self.log: list[tuple[float, int]] = []
        self.errors: list[str] = []

    def _restart(self, victim: int) -> None:
        try:
            self.cluster.restart("worker", victim)
        except Exception as error:  # pylint: disable=broad-except  (reported in the RESULT)
            self.errors.append(repr(error))

    def run(self):
        self.running.wait(START_WAIT_S)
        start = time.monotonic()
        while len(self.log) < self.kills and not self.done.wait(self.rng.uniform(*GAP_S)):
            victim = self.rng.randrange(self.workers)
            try:
                self.cluster.kill("worker", victim)
            except Exception as error:  # pylint: disable=broad-except
                self.errors.append(repr(error))
                return
            self.log.append((round(time.monotonic() - start, 2), victim))
            self._restart(victim)

    def finish(self, timeout_s: float) -> None:
        """Stops killing and waits (bounded) for the restart in progress."""
        self.done.set()
        self.join(timeout_s)


class _Started(tf.keras.callbacks.Callback):
    def __init__(self, event):
        super().__init__()
        self._supports_tf_logs = True
        self.event = event

    def on_train_batch_end(self, batch, logs=None):
        if not self.event.is_set():
            print("tf_psx crash fit started", flush=True)
        self.event.set()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--batches", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-tokens", action="store_true", help="the behaviour before step tokens")
    parser.add_argument("--sync", action="store_true", help="sync=True (the batches divisible by the workers)")
    parser.add_argument("--launched", action="store_true", help="the chief of a tf-psx launch job (no killer)")
    parser.add_argument("--tfra", action="store_true",
                        help="the rows in a TFRA hash table over the 2 ps tasks (TFRA's layer, as its demos write it)")
    parser.add_argument("--steps-per-execution", type=int, default=1,
                        help="compile with this steps_per_execution (each closure runs that many steps)")
    parser.add_argument("--stall-report-s", type=float, default=90.0,
                        help="a StallDoctor report (closures, task states, stacks) after this many silent seconds")
    args = parser.parse_args(argv)
    if args.sync and args.batches % args.workers:
        parser.error(f"--sync needs --batches divisible by --workers; got {args.batches} and {args.workers}")
    if args.no_tokens:
        from tf_psx._tf import step_tokens  # pylint: disable=import-outside-toplevel

        step_tokens.current = lambda: None
    count = args.batches * BATCH
    ids = np.arange(count, dtype=np.int64)[:, None]
    local = tf_psx.LocalCluster(num_workers=args.workers, num_ps=2, processes=True)
    with (tf_psx.launched_or(local) if args.launched else local) as cluster:
        sync = dict(sync=True, sync_timeout_s=30) if args.sync else {}
        strategy = tf_psx.ParameterServerStrategy(cluster, "fixed:2", **sync)
        model = build(strategy, count, tfra=args.tfra, dense=True)
        if args.steps_per_execution != 1:
            model.compile(model.optimizer, model.loss, steps_per_execution=args.steps_per_execution)
        running = threading.Event()
        killer = Killer(cluster, args.workers, 0 if args.launched else args.kills, args.seed, running)
        killer.start()
        retries = tf_psx._tf.runtime.closure_retries(strategy.coordinator)  # pylint: disable=protected-access
        doctor = tf_psx.callbacks.StallDoctor(args.stall_report_s, cluster=cluster)
        start = time.monotonic()
        try:
            history = model.fit(ids, np.zeros(count, np.float32), batch_size=BATCH, epochs=1, shuffle=True,
                                verbose=0, callbacks=[_Started(running), doctor])
        finally:
            killer.finish(RESTART_WAIT_S)
        seconds = time.monotonic() - start
        rows = rows_of(model, count, tfra=args.tfra)
        grad = GRAD / args.workers if args.sync else GRAD
        applied = [applications(row, grad) for row in rows]
        # The steps each dense offset element was updated by (every step once: `steps`, or the sync steps).
        offsets = steps_of(np.concatenate(tf_psx.unsharded_weights(model.get_layer("offsets"))))
        print("RESULT " + json.dumps({
            "workers": args.workers, "tokens": not args.no_tokens, "sync": strategy.sync_stats() if args.sync else None, "rows": count, "seconds": round(seconds, 1),
            "kills": killer.log, "killer_errors": killer.errors,
            "counts": {str(k): v for k, v in sorted(collections.Counter(applied).items())},
            "iterations": int(model.optimizer.iterations.numpy()), "steps": args.batches,
            "offset_steps": {str(k): v for k, v in sorted(collections.Counter(offsets).items())},
            "grouped": len(tf_psx.training.exact_updates.grouped_variables(model.optimizer)),
            "closure_retries": retries.count, "steps_rerun": history.history.get("steps_rerun"),
            "caught": tf_psx.training.exact_updates.rerun_counts(model.optimizer), "stall_reports": len(doctor.reports),
        }), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The task processes are stopped; TF 2.16.2's teardown of the remote
    # contexts of restarted workers hung at interpreter exit (measured > 3 min).
    os._exit(code)  # pylint: disable=protected-access
