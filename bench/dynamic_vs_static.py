"""ms/step of DynamicEmbedding (TFRA hash tables) against ShardedEmbedding, same model.

Setup: in-process LocalCluster with 1 worker and 2 ps, batch 256 x 8 ids
drawn uniformly from 100k ids, dim 32, mean pooling + Dense(1), Adam
(tf_psx.optimizers.LazyAdam for the static table; TFRA wraps tf-keras Adam
for the hash table, which is sparse by construction). ShardedEmbedding is
split fixed:2; DynamicEmbedding puts one hash table on each ps. Each layer
runs in fresh processes, in ABAB... order over the rounds. No target: this
is the price of not knowing the vocabulary in advance.
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
TIMED_STEPS = 100
ROUNDS = 2
LAYERS = ("ShardedEmbedding", "DynamicEmbedding")


def child(name: str) -> None:
    import numpy as np  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import time_fit  # pylint: disable=import-outside-toplevel

    cluster = tf_psx.LocalCluster(num_workers=1, num_ps=2).start()
    strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
    with strategy.scope():
        inputs = tf.keras.Input((IDS_PER_EXAMPLE,), dtype=tf.int64)
        if name == "ShardedEmbedding":
            emb = tf_psx.layers.ShardedEmbedding(NUM_IDS, DIM)(inputs)
            optimizer = tf_psx.optimizers.LazyAdam(0.001)
        else:
            emb = tf_psx.layers.DynamicEmbedding(DIM)(inputs)
            optimizer = tf.keras.optimizers.Adam(0.001)
        pooled = tf.keras.layers.GlobalAveragePooling1D()(emb)
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(pooled))
        model.compile(optimizer, "binary_crossentropy")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, NUM_IDS, size=(BATCH * 32, IDS_PER_EXAMPLE))
    labels = (ids[:, 0] % 2).astype(np.float32)

    def dataset_fn(_):
        return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH).prefetch(2)

    print(json.dumps({"ms_per_step": time_fit(model, dataset_fn, WARMUP_STEPS, TIMED_STEPS)}), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)


def main() -> None:
    from _common import run_child, write_result  # pylint: disable=import-outside-toplevel

    times: dict[str, list[float]] = {name: [] for name in LAYERS}
    for round_index in range(ROUNDS):
        for name in LAYERS if round_index % 2 == 0 else LAYERS[::-1]:
            ms = run_child(__file__, name)["ms_per_step"]
            times[name].append(ms)
            print(f"round {round_index + 1}/{ROUNDS} {name}: {ms:.1f} ms/step", flush=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = med["DynamicEmbedding"] / med["ShardedEmbedding"]
    print(f"median ms/step {med}, ratio {ratio:.2f}")
    write_result(
        "dynamic_vs_static",
        f"`model.fit` ms/step, median of {ROUNDS} fresh processes each ({TIMED_STEPS} timed steps after "
        f"{WARMUP_STEPS} warm-up steps); in-process LocalCluster with 1 worker and 2 ps; batch {BATCH} x "
        f"{IDS_PER_EXAMPLE} ids uniform over {NUM_IDS}, dim {DIM}, mean pooling + Dense(1); "
        "ShardedEmbedding (fixed:2, LazyAdam) against DynamicEmbedding (a TFRA table per ps, Adam).",
        [
            {"metric": "ShardedEmbedding ms/step", "value": round(med["ShardedEmbedding"], 2), "unit": "ms"},
            {"metric": "DynamicEmbedding ms/step", "value": round(med["DynamicEmbedding"], 2), "unit": "ms"},
            {"metric": "DynamicEmbedding / ShardedEmbedding", "value": round(ratio, 3)},
        ],
        extra={"ms_per_step": times},
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
