"""ms/step of DynamicEmbedding (TFRA hash tables) against ShardedEmbedding, same model, 1 and 2 workers.

Setup: in-process LocalCluster with 1 or 2 workers and 2 ps, batch 256 x 8
ids per worker step drawn uniformly from 100k ids, dim 32, mean pooling +
Dense(1), Adam (tf_psx.optimizers.LazyAdam for the static table; TFRA wraps
tf-keras Adam for the hash table, which is sparse by construction).
ShardedEmbedding is split fixed:2; DynamicEmbedding puts one hash table on
each ps. "DynamicEmbedding+policy" adds admission and eviction: min_count=2,
max_rows=50_000 and TableEviction every 100 steps (so rows are evicted
during the timed steps). Each variant runs in fresh processes, in
alternating order over the rounds; ms/step is wall time per step of the
whole cluster. Target (issue: hash tables for production): dynamic / static
<= 1.3 with the policy off.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NUM_IDS, DIM, IDS_PER_EXAMPLE, BATCH = 100_000, 32, 8, 256
WARMUP_STEPS = 20
TIMED_STEPS = 200
ROUNDS = 2
LAYERS = ("ShardedEmbedding", "DynamicEmbedding", "DynamicEmbedding+policy")
WORKERS = (1, 2)
TARGET = 1.3


def child(name: str, workers: str) -> None:
    import numpy as np  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import time_fit  # pylint: disable=import-outside-toplevel

    cluster = tf_psx.LocalCluster(num_workers=int(workers), num_ps=2).start()
    strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
    callbacks = None
    with strategy.scope():
        inputs = tf.keras.Input((IDS_PER_EXAMPLE,), dtype=tf.int64)
        if name == "ShardedEmbedding":
            emb = tf_psx.layers.ShardedEmbedding(NUM_IDS, DIM)(inputs)
            optimizer = tf_psx.optimizers.LazyAdam(0.001)
        elif name == "DynamicEmbedding":
            emb = tf_psx.layers.DynamicEmbedding(DIM)(inputs)
            optimizer = tf.keras.optimizers.Adam(0.001)
        else:
            emb = tf_psx.layers.DynamicEmbedding(DIM, min_count=2, max_rows=50_000)(inputs)
            optimizer = tf.keras.optimizers.Adam(0.001)
            callbacks = [tf_psx.callbacks.TableEviction(every_n_steps=100)]
        pooled = tf.keras.layers.GlobalAveragePooling1D()(emb)
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(pooled))
        model.compile(optimizer, "binary_crossentropy")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, NUM_IDS, size=(BATCH * 32, IDS_PER_EXAMPLE))
    labels = (ids[:, 0] % 2).astype(np.float32)

    def dataset_fn(_):
        return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH).prefetch(2)

    ms = time_fit(model, dataset_fn, WARMUP_STEPS, TIMED_STEPS, callbacks=callbacks)
    print(json.dumps({"ms_per_step": ms}), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)


def main() -> None:
    from _common import run_child, write_result  # pylint: disable=import-outside-toplevel

    times: dict[str, list[float]] = {f"{name} {w}w": [] for w in WORKERS for name in LAYERS}
    for round_index in range(ROUNDS):
        for workers in WORKERS:
            for name in LAYERS if round_index % 2 == 0 else LAYERS[::-1]:
                ms = run_child(__file__, name, str(workers))["ms_per_step"]
                times[f"{name} {workers}w"].append(ms)
                print(f"round {round_index + 1}/{ROUNDS} {name} {workers}w: {ms:.1f} ms/step", flush=True)
    med = {key: statistics.median(t) for key, t in times.items()}
    rows = []
    for workers in WORKERS:
        static, dynamic, policy = (med[f"{name} {workers}w"] for name in LAYERS)
        ratio = dynamic / static
        rows += [
            {"metric": f"{workers} worker(s): ShardedEmbedding ms/step", "value": round(static, 2), "unit": "ms"},
            {"metric": f"{workers} worker(s): DynamicEmbedding ms/step", "value": round(dynamic, 2), "unit": "ms"},
            {"metric": f"{workers} worker(s): DynamicEmbedding / ShardedEmbedding", "value": round(ratio, 3),
             "target": f"<= {TARGET}", "ok": ratio <= TARGET},
            {"metric": f"{workers} worker(s): with min_count=2, max_rows=50k, eviction every 100 steps / without",
             "value": round(policy / dynamic, 3)},
        ]
    print(json.dumps(med))
    write_result(
        "dynamic_vs_static",
        f"`model.fit` ms/step (whole cluster), median of {ROUNDS} fresh processes each ({TIMED_STEPS} timed steps "
        f"after {WARMUP_STEPS} warm-up steps); in-process LocalCluster with 1 or 2 workers and 2 ps; batch {BATCH} x "
        f"{IDS_PER_EXAMPLE} ids per worker step, uniform over {NUM_IDS:,}, dim {DIM}, mean pooling + Dense(1); "
        "ShardedEmbedding (fixed:2, LazyAdam) against DynamicEmbedding (a TFRA table per ps, Adam), and "
        "DynamicEmbedding with min_count=2, max_rows=50,000 and TableEviction every 100 steps.",
        rows,
        extra={"ms_per_step": times},
    )


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 2)
