"""Peak memory of a `fit` at 1x and 10x the steps: FiBiNET, DeepFM (DeepCTR 0.9.4) and the quickstart model.

Each run is a fresh process. `cluster`: an in-process `LocalCluster` with 2
workers and 2 ps tasks, `partitioner="fixed:2"`, `fit` on a
`DatasetCreator` (the coordinator, the workers and the ps tasks are all in
this one process, so its peak RSS is the whole cluster's). `local`: the
same model, data and batch with no strategy (`fit` on the same dataset).
`servers`: the in-process cluster and the strategy, no model: the servers'
fixed cost. `tf_cluster`: the cluster run under TF's own
`ParameterServerStrategy` (`FixedShardsPartitioner(2)`, same
`LocalCluster`), the floor that TF itself sets. Peak RSS is the process's `ru_maxrss`.

Targets (the speed issue): 10x the steps <= 1.1x the peak of 1x; a
2-worker in-process fit <= 2x the one-process run plus the servers' fixed
cost (`servers` minus a bare TF import, `baseline`).

DeepCTR's FiBiNET has 13 sparse fields (SENET + bilinear interaction, 383
variables once partitioned in two): its step graph under exact updates held
one control input per gradient tensor of a ps task's unit on every op of
the unit (33.6 MB of graph, 6 GB peak RSS at 5 steps); joined into one
no-op first (tf_psx.training.exact_updates.execute_unordered), 9.2 MB.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import entry, run_child, write_result  # noqa: E402  pylint: disable=wrong-import-position

FIELDS, VOCAB, DIM, BATCH, EXAMPLES = 13, 1000, 4, 256, 8192
BASE_STEPS = {"fibinet": 30, "deepfm": 30, "quickstart": 100}
MODELS = ("fibinet", "deepfm", "quickstart")


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _data():
    import numpy as np  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(0)
    features = {f"C{i}": rng.integers(0, VOCAB, EXAMPLES) for i in range(1, FIELDS + 1)}
    labels = (rng.random(EXAMPLES) < 0.25).astype("float32")
    return features, labels


def _model(name: str):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if name == "quickstart":
        inputs = {f"C{i}": tf.keras.Input((), dtype="int64", name=f"C{i}") for i in range(1, FIELDS + 1)}
        ids = tf.keras.layers.Lambda(lambda d: tf.stack([d[k] for k in sorted(d)], axis=1))(inputs)
        table = tf.keras.layers.Embedding(VOCAB * FIELDS, 8)(ids)
        out = tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Flatten()(table))
        model = tf.keras.Model(inputs, out)
        model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy")
        return model
    from deepctr.feature_column import SparseFeat  # pylint: disable=import-outside-toplevel
    from deepctr.models import DeepFM, FiBiNET  # pylint: disable=import-outside-toplevel

    columns = [SparseFeat(f"C{i}", vocabulary_size=VOCAB, embedding_dim=DIM) for i in range(1, FIELDS + 1)]
    model = (FiBiNET if name == "fibinet" else DeepFM)(columns, columns, task="binary")
    model.compile("adam", "binary_crossentropy")
    return model


def child(model_name: str, mode: str, steps: str) -> None:
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    steps = int(steps)
    features, labels = _data()

    def dataset_fn(_context=None):
        return tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(BATCH)

    started = time.perf_counter()
    if mode == "baseline":
        result = {}
    elif mode == "local":
        model = _model(model_name)
        model.fit(dataset_fn(), epochs=1, steps_per_epoch=steps, verbose=0)
    else:
        with tf_psx.LocalCluster(num_workers=2, num_ps=2) as cluster:
            if mode == "tf_cluster":
                strategy = tf.distribute.experimental.ParameterServerStrategy(
                    cluster.resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
            else:
                strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
            if mode in ("cluster", "tf_cluster"):
                with strategy.scope():
                    model = _model(model_name)
                model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=steps,
                          verbose=0)
    result = {"peak_mb": _peak_mb(), "seconds": time.perf_counter() - started}
    print(json.dumps(result), flush=True)


def main() -> None:
    import argparse  # pylint: disable=import-outside-toplevel

    from _common import saved_raw  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser()
    parser.add_argument("--keep", action="store_true", help="reuse the runs of the last results file; run the rest")
    args = parser.parse_args()
    runs = dict(saved_raw("memory_growth")) if args.keep else {}
    for variant in [("none", "baseline", "0"), ("none", "servers", "0")] + [
            (model, mode, str(BASE_STEPS[model] * factor))
            for model in MODELS for mode in ("local", "cluster", "tf_cluster") for factor in (1, 10)]:
        if "/".join(variant) in runs:
            continue
        result = run_child(__file__, *variant, timeout=1800)
        runs["/".join(variant)] = result
        print(variant, result, flush=True)
    fixed = runs["none/servers/0"]["peak_mb"] - runs["none/baseline/0"]["peak_mb"]
    rows = [{"metric": "servers' fixed cost (2 workers + 2 ps in-process, MB)", "value": round(fixed), "unit": "MB",
             "ok": None}]
    for model in MODELS:
        one, ten = BASE_STEPS[model], BASE_STEPS[model] * 10
        for mode in ("local", "cluster", "tf_cluster"):
            small, large = runs[f"{model}/{mode}/{one}"]["peak_mb"], runs[f"{model}/{mode}/{ten}"]["peak_mb"]
            rows.append({"metric": f"{model} {mode}: peak RSS at {ten} / {one} steps", "value": round(large / small, 3),
                         "target": "<= 1.1", "ok": large / small <= 1.1,
                         "note": f"{small:.0f} MB -> {large:.0f} MB"})
        cluster, local = runs[f"{model}/cluster/{ten}"]["peak_mb"], runs[f"{model}/local/{ten}"]["peak_mb"]
        bound = 2 * local + fixed
        rows.append({"metric": f"{model}: 2-worker in-process fit peak RSS / (2 x one process + servers)",
                     "value": round(cluster / bound, 3), "target": "<= 1.0", "ok": cluster <= bound,
                     "note": f"{cluster:.0f} MB against 2 x {local:.0f} + {fixed:.0f} MB"})
        floor = runs[f"{model}/tf_cluster/{ten}"]["peak_mb"]
        rows.append({"metric": f"{model}: tf_psx / TF's own strategy, 2-worker in-process fit peak RSS",
                     "value": round(cluster / floor, 3), "ok": None, "note": f"{cluster:.0f} MB / {floor:.0f} MB"})
    write_result("memory_growth", f"peak RSS per process of a fit, 1x and 10x the steps; in-process LocalCluster 2 "
                 f"workers 2 ps (fixed:2), DatasetCreator, batch {BATCH}; DeepCTR 0.9.4 FiBiNET/DeepFM ({FIELDS} "
                 f"sparse fields of {VOCAB}, dim {DIM}, Adam), quickstart (Embedding 8 + Dense, Adagrad)", rows, runs)


if __name__ == "__main__":
    entry(child, main, child_args=3)
