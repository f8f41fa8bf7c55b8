"""Unit tests for tf_psx.cluster (unit tier: no servers are started)."""

from __future__ import annotations

import doctest
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tf_psx import cluster
from tf_psx.cluster import ClusterConfig, TFConfigError

pytestmark = pytest.mark.unit

CLUSTER_PY = Path(cluster.__file__)

WORKERS = ["worker0.example.com:2222", "10.0.0.2:2222"]
PS = ["ps0.example.com:2222", "[fd00::3]:2222"]
CHIEF = "chief0.example.com:2222"
EVALUATOR = "eval0.example.com:2222"


@pytest.fixture
def full_config() -> ClusterConfig:
    return ClusterConfig(workers=WORKERS, ps=PS, chief=CHIEF, evaluator=EVALUATOR)


def tf_config_with(**cluster_jobs) -> dict:
    """A TF_CONFIG dict whose cluster is a valid PS cluster updated with `cluster_jobs`."""
    jobs = {"worker": ["w0:2222"], "ps": ["ps0:2222"]}
    jobs.update(cluster_jobs)
    return {"cluster": jobs}


# --- the public surface -------------------------------------------------


def test_public_api_is_pinned():
    assert cluster.__all__ == ["ClusterConfig", "TFConfigError"]
    assert issubclass(TFConfigError, ValueError)
    signatures = {
        "__init__": "(self, workers: 'Sequence[str]', ps: 'Sequence[str]', "
        "chief: 'str | Sequence[str] | None' = None, "
        "evaluator: 'str | Sequence[str] | None' = None) -> 'None'",
        "from_tf_config": "(value: 'str | Mapping[str, Any] | None' = None) -> 'ClusterConfig'",
        "tf_config": "(self, task_type: 'str', index: 'int') -> 'dict[str, Any]'",
        "to_json": "(self, task_type: 'str', index: 'int') -> 'str'",
        "cluster_spec": "(self) -> 'tf.train.ClusterSpec'",
        "as_dict": "(self) -> 'dict[str, list[str]]'",
        "validate_for_parameter_server": "(self) -> 'ClusterConfig'",
    }
    for name, expected in signatures.items():
        assert str(inspect.signature(getattr(ClusterConfig, name))) == expected, name
    for name in ("workers", "ps", "chief", "evaluator", "num_workers", "num_ps", "task_type", "task_index"):
        assert isinstance(inspect.getattr_static(ClusterConfig, name), property), name


def test_docstring_examples_run():
    results = doctest.testmod(cluster.config, optionflags=doctest.ELLIPSIS)
    assert results.attempted > 0
    assert results.failed == 0


@pytest.mark.processes
def test_importing_the_module_does_not_import_tensorflow():
    # Loads the file itself, so that whatever tf_psx/__init__.py imports does not count.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('cluster_alone', {str(CLUSTER_PY)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "module.ClusterConfig(workers=['w:1'], ps=['p:2']).to_json('worker', 0)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- valid configs ------------------------------------------------------


def test_constructor_keeps_addresses_in_order(full_config):
    assert full_config.workers == tuple(WORKERS)
    assert full_config.ps == tuple(PS)
    assert full_config.chief == CHIEF
    assert full_config.evaluator == EVALUATOR
    assert (full_config.num_workers, full_config.num_ps) == (2, 2)
    assert (full_config.task_type, full_config.task_index) == (None, None)
    assert full_config.as_dict() == {
        "chief": [CHIEF],
        "worker": WORKERS,
        "ps": PS,
        "evaluator": [EVALUATOR],
    }


@pytest.mark.parametrize("chief", [CHIEF, [CHIEF], (CHIEF,)])
def test_chief_may_be_a_string_or_one_element_list(chief):
    assert ClusterConfig(workers=WORKERS, ps=PS, chief=chief).chief == CHIEF


def test_as_dict_returns_a_copy(full_config):
    full_config.as_dict()["worker"].append("intruder:1")
    assert full_config.num_workers == 2


