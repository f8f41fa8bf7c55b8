"""ms/step of DynamicEmbedding (its default store) against ShardedEmbedding, same model, 1 and 2 workers.

On the newest stack (no TFRA) DynamicEmbedding is on tf_psx's own tables (`table="native"`); where TFRA is
installed, on TFRA's (and the "one table lock" variant is measured too).

Setup: in-process LocalCluster with 1 or 2 workers and 2 ps, batch 256 x 8
ids per worker step drawn uniformly from 100k ids, dim 32, mean pooling +
Dense(1), Adam (tf_psx.optimizers.LazyAdam for the static table; TFRA wraps
tf-keras Adam for the hash table, which is sparse by construction).
ShardedEmbedding is split fixed:2; DynamicEmbedding puts one hash table on
each ps. steps_per_execution=1.

Paired (the default): ShardedEmbedding, DynamicEmbedding (its exact update
made per shard, on the ps task that owns the shard, under the shard's lock:
tf_psx.tables.tfra_updates) and "DynamicEmbedding, one table lock" (the same traced
with TABLE_UPDATES_PER_SHARD off: the whole table's update on its first ps
task under one lock, as a table with a policy is updated) in one process on one
cluster, one model each, their timed windows interleaved (bench/_common.py
time_fits_paired: a variant's number is its fastest window); one process
per worker count and round, the build order rotated each round; each ratio
taken per round, reported as median and spread (min-max). ms/step is wall
time per step of the whole cluster, CPU ms/step that of the one process
(coordinator and in-process servers).

`--with-singles` also runs, one per process (fastest of WINDOWS windows):
"DynamicEmbedding+policy" (min_count=2, max_rows=50_000, TableEviction
every 100 steps, so rows are evicted during the timed steps) and, with 1
worker, TFRA's own apply (exact_updates=False). Without it their rows are
kept from the run that measured them, dated.

Target (issue 30): dynamic / static <= 1.3, judged only when the spread
does not straddle it.

`--split` also pairs each table with its layer frozen (trainable=False), 1 worker: the
step without the table's update, to split its cost into lookup and update.

`--kernels` also profiles ShardedEmbedding and DynamicEmbedding (1 worker, one process per round, one
model each on one cluster, TIMED_STEPS steps each under TF's profiler after the warm-up): kernel ms per
step by op type, in the optimizer's update and in the rest of the step (bench/_common.py kernel_ms), TFRA's
hash-table kernels summed apart.

`python bench/dynamic_vs_static.py [--rounds N] [--workers 1 2] [--with-singles] [--split] [--kernels]`.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# `--scale ctr` (passed to the children as $TF_PSX_BENCH_SCALE): CTR scale, batch 2048 x 26 ids per example
# uniform over 2M, dim 16; results in bench/results/dynamic_vs_static_ctr.json.
SCALE = os.environ.get("TF_PSX_BENCH_SCALE", "small")
if SCALE == "ctr":
    NUM_IDS, DIM, IDS_PER_EXAMPLE, BATCH = 2_000_000, 16, 26, 2048
else:
    NUM_IDS, DIM, IDS_PER_EXAMPLE, BATCH = 100_000, 32, 8, 256
RESULT = "dynamic_vs_static_ctr" if SCALE == "ctr" else "dynamic_vs_static"
WARMUP_STEPS = 20
TIMED_STEPS = 100  # per window (PAIRED_WINDOWS per variant when paired, WINDOWS alone), the fastest counts
# 1 worker only: TFRA's own apply (exact_updates=False; exact with one worker), to split the hash table's
# cost into TFRA's lookup and shadow buffers and tf_psx's locked update.
TFRA_APPLY = "DynamicEmbedding, TFRA's apply"
WORKERS = (1, 2)
TARGET = 1.3


ONE_LOCK = "DynamicEmbedding, one table lock"


def _tfra_store() -> bool:
    """True where DynamicEmbedding defaults to TFRA's tables (TFRA installed); else it is on tf_psx's own."""
    from tf_psx._tf import tfra  # pylint: disable=import-outside-toplevel

    return tfra.tfra_installed()


# One table lock is a TFRA-store variant (tf_psx's own tables are always updated per shard).
PAIRED = ("ShardedEmbedding", "DynamicEmbedding", ONE_LOCK) if _tfra_store() else ("ShardedEmbedding",
                                                                                      "DynamicEmbedding")
# `--split`: each table also with its layer frozen (trainable=False: the lookup and the rest of the step, no
# update of the table), to split a step into the table's lookup and its update. 1 worker, paired.
FROZEN = " (frozen)"
SPLIT = ("ShardedEmbedding", "ShardedEmbedding" + FROZEN, "DynamicEmbedding", "DynamicEmbedding" + FROZEN)
# `--kernels`: the variants profiled, 1 worker.
KERNELS = ("ShardedEmbedding", "DynamicEmbedding")
TOP_KERNELS = 6


def _model(tf, tf_psx, strategy, name: str):
    """(model, dataset_fn, callbacks) of variant `name`, built in `strategy`'s scope."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    callbacks = None
    frozen = name.endswith(FROZEN)
    name = name[: -len(FROZEN)] if frozen else name
    with strategy.scope():
        inputs = tf.keras.Input((IDS_PER_EXAMPLE,), dtype=tf.int64)
        if name == "ShardedEmbedding":
            layer = tf_psx.layers.ShardedEmbedding(NUM_IDS, DIM)
            optimizer = tf_psx.optimizers.LazyAdam(0.001)
        elif name == "DynamicEmbedding+policy":
            layer = tf_psx.layers.DynamicEmbedding(DIM, min_count=2, max_rows=50_000)
            optimizer = tf.keras.optimizers.Adam(0.001)
            callbacks = [tf_psx.callbacks.TableEviction(every_n_steps=100)]
        else:
            layer = tf_psx.layers.DynamicEmbedding(DIM)
            optimizer = tf.keras.optimizers.Adam(0.001)
        layer.trainable = not frozen
        emb = layer(inputs)
        pooled = tf.keras.layers.GlobalAveragePooling1D()(emb)
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(pooled))
        model.compile(optimizer, "binary_crossentropy")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, NUM_IDS, size=(BATCH * 32, IDS_PER_EXAMPLE))
    labels = (ids[:, 0] % 2).astype(np.float32)

    def dataset_fn(_):
        return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH).prefetch(2)

    return model, dataset_fn, callbacks


