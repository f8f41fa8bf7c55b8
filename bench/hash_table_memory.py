"""Memory of a DynamicEmbedding under a row budget, against the unbounded table.

A generated stream of 3,000,000 key events drawn from an unbounded
Zipf(1.05) (numpy's `zipf`; about 1.6M distinct keys), 512 examples x 8 keys
per step, dim 16, Adagrad, on a LocalCluster with 1 worker and 2 ps task
processes. Bounded: `max_rows=100_000` with eviction (`policy.evict()`, what
TableEviction runs) every 50 steps. Every 50 steps the table's rows and the
ps processes' RSS (summed) are recorded. "Flat after warm-up" is measured as
the growth of rows and RSS from the end of the first quarter of the stream
to its end.

Also the disk tier's own throughput: rows (and their Adagrad slot) written
to and read back from a `DiskTier`, rows/s.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

EVENTS = 3_000_000
BATCH, KEYS_PER_EXAMPLE, DIM = 512, 8, 16
MAX_ROWS = 100_000
EVERY = 50
STEPS = EVENTS // (BATCH * KEYS_PER_EXAMPLE)


def child(variant: str) -> None:
    import numpy as np  # pylint: disable=import-outside-toplevel
    import psutil  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(0)
    keys = rng.zipf(1.05, size=(STEPS * BATCH, KEYS_PER_EXAMPLE)).astype(np.int64)
    labels = (rng.random(STEPS * BATCH) < 0.2).astype(np.float32)
    policy = {"max_rows": MAX_ROWS} if variant == "bounded" else {}
    with tf_psx.LocalCluster(num_workers=1, num_ps=2, processes=True) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster)
        with strategy.scope():
            inputs = tf.keras.Input((KEYS_PER_EXAMPLE,), dtype=tf.int64)
            layer = tf_psx.layers.DynamicEmbedding(DIM, name="events", **policy)
            pooled = tf.keras.layers.GlobalAveragePooling1D()(layer(inputs))
            model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(pooled))
            model.compile(tf.keras.optimizers.Adagrad(0.05), "binary_crossentropy")

        def rss() -> float:
            return sum(psutil.Process(cluster.pid("ps", i)).memory_info().rss for i in range(2)) / 2**20

        trace = []

        class Record(tf.keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                evict_s = locked_s = 0.0
                if layer.policy is not None:
                    report = layer.policy.evict()
                    evict_s, locked_s = report.seconds, report.locked_seconds
                trace.append({"step": (epoch + 1) * EVERY, "rows": layer.size(), "ps_rss_mib": round(rss(), 1),
                              "evict_s": round(evict_s, 3), "locked_s": round(locked_s, 3)})

        def dataset_fn(_ctx):
            return tf.data.Dataset.from_tensor_slices((keys, labels)).batch(BATCH)

        start = time.perf_counter()
        model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=STEPS // EVERY,
                  steps_per_epoch=EVERY, verbose=0, callbacks=[Record()])
        seconds = time.perf_counter() - start
        distinct = int(len(np.unique(keys[: (STEPS // EVERY) * EVERY * BATCH])))
    print(json.dumps({"trace": trace, "seconds": seconds, "distinct_keys": distinct}), flush=True)


def disk_rates() -> dict:
    import tempfile  # pylint: disable=import-outside-toplevel

    import numpy as np  # pylint: disable=import-outside-toplevel

    from tf_psx.tables import DiskTier  # pylint: disable=import-outside-toplevel

    rows = 200_000
    rng = np.random.default_rng(0)
    keys = rng.choice(10**12, size=rows, replace=False).astype(np.int64)
    values = rng.normal(size=(rows, DIM)).astype(np.float32)
    slots = rng.random((rows, DIM)).astype(np.float32)
    with tempfile.TemporaryDirectory() as directory:
        store = DiskTier(directory, DIM)
        start = time.perf_counter()
        for chunk in range(0, rows, 10_000):
            store.write(keys[chunk:chunk + 10_000], [values[chunk:chunk + 10_000], slots[chunk:chunk + 10_000]], 0)
        write_s = time.perf_counter() - start
        order = rng.permutation(rows)
        start = time.perf_counter()
        for chunk in range(0, rows, 10_000):
            found, parts = store.read(keys[order[chunk:chunk + 10_000]])
            assert np.array_equal(parts[0].astype(np.float32), values[order[chunk:chunk + 10_000]])
        read_s = time.perf_counter() - start
    return {"rows": rows, "write_rows_per_s": rows / write_s, "read_rows_per_s": rows / read_s}


IMAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "img", "hash_table_memory.png")


def plot(traces: dict) -> None:
    """Rows and ps RSS against steps, bounded and unbounded: docs/img/hash_table_memory.png."""
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    fig, (rows_axis, rss_axis) = plt.subplots(1, 2, figsize=(9, 3.6))
    for variant, trace in traces.items():
        steps = [point["step"] for point in trace]
        rows_axis.plot(steps, [point["rows"] for point in trace], marker="o", markersize=3, label=variant)
        rss_axis.plot(steps, [point["ps_rss_mib"] for point in trace], marker="o", markersize=3, label=variant)
    rows_axis.set_xlabel("step")
    rows_axis.set_ylabel("table rows")
    rss_axis.set_xlabel("step")
    rss_axis.set_ylabel("ps RSS, MiB (2 tasks)")
    for axis in (rows_axis, rss_axis):
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"DynamicEmbedding, max_rows={MAX_ROWS:,} against unbounded")
    fig.tight_layout()
    os.makedirs(os.path.dirname(IMAGE), exist_ok=True)
    fig.savefig(IMAGE, dpi=110)
    print(f"wrote {IMAGE}")


def main() -> None:
    from _common import add_images, run_child, write_result  # pylint: disable=import-outside-toplevel

    runs = {variant: run_child(__file__, variant, timeout=1200) for variant in ("bounded", "unbounded")}
    quarter = len(runs["bounded"]["trace"]) // 4
    rows = []
    for variant, run in runs.items():
        trace = run["trace"]
        early, last = trace[quarter - 1], trace[-1]
        peak = max(point["ps_rss_mib"] for point in trace)
        rows += [
            {"metric": f"{variant}: table rows at 1/4 of the stream -> end", "value": f"{early['rows']} -> {last['rows']}"},
            {"metric": f"{variant}: ps RSS MiB at 1/4 -> end (peak)",
             "value": f"{early['ps_rss_mib']} -> {last['ps_rss_mib']} ({peak})"},
            {"metric": f"{variant}: ps RSS growth after 1/4 of the stream", "value": round(last["ps_rss_mib"] / early["ps_rss_mib"], 3),
             "target": "flat (bounded)" if variant == "bounded" else None},
            {"metric": f"{variant}: seconds for the stream", "value": round(run["seconds"], 1), "unit": "s"},
        ]
    def median(key):
        values = sorted(p[key] for p in runs["bounded"]["trace"] if p["evict_s"])
        return round(values[len(values) // 2], 3)

    step_s = runs["bounded"]["seconds"] / STEPS
    rows += [
        {"metric": "bounded: seconds per eviction run (median)", "value": median("evict_s"), "unit": "s"},
        {"metric": "bounded: of which under the table's locks (median)", "value": median("locked_s"), "unit": "s"},
        {"metric": "bounded: mean step time over the stream", "value": round(step_s, 4), "unit": "s"},
    ]
    disk = disk_rates()
    rows += [
        {"metric": "disk tier write, rows (+ slot) per s", "value": round(disk["write_rows_per_s"])},
        {"metric": "disk tier read back (random order), rows per s", "value": round(disk["read_rows_per_s"])},
    ]
    for variant, run in runs.items():
        print(variant, json.dumps(run["trace"]))
    plot({variant: run["trace"] for variant, run in runs.items()})
    path = write_result(
        "hash_table_memory",
        f"{STEPS * BATCH * KEYS_PER_EXAMPLE:,} key events from numpy zipf(1.05) "
        f"({runs['bounded']['distinct_keys']:,} distinct), {BATCH} x {KEYS_PER_EXAMPLE} keys per step, dim {DIM}, "
        f"Adagrad; LocalCluster 1 worker + 2 ps task processes; bounded = max_rows={MAX_ROWS:,} evicted every "
        f"{EVERY} steps; RSS summed over the 2 ps processes. Disk tier: {disk['rows']:,} rows of dim {DIM} + one slot.",
        rows,
        extra={"traces": {variant: run["trace"] for variant, run in runs.items()}, "disk": disk},
    )
    add_images(path, ["img/hash_table_memory.png"])


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 1)
