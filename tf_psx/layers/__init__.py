"""Embedding layers for tables sharded over parameter servers.

* `ShardedEmbedding` (`tf_psx.layers.sharded`): a fixed vocabulary, a
  drop-in for `tf.keras.layers.Embedding`, with shard-balanced row placement
  and deduplicated lookups.
* `DynamicEmbedding` (`tf_psx.layers.hash_table`): a TFRA hash table on the
  ps tasks, sized by the keys seen, not by a vocabulary.
* `FeatureEmbeddings`, `DynamicFeatureEmbeddings` (`tf_psx.layers.fused`):
  many features in one table of either kind, one lookup per step for all.

`tf_psx.layers.wire` holds `wire_dtype` (half-float rows on the wire) and
`tf_psx.layers.common` the tf-keras registration the layers share: saved
models name a layer "tf_psx>ClassName", not its module.
"""

from tf_psx.layers.fused import (  # noqa: F401  (the names `tf_psx.layers.X` has always had)
    FEATURE_KEY_BITS,
    MAX_DYNAMIC_FEATURES,
    DynamicFeatureEmbeddings,
    FeatureEmbeddings,
    check_feature_dict,
    fold_feature_keys,
    split_feature_rows,
)
from tf_psx.layers.hash_table import (  # noqa: F401
    DEFAULT_INIT_STDDEV,
    STRING_KEY_BUCKETS,
    UNSEEN_KEY_DEFAULT,
    DynamicEmbedding,
    table_keys,
)
from tf_psx.layers.sharded import MAX_BALANCED_INPUT_DIM, ShardedEmbedding, balanced_permutation  # noqa: F401

__all__ = ["ShardedEmbedding", "FeatureEmbeddings", "DynamicEmbedding", "DynamicFeatureEmbeddings",
           "balanced_permutation"]
