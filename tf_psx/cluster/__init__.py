"""The cluster: where the tasks are, and the processes that run them.

`tf_psx.cluster` (this package) is light: importing it imports neither
TensorFlow nor any process supervision. `ClusterConfig` (building, parsing
and validating `TF_CONFIG`) lives in `tf_psx.cluster.config`; the other
modules are imported by name:

* `config`: `ClusterConfig`, and `ClusterSource` (a cluster started on demand);
* `validation`: the `TF_CONFIG` checks and their messages;
* `ports`: loopback ports and reachability (one implementation);
* `local`: `LocalCluster`, in-process servers or task processes;
* `supervisor`: task processes (start, ready mark, bounded wait, stop);
* `server`: one ps or worker task from `TF_CONFIG` (`python -m tf_psx.server`);
* `preflight`: `tf-psx doctor TF_CONFIG`, the checks before a run;
* `k8s`: Kubeflow TFJob manifests;
* `netproxy`, `tlsmesh`: TCP relays, and the mutual-TLS mesh around a task.
"""

from tf_psx.cluster.config import ClusterConfig, TFConfigError
from tf_psx.cluster.validation import (  # noqa: F401  (the names `tf_psx.cluster.X` has always had)
    PORT_RANGE,
    PS_REQUIRED_TASK_TYPES,
    SINGLE_TASK_TYPES,
    TF_CONFIG_ENV,
    TRAINING_TASK_TYPES,
    VALID_TASK_TYPES,
)

__all__ = ["ClusterConfig", "TFConfigError"]