@pytest.mark.parametrize(
    "address",
    [
        "localhost:1",
        "my_service:65535",
        "job-worker-0.ns.svc.cluster.local:2222",
        "192.168.1.1:80",
        "[::1]:2222",
        "[2001:db8::7]:443",
    ],
)
def test_valid_address_forms(address):
    assert ClusterConfig(workers=[address], ps=["other:9"]).workers == (address,)


def test_training_tf_config_leaves_out_the_evaluator(full_config):
    expected_cluster = {"chief": [CHIEF], "worker": WORKERS, "ps": PS}
    for task_type, index in [("chief", 0), ("worker", 1), ("ps", 0)]:
        assert full_config.tf_config(task_type, index) == {
            "cluster": expected_cluster,
            "task": {"type": task_type, "index": index},
        }


def test_evaluator_tf_config_holds_only_the_evaluator(full_config):
    assert full_config.tf_config("evaluator", 0) == {
        "cluster": {"evaluator": [EVALUATOR]},
        "task": {"type": "evaluator", "index": 0},
    }


def test_to_json_is_tf_config_as_json(full_config):
    assert json.loads(full_config.to_json("worker", 1)) == full_config.tf_config("worker", 1)


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "dict"])
def test_from_tf_config_keeps_evaluator_and_task(as_json):
    tf_config = {
        "cluster": {"chief": [CHIEF], "worker": WORKERS, "ps": PS, "evaluator": [EVALUATOR]},
        "task": {"type": "ps", "index": 1},
        "rpc_layer": "grpc",  # Known to TF; ignored here.
    }
    cfg = ClusterConfig.from_tf_config(json.dumps(tf_config) if as_json else tf_config)
    assert cfg.evaluator == EVALUATOR
    assert (cfg.task_type, cfg.task_index) == ("ps", 1)
    assert cfg.as_dict() == tf_config["cluster"]


def test_from_tf_config_reads_the_environment(monkeypatch, full_config):
    monkeypatch.setenv("TF_CONFIG", full_config.to_json("worker", 0))
    cfg = ClusterConfig.from_tf_config()
    assert cfg.as_dict() == {"chief": [CHIEF], "worker": WORKERS, "ps": PS}
    assert (cfg.task_type, cfg.task_index) == ("worker", 0)


def test_from_tf_config_accepts_a_cluster_without_ps_until_asked():
    cfg = ClusterConfig.from_tf_config({"cluster": {"worker": WORKERS}})
    assert (cfg.num_workers, cfg.num_ps, cfg.task_type) == (2, 0, None)
    with pytest.raises(TFConfigError, match=r'TF_CONFIG\["cluster"\] has no "ps" job'):
        cfg.validate_for_parameter_server()


def test_validate_for_parameter_server_names_a_missing_worker_job():
    cfg = ClusterConfig.from_tf_config({"cluster": {"chief": [CHIEF], "ps": PS}})
    with pytest.raises(TFConfigError, match=r'has no "worker" job; .*\(received jobs: "chief", "ps"\)'):
        cfg.validate_for_parameter_server()


def test_validate_for_parameter_server_returns_self(full_config):
    assert full_config.validate_for_parameter_server() is full_config


def test_evaluator_task_without_evaluator_job_is_accepted_as_in_tensorflow():
    # multi_worker_util._validate_cluster_spec makes the same exception.
    cfg = ClusterConfig.from_tf_config({"cluster": {"worker": WORKERS}, "task": {"type": "evaluator", "index": 0}})
    assert (cfg.task_type, cfg.task_index, cfg.evaluator) == ("evaluator", 0, None)


def test_from_tf_config_round_trips_every_task(full_config):
    for task_type, index in [("chief", 0), ("worker", 1), ("ps", 1), ("evaluator", 0)]:
        cfg = ClusterConfig.from_tf_config(full_config.to_json(task_type, index))
        assert cfg.tf_config(task_type, index) == full_config.tf_config(task_type, index)


