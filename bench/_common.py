"""Shared helpers for the benchmarks: the result file format and the machine line."""

from __future__ import annotations

import datetime
import json
import os
import platform

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> str:
    """A one-line description of where the benchmark ran."""
    return f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"


def write_result(name: str, setup: str, rows: list[dict], extra: dict | None = None, date: str | None = None) -> str:
    """Writes bench/results/<name>.json and returns its path.

    Args:
      name: the benchmark's name (the file stem).
      setup: one line saying what was measured, on what.
      rows: dicts with "metric", "value" and optionally "unit", "target" (a
        string such as ">= 0.98") and "ok" (bool, or None when no target).
      extra: any raw measurements worth keeping.
      date: the date of the runs the rows come from ("YYYY-MM-DD HH:MM
        UTC"); None: now. Rows rewritten from saved runs keep their runs'
        date (`saved_date`).
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    os.makedirs(RESULTS_DIR, exist_ok=True)
    record = {
        "name": name,
        "setup": setup,
        "machine": machine(),
        "tensorflow": tf.__version__,
        "date": date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "rows": rows,
        "raw": extra or {},
    }
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=2)
        handle.write("\n")
    print(f"wrote {path}")
    return path


def entry(child, main, child_args: int) -> None:
    """`python SCRIPT --child ARG...` runs `child(*ARGS)` (a measurement); `python SCRIPT` runs `main()`."""
    import sys  # pylint: disable=import-outside-toplevel

    if len(sys.argv) == child_args + 2 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
    else:
        main()


def add_images(path: str, images: list[str]) -> None:
    """Adds image paths (relative to docs/) to a result file; report.py shows them under its table."""
    with open(path, encoding="utf-8") as handle:
        record = json.load(handle)
    record["images"] = list(images)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=2)
        handle.write("\n")


# A fresh interpreter per measurement: TF import, cluster start and the first
# trace take ~30 s on 2 loaded cores; the slowest measured child (stock Adam at
# 2M rows) adds ~60 s.
CHILD_TIMEOUT_S = 400


def run_child(script: str, *args: str, timeout: float = CHILD_TIMEOUT_S) -> dict:
    """Runs `python SCRIPT --child ARGS` and returns the JSON of its last "{" line.

    Benchmarks measure in fresh processes because, measured here, whichever of
    two models is built first in one process runs about 30 % slower.
    """
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    out = subprocess.run(
        [sys.executable, os.path.abspath(script), "--child", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"child {args} failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def time_fit(model, dataset_fn, warmup_steps: int, timed_steps: int, callbacks=None) -> float:
    """ms per `model.fit` step over `timed_steps`, after `warmup_steps` (the trace)."""
    return time_fit_cpu(model, dataset_fn, warmup_steps, timed_steps, {}, callbacks)[0]


def _cpu_ms(pid: int) -> float:
    """CPU time (user + system) of process `pid` so far, in ms (from /proc; 0.0 where there is none)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # Fields 14 and 15 of proc(5) (utime, stime), counted after the ")" that ends field 2.
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def time_fit_cpu(model, dataset_fn, warmup_steps: int, timed_steps: int, pids: dict, callbacks=None, windows: int = 1):
    """(ms per step, {name: CPU ms per step of process pids[name]}, every window's ms per step), as `time_fit`.

    The timed steps are `windows` fits of `timed_steps` each, and the
    fastest window gives the first two values. The fastest, not the median: a disturbance
    only adds time, and this machine's own speed moves (measured: a fixed
    numpy job on the idle 2-core machine ran at 0.67x its usual rate for
    2.5 s at a time, without any steal shown by vmstat), so windows of the
    same fit in one process differed by up to 2.5x.
    """
    import time  # pylint: disable=import-outside-toplevel

    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    data = tf.keras.utils.experimental.DatasetCreator(dataset_fn)
    model.fit(data, epochs=1, steps_per_epoch=warmup_steps, verbose=0, callbacks=callbacks)
    measured = []
    for _ in range(windows):
        before = {name: _cpu_ms(pid) for name, pid in pids.items()}
        start = time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=timed_steps, verbose=0, callbacks=callbacks)
        ms = (time.perf_counter() - start) * 1000 / timed_steps
        measured.append((ms, {name: (_cpu_ms(pid) - before[name]) / timed_steps for name, pid in pids.items()}))
    ms, cpu = min(measured, key=lambda pair: pair[0])
    return ms, cpu, [round(pair[0], 3) for pair in measured]


