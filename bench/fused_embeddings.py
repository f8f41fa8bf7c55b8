"""Examples/s of a Criteo-shaped CTR model: 26 stock Embedding layers against one FeatureEmbeddings.

Model: 26 categorical features with Criteo's cardinalities capped at 500,000
rows (Zipf-distributed ids, numpy zipf(1.1) folded into each vocabulary), 13
dense features, embeddings of dim 16 concatenated with the dense features
into a DeepFM-sized MLP (400-400-400, ReLU) and a sigmoid; Adagrad 0.01,
batch 512 per worker step; LocalCluster with 2 ps task processes and 1 or 2
worker task processes, `tf_psx.ParameterServerStrategy` (exact updates).

* stock: 26 `tf.keras.layers.Embedding` layers, TF's
  `FixedShardsPartitioner(2)` (the way users write it);
* fused: one `tf_psx.layers.FeatureEmbeddings` (2 shards);
* fused + bf16: the same with `wire_dtype="bfloat16"`;
* dynamic: one `tf_psx.layers.DynamicFeatureEmbeddings` (a TFRA hash table
  per ps, feature index folded into the key), 1 worker.

Also, with 1 worker: the embedding stage alone (the embeddings summed into
the logit, no MLP) for 26, 52 and 104 features (the features repeated with
new ids), and the MLP alone (the 26 embeddings replaced by a constant) as the
floor, and the stage's floor: the stage with the 26 embeddings replaced by
a constant (what a `model.fit` step costs here with no embedding at all:
the closure, the input, the head's variables on the ps); the time of the
embeddings is the stage's time above that floor. Value bytes per step:
the embedding values that travel between the worker and the ps per step
(rows read plus gradients sent), counted from the batches (stock: every id of the batch, 4 bytes a value; fused: the distinct
ids of the batch, 4 or 2 bytes a value). Every variant runs in a fresh
process, in two rounds (the second in reverse order); ms/step is the mean
of the rounds, and both are kept in the result's extra fields.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Criteo (Kaggle display advertising) categorical cardinalities, capped.
CRITEO_CARDINALITIES = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
                        14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
CAP = 500_000
DIM, DENSE, BATCH, HIDDEN = 16, 13, 512, (400, 400, 400)
WARMUP_STEPS, TIMED_STEPS = 10, 200
# Every variant runs once per round; round 2 runs them in the reverse order.
ROUNDS = 2
TARGETS = {"stage": 2.5, "whole": 1.5}


def cardinalities(num_features: int) -> list[int]:
    base = [min(c, CAP) for c in CRITEO_CARDINALITIES]
    return (base * (num_features // len(base) + 1))[:num_features]


def batches(num_features: int, steps: int, seed: int = 0):
    import numpy as np  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    cards = cardinalities(num_features)
    n = BATCH * steps
    ids = {f"C{i + 1}": ((rng.zipf(1.1, size=n) - 1) % card).astype(np.int64) for i, card in enumerate(cards)}
    dense = rng.random((n, DENSE)).astype(np.float32)
    labels = (rng.random(n) < 0.25).astype(np.float32)
    return ids, dense, labels


def value_bytes(ids: dict, value_size: int, dedup: bool) -> float:
    """Mean embedding value bytes per step (rows read + gradients sent)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    names = list(ids)
    steps = len(ids[names[0]]) // BATCH
    total = 0
    for step in range(steps):
        part = slice(step * BATCH, (step + 1) * BATCH)
        if dedup:
            offsets = np.cumsum([0] + [int(ids[n].max()) + 1 for n in names[:-1]])
            rows = len(np.unique(np.concatenate([ids[n][part] + o for n, o in zip(names, offsets)])))
        else:
            rows = BATCH * len(names)
        total += 2 * rows * DIM * value_size
    return total / steps


