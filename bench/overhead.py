"""Steps/s of tf_psx.ParameterServerStrategy against TF's own, same cluster and model.

One LocalCluster (2 workers, 2 ps, task processes) serves every round. Each
round runs a fresh coordinator process per strategy, in ABBA order, with the
same model and data. A fresh process per measurement matters: measured here,
two strategies in one process are not comparable, because whichever is built
first runs about 30 % slower, whichever it is. Target: tf_psx / raw >= 0.98.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROWS, DIM, FIELDS, BATCH = 100_000, 16, 8, 256
WARMUP_STEPS = 40
STEPS_PER_ROUND = 300
ROUNDS = 6
TARGET = 0.98


def child(name: str, cluster_json: str) -> None:
    """Builds the model under one strategy, warms up, prints steps/s as JSON."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    config = tf_psx.ClusterConfig.from_tf_config(cluster_json)
    partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
    if name == "tf_psx":
        strategy = tf_psx.ParameterServerStrategy(config, partitioner=partitioner)
    else:
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(config.cluster_spec(), rpc_layer="grpc")
        strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    with strategy.scope():
        inputs = tf.keras.Input((FIELDS,), dtype=tf.int64)
        emb = tf.keras.layers.Embedding(ROWS, DIM)(inputs)
        hidden = tf.keras.layers.Dense(32, activation="relu")(tf.keras.layers.Flatten()(emb))
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(hidden))
        model.compile(tf.keras.optimizers.Adagrad(0.05), "binary_crossentropy")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, size=(BATCH * 64, FIELDS))
    labels = (ids[:, 0] % 2).astype(np.float32)

    def dataset_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH).prefetch(2)

    data = tf.keras.utils.experimental.DatasetCreator(dataset_fn)
    model.fit(data, epochs=1, steps_per_epoch=WARMUP_STEPS, verbose=0)
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=STEPS_PER_ROUND, verbose=0)
    rate = STEPS_PER_ROUND / (time.perf_counter() - start)
    print(json.dumps({"name": name, "steps_per_s": rate}), flush=True)
    os._exit(0)  # pylint: disable=protected-access


def main() -> None:
    import tf_psx  # pylint: disable=import-outside-toplevel

    from _common import run_child, write_result  # pylint: disable=import-outside-toplevel

    rates: dict[str, list[float]] = {"tf_psx": [], "raw_tf": []}
    with tf_psx.LocalCluster(num_workers=2, num_ps=2, processes=True) as cluster:
        cluster_json = json.dumps({"cluster": cluster.config.as_dict()})
        for round_index in range(ROUNDS):
            order = ["tf_psx", "raw_tf"] if round_index % 2 == 0 else ["raw_tf", "tf_psx"]
            for name in order:
                rate = run_child(__file__, name, cluster_json)["steps_per_s"]
                rates[name].append(rate)
                print(f"round {round_index + 1}/{ROUNDS} {name}: {rate:.1f} steps/s", flush=True)
    med = {name: statistics.median(r) for name, r in rates.items()}
    ratio = med["tf_psx"] / med["raw_tf"]
    print(f"median steps/s tf_psx {med['tf_psx']:.1f}  raw TF {med['raw_tf']:.1f}  ratio {ratio:.3f}")
    write_result(
        "overhead",
        f"`model.fit` steps/s, median of {ROUNDS} rounds (ABBA order, a fresh coordinator process each, "
        f"{STEPS_PER_ROUND} timed steps after {WARMUP_STEPS} warm-up steps); one LocalCluster of task processes "
        f"with 2 workers and 2 ps; Embedding {ROWS}x{DIM} over {FIELDS} fields (fixed:2) + MLP, batch {BATCH}, "
        "Adagrad, steps_per_execution=1.",
        [
            {"metric": "tf_psx steps/s (median)", "value": round(med["tf_psx"], 2)},
            {"metric": "raw TF steps/s (median)", "value": round(med["raw_tf"], 2)},
            {"metric": "tf_psx steps/s range", "value": f"{min(rates['tf_psx']):.1f} to {max(rates['tf_psx']):.1f}"},
            {"metric": "raw TF steps/s range", "value": f"{min(rates['raw_tf']):.1f} to {max(rates['raw_tf']):.1f}"},
            {"metric": "ratio tf_psx / raw TF", "value": round(ratio, 4), "target": f">= {TARGET}", "ok": ratio >= TARGET},
        ],
        extra={"rates": rates},
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