def child(name: str, workers: str, shift: str) -> None:
    """`name` "paired": the PAIRED variants in one process (built in an order rotated by `shift`); else one variant."""
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import (  # pylint: disable=import-outside-toplevel
        WINDOWS, fit_runner, kernel_ms, time_fit_cpu, time_fits_paired)
    from tf_psx.tables import tfra_updates as exact_tables  # pylint: disable=import-outside-toplevel

    cluster = tf_psx.LocalCluster(num_workers=int(workers), num_ps=2).start()
    strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2", exact_updates=(name != TFRA_APPLY))
    pids = {"process": os.getpid()}
    if name == "kernels":
        profiles = {}
        for variant in KERNELS:
            model, dataset_fn, _ = _model(tf, tf_psx, strategy, variant)
            run = fit_runner((model, dataset_fn))
            run(WARMUP_STEPS, None)
            profiles[variant] = kernel_ms(lambda steps, run=run: run(steps, None), TIMED_STEPS, model.optimizer.name)
        print(json.dumps(profiles), flush=True)
        os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)
    if name not in ("paired", "split"):
        model, dataset_fn, callbacks = _model(tf, tf_psx, strategy, name)
        ms, cpu, windows = time_fit_cpu(model, dataset_fn, WARMUP_STEPS, TIMED_STEPS, pids,
                                        callbacks=callbacks, windows=WINDOWS)
        print(json.dumps({"ms_per_step": ms, "cpu_ms_per_step": cpu["process"], "windows_ms": windows}), flush=True)
        os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)
    names = PAIRED if name == "paired" else SPLIT
    order = names[int(shift) % len(names):] + names[:int(shift) % len(names)]

    def runner(variant):
        model, dataset_fn, _ = _model(tf, tf_psx, strategy, variant)
        per_shard = variant != ONE_LOCK

        def run(steps, callbacks):
            exact_tables.TABLE_UPDATES_PER_SHARD = per_shard  # read when the step is traced (its first fit)
            try:
                model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=steps,
                          verbose=0, callbacks=callbacks)
            finally:
                exact_tables.TABLE_UPDATES_PER_SHARD = True

        return run

    timed = time_fits_paired({variant: runner(variant) for variant in order}, WARMUP_STEPS, TIMED_STEPS, pids)
    print(json.dumps({variant: {"ms_per_step": result["ms_per_step"],
                                "cpu_ms_per_step": result["cpu_ms_per_step"]["process"],
                                "windows_ms": result["windows_ms"]} for variant, result in timed.items()}), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)


