"""Unit tests for tf_psx.cluster.k8s (unit tier: no cluster, no servers).

The manifests are checked against tests/tfjob_v1_schema.json, a closed subset
of the TFJob v1 schema, and the TF_CONFIG of every pod is derived from the
manifest the way the training operator derives it (genClusterSpec: one
headless service "{job}-{replica type}-{index}" per replica, the port of the
container "tensorflow" named "tfjob-port") and parsed with ClusterConfig.
"""

from __future__ import annotations

import copy
import doctest
import inspect
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from tf_psx.cluster import k8s, tlsmesh
from tf_psx.cluster import ClusterConfig
from tf_psx.cluster.k8s import ManifestError, operator_tf_config, tfjob_manifest

from conftest import TESTS

pytestmark = pytest.mark.unit

SCHEMA = json.loads((Path(TESTS) / "tfjob_v1_schema.json").read_text(encoding="utf-8"))
IMAGE = "registry.example.com/ctr:1.0"
COMMAND = ["python", "train.py", "--epochs", "3"]

# (name, workers, ps, evaluator, namespace, port, cpu, memory, gpus)
JOB_CASES = [
    pytest.param(("ctr", 1, 1, False, None, 2222, None, None, 0), id="smallest"),
    pytest.param(("ctr-big", 4, 2, True, "ml-training", 2222, "4", "16Gi", 1), id="evaluator-gpus"),
    pytest.param(("j2", 3, 3, True, None, 23456, "500m", "512Mi", 0), id="other-port"),
]


def manifest_for(name, workers, ps, evaluator, namespace, port, cpu, memory, gpus):
    return tfjob_manifest(
        name, IMAGE, COMMAND, workers=workers, ps=ps, evaluator=evaluator,
        cpu=cpu, memory=memory, gpus=gpus, namespace=namespace, port=port,
    )


def replica_container(manifest: dict, replica_type: str) -> dict:
    containers = manifest["spec"]["tfReplicaSpecs"][replica_type]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def operator_cluster(manifest: dict) -> dict[str, list[str]]:
    """The cluster part of TF_CONFIG as the operator builds it from `manifest`.

    Written from the operator's genClusterSpec, independently of tf_psx.cluster.k8s:
    every replica type (the Evaluator included), one address per replica, the
    headless service "{job}-{rtype lowercase}-{i}.{namespace}.svc" and the
    container port named "tfjob-port" of the container named "tensorflow".
    """
    name = manifest["metadata"]["name"]
    namespace = manifest["metadata"].get("namespace", "default")
    cluster = {}
    for rtype, spec in manifest["spec"]["tfReplicaSpecs"].items():
        (container,) = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "tensorflow"]
        (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "tfjob-port"]
        cluster[rtype.lower()] = [
            f"{name}-{rtype.lower()}-{i}.{namespace}.svc:{port}" for i in range(spec["replicas"])
        ]
    return cluster


# --- the public surface -------------------------------------------------


def test_public_api_is_pinned():
    assert k8s.__all__ == ["ManifestError", "network_policy", "operator_tf_config", "tfjob_manifest"]
    assert issubclass(ManifestError, ValueError)
    assert str(inspect.signature(tfjob_manifest)) == (
        "(name: 'str', image: 'str', command: 'Sequence[str]', workers: 'int', ps: 'int', "
        "evaluator: 'bool' = False, cpu: 'str | None' = None, memory: 'str | None' = None, "
        "gpus: 'int' = 0, namespace: 'str | None' = None, port: 'int' = 2222, "
        "tls_secret: 'str | None' = None) -> 'dict[str, Any]'"
    )
    assert str(inspect.signature(operator_tf_config)) == (
        "(name: 'str', replica_type: 'str', index: 'int', workers: 'int', ps: 'int', "
        "evaluator: 'bool' = False, namespace: 'str | None' = None, port: 'int' = 2222) "
        "-> 'dict[str, Any]'"
    )


def test_docstring_examples_run():
    results = doctest.testmod(k8s, optionflags=doctest.ELLIPSIS)
    assert results.attempted > 0
    assert results.failed == 0


# --- the manifest against the TFJob v1 schema ---------------------------


def test_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("case", JOB_CASES)
def test_manifest_matches_tfjob_v1_schema(case):
    manifest = manifest_for(*case)
    jsonschema.validate(manifest, SCHEMA, cls=jsonschema.Draft202012Validator)
    # What kubectl reads is the YAML: it must load back to the same manifest.
    assert yaml.safe_load(yaml.safe_dump(manifest, sort_keys=False)) == manifest


SPECS = ("spec", "tfReplicaSpecs")
WORKER_CONTAINER = (*SPECS, "Worker", "template", "spec", "containers", 0)


