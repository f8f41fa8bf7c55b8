"""ms/step of DynamicEmbedding (TFRA hash tables) against ShardedEmbedding, same model, 1 and 2 workers.

Setup: in-process LocalCluster with 1 or 2 workers and 2 ps, batch 256 x 8
ids per worker step drawn uniformly from 100k ids, dim 32, mean pooling +
Dense(1), Adam (tf_psx.optimizers.LazyAdam for the static table; TFRA wraps
tf-keras Adam for the hash table, which is sparse by construction).
ShardedEmbedding is split fixed:2; DynamicEmbedding puts one hash table on
each ps. "DynamicEmbedding+policy" adds admission and eviction: min_count=2,
max_rows=50_000 and TableEviction every 100 steps (so rows are evicted
during the timed steps). The interleaved method of bench/_common.py: every
variant runs once per round in a fresh process, the order rotated each
round; each ratio is taken per round and reported as median and spread
(min-max). ms/step is wall time per step of the whole cluster, CPU ms/step
that of the one process (coordinator and in-process servers).
steps_per_execution=1. Target (issue 30): dynamic / static <= 1.3 with the
policy off, judged only when the spread does not straddle it.

`python bench/dynamic_vs_static.py [--rounds N] [--workers 1]`.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NUM_IDS, DIM, IDS_PER_EXAMPLE, BATCH = 100_000, 32, 8, 256
WARMUP_STEPS = 20
TIMED_STEPS = 100  # per window; WINDOWS windows per child, the fastest counts
LAYERS = ("ShardedEmbedding", "DynamicEmbedding", "DynamicEmbedding+policy")
# 1 worker only: TFRA's own apply (exact_updates=False; exact with one worker), to split the hash table's
# cost into TFRA's lookup and shadow buffers and tf_psx's locked update.
TFRA_APPLY = "DynamicEmbedding, TFRA's apply"
WORKERS = (1, 2)
TARGET = 1.3


def child(name: str, workers: str) -> None:
    import numpy as np  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import WINDOWS, time_fit_cpu  # pylint: disable=import-outside-toplevel

    cluster = tf_psx.LocalCluster(num_workers=int(workers), num_ps=2).start()
    strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2", exact_updates=(name != TFRA_APPLY))
    callbacks = None
    with strategy.scope():
        inputs = tf.keras.Input((IDS_PER_EXAMPLE,), dtype=tf.int64)
        if name == "ShardedEmbedding":
            emb = tf_psx.layers.ShardedEmbedding(NUM_IDS, DIM)(inputs)
            optimizer = tf_psx.optimizers.LazyAdam(0.001)
        elif name in ("DynamicEmbedding", TFRA_APPLY):
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

    ms, cpu, windows = time_fit_cpu(model, dataset_fn, WARMUP_STEPS, TIMED_STEPS, {"process": os.getpid()},
                                    callbacks=callbacks, windows=WINDOWS)
    print(json.dumps({"ms_per_step": ms, "cpu_ms_per_step": cpu["process"], "windows_ms": windows}), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)


def main() -> None:
    import argparse  # pylint: disable=import-outside-toplevel

    from _common import ROUNDS, interleaved, per_round, ratio_row, ratios, spread_text, write_result  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--workers", type=int, nargs="*", default=list(WORKERS))
    args = parser.parse_args()
    variants = [(name, workers) for workers in args.workers for name in LAYERS]
    if 1 in args.workers:
        variants.append((TFRA_APPLY, 1))
    runs = interleaved(__file__, variants, args.rounds)
    rows = []
    for workers in args.workers:
        static, dynamic, policy = (runs[(name, workers)] for name in LAYERS)
        for name, results in zip(LAYERS, (static, dynamic, policy)):
            rows.append({"metric": f"{workers} worker(s): {name} ms/step (CPU ms/step)",
                         "value": f"{spread_text(per_round(results, 'ms_per_step'))} "
                                  f"(CPU {spread_text(per_round(results, 'cpu_ms_per_step'))})"})
        rows.append(ratio_row(f"{workers} worker(s): DynamicEmbedding / ShardedEmbedding",
                              ratios(dynamic, static, "ms_per_step"), TARGET, higher_is_better=False))
        rows.append(ratio_row(f"{workers} worker(s): with min_count=2, max_rows=50k, eviction every 100 steps / "
                              "without", ratios(policy, dynamic, "ms_per_step")))
    if (TFRA_APPLY, 1) in runs:
        tfra_apply = runs[(TFRA_APPLY, 1)]
        rows.append({"metric": f"1 worker: {TFRA_APPLY} (exact_updates=False) ms/step (CPU ms/step)",
                     "value": f"{spread_text(per_round(tfra_apply, 'ms_per_step'))} "
                              f"(CPU {spread_text(per_round(tfra_apply, 'cpu_ms_per_step'))})"})
        rows.append(ratio_row(f"1 worker: {TFRA_APPLY} / ShardedEmbedding (TFRA's lookup and shadow buffers, "
                              "without tf_psx's locked update)", ratios(tfra_apply, runs[("ShardedEmbedding", 1)], "ms_per_step")))
    write_result(
        "dynamic_vs_static",
        f"`model.fit` ms/step (whole cluster; a child's: the fastest of 5 windows of {TIMED_STEPS} steps after "
        f"{WARMUP_STEPS} warm-up steps), steps_per_execution=1; {args.rounds} interleaved rounds of fresh processes, ratios per round (median, "
        f"min-max); in-process LocalCluster with 1 or 2 workers and 2 ps; batch {BATCH} x "
        f"{IDS_PER_EXAMPLE} ids per worker step, uniform over {NUM_IDS:,}, dim {DIM}, mean pooling + Dense(1); "
        "ShardedEmbedding (fixed:2, LazyAdam) against DynamicEmbedding (a TFRA table per ps, Adam), and "
        "DynamicEmbedding with min_count=2, max_rows=50,000 and TableEviction every 100 steps.",
        rows,
        extra={" ".join(map(str, key)): value for key, value in runs.items()},
    )


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 2)
