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
