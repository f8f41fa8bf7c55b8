"""ms/step at 10k rows against 2M rows, per optimizer: does the cost follow the table?

Setup (issue 3): LocalCluster with 1 worker and 2 ps (in-process), the
embedding split fixed:2, batch 256 x 8 ids, dim 32, `model.fit` with
steps_per_execution=1. Both sizes run in one process (one model each on
one cluster), their timed windows interleaved (bench/_common.py
time_fits_paired: a size's number is its fastest window); the process's
ratio is 2M over 10k. A round runs every optimizer's process once, in a
fresh process each, the order rotated and the size built first alternating
from round to round; the ratios are reported as median and spread
(min-max), judged only when the spread is on one side of the target. Target: ratio 2M / 10k <= 1.2 for every optimizer that
tf_psx recommends for embeddings (tf_psx.optimizers.LazyAdam and SGD,
tf-keras Adagrad). Stock tf-keras Adam and SGD are the baseline; a 2M-row
step of theirs takes seconds, so they run only with `--with-stock` (one
round), and otherwise their rows are kept from the last result file with
that run's date.

`python bench/vocab_scaling.py [--rounds N] [--with-stock]`.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SMALL_ROWS, LARGE_ROWS = 10_000, 2_000_000
ROUNDS = 4
DIM, IDS_PER_EXAMPLE, BATCH = 32, 8, 256
WARMUP_STEPS = 20
TIMED_STEPS = 100  # per window; PAIRED_WINDOWS windows per size, the fastest counts
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


def _model(tf, tf_psx, strategy, name: str, rows: int):
    """The benchmark's model at `rows` rows, compiled with optimizer `name`, and its dataset_fn."""
    import numpy as np  # pylint: disable=import-outside-toplevel

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

    return model, dataset_fn


def child(name: str, first: str) -> None:
    """Times fit of both table sizes in one process, windows interleaved (`first`: the size built first).

    A stock optimizer (whose 2M-row step takes seconds) times one size per
    process instead: `first` is then "only:<rows>".
    """
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import WINDOWS, time_fit_cpu, time_fits_paired  # pylint: disable=import-outside-toplevel

    cluster = tf_psx.LocalCluster(num_workers=1, num_ps=2).start()
    strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
    pids = {"process": os.getpid()}
    if first.startswith("only:"):
        model, dataset_fn = _model(tf, tf_psx, strategy, name, int(first[len("only:"):]))
        ms, cpu, windows = time_fit_cpu(model, dataset_fn, WARMUP_STEPS, TIMED_STEPS, pids, windows=WINDOWS)
        print(json.dumps({"ms_per_step": ms, "cpu_ms_per_step": cpu["process"], "windows_ms": windows}), flush=True)
        os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)
    sizes = [SMALL_ROWS, LARGE_ROWS] if int(first) == SMALL_ROWS else [LARGE_ROWS, SMALL_ROWS]
    fits = {str(rows): _model(tf, tf_psx, strategy, name, rows) for rows in sizes}
    timed = time_fits_paired(fits, WARMUP_STEPS, TIMED_STEPS, pids)
    out = {f"{key}_{rows}": (value["process"] if key == "cpu_ms_per_step" else value)
           for rows, result in timed.items() for key, value in result.items()}
    out["ratio"] = timed[str(LARGE_ROWS)]["ms_per_step"] / timed[str(SMALL_ROWS)]["ms_per_step"]
    print(json.dumps(out), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)


def main() -> None:
    import argparse  # pylint: disable=import-outside-toplevel

    from _common import (  # pylint: disable=import-outside-toplevel
        PAIRED_WINDOWS, interleaved, kept_rows, ratio_row, spread_text, write_result)

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--with-stock", action="store_true")
    args = parser.parse_args()
    recommended = [name for name, (yes, _) in OPTIMIZERS.items() if yes]
    # A round: every optimizer's process once; the size built first alternates from round to round.
    runs = interleaved(__file__, [(name,) for name in recommended], args.rounds,
                       round_args=lambda index: (SMALL_ROWS if index % 2 == 0 else LARGE_ROWS,))
    rows_out = []
    for name in recommended:
        done = runs[(name,)]
        row = ratio_row(f"{name}: ms/step 2M / 10k rows", [run["ratio"] for run in done], TARGET,
                        higher_is_better=False)
        row["value"] += "; ms/step " + "; ".join(
            f"{rows // 1000}k {spread_text([run[f'ms_per_step_{rows}'] for run in done])}" for rows in (SMALL_ROWS, LARGE_ROWS))
        row["value"] += "; CPU ms/step " + "; ".join(
            f"{rows // 1000}k {spread_text([run[f'cpu_ms_per_step_{rows}'] for run in done])}"
            for rows in (SMALL_ROWS, LARGE_ROWS))
        rows_out.append(row)
    stock = [name for name, (yes, _) in OPTIMIZERS.items() if not yes]
    if args.with_stock:
        base = interleaved(__file__, [(name, f"only:{rows}") for name in stock for rows in (SMALL_ROWS, LARGE_ROWS)], 1)
        for name in stock:
            small = base[(name, f"only:{SMALL_ROWS}")][0]["ms_per_step"]
            large = base[(name, f"only:{LARGE_ROWS}")][0]["ms_per_step"]
            rows_out.append({"metric": f"{name}: ms/step 2M / 10k rows", "target": "baseline", "ok": None,
                             "value": f"{large / small:.1f}x ({small:.1f} -> {large:.1f} ms/step, one round)"})
    else:
        rows_out += kept_rows("vocab_scaling", rows_out)  # the stock baselines, with their run's date
    write_result(
        "vocab_scaling",
        f"`model.fit` ms/step at {SMALL_ROWS} and {LARGE_ROWS} rows, both sizes in one process (one model each on "
        f"one cluster), their windows interleaved: {PAIRED_WINDOWS} windows of {TIMED_STEPS} steps each after "
        f"{WARMUP_STEPS} warm-up steps, the order reversed every window, a size's number its fastest window "
        f"(bench/_common.py time_fits_paired); the ratio 2M / 10k per process; {args.rounds} rounds of fresh "
        "processes (the size built first alternating), median and spread (min-max); steps_per_execution=1; "
        f"in-process LocalCluster with 1 worker and 2 ps, Embedding split fixed:2, batch {BATCH} x "
        f"{IDS_PER_EXAMPLE} ids, dim {DIM}, mean pooling + Dense(1). CPU ms/step is the one process's "
        "(coordinator and in-process servers), over the fastest window.",
        rows_out,
        extra={" ".join(map(str, key)): value for key, value in runs.items()},
    )


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 2)
