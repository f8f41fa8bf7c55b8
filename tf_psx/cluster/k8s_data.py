"""Kubernetes objects of the tf.data service beside a TFJob: a dispatcher and data workers.

`tf-psx k8s ... --data-workers N` adds them to the job's YAML
(tf_psx.cluster.data_service runs in each container):

* a Deployment of one dispatcher and a Service in front of it
  (`<job>-data-dispatcher:DISPATCHER_PORT`);
* a Deployment of N data workers; each tells the dispatcher its pod IP
  (the downward API's `status.podIP`), where the coordinator reads from it;
* `$TF_PSX_DATA_SERVICE` in the Chief's and the Evaluator's containers, the
  dispatcher's address: `tf_psx.cluster.data_service.service_address()`.

Known limitations:
  * The dispatcher keeps its state in memory: when its pod restarts, the
    running pass of the data starts again (tf.data service without a
    `work_dir`).
  * The data service talks plain gRPC, so it is refused with `tls_secret`
    (the job's NetworkPolicy admits only the TLS port).
"""

from __future__ import annotations

from typing import Any

from tf_psx.cluster import data_service as _data_service
from tf_psx.errors import ManifestError

DISPATCHER_PORT = 5050
WORKER_PORT = 5051
_APP_LABEL = "app.kubernetes.io/name"
_MODULE = ("python", "-m", "tf_psx.cluster.data_service")


def dispatcher_name(name: str) -> str:
    """The dispatcher's Deployment and Service name of job `name`."""
    return f"{name}-data-dispatcher"


def dispatcher_address(name: str) -> str:
    """The address the Chief reads from (the Service's name resolves in the job's namespace)."""
    return _data_service.address(DISPATCHER_PORT, dispatcher_name(name))


def _metadata(name: str, namespace: str | None) -> dict[str, str]:
    return {"name": name, **({"namespace": namespace} if namespace is not None else {})}


def _deployment(name: str, namespace: str | None, replicas: int, container: dict[str, Any]) -> dict[str, Any]:
    labels = {_APP_LABEL: name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(name, namespace),
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}}},
    }


def data_service_manifests(name: str, image: str, data_workers: int, namespace: str | None = None,
                           resources: dict[str, Any] | None = None, tls_secret: str | None = None) -> list[dict]:
    """The dispatcher's Deployment and Service and the data workers' Deployment of job `name`.

    Args:
      name, image, namespace: as `tfjob_manifest` (checked there).
      data_workers: the number of data workers, >= 1.
      resources: the containers' `resources` (the job's cpu and memory), or None.
      tls_secret: must be None (see the module's limitations).

    Raises:
      ManifestError: `data_workers` is not an int >= 1, or `tls_secret` is set.
    """
    if isinstance(data_workers, bool) or not isinstance(data_workers, int) or data_workers < 1:
        raise ManifestError("data_workers", f"must be an int >= 1 (the tf.data service workers). Received: "
                                            f"{data_workers!r}. Fix: pass e.g. 2, or leave it out.")
    if tls_secret is not None:
        raise ManifestError("data_workers", "cannot be used with a TLS secret: the tf.data service talks plain "
                                            f"gRPC and the job's NetworkPolicy admits only its TLS port. Received: "
                                            f"{data_workers} with tls_secret={tls_secret!r}. Fix: leave out one of them.")
    dispatcher = dispatcher_name(name)
    extra = {"resources": resources} if resources else {}
    serve = {"name": "dispatcher", "image": image, "ports": [{"containerPort": DISPATCHER_PORT}],
             "command": [*_MODULE, "dispatcher", "--port", str(DISPATCHER_PORT)], **extra}
    work = {"name": "data-worker", "image": image, "ports": [{"containerPort": WORKER_PORT}],
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "command": [*_MODULE, "worker", "--port", str(WORKER_PORT), "--dispatcher", f"{dispatcher}:{DISPATCHER_PORT}",
                        "--host", "$(POD_IP)"], **extra}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(dispatcher, namespace),
        "spec": {"selector": {_APP_LABEL: dispatcher},
                 "ports": [{"port": DISPATCHER_PORT, "targetPort": DISPATCHER_PORT}]},
    }
    return [_deployment(dispatcher, namespace, 1, serve), service,
            _deployment(f"{name}-data-workers", namespace, data_workers, work)]


def give_address(tfjob: dict[str, Any]) -> dict[str, Any]:
    """Adds `$TF_PSX_DATA_SERVICE` (the dispatcher's address) to the Chief's and the Evaluator's containers."""
    address = dispatcher_address(tfjob["metadata"]["name"])
    for rtype in ("Chief", "Evaluator"):
        spec = tfjob["spec"]["tfReplicaSpecs"].get(rtype)
        if spec is not None:
            for container in spec["template"]["spec"]["containers"]:
                container.setdefault("env", []).append({"name": _data_service.ENV, "value": address})
    return tfjob