def test_equality_hash_and_repr(full_config):
    same = ClusterConfig(workers=list(WORKERS), ps=tuple(PS), chief=[CHIEF], evaluator=EVALUATOR)
    assert same == full_config
    assert hash(same) == hash(full_config)
    assert full_config != ClusterConfig(workers=WORKERS, ps=PS, chief=CHIEF)
    # The task is part of the value: the same cluster read for another task differs.
    worker0 = ClusterConfig.from_tf_config(full_config.to_json("worker", 0))
    assert worker0 != ClusterConfig.from_tf_config(full_config.to_json("worker", 1))
    assert repr(ClusterConfig(workers=["w:1"], ps=["p:2"])) == (
        "ClusterConfig(workers=['w:1'], ps=['p:2'], chief=None, evaluator=None)"
    )
    assert repr(worker0).endswith("task_type='worker', task_index=0)")


# --- invalid TF_CONFIG: one case per rule --------------------------------


def test_error_message_format_is_pinned():
    with pytest.raises(TFConfigError) as info:
        ClusterConfig.from_tf_config({"cluster": {"worker": ["w0:2222"], "ps": ["ps0:2222", "ps1"]}})
    assert str(info.value) == (
        'TF_CONFIG["cluster"]["ps"][1] must be "host:port" (a hostname, IPv4 address or '
        '[IPv6] address, then a port 1..65535); received "ps1". '
        'Fix: add the port after a colon, e.g. "ps1:2222".'
    )


def test_messages_use_the_constants_the_checks_use():
    low, high = cluster.PORT_RANGE
    with pytest.raises(TFConfigError, match=re.escape(f"outside {low}..{high}")):
        ClusterConfig(workers=[f"w:{high + 1}"], ps=PS)
    types = ", ".join(f'"{t}"' for t in cluster.VALID_TASK_TYPES)
    with pytest.raises(TFConfigError, match=re.escape(f"expected one of {types}")):
        ClusterConfig.from_tf_config({"cluster": {"parameter_server": ["p:1"]}})


def test_malformed_json_gives_the_position():
    # '{"cluster": {"worker": [' is 24 characters and '"w:1",' 6 more, so the "]"
    # where a value was expected is char 30 (0-based), line 1, column 31.
    text = '{"cluster": {"worker": ["w:1",]}}'
    with pytest.raises(
        TFConfigError,
        match=r"TF_CONFIG must be valid JSON .*Expecting value at line 1, column 31 \(char 30\)",
    ):
        ClusterConfig.from_tf_config(text)


def test_malformed_json_on_a_later_line():
    # The comma is missing before line 5's '"task"', which starts after two spaces
    # (column 3); lines 1-4 hold 2 + 15 + 22 + 4 = 43 characters, so char 43 + 2 = 45.
    text = '{\n  "cluster": {\n    "worker": ["w:1"]\n  }\n  "task": {}\n}'
    with pytest.raises(TFConfigError, match=r"Expecting ',' delimiter at line 5, column 3 \(char 45\)"):
        ClusterConfig.from_tf_config(text)


@pytest.mark.parametrize("env", [None, "", "   "], ids=["unset", "empty", "blank"])
def test_unset_tf_config_says_how_to_set_it(monkeypatch, env):
    if env is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", env)
    with pytest.raises(TFConfigError, match=r"TF_CONFIG is not set .* Fix: set it .*export TF_CONFIG="):
        ClusterConfig.from_tf_config()


