"""The Zipf batches that shard_balance.py and dedup_bytes.py share."""

from __future__ import annotations

import numpy as np

NUM_IDS = 1_000_000
EXPONENT = 1.05
BATCH = 4096
NUM_BATCHES = 50
SEED = 0


def zipf_batches() -> np.ndarray:
    """int64 [NUM_BATCHES, BATCH]: frequency-sorted ids (id 0 the most frequent).

    P(id = k) is proportional to (k + 1) ** -EXPONENT over [0, NUM_IDS): a
    bounded Zipf, as after building a vocabulary by counting.
    """
    weights = np.arange(1, NUM_IDS + 1, dtype=np.float64) ** -EXPONENT
    rng = np.random.default_rng(SEED)
    return rng.choice(NUM_IDS, size=(NUM_BATCHES, BATCH), p=weights / weights.sum()).astype(np.int64)
