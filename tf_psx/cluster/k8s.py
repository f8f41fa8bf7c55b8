"""Kubeflow `TFJob` manifests for a parameter-server cluster, and the TF_CONFIG they lead to.

`tfjob_manifest` builds the TFJob (apiVersion kubeflow.org/v1) of one
parameter-server training job: one Chief that runs your training command (the
`ClusterCoordinator`), N Workers and M PS that run `python -m tf_psx.server`,
and optionally one Evaluator that runs your command too. The Kubeflow training
operator turns it into one pod and one headless service per replica and hands
each pod a TF_CONFIG; `operator_tf_config` computes that TF_CONFIG the way the
operator does (pkg/controller.v1/tensorflow/tensorflow.go, genClusterSpec), so
that it can be checked with `ClusterConfig.from_tf_config` before anything is
deployed.

Every invalid argument raises `ManifestError`, whose message names the
argument, the value received, the expected form and the fix.

Importing this module does not import TensorFlow.

Example:

>>> job = tfjob_manifest("ctr", "registry.example.com/ctr:1", ["python", "train.py"], workers=2, ps=1)
>>> {rtype: spec["replicas"] for rtype, spec in job["spec"]["tfReplicaSpecs"].items()}
{'Chief': 1, 'Worker': 2, 'PS': 1}
>>> operator_tf_config("ctr", "Worker", 1, workers=2, ps=1)["task"]
{'type': 'worker', 'index': 1}
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from tf_psx import _checks
from tf_psx._tf.runtime import GRPC_FAIL_FAST_ENV, GRPC_FAIL_FAST_VALUE
from tf_psx.cluster import PORT_RANGE
from tf_psx.errors import ManifestError
from tf_psx.cluster.server import INTRA_OP_ENV as INTRA_OP_THREADS_ENV

__all__ = ["ManifestError", "network_policy", "operator_tf_config", "tfjob_manifest"]

API_VERSION = "kubeflow.org/v1"
KIND = "TFJob"

# The operator sets TF_CONFIG only in the container of this name, and rejects a
# replica without one (TFJobDefaultContainerName, tensorflow_validation.go).
CONTAINER_NAME = "tensorflow"

# The operator reads the port of the cluster addresses from the container port
# of this name, and uses 2222 without one (GetPortFromTFJob, TFJobDefaultPort).
PORT_NAME = "tfjob-port"
DEFAULT_PORT = 2222

# The namespace `kubectl apply` uses when neither the manifest nor -n names one
# (for the default kubectl context); operator_tf_config assumes it likewise.
DEFAULT_NAMESPACE = "default"

# Once the job is done (the Chief finished), delete the pods still running:
# the PS never exit by themselves, and would hold their nodes forever. Finished
# pods are kept so that their logs can still be read ("All" would delete them).
CLEAN_POD_POLICY = "Running"

# What the PS and Worker containers run: see `tfjob_manifest` for why.
SERVER_COMMAND = ("python", "-m", "tf_psx.server")

# With `tls_secret`: where the secret is mounted in every container, the
# volume's name, and what each command is wrapped in (tf_psx.tlsmesh: the
# task sees a loopback cluster; its port is reached over mutual TLS only).
TLS_MOUNT_PATH = "/etc/tf-psx/tls"
TLS_VOLUME = "tf-psx-tls"
TLS_MESH_COMMAND = ("python", "-m", "tf_psx.tlsmesh", "--cert-dir", TLS_MOUNT_PATH, "--")
# The label the training operator puts on every pod of a job (kubeflow/common JobNameLabel).
JOB_NAME_LABEL = "training.kubeflow.org/job-name"

# The extended resource of the NVIDIA device plugin.
GPU_RESOURCE = "nvidia.com/gpu"

# Replica types in the order they are written, with their restart policies.
#   Chief: OnFailure. In TF 2.16 a PS failure is not recoverable inside the
#     coordinator: `ClusterCoordinator` raises and the training script exits
#     with status 1. The documented recovery is to restart the coordinator,
#     which resumes from its last checkpoint (BackupAndRestore). ExitCode would
#     treat status 1 as a permanent error (1..127) and fail the whole job.
#   Worker: ExitCode. Workers hold no state; the coordinator re-runs a lost
#     worker's functions elsewhere and reconnects when the pod comes back. A
#     kill (137: OOM, preemption) is retryable (128..255) and restarts the pod;
#     tf_psx.server exits 2 on a bad TF_CONFIG, a permanent error (1..127) that
#     fails the job instead of crash-looping.
#   PS: OnFailure. A PS must come back whenever it dies, whatever the exit
#     status (a crash, an OOM kill), for the restarted Chief to rebuild its
#     variables on it; OnFailure restarts the container in place, in the same
#     pod behind the same service name. Always is not used: tf_psx.server exits
#     0 only when it was asked to stop (SIGTERM), and restarting it then would
#     fight the shutdown.
#   Evaluator: OnFailure. The evaluator is not part of training, so a crash
#     (e.g. while reading a checkpoint being written) must neither fail the job,
#     as a permanent ExitCode error of any replica does, nor stop evaluation.
REPLICA_TYPES = ("Chief", "Worker", "PS", "Evaluator")
RESTART_POLICIES = {
    "Chief": "OnFailure",
    "Worker": "ExitCode",
    "PS": "OnFailure",
    "Evaluator": "OnFailure",
}

# The replica types whose pods get the GPUs: the PS only store and update
# variables, the evaluator only reads checkpoints.
GPU_REPLICA_TYPES = ("Chief", "Worker")

# Pod and service names are DNS labels (RFC 1123), at most 63 characters.
MAX_DNS_LABEL_CHARS = 63

# The operator sets this TF_CONFIG key for TF <= 1.3 (contrib.learn); TF 2 ignores it.
OPERATOR_TF_CONFIG_ENVIRONMENT = "cloud"

# The operator validates the job name as a DNS-1035 label (NameIsDNS1035Label):
# lowercase letters, digits and '-', starting with a letter.
_JOB_NAME_RE = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?\Z")
# Namespaces are DNS-1123 labels: they may also start with a digit.
_NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
# The Kubernetes resource.Quantity pattern (as in every generated CRD), without
# its leading sign: a negative request or limit is never meant.
_DECIMAL = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
_QUANTITY_RE = re.compile(rf"{_DECIMAL}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_DECIMAL}))?\Z")
_EXAMPLE_NAME = "ctr-train"
_QUANTITY_EXAMPLES = {"cpu": '"4" or "500m"', "memory": '"16Gi" or "512Mi"'}
# Kubernetes quantity suffixes, for a CPU request written with one (rare beyond "m").
_CPU_SUFFIXES = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 1024.0, "Mi": 1024.0 ** 2,
                 "Gi": 1024.0 ** 3}


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    return f"{value!r} (a {type(value).__name__})" if isinstance(value, bool) else repr(value)


def _check_count(value: Any, argument: str, minimum: int, what: str, fix: str) -> int:
    if _checks.is_int_at_least(value, minimum):
        return value
    if not isinstance(value, int) or isinstance(value, bool):  # True is not 1 replica.
        received = f"{value!r} (a {type(value).__name__})"
    else:
        received = repr(value)
    raise ManifestError(argument, f"must be an int >= {minimum} ({what}); received {received}. Fix: {fix}")


def _suggest_name(value: str) -> str:
    name = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"job-{name}".rstrip("-")
    return name


def _check_name(value: Any) -> str:
    if not isinstance(value, str) or not _JOB_NAME_RE.match(value):
        suggestion = _suggest_name(value) if isinstance(value, str) else _EXAMPLE_NAME
        raise ManifestError(
            "name",
            "must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter "
            f"and ending with a letter or digit), as the operator requires of a TFJob name; received "
            f"{_show(value)}. Fix: use a name like {_show(suggestion)}.",
        )
    return value


def _check_name_length(name: str, counts: dict[str, int]) -> None:
    """Checks that every pod and service name derived from `name` is a DNS label.

    The operator names the pod and the headless service of each replica
    "{name}-{replica type, lowercase}-{index}", so the room left for `name`
    depends on the longest replica type and index of this job, e.g. 51
    characters with an Evaluator ("-evaluator-0" takes 12 of the 63).
    """
    longest = max((_service_name(name, rtype, count - 1) for rtype, count in counts.items()), key=len)
    if len(longest) > MAX_DNS_LABEL_CHARS:
        room = MAX_DNS_LABEL_CHARS - (len(longest) - len(name))
        raise ManifestError(
            "name",
            f"must leave room for the pod and service names the operator derives from it "
            f'("{{name}}-{{replica type}}-{{index}}", at most {MAX_DNS_LABEL_CHARS} characters); '
            f"received {_show(name)} ({len(name)} characters), which makes {_show(longest)} "
            f"({len(longest)} characters). Fix: shorten the name to at most {room} characters.",
        )


def _check_namespace(value: Any) -> str:
    if value is None:
        return DEFAULT_NAMESPACE
    if not isinstance(value, str) or len(value) > MAX_DNS_LABEL_CHARS or not _NAMESPACE_RE.match(value):
        raise ManifestError(
            "namespace",
            f"must be a DNS-1123 label (lowercase letters, digits and '-', at most "
            f"{MAX_DNS_LABEL_CHARS} characters); received "
            f"{_show(value)}. Fix: use the name of an existing namespace, e.g. \"ml-training\".",
        )
    return value


def _check_port(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and PORT_RANGE[0] <= value <= PORT_RANGE[1]:
        return value
    raise ManifestError(
        "port",
        f"must be an int in {PORT_RANGE[0]}..{PORT_RANGE[1]} (the port every task listens on); "
        f"received {_show(value)}. Fix: use the operator's default, {DEFAULT_PORT}.",
    )


def _check_job(
    name: Any, workers: Any, ps: Any, evaluator: Any, namespace: Any, port: Any
) -> tuple[str, dict[str, int], str, int]:
    """Checks the arguments shared by both public functions.

    Returns:
      (name, {replica type: number of replicas}, namespace, port), the replica
      types in REPLICA_TYPES order, "Evaluator" only when `evaluator` is true.
    """
    name = _check_name(name)
    workers = _check_count(
        workers, "workers", 1, "the number of Worker replicas",
        "run at least one worker; parameter-server training needs one.",
    )
    ps = _check_count(
        ps, "ps", 1, "the number of PS replicas",
        "run at least one parameter server; parameter-server training needs one.",
    )
    if not isinstance(evaluator, bool):
        raise ManifestError(
            "evaluator",
            f"must be True or False (whether to run an Evaluator replica); received {_show(evaluator)}. "
            "Fix: pass evaluator=True to add one.",
        )
    counts = {"Chief": 1, "Worker": workers, "PS": ps}
    if evaluator:
        counts["Evaluator"] = 1
    _check_name_length(name, counts)
    return name, counts, _check_namespace(namespace), _check_port(port)


def _check_image(value: Any) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ManifestError(
            "image",
            "must be a container image reference without spaces, e.g. "
            f'"registry.example.com/ctr:1.0"; received {_show(value)}. Fix: pass the image that '
            "holds your training script and tf_psx.",
        )
    return value


def _check_command(value: Any) -> list[str]:
    if (
        isinstance(value, str)
        or not isinstance(value, Sequence)
        or not value
        or not all(isinstance(part, str) for part in value)
        or not value[0]
    ):
        fix = (
            f"split it into a list, e.g. {value.split()!r}."
            if isinstance(value, str) and value.strip()
            else 'pass the program and its arguments, e.g. ["python", "train.py"].'
        )
        raise ManifestError(
            "command",
            "must be a non-empty list of strings (the Chief's and the Evaluator's command, "
            f"program first); received {value!r}. Fix: {fix}",
        )
    return list(value)


def _check_quantity(value: Any, argument: str) -> str | None:
    if value is None:
        return None
    text = str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not _QUANTITY_RE.match(text):
        raise ManifestError(
            argument,
            f"must be a Kubernetes quantity such as {_QUANTITY_EXAMPLES[argument]}; received "
            f"{_show(value)}. Fix: write a number with an optional unit suffix (m, k, M, G, Ki, "
            "Mi, Gi, ...), without spaces or a sign.",
        )
    return text


def _service_name(name: str, replica_type: str, index: int) -> str:
    # common.GenGeneralName: "{job}-{rtype}-{index}" with '/' replaced by '-'.
    return f"{name}-{replica_type.lower()}-{index}".replace("/", "-")


def _address(name: str, replica_type: str, index: int, namespace: str, port: int) -> str:
    return f"{_service_name(name, replica_type, index)}.{namespace}.svc:{port}"


def cpu_threads(quantity: str) -> int:
    """The thread count of a CPU quantity: "500m" -> 1, "4" -> 4, "2.5" -> 3 (rounded up, at least 1)."""
    import math  # pylint: disable=import-outside-toplevel

    number = re.match(r"[0-9.]+(?:[eE][+-]?[0-9]+)?", quantity).group(0)
    cores = float(number) * _CPU_SUFFIXES.get(quantity[len(number):], 1)
    return max(1, math.ceil(cores - 1e-9))


def _container(
    image: str, command: list[str], port: int, requests: dict[str, str], limits: dict[str, Any],
    threads: int | None = None, tls: bool = False,
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "command": command,
        "ports": [{"name": PORT_NAME, "containerPort": port}],
        "env": [{"name": GRPC_FAIL_FAST_ENV, "value": GRPC_FAIL_FAST_VALUE}],
    }
    if threads is not None:
        # tf_psx.server sizes its intra-op pool to the CPU request, not to the node's cores.
        container["env"].append({"name": INTRA_OP_THREADS_ENV, "value": str(threads)})
    resources = {key: dict(value) for key, value in (("requests", requests), ("limits", limits)) if value}
    if resources:
        container["resources"] = resources
    if tls:
        container["command"] = [*TLS_MESH_COMMAND, *command]
        container["volumeMounts"] = [{"name": TLS_VOLUME, "mountPath": TLS_MOUNT_PATH, "readOnly": True}]
    return container


def _check_secret(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _NAMESPACE_RE.match(value) or len(value) > MAX_DNS_LABEL_CHARS:
        raise ManifestError(
            "tls_secret",
            "must be the name of a Kubernetes secret (lowercase letters, digits and '-', at most "
            f"{MAX_DNS_LABEL_CHARS} characters) holding ca.crt, tls.crt and tls.key, or None; received {_show(value)}. "
            "Fix: create one with cert-manager or `kubectl create secret generic NAME --from-file=ca.crt "
            "--from-file=tls.crt --from-file=tls.key`, and pass its name.",
        )
    return value


def tfjob_manifest(
    name: str,
    image: str,
    command: Sequence[str],
    workers: int,
    ps: int,
    evaluator: bool = False,
    cpu: str | None = None,
    memory: str | None = None,
    gpus: int = 0,
    namespace: str | None = None,
    port: int = DEFAULT_PORT,
    tls_secret: str | None = None,
) -> dict[str, Any]:
    """Builds the Kubeflow TFJob (kubeflow.org/v1) of a parameter-server training job.

    Replicas (restart policies and their reasons: see RESTART_POLICIES):
      * Chief (1): runs `command`. It is the `ClusterCoordinator`: it builds
        the model and dispatches training steps to the workers.
      * Worker (`workers`) and PS (`ps`): run `python -m tf_psx.server`. In
        TF 2 parameter-server training, workers and parameter servers run no
        user code: they only host a `tf.distribute.Server` that the coordinator
        places variables on and sends functions to. tf_psx.server starts that
        server from the operator's TF_CONFIG, leaves the evaluator out of its
        cluster (the operator puts it in; see `ClusterConfig`), gives workers
        enough inter-op threads not to deadlock, sets GRPC_FAIL_FAST, exits 0
        on SIGTERM and 2 on a bad TF_CONFIG (a permanent error for ExitCode).
        The image must therefore hold tf_psx as well as the training script.
      * Evaluator (1, only with `evaluator=True`): runs `command` too, with
        TF_CONFIG task type "evaluator"; it is kept out of the training
        cluster (`ClusterConfig.cluster_spec()` drops it).

    Every container is named "tensorflow" and declares the port "tfjob-port",
    the two names the operator looks for, and sets GRPC_FAIL_FAST=use_caller
    so that calls to a dead task fail at once and the coordinator can react.

    With `tls_secret`, the tasks talk over mutual TLS (`tf_psx.tlsmesh`):
    the secret (ca.crt, tls.crt, tls.key) is mounted in every container at
    TLS_MOUNT_PATH and every command runs inside `python -m tf_psx.tlsmesh`,
    which listens with TLS on `port` and gives the task a cluster of
    loopback addresses. Apply `network_policy(name)` with it: it admits
    only `port` into the job's pods, so the plain gRPC ports stay closed.

    Known limitations:
      * All replicas use the same image, port, cpu and memory.
      * The training script must build its cluster with tf_psx
        (`ClusterConfig.from_tf_config()` or `tf_psx.ParameterServerStrategy`):
        a plain `TFConfigClusterResolver` keeps the evaluator job that the
        operator puts in every TF_CONFIG (tensorflow#46169).
      * A Chief that crashes on a bug restarts forever (OnFailure); watch the
        job, or add `runPolicy.backoffLimit` to the manifest.
      * cleanPodPolicy "Running" deletes the Evaluator as soon as the Chief
        finishes, possibly before it has evaluated the last checkpoint.

    Args:
      name: the TFJob name, a DNS-1035 label; with "-{replica type}-{index}"
        appended (the operator's pod and service names) it must stay within
        63 characters.
      image: the container image of every replica.
      command: the Chief's and the Evaluator's command, program first, e.g.
        ["python", "train.py", "--epochs", "3"].
      workers: the number of Worker replicas, >= 1.
      ps: the number of PS replicas, >= 1.
      evaluator: add one Evaluator replica.
      cpu: the CPU request and limit of every container (a Kubernetes
        quantity, "4" or "500m"), or None for none.
      memory: the memory request and limit of every container ("16Gi"), or
        None for none.
      gpus: the `nvidia.com/gpu` limit of the Chief and of each Worker, >= 0.
      namespace: metadata.namespace, or None to leave it to `kubectl`.
      port: the port every task listens on (with `tls_secret`: with TLS).
      tls_secret: None, or the name of the secret of the cluster's
        certificates: the tasks then talk over mutual TLS only.

    Returns:
      The manifest as a dict, ready for `yaml.safe_dump(..., sort_keys=False)`.

    Raises:
      ManifestError: if an argument is invalid.

    Example:

    >>> job = tfjob_manifest("ctr", "img:1", ["python", "train.py"], workers=2, ps=1,
    ...                      evaluator=True, gpus=1)
    >>> {t: s["restartPolicy"] for t, s in job["spec"]["tfReplicaSpecs"].items()}
    {'Chief': 'OnFailure', 'Worker': 'ExitCode', 'PS': 'OnFailure', 'Evaluator': 'OnFailure'}
    >>> worker = job["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    >>> worker["command"], worker["resources"]
    (['python', '-m', 'tf_psx.server'], {'limits': {'nvidia.com/gpu': 1}})
    """
    name, counts, _, port = _check_job(name, workers, ps, evaluator, namespace, port)
    image = _check_image(image)
    command = _check_command(command)
    quantities = {"cpu": _check_quantity(cpu, "cpu"), "memory": _check_quantity(memory, "memory")}
    requests = {key: quantity for key, quantity in quantities.items() if quantity is not None}
    gpus = _check_count(gpus, "gpus", 0, "the GPUs of the Chief and of each Worker", "pass 0 for no GPUs.")
    tls_secret = _check_secret(tls_secret)
    replica_specs: dict[str, Any] = {}
    for rtype, replicas in counts.items():
        limits: dict[str, Any] = dict(requests)
        if gpus and rtype in GPU_REPLICA_TYPES:
            limits[GPU_RESOURCE] = gpus
        runs = list(SERVER_COMMAND) if rtype in ("Worker", "PS") else list(command)
        pod: dict[str, Any] = {"containers": [_container(
            image, runs, port, requests, limits,
            cpu_threads(requests["cpu"]) if "cpu" in requests and rtype in ("Worker", "PS") else None,
            tls=tls_secret is not None)]}
        if tls_secret is not None:
            pod["volumes"] = [{"name": TLS_VOLUME, "secret": {"secretName": tls_secret}}]
        replica_specs[rtype] = {
            "replicas": replicas,
            "restartPolicy": RESTART_POLICIES[rtype],
            "template": {"spec": pod},
        }
    metadata = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {"runPolicy": {"cleanPodPolicy": CLEAN_POD_POLICY}, "tfReplicaSpecs": replica_specs},
    }


def network_policy(name: str, namespace: str | None = None, port: int = DEFAULT_PORT) -> dict[str, Any]:
    """The NetworkPolicy of a job: only the job's own pods reach its task port.

    It selects every pod of the job (the operator's job-name label) and
    admits only TCP `port`, and only from the job's own pods. Without TLS
    that is the task port; with `tfjob_manifest(..., tls_secret=...)` it is
    the TLS door of `tf_psx.tlsmesh`, and TensorFlow's plain gRPC ports,
    which it binds on every interface, are thereby closed to everything. It
    needs a network plugin that enforces NetworkPolicy (Calico, Cilium, ...);
    on one that does not, the policy is accepted and does nothing.

    Known limitations:
      * Other ports of the pods (a Prometheus `--metrics-port`, TensorBoard)
        are closed too; add an ingress rule for them.

    Raises:
      ManifestError: if an argument is invalid.

    Example:

    >>> policy = network_policy("ctr")
    >>> policy["spec"]["ingress"][0]["ports"]
    [{'protocol': 'TCP', 'port': 2222}]
    """
    name, _, checked_namespace, port = _check_job(name, 1, 1, False, namespace, port)
    metadata = {"name": f"{name}-tasks-only"}
    if namespace is not None:
        metadata["namespace"] = checked_namespace
    job_pods = {"matchLabels": {JOB_NAME_LABEL: name}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {
            "podSelector": job_pods,
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": job_pods}], "ports": [{"protocol": "TCP", "port": port}]}],
        },
    }


def operator_tf_config(
    name: str,
    replica_type: str,
    index: int,
    workers: int,
    ps: int,
    evaluator: bool = False,
    namespace: str | None = None,
    port: int = DEFAULT_PORT,
) -> dict[str, Any]:
    """The TF_CONFIG the training operator hands one pod of `tfjob_manifest`'s job.

    As in the operator (genClusterSpec), the cluster lists every replica type,
    the Evaluator included, each task addressed by its headless service:
    "{name}-{replica type, lowercase}-{index}.{namespace}.svc:{port}". The task
    type is the replica type in lowercase.

    Known limitations:
      * The operator appends its CUSTOM_CLUSTER_DOMAIN setting (e.g.
        ".cluster.local") to every address when it is set; this does not.
      * With `enableDynamicWorker` the operator writes a "sparseCluster"
        instead; `tfjob_manifest` never sets it.

    Args:
      name: the TFJob name, as in `tfjob_manifest`.
      replica_type: "Chief", "Worker", "PS" or "Evaluator" (any case, as the
        operator accepts).
      index: the replica's index, 0..replicas - 1.
      workers: the number of Worker replicas, as in `tfjob_manifest`.
      ps: the number of PS replicas.
      evaluator: whether the job has an Evaluator.
      namespace: the namespace the job runs in; None means "default".
      port: the "tfjob-port" of the containers.

    Returns:
      {"cluster": {task type: [addresses]}, "task": {"type": ..., "index": ...},
      "environment": "cloud"}.

    Raises:
      ManifestError: if an argument is invalid, or the replica does not exist.

    Example:

    >>> tf_config = operator_tf_config("ctr", "PS", 0, workers=2, ps=1, evaluator=True)
    >>> for task_type, addresses in tf_config["cluster"].items():
    ...     print(task_type, addresses)
    chief ['ctr-chief-0.default.svc:2222']
    worker ['ctr-worker-0.default.svc:2222', 'ctr-worker-1.default.svc:2222']
    ps ['ctr-ps-0.default.svc:2222']
    evaluator ['ctr-evaluator-0.default.svc:2222']
    >>> tf_config["task"]
    {'type': 'ps', 'index': 0}
    """
    name, counts, namespace, port = _check_job(name, workers, ps, evaluator, namespace, port)
    by_lower = {rtype.lower(): rtype for rtype in counts}
    rtype = by_lower.get(replica_type.lower()) if isinstance(replica_type, str) else None
    if rtype is None:
        absent = isinstance(replica_type, str) and replica_type.lower() == "evaluator"
        fix = "pass evaluator=True if the job has one." if absent else "use one of the job's replica types."
        raise ManifestError(
            "replica_type",
            f"must be one of the job's replica types, {', '.join(map(_show, counts))}; received "
            f"{_show(replica_type)}. Fix: {fix}",
        )
    count = counts[rtype]
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
        raise ManifestError(
            "index",
            f"must be an int in 0..{count - 1} (the job has {count} {rtype} replica"
            f"{'s' if count != 1 else ''}); received {_show(index)}. Fix: count the replicas from 0.",
        )
    cluster = {
        t.lower(): [_address(name, t, i, namespace, port) for i in range(n)] for t, n in counts.items()
    }
    return {
        "cluster": cluster,
        "task": {"type": rtype.lower(), "index": index},
        "environment": OPERATOR_TF_CONFIG_ENVIRONMENT,
    }