@pytest.mark.parametrize(
    "path, key, value",
    [
        pytest.param((), "specs", {}, id="unknown-top-level-field"),
        pytest.param(("spec", "runPolicy"), "cleanPodPolicy", "Always", id="cleanPodPolicy-enum"),
        pytest.param(SPECS, "Coordinator", {"replicas": 1, "template": {}}, id="unknown-replica-type"),
        pytest.param((*SPECS, "PS"), "restartpolicy", "Always", id="misspelt-restartPolicy"),
        pytest.param((*SPECS, "PS"), "restartPolicy", "Sometimes", id="restartPolicy-enum"),
        pytest.param((*SPECS, "Worker"), "replicas", -1, id="negative-replicas"),
        pytest.param(WORKER_CONTAINER, "port", 2222, id="unknown-container-field"),
        pytest.param((*WORKER_CONTAINER, "resources", "limits"), "cpu", "four", id="bad-quantity"),
    ],
)
def test_schema_rejects_what_the_operator_would_not_take(path, key, value):
    # Guards the schema itself: each change breaks a rule the other tests rely on.
    manifest = manifest_for("ctr", 2, 1, False, None, 2222, "4", None, 0)
    jsonschema.validate(manifest, SCHEMA, cls=jsonschema.Draft202012Validator)
    broken = copy.deepcopy(manifest)
    target = broken
    for step in path:
        target = target[step]
    target[key] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA, cls=jsonschema.Draft202012Validator)


# --- what the manifest says ----------------------------------------------


def test_replica_specs():
    manifest = manifest_for("ctr", 4, 2, True, None, 2222, None, None, 0)
    assert manifest["apiVersion"] == "kubeflow.org/v1"
    assert manifest["kind"] == "TFJob"
    assert manifest["metadata"] == {"name": "ctr"}
    assert manifest["spec"]["runPolicy"] == {"cleanPodPolicy": "Running"}
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert {t: (s["replicas"], s["restartPolicy"]) for t, s in specs.items()} == {
        "Chief": (1, "OnFailure"),
        "Worker": (4, "ExitCode"),
        "PS": (2, "OnFailure"),
        "Evaluator": (1, "OnFailure"),
    }
    for rtype in specs:
        container = replica_container(manifest, rtype)
        assert container["name"] == "tensorflow"
        assert container["image"] == IMAGE
        assert container["ports"] == [{"name": "tfjob-port", "containerPort": 2222}]
        assert container["env"] == [{"name": "GRPC_FAIL_FAST", "value": "use_caller"}]
        assert "resources" not in container
        expected = COMMAND if rtype in ("Chief", "Evaluator") else ["python", "-m", "tf_psx.server"]
        assert container["command"] == expected, rtype


def test_no_evaluator_without_the_flag():
    manifest = manifest_for("ctr", 2, 1, False, None, 2222, None, None, 0)
    assert list(manifest["spec"]["tfReplicaSpecs"]) == ["Chief", "Worker", "PS"]


def test_resources_and_gpus():
    manifest = manifest_for("ctr", 2, 1, True, "ml", 2222, "4", "16Gi", 2)
    assert manifest["metadata"] == {"name": "ctr", "namespace": "ml"}
    for rtype in ("Chief", "Worker", "PS", "Evaluator"):
        resources = replica_container(manifest, rtype)["resources"]
        assert resources["requests"] == {"cpu": "4", "memory": "16Gi"}
        # GPUs only where the model computes: the chief and the workers.
        gpu = {"nvidia.com/gpu": 2} if rtype in ("Chief", "Worker") else {}
        assert resources["limits"] == {"cpu": "4", "memory": "16Gi", **gpu}, rtype


def test_the_manifest_does_not_share_lists_with_the_caller():
    command = ["python", "train.py"]
    manifest = tfjob_manifest("ctr", IMAGE, command, workers=1, ps=1)
    replica_container(manifest, "Chief")["command"].append("--oops")
    assert command == ["python", "train.py"]


# --- the TF_CONFIG the operator hands each pod ---------------------------


@pytest.mark.parametrize("case", JOB_CASES)
def test_operator_tf_config_of_every_pod_parses(case):
    name, workers, ps, evaluator, namespace, port = case[:6]
    manifest = manifest_for(*case)
    expected_cluster = operator_cluster(manifest)
    ns = namespace or "default"
    # e.g. "ctr-big-worker-3.ml-training.svc:2222" for the 4th worker of case 2.
    assert expected_cluster["worker"][-1] == f"{name}-worker-{workers - 1}.{ns}.svc:{port}"
    assert ("evaluator" in expected_cluster) == evaluator
    for rtype, spec in manifest["spec"]["tfReplicaSpecs"].items():
        for index in range(spec["replicas"]):
            tf_config = operator_tf_config(
                name, rtype, index, workers=workers, ps=ps, evaluator=evaluator,
                namespace=namespace, port=port,
            )
            assert tf_config["cluster"] == expected_cluster
            assert tf_config["task"] == {"type": rtype.lower(), "index": index}
            config = ClusterConfig.from_tf_config(json.dumps(tf_config))
            assert (config.task_type, config.task_index) == (rtype.lower(), index)
            assert (config.num_workers, config.num_ps) == (workers, ps)
            assert config.chief == f"{name}-chief-0.{ns}.svc:{port}"
            assert config.as_dict() == expected_cluster
            config.validate_for_parameter_server()
            # The operator puts the evaluator in every cluster; the training
            # cluster (what tf_psx.server and the coordinator use) leaves it out.
            assert sorted(config.cluster_spec().jobs) == ["chief", "ps", "worker"]
            assert (config.evaluator is not None) == evaluator


