"""Sync, backups and SyncSwitch with a simulated straggler: a sleep in a worker's input, not a stopped process.

bench/sync_regime.py slows worker 0 by stopping its process (SIGSTOP) 20 ms
of every 30 ms. On 2 shared cores the other workers then get its CPU, so
sync loses less to the straggler than on hosts of their own and the async
remedies gain less. Here the cluster is simulated instead: every worker's
input pipeline sleeps `DELAY_MS` per batch (worker 0, found by
`tf.distribute.coordinator.experimental_get_current_worker_index()`, sleeps
3x as long), in tf.data's sleep transformation, which uses no CPU; the step
itself is small (the logistic regression of sync_regime, batch 64), so a
worker's pace is set by its sleep, as by the speed of a host of its own.
Nothing else differs from sync_regime: its data, model, learning rate and
global batch (4 workers x 64), `EPOCHS` epochs of `STEPS` global steps.

Modes, each in a fresh process with its own LocalCluster (4 workers, 1 ps):

  even     sync=True, no straggler (every worker sleeps DELAY_MS)
  sync     sync=True, worker 0 3x
  backup   sync=True, replicas_to_aggregate=3, worker 0 3x
  switch   sync="switchable", SyncSwitch(to="sync", patience=1, min_delta=0.01), worker 0 3x
  async    asynchronous, worker 0 3x

Every mode runs with data seeds 0, 1 and 2; the seeds are rounds, and the
modes of a round run in a rotated order (bench/_common.interleaved). The
ratios (switch / sync examples/s, backup / even applied examples/s) are
taken within a round and reported as median and spread; the AUC
condition ("at sync's AUC") is the mean over the 3 seeds of the switch's
final gap to the Bayes AUC minus sync's, <= 0.002.

Writes bench/results/sync_stragglers.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

DELAY_MS = 40  # a worker's input sleep per batch; worker 0 sleeps SLOWDOWN x as long
SLOWDOWN = 3
SEEDS = (0, 1, 2)
CHILD_TIMEOUT_S = 600
MODES = {
    "even": {"sync": True, "straggler": False, "label": "sync, no straggler"},
    "sync": {"sync": True, "label": "sync"},
    "backup": {"sync": True, "replicas": 3, "label": "sync, 3 of 4 aggregated"},
    "switch": {"sync": "switchable", "label": "async then sync (SyncSwitch)"},
    "async": {"label": "async"},
}


def child(mode: str, seed: str) -> None:
    """Trains one mode; prints a JSON line with the AUC per epoch and examples/s."""
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.python.data.experimental.ops import testing  # pylint: disable=import-outside-toplevel

    import sync_regime  # pylint: disable=import-outside-toplevel
    from _common import holdout_auc  # pylint: disable=import-outside-toplevel

    spec = MODES[mode]
    train, holdout = sync_regime._data(int(seed))  # pylint: disable=protected-access  (the same data as sync_regime)
    workers, steps = sync_regime.WORKERS, sync_regime.STEPS * sync_regime.WORKERS
    batch = sync_regime.GLOBAL_BATCH // workers
    slow_factor = SLOWDOWN if spec.get("straggler", True) else 1
    with tf_psx.LocalCluster(num_workers=workers, num_ps=1, processes=True) as cluster:
        strategy, model = sync_regime.strategy_and_model(cluster, spec, train.num_rows, sync_regime.LEARNING_RATE)

        def dataset_fn(_ctx):
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            delay_us = tf.cast(tf.where(tf.equal(index, 0), slow_factor, 1) * DELAY_MS * 1000, tf.int64)
            ds = tf.data.Dataset.from_tensor_slices((train.ids, train.labels))
            return ds.shuffle(len(train.labels)).repeat().batch(batch).apply(testing.sleep(delay_us)).prefetch(4)

        evaluate = holdout_auc(model, strategy.coordinator, holdout, sync_regime.STEPS * sync_regime.GLOBAL_BATCH)
        callbacks = [evaluate]
        switch = None
        if spec.get("sync") == "switchable":
            switch = tf_psx.callbacks.SyncSwitch(to="sync", patience=1, min_delta=0.01)
            callbacks.insert(0, switch)
        model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=sync_regime.EPOCHS,
                  steps_per_epoch=steps, callbacks=callbacks, verbose=0)
        seconds = evaluate.training_seconds()
        trained = (sync_regime.EPOCHS - 1) * steps * batch
        applied = sync_regime.applied_examples(strategy, spec, trained)
        stats = strategy.sync_stats() if spec.get("sync") else None
        result = {"mode": mode, "seed": int(seed), "bayes_auc": holdout.bayes_auc, "points": evaluate.points,
                  "examples_per_s": trained / seconds, "applied_examples_per_s": applied / seconds,
                  "final_auc": evaluate.points[-1]["auc"],
                  "sync": stats, "switched_at_step": None if switch is None else switch.switched_at_step}
    print(json.dumps(result), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (skip TF's slow teardown of the cluster connection)


def _gap(result) -> float:
    return result["bayes_auc"] - result["points"][-1]["auc"]


def _rows(runs: dict) -> list:
    """The table's rows from the runs ({mode: [one result per seed, in seed order]})."""
    from _common import ratio_row  # pylint: disable=import-outside-toplevel

    rows = []
    for mode, spec in MODES.items():
        rates = [r["examples_per_s"] for r in runs[mode]]
        gaps = [_gap(r) for r in runs[mode]]
        rows.append({"metric": f"{spec['label']}: examples/s, median of {len(rates)} seeds",
                     "value": round(statistics.median(rates)), "unit": f"examples/s ({min(rates):.0f}-{max(rates):.0f})"})
        rows.append({"metric": f"{spec['label']}: AUC gap to Bayes, mean of {len(gaps)} seeds",
                     "value": round(statistics.mean(gaps), 5), "unit": f"({min(gaps):.5f}-{max(gaps):.5f})"})

    def per_seed(top, bottom, key="examples_per_s"):
        return [a[key] / b[key] for a, b in zip(runs[top], runs[bottom])]

    rows.append(ratio_row("switch / sync, examples/s (3x straggler)", per_seed("switch", "sync"), 1.5))
    difference = statistics.mean(_gap(r) for r in runs["switch"]) - statistics.mean(_gap(r) for r in runs["sync"])
    rows.append({"metric": "switch AUC gap - sync AUC gap, mean of the seeds", "value": round(difference, 5),
                 "target": "<= 0.002", "ok": difference <= 0.002})
    rows.append(ratio_row("3-of-4 backups with a 3x straggler / 4 equal workers, applied examples/s",
                          per_seed("backup", "even", "applied_examples_per_s"), 0.7))
    rows.append(ratio_row("async / sync, examples/s (3x straggler)", per_seed("async", "sync")))
    return rows