INVALID_TF_CONFIGS = {
    # id: (TF_CONFIG, pattern the message must match)
    "value-not-str-or-dict": (42, r"Argument `value` must be None .*received 42 \(an int\)"),
    "top-level-not-object": ('["w:1"]', r'TF_CONFIG must be a JSON object .*received \["w:1"\] \(a list\)'),
    "no-cluster-key": (
        {"task": {"type": "worker", "index": 0}},
        r'TF_CONFIG\["cluster"\] is missing; received \{"task": .*Fix: add a "cluster" key',
    ),
    "cluster-not-object": ({"cluster": ["w:1"]}, r'TF_CONFIG\["cluster"\] must be a dict .*\(a list\)'),
    "cluster-empty": ({"cluster": {}}, r'TF_CONFIG\["cluster"\] must name at least one job'),
    "unknown-task-type": (
        tf_config_with(workers=["w1:1"]),
        r'TF_CONFIG\["cluster"\] has unknown task type "workers"; expected one of "chief", '
        r'"worker", "ps", "evaluator"\. Fix: did you mean "worker"\?',
    ),
    "master-is-tf1-chief": (
        tf_config_with(master=["m:1"]),
        r'unknown task type "master".* "master" is the TF1 name for "chief"',
    ),
    "job-empty": (tf_config_with(ps=[]), r'TF_CONFIG\["cluster"\]\["ps"\] must be a non-empty list .*received \[\]'),
    "job-not-list": (
        tf_config_with(ps="ps0:2222"),
        r'TF_CONFIG\["cluster"\]\["ps"\] must be a non-empty list .*received "ps0:2222" \(a str\)'
        r'. Fix: write it as a list, e.g. \["ps0:2222"\]',
    ),
    "job-sparse-dict": (tf_config_with(worker={"1": "w:1"}), r'\["worker"\] must be a non-empty list .*\(a dict\)'),
    "address-not-string": (
        tf_config_with(worker=["w0:1", 2222]),
        r'TF_CONFIG\["cluster"\]\["worker"\]\[1\] must be "host:port" .*received 2222 \(an int\)',
    ),
    "address-no-port": (tf_config_with(ps=["ps0"]), r'\["ps"\]\[0\] must be "host:port" .*received "ps0"\.'),
    "address-empty-host": (tf_config_with(ps=[":2222"]), r'received ":2222", whose host is empty'),
    "address-empty": (tf_config_with(ps=[""]), r'\["ps"\]\[0\] must be "host:port".*received ""\.'),
    "address-space-in-host": (tf_config_with(ps=["ps 0:2222"]), r'whose host "ps 0" is not a valid hostname'),
    "address-bad-ipv4": (tf_config_with(ps=["10.0.0.256:2222"]), r'whose host "10.0.0.256" is not a valid IPv4'),
    "address-bare-ipv6": (
        tf_config_with(ps=["fd00::3:2222"]),
        r'received "fd00::3:2222", an IPv6 address without brackets\. Fix: .*"\[fd00::3\]:2222"',
    ),
    "address-bracketed-not-ipv6": (tf_config_with(ps=["[ps0]:2222"]), r'bracketed host "ps0" is not an IPv6'),
    "address-ipv6-no-port": (tf_config_with(ps=["[::1]"]), r'received "\[::1\]", which is not "\[IPv6\]:port"'),
    "port-non-numeric": (tf_config_with(ps=["ps0:http"]), r'received "ps0:http", whose port "http" is not a number'),
    "port-negative": (tf_config_with(ps=["ps0:-1"]), r'whose port "-1" is not a number'),
    "port-zero": (tf_config_with(ps=["ps0:0"]), r"whose port 0 is outside 1\.\.65535"),
    "port-too-big": (tf_config_with(ps=["ps0:65536"]), r"whose port 65536 is outside 1\.\.65535"),
    "duplicate-within-job": (
        tf_config_with(worker=["w0:2222", "w0:2222"]),
        r'TF_CONFIG\["cluster"\]\["worker"\]\[1\] must be an address no other task uses; received '
        r'"w0:2222", which TF_CONFIG\["cluster"\]\["worker"\]\[0\] already holds',
    ),
    "duplicate-across-jobs": (
        tf_config_with(worker=["w0:2222"], ps=["W0:2222"]),
        r'TF_CONFIG\["cluster"\]\["ps"\]\[0\] must be an address no other task uses; received '
        r'"W0:2222", which TF_CONFIG\["cluster"\]\["worker"\]\[0\] already holds \(written "w0:2222" there\)',
    ),
    "duplicate-ipv6-spellings": (
        tf_config_with(worker=["[::1]:2222"], ps=["[0:0::1]:2222"]),
        r'\["ps"\]\[0\] must be an address no other task uses',
    ),
    "duplicate-with-evaluator": (
        tf_config_with(evaluator=["w0:2222"]),
        r'\["evaluator"\]\[0\] must be an address no other task uses.*\["worker"\]\[0\] already holds',
    ),
    "two-chiefs": (
        tf_config_with(chief=["c0:1", "c1:1"]),
        r'TF_CONFIG\["cluster"\]\["chief"\] must hold exactly one address .*\(2 addresses\)',
    ),
    "two-evaluators": (tf_config_with(evaluator=["e0:1", "e1:1"]), r'\["evaluator"\] must hold exactly one address'),
    "task-not-object": ({**tf_config_with(), "task": "worker"}, r'TF_CONFIG\["task"\] must be a dict .*\(a str\)'),
    "task-without-index": (
        {**tf_config_with(), "task": {"type": "worker"}},
        r'TF_CONFIG\["task"\] must be a dict with "type" and "index"',
    ),
    "task-type-unknown": (
        {**tf_config_with(), "task": {"type": "master", "index": 0}},
        r'TF_CONFIG\["task"\]\["type"\] must be one of "chief", "worker", "ps", "evaluator"; '
        r'received "master"\. Fix: "master" is the TF1 name for "chief"',
    ),
    "task-type-not-in-cluster": (
        {**tf_config_with(), "task": {"type": "chief", "index": 0}},
        r'TF_CONFIG\["task"\]\["type"\] must name a job of TF_CONFIG\["cluster"\], which has '
        r'"worker", "ps"; received "chief"',
    ),
    "task-index-too-big": (
        {**tf_config_with(), "task": {"type": "ps", "index": 1}},
        r'TF_CONFIG\["task"\]\["index"\] must be an int in 0\.\.0 \(TF_CONFIG\["cluster"\]\["ps"\] has '
        r"1 address\); received 1\.",
    ),
    "task-index-negative": ({**tf_config_with(), "task": {"type": "ps", "index": -1}}, r"in 0\.\.0 .*received -1\."),
    "task-index-string": (
        {**tf_config_with(), "task": {"type": "ps", "index": "0"}},
        r'\["index"\] must be an int .*received "0" \(a str\)',
    ),
    "task-index-bool": ({**tf_config_with(), "task": {"type": "ps", "index": False}}, r"received false \(a bool\)"),
    "evaluator-task-index-without-job": (
        {**tf_config_with(), "task": {"type": "evaluator", "index": 1}},
        r'\["index"\] must be an int in 0\.\.0 \(there is at most one evaluator\)',
    ),
}