@pytest.mark.parametrize("replica_type", ["ps", "PS", "Ps"])
def test_operator_tf_config_accepts_any_case_like_the_operator(replica_type):
    assert operator_tf_config("ctr", replica_type, 1, workers=1, ps=2)["task"] == {"type": "ps", "index": 1}


@pytest.mark.parametrize(
    "kwargs, argument, match",
    [
        ({"replica_type": "Master"}, "replica_type",
         r'one of the job\'s replica types, "Chief", "Worker", "PS"; received "Master"'),
        ({"replica_type": "Evaluator"}, "replica_type", r"received \"Evaluator\"\. Fix: pass evaluator=True"),
        ({"index": 2}, "index", r"must be an int in 0\.\.1 \(the job has 2 Worker replicas\); received 2"),
        ({"index": -1}, "index", r"received -1"),
        ({"index": True}, "index", r"received True \(a bool\)"),
        ({"ps": 0}, "ps", r"must be an int >= 1 \(the number of PS replicas\); received 0"),
    ],
)
def test_operator_tf_config_errors(kwargs, argument, match):
    args = {"name": "ctr", "replica_type": "Worker", "index": 0, "workers": 2, "ps": 1, **kwargs}
    with pytest.raises(ManifestError, match=match) as info:
        operator_tf_config(**args)
    assert info.value.argument == argument
    assert "Fix: " in str(info.value)


# --- validation ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, argument, match",
    [
        ({"name": "CTR"}, "name", r'DNS-1035 label .* received "CTR"\. Fix: use a name like "ctr"'),
        ({"name": "1job"}, "name", r'received "1job"\. Fix: use a name like "job-1job"'),
        ({"name": "ctr_train"}, "name", r'received "ctr_train"\. Fix: use a name like "ctr-train"'),
        ({"name": "ctr-"}, "name", r'received "ctr-"'),
        ({"name": ""}, "name", r'received ""'),
        ({"workers": 0}, "workers", r"must be an int >= 1 \(the number of Worker replicas\); received 0"),
        ({"workers": True}, "workers", r"received True \(a bool\)"),
        ({"workers": "2"}, "workers", r"received '2' \(a str\)"),
        ({"ps": 0}, "ps", r"must be an int >= 1 \(the number of PS replicas\); received 0"),
        ({"gpus": -1}, "gpus", r"must be an int >= 0 .*; received -1\. Fix: pass 0 for no GPUs"),
        ({"command": []}, "command", r"non-empty list of strings .*; received \[\]"),
        ({"command": "python train.py"}, "command",
         r"Fix: split it into a list, e.g. \['python', 'train.py'\]"),
        ({"command": ["python", 3]}, "command", r"received \['python', 3\]"),
        ({"command": [""]}, "command", r"received \[''\]"),
        ({"image": ""}, "image", r'received ""'),
        ({"image": "my image"}, "image", r'without spaces.*received "my image"'),
        ({"cpu": "two"}, "cpu", r'Kubernetes quantity such as "4" or "500m"; received "two"'),
        ({"memory": "-1Gi"}, "memory", r'received "-1Gi"'),
        ({"memory": "16 Gi"}, "memory", r'received "16 Gi"'),
        ({"namespace": "ML_Team"}, "namespace", r'DNS-1123 label .*; received "ML_Team"'),
        ({"port": 0}, "port",
         r"must be an int in 1\.\.65535 .*; received 0\. Fix: use the operator's default, 2222"),
        ({"port": 65536}, "port", r"received 65536"),
        ({"evaluator": "yes"}, "evaluator", r'must be True or False .*; received "yes"'),
    ],
)
def test_invalid_arguments_are_named_with_the_fix(kwargs, argument, match):
    args = {"name": "ctr", "image": IMAGE, "command": COMMAND, "workers": 2, "ps": 1, **kwargs}
    with pytest.raises(ManifestError, match=match) as info:
        tfjob_manifest(**args)
    assert info.value.argument == argument
    assert str(info.value).startswith(f"Argument `{argument}` must ")
    assert "Fix: " in str(info.value)
    assert info.value.renamed("Option `--x`").startswith("Option `--x` must ")