def build(variant: str, num_features: int):
    """The model of `variant` in the current strategy's scope, its dataset_fn and its ids (a dict of arrays)."""
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    cards = cardinalities(num_features)
    names = [f"C{i + 1}" for i in range(num_features)]
    ids, dense, labels = batches(num_features, 64)
    inputs = {name: tf.keras.Input((), dtype=tf.int64, name=name) for name in names}
    inputs["numeric"] = tf.keras.Input((DENSE,), name="numeric")
    if variant.startswith("stock"):
        vectors = [tf.keras.layers.Embedding(card, DIM, name=f"emb_{name}")(inputs[name])
                   for name, card in zip(names, cards)]
    elif variant.startswith("dynamic"):
        layer = tf_psx.layers.DynamicFeatureEmbeddings(names, DIM)
        out = layer({name: inputs[name] for name in names})
        vectors = [out[name] for name in names]
    elif variant.startswith("fused"):
        wire = "bfloat16" if "bf16" in variant else None
        layer = tf_psx.layers.FeatureEmbeddings(dict(zip(names, cards)), DIM, wire_dtype=wire)
        out = layer({name: inputs[name] for name in names})
        vectors = [out[name] for name in names]
    else:  # mlp_only: the embeddings replaced by a constant
        zeros = tf.keras.layers.Lambda(lambda d: tf.zeros([tf.shape(d)[0], DIM]))(inputs["numeric"])
        vectors = [zeros] * num_features
    if variant.endswith("stage"):
        summed = tf.keras.layers.Lambda(lambda v: tf.reduce_sum(tf.add_n(v), axis=1, keepdims=True))(vectors)
        logit = tf.keras.layers.Dense(1)(tf.keras.layers.Concatenate()([summed, inputs["numeric"]]))
    else:
        hidden = tf.keras.layers.Concatenate()(vectors + [inputs["numeric"]])
        for width in HIDDEN:
            hidden = tf.keras.layers.Dense(width, activation="relu")(hidden)
        logit = tf.keras.layers.Dense(1)(hidden)
    model = tf.keras.Model(inputs, tf.keras.layers.Activation("sigmoid")(logit))
    model.compile(tf.keras.optimizers.Adagrad(0.01), "binary_crossentropy")

    def dataset_fn(_ctx):
        features = dict(ids, numeric=dense)
        return tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(BATCH).prefetch(4)

    return model, dataset_fn, ids


def child(variant: str, workers: str, num_features: str) -> None:
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import time_fit_cpu  # pylint: disable=import-outside-toplevel

    cluster = tf_psx.LocalCluster(num_workers=int(workers), num_ps=2, processes=True).start()
    try:
        strategy = tf_psx.ParameterServerStrategy(
            cluster, tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
        with strategy.scope():
            model, dataset_fn, ids = build(variant, int(num_features))
        pids = dict(cluster.task_pids(), coordinator=os.getpid())
        ms, cpu = time_fit_cpu(model, dataset_fn, WARMUP_STEPS, TIMED_STEPS, pids)
    finally:
        cluster.stop()
    moved = 0.0 if variant.startswith("mlp_only") else value_bytes(ids, 2 if "bf16" in variant else 4,
                                                                   dedup=not variant.startswith("stock"))
    print(json.dumps({"ms_per_step": ms, "examples_per_s": 1000.0 * BATCH / ms, "value_bytes_per_step": moved,
                      "cpu_ms_per_step": cpu}), flush=True)


RUNS = [
    ("stock", 1, 26), ("fused", 1, 26), ("fused_bf16", 1, 26), ("mlp_only", 1, 26),
    ("stock", 2, 26), ("fused", 2, 26), ("fused_bf16", 2, 26),
    ("dynamic", 1, 26), ("dynamic_stage", 1, 26),
    ("stock_stage", 1, 26), ("fused_stage", 1, 26), ("mlp_only_stage", 1, 26),
    ("stock_stage", 1, 52), ("fused_stage", 1, 52),
    ("stock_stage", 1, 104), ("fused_stage", 1, 104),
]
IMAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img", "fused_embeddings.png")


def plot(results: dict) -> None:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    fig, axis = plt.subplots(figsize=(6, 3.8))
    for variant in ("stock_stage", "fused_stage"):
        points = sorted((f, r["examples_per_s"]) for (v, w, f), r in results.items() if v == variant)
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=variant.replace("_", " "))
    axis.set_xlabel("categorical features")
    axis.set_ylabel("examples/s (1 worker, 2 ps)")
    axis.set_xticks([26, 52, 104])
    axis.grid(True, alpha=0.3)
    axis.legend()
    axis.set_title("Embedding stage: examples/s against features")
    fig.tight_layout()
    os.makedirs(os.path.dirname(IMAGE), exist_ok=True)
    fig.savefig(IMAGE, dpi=110)