@pytest.mark.parametrize("tf_config, pattern", INVALID_TF_CONFIGS.values(), ids=INVALID_TF_CONFIGS.keys())
def test_invalid_tf_config_is_rejected(tf_config, pattern):
    with pytest.raises(TFConfigError, match=pattern) as info:
        ClusterConfig.from_tf_config(tf_config)
    assert " Fix: " in str(info.value)


# The environment holds text, so only the cases that are JSON texts or dicts apply.
ENV_CASES = {k: v for k, v in INVALID_TF_CONFIGS.items() if isinstance(v[0], (str, dict))}


@pytest.mark.parametrize("tf_config, pattern", ENV_CASES.values(), ids=ENV_CASES.keys())
def test_invalid_tf_config_is_rejected_from_the_environment(monkeypatch, tf_config, pattern):
    monkeypatch.setenv("TF_CONFIG", tf_config if isinstance(tf_config, str) else json.dumps(tf_config))
    with pytest.raises(TFConfigError, match=pattern):
        ClusterConfig.from_tf_config()


# --- invalid constructor and method arguments ----------------------------


INVALID_ARGUMENTS = {
    "workers-empty": (dict(workers=[], ps=PS), r"workers must be a non-empty list .*received \[\]\. Fix: list at"),
    "ps-empty": (dict(workers=WORKERS, ps=[]), r"ps must be a non-empty list .*received \[\]"),
    "workers-a-string": (dict(workers="w0:1", ps=PS), r'workers must be a non-empty list .*received "w0:1" \(a str\)'),
    "ps-bad-address": (dict(workers=WORKERS, ps=["ps0:2222", "ps1"]), r'ps\[1\] must be "host:port".*received "ps1"\.'),
    "chief-bad-address": (dict(workers=WORKERS, ps=PS, chief="c0"), r'^chief must be "host:port"'),
    "chief-two-addresses": (
        dict(workers=WORKERS, ps=PS, chief=["c0:1", "c1:1"]),
        r'chief must hold exactly one address .*Fix: keep one chief and move the other addresses to "worker"',
    ),
    "evaluator-not-string": (dict(workers=WORKERS, ps=PS, evaluator=7), r"Argument `evaluator` must be .*\(an int\)"),
    "evaluator-reuses-worker": (
        dict(workers=WORKERS, ps=PS, evaluator=WORKERS[1]),
        r"^evaluator must be an address no other task uses; .*which workers\[1\] already holds",
    ),
}


