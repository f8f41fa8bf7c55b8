"""Rows/s of the Criteo reader (`tf_psx.data.criteo`) on one core, against what training consumes.

A generated Criteo TSV file (`write_criteo_sample`, 200,000 rows plus 200
malformed lines at random places) is read to the end in batches of 512, in a fresh process,
with tf.data's private thread pool set to 1 thread ("one core") and with
tf.data's defaults (both cores). The training rate it is compared with is
the examples/s of the whole Criteo-shaped model with FeatureEmbeddings and 2
workers, read from bench/results/fused_embeddings.json (run that first).
Target (issue: speed where CTR models spend it): reader on one core >= 3x
the training rate. One round per setting, best of 2 passes over the file.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ROWS, BATCH = 200_000, 512
TARGET = 3.0


def child(threads: str, path: str) -> None:
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    best = 0.0
    for _ in range(2):
        dataset = tf_psx.data.criteo(path, BATCH)
        if threads != "default":
            options = tf.data.Options()
            options.threading.private_threadpool_size = int(threads)
            options.threading.max_intra_op_parallelism = 1
            dataset = dataset.with_options(options)
        start = time.perf_counter()
        rows = sum(int(label.shape[0]) for _, label in dataset)
        best = max(best, rows / (time.perf_counter() - start))
    print(json.dumps({"rows_per_s": best, "rows": rows}), flush=True)


def main() -> None:
    from _common import run_child, write_result  # pylint: disable=import-outside-toplevel

    from tf_psx.data import write_criteo_sample  # pylint: disable=import-outside-toplevel

    fused = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fused_embeddings.json")
    with open(fused, encoding="utf-8") as handle:
        training = json.load(handle)["raw"]["fused 2w 26f"]["examples_per_s"]
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "day_0.tsv")
        write_criteo_sample(path, ROWS, seed=0, malformed=ROWS // 1000)
        one = run_child(__file__, "1", path)
        default = run_child(__file__, "default", path)
    ratio = one["rows_per_s"] / training
    write_result(
        "reader_throughput",
        f"tf_psx.data.criteo over a generated {ROWS:,}-row Criteo TSV file (+{ROWS // 1000} malformed lines), batches of {BATCH}, best of 2 passes in a "
        "fresh process; 'one core' = tf.data private thread pool of 1 thread. Training rate: the whole "
        "Criteo-shaped model with FeatureEmbeddings and 2 workers (bench/results/fused_embeddings.json).",
        [
            {"metric": "reader rows/s, one core", "value": round(one["rows_per_s"])},
            {"metric": "reader rows/s, tf.data defaults (2 cores)", "value": round(default["rows_per_s"])},
            {"metric": "training examples/s (fused, 2 workers)", "value": round(training)},
            {"metric": "reader on one core / training rate", "value": round(ratio, 2), "target": f">= {TARGET}",
             "ok": ratio >= TARGET},
        ],
        extra={"one_core": one, "default": default},
    )


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 2)