def main() -> None:
    from _common import interleaved, write_result  # pylint: disable=import-outside-toplevel

    rounds = interleaved(__file__, [(mode,) for mode in MODES], rounds=len(SEEDS), timeout=CHILD_TIMEOUT_S,
                         round_args=lambda index: (str(SEEDS[index]),))
    runs = {mode: rounds[(mode,)] for mode in MODES}
    write_result(
        "sync_stragglers",
        f"a simulated cluster: each worker's input sleeps {DELAY_MS} ms per batch in tf.data (worker 0: "
        f"{SLOWDOWN}x), no CPU; otherwise bench/sync_regime.py's data, model and batch (4 workers x 64, 1 ps, "
        "task processes); one run per mode and data seed (0, 1, 2), the modes of a seed in rotated order, a fresh "
        "process each; ratios within a seed, median and spread",
        _rows(runs), extra=runs)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    elif sys.argv[1:] == ["--rows"]:
        from _common import RESULTS_DIR  # pylint: disable=import-outside-toplevel

        PATH = os.path.join(RESULTS_DIR, "sync_stragglers.json")
        with open(PATH, encoding="utf-8") as handle:
            SAVED = json.load(handle)
        SAVED["rows"] = _rows(SAVED["raw"])
        with open(PATH, "w", encoding="utf-8") as handle:
            json.dump(SAVED, handle, indent=2)
            handle.write("\n")
    else:
        main()
