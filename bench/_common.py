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


def write_result(name: str, setup: str, rows: list[dict], extra: dict | None = None) -> str:
    """Writes bench/results/<name>.json and returns its path.

    Args:
      name: the benchmark's name (the file stem).
      setup: one line saying what was measured, on what.
      rows: dicts with "metric", "value" and optionally "unit", "target" (a
        string such as ">= 0.98") and "ok" (bool, or None when no target).
      extra: any raw measurements worth keeping.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    os.makedirs(RESULTS_DIR, exist_ok=True)
    record = {
        "name": name,
        "setup": setup,
        "machine": machine(),
        "tensorflow": tf.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
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
    import time  # pylint: disable=import-outside-toplevel

    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    data = tf.keras.utils.experimental.DatasetCreator(dataset_fn)
    model.fit(data, epochs=1, steps_per_epoch=warmup_steps, verbose=0, callbacks=callbacks)
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=timed_steps, verbose=0, callbacks=callbacks)
    return (time.perf_counter() - start) * 1000 / timed_steps
