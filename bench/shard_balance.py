"""Max / mean of the distinct rows each shard serves per batch, per placement.

Setup (issue 3): Zipf(1.05) over 1e6 frequency-sorted ids, batches of 4096,
8 shards. Placements: "div" (contiguous ranges: TF's Fixed/MinSize/MaxSize
partitioners and a plain Embedding), "mod" (id % 8) and
tf_psx.layers.ShardedEmbedding with balance and dedup on. The counts come
from tf_psx.partitioners.shard_load, the function behind `tf-psx
shard-report`. Target: <= 1.10 for ShardedEmbedding.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHARDS = 8
TARGET = 1.10


def main() -> None:
    from _common import write_result  # pylint: disable=import-outside-toplevel
    from _zipf import BATCH, NUM_BATCHES, NUM_IDS, zipf_batches  # pylint: disable=import-outside-toplevel

    from tf_psx.layers import ShardedEmbedding  # pylint: disable=import-outside-toplevel
    from tf_psx.partitioners import shard_load  # pylint: disable=import-outside-toplevel

    ids = zipf_batches()
    layer = ShardedEmbedding(NUM_IDS, 16, balance=True, dedup=True)
    rows = []
    raw = {}
    for label, placement in (("div", "div"), ("mod", "mod"), ("ShardedEmbedding", layer)):
        load = shard_load(ids, NUM_IDS, SHARDS, placement=placement, batch_size=BATCH)
        print(load.table(), flush=True)
        is_ours = label == "ShardedEmbedding"
        rows.append({
            "metric": f"{label}: unique rows per shard per batch, max/mean",
            "value": round(load.imbalance, 4),
            "target": f"<= {TARGET}" if is_ours else "-",
            "ok": (load.imbalance <= TARGET) if is_ours else None,
        })
        rows.append({"metric": f"{label}: lookups per shard, max/mean", "value": round(load.lookup_imbalance, 4)})
        raw[label] = {"unique_per_batch": load.unique_per_batch.tolist(), "lookups": load.lookups.tolist()}
    write_result(
        "shard_balance",
        f"Zipf(1.05) over {NUM_IDS} frequency-sorted ids, {NUM_BATCHES} batches of {BATCH} ids, {SHARDS} shards; "
        "tf_psx.partitioners.shard_load per placement (div = contiguous ranges, as TF's partitioners place rows).",
        rows,
        extra=raw,
    )


if __name__ == "__main__":
    main()
