"""The split of a native hash table's update (find, rule, insert, initial rows), and the store it is built on.

One process, no cluster: the kernels a ps task runs for one shard's update
of one step (tf_psx.tables.updates), each timed alone in a `tf.function`
on a table already holding the keys (the steady state of training), at
two scales:

* small: the model of bench/dynamic_vs_static.py, ~2,000 distinct keys a
  step (batch 256 x 8 uniform ids of 100k), dim 32, Adam (a value of
  32 x 3 + 2 floats);
* CTR: ~53,000 distinct keys a step (batch 2048 x 26 uniform ids of 2M),
  dim 16, Adam (16 x 3 + 2 floats).

Rows:
* find, rule, insert: ms per step of `DenseHashTable.lookup`, the Adam rule
  on the found rows (tf_psx.tables.updates.TableRule), `insert`; and the
  three in one function (what the ps runs under the shard's lock);
* initial rows: `draw_rows` for every key of the step (only absent keys pay
  it in training: all of them on a step of new keys);
* the same find then insert on `MutableHashTable` and on TFRA's layout
  where TFRA is installed (three tables of dim floats: row, m, v), against
  `DenseHashTable` with the packed value: why the store is `DenseHashTable`.

The transfer between worker and ps tasks is not here: bench/dynamic_vs_static.py's
`--split` times the step with the table's update against the step without it, on a cluster.

`python bench/native_table_split.py [--reps N] [--windows W]`. Writes bench/results/native_table_split.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

SCALES = {
    # name: (distinct keys a step, key space, dim)
    "small": (256 * 8, 100_000, 32),
    "CTR": (2048 * 26, 2_000_000, 16),
}
REPS, WINDOWS = 30, 5


def _distinct(rng, count: int, space: int) -> np.ndarray:
    """The distinct keys of one step: `count` uniform draws from `space`, deduplicated."""
    return np.unique(rng.integers(0, space, size=count)).astype(np.int64)


def _timed(fn, reps: int, windows: int) -> list[float]:
    """ms per call of `fn()`, one number per window (the mean of `reps` calls after a warm-up)."""
    fn()
    out = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - start) / reps * 1000)
    return out


def measure(scale: str, reps: int, windows: int) -> dict:
    import tf_psx  # pylint: disable=import-outside-toplevel,unused-import  (first: tf.keras is tf-keras)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_psx.tables import native, updates  # pylint: disable=import-outside-toplevel

    count, space, dim = SCALES[scale]
    rng = np.random.default_rng(0)
    # The table holds the keys of 20 earlier steps; the timed step's keys are all in it.
    history = np.unique(np.concatenate([_distinct(rng, count, space) for _ in range(20)]))
    step_keys = tf.constant(rng.choice(history, size=len(_distinct(rng, count, space)), replace=False))
    grad = tf.random.normal([int(step_keys.shape[0]), dim])
    table = native.NativeTable("bench", dim, 2, [None])
    table.import_values(history, np.zeros([len(history), table.width], np.float32))
    shard = table.shards[0]
    rule = updates.TableRule.for_optimizer(tf.keras.optimizers.Adam(0.001))
    lr, step = tf.constant(0.001), tf.constant(10.0)
    found_value = shard.lookup(step_keys)

    @tf.function
    def find():
        return shard.lookup(step_keys)

    @tf.function
    def apply_rule():
        return rule.apply(found_value[:, :dim], found_value[:, dim:3 * dim], grad, lr, step, dim)

    def done(op):
        """A tensor that waits for `op` (a tf.function returns tensors only)."""
        with tf.control_dependencies([op]):
            return tf.constant(0)

    @tf.function
    def insert():
        return done(shard.insert(step_keys, found_value))

    @tf.function
    def whole():
        found = shard.lookup(step_keys)
        rows, slots = rule.apply(found[:, :dim], found[:, dim:3 * dim], grad, lr, step, dim)
        return done(shard.insert(step_keys, tf.concat([rows, slots, found[:, -native.BOOKKEEPING:]], axis=1)))

    @tf.function
    def draw():
        return native.draw_rows(step_keys, dim, ("normal", 0.0, 0.05, None), 7)

    mutable = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, tf.zeros([table.width]))
    mutable.insert(tf.constant(history), tf.zeros([len(history), table.width]))

    @tf.function
    def mutable_find_insert():
        found = mutable.lookup(step_keys)
        return done(mutable.insert(step_keys, found + 1.0))

    @tf.function
    def dense_find_insert():
        found = shard.lookup(step_keys)
        return done(shard.insert(step_keys, found + 1.0))

    results = {"distinct_keys": int(step_keys.shape[0]), "table_keys": int(len(history)), "dim": dim,
               "value_floats": table.width}
    for name, fn in (("find", find), ("rule", apply_rule), ("insert", insert), ("whole update", whole),
                     ("initial rows of every key", draw), ("DenseHashTable find+insert", dense_find_insert),
                     ("MutableHashTable find+insert", mutable_find_insert)):
        results[name] = _timed(fn, reps, windows)
    tfra_time = _tfra_find_insert(tf, history, step_keys, dim, reps, windows)
    if tfra_time is not None:
        results["TFRA three tables find+insert"] = tfra_time
    return results


def _tfra_find_insert(tf, history, step_keys, dim: int, reps: int, windows: int):
    """TFRA's layout (row, m, v in three tables), find then insert each; None where TFRA is absent."""
    from tf_psx._tf import tfra as _tfra  # pylint: disable=import-outside-toplevel

    if not _tfra.tfra_installed():
        return None
    de = _tfra.tfra()
    tables = [de.get_variable(f"bench_{part}", tf.int64, tf.float32, dim=dim, initializer=0.0)
              for part in ("row", "m", "v")]
    for table in tables:
        table.upsert(tf.constant(history), tf.zeros([len(history), dim]))

    @tf.function
    def find_insert():
        with tf.control_dependencies([table.upsert(step_keys, table.lookup(step_keys) + 1.0) for table in tables]):
            return tf.constant(0)

    return _timed(find_insert, reps, windows)  # (its group is an op: run for its effect)


def main() -> None:
    from _common import ratio_row, spread_text, write_result  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--windows", type=int, default=WINDOWS)
    args = parser.parse_args()
    rows, raw = [], {}
    for scale in SCALES:
        result = measure(scale, args.reps, args.windows)
        raw[scale] = result
        for name, values in result.items():
            if isinstance(values, list):
                rows.append({"metric": f"{scale} ({result['distinct_keys']} keys, value of {result['value_floats']} "
                                       f"floats): {name} ms/step",
                             "value": spread_text(values), "ok": None})
        dense = result["DenseHashTable find+insert"]
        for other in ("MutableHashTable find+insert", "TFRA three tables find+insert"):
            if other in result:  # per window: the two were timed in the same process, one after the other
                rows.append(ratio_row(f"{scale}: {other} / DenseHashTable find+insert (packed value)",
                                      [a / b for a, b in zip(result[other], dense)]))
    setup = ("One process, no cluster: one shard's update of one step, each part timed alone in a tf.function "
             f"(median of {args.windows} windows of {args.reps} calls, spread min-max), on a DenseHashTable already "
             "holding 20 steps' keys; Adam's rule; small: the dynamic_vs_static model, CTR: batch 2048 x 26 of 2M.")
    print(write_result("native_table_split", setup, rows, extra=raw))


if __name__ == "__main__":
    main()
