"""Convergence of asynchronous training against a known optimum, with and without a staleness bound.

Data: `tf_psx.data.synthetic_ctr`, clicks from a planted logistic model, so
the Bayes-optimal AUC of the holdout is known. Model: the matching logistic
regression (an Embedding of width 1 over every id, summed, plus a bias),
Adagrad. Every mode sees the same number of examples:

  (a) 1 worker: the sequential reference;
  (b) 3 workers, asynchronous;
  (c) 3 workers, StalenessBound(1, "drop");
  (d) 3 workers, StalenessBound(1, "scale");
  (e) 3 workers, PeriodicSync every 50 steps.

Each mode runs in a fresh coordinator process with its own LocalCluster of
task processes (1 ps). After every epoch the holdout AUC is computed on the
coordinator from the weights (numpy), so evaluation does not touch the
workers; examples/s is measured over epochs 2.. (epoch 1 includes tracing),
evaluation time excluded. Targets: (c) or (d) within 0.005 AUC of (a), at
>= 0.9x the examples/s of (b).

Writes bench/results/convergence.json and docs/img/convergence.png.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

FIELDS, VOCAB, BATCH = 8, 1000, 256
STEPS_PER_EPOCH, EPOCHS = 100, 8  # 800 steps x 256 = 204,800 examples per mode
HOLDOUT = 50_000
LEARNING_RATE = 0.1
SEED = 0
SYNC_EVERY = 50
GAP_TARGET = 0.005
THROUGHPUT_TARGET = 0.9
# A child imports TF, starts 2-4 task processes and traces fit: minutes on 2 cores.
CHILD_TIMEOUT_S = 400
IMAGE = os.path.join(os.path.dirname(HERE), "docs", "img", "convergence.png")

MODES = {
    "a_1_worker": {"workers": 1, "label": "(a) 1 worker"},
    "b_async": {"workers": 3, "label": "(b) 3 workers, async"},
    "c_drop": {"workers": 3, "label": '(c) 3 workers, StalenessBound(1, "drop")', "bound": "drop"},
    "d_scale": {"workers": 3, "label": '(d) 3 workers, StalenessBound(1, "scale")', "bound": "scale"},
    "e_sync": {"workers": 3, "label": f"(e) 3 workers, PeriodicSync every {SYNC_EVERY}", "sync": True},
}


def _data():
    import tf_psx  # pylint: disable=import-outside-toplevel

    data = tf_psx.data.synthetic_ctr(STEPS_PER_EPOCH * EPOCHS * BATCH + HOLDOUT, FIELDS, VOCAB, seed=SEED)
    return data.split(HOLDOUT / len(data.labels))


def child(mode: str) -> None:
    """Trains one mode; prints a JSON line with the AUC per epoch and examples/s."""
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import holdout_auc, logistic_model  # pylint: disable=import-outside-toplevel

    spec = MODES[mode]
    train, holdout = _data()
    workers = spec["workers"]
    with tf_psx.LocalCluster(num_workers=workers, num_ps=1, processes=True) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster)
        with strategy.scope():
            model = logistic_model(train.num_rows, FIELDS, LEARNING_RATE)

        def dataset_fn(ctx):
            ds = tf.data.Dataset.from_tensor_slices((train.ids, train.labels))
            ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            return ds.shuffle(20_000, seed=SEED + ctx.input_pipeline_id).repeat().batch(BATCH).prefetch(4)

        evaluate = holdout_auc(model, strategy.coordinator, holdout, STEPS_PER_EPOCH * BATCH)
        callbacks = []
        if "bound" in spec:
            callbacks.append(tf_psx.callbacks.StalenessBound(1, spec["bound"]))
        if spec.get("sync"):
            callbacks.append(tf_psx.callbacks.PeriodicSync(SYNC_EVERY, tempfile.mkdtemp(prefix="convergence-")))
        callbacks.append(evaluate)
        history = model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=EPOCHS,
                            steps_per_epoch=STEPS_PER_EPOCH, callbacks=callbacks, verbose=0)
        rate = (EPOCHS - 1) * STEPS_PER_EPOCH * BATCH / evaluate.training_seconds()
        result = {
            "mode": mode,
            "bayes_auc": holdout.bayes_auc,
            "points": evaluate.points,
            "examples_per_s": rate,
            "applied": int(model.optimizer.iterations.numpy()),
            "dropped": sum(history.history.get("dropped_gradients", [0])),
            "staleness_mean": history.history.get("staleness_mean"),
        }
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (skip TF's slow teardown of the cluster connection)


def _plot(results: dict) -> None:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    fig, axis = plt.subplots(figsize=(7, 4.2))
    for mode, result in results.items():
        xs = [p["examples"] for p in result["points"]]
        ys = [result["bayes_auc"] - p["auc"] for p in result["points"]]
        axis.plot(xs, ys, marker="o", markersize=3, label=MODES[mode]["label"])
    axis.set_xlabel("examples seen")
    axis.set_ylabel("Bayes AUC - holdout AUC")
    axis.set_yscale("log")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    axis.set_title("Convergence on synthetic CTR (planted logistic model)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(IMAGE), exist_ok=True)
    fig.savefig(IMAGE, dpi=110)
    print(f"wrote {IMAGE}")


def main() -> None:
    from _common import add_images, write_result  # pylint: disable=import-outside-toplevel

    results = {}
    for mode in MODES:
        start = time.perf_counter()
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode],
                             capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
        lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if not lines:
            raise SystemExit(f"mode {mode} failed (rc {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        results[mode] = json.loads(lines[-1][len("RESULT "):])
        final = results[mode]["points"][-1]["auc"]
        print(f"{mode}: gap {results[mode]['bayes_auc'] - final:.4f}, "
              f"{results[mode]['examples_per_s']:.0f} examples/s ({time.perf_counter() - start:.0f} s)", flush=True)

    def gap(mode):
        return results[mode]["bayes_auc"] - results[mode]["points"][-1]["auc"]

    def rate(mode):
        return results[mode]["examples_per_s"]

    rows = []
    for mode in MODES:
        rows.append({"metric": f"{MODES[mode]['label']}: AUC gap to Bayes", "value": round(gap(mode), 5)})
        rows.append({"metric": f"{MODES[mode]['label']}: examples/s", "value": round(rate(mode), 1)})
    passes = {}
    for mode in ("c_drop", "d_scale"):
        extra_gap = gap(mode) - gap("a_1_worker")
        ratio = rate(mode) / rate("b_async")
        passes[mode] = extra_gap <= GAP_TARGET and ratio >= THROUGHPUT_TARGET
        rows.append({"metric": f"{mode[2:]}: gap - gap(a)", "value": round(extra_gap, 5),
                     "target": f"<= {GAP_TARGET}", "ok": extra_gap <= GAP_TARGET})
        rows.append({"metric": f"{mode[2:]}: examples/s / (b)", "value": round(ratio, 3),
                     "target": f">= {THROUGHPUT_TARGET}", "ok": ratio >= THROUGHPUT_TARGET})
    rows.append({"metric": "(c) or (d) meets both targets", "value": any(passes.values()),
                 "target": "True", "ok": any(passes.values())})
    _plot(results)
    path = write_result(
        "convergence",
        f"Holdout AUC gap to the Bayes-optimal AUC after {STEPS_PER_EPOCH * EPOCHS * BATCH:,} examples "
        f"(synthetic_ctr: {FIELDS} fields x {VOCAB} ids, Zipf 1.05; logistic regression, Adagrad "
        f"{LEARNING_RATE}, batch {BATCH} per worker step; {HOLDOUT:,} holdout examples), and examples/s over "
        "epochs 2..8; every mode in a fresh process with its own LocalCluster of task processes (1 ps).",
        rows,
        extra=results,
    )
    add_images(path, ["img/convergence.png"])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
