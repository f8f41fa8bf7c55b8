"""Tests of the `tf-psx` command (unit tier: no servers are started).

Most tests call `tf_psx.cli.main([...])` in-process; one runs the installed
console script, and one checks in a fresh interpreter that the command never
imports TensorFlow.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from tf_psx import cli
from tf_psx.cluster import ClusterConfig
from tf_psx.cluster.k8s import network_policy, tfjob_manifest

from conftest import TESTS

pytestmark = pytest.mark.unit

SCHEMA = json.loads((Path(TESTS) / "tfjob_v1_schema.json").read_text(encoding="utf-8"))
VALID_TF_CONFIG = json.dumps(
    {
        "cluster": {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["ps0:2222"]},
        "task": {"type": "worker", "index": 0},
    }
)
VALID_SUMMARY = "valid: 2 workers, 1 ps, chief, task worker:0\n"
K8S_ARGS = ["k8s", "--name", "ctr", "--image", "img:1", "--workers", "2", "--ps", "1"]
# Generous: a fresh interpreter on a loaded 2-core machine.
SUBPROCESS_TIMEOUT_S = 120


def test_public_api_is_pinned():
    assert cli.__all__ == ["CommandError", "main"]
    assert {"_add_config", "_add_k8s", "_add_shard_report"} <= {add.__name__ for add in cli._SUBCOMMANDS}


# --- config: print a TF_CONFIG ---------------------------------------------


@pytest.mark.parametrize(
    "flags, task, expected_cluster",
    [
        (["--workers", "w0:2222,w1:2222", "--ps", "ps0:2222"], "worker:1",
         {"worker": ["w0:2222", "w1:2222"], "ps": ["ps0:2222"]}),
        (["--workers", "w0:1", "--ps", "ps0:2,ps1:3", "--chief", "c0:4"], "ps:1",
         {"chief": ["c0:4"], "worker": ["w0:1"], "ps": ["ps0:2", "ps1:3"]}),
        # Spaces after the commas are forgiven; the evaluator stays out of a training task's cluster.
        (["--workers", "w0:1, w1:1", "--ps", "ps0:2", "--chief", "c0:4", "--evaluator", "e0:5"], "chief:0",
         {"chief": ["c0:4"], "worker": ["w0:1", "w1:1"], "ps": ["ps0:2"]}),
        # The evaluator's own TF_CONFIG holds only the evaluator (ClusterConfig.tf_config).
        (["--workers", "w0:1", "--ps", "ps0:2", "--evaluator", "e0:5"], "evaluator:0",
         {"evaluator": ["e0:5"]}),
    ],
)
def test_config_round_trips_through_from_tf_config(run, flags, task, expected_cluster):
    status, out, err = run("config", *flags, "--task", task)
    assert (status, err) == (0, "")
    assert out.endswith("\n") and out.count("\n") == 1  # one line, for export TF_CONFIG=$(...)
    config = ClusterConfig.from_tf_config(out)
    task_type, index = task.split(":")
    assert (config.task_type, config.task_index) == (task_type, int(index))
    assert config.as_dict() == expected_cluster
    assert json.loads(out) == {"cluster": expected_cluster, "task": {"type": task_type, "index": int(index)}}


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--workers", "w0:2222", "--ps", "ps0", "--task", "worker:0"],
         r'ps\[0\] must be "host:port" .*received "ps0"\. Fix: add the port after a colon, e.g\. "ps0:2222"'),
        (["--workers", "w0:2222,w0:2222", "--ps", "ps0:1", "--task", "worker:0"],
         r'workers\[1\] must be an address no other task uses'),
        (["--workers", "w0:2222", "--ps", "ps0:1", "--task", "worker"],
         r'Option `--task` must be "TYPE:INDEX" .*received "worker"'),
        (["--workers", "w0:2222", "--ps", "ps0:1", "--task", "chief:0"],
         r'Option `--task` "chief:0" names no task of the cluster: .*received "chief"'),
        (["--workers", "w0:2222", "--ps", "ps0:1", "--task", "worker:1"],
         r'Option `--task` "worker:1" .*must be an int in 0\.\.0 .*received 1'),
        (["--ps", "ps0:1", "--task", "worker:0"], r"Option `--workers` is required to print a TF_CONFIG"),
        (["--workers", "w0:2222", "--ps", "ps0:1"], r"Option `--task` is required"),
    ],
)
def test_config_bad_flags_exit_2_with_the_message(run, argv, match):
    status, out, err = run("config", *argv)
    assert (status, out) == (2, "")
    assert err.startswith("tf-psx config: error: ")
    assert "Fix: " in err
    assert re.search(match, err), err


# --- config --check ----------------------------------------------------------


def test_check_valid_environment(run, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", VALID_TF_CONFIG)
    assert run("config", "--check") == (0, VALID_SUMMARY, "")


def test_check_summary_names_the_evaluator_and_a_missing_task(run, monkeypatch):
    cluster = {"worker": ["w:1"], "ps": ["p:2"], "evaluator": ["e:3"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster}))
    assert run("config", "--check") == (0, "valid: 1 worker, 1 ps, evaluator, no task\n", "")


@pytest.mark.parametrize(
    "tf_config, match",
    [
        ('{"cluster": {"worker": ["w0:2222"], "ps": ["ps0:2222"]},}',
         r"\$TF_CONFIG: TF_CONFIG must be valid JSON .*trailing comma"),
        ("{'cluster': {}}", r"must be valid JSON .*single quotes"),
        ('{"cluster": {"worker": ["w0:70000"], "ps": ["ps0:2222"]}}',
         r'TF_CONFIG\["cluster"\]\["worker"\]\[0\] must be "host:port" .*received "w0:70000"'),
        ('{"cluster": {"worker": ["w0:http"], "ps": ["ps0:2222"]}}', r'whose port "http" is not a number'),
        ('{"cluster": {"worker": ["w0:1"], "ps": ["ps0:2"]}, "task": {"type": "master", "index": 0}}',
         r'TF_CONFIG\["task"\]\["type"\] must be one of'),
        # Valid for TensorFlow, but parameter-server training needs ps.
        ('{"cluster": {"worker": ["w0:1"]}, "task": {"type": "worker", "index": 0}}', r'has no "ps" job'),
        ("", r"TF_CONFIG is not set"),
    ],
)
def test_check_invalid_environment_exits_2_with_the_message(run, monkeypatch, tf_config, match):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    status, out, err = run("config", "--check")
    assert (status, out) == (2, "")
    assert err.startswith("tf-psx config: error: $TF_CONFIG: ")
    assert re.search(match, err), err


def test_check_unset_environment(run, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    status, out, err = run("config", "--check")
    assert (status, out) == (2, "")
    assert "TF_CONFIG is not set" in err and "Fix: " in err


def test_check_file(run, tmp_path, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)  # The file is read, not the environment.
    good = tmp_path / "tf_config.json"
    good.write_text(VALID_TF_CONFIG, encoding="utf-8")
    assert run("config", "--check", str(good)) == (0, VALID_SUMMARY, "")
    bad = tmp_path / "bad.json"
    bad.write_text('{"cluster": {"worker": ["w0:1"], "ps": ["ps0"]}}', encoding="utf-8")
    status, out, err = run("config", "--check", str(bad))
    assert (status, out) == (2, "")
    assert err.startswith(f"tf-psx config: error: {bad}: ")
    assert 'TF_CONFIG["cluster"]["ps"][0] must be "host:port"' in err


def test_check_missing_file(run, tmp_path):
    missing = tmp_path / "nope.json"
    status, out, err = run("config", "--check", str(missing))
    assert (status, out) == (2, "")
    assert f'FILE "{missing}" of `--check FILE` does not exist' in err
    assert "Fix: check the path" in err


def test_check_directory_is_not_a_file(run, tmp_path):
    status, _, err = run("config", "--check", str(tmp_path))
    assert status == 2
    assert "cannot be read" in err


def test_check_stdin(run, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(VALID_TF_CONFIG))
    assert run("config", "--check", "-") == (0, VALID_SUMMARY, "")
    monkeypatch.setattr(sys, "stdin", io.StringIO("not json"))
    status, _, err = run("config", "--check", "-")
    assert status == 2
    assert err.startswith("tf-psx config: error: <stdin>: TF_CONFIG must be valid JSON")


def test_check_takes_no_cluster_flags(run):
    status, out, err = run("config", "--check", "--workers", "w0:1")
    assert (status, out) == (2, "")
    assert "received --workers as well" in err


# --- k8s -----------------------------------------------------------------------


def test_k8s_writes_a_valid_tfjob_to_a_file(run, tmp_path):
    path = tmp_path / "job.yaml"
    status, out, err = run(
        *K8S_ARGS, "--evaluator", "--cpu", "4", "--memory", "16Gi", "--gpus", "1", "--namespace", "ml",
        "-o", str(path), "--", "python", "train.py", "--epochs", "3",
    )
    assert (status, out) == (0, "")
    assert f"wrote TFJob ctr (1 Chief, 2 Worker, 1 PS, 1 Evaluator) to {path}" in err
    assert f"kubectl apply -f {path}" in err
    manifest = yaml.safe_load(path.read_text(encoding="utf-8"))
    jsonschema.validate(manifest, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert manifest == tfjob_manifest(
        "ctr", "img:1", ["python", "train.py", "--epochs", "3"], workers=2, ps=1, evaluator=True,
        cpu="4", memory="16Gi", gpus=1, namespace="ml",
    )
    # sort_keys=False: the YAML reads in the manifest's order, apiVersion first.
    assert path.read_text(encoding="utf-8").startswith("apiVersion: kubeflow.org/v1\nkind: TFJob\n")


def test_k8s_writes_to_stdout_without_o(run):
    status, out, err = run(*K8S_ARGS, "--port", "2345", "--", "python", "train.py")
    assert status == 0
    assert "to stdout" in err
    manifest = yaml.safe_load(out)
    jsonschema.validate(manifest, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert manifest == tfjob_manifest("ctr", "img:1", ["python", "train.py"], workers=2, ps=1, port=2345)


def test_k8s_data_workers_add_the_data_service_and_give_the_chief_its_address(run):
    status, out, err = run(*K8S_ARGS, "--evaluator", "--cpu", "2", "--data-workers", "3", "--", "python", "train.py")
    assert status == 0, err
    assert "a tf.data service of 3 data worker(s)" in err
    job, dispatcher, service, workers = yaml.safe_load_all(out)
    jsonschema.validate(job, SCHEMA, cls=jsonschema.Draft202012Validator)
    address = {"name": "TF_PSX_DATA_SERVICE", "value": "grpc://ctr-data-dispatcher:5050"}
    specs = job["spec"]["tfReplicaSpecs"]
    for rtype in ("Chief", "Evaluator"):
        assert address in specs[rtype]["template"]["spec"]["containers"][0]["env"]
    for rtype in ("Worker", "PS"):
        assert address not in specs[rtype]["template"]["spec"]["containers"][0]["env"]
    assert (dispatcher["kind"], service["kind"], workers["kind"]) == ("Deployment", "Service", "Deployment")
    assert service["metadata"]["name"] == "ctr-data-dispatcher" and service["spec"]["ports"][0]["port"] == 5050
    assert service["spec"]["selector"] == dispatcher["spec"]["template"]["metadata"]["labels"]
    assert workers["spec"]["replicas"] == 3
    (container,) = workers["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "tf_psx.cluster.data_service", "worker", "--port", "5051",
                                    "--dispatcher", "ctr-data-dispatcher:5050", "--host", "$(POD_IP)"]
    assert container["resources"] == {"requests": {"cpu": "2"}, "limits": {"cpu": "2"}}


@pytest.mark.parametrize("extra, match", [
    (["--data-workers", "-1"], r"Option `--data-workers` must be an int >= 1 .*Received: -1"),
    (["--data-workers", "2", "--tls-secret", "ctr-tls"], r"Option `--data-workers` cannot be used with a TLS secret"),
])
def test_k8s_bad_data_workers_exit_2_naming_the_option(run, extra, match):
    status, out, err = run(*K8S_ARGS, *extra, "--", "python", "train.py")
    assert (status, out) == (2, "")
    assert re.search(match, err) and "Fix: " in err, err


@pytest.mark.parametrize(
    "replace, match",
    [
        ({"--workers": "0"},
         r"Option `--workers` must be an int >= 1 \(the number of Worker replicas\); received 0"),
        ({"--ps": "0"}, r"Option `--ps` must be an int >= 1"),
        ({"--name": "CTR"}, r'Option `--name` must be a DNS-1035 label .*received "CTR"'),
        ({"--image": "a b"}, r'Option `--image` must be .*received "a b"'),
        ({"--gpus": "-1"}, r"Option `--gpus` must be an int >= 0"),
        ({"--cpu": "lots"},
         r'Option `--cpu` must be a Kubernetes quantity such as "4" or "500m"; received "lots"'),
        ({"--port": "0"}, r"Option `--port` must be an int in 1\.\.65535"),
        ({"--namespace": "Team_A"}, r'Option `--namespace` must be'),
    ],
)
def test_k8s_bad_options_exit_2_naming_the_option(run, tmp_path, replace, match):
    argv = list(K8S_ARGS) + ["--cpu", "1", "--gpus", "0", "--port", "2222", "--namespace", "ml"]
    for flag, value in replace.items():
        argv[argv.index(flag) + 1] = value
    path = tmp_path / "job.yaml"
    status, out, err = run(*argv, "-o", str(path), "--", "python", "train.py")
    assert (status, out) == (2, "")
    assert err.startswith("tf-psx k8s: error: ")
    assert re.search(match, err), err
    assert "Fix: " in err
    assert not path.exists()


def test_k8s_tls_secret_writes_the_tfjob_and_its_network_policy(run):
    status, out, err = run(*K8S_ARGS, "--namespace", "ml", "--tls-secret", "ctr-tls", "--", "python", "train.py")
    assert status == 0 and "TLS only, with its NetworkPolicy" in err
    job, policy = yaml.safe_load_all(out)
    jsonschema.validate(job, SCHEMA, cls=jsonschema.Draft202012Validator)
    assert job == tfjob_manifest("ctr", "img:1", ["python", "train.py"], workers=2, ps=1, namespace="ml",
                                 tls_secret="ctr-tls")
    assert policy == network_policy("ctr", namespace="ml")
    status, _, err = run(*K8S_ARGS, "--tls-secret", "Ctr_TLS", "--", "python", "train.py")
    assert status == 2 and err.startswith("tf-psx k8s: error: Option `--tls-secret` must be the name")


def test_k8s_without_a_command(run):
    status, out, err = run(*K8S_ARGS)
    assert (status, out) == (2, "")
    assert "The command after `--` is missing" in err and "-- python train.py" in err


def test_k8s_unwritable_output(run, tmp_path):
    path = tmp_path / "no-such-dir" / "job.yaml"
    status, _, err = run(*K8S_ARGS, "-o", str(path), "--", "python", "train.py")
    assert status == 2
    assert f'Option `-o` FILE "{path}" cannot be written' in err


# --- the parser ----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, status, match",
    [
        ([], 2, "the following arguments are required: COMMAND"),
        (["launch"], 2, "the following arguments are required: --workers, --ps"),
        (["k8s", "--name", "c", "--image", "i", "--workers", "two", "--ps", "1"], 2,
         "argument --workers: invalid int value: 'two'"),
        (["--help"], 0, ""),
    ],
)
def test_argparse_exits_become_return_values(run, argv, status, match):
    got, out, err = run(*argv)
    assert got == status
    assert match in err
    if status == 0:
        assert "config" in out and "k8s" in out


def test_a_subcommand_is_added_by_one_adder(run, monkeypatch):
    # The extension point other subcommands (launch, shard-report) use.
    def _add_hello(subparsers):
        parser = subparsers.add_parser("hello")
        parser.add_argument("--who", default="world")
        parser.set_defaults(run=lambda args: print(f"hello {args.who}") or 0)

    monkeypatch.setattr(cli, "_SUBCOMMANDS", [*cli._SUBCOMMANDS, _add_hello])
    assert run("hello", "--who", "ps") == (0, "hello ps\n", "")
    assert run("config", "--workers", "w:1", "--ps", "p:2", "--task", "ps:0")[0] == 0


# --- out of process --------------------------------------------------------------


@pytest.mark.processes
def test_installed_console_script_checks_tf_config():
    script = Path(sys.executable).parent / "tf-psx"
    repo = Path(cli.__file__).parents[2]  # tf_psx/cli/__init__.py
    assert script.exists(), f"{script} is missing. Fix: pip install --no-deps -e {repo}"
    env = {**os.environ, "TF_CONFIG": VALID_TF_CONFIG}
    good = subprocess.run(
        [str(script), "config", "--check"], capture_output=True, text=True, env=env,
        timeout=SUBPROCESS_TIMEOUT_S, check=False,
    )
    assert (good.returncode, good.stdout, good.stderr) == (0, VALID_SUMMARY, "")
    env["TF_CONFIG"] = '{"cluster": {"worker": ["w0:0"], "ps": ["ps0:1"]}}'
    bad = subprocess.run(
        [str(script), "config", "--check"], capture_output=True, text=True, env=env,
        timeout=SUBPROCESS_TIMEOUT_S, check=False,
    )
    assert bad.returncode == 2
    assert 'TF_CONFIG["cluster"]["worker"][0] must be "host:port"' in bad.stderr


@pytest.mark.processes
def test_config_and_k8s_do_not_import_tensorflow(tmp_path):
    code = (
        "import sys, tf_psx.cli\n"
        "assert tf_psx.cli.main(['config', '--workers', 'a:1', '--ps', 'b:2', '--task', 'worker:0']) == 0\n"
        f"assert tf_psx.cli.main(['k8s', '--name', 'j', '--image', 'i', '--workers', '1', '--ps', '1',"
        f" '-o', {str(tmp_path / 'job.yaml')!r}, '--', 'python', 't.py']) == 0\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'tf_keras'))\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT_S, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('{"cluster": {"worker": ["a:1"], "ps": ["b:2"]}')
    assert (tmp_path / "job.yaml").exists()
