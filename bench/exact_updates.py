"""Exact updates: the closed-form check over a grid, and what the locks cost per step.

Part 1, the closed form (tests/scripts/exact_updates.py): every batch holds
the same 200 keys, the loss is linear in the looked-up rows, so after S
applied steps each row must equal S sequential applications of the constant
gradient. For each layer (ShardedEmbedding, stock Embedding, DynamicEmbedding)
x optimizer (tf-keras SGD, SGD momentum 0.9, Adagrad, Adam; tf_psx LazyAdam,
SGD, SGD momentum) x 1/2/3 workers x in-process / task-process clusters it
records the share of the true move applied (target 1.0000) and the largest
row error relative to the largest move (target <= 1e-4); with
`exact_updates=False` (TF's and TFRA's own update paths, "before") for 2 and
3 workers in-process.

Part 2, the cost: ms per step of a DeepFM-like model on 26 categorical
features (Criteo-like cardinalities capped at 100k, Zipf(1.1) ids) plus 13
dense, FM + DNN(400, 400, 400), batch 512, Adagrad, 2 ps on task processes,
with 2 and 3 workers, `exact_updates` True against False. Two embedding
layouts: 26 ShardedEmbedding tables (fixed:2) and one DynamicEmbedding for
all fields (field folded into the key). Fresh processes, ABAB order over the
rounds. Target: exact / before <= 1.1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REPO = os.path.dirname(HERE)
SCRIPT = os.path.join(REPO, "tests", "scripts", "exact_updates.py")

LAYERS = ("sharded", "stock", "dynamic")
OPTIMIZERS = ("sgd", "sgd_momentum", "adagrad", "adam", "lazyadam", "psx_sgd", "psx_sgd_momentum")
CLOSED_FORM_STEPS = 40
TOLERANCE = 1e-4
# A grid run trains 21 models on one cluster: about a minute on 2 cores.
GRID_TIMEOUT_S = 900

NUM_CAT, NUM_DENSE, DIM, BATCH = 26, 13, 8, 512
# Criteo's 26 cardinalities (Kaggle), capped so that two runs fit in memory.
CARDINALITIES = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]
CAP = 100_000
ZIPF = 1.1
HIDDEN = (400, 400, 400)
WARMUP_STEPS, TIMED_STEPS, ROUNDS = 15, 100, 3
COST_WORKERS = (2, 3)
COST_LAYOUTS = ("sharded", "dynamic")
COST_TARGET = 1.1


def closed_form_grid() -> list[dict]:
    runs = []
    for workers in (1, 2, 3):
        for processes in (False, True):
            runs.append((workers, processes, True))
    runs += [(2, False, False), (3, False, False)]
    results = []
    for workers, processes, exact in runs:
        args = [sys.executable, SCRIPT, "--layer", *LAYERS, "--optimizer", *OPTIMIZERS, "--workers", str(workers),
                "--steps", str(CLOSED_FORM_STEPS)]
        args += ["--processes"] if processes else []
        args += [] if exact else ["--no-exact"]
        out = subprocess.run(args, capture_output=True, text=True, timeout=GRID_TIMEOUT_S, check=False)
        lines = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or len(lines) != len(LAYERS) * len(OPTIMIZERS):
            raise SystemExit(f"closed-form run {args[2:]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        print(f"closed form: {workers} workers, processes={processes}, exact={exact}: "
              f"shares {[round(r['share'], 4) for r in lines]}", flush=True)
        results += lines
    return results


def child(layout: str, workers: int, exact: bool) -> None:
    import numpy as np  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import time_fit  # pylint: disable=import-outside-toplevel

    cluster = tf_psx.LocalCluster(num_workers=workers, num_ps=2, processes=True).start()
    strategy = tf_psx.ParameterServerStrategy(cluster, "fixed:2", exact_updates=exact)
    sizes = [min(c, CAP) for c in CARDINALITIES]
    with strategy.scope():
        cat = tf.keras.Input((NUM_CAT,), dtype=tf.int64, name="cat")
        dense = tf.keras.Input((NUM_DENSE,), name="dense_features")
        if layout == "sharded":
            columns = tf.unstack(cat, axis=1)
            embs = [tf_psx.layers.ShardedEmbedding(n, DIM, name=f"C{i + 1}")(c) for i, (n, c) in enumerate(zip(sizes, columns))]
            linear = [tf_psx.layers.ShardedEmbedding(n, 1, name=f"C{i + 1}_w")(c) for i, (n, c) in enumerate(zip(sizes, columns))]
            fields = tf.stack(embs, axis=1)  # [batch, 26, dim]
            first_order = tf.add_n(linear)
        else:
            # One hash table for every field: the field id in the high bits of the key.
            keys = cat + tf.constant(np.arange(NUM_CAT, dtype=np.int64) << 40)
            fields = tf_psx.layers.DynamicEmbedding(DIM, name="fields")(keys)
            first_order = tf.reduce_sum(tf_psx.layers.DynamicEmbedding(1, name="fields_w")(keys), axis=1)
        summed = tf.reduce_sum(fields, axis=1)
        fm = 0.5 * tf.reduce_sum(summed * summed - tf.reduce_sum(fields * fields, axis=1), axis=1, keepdims=True)
        hidden = tf.concat([tf.reshape(fields, [-1, NUM_CAT * DIM]), dense], axis=1)
        for units in HIDDEN:
            hidden = tf.keras.layers.Dense(units, activation="relu")(hidden)
        logit = tf.keras.layers.Dense(1)(hidden) + fm + first_order
        model = tf.keras.Model({"cat": cat, "dense_features": dense}, tf.keras.layers.Activation("sigmoid")(logit))
        model.compile(tf.keras.optimizers.Adagrad(0.01), "binary_crossentropy")
    rng = np.random.default_rng(0)
    rows = BATCH * 16
    ids = np.stack([(rng.zipf(ZIPF, rows) - 1) % n for n in sizes], axis=1).astype(np.int64)
    dense_values = rng.random((rows, NUM_DENSE), dtype=np.float32)
    labels = (rng.random(rows) < 0.25).astype(np.float32)

    def dataset_fn(_ctx):
        data = tf.data.Dataset.from_tensor_slices(({"cat": ids, "dense_features": dense_values}, labels))
        return data.repeat().batch(BATCH).prefetch(2)

    ms = time_fit(model, dataset_fn, WARMUP_STEPS, TIMED_STEPS)
    cluster.stop()
    print(json.dumps({"ms_per_step": ms}), flush=True)
    os._exit(0)  # pylint: disable=protected-access


def cost() -> tuple[list[dict], dict]:
    from _common import run_child  # pylint: disable=import-outside-toplevel

    samples: dict = {}
    for round_index in range(ROUNDS):
        for layout in COST_LAYOUTS:
            for workers in COST_WORKERS:
                order = (True, False) if round_index % 2 == 0 else (False, True)
                for exact in order:
                    key = f"{layout}/{workers}w/{'exact' if exact else 'before'}"
                    ms = run_child(__file__, layout, str(workers), str(int(exact)))["ms_per_step"]
                    samples.setdefault(key, []).append(ms)
                    print(f"{key}: {ms:.1f} ms/step", flush=True)
    rows = []
    for layout in COST_LAYOUTS:
        for workers in COST_WORKERS:
            exact = statistics.median(samples[f"{layout}/{workers}w/exact"])
            before = statistics.median(samples[f"{layout}/{workers}w/before"])
            ratio = exact / before
            rows.append({"metric": f"DeepFM {layout}, {workers} workers: ms/step exact / before",
                         "value": round(ratio, 3), "target": f"<= {COST_TARGET}", "ok": ratio <= COST_TARGET})
            rows.append({"metric": f"DeepFM {layout}, {workers} workers: ms/step exact, before",
                         "value": f"{exact:.1f}, {before:.1f}", "unit": "ms"})
    return rows, samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=3, metavar=("LAYOUT", "WORKERS", "EXACT"))
    parser.add_argument("--skip-grid", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), bool(int(args.child[2])))
        return
    from _common import write_result  # pylint: disable=import-outside-toplevel

    start = time.monotonic()
    rows: list[dict] = []
    grid = [] if args.skip_grid else closed_form_grid()
    for exact in (True, False):
        for workers in (1, 2, 3):
            for processes in (False, True):
                for layer in LAYERS:
                    picked = [r for r in grid if r["exact_updates"] == exact and r["workers"] == workers
                              and r["processes"] == processes and r["layer"] == layer]
                    if not picked:
                        continue
                    worst = max(picked, key=lambda r: abs(r["share"] - 1))
                    error = max(r["max_row_error"] for r in picked)
                    mode = "task processes" if processes else "in-process"
                    label = "exact" if exact else "before (exact_updates=False)"
                    shares = ", ".join(f"{r['optimizer']} {r['share']:.4f}" for r in picked)
                    rows.append({
                        "metric": f"{label}, {layer}, {workers} worker(s), {mode}: share of the true move ({shares})",
                        "value": round(worst["share"], 4),
                        "target": "1.0000" if exact else "-",
                        "ok": (abs(worst["share"] - 1) <= TOLERANCE and error <= TOLERANCE) if exact else None,
                    })
    cost_rows, samples = ([], {}) if args.skip_cost else cost()
    rows += cost_rows
    write_result(
        "exact_updates",
        "Closed-form share of the true update (worst optimizer per row, all listed) for every layer x optimizer x "
        "workers x cluster mode, and the ms/step cost of the per-variable locks on a 26-feature DeepFM-like model "
        "(batch 512, Adagrad, 2 ps task processes; exact_updates=True against False).",
        rows,
        {"closed_form": grid, "cost_samples": samples, "seconds": round(time.monotonic() - start)},
    )


if __name__ == "__main__":
    main()
