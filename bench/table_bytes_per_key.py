"""Bytes per key of a hash table on its ps task as it grows to 10M keys, and a step's update at 10M against 100k keys.

One process, no cluster: what one ps task holds for its shard. Keys are
inserted in chunks of 250,000 (uniform int64), width 16 with Adam's two
slots. After each chunk the process's RSS (current) and its peak
(`ru_maxrss`, which catches the moment a table grows and holds its old and
new buckets at once) are read; bytes per key is (RSS - RSS before the
table) / keys. Raw bytes: the key (8) and its value (the row, 2 slots and
the bookkeeping: (16 x 3 + 3) x 4), 212 B.

* native: tf_psx's `NativeTable` shard (`DenseHashTable`, the value packed).
* tfra (where TFRA is installed): TFRA's layout under Adam, three tables
  of 16 floats (row, m, v), each holding the key.

Step time: the update of one CTR step (~53,000 distinct keys of the table,
find + Adam's rule + insert, tf_psx.tables.updates' kernels) on a table of
10M keys against one of 100k, windows interleaved in the same process.

`python bench/table_bytes_per_key.py [--keys 10000000]`. Writes
bench/results/table_bytes_per_key.json (run it on the TFRA stack too for
TFRA's figure: bench/results/tf2.16/).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

DIM, SLOTS, CHUNK = 16, 2, 250_000
STEP_KEYS = 2048 * 26  # drawn with repeats: ~53,000 distinct
TARGET_BYTES, TARGET_STEP = 2.0, 1.2


def _rss_mb() -> float:
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(store: str, total: str) -> None:
    import tf_psx  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_psx.tables import native, updates  # pylint: disable=import-outside-toplevel

    total = int(total)
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(1, 2**62, size=int(total * 1.001)))[:total]
    rng.shuffle(keys)
    width = DIM * (1 + SLOTS) + native.BOOKKEEPING
    raw = 8 + 4 * width
    values = tf.zeros([CHUNK, width if store == "native" else DIM])
    base = _rss_mb()
    if store == "native":
        table = native.NativeTable("bench", DIM, SLOTS, [None])

        def insert(part):
            table.shards[0].insert(tf.constant(part), values[: len(part)])
    else:
        from tf_psx._tf import tfra as _tfra  # pylint: disable=import-outside-toplevel

        de = _tfra.tfra()
        tables = [de.get_variable(f"bench_{part}", tf.int64, tf.float32, dim=DIM, initializer=0.0)
                  for part in ("row", "m", "v")]

        def insert(part):
            for one in tables:
                one.upsert(tf.constant(part), values[: len(part)])
    points = []
    for start in range(0, total, CHUNK):
        insert(keys[start:start + CHUNK])
        held = min(start + CHUNK, total)
        points.append({"keys": held, "bytes_per_key": (_rss_mb() - base) * 2**20 / held,
                       "peak_bytes_per_key": (_peak_mb() - base) * 2**20 / held})
    result = {"store": store, "raw_bytes_per_key": raw, "points": points}
    if store == "native":
        result["step_ms"] = _step_times(tf, native, updates, table, keys, rng)
    print(json.dumps(result), flush=True)


def _step_times(tf, native, updates, big, keys, rng) -> dict:
    """ms of one CTR step's update on `big` (all its keys) and on a table of 100k keys, windows interleaved."""
    small = native.NativeTable("small", DIM, SLOTS, [None])
    small_keys = keys[:100_000]
    small.shards[0].insert(tf.constant(small_keys), tf.zeros([len(small_keys), big.width]))
    rule = updates.TableRule.for_optimizer(tf.keras.optimizers.Adam(0.001))

    def update_of(table, pool):
        step = tf.constant(np.unique(rng.choice(pool, size=STEP_KEYS)))
        grad = tf.random.normal([int(step.shape[0]), DIM])
        shard = table.shards[0]

        @tf.function
        def update():
            found = shard.lookup(step)
            rows, slots = rule.apply(found[:, :DIM], found[:, DIM:3 * DIM], grad, tf.constant(0.001),
                                     tf.constant(10.0), DIM)
            value = tf.concat([rows, slots, found[:, -native.BOOKKEEPING:]], axis=1)
            with tf.control_dependencies([shard.insert(step, value)]):
                return tf.constant(0)

        return update

    fns = {"10M": update_of(big, keys), "100k": update_of(small, small_keys)}
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(7):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(10):
                fn()
            times[name].append((time.perf_counter() - start) / 10 * 1000)
    return times


def main() -> None:
    from _common import ratio_row, run_child, spread_text, write_result  # pylint: disable=import-outside-toplevel
    from tf_psx._tf import tfra as _tfra  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=10_000_000)
    args = parser.parse_args()
    stores = ["native"] + (["tfra"] if _tfra.tfra_installed() else [])
    runs = {store: run_child(__file__, store, str(args.keys), timeout=3600) for store in stores}
    rows = []
    for store, run in runs.items():
        raw = run["raw_bytes_per_key"]
        for at in (1_000_000, args.keys):
            point = next(p for p in run["points"] if p["keys"] >= at)
            rows.append({"metric": f"{store}: bytes per key at {point['keys']:,} keys / raw {raw} B",
                         "value": round(point["bytes_per_key"] / raw, 3), "target": f"<= {TARGET_BYTES}",
                         "ok": point["bytes_per_key"] / raw <= TARGET_BYTES,
                         "note": f"{point['bytes_per_key']:.0f} B per key"})
        worst = max(run["points"], key=lambda p: p["peak_bytes_per_key"] if p["keys"] >= CHUNK * 4 else 0)
        rows.append({"metric": f"{store}: worst point of growth from 1M keys (peak RSS) / raw",
                     "value": round(worst["peak_bytes_per_key"] / raw, 3), "target": f"<= {TARGET_BYTES}",
                     "ok": worst["peak_bytes_per_key"] / raw <= TARGET_BYTES,
                     "note": f"at {worst['keys']:,} keys: {worst['peak_bytes_per_key']:.0f} B per key"})
        if "step_ms" in run:
            big, small = run["step_ms"]["10M"], run["step_ms"]["100k"]
            rows.append({"metric": f"{store}: a CTR step's update ms, 10M-key table (100k-key table)",
                         "value": f"{spread_text(big)} ({spread_text(small)})", "ok": None})
            rows.append(ratio_row(f"{store}: step update at {args.keys:,} keys / at 100k keys",
                                  [a / b for a, b in zip(big, small)], TARGET_STEP, higher_is_better=False))
    write_result("table_bytes_per_key", f"one process, no cluster: a hash table's shard grown to {args.keys:,} keys "
                 f"in chunks of {CHUNK:,}, dim {DIM}, Adam (2 slots), RSS after each chunk and peak RSS; a CTR "
                 "step's update (find + Adam + insert of ~53k keys) on it against a 100k-key table, 7 interleaved "
                 "windows of 10", rows, runs)


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 2)