def logistic_model(num_rows: int, fields: int, learning_rate: float):
    """The planted model's logistic regression, built in the current strategy's scope.

    An Embedding "w" of width 1 over every id, summed by a Dense "bias" whose
    kernel starts at ones (a per-field scale; the planted model has all
    scales 1), then a sigmoid; Adagrad and log loss.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    inputs = tf.keras.Input((fields,), dtype=tf.int64)
    weights = tf.keras.layers.Embedding(num_rows, 1, embeddings_initializer="zeros", name="w")(inputs)
    logit = tf.keras.layers.Dense(1, kernel_initializer="ones", name="bias")(tf.keras.layers.Flatten()(weights))
    model = tf.keras.Model(inputs, tf.keras.layers.Activation("sigmoid")(logit))
    model.compile(tf.keras.optimizers.Adagrad(learning_rate), "binary_crossentropy")
    return model


def holdout_auc(model, coordinator, holdout, examples_per_epoch: int):
    """A callback that, after every epoch, joins the steps and scores `holdout` with `logistic_model`'s weights.

    Scoring runs on the coordinator in numpy, so it does not touch the
    workers. `points` holds {"examples", "auc", "seconds"} per epoch
    (seconds since the end of epoch 1, evaluation excluded);
    `training_seconds()` is the wall time of epochs 2.. less evaluation.
    """
    import time  # pylint: disable=import-outside-toplevel

    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tf_psx.data import roc_auc  # pylint: disable=import-outside-toplevel

    class HoldoutAUC(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.points, self.eval_s, self.epoch_ends = [], 0.0, []

        def on_epoch_end(self, epoch, logs=None):
            start = time.perf_counter()
            self.epoch_ends.append(start)
            coordinator.join()
            table = tf.convert_to_tensor(model.get_layer("w").embeddings).numpy()[:, 0]
            kernel = tf.convert_to_tensor(model.get_layer("bias").kernel).numpy()[:, 0]
            bias = float(model.get_layer("bias").bias.numpy()[0])
            scores = bias + (table[holdout.ids] * kernel).sum(axis=1)
            self.points.append({"examples": (epoch + 1) * examples_per_epoch, "auc": roc_auc(holdout.labels, scores),
                                "seconds": start - self.epoch_ends[0] - self.eval_s})
            self.eval_s += time.perf_counter() - start

        def training_seconds(self) -> float:
            # Between the end of epoch 1 and the end of the last, less the
            # evaluations made in that span.
            epochs = len(self.epoch_ends)
            span = self.epoch_ends[-1] - self.epoch_ends[0]
            return max(span - self.eval_s * (epochs - 1) / epochs, 1e-9)

    return HoldoutAUC()


def sharded_table_model(rows: int, dim: int, ids: int):
    """A ShardedEmbedding(rows, dim) (fixed:2) + Dense(1) with Adagrad(0.05) on an in-process cluster (1 worker, 2 ps).

    Returns (model, cluster); the cluster's servers live until the process ends.
    """
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    cluster = tf_psx.LocalCluster(num_workers=1, num_ps=2).start()
    strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
    with strategy.scope():
        inputs = tf.keras.Input((ids,), dtype=tf.int64)
        emb = tf_psx.layers.ShardedEmbedding(rows, dim)(inputs)
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(emb)))
        model.compile(tf.keras.optimizers.Adagrad(0.05), "mse")
    return model, cluster


# A straggler: its task process stopped STOP_S of every STOP_S + RUN_S seconds (3x slower).
STOP_S, RUN_S = 0.020, 0.010


class Straggler:
    """Stops a task process for STOP_S of every STOP_S + RUN_S seconds (a 3x slowdown).

    The stop/continue loop is a process of its own: a thread of the
    coordinator could wait for the GIL while a TF call waits for the stopped
    worker, and never send the SIGCONT.
    """

    def __init__(self, pid: int):
        import subprocess  # pylint: disable=import-outside-toplevel
        import sys  # pylint: disable=import-outside-toplevel

        self.pid = pid
        loop = (f"import os, signal, time\nwhile True:\n    os.kill({pid}, signal.SIGSTOP); time.sleep({STOP_S})\n"
                f"    os.kill({pid}, signal.SIGCONT); time.sleep({RUN_S})\n")
        self._process = subprocess.Popen([sys.executable, "-c", loop])

    def stop(self) -> None:
        import signal  # pylint: disable=import-outside-toplevel

        self._process.kill()
        self._process.wait()
        os.kill(self.pid, signal.SIGCONT)


# --- The interleaved method (issue 30) ---
#
# Variants of one comparison run interleaved: every round runs each variant
# once, in a fresh process, the order rotated by one each round (A B C, B C A,
# C A B, ...), so that no variant always runs first or after the same one. A
# ratio is taken per round (variant X over variant Y of the same round), and
# reported as its median and spread (min-max). It is judged met only when its
# whole spread is on the target's side, missed only when its whole spread is
# on the other side; a spread that straddles the target is not judged.
ROUNDS = 5
# Timed windows per child (time_fit_cpu): the fastest window is the child's number.
WINDOWS = 5
# Timed windows per variant when variants share a process (time_fits_paired).
PAIRED_WINDOWS = 12


def fit_runner(entry):
    """`run(steps, callbacks)` of a `time_fits_paired` entry: the entry itself, or a fit of (model, dataset_fn)."""
    if callable(entry):
        return entry
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    model, dataset_fn = entry
    data = tf.keras.utils.experimental.DatasetCreator(dataset_fn)

    def run(steps, callbacks):
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks)

    return run


def time_fits_paired(fits: dict, warmup_steps: int, timed_steps: int, pids: dict, windows: int = PAIRED_WINDOWS) -> dict:
    """{name: {"ms_per_step", "cpu_ms_per_step", "windows_ms"}}: variants in one process, their windows interleaved.

    `fits` maps a name to (model, dataset_fn), a fit of
    `DatasetCreator(dataset_fn)`, or to a function `run(steps, callbacks)`
    that fits one epoch of `steps` steps with `callbacks`. Every model fits
    `warmup_steps` (its trace), then window after window each model fits
    `timed_steps` (the order reversed every window: A B, B A, ...). A
    window is timed from its epoch's begin to its end (fit's own setup
    left out). A variant's number is its fastest window, with the CPU ms
    per step of `pids` over that window.

    Why: windows of one fit moved by up to 4x within a second on this
    machine (6.5 and 25.7 ms/step 0.7 s apart), and whole processes by 2x
    (a run's rounds 4-5 were all ~2x slower than its rounds 1-2), so
    variants timed in separate processes minutes apart compared machine
    states, not variants. Adjacent windows of one process share them: the
    ratio of the fastest windows of LazyAdam 2M / 10k rows came out 1.10
    and 1.10 in two processes (built in either order), where separate
    processes gave 0.90-1.34.
    """
    import time  # pylint: disable=import-outside-toplevel

    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    marks: dict = {}

    class _Window(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            marks["cpu"] = {name: _cpu_ms(pid) for name, pid in pids.items()}
            marks["start"] = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            marks["ms"] = (time.perf_counter() - marks["start"]) * 1000 / timed_steps
            marks["cpu"] = {name: (_cpu_ms(pid) - marks["cpu"][name]) / timed_steps for name, pid in pids.items()}

    runners = {name: fit_runner(entry) for name, entry in fits.items()}
    for run in runners.values():
        run(warmup_steps, None)
    measured: dict = {name: [] for name in fits}
    names = list(fits)
    for index in range(windows):
        for name in names if index % 2 == 0 else names[::-1]:
            runners[name](timed_steps, [_Window()])
            measured[name].append((marks["ms"], marks["cpu"]))
    results = {}
    for name, windows_of in measured.items():
        ms, cpu = min(windows_of, key=lambda pair: pair[0])
        results[name] = {"ms_per_step": ms, "cpu_ms_per_step": cpu, "windows_ms": [round(w[0], 3) for w in windows_of]}
    return results


def kernel_ms(run, steps: int, update_scope: str) -> dict:
    """{"update": {kernel type: ms/step}, "rest": {...}}: TF profiler kernel time of `run(steps)`, per step.

    Every TF op event of the trace (named "op name:op type") is summed by
    its op type: wall time of the kernel's events, which on 2 shared cores
    includes time a kernel's thread waited for a core. "update" holds the
    ops whose name starts with `update_scope` + "/" (the optimizer's name
    scope: its apply, and tf_psx's locked updates inside it), "rest" the
    others (the forward and backward pass, the input).
    """
    import glob  # pylint: disable=import-outside-toplevel
    import tempfile  # pylint: disable=import-outside-toplevel

    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_psx._tf.versions import xplane_pb2  # pylint: disable=import-outside-toplevel  (moved in TF 2.18)

    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            run(steps)
        finally:
            tf.profiler.experimental.stop()
        space = xplane_pb2().XSpace()
        with open(sorted(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True))[-1], "rb") as file:
            space.ParseFromString(file.read())
    return kernel_totals(space, steps, update_scope)


def kernel_totals(space, steps: int, update_scope: str) -> dict:
    """`kernel_ms` of a parsed profile (an XSpace proto) of `steps` steps."""
    import collections  # pylint: disable=import-outside-toplevel

    totals = {"update": collections.Counter(), "rest": collections.Counter()}
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if ":" not in name or "::" in name or name.startswith("Eager"):
                    continue  # not an op's kernel (the executor's and the runtime's own events)
                op_name, op_type = name.rsplit(":", 1)
                side = "update" if op_name.startswith(update_scope + "/") else "rest"
                totals[side][op_type] += event.duration_ps / 1e9 / steps
    return {side: dict(counter) for side, counter in totals.items()}


def interleaved(script: str, variants: list[tuple], rounds: int = ROUNDS, timeout: float = CHILD_TIMEOUT_S,
                log=print, round_args=None) -> dict:
    """{variant: [child result per round]}: `rounds` rounds of `python SCRIPT --child *variant`, order rotated.

    Args:
      script: the benchmark script (its `--child ARGS` prints one JSON line).
      variants: tuples of child arguments (converted to str).
      rounds: how many times each variant runs.
      timeout: seconds for one child.
      log: called with one line per child run.
      round_args: a function of the round's index returning more child
        arguments for every run of that round (a data seed), or None.
    """
    results: dict = {variant: [] for variant in variants}
    for index in range(rounds):
        shift = index % len(variants)
        extra = tuple(round_args(index)) if round_args is not None else ()
        for variant in variants[shift:] + variants[:shift]:
            result = run_child(script, *(str(arg) for arg in variant + extra), timeout=timeout)
            results[variant].append(result)
            log(f"round {index + 1}/{rounds} {' '.join(map(str, variant))}: "
                + ", ".join(f"{key} {value:.4g}" for key, value in result.items() if isinstance(value, (int, float))))
    return results


def per_round(runs: list[dict], key: str) -> list[float]:
    """The value of `key` in each round's result."""
    return [float(run[key]) for run in runs]


def ratios(top: list[dict], bottom: list[dict], key: str) -> list[float]:
    """Per round: top's `key` over bottom's `key` (the two variants of the same round)."""
    return [a / b for a, b in zip(per_round(top, key), per_round(bottom, key))]


def judge(values: list[float], target: float, higher_is_better: bool) -> bool | None:
    """True when every value meets `target`, False when none does, None when the spread straddles it."""
    meets = [(v >= target) if higher_is_better else (v <= target) for v in values]
    if all(meets):
        return True
    if not any(meets):
        return False
    return None


def spread_text(values: list[float], digits: int = 3) -> str:
    """"median (min-max, n rounds)"."""
    import statistics  # pylint: disable=import-outside-toplevel

    return (f"{statistics.median(values):.{digits}g} ({min(values):.{digits}g}-{max(values):.{digits}g}, "
            f"{len(values)} rounds)")


def ratio_row(metric: str, values: list[float], target: float | None = None, higher_is_better: bool = True) -> dict:
    """A result row for a per-round ratio: median, spread, and the verdict of `judge` when there is a target."""
    import statistics  # pylint: disable=import-outside-toplevel

    row = {"metric": metric, "value": spread_text(values), "median": round(statistics.median(values), 4),
           "spread": [round(min(values), 4), round(max(values), 4)], "rounds": [round(v, 4) for v in values]}
    if target is not None:
        row["target"] = f"{'>=' if higher_is_better else '<='} {target}"
        row["ok"] = judge(values, target, higher_is_better)
    return row


def kept_rows(name: str, new_rows: list[dict], only_kept: bool = False) -> list[dict]:
    """The rows of the last bench/results/<name>.json whose metric `new_rows` lacks, marked with that run's date.

    For a benchmark that re-measures a part of its comparisons: the rest
    stay on the page, saying when they were measured. `only_kept`: only the
    rows that file had kept itself (when its own rows are being rewritten
    from its raw runs).
    """
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        previous = json.load(handle)
    have = {row["metric"] for row in new_rows}
    kept = []
    for row in previous["rows"]:
        if row["metric"] in have:
            continue
        if " [kept from the run of " in str(row["value"]):
            kept.append(row)  # kept before: it keeps its own run's date
            continue
        if not only_kept:
            kept.append(dict(row, value=f"{row['value']} [kept from the run of {previous['date']}]"))
    return kept


def _saved(name: str) -> dict | None:
    """The last bench/results/<name>.json, or None."""
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def saved_raw(name: str) -> dict:
    """The raw part of the last bench/results/<name>.json, or {} (kept beside a partial run's own raw runs)."""
    return (_saved(name) or {}).get("raw", {})


def saved_date(name: str) -> str:
    """The date of the runs in bench/results/<name>.json (for `write_result` when only its rows are rewritten)."""
    return _saved(name)["date"]


def saved_runs(name: str, arity: int) -> dict:
    """The `interleaved` runs saved in bench/results/<name>.json's raw part, keyed by their variant tuples.

    The raw keys are a variant's `arity` arguments joined by spaces; only
    the first may hold spaces itself (an optimizer's name), and integer
    arguments come back as ints.
    """
    with open(os.path.join(RESULTS_DIR, f"{name}.json"), encoding="utf-8") as handle:
        raw = json.load(handle)["raw"]
    return {tuple(int(part) if part.isdigit() else part for part in key.rsplit(" ", arity - 1)): value
            for key, value in raw.items()}
