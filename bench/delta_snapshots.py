"""Updates a crash loses, and what keeping that loss small costs: full snapshots against delta snapshots.

A 2,000,000 x 16 ShardedEmbedding (fixed:2) with Adagrad (2 x 128 MB of
table and slot) plus Dense(1), in-process LocalCluster with 1 worker and 2
ps, batch 256 x 4 Zipf ids (exponent 1.05 over the rows, as after counting a
vocabulary); `model.fit` of 300 steps after 5 traced ones, to a local
directory. Each setting in a fresh process:

* none: no snapshot (the step time without any);
* full every 60 steps (PeriodicSync(60));
* full every 10 steps (PeriodicSync(10)): the way to lose at most 10 steps
  without deltas;
* full every 60 + delta every 10 (PeriodicSync(60, delta_every_n_steps=10));
  with Adagrad under the cluster the changed rows come from the marks the
  updates set (delta_rows_by="auto");
* the same with delta_rows_by="fingerprint": a fingerprint pass over each
  table per delta (what an optimizer that writes beyond the gradient's rows,
  such as Adam, gets);
* the last two again with the directory on `ram://`, a tf.io.gfile
  filesystem: every byte then goes through the coordinator, as on an object
  store (where bytes cost more than on this machine's local disk).

A crash (a ps task's included: the job restarts and resumes) loses the steps
since the newest snapshot or delta: at most the interval, in steps and in
seconds at the setting's own step time. Cost per step = the setting's ms per
step against none's. The delta's size is its row count and its file bytes
against the full checkpoint's bytes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROWS, DIM, IDS, BATCH, STEPS, WARMUP, EXPONENT = 2_000_000, 16, 4, 256, 300, 5, 1.05
SETTINGS = {"none": None, "full60": (60, None, "auto"), "full10": (10, None, "auto"),
            "full60_delta10": (60, 10, "auto"), "full60_delta10_fingerprint": (60, 10, "fingerprint"),
            "ram_full10": (10, None, "auto"), "ram_full60_delta10": (60, 10, "auto")}


def child(setting: str) -> None:
    import numpy as np  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import sharded_table_model  # pylint: disable=import-outside-toplevel

    model, _cluster = sharded_table_model(ROWS, DIM, IDS)
    rng = np.random.default_rng(0)
    weights = np.arange(1, ROWS + 1, dtype=np.float64) ** -EXPONENT
    ids = rng.choice(ROWS, size=(BATCH * 64, IDS), p=weights / weights.sum()).astype(np.int64)
    labels = rng.random(BATCH * 64).astype(np.float32)
    data = tf.keras.utils.experimental.DatasetCreator(
        lambda _: tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH))
    model.fit(data, epochs=1, steps_per_epoch=WARMUP, verbose=0)  # trace
    result = {}
    with tempfile.TemporaryDirectory() as local:
        directory = f"ram://delta_bench/{setting}" if setting.startswith("ram_") else local
        callbacks, sync = [], None
        if SETTINGS[setting] is not None:
            every, delta, rows_by = SETTINGS[setting]
            sync = tf_psx.callbacks.PeriodicSync(every, directory, delta_every_n_steps=delta, delta_rows_by=rows_by)
            callbacks = [sync]
        start = time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=STEPS, verbose=0, callbacks=callbacks)
        result["ms_per_step"] = (time.perf_counter() - start) * 1000 / STEPS
        if sync is not None:
            result["snapshot_seconds"] = sync.snapshot_seconds
            result["delta_seconds"] = sync.delta_seconds
            result["delta_rows"] = sync.delta_rows
            newest = tf_psx.callbacks.PeriodicSync.latest(directory)
            result["full_bytes"] = sum(tf.io.gfile.stat(path).length
                                       for path in tf.io.gfile.glob(f"{newest.path}/ckpt.*"))
            result["delta_bytes"] = [json.loads(tf.io.gfile.GFile(path).read())["bytes"]
                                     for path in tf.io.gfile.glob(f"{directory}/snapshot-*/delta-*.json")]
    print(json.dumps(result), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)


def main() -> None:
    from _common import run_child, write_result  # pylint: disable=import-outside-toplevel

    runs = {setting: run_child(__file__, setting) for setting in SETTINGS}
    base = runs["none"]["ms_per_step"]

    def window(setting: str) -> int:
        every, delta, _ = SETTINGS[setting]
        return delta or every

    rows = []
    for setting in [name for name in SETTINGS if name != "none"]:
        run = runs[setting]
        steps = window(setting)
        rows.append({"metric": f"{setting}: ms per step (none: {base:.1f})", "value": round(run["ms_per_step"], 1),
                     "unit": "ms"})
        rows.append({"metric": f"{setting}: cost per step against none", "value": round(run["ms_per_step"] / base, 3),
                     "unit": "x"})
        rows.append({"metric": f"{setting}: updates a crash loses, at most", "value": f"{steps} steps = "
                     f"{steps * run['ms_per_step'] / 1000:.1f} s"})
    delta_run = runs["full60_delta10"]
    rows += [
        {"metric": "full snapshot: seconds (median, full60)", "value": round(statistics.median(
            runs["full60"]["snapshot_seconds"]), 3), "unit": "s"},
        {"metric": "delta: seconds (median), by marks", "value": round(statistics.median(delta_run["delta_seconds"]), 3),
         "unit": "s"},
        {"metric": "delta: seconds (median), by fingerprint",
         "value": round(statistics.median(runs["full60_delta10_fingerprint"]["delta_seconds"]), 3), "unit": "s"},
        {"metric": "delta: rows (median; table and slot rows)", "value": int(statistics.median(
            delta_run["delta_rows"]))},
        {"metric": "delta bytes / full checkpoint bytes (newest delta)",
         "value": round(max(delta_run["delta_bytes"]) / delta_run["full_bytes"], 4)},
        {"metric": "full60_delta10 / full10 ms per step (same loss window)",
         "value": round(delta_run["ms_per_step"] / runs["full10"]["ms_per_step"], 3), "unit": "x"},
        {"metric": "full60_delta10_fingerprint / full10 ms per step (same loss window)",
         "value": round(runs["full60_delta10_fingerprint"]["ms_per_step"] / runs["full10"]["ms_per_step"], 3),
         "unit": "x"},
        {"metric": "on ram://: full60_delta10 / full10 ms per step (same loss window)",
         "value": round(runs["ram_full60_delta10"]["ms_per_step"] / runs["ram_full10"]["ms_per_step"], 3),
         "unit": "x"},
    ]
    write_result(
        "delta_snapshots",
        f"{STEPS} fit steps of a {ROWS:,} x {DIM} ShardedEmbedding (fixed:2) with Adagrad + Dense(1), batch {BATCH} "
        f"x {IDS} Zipf ids (exponent {EXPONENT}); in-process LocalCluster with 1 worker and 2 ps; local directory; "
        "each setting in a fresh process. Loss window = steps since the newest snapshot or delta, at most.",
        rows,
        extra=runs,
    )


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 1)
