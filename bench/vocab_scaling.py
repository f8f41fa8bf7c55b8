"""ms/step at 10k rows against 2M rows, per optimizer: does the cost follow the table?

Setup (issue 3): LocalCluster with 1 worker and 2 ps (in-process), the
embedding split fixed:2, batch 256 x 8 ids, dim 32, `model.fit` with
steps_per_execution=1. The interleaved method of bench/_common.py: every
(optimizer, rows) pair runs once per round in a fresh process, the order
rotated each round; a round's ratio is its 2M run over its 10k run, reported
as median and spread (min-max), judged only when the spread is on one side
of the target. Target: ratio 2M / 10k <= 1.2 for every optimizer that
tf_psx recommends for embeddings (tf_psx.optimizers.LazyAdam and SGD,
tf-keras Adagrad). Stock tf-keras Adam and SGD are the baseline; a 2M-row
step of theirs takes seconds, so they run only with `--with-stock` (one
round), and otherwise their rows are kept from the last result file with
that run's date.

`python bench/vocab_scaling.py [--rounds N] [--with-stock] [--more]` (`--more`: N rounds added to the last result's).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SMALL_ROWS, LARGE_ROWS = 10_000, 2_000_000
DIM, IDS_PER_EXAMPLE, BATCH = 32, 8, 256
WARMUP_STEPS = 20
TIMED_STEPS = 100  # per window; WINDOWS windows per child, the fastest counts
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

    from _common import WINDOWS, time_fit_cpu  # pylint: disable=import-outside-toplevel

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

    ms, cpu, windows = time_fit_cpu(model, dataset_fn, WARMUP_STEPS, TIMED_STEPS, {"process": os.getpid()},
                                    windows=WINDOWS)
    print(json.dumps({"ms_per_step": ms, "cpu_ms_per_step": cpu["process"], "windows_ms": windows}), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)


def main() -> None:
    import argparse  # pylint: disable=import-outside-toplevel

    from _common import (  # pylint: disable=import-outside-toplevel
        ROUNDS, interleaved, kept_rows, per_round, ratio_row, ratios, saved_runs, spread_text, write_result)

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--with-stock", action="store_true")
    parser.add_argument("--more", action="store_true", help="add --rounds rounds to the last result's runs")
    args = parser.parse_args()
    recommended = [name for name, (yes, _) in OPTIMIZERS.items() if yes]
    runs = interleaved(__file__, [(name, rows) for name in recommended for rows in (SMALL_ROWS, LARGE_ROWS)],
                       args.rounds)
    if args.more:
        for key, earlier in saved_runs("vocab_scaling", 2).items():
            runs[key] = earlier + runs[key]
    args.rounds = len(runs[(recommended[0], SMALL_ROWS)])
    rows_out = []
    for name in recommended:
        small, large = runs[(name, SMALL_ROWS)], runs[(name, LARGE_ROWS)]
        row = ratio_row(f"{name}: ms/step 2M / 10k rows", ratios(large, small, "ms_per_step"), TARGET,
                        higher_is_better=False)
        row["value"] += (f"; ms/step {spread_text(per_round(small, 'ms_per_step'))} -> "
                         f"{spread_text(per_round(large, 'ms_per_step'))}; CPU ms/step "
                         f"{spread_text(per_round(small, 'cpu_ms_per_step'))} -> "
                         f"{spread_text(per_round(large, 'cpu_ms_per_step'))}")
        rows_out.append(row)
    stock = [name for name, (yes, _) in OPTIMIZERS.items() if not yes]
    if args.with_stock:
        base = interleaved(__file__, [(name, rows) for name in stock for rows in (SMALL_ROWS, LARGE_ROWS)], 1)
        for name in stock:
            small, large = base[(name, SMALL_ROWS)][0]["ms_per_step"], base[(name, LARGE_ROWS)][0]["ms_per_step"]
            rows_out.append({"metric": f"{name}: ms/step 2M / 10k rows", "target": "baseline", "ok": None,
                             "value": f"{large / small:.1f}x ({small:.1f} -> {large:.1f} ms/step, one round)"})
    else:
        rows_out += kept_rows("vocab_scaling", rows_out)  # the stock baselines, with their run's date
    write_result(
        "vocab_scaling",
        f"`model.fit` ms/step at {SMALL_ROWS} and {LARGE_ROWS} rows; {args.rounds} interleaved rounds of fresh "
        f"processes, the ratio 2M / 10k per round, median and spread (min-max) (a child's ms/step: the median of "
        f"5 windows of {TIMED_STEPS} steps after {WARMUP_STEPS} warm-up steps, steps_per_execution=1); in-process LocalCluster with 1 worker and 2 ps, "
        f"Embedding split fixed:2, batch {BATCH} x {IDS_PER_EXAMPLE} ids, dim {DIM}, mean pooling + Dense(1). "
        "CPU ms/step is the one process's (coordinator and in-process servers).",
        rows_out,
        extra={" ".join(map(str, key)): value for key, value in runs.items()},
    )


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 2)