def _kernel_rows(profiles: list[dict], spread_text) -> list[dict]:
    """Rows of `--kernels`: per variant and side, all kernels and TFRA's, and the costliest kernels of the update."""
    import statistics  # pylint: disable=import-outside-toplevel

    rows = []
    for variant in KERNELS:
        for side, label in (("update", "the optimizer's update"), ("rest", "the rest of the step")):
            every = [sum(profile[variant][side].values()) for profile in profiles]
            tfra = [sum(ms for kind, ms in profile[variant][side].items() if kind.startswith("TFRA>"))
                    for profile in profiles]
            rows.append({"metric": f"1 worker, kernels: {variant}, {label}: kernel ms/step, all kernels "
                                   "(TFRA's hash-table kernels)",
                         "value": f"{spread_text(every)} ({spread_text(tfra)})"})
        kinds = {kind for profile in profiles for kind in profile[variant]["update"]}
        median = {kind: statistics.median(profile[variant]["update"].get(kind, 0.0) for profile in profiles)
                  for kind in kinds}
        top = sorted(median.items(), key=lambda item: -item[1])[:TOP_KERNELS]
        # The round count goes in the unit, not the name: a later run with another --rounds replaces the row.
        rows.append({"metric": f"1 worker, kernels: {variant}, the optimizer's update: costliest kernels, ms/step",
                     "value": ", ".join(f"{kind} {ms:.2f}" for kind, ms in top),
                     "unit": f"(median of {len(profiles)} rounds)"})
    return rows