@pytest.mark.parametrize("kwargs, pattern", INVALID_ARGUMENTS.values(), ids=INVALID_ARGUMENTS.keys())
def test_invalid_constructor_arguments(kwargs, pattern):
    with pytest.raises(TFConfigError, match=pattern):
        ClusterConfig(**kwargs)


@pytest.mark.parametrize(
    "task_type, index, pattern",
    [
        ("master", 0, r'Argument `task_type` must be one of .*"master" is the TF1 name for "chief"'),
        ("chief", 0, r'Argument `task_type` must name a job of the cluster, which has "worker", "ps"'),
        ("worker", 2, r"Argument `index` must be an int in 0\.\.1 \(workers has 2 addresses\); received 2\."),
        ("worker", -1, r"Argument `index` must be an int in 0\.\.1 .*received -1\."),
        ("ps", 0.0, r"Argument `index` must be an int .*received 0\.0 \(a float\)"),
    ],
)
def test_tf_config_rejects_a_task_outside_the_cluster(task_type, index, pattern):
    cfg = ClusterConfig(workers=WORKERS, ps=PS)
    with pytest.raises(TFConfigError, match=pattern):
        cfg.tf_config(task_type, index)
    with pytest.raises(TFConfigError, match=pattern):
        cfg.to_json(task_type, index)


# --- agreement with TensorFlow ---------------------------------------------


@pytest.mark.parametrize(
    "task_type, index", [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0), ("ps", 1), ("evaluator", 0)]
)
def test_tf_config_resolver_reads_what_we_write(monkeypatch, full_config, task_type, index):
    tf = pytest.importorskip("tensorflow")
    monkeypatch.setenv("TF_CONFIG", full_config.to_json(task_type, index))
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    assert (resolver.task_type, resolver.task_id) == (task_type, index)
    expected = full_config.cluster_spec().as_dict()
    if task_type == "evaluator":
        expected = {"evaluator": [EVALUATOR]}
    assert resolver.cluster_spec().as_dict() == expected
    # Our own reading of the same TF_CONFIG agrees with TensorFlow's.
    ours = ClusterConfig.from_tf_config()
    assert (ours.task_type, ours.task_index) == (resolver.task_type, resolver.task_id)
    assert ours.cluster_spec().as_dict() == {
        job: addrs for job, addrs in resolver.cluster_spec().as_dict().items() if job != "evaluator"
    }


def test_cluster_spec_never_holds_the_evaluator(full_config):
    pytest.importorskip("tensorflow")
    spec = full_config.cluster_spec()
    assert sorted(spec.jobs) == ["chief", "ps", "worker"]
    assert spec.as_dict() == {"chief": [CHIEF], "worker": WORKERS, "ps": PS}
    # Also when the evaluator came in through a TF_CONFIG cluster (the Kubeflow form).
    tf_config = {"cluster": full_config.as_dict(), "task": {"type": "evaluator", "index": 0}}
    from_env = ClusterConfig.from_tf_config(tf_config)
    assert from_env.evaluator == EVALUATOR
    assert "evaluator" not in from_env.cluster_spec().jobs


def test_cluster_spec_of_a_tf_config_cluster_matches_tensorflow(monkeypatch):
    tf = pytest.importorskip("tensorflow")
    tf_config = {"cluster": {"worker": WORKERS}, "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cfg = ClusterConfig.from_tf_config()
    assert cfg.cluster_spec().as_dict() == resolver.cluster_spec().as_dict() == {"worker": WORKERS}

