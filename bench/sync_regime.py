"""Where asynchronous training hurts, and what sync, switching and staleness bounds buy back.

Data and model as bench/convergence.py: `tf_psx.data.synthetic_ctr` with a
planted logistic model (known Bayes AUC), the matching logistic regression,
Adagrad. The training pool holds 4x the examples a run consumes, and every
worker shuffles the whole pool with its own seed, so 1 and 4 workers both
train on nearly distinct examples. The regime: a high learning rate (`LEARNING_RATE`) and 4 workers,
one of them (worker 0) slowed 3x: its task process is stopped (SIGSTOP)
for 20 ms of every 30 ms, so it runs a third of the time. Every mode sees the same examples
(`EPOCHS` x `STEPS` x the global batch 256):

  one_worker        1 worker, batch 256 (the global batch), no straggler
  async             4 workers x 64, async
  async_lr/2, /4    the same at half and a quarter of the rate (the tuned async)
  drop, scale       4 async workers with StalenessBound(1, "drop" / "scale")
  sync_even         4 workers, sync=True, no straggler (throughput reference)
  sync              4 workers, sync=True
  sync_backup       4 workers, sync=True, replicas_to_aggregate=3
  switch            4 workers, sync="switchable", SyncSwitch(patience=1): async
                    until an epoch's loss improves by < 1 %, then sync

Each mode runs in a fresh process with its own LocalCluster of task
processes (1 ps). Holdout AUC after every epoch from the weights (numpy, on
the coordinator). examples/s: the batches trained (for sync modes: applied)
x batch over the wall time of epochs 2.. less evaluation; the time to a
target AUC (the one-worker run's final AUC - 0.005) counts from the end of
epoch 1. Seed 0 for every mode; seeds 1 and 2 also for the modes of the
targets that ask for a mean of 3 seeds (1 worker, async, sync, switch).

Writes bench/results/sync_regime.json and docs/img/sync_regime.png.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

FIELDS, VOCAB, GLOBAL_BATCH, WORKERS = 8, 1000, 256, 4
STEPS, EPOCHS = 40, 8  # global steps per epoch: 40 x 256 x 8 = 81,920 examples per mode
HOLDOUT = 50_000
# The training pool is POOL x the examples a run consumes, and each worker
# shuffles all of it with its own seed: a run's examples are nearly all
# distinct whether 1 or 4 workers draw them.
POOL = 4
LEARNING_RATE = 4.0
SEEDS = (0, 1, 2)
# The modes of the targets that ask for a mean of 3 seeds; the others run seed 0 only.
SEEDED_MODES = ("one_worker", "async", "sync", "switch")
TARGET_BELOW_ONE_WORKER = 0.005
CHILD_TIMEOUT_S = 600
IMAGE = os.path.join(os.path.dirname(HERE), "docs", "img", "sync_regime.png")

MODES = {
    "sync_even": {"workers": 4, "sync": True, "straggler": False, "label": "4 workers, sync, no straggler"},
    "one_worker": {"workers": 1, "straggler": False, "label": "1 worker, batch 256"},
    "async": {"workers": 4, "label": "4 workers, async"},
    "async_lr2": {"workers": 4, "lr": LEARNING_RATE / 2, "label": "4 workers, async, rate / 2"},
    "async_lr4": {"workers": 4, "lr": LEARNING_RATE / 4, "label": "4 workers, async, rate / 4"},
    "drop": {"workers": 4, "bound": "drop", "label": 'async + StalenessBound(1, "drop")'},
    "scale": {"workers": 4, "bound": "scale", "label": 'async + StalenessBound(1, "scale")'},
    "sync": {"workers": 4, "sync": True, "label": "4 workers, sync"},
    "sync_backup": {"workers": 4, "sync": True, "replicas": 3, "label": "4 workers, sync, 3 of 4 aggregated"},
    "switch": {"workers": 4, "sync": "switchable", "label": "4 workers, async then sync (SyncSwitch)"},
}


def _data(seed: int):
    import tf_psx  # pylint: disable=import-outside-toplevel

    data = tf_psx.data.synthetic_ctr(POOL * STEPS * EPOCHS * GLOBAL_BATCH + HOLDOUT, FIELDS, VOCAB, seed=seed)
    return data.split(HOLDOUT / len(data.labels))




def strategy_and_model(cluster, spec: dict, num_rows: int, learning_rate: float):
    """The strategy of a mode's `spec` ("sync", "replicas") on `cluster`, and the logistic model in its scope."""
    import tf_psx  # pylint: disable=import-outside-toplevel

    from _common import logistic_model  # pylint: disable=import-outside-toplevel

    kwargs = {}
    if spec.get("sync"):
        kwargs = {"sync": spec["sync"], "replicas_to_aggregate": spec.get("replicas")}
    strategy = tf_psx.ParameterServerStrategy(cluster, **kwargs)
    with strategy.scope():
        model = logistic_model(num_rows, FIELDS, learning_rate)
    return strategy, model


