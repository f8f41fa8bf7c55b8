"""Keras callbacks that make asynchronous parameter-server training predictable.

* `PeriodicSync`: every N steps, a barrier and an atomic snapshot (model,
  optimizer slots, step counter, DynamicEmbedding tables); `fit` resumes from
  the newest complete snapshot, skipping the steps already done.
* `StalenessBound`: measures how stale each gradient is (a version counter on
  a ps task) and drops or down-weights gradients that are too stale.
* `SyncSwitch`: switches a `sync="switchable"` strategy from async to sync
  steps (or back) at a step or on a loss plateau.
* `ClusterMonitor`: TensorBoard scalars for the cluster (throughput, bytes
  per ps task, gradient sparsity, staleness, snapshot time, retried closures,
  ps memory, rows per hash table and rows evicted), and a Prometheus endpoint.
* `TableEviction`: applies the eviction of `DynamicEmbedding` tables
  (`max_age_steps`, `max_rows`, the disk tier) every N steps or seconds.
* `StallDoctor`: when no step finishes for a while, logs which worker holds
  which step, the task states and the stacks.

All of them run their batch hooks under `ParameterServerStrategy` (they
accept remote values: `_supports_tf_logs`, set by the shared base class in
`base`). The per-step measurements are made by one shared probe per model
(`probe`: `_StepProbe`), which wraps `train_step` and the optimizer's apply
through `tf_psx._tf.fit_hooks`; the public classes only configure it and
read it. `PeriodicSync` is an adapter over the snapshot engine
(`tf_psx.snapshots.engine`), which restores and writes.

One callback per module: `staleness`, `periodic_sync`, `sync_switch`,
`cluster_monitor`, `table_eviction`, `stall_doctor`; this package re-exports
the names `tf_psx.callbacks.X` has always had.
"""

# The names `tf_psx.callbacks.X` has always had.
from tf_psx.callbacks.cluster_monitor import DEFAULT_MONITOR_STEPS, ClusterMonitor  # noqa: F401
from tf_psx.callbacks.periodic_sync import PeriodicSync, finish_snapshots_of  # noqa: F401
from tf_psx.callbacks.probe import STALENESS_BINS  # noqa: F401
from tf_psx.callbacks.stall_doctor import DEFAULT_STALL_TIMEOUT_S, StallDoctor  # noqa: F401
from tf_psx.callbacks.staleness import POLICIES, Policy, StalenessBound  # noqa: F401
from tf_psx.callbacks.sync_switch import SyncSwitch
from tf_psx.callbacks.table_eviction import TableEviction
from tf_psx.snapshots.store import CHECKPOINT_NAME, MANIFEST, SNAPSHOT_PREFIX, TMP_PREFIX, Snapshot  # noqa: F401

__all__ = ["StalenessBound", "PeriodicSync", "ClusterMonitor", "TableEviction", "SyncSwitch", "StallDoctor", "Snapshot"]
