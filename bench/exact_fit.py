"""Examples/s of exact `fit` (the coordinator reads the input) against per-worker input, and the progress bar's cost.

Model: the 26-feature Criteo-shaped model of bench/fused_embeddings.py
(`FeatureEmbeddings`, MLP 400-400-400, Adagrad, batch 512 per step),
2 worker and 2 ps task processes, `steps_per_execution=1` unless the
variant says 10, prefetch 4.

Variants, each in a fresh process:
* creator: `fit(DatasetCreator(fn), steps_per_epoch=N)`, each worker reading
  its own copy of the data (`from_tensor_slices(...).batch(512)`): TF's
  per-worker path, no exact epochs (what fit without a strategy's meaning
  gave before);
* exact_dataset: `fit(dataset, epochs=...)` of the same pipeline, finite (N
  batches): the coordinator reads and sends the batches;
* exact_arrays: `fit(features, labels, batch_size=512)` (no shuffle);
* exact_arrays_verbose: the same with `verbose=1` (tf_psx's throttled
  progress bar, its output to a pipe);
* creator_straggler, exact_arrays_straggler: worker 0 stopped for 20 ms of
  every 30 ms (SIGSTOP/SIGCONT from another process: 3x slower);
* creator_spe10, exact_dataset_spe10: `steps_per_execution=10`, the
  setting TF's parameter-server tutorial advises;
* exact_service: exact_dataset's pipeline read by a tf.data service
  ("distributed_epoch", one data worker task process that LocalCluster
  starts): the coordinator receives ready batches instead of reading them.
  On one 2-core machine the data worker shares the cores with everything
  else, so this shows the coordinator's CPU per step, not the gain of
  readers on other hosts;
* exact_arrays_nojournal: exact_arrays with `tf_psx.training.step_once.JOURNAL`
  off (no copy of the rows an update writes): what the journal costs;
* exact_arrays_notokens: exact_arrays with no step token seen by the
  updates (`tf_psx.training.step_once.current` returns None: no ring, no journal,
  a re-run applied again): what the tokens cost in all;
* exact_arrays_unfolded: exact_arrays with the step's `iterations` bump
  under its own lock and ring (`tf_psx.training.exact_updates.FOLD_ITERATIONS`
  off): what making it in its ps task's unit of dense updates saves.

By default (`--variants paired,paired_straggler,paired_spe10`) the comparisons run
paired: creator, exact_dataset, exact_arrays, exact_arrays_notokens and
exact_arrays_unfolded in one process on one cluster (one model for the
first three, one more for each of the last two, traced with tokens off or
the bump apart), their timed epochs interleaved, PAIRED_WINDOWS
each, a variant's number its fastest epoch (bench/_common.py
time_fits_paired); the two straggler variants likewise in a process of
their own, and creator_spe10 and exact_dataset_spe10 in another. Any other variant named runs alone in its process: one warm-up
epoch (the trace), then the timed one. The examples/s and the CPU ms per
step of every process are read over a timed epoch of `--steps` batches
(400 by default: runs with 100, about 2.5 s timed, moved the per-worker
path alone by 30% between rounds). Processes run in ROUNDS rounds (each
round in another order); every ratio is reported as its median and its
spread (min-max) over the rounds, and called met or missed only when the
spread does not straddle the target.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Batches of one epoch (warm-up epoch, then the timed one); `--steps` sets it for a run (its children read it here).
STEPS = int(os.environ.get("TF_PSX_EXACT_FIT_STEPS", "400"))
ROUNDS = 3
WORKERS = 2
VARIANTS = ["creator", "exact_dataset", "exact_arrays", "exact_arrays_verbose", "creator_straggler",
            "exact_arrays_straggler", "creator_spe10", "exact_dataset_spe10", "exact_service", "exact_arrays_nojournal",
            "exact_arrays_notokens", "exact_arrays_unfolded"]


def _cluster_and_strategy(data_workers: int = 0):
    """The benchmark's started LocalCluster (WORKERS workers, 2 ps, task processes) and its strategy."""
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    cluster = tf_psx.LocalCluster(num_workers=WORKERS, num_ps=2, processes=True, data_workers=data_workers).start()
    strategy = tf_psx.ParameterServerStrategy(cluster, tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    return cluster, strategy


def child(variant: str) -> None:
    if variant in PAIRED:
        paired_child(variant)
        return
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import Straggler, _cpu_ms  # pylint: disable=import-outside-toplevel
    from fused_embeddings import BATCH, batches, build  # pylint: disable=import-outside-toplevel

    if variant.endswith("_nojournal"):  # the journal's cost (tf_psx.training.step_once.JOURNAL)
        from tf_psx.training import step_once  # pylint: disable=import-outside-toplevel

        step_once.JOURNAL = False
        variant = variant[: -len("_nojournal")]
    if variant.endswith("_notokens"):  # everything the step tokens cost (no re-run is then applied once)
        from tf_psx.training import step_once  # pylint: disable=import-outside-toplevel

        step_once.current = lambda: None
        variant = variant[: -len("_notokens")]
    if variant.endswith("_unfolded"):  # the `iterations` bump under its own lock and ring
        from tf_psx.training import exact_updates  # pylint: disable=import-outside-toplevel

        exact_updates.FOLD_ITERATIONS = False
        variant = variant[: -len("_unfolded")]
    cluster, strategy = _cluster_and_strategy(data_workers=1 if variant == "exact_service" else 0)
    slow = None
    try:
        with strategy.scope():
            model, _, _ = build("fused", 26)
            if variant.endswith("spe10"):
                model.compile(model.optimizer, model.loss, steps_per_execution=10)
        ids, dense, labels = batches(26, STEPS)
        features = dict(ids, numeric=dense)
        pids = dict(cluster.task_pids(), coordinator=os.getpid())  # with exact_service: the data service's too
        marks = {}

        class Timer(tf.keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 1:
                    marks["cpu"] = {name: _cpu_ms(pid) for name, pid in pids.items()}
                    marks["start"] = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                if epoch == 1:
                    marks["seconds"] = time.perf_counter() - marks["start"]
                    marks["cpu"] = {name: (_cpu_ms(pid) - marks["cpu"][name]) / STEPS for name, pid in pids.items()}

        if variant.endswith("straggler"):
            slow = Straggler(cluster.pid("worker", 0))
        verbose = 1 if variant.endswith("verbose") else 0
        if variant.startswith("creator"):
            def dataset_fn(_ctx):
                return tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(BATCH).prefetch(4)

            model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=2, steps_per_epoch=STEPS,
                      verbose=verbose, callbacks=[Timer()])
        elif variant.startswith("exact_arrays"):
            model.fit(features, labels, batch_size=BATCH, epochs=2, shuffle=False, verbose=verbose,
                      callbacks=[Timer()])
        else:
            dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(BATCH)
            if variant == "exact_service":
                dataset = dataset.apply(tf.data.experimental.service.distribute(
                    processing_mode="distributed_epoch", service=cluster.data_service))
            model.fit(dataset.prefetch(4), epochs=2, verbose=verbose, callbacks=[Timer()])
        applied = int(model.optimizer.iterations.numpy())
    finally:
        if slow is not None:
            slow.stop()
        cluster.stop()
    print("RESULT " + json.dumps({"examples_per_s": STEPS * BATCH / marks["seconds"], "cpu_ms_per_step": marks["cpu"],
                                  "steps": applied}), flush=True)


PAIRED_WINDOWS = 4  # timed windows (epochs of STEPS batches) per variant of a paired child
PAIRED = {"paired": ["creator", "exact_dataset", "exact_arrays", "exact_arrays_notokens", "exact_arrays_unfolded"],
          "paired_straggler": ["creator_straggler", "exact_arrays_straggler"],
          "paired_spe10": ["creator_spe10", "exact_dataset_spe10"]}


def paired_child(kind: str) -> None:
    """The variants of `PAIRED[kind]` in one process on one cluster, their timed epochs interleaved.

    creator, exact_dataset and exact_arrays fit one model (the creator path
    and the fed path trace their own functions); exact_arrays_notokens fits
    a second model, traced with no step token, and exact_arrays_unfolded a
    third, traced with the `iterations` bump apart. With a straggler, worker 0 is
    stopped 20 ms of every 30 ms from the end of the warm-up on.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import Straggler, time_fits_paired  # pylint: disable=import-outside-toplevel
    from fused_embeddings import BATCH, batches, build  # pylint: disable=import-outside-toplevel
    from tf_psx.training import exact_updates, step_once  # pylint: disable=import-outside-toplevel

    names = PAIRED[kind]
    cluster, strategy = _cluster_and_strategy()
    slow = None
    try:
        with strategy.scope():
            model, _, _ = build("fused", 26)
            if kind.endswith("spe10"):
                model.compile(model.optimizer, model.loss, steps_per_execution=10)
            untokened = build("fused", 26)[0] if "exact_arrays_notokens" in names else None
            unfolded = build("fused", 26)[0] if "exact_arrays_unfolded" in names else None
        ids, dense, labels = batches(26, STEPS)
        features = dict(ids, numeric=dense)

        def head(steps):
            return {k: v[:steps * BATCH] for k, v in features.items()}, labels[:steps * BATCH]

        def creator(steps, callbacks):
            def dataset_fn(_ctx):
                return tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(BATCH).prefetch(4)

            model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=steps,
                      verbose=0, callbacks=callbacks)

        def exact_dataset(steps, callbacks):
            model.fit(tf.data.Dataset.from_tensor_slices(head(steps)).batch(BATCH).prefetch(4), epochs=1, verbose=0,
                      callbacks=callbacks)

        def exact_arrays(steps, callbacks, which=model):
            x, y = head(steps)
            which.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)

        runners = {"creator": creator, "creator_straggler": creator, "creator_spe10": creator,
                   "exact_dataset": exact_dataset, "exact_dataset_spe10": exact_dataset,
                   "exact_arrays": exact_arrays, "exact_arrays_straggler": exact_arrays,
                   "exact_arrays_notokens": lambda steps, callbacks: exact_arrays(steps, callbacks, untokened),
                   "exact_arrays_unfolded": lambda steps, callbacks: exact_arrays(steps, callbacks, unfolded)}
        fits = {name: runners[name] for name in names}
        for name, run in fits.items():  # the traces, before any straggler
            if name == "exact_arrays_notokens":
                traced, step_once.current = step_once.current, lambda: None
                try:
                    run(20, None)
                finally:
                    step_once.current = traced
            elif name == "exact_arrays_unfolded":
                exact_updates.FOLD_ITERATIONS = False
                try:
                    run(20, None)
                finally:
                    exact_updates.FOLD_ITERATIONS = True
            else:
                run(20, None)
        if kind.endswith("straggler"):
            slow = Straggler(cluster.pid("worker", 0))
        pids = dict(cluster.task_pids(), coordinator=os.getpid())
        timed = time_fits_paired(fits, 2, STEPS, pids, windows=PAIRED_WINDOWS)
    finally:
        if slow is not None:
            slow.stop()
        cluster.stop()
    out = {name: {"examples_per_s": 1000.0 * BATCH / result["ms_per_step"], "cpu_ms_per_step": result["cpu_ms_per_step"],
                  "windows_ms": result["windows_ms"]} for name, result in timed.items()}
    print("RESULT " + json.dumps(out), flush=True)


def _run(variant: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant], capture_output=True,
                         text=True, timeout=900, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    """`python bench/exact_fit.py [--variants a,b,...]`: every variant, or a part (the other rows are kept, dated)."""
    import argparse  # pylint: disable=import-outside-toplevel

    from _common import (  # pylint: disable=import-outside-toplevel
        kept_rows, machine, ratio_row, saved_date, saved_raw, write_result)

    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default=",".join(PAIRED),
                        help="comma-separated, of: " + ", ".join(list(PAIRED) + VARIANTS))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--steps", type=int, default=STEPS, help="batches per epoch (the timed epoch's steps)")
    parser.add_argument("--rows", action="store_true",
                        help="rewrite the rows from the raw runs the last result holds (partial runs merged; no run)")
    options = parser.parse_args()
    chosen, rounds = options.variants.split(","), options.rounds
    os.environ["TF_PSX_EXACT_FIT_STEPS"] = str(options.steps)
    unknown = sorted(set(chosen) - set(VARIANTS) - set(PAIRED))
    if unknown:
        raise SystemExit(f"exact_fit: unknown variant(s) {unknown}; choose from {list(PAIRED) + VARIANTS}")
    chosen = [v for v in list(PAIRED) + VARIANTS if v in chosen]
    runs: dict[str, list[dict]] = {v: [] for v in chosen}
    if options.rows:
        runs = saved_raw("exact_fit").get("runs", {})
        chosen = [v for v in VARIANTS if v in runs]
        rounds = min(len(value) for value in runs.values())
    for round_index in range(0 if options.rows else rounds):
        order = chosen[round_index % len(chosen):] + chosen[:round_index % len(chosen)]
        for variant in order:
            result = _run(variant)
            runs[variant].append(result)
            shown = result.items() if variant in PAIRED else [(variant, result)]
            print(f"round {round_index + 1} " + ", ".join(f"{name}: {value['examples_per_s']:.0f} examples/s"
                                                          for name, value in shown), flush=True)

    for kind in PAIRED:  # a paired child's variants, as one run each per round
        if kind in runs:
            for name in PAIRED[kind]:
                runs[name] = [result[name] for result in runs[kind]]
            del runs[kind]
            chosen = [v for v in chosen if v != kind] + PAIRED[kind]

    def ratios(a: str, b: str) -> list[float]:
        return [x["examples_per_s"] / y["examples_per_s"] for x, y in zip(runs[a], runs[b])]

    def median_of(variant: str, key: str = "examples_per_s") -> float:
        return statistics.median(r[key] for r in runs[variant])

    comparisons = [
        ("exact dataset / per-worker, equal workers", "exact_dataset", "creator", 0.95),
        ("exact arrays / per-worker, equal workers", "exact_arrays", "creator", 0.95),
        ("exact arrays / per-worker, one 3x straggler", "exact_arrays_straggler", "creator_straggler", 0.9),
        ("verbose=1 / verbose=0 (exact arrays)", "exact_arrays_verbose", "exact_arrays", 0.98),
        ("exact dataset / per-worker, steps_per_execution=10", "exact_dataset_spe10", "creator_spe10", 0.95),
        ("exact over a tf.data service / exact dataset", "exact_service", "exact_dataset", None),
        ("journal on / off (exact arrays)", "exact_arrays", "exact_arrays_nojournal", None),
        ("step tokens on / off (exact arrays)", "exact_arrays", "exact_arrays_notokens", None),
        ("iterations bump in the unit / apart (exact arrays)", "exact_arrays", "exact_arrays_unfolded", None),
    ]
    rows = [ratio_row(metric, ratios(top, bottom), target) for metric, top, bottom, target in comparisons
            if top in runs and bottom in runs]
    for variant in chosen:
        cpu = statistics.median(r["cpu_ms_per_step"]["coordinator"] for r in runs[variant])
        rows.append({"metric": f"{variant}: examples/s", "value": round(median_of(variant)), "unit": "examples/s"})
        rows.append({"metric": f"{variant}: coordinator CPU", "value": round(cpu, 2), "unit": "ms/step"})
    setup = (f"26-feature Criteo-shaped model (FeatureEmbeddings, MLP 400-400-400, Adagrad), batch 512, "
             f"{WORKERS} workers + 2 ps task processes, steps_per_execution=1 (10 where named), prefetch 4; "
             f"{rounds} rounds of fresh processes; median and spread (min-max) of the per-round ratios. "
             f"{', '.join(PAIRED['paired'])} (and, with worker 0 stopped 20 ms of every 30 ms, "
             f"{', '.join(PAIRED['paired_straggler'])}; and, at steps_per_execution=10, "
             f"{', '.join(PAIRED['paired_spe10'])}) run in one process on one cluster, their timed epochs "
             f"of {options.steps} steps interleaved ({PAIRED_WINDOWS} each, a variant's number its fastest; "
             "bench/_common.py time_fits_paired); other variants one per process, one timed epoch of "
             f"{options.steps} steps after a warm-up epoch")
    if options.rows:
        setup += ("; rows rewritten from the raw runs this file holds (partial runs of this date and before, each "
                  "variant's own rounds)")
    else:
        setup += f"; this run measured {', '.join(chosen)}, the other rows are kept from earlier runs"
    # The raw runs of the rows kept from earlier runs stay beside this run's.
    write_result("exact_fit", setup, rows + kept_rows("exact_fit", rows, only_kept=options.rows),
                 extra={"runs": {**saved_raw("exact_fit").get("runs", {}), **runs}, "machine": machine()},
                 date=saved_date("exact_fit") if options.rows else None)


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 1)