def main() -> None:
    from _common import add_images, run_child, write_result  # pylint: disable=import-outside-toplevel

    rounds: dict = {}
    for index in range(ROUNDS):
        for variant, workers, features in (RUNS if index % 2 == 0 else RUNS[::-1]):
            result = run_child(__file__, variant, str(workers), str(features), timeout=900)
            rounds.setdefault((variant, workers, features), []).append(result)
            print(f"round {index + 1}: {variant} {workers}w {features}f: {result['examples_per_s']:.0f} ex/s "
                  f"({result['ms_per_step']:.1f} ms/step), {result['value_bytes_per_step'] / 1e6:.2f} MB/step",
                  flush=True)
    results = {}
    for key, runs in rounds.items():
        ms = sum(run["ms_per_step"] for run in runs) / len(runs)
        results[key] = {"ms_per_step": ms, "examples_per_s": 1000.0 * BATCH / ms,
                        "value_bytes_per_step": runs[0]["value_bytes_per_step"],
                        "rounds_ms_per_step": [round(run["ms_per_step"], 2) for run in runs],
                        "cpu_ms_per_step": {name: sum(run["cpu_ms_per_step"][name] for run in runs) / len(runs)
                                            for name in runs[0]["cpu_ms_per_step"]}}

    def rate(variant, workers=1, features=26):
        return results[(variant, workers, features)]["examples_per_s"]

    rows = []
    for workers in (1, 2):
        for variant in ("stock", "fused", "fused_bf16"):
            r = results[(variant, workers, 26)]
            rows.append({"metric": f"whole model, {workers} worker(s), {variant}: examples/s", "value": round(r["examples_per_s"])})
        ratio = rate("fused", workers) / rate("stock", workers)
        rows.append({"metric": f"whole model, {workers} worker(s): fused / stock", "value": round(ratio, 3),
                     "target": f">= {TARGETS['whole']}", "ok": ratio >= TARGETS["whole"]})
        rows.append({"metric": f"whole model, {workers} worker(s): fused bf16 / fused",
                     "value": round(rate("fused_bf16", workers) / rate("fused", workers), 3)})
    for scope, suffix in (("whole model", ""), ("embedding stage", "_stage")):
        ratio = rate(f"dynamic{suffix}") / rate(f"stock{suffix}")
        rows.append({"metric": f"{scope}, 1 worker: DynamicFeatureEmbeddings (one hash table) / stock", "value": round(ratio, 3),
                     "target": ">= 1.0", "ok": ratio >= 1.0})
    rows.append({"metric": "MLP alone (embeddings replaced by a constant), 1 worker: examples/s (the floor)",
                 "value": round(rate("mlp_only"))})
    floor = results[("mlp_only_stage", 1, 26)]["ms_per_step"]
    rows.append({"metric": "embedding stage with the embeddings replaced by a constant, 1 worker: examples/s "
                 "(the stage's floor)", "value": round(rate("mlp_only_stage"))})
    above = {v: results[(v, 1, 26)]["ms_per_step"] - floor for v in ("stock_stage", "fused_stage")}
    rows.append({"metric": "embedding stage, 26 features: ms/step above the floor, stock / fused",
                 "value": f"{above['stock_stage']:.1f} / {above['fused_stage']:.1f}"})
    if above["fused_stage"] > 0:
        rows.append({"metric": "embedding stage, 26 features: stock / fused ms/step above the floor",
                     "value": round(above["stock_stage"] / above["fused_stage"], 2)})
    for features in (26, 52, 104):
        ratio = rate("fused_stage", 1, features) / rate("stock_stage", 1, features)
        rows.append({"metric": f"embedding stage, {features} features: stock / fused examples/s",
                     "value": f"{rate('stock_stage', 1, features):.0f} / {rate('fused_stage', 1, features):.0f}"})
        rows.append({"metric": f"embedding stage, {features} features: fused / stock", "value": round(ratio, 3),
                     "target": f">= {TARGETS['stage']}" if features == 26 else None,
                     "ok": ratio >= TARGETS["stage"] if features == 26 else None})
    for variant in ("stock", "fused", "mlp_only", "stock_stage", "fused_stage", "mlp_only_stage"):
        cpu = results[(variant, 1, 26)]["cpu_ms_per_step"]
        ps = sum(value for name, value in cpu.items() if name.startswith("ps"))
        rows.append({"metric": f"where the time goes, {variant} (1 worker, 26 features): CPU ms per step of the "
                     "worker / the 2 ps tasks / the coordinator, against the wall ms per step",
                     "value": f"{cpu['worker:0']:.1f} / {ps:.1f} / {cpu['coordinator']:.1f} (sum "
                              f"{sum(cpu.values()):.1f}) against {results[(variant, 1, 26)]['ms_per_step']:.1f}"})
    stock_bytes = results[("stock", 1, 26)]["value_bytes_per_step"]
    for variant in ("stock", "fused", "fused_bf16"):
        value = results[(variant, 1, 26)]["value_bytes_per_step"]
        rows.append({"metric": f"{variant}: embedding value bytes per step (rows + gradients)",
                     "value": f"{value / 1e6:.3f} MB ({value / stock_bytes:.3f}x stock)"})
    plot(results)
    path = write_result(
        "fused_embeddings",
        f"Criteo-shaped model: 26 categorical features (Criteo cardinalities capped at {CAP:,}; numpy zipf(1.1) ids), "
        f"{DENSE} dense, dim {DIM}, MLP {'-'.join(map(str, HIDDEN))}, Adagrad, batch {BATCH} per worker step; "
        "LocalCluster with 2 ps task processes and 1 or 2 worker task processes; examples/s over "
        f"{TIMED_STEPS} steps after {WARMUP_STEPS} warm-up steps, one fresh process per variant, mean of {ROUNDS} "
        "rounds (the second in reverse order). stock = 26 "
        "tf.keras.layers.Embedding with TF's FixedShardsPartitioner(2); fused = one FeatureEmbeddings. "
        "Embedding stage = the same without the MLP (embeddings summed into the logit); its floor = the stage with "
        "the embeddings replaced by a constant.",
        rows,
        extra={f"{v} {w}w {f}f": r for (v, w, f), r in results.items()},
    )
    add_images(path, ["img/fused_embeddings.png"])


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 3)
