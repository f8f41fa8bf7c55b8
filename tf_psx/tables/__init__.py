"""Hash tables: tf_psx's own tables on TensorFlow's ops, their updates, and the lifecycle of TFRA-backed tables.

* `tf_psx.tables.native`: the storage (one `DenseHashTable` per ps task, a
  key's row, optimizer slots and bookkeeping in one value), the key
  partition and the per-key initial rows.
* `tf_psx.tables.updates`: a step's update of a table, per shard on its ps
  task under its lock, with the optimizers' rules.
* `tf_psx.tables.from_tfra`: a snapshot of TFRA-backed layers restored
  into native ones (`tf_psx.tables.restore_from_tfra`).
* `tf_psx.tables.tfra_updates`: the update of a TFRA table, per shard.
* `tf_psx.tables.sync`: the gradient sums of synchronous training for both
  stores (registered with tf_psx.training.sync_training on import).
* `tf_psx.tables.lifecycle`: admission, eviction, the disk tier and the
  resharded restore of TFRA-backed `DynamicEmbedding` tables (its names are
  re-exported here: `tf_psx.tables.TablePolicy`, ...).

The layer itself is `tf_psx.layers.DynamicEmbedding`. Importing this
package imports TensorFlow.
"""

from tf_psx.tables import sync as _sync, tfra_updates as _tfra_updates  # noqa: F401  (each registers itself with the training core)
from tf_psx.tables.from_tfra import restore_from_tfra  # noqa: F401
from tf_psx.tables.lifecycle import (  # noqa: F401
    SPILLED,
    DiskTier,
    EvictionReport,
    TablePolicy,
    carry_step_counters,
    hash_table_layers,
    restore_tables,
    seed_policies,
    slot_tables,
    table_layers,
)

__all__ = ["TablePolicy", "DiskTier", "EvictionReport", "SPILLED", "restore_tables", "seed_policies", "slot_tables",
           "hash_table_layers", "carry_step_counters", "table_layers", "restore_from_tfra"]