def main() -> None:
    import argparse  # pylint: disable=import-outside-toplevel

    from _common import (  # pylint: disable=import-outside-toplevel
        PAIRED_WINDOWS, ROUNDS, interleaved, kept_rows, per_round, ratio_row, ratios, saved_raw, spread_text,
        write_result)

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--workers", type=int, nargs="*", default=list(WORKERS))
    parser.add_argument("--with-singles", action="store_true",
                        help="also DynamicEmbedding+policy and TFRA's own apply, one per process")
    parser.add_argument("--split", action="store_true",
                        help="also each table frozen (lookup without update), paired, 1 worker")
    parser.add_argument("--kernels", action="store_true",
                        help="also kernel ms/step by op type under TF's profiler, 1 worker")
    parser.add_argument("--no-paired", action="store_true", help="without the paired comparison (rows kept)")
    parser.add_argument("--scale", choices=("small", "ctr"), default="small",
                        help="ctr: batch 2048 x 26 ids uniform over 2M, dim 16 (dynamic_vs_static_ctr.json)")
    args = parser.parse_args()
    if args.scale != SCALE:  # the constants are read at import: run again with the scale in the environment
        os.environ["TF_PSX_BENCH_SCALE"] = args.scale
        os.execv(sys.executable, [sys.executable, *sys.argv])
    variants = [] if args.no_paired else [("paired", workers) for workers in args.workers]
    if args.split:
        variants.append(("split", 1))
    if args.kernels:
        variants.append(("kernels", 1))
    if args.with_singles:
        variants += [("DynamicEmbedding+policy", workers) for workers in args.workers]
        if 1 in args.workers:
            variants.append((TFRA_APPLY, 1))
    runs = interleaved(__file__, variants, args.rounds, round_args=lambda index: (index,))

    def times(results: list[dict]) -> str:
        return (f"{spread_text(per_round(results, 'ms_per_step'))} "
                f"(CPU {spread_text(per_round(results, 'cpu_ms_per_step'))})")

    rows = []
    for workers in [] if args.no_paired else args.workers:
        paired = {name: [run[name] for run in runs[("paired", workers)]] for name in PAIRED}
        static, dynamic = paired["ShardedEmbedding"], paired["DynamicEmbedding"]
        for name in PAIRED:
            rows.append({"metric": f"{workers} worker(s): {name} ms/step (CPU ms/step)", "value": times(paired[name])})
        rows.append(ratio_row(f"{workers} worker(s): DynamicEmbedding / ShardedEmbedding",
                              ratios(dynamic, static, "ms_per_step"), TARGET, higher_is_better=False))
        if ONE_LOCK in paired:
            rows.append(ratio_row(f"{workers} worker(s): DynamicEmbedding, update per shard / one table lock",
                                  ratios(dynamic, paired[ONE_LOCK], "ms_per_step"), higher_is_better=False))
        if ("DynamicEmbedding+policy", workers) in runs:
            policy = runs[("DynamicEmbedding+policy", workers)]
            rows.append({"metric": f"{workers} worker(s): DynamicEmbedding+policy ms/step (CPU ms/step), alone "
                                   "in its process", "value": times(policy)})
    if ("split", 1) in runs:
        split = {name: [run[name] for run in runs[("split", 1)]] for name in SPLIT}
        for name in SPLIT:
            rows.append({"metric": f"1 worker, split: {name} ms/step (CPU ms/step)", "value": times(split[name])})
        for table in ("ShardedEmbedding", "DynamicEmbedding"):
            rows.append(ratio_row(f"1 worker, split: {table}, the table's update / the whole step (ms/step: 1 - "
                                  "frozen / trained)", [1 - f["ms_per_step"] / t["ms_per_step"] for f, t in
                                                       zip(split[table + FROZEN], split[table])]))
        rows.append(ratio_row("1 worker, split: frozen DynamicEmbedding / frozen ShardedEmbedding (the lookups and "
                              "the rest of the step, no table update)",
                              ratios(split["DynamicEmbedding" + FROZEN], split["ShardedEmbedding" + FROZEN],
                                     "ms_per_step")))
    if ("kernels", 1) in runs:
        rows += _kernel_rows(runs[("kernels", 1)], spread_text)
    if (TFRA_APPLY, 1) in runs:
        rows.append({"metric": f"1 worker: {TFRA_APPLY} (exact_updates=False) ms/step (CPU ms/step), alone in its "
                               "process", "value": times(runs[(TFRA_APPLY, 1)])})
    rows += kept_rows(RESULT, rows)
    write_result(
        RESULT,
        f"`model.fit` ms/step (whole cluster), steps_per_execution=1; ShardedEmbedding, DynamicEmbedding"
        + (" and DynamicEmbedding with one table lock (its whole update on its first ps task)" if _tfra_store()
           else "") + " in one process on one cluster, their windows "
        f"interleaved: {PAIRED_WINDOWS} windows of {TIMED_STEPS} steps each after {WARMUP_STEPS} warm-up steps, "
        "a variant's number its fastest window (bench/_common.py time_fits_paired); "
        f"{args.rounds} rounds of fresh processes (build order rotated), ratios per round (median, min-max); "
        f"in-process LocalCluster with 1 or 2 workers and 2 ps; batch {BATCH} x "
        f"{IDS_PER_EXAMPLE} ids per worker step, uniform over {NUM_IDS:,}, dim {DIM}, mean pooling + Dense(1); "
        "ShardedEmbedding (fixed:2, LazyAdam) against DynamicEmbedding ("
        + ("a TFRA table per ps" if _tfra_store() else "tf_psx's own tables: a DenseHashTable per ps") + ", Adam). "
        "Rows named 'alone in its process' (--with-singles): that variant alone, the fastest of 5 windows. "
        "Rows named 'split' (--split): ShardedEmbedding and DynamicEmbedding each also with its layer frozen "
        "(trainable=False: the lookup and the rest of the step, no table update), the four paired in one "
        "process, 1 worker.",
        rows,
        # The raw runs of the rows kept from earlier runs stay beside this run's.
        extra={**saved_raw(RESULT), **{" ".join(map(str, key)): value for key, value in runs.items()}},
    )


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 3)
