"""Training stalled per PeriodicSync snapshot: synchronous writes against background writes.

A 2,000,000 x 16 ShardedEmbedding (fixed:2) with Adagrad (so 2 x 128 MB of
table and slot) plus Dense(1), in-process LocalCluster with 1 worker and 2
ps, batch 256 x 4 ids; `model.fit` of 300 steps with PeriodicSync every 60
steps to a local directory (an interval longer than one write: a background
write still running when the next snapshot comes is waited for, and that
wait counts as stall). Stall per snapshot = the seconds the callback
holds the training loop (`snapshot_seconds`: the barrier, plus the write
when synchronous, plus the copy and any wait for the previous write when in
the background). Each mode in a fresh process. Target (issue: production
operations): background stall <= 0.2x synchronous stall.
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

ROWS, DIM, IDS, BATCH, STEPS, EVERY = 2_000_000, 16, 4, 256, 300, 60
TARGET = 0.2


def child(mode: str) -> None:
    import numpy as np  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import sharded_table_model  # pylint: disable=import-outside-toplevel

    model, _cluster = sharded_table_model(ROWS, DIM, IDS)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ROWS, size=(BATCH * 16, IDS))
    labels = rng.random(BATCH * 16).astype(np.float32)
    data = tf.keras.utils.experimental.DatasetCreator(
        lambda _: tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH))
    model.fit(data, epochs=1, steps_per_epoch=5, verbose=0)  # trace
    with tempfile.TemporaryDirectory() as directory:
        sync = tf_psx.callbacks.PeriodicSync(EVERY, directory, background=(mode == "background"))
        start = time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=STEPS, verbose=0, callbacks=[sync])
        seconds = time.perf_counter() - start
        count = len(tf_psx.callbacks.PeriodicSync.snapshots(directory))
    print(json.dumps({"stalls": sync.snapshot_seconds, "fit_seconds": seconds, "snapshots_kept": count}), flush=True)
    os._exit(0)  # pylint: disable=protected-access  (in-process servers cannot be stopped)


def main() -> None:
    from _common import run_child, write_result  # pylint: disable=import-outside-toplevel

    runs = {mode: run_child(__file__, mode) for mode in ("sync", "background")}
    stall = {mode: statistics.median(run["stalls"]) for mode, run in runs.items()}
    ratio = stall["background"] / stall["sync"]
    write_result(
        "snapshot_stall",
        f"PeriodicSync every {EVERY} steps over {STEPS} steps of a {ROWS:,} x {DIM} ShardedEmbedding (fixed:2) with "
        f"Adagrad + Dense(1), batch {BATCH} x {IDS} ids; in-process LocalCluster with 1 worker and 2 ps; local "
        "directory; stall = seconds the callback holds the training loop (median over the snapshots).",
        [
            {"metric": "synchronous writes: stall per snapshot (median)", "value": round(stall["sync"], 3), "unit": "s"},
            {"metric": "background writes: stall per snapshot (median)", "value": round(stall["background"], 3),
             "unit": "s"},
            {"metric": "background / synchronous stall", "value": round(ratio, 3), "target": f"<= {TARGET}",
             "ok": ratio <= TARGET},
            {"metric": "fit seconds, synchronous / background",
             "value": f"{runs['sync']['fit_seconds']:.1f} / {runs['background']['fit_seconds']:.1f}"},
        ],
        extra=runs,
    )


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 1)