@pytest.mark.parametrize(
    "workers, evaluator, room",
    [
        # The longest derived name decides: "-evaluator-0" is 12 characters,
        # which leaves 63 - 12 = 51 for the job name...
        (10, True, 51),
        # ...without an evaluator, "-worker-9" (9) leaves 54 with 10 workers...
        (10, False, 54),
        # ...and "-worker-1000" (12) leaves 51 with 1001 workers.
        (1001, False, 51),
    ],
)
def test_name_leaves_room_for_the_pod_and_service_names(workers, evaluator, room):
    longest_ok = "j" * room
    manifest = tfjob_manifest(longest_ok, IMAGE, COMMAND, workers=workers, ps=2, evaluator=evaluator)
    assert manifest["metadata"]["name"] == longest_ok
    too_long = rf"\({room + 1} characters\), which makes .* shorten the name to at most {room} characters"
    with pytest.raises(ManifestError, match=too_long):
        tfjob_manifest(longest_ok + "j", IMAGE, COMMAND, workers=workers, ps=2, evaluator=evaluator)


@pytest.mark.parametrize("cpu, threads", [("500m", 1), ("4", 4), ("2.5", 3), ("1500m", 2)])
def test_the_cpu_request_sizes_the_servers_thread_pools(cpu, threads):
    manifest = manifest_for("ctr", 2, 1, True, None, 2222, cpu, None, 0)
    for rtype in ("Worker", "PS"):
        assert {"name": "TF_PSX_INTRA_OP_THREADS", "value": str(threads)} in replica_container(manifest, rtype)["env"]
    for rtype in ("Chief", "Evaluator"):  # the user's command: its threads are its own
        assert all(e["name"] != "TF_PSX_INTRA_OP_THREADS" for e in replica_container(manifest, rtype)["env"])


# --- TLS between the pods -----------------------------------------------------


@pytest.mark.parametrize("port", [2222, 23456])
def test_tls_wraps_every_command_in_the_mesh_whose_door_is_the_only_open_port(port):
    manifest = tfjob_manifest("ctr", IMAGE, COMMAND, workers=2, ps=2, evaluator=True, namespace="ml",
                              port=port, tls_secret="ctr-tls")
    jsonschema.validate(manifest, SCHEMA, cls=jsonschema.Draft202012Validator)
    policy = k8s.network_policy("ctr", namespace="ml", port=port)
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": port}]
    # The policy selects the pods the operator labels with the job's name, and admits only them.
    assert policy["spec"]["podSelector"] == rule["from"][0]["podSelector"] == {
        "matchLabels": {"training.kubeflow.org/job-name": "ctr"}}
    assert policy["metadata"] == {"name": "ctr-tasks-only", "namespace": "ml"}
    cluster = operator_cluster(manifest)
    for rtype, spec in manifest["spec"]["tfReplicaSpecs"].items():
        container = replica_container(manifest, rtype)
        mesh, runs = container["command"][:6], container["command"][6:]
        assert mesh == ["python", "-m", "tf_psx.tlsmesh", "--cert-dir", "/etc/tf-psx/tls", "--"]
        assert runs == (COMMAND if rtype in ("Chief", "Evaluator") else ["python", "-m", "tf_psx.server"])
        assert container["volumeMounts"] == [{"name": "tf-psx-tls", "mountPath": "/etc/tf-psx/tls", "readOnly": True}]
        assert spec["template"]["spec"]["volumes"] == [{"name": "tf-psx-tls", "secret": {"secretName": "ctr-tls"}}]
        for index in range(spec["replicas"]):
            plan = tlsmesh.mesh_plan({"cluster": cluster, "task": {"type": rtype.lower(), "index": index}})
            # The door listens on the port that the operator's addresses and the policy name...
            assert list(plan.accept) == ([] if rtype == "Evaluator" else [f"0.0.0.0:{port}"])
            # ...and the task's own process is given loopback addresses only.
            addresses = [a for job in plan.local_tf_config["cluster"].values() for a in job]
            assert len(addresses) == 5 and all(a.startswith("127.0.0.1:") for a in addresses)
    plain = tfjob_manifest("ctr", IMAGE, COMMAND, workers=2, ps=2)
    assert "volumes" not in plain["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]


@pytest.mark.parametrize("secret", ["CTR_TLS", "", 3])
def test_a_bad_tls_secret_name_is_named_with_the_fix(secret):
    with pytest.raises(ManifestError, match=r"`tls_secret` must be the name of a Kubernetes secret .*"
                                            r"received .*Fix: create one with cert-manager") as info:
        tfjob_manifest("ctr", IMAGE, COMMAND, workers=1, ps=1, tls_secret=secret)
    assert info.value.argument == "tls_secret"
