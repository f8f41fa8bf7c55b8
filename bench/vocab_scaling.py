"""ms/step at 10k rows against 2M rows, per optimizer: does the cost follow the table?

Setup (issue 3): LocalCluster with 1 worker and 2 ps (in-process), the
embedding split fixed:2, batch 256 x 8 ids, dim 32, `model.fit` with
steps_per_execution=1. Each (optimizer, rows) pair runs in a fresh process;
the rounds alternate the order of the two sizes. Target: ratio 2M / 10k
<= 1.2 for every optimizer that tf_psx recommends for embeddings
(tf_psx.optimizers.LazyAdam and SGD, tf-keras Adagrad); stock tf-keras Adam
and SGD are the baseline.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SMALL_ROWS, LARGE_ROWS = 10_000, 2_000_000
DIM, IDS_PER_EXAMPLE, BATCH = 32, 8, 256
WARMUP_STEPS = 20
TIMED_STEPS = 60
ROUNDS = 2
TARGET = 1.2
# name -> (recommended for embeddings, builder source evaluated in the child)
OPTIMIZERS = {
    "tf_psx LazyAdam": (True, "tf_psx.optimizers.LazyAdam(0.001)"),
    "tf_psx SGD": (True, "tf_psx.optimizers.SGD(0.05)"),
    "tf_psx SGD momentum 0.9": (True, "tf_psx.optimizers.SGD(0.05, momentum=0.9)"),
    "tf-keras Adagrad": (True, "tf.keras.optimizers.Adagrad(0.05)"),
    "stock tf-keras Adam": (False, "tf.keras.optimizers.Adam(0.001)"),
    "stock tf-keras SGD": (False, "tf.keras.optimizers.SGD(0.05)"),
}


def child(name: str, rows: str) -> None:
    """Times fit on one (optimizer, rows) pair; prints {"ms_per_step": ...}."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import time_fit  # pylint: disable=import-outside-toplevel

    rows = int(rows)
    cluster = tf_psx.LocalCluster(num_workers=1, num_ps=2).start()
    strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
    with strategy.scope():
        inputs = tf.keras.Input((IDS_PER_EXAMPLE,), dtype=tf.int64)
        emb = tf.keras.layers.Embedding(rows, DIM)(inputs)
        pooled = tf.keras.layers.GlobalAveragePooling1D()(emb)
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(pooled))
        model.compile(eval(OPTIMIZERS[name][1], {"tf": tf, "tf_psx": tf_psx}), "binary_crossentropy")  # pylint: disable=eval-used
    rng = np.random.default_rng(0)
    ids = rng.integers(0, rows, size=(BATCH * 32, IDS_PER_EXAMPLE))
    labels = (ids[:, 0] % 2).astype(np.float32)

    def dataset_fn(_):
        return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH).prefetch(2)

    ms = time_fit(model, dataset_fn, WARMUP_STEPS, TIMED_STEPS)
    print(json.dumps({"ms_per_step": ms}), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)


def main() -> None:
    from _common import run_child, write_result  # pylint: disable=import-outside-toplevel

    times: dict[str, dict[int, list[float]]] = {name: {SMALL_ROWS: [], LARGE_ROWS: []} for name in OPTIMIZERS}
    for round_index in range(ROUNDS):
        sizes = [SMALL_ROWS, LARGE_ROWS] if round_index % 2 == 0 else [LARGE_ROWS, SMALL_ROWS]
        for name in OPTIMIZERS:
            for rows in sizes:
                ms = run_child(__file__, name, str(rows))["ms_per_step"]
                times[name][rows].append(ms)
                print(f"round {round_index + 1}/{ROUNDS} {name} {rows} rows: {ms:.1f} ms/step", flush=True)
    rows_out = []
    for name, (recommended, _) in OPTIMIZERS.items():
        small, large = (statistics.median(times[name][r]) for r in (SMALL_ROWS, LARGE_ROWS))
        ratio = large / small
        print(f"{name}: {small:.1f} -> {large:.1f} ms/step, ratio {ratio:.2f}")
        rows_out.append({
            "metric": f"{name}: ms/step 10k -> 2M rows (ratio)",
            "value": f"{small:.1f} -> {large:.1f} ({ratio:.2f}x)",
            "target": f"<= {TARGET}x" if recommended else "baseline",
            "ok": (ratio <= TARGET) if recommended else None,
        })
    write_result(
        "vocab_scaling",
        f"`model.fit` ms/step at {SMALL_ROWS} and {LARGE_ROWS} rows, median of {ROUNDS} fresh processes each "
        f"({TIMED_STEPS} timed steps after {WARMUP_STEPS} warm-up steps, the size order alternating by round); "
        f"in-process LocalCluster with 1 worker and 2 ps, Embedding split fixed:2, batch {BATCH} x "
        f"{IDS_PER_EXAMPLE} ids, dim {DIM}, mean pooling + Dense(1).",
        rows_out,
        extra={"ms_per_step": {name: {str(r): v for r, v in t.items()} for name, t in times.items()}},
    )


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()
