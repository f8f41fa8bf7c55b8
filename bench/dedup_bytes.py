"""Embedding bytes moved per step with ShardedEmbedding dedup on and off.

Same Zipf batches as shard_balance.py (1e6 ids, Zipf(1.05), 4096 ids per
batch), dim 32, float32. Per step a lookup moves each gathered row from its
ps to the worker, and the gradient moves the same rows back (an
IndexedSlices with one row per gathered id). The row counts are measured on
the layer itself: the rows of the IndexedSlices gradient that
`tf.GradientTape` returns for the table, which is what the worker sends to
the ps tasks; forward bytes equal them. Measured in one process (no
cluster), since the count does not depend on where the shards live.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DIM = 32
BYTES_PER_FLOAT = 4
# Forward rows plus the same rows of gradient back.
DIRECTIONS = 2


def _rows_moved(layer, batch) -> int:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant(batch)))
    grad = tape.gradient(loss, layer.embeddings)
    assert isinstance(grad, tf.IndexedSlices), type(grad)
    return int(grad.values.shape[0])


def main() -> None:
    import numpy as np  # pylint: disable=import-outside-toplevel

    from _common import write_result  # pylint: disable=import-outside-toplevel
    from _zipf import BATCH, NUM_BATCHES, NUM_IDS, zipf_batches  # pylint: disable=import-outside-toplevel

    from tf_psx.layers import ShardedEmbedding  # pylint: disable=import-outside-toplevel

    ids = zipf_batches()
    rows_moved = {}
    for dedup in (False, True):
        layer = ShardedEmbedding(NUM_IDS, DIM, dedup=dedup)
        layer.build((None,))
        rows_moved[dedup] = [_rows_moved(layer, batch) for batch in ids]
    unique = [len(np.unique(batch)) for batch in ids]
    assert rows_moved[True] == unique, "dedup must move each distinct row once"
    off, on = (float(np.mean(rows_moved[d])) * DIM * BYTES_PER_FLOAT * DIRECTIONS for d in (False, True))
    print(f"bytes/step dedup off {off:.0f}, on {on:.0f}, ratio {on / off:.3f}")
    write_result(
        "dedup_bytes",
        f"Embedding bytes per step (rows gathered + gradient rows back, float32, dim {DIM}), mean over "
        f"{NUM_BATCHES} Zipf(1.05) batches of {BATCH} ids over {NUM_IDS} ids; rows counted from the "
        "IndexedSlices gradient of tf_psx.layers.ShardedEmbedding.",
        [
            {"metric": "dedup off: bytes per step", "value": round(off), "unit": "B"},
            {"metric": "dedup on: bytes per step", "value": round(on), "unit": "B"},
            {"metric": "dedup on / off", "value": round(on / off, 4)},
            {"metric": "distinct ids per batch (mean)", "value": round(float(np.mean(unique)), 1)},
        ],
        extra={"rows_moved_off": rows_moved[False], "rows_moved_on": rows_moved[True]},
    )


if __name__ == "__main__":
    main()