def applied_examples(strategy, spec: dict, trained: int) -> float:
    """The examples of `trained` that were applied: in sync mode, less the dropped (late) gradients' share."""
    if spec.get("sync") is not True:
        return trained
    stats = strategy.sync_stats()
    return trained * stats["applied_batches"] / max(stats["applied_batches"] + stats["dropped"], 1)


def child(mode: str, seed: str) -> None:
    """Trains one mode; prints a JSON line with the AUC per epoch, examples/s and step time."""
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import Straggler, holdout_auc  # pylint: disable=import-outside-toplevel

    seed = int(seed)
    spec = MODES[mode]
    train, holdout = _data(seed)
    workers = spec["workers"]
    batch = GLOBAL_BATCH // workers
    steps = STEPS * workers
    straggler = spec.get("straggler", True)
    with tf_psx.LocalCluster(num_workers=workers, num_ps=1, processes=True) as cluster:
        strategy, model = strategy_and_model(cluster, spec, train.num_rows, spec.get("lr", LEARNING_RATE))

        def dataset_fn(ctx):
            # TF's ParameterServerStrategy gives every worker input_pipeline_id 0
            # of 1 pipeline, so a seeded shuffle would give all workers the same
            # batches: each worker shuffles the whole pool with its own random seed.
            ds = tf.data.Dataset.from_tensor_slices((train.ids, train.labels))
            return ds.shuffle(len(train.labels)).repeat().batch(batch).prefetch(4)

        evaluate = holdout_auc(model, strategy.coordinator, holdout, STEPS * GLOBAL_BATCH)
        callbacks = []
        switch = None
        if "bound" in spec:
            callbacks.append(tf_psx.callbacks.StalenessBound(1, spec["bound"]))
        if spec.get("sync") == "switchable":
            switch = tf_psx.callbacks.SyncSwitch(to="sync", patience=1, min_delta=0.01)
            callbacks.append(switch)
        callbacks.append(evaluate)
        slow = Straggler(cluster.pid("worker", 0)) if straggler else None
        try:
            history = model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=EPOCHS,
                                steps_per_epoch=steps, callbacks=callbacks, verbose=0)
        finally:
            if slow is not None:
                slow.stop()
        seconds = evaluate.training_seconds()
        trained = (EPOCHS - 1) * steps * batch
        applied = applied_examples(strategy, spec, trained)
        result = {
            "mode": mode,
            "seed": seed,
            "bayes_auc": holdout.bayes_auc,
            "points": evaluate.points,
            "examples_per_s": trained / seconds,
            "applied_examples_per_s": applied / seconds,
            # Per worker: the wall time of one worker's step (all workers busy).
            "worker_step_s": seconds * workers / ((EPOCHS - 1) * steps),
            "dropped": sum(history.history.get("dropped_gradients", [0])),
            "sync": strategy.sync_stats() if spec.get("sync") else None,
            "switched_at_step": None if switch is None else switch.switched_at_step,
            "straggler": straggler,
        }
    print(json.dumps(result), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (skip TF's slow teardown of the cluster connection)


def _final_gap(result) -> float:
    return result["bayes_auc"] - result["points"][-1]["auc"]


def _time_to(result, target: float):
    for point in result["points"][1:]:
        if point["auc"] >= target:
            return point["seconds"]
    return None


# The plot's two panels, at most five lines each: what the regimes cost with a
# straggler, and what the async remedies do.
PANELS = (
    ("sync regimes", ("one_worker", "sync_even", "sync", "sync_backup", "switch")),
    ("async and its remedies", ("async", "async_lr2", "async_lr4", "drop", "scale")),
)


def _plot(results: dict) -> None:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    fig, axes = plt.subplots(1, len(PANELS), figsize=(11, 4.2), sharey=True)
    for axis, (title, modes) in zip(axes, PANELS):
        for mode in modes:  # seed 0
            points = results[mode]["points"][1:]
            axis.plot([p["seconds"] for p in points], [p["auc"] for p in points], marker="o", markersize=3,
                      label=MODES[mode]["label"])
        axis.set_xlabel("seconds since the end of epoch 1 (evaluation excluded)")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
        axis.set_title(title, fontsize=10)
    axes[0].set_ylabel("holdout AUC")
    fig.suptitle("AUC against wall time: 4 workers, one slowed 3x, high learning rate (seed 0)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(IMAGE), exist_ok=True)
    fig.savefig(IMAGE, dpi=110)


def _rows(results: dict) -> list:
    """The table's rows from the modes' results."""
    target = results["one_worker"]["points"][-1]["auc"] - TARGET_BELOW_ONE_WORKER
    rows = []
    for mode in MODES:
        result = results[mode]
        label = MODES[mode]["label"]
        rows.append({"metric": f"{label}: AUC gap to Bayes", "value": round(_final_gap(result), 5)})
        rows.append({"metric": f"{label}: examples/s", "value": round(result["examples_per_s"], 1)})
        reached = _time_to(result, target)
        rows.append({"metric": f"{label}: s to AUC {target:.4f}", "value": None if reached is None else round(reached, 1)})

    def gap(mode):
        return _final_gap(results[mode])

    def rate(mode, key="examples_per_s"):
        return results[mode][key]

    def seeded(mode):
        return [results[mode if seed == 0 else f"{mode}@{seed}"] for seed in SEEDS
                if (mode if seed == 0 else f"{mode}@{seed}") in results]

    def mean_gap(mode):
        return sum(_final_gap(r) for r in seeded(mode)) / len(seeded(mode))

    def mean_rate(mode):
        return sum(r["examples_per_s"] for r in seeded(mode)) / len(seeded(mode))

    seeds = len(seeded("switch"))
    for mode in SEEDED_MODES:
        gaps = [_final_gap(r) for r in seeded(mode)]
        rows.append({"metric": f"{MODES[mode]['label']}: AUC gap, mean (min..max) of {len(gaps)} seeds",
                     "value": f"{sum(gaps) / len(gaps):.5f} ({min(gaps):.5f}..{max(gaps):.5f})"})
    async_gap = mean_gap("async") - mean_gap("one_worker")
    rows.append({"metric": f"async gap - 1-worker gap (mean of {seeds} seeds)", "value": round(async_gap, 5),
                 "target": ">= 0.01", "ok": async_gap >= 0.01})
    switch_diff = mean_gap("switch") - mean_gap("sync")
    switch_ratio = mean_rate("switch") / mean_rate("sync")
    rows.append({"metric": f"switch: gap - sync gap (mean of {seeds} seeds)", "value": round(switch_diff, 5),
                 "target": "<= 0.002", "ok": switch_diff <= 0.002})
    rows.append({"metric": f"switch: examples/s / sync (mean of {seeds} seeds)", "value": round(switch_ratio, 3),
                 "target": ">= 1.5", "ok": switch_ratio >= 1.5})
    tuned = min(("async", "async_lr2", "async_lr4"), key=gap)
    rows.append({"metric": "best async rate", "value": MODES[tuned]["label"]})
    sync_gap = gap("sync")
    rows.append({"metric": "best async gap - sync gap", "value": round(gap(tuned) - sync_gap, 5)})
    for bound in ("drop", "scale"):
        ratio = rate(bound) / rate("async")
        if gap(tuned) - sync_gap > 0:
            closed = (gap(tuned) - gap(bound)) / (gap(tuned) - sync_gap)
            rows.append({"metric": f"{bound}: share of the (tuned async - sync) gap closed", "value": round(closed, 3),
                         "target": ">= 0.5", "ok": closed >= 0.5})
        else:
            # The tuned async run is as good as sync: there is no gap for a bound to close.
            rows.append({"metric": f"{bound}: gap - best async gap", "value": round(gap(bound) - gap(tuned), 5),
                         "target": "<= 0 (no async-sync gap to close)", "ok": gap(bound) <= gap(tuned)})
        rows.append({"metric": f"{bound}: examples/s / async", "value": round(ratio, 3), "target": ">= 0.9",
                     "ok": ratio >= 0.9})
    backup_ratio = rate("sync_backup", "applied_examples_per_s") / rate("sync_even", "applied_examples_per_s")
    rows.append({"metric": "sync 3 of 4 with straggler: applied examples/s / sync without straggler",
                 "value": round(backup_ratio, 3), "target": ">= 0.7", "ok": backup_ratio >= 0.7})
    return rows


def main() -> None:
    from _common import RUN_S, STOP_S, add_images, run_child, write_result  # pylint: disable=import-outside-toplevel

    results: dict = {}
    runs = [(mode, 0) for mode in MODES] + [(mode, seed) for seed in SEEDS[1:] for mode in SEEDED_MODES]
    for mode, seed in runs:
        start = time.perf_counter()
        key = mode if seed == 0 else f"{mode}@{seed}"
        results[key] = run_child(__file__, mode, str(seed), timeout=CHILD_TIMEOUT_S)
        print(f"{key}: gap {_final_gap(results[key]):.4f}, {results[key]['examples_per_s']:.0f} examples/s "
              f"({time.perf_counter() - start:.0f} s)", flush=True)

    rows = _rows(results)
    _plot(results)
    path = write_result(
        "sync_regime",
        f"synthetic_ctr ({FIELDS} fields x {VOCAB} ids, planted logistic model), logistic regression, Adagrad "
        f"{LEARNING_RATE}, global batch {GLOBAL_BATCH} (4 workers x {GLOBAL_BATCH // WORKERS}), {EPOCHS} epochs of "
        f"{STEPS * GLOBAL_BATCH:,} examples; worker 0's process is stopped {STOP_S * 1000:.0f} ms of every "
        f"{(STOP_S + RUN_S) * 1000:.0f} ms (3x slower) "
        "except in the 1-worker and no-straggler runs; each mode in a fresh process with task processes (1 ps); "
        f"data seed 0, and seeds {SEEDS[1:]} for {', '.join(SEEDED_MODES)}.",
        rows,
        extra=results,
    )
    add_images(path, ["img/sync_regime.png"])


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    elif sys.argv[1:] == ["--rows"]:  # also redraws docs/img/sync_regime.png
        # Rebuilds the table and the plot of bench/results/sync_regime.json from its raw results (no new run).
        from _common import RESULTS_DIR as RESULTS  # pylint: disable=import-outside-toplevel

        path = os.path.join(RESULTS, "sync_regime.json")
        with open(path, encoding="utf-8") as handle:
            saved = json.load(handle)
        saved["rows"] = _rows(saved["raw"])
        _plot(saved["raw"])
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(saved, handle, indent=2)
            handle.write("\n")
    else:
        main()
