"""Bytes on the wire of a DynamicEmbedding step with `wire_dtype="bfloat16"` against float32, counted by a relay.

Every byte to or from each of the 2 ps task processes and the worker
crosses a `tf_psx.cluster.netproxy.DelayProxy` with no delay (bench/
ps_latency.py's cluster, the worker relayed too), which counts them. TF
moves a tensor by a pull: what the worker sends a ps task, the ps task
fetches over its own connection to the worker, so a relay in front of the
ps tasks alone sees only the rows coming back. The model is a hash
table only: DynamicEmbedding (TFRA) of FIELDS keys per example, the rows
averaged over the embedding width into a Dense(1) over the fields (so no
dense variable grows with the width), SGD, batch BATCH, STEPS steps of the
same Zipf keys, exact updates (the default). Each (wire dtype, width) runs
in a fresh process, the order rotated over the rounds.

Value bytes: everything else on the wire (keys, the function calls, the
head's weights, gRPC framing) does not depend on the embedding width, so
the value bytes of a step are the slope of the relayed bytes over the width
(widths DIMS), times the width. What crosses as values: the rows a lookup
reads (ps -> worker), and the gradient and the forward rows of the keys
absent at the lookup that the exact update sends to the shard's ps task
(worker -> ps); the share of keys new in their step is reported beside. Target (issue 30): the
bfloat16 value bytes <= 0.55x of float32's.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FIELDS, BATCH, STEPS, KEYS = 8, 256, 60, 200_000
DIMS = (16, 64)
WIRES = ("float32", "bfloat16")
ROUNDS = 2
TARGET = 0.55


def _keys():
    import numpy as np  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(0)
    ranks = np.minimum(rng.zipf(1.1, size=(BATCH * STEPS, FIELDS)), KEYS)
    # Large sparse int64 keys, as hashed categories are.
    return (ranks * 7_919 + 10**12).astype(np.int64)


def child(wire: str, dim: str) -> None:
    import time  # pylint: disable=import-outside-toplevel

    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel

    from ps_latency import _delayed_cluster  # pylint: disable=import-outside-toplevel

    keys = _keys()
    labels = (keys[:, 0] % 3 == 0).astype(np.float32)
    config, stop = _delayed_cluster(0.0, relay_worker=True)
    try:
        os.environ["TF_CONFIG"] = config.to_json("chief", 0)
        strategy = tf_psx.ParameterServerStrategy()
        with strategy.scope():
            inputs = tf.keras.Input((FIELDS,), dtype=tf.int64)
            rows = tf_psx.layers.DynamicEmbedding(int(dim), wire_dtype=None if wire == "float32" else wire)(inputs)
            pooled = tf.keras.layers.Lambda(lambda r: tf.reduce_mean(r, axis=-1))(rows)
            model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(pooled))
            model.compile(tf.keras.optimizers.SGD(0.1), "binary_crossentropy")

        def dataset(_ctx=None):
            return tf.data.Dataset.from_tensor_slices((keys, labels)).batch(BATCH)

        start = time.monotonic()
        model.fit(tf.keras.utils.experimental.DatasetCreator(dataset), epochs=1, steps_per_epoch=STEPS, verbose=0)
        seconds = time.monotonic() - start
        table_dtype = model.layers[1].table.value_dtype.name
    finally:
        stats = stop()
    relayed = sum(route["bytes_up"] + route["bytes_down"] for route in stats.values())
    print(json.dumps({"relayed_bytes": relayed, "fit_s": seconds, "table_dtype": table_dtype}), flush=True)


def main() -> None:
    import numpy as np  # pylint: disable=import-outside-toplevel

    from _common import interleaved, ratio_row, spread_text, write_result  # pylint: disable=import-outside-toplevel

    keys = _keys()
    steps = [np.unique(keys[s * BATCH:(s + 1) * BATCH]) for s in range(STEPS)]
    distinct = float(np.mean([len(step) for step in steps]))
    # Keys first seen in their step: the exact update sends their forward rows too.
    seen, new = set(), 0
    for step in steps:
        new += len(set(step.tolist()) - seen)
        seen.update(step.tolist())
    new_share = new / (distinct * STEPS)
    variants = [(wire, dim) for wire in WIRES for dim in DIMS]
    runs = interleaved(__file__, variants, rounds=ROUNDS)
    low, high = DIMS
    # Per round: value bytes per step and per unit of width (the slope over the widths).
    slope = {wire: [(b["relayed_bytes"] - a["relayed_bytes"]) / (high - low) / STEPS
                    for a, b in zip(runs[(wire, low)], runs[(wire, high)])] for wire in WIRES}
    ratio = [narrow / wide for narrow, wide in zip(slope["bfloat16"], slope["float32"])]
    rows = [ratio_row("value bytes on the wire: bfloat16 / float32", ratio, TARGET, higher_is_better=False)]
    for wire in WIRES:
        rows.append({"metric": f"{wire}: value bytes per step at dim {high}",
                     "value": spread_text([s * high for s in slope[wire]]), "unit": "B"})
        rows.append({"metric": f"{wire}: value bytes per distinct key and width unit",
                     "value": spread_text([s / distinct for s in slope[wire]])})
        for dim in DIMS:
            rows.append({"metric": f"{wire} dim {dim}: relayed bytes per step (all)",
                         "value": spread_text([r["relayed_bytes"] / STEPS for r in runs[(wire, dim)]]), "unit": "B"})
    rows.append({"metric": "keys new in their step (share of the distinct keys)", "value": round(new_share, 4)})
    assert all(r["table_dtype"] == "float32" for variant in variants for r in runs[variant])
    write_result(
        "hash_table_wire",
        f"DynamicEmbedding (TFRA, 2 ps, 1 worker, exact updates), {FIELDS} Zipf(1.1) keys per example, batch "
        f"{BATCH} ({distinct:.0f} distinct keys per step), SGD, {STEPS} steps; every byte to or from a ps task or "
        f"the worker counted by a relay (DelayProxy, no delay); value bytes = the slope of the "
        f"relayed bytes over the width ({low} -> {high}); each (wire dtype, width) a fresh process, "
        f"{ROUNDS} rotated rounds. The table stays float32.",
        rows,
        extra={"runs": {f"{wire} {dim}": runs[(wire, dim)] for wire, dim in variants}, "distinct_keys": distinct,
               "new_key_share": new_share},
    )


if __name__ == "__main__":
    from _common import entry  # noqa: E402  pylint: disable=wrong-import-position

    entry(child, main, 2)
