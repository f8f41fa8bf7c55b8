"""`ClusterConfig`: where the tasks of a parameter-server cluster are.

A cluster is a set of jobs ("chief", "worker", "ps", "evaluator"), each a list
of "host:port" addresses. `ClusterConfig` builds one from Python lists or
reads one from a `TF_CONFIG` (the environment variable, a JSON string or a
dict), checks it completely before anything connects, and writes it back out
as the `TF_CONFIG` of each task or as a `tf.train.ClusterSpec`.

Every invalid input raises `TFConfigError`, whose message gives the JSON path
of the bad value (``TF_CONFIG["cluster"]["ps"][1]``), the value received, the
expected form and the fix.

Importing this module does not import TensorFlow; only `cluster_spec()` does.

Example:

>>> cfg = ClusterConfig(workers=["w0:2222", "w1:2222"], ps=["ps0:2222"])
>>> cfg.tf_config("worker", 1)
{'cluster': {'worker': ['w0:2222', 'w1:2222'], 'ps': ['ps0:2222']}, 'task': {'type': 'worker', 'index': 1}}
>>> ClusterConfig.from_tf_config(cfg.to_json("ps", 0)).task_type
'ps'
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tf_psx.errors import TFConfigError

if TYPE_CHECKING:  # Only for annotations: importing this module must stay TF-free.
    import tensorflow as tf

__all__ = ["ClusterConfig", "TFConfigError"]

# The environment variable that TensorFlow's TFConfigClusterResolver reads.
TF_CONFIG_ENV = "TF_CONFIG"

# The task types TensorFlow 2 accepts in a cluster (multi_worker_util.py), in
# the order we write them so that every TF_CONFIG we emit reads the same way.
VALID_TASK_TYPES = ("chief", "worker", "ps", "evaluator")

# The jobs of the training cluster. The evaluator is left out of cluster_spec()
# and of the training tasks' TF_CONFIG: a coordinator that finds it there
# waits for a server the evaluator never starts (tensorflow#46169).
TRAINING_TASK_TYPES = ("chief", "worker", "ps")

# TensorFlow allows at most one task in each of these jobs (multi_worker_util).
SINGLE_TASK_TYPES = ("chief", "evaluator")

# ParameterServerStrategy raises "There must be at least one worker/ps." without them.
PS_REQUIRED_TASK_TYPES = ("worker", "ps")

# The TF1 (Estimator) name of the chief; TF2 rejects it, so we reject it and say so.
TF1_CHIEF_NAME = "master"

# TCP ports a server can listen on; 0 means "any free port", which no peer can dial.
PORT_RANGE = (1, 65535)

# The port TensorFlow's documentation uses in its TF_CONFIG examples.
_EXAMPLE_PORT = 2222

# Keeps an error about one value short when that value is a whole cluster.
_MAX_SHOWN_CHARS = 200

# Characters of a malformed JSON text shown on each side of the error position.
_JSON_CONTEXT_CHARS = 20

_ADDRESS_FORM = (
    '"host:port" (a hostname, IPv4 address or [IPv6] address, '
    f"then a port {PORT_RANGE[0]}..{PORT_RANGE[1]})"
)
# The chief's: the process that reads TF_CONFIG to build a strategy is the chief
# (a "worker" task here leads to the next error, "this task is worker").
_TF_CONFIG_EXAMPLE = (
    f'{{"cluster": {{"chief": ["host0:{_EXAMPLE_PORT}"], "worker": ["host1:{_EXAMPLE_PORT}"], '
    f'"ps": ["host2:{_EXAMPLE_PORT}"]}}, "task": {{"type": "chief", "index": 0}}}}'
)
_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?"
_HOSTNAME_RE = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*\Z")
_NUMERIC_HOST_RE = re.compile(r"[0-9.]+\Z")
_PORT_RE = re.compile(r"[0-9]+\Z")
_BRACKETED_RE = re.compile(r"\[(?P<host>[^\[\]]*)\](?::(?P<port>.*))?\Z", re.DOTALL)


def _show(value: Any) -> str:
    """The value as JSON when it is JSON (strings in double quotes), else repr."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > _MAX_SHOWN_CHARS:
        text = text[: _MAX_SHOWN_CHARS - 3] + "..."
    return text


def _show_text(text: str) -> str:
    """A JSON text as a Python literal, so its double quotes are not escaped."""
    if len(text) > _MAX_SHOWN_CHARS:
        text = text[: _MAX_SHOWN_CHARS - 3] + "..."
    return repr(text)


def _show_typed(value: Any) -> str:
    """`_show` plus the Python type, for errors about the kind of value."""
    name = type(value).__name__
    article = "an" if name[:1] in "aeiou" else "a"
    return f"{_show(value)} ({article} {name})"


def _quoted(names: Sequence[str]) -> str:
    return ", ".join(json.dumps(name) for name in names)


class _Paths:
    """Names the places where values come from, for error messages.

    Args:
      cluster: the cluster as a whole, e.g. 'TF_CONFIG["cluster"]'.
      jobs: per task type, the name of its list, e.g. 'TF_CONFIG["cluster"]["ps"]'.
      scalar_jobs: task types given as one address rather than a list, whose
        address is named without an index.
      required_jobs: task types that must be present (constructor arguments).
      task_type: the task type, e.g. 'TF_CONFIG["task"]["type"]'.
      task_index: the task index, e.g. 'TF_CONFIG["task"]["index"]'.
    """

    def __init__(
        self,
        cluster: str,
        jobs: Mapping[str, str],
        task_type: str,
        task_index: str,
        scalar_jobs: frozenset[str] = frozenset(),
        required_jobs: frozenset[str] = frozenset(),
    ) -> None:
        self.cluster = cluster
        self._jobs = jobs
        self.task_type = task_type
        self.task_index = task_index
        self._scalar_jobs = scalar_jobs
        self.required_jobs = required_jobs

    def job(self, task_type: Any) -> str:
        if task_type in self._jobs:
            return self._jobs[task_type]
        return f"{self.cluster}[{_show(task_type)}]"

    def address(self, task_type: str, index: int) -> str:
        if task_type in self._scalar_jobs:
            return self.job(task_type)
        return f"{self.job(task_type)}[{index}]"


def _tf_config_paths() -> _Paths:
    cluster = f'{TF_CONFIG_ENV}["cluster"]'
    return _Paths(
        cluster=cluster,
        jobs={t: f"{cluster}[{json.dumps(t)}]" for t in VALID_TASK_TYPES},
        task_type=f'{TF_CONFIG_ENV}["task"]["type"]',
        task_index=f'{TF_CONFIG_ENV}["task"]["index"]',
    )


def _argument_paths(scalar_jobs: frozenset[str] = frozenset()) -> _Paths:
    return _Paths(
        cluster="the cluster",
        jobs={"chief": "chief", "worker": "workers", "ps": "ps", "evaluator": "evaluator"},
        task_type="Argument `task_type`",
        task_index="Argument `index`",
        scalar_jobs=scalar_jobs,
        required_jobs=frozenset(PS_REQUIRED_TASK_TYPES),
    )


def _address_error(path: str, value: Any, problem: str, fix: str) -> TFConfigError:
    return TFConfigError(f"{path} must be {_ADDRESS_FORM}; received {_show(value)}{problem}. Fix: {fix}")


def _check_address(value: Any, path: str) -> tuple[str, int]:
    """Checks one "host:port" address.

    Args:
      value: the address as received.
      path: where it came from, for the error message.

    Returns:
      (host, port) normalised for comparison: the host lower-cased (IPv6 in
      compressed form) and the port as an int.

    Raises:
      TFConfigError: if `value` is not a "host:port" string with a valid host
        and a port in PORT_RANGE.
    """
    if not isinstance(value, str):
        raise TFConfigError(
            f"{path} must be {_ADDRESS_FORM}; received {_show_typed(value)}. "
            f'Fix: write the address as a string, e.g. "host:{_EXAMPLE_PORT}".'
        )
    if value.startswith("["):
        match = _BRACKETED_RE.match(value)
        if match is None or match["port"] is None:
            raise _address_error(
                path, value, ", which is not \"[IPv6]:port\"",
                f'write the IPv6 address in brackets followed by the port, e.g. "[::1]:{_EXAMPLE_PORT}".',
            )
        host_text, port_text = match["host"], match["port"]
        try:
            host = str(ipaddress.IPv6Address(host_text))
        except ValueError:
            raise _address_error(
                path, value, f", whose bracketed host {_show(host_text)} is not an IPv6 address",
                f'put only an IPv6 address in the brackets, e.g. "[::1]:{_EXAMPLE_PORT}".',
            ) from None
    else:
        host_text, colon, port_text = value.rpartition(":")
        if not colon:
            raise _address_error(
                path, value, "", f"add the port after a colon, e.g. {_show(f'{value}:{_EXAMPLE_PORT}')}."
            )
        if ":" in host_text:
            raise _address_error(
                path, value, ", an IPv6 address without brackets",
                f"put the IPv6 address in brackets, e.g. {_show(f'[{host_text}]:{port_text}')}.",
            )
        if not host_text:
            raise _address_error(
                path, value, ", whose host is empty",
                f"put the host before the colon, e.g. {_show(f'localhost{value}')}.",
            )
        if not _HOSTNAME_RE.match(host_text):
            raise _address_error(
                path, value, f", whose host {_show(host_text)} is not a valid hostname or IPv4 address",
                "use letters, digits, '-', '_' and '.' only, with no spaces.",
            )
        if _NUMERIC_HOST_RE.match(host_text):
            try:
                ipaddress.IPv4Address(host_text)
            except ValueError:
                raise _address_error(
                    path, value, f", whose host {_show(host_text)} is not a valid IPv4 address",
                    "use four numbers 0..255 separated by dots, e.g. \"10.0.0.1\".",
                ) from None
        host = host_text.lower()
    if not _PORT_RE.match(port_text):
        raise _address_error(
            path, value, f", whose port {_show(port_text)} is not a number",
            f"end the address with a port number in {PORT_RANGE[0]}..{PORT_RANGE[1]}.",
        )
    port = int(port_text)
    if not PORT_RANGE[0] <= port <= PORT_RANGE[1]:
        raise _address_error(
            path, value, f", whose port {port} is outside {PORT_RANGE[0]}..{PORT_RANGE[1]}",
            f"use a port in {PORT_RANGE[0]}..{PORT_RANGE[1]}.",
        )
    return host, port


def _unknown_task_type_fix(task_type: Any) -> str:
    if task_type == TF1_CHIEF_NAME:
        return f'"{TF1_CHIEF_NAME}" is the TF1 name for "chief"; rename it to "chief".'
    close = difflib.get_close_matches(str(task_type), VALID_TASK_TYPES, n=1)
    if close:
        return f"did you mean {json.dumps(close[0])}?"
    return "use one of those task types."


def _check_cluster(cluster: Any, paths: _Paths) -> dict[str, tuple[str, ...]]:
    """Checks a whole cluster dict.

    Args:
      cluster: {task type: list of "host:port"} as received.
      paths: names for the error messages.

    Returns:
      {task type: tuple of addresses}, in VALID_TASK_TYPES order.

    Raises:
      TFConfigError: on the first problem found.
    """
    if not isinstance(cluster, Mapping):
        raise TFConfigError(
            f"{paths.cluster} must be a dict of task type -> list of addresses, like "
            f'{{"worker": ["host1:{_EXAMPLE_PORT}"], "ps": ["host2:{_EXAMPLE_PORT}"]}}; '
            f"received {_show_typed(cluster)}. Fix: make it a JSON object."
        )
    if not cluster:
        raise TFConfigError(
            f"{paths.cluster} must name at least one job (one of {_quoted(VALID_TASK_TYPES)}); "
            f'received {{}}. Fix: add the jobs, e.g. {{"worker": ["host1:{_EXAMPLE_PORT}"], '
            f'"ps": ["host2:{_EXAMPLE_PORT}"]}}.'
        )
    for task_type in cluster:
        if task_type not in VALID_TASK_TYPES:
            raise TFConfigError(
                f"{paths.cluster} has unknown task type {_show(task_type)}; expected one of "
                f"{_quoted(VALID_TASK_TYPES)}. Fix: {_unknown_task_type_fix(task_type)}"
            )
    jobs: dict[str, tuple[str, ...]] = {}
    seen: dict[tuple[str, int], tuple[str, str]] = {}  # normalised -> (path, as written)
    for task_type in VALID_TASK_TYPES:
        if task_type not in cluster:
            continue
        addresses = cluster[task_type]
        job_path = paths.job(task_type)
        if not isinstance(addresses, (list, tuple)):
            example = [addresses] if isinstance(addresses, str) else [f"host:{_EXAMPLE_PORT}"]
            raise TFConfigError(
                f'{job_path} must be a non-empty list of "host:port" strings; received '
                f"{_show_typed(addresses)}. Fix: write it as a list, e.g. {_show(example)}."
            )
        if not addresses:
            fix = (
                f"list at least one address (parameter-server training needs at least one in each "
                f"of {_quoted(PS_REQUIRED_TASK_TYPES)})."
                if task_type in paths.required_jobs
                else f"list at least one address, or leave out the {json.dumps(task_type)} job."
            )
            raise TFConfigError(
                f'{job_path} must be a non-empty list of "host:port" strings; received []. Fix: {fix}'
            )
        if task_type in SINGLE_TASK_TYPES and len(addresses) > 1:
            other = "worker" if task_type == "chief" else None
            fix = (
                f'keep one chief and move the other addresses to "{other}".'
                if other
                else "keep one evaluator address and run any other evaluators with their own TF_CONFIG."
            )
            raise TFConfigError(
                f"{job_path} must hold exactly one address (TensorFlow allows at most one "
                f"{json.dumps(task_type)} task); received {_show(list(addresses))} "
                f"({len(addresses)} addresses). Fix: {fix}"
            )
        for index, address in enumerate(addresses):
            path = paths.address(task_type, index)
            key = _check_address(address, path)
            if key in seen:
                first_path, first = seen[key]
                same = f" (written {_show(first)} there)" if first != address else ""
                raise TFConfigError(
                    f"{path} must be an address no other task uses; received {_show(address)}, "
                    f"which {first_path} already holds{same}. Fix: give each task its own "
                    "host:port, e.g. a different port on the same host."
                )
            seen[key] = (path, address)
        jobs[task_type] = tuple(addresses)
    return jobs


def _check_task(
    jobs: Mapping[str, tuple[str, ...]],
    task_type: Any,
    index: Any,
    paths: _Paths,
    allow_absent_evaluator: bool,
) -> None:
    """Checks that (task_type, index) names a task of `jobs`.

    Args:
      jobs: the checked cluster.
      task_type: the task type as received.
      index: the task index as received.
      paths: names for the error messages.
      allow_absent_evaluator: accept "evaluator" when the cluster has no
        evaluator job, as TensorFlow does (multi_worker_util); its index must
        then be 0.

    Raises:
      TFConfigError: if the task type is unknown or absent from the cluster, or
        the index is not an int in range.
    """
    if task_type not in VALID_TASK_TYPES:
        received = _show_typed(task_type) if not isinstance(task_type, str) else _show(task_type)
        raise TFConfigError(
            f"{paths.task_type} must be one of {_quoted(VALID_TASK_TYPES)}; received {received}. "
            f"Fix: {_unknown_task_type_fix(task_type)}"
        )
    if task_type in jobs:
        count = len(jobs[task_type])
        why = f"{paths.job(task_type)} has {count} address{'es' if count != 1 else ''}"
    elif task_type == "evaluator" and allow_absent_evaluator:
        count = 1
        why = "there is at most one evaluator"
    else:
        raise TFConfigError(
            f"{paths.task_type} must name a job of {paths.cluster}, which has "
            f"{_quoted(list(jobs))}; received {json.dumps(task_type)}. Fix: add the "
            f"{json.dumps(task_type)} job to the cluster, or use one of its task types."
        )
    is_int = isinstance(index, int) and not isinstance(index, bool)  # JSON true is not 1.
    if not is_int or not 0 <= index < count:
        received = _show(index) if is_int else _show_typed(index)
        raise TFConfigError(
            f"{paths.task_index} must be an int in 0..{count - 1} ({why}); received {received}. "
            f"Fix: use the task's position in the {json.dumps(task_type)} list, counting from 0."
        )


def _load_tf_config(value: Any) -> Any:
    """Returns the parsed TF_CONFIG from `value` or from the environment."""
    if value is None:
        value = os.environ.get(TF_CONFIG_ENV, "")
        if not value.strip():
            raise TFConfigError(
                f"{TF_CONFIG_ENV} is not set (the environment variable is missing or empty); "
                f"expected a JSON object like {_TF_CONFIG_EXAMPLE}. Fix: set it before starting "
                f"the task, e.g. export {TF_CONFIG_ENV}='{_TF_CONFIG_EXAMPLE}', or pass the JSON "
                "string or dict to ClusterConfig.from_tf_config(value)."
            )
    if isinstance(value, Mapping):
        return value
    if not isinstance(value, str):
        raise TFConfigError(
            f"Argument `value` must be None (read the {TF_CONFIG_ENV} environment variable), a "
            f"JSON string or a dict; received {_show_typed(value)}. Fix: pass "
            f"json.dumps(...) of the {TF_CONFIG_ENV} dict, or the dict itself."
        )
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        start = max(0, err.pos - _JSON_CONTEXT_CHARS)
        near = value[start : err.pos + _JSON_CONTEXT_CHARS]
        raise TFConfigError(
            f"{TF_CONFIG_ENV} must be valid JSON like {_TF_CONFIG_EXAMPLE}; received {_show_text(value)}, "
            f"which fails with: {err.msg} at line {err.lineno}, column {err.colno} (char {err.pos}). "
            f"Fix: correct the JSON near {_show_text(near)} (a common cause is single quotes or a "
            "trailing comma; json.dumps() of a dict writes valid JSON)."
        ) from None


class ClusterConfig:
    """The addresses of the tasks of a cluster, checked before anything connects.

    Build one for parameter-server training from lists of "host:port"
    addresses, or read any TensorFlow cluster from a TF_CONFIG with
    `from_tf_config`. Then write each task's TF_CONFIG with `tf_config` /
    `to_json`, or get the training cluster as a `tf.train.ClusterSpec`.

    Addresses are "host:port": the host is a hostname, an IPv4 address or an
    IPv6 address in brackets ("[::1]:2222"); the port is in 1..65535. No two
    tasks may share an address. "chief" and "evaluator" hold at most one
    address each.

    The evaluator is never part of the training cluster: `cluster_spec()` and
    the TF_CONFIG of the chief, workers and parameter servers leave it out,
    because a coordinator that finds an "evaluator" job in its cluster waits
    for a server the evaluator never starts (tensorflow#46169). The
    evaluator's own TF_CONFIG holds only the evaluator job: it reads the
    checkpoints and never dials a training task. `as_dict()` and `.evaluator`
    keep it.

    Known limitations:
      * Two names for one machine ("localhost:2222" and "127.0.0.1:2222") are
        not detected as the same address; only equal hosts (case-insensitive,
        IPv6 compared in compressed form) with equal ports are.
      * Sparse jobs ({"worker": {"1": "host:2222"}}), which `tf.train.ClusterSpec`
        accepts, are rejected: every job is a list.
      * TF_CONFIG keys other than "cluster" and "task" ("rpc_layer",
        "environment", "session_master") are ignored and not written back.

    Example:

    >>> cfg = ClusterConfig(
    ...     workers=["w0:2222", "w1:2222"], ps=["ps0:2222"],
    ...     chief="c0:2222", evaluator="e0:2222")
    >>> cfg.num_workers, cfg.num_ps
    (2, 1)
    >>> cfg.tf_config("chief", 0)["cluster"]
    {'chief': ['c0:2222'], 'worker': ['w0:2222', 'w1:2222'], 'ps': ['ps0:2222']}
    >>> cfg.tf_config("evaluator", 0)
    {'cluster': {'evaluator': ['e0:2222']}, 'task': {'type': 'evaluator', 'index': 0}}
    >>> sorted(cfg.cluster_spec().jobs)
    ['chief', 'ps', 'worker']
    """

    def __init__(
        self,
        workers: Sequence[str],
        ps: Sequence[str],
        chief: str | Sequence[str] | None = None,
        evaluator: str | Sequence[str] | None = None,
    ) -> None:
        """Builds and checks a parameter-server cluster.

        Args:
          workers: the worker addresses, [num_workers] "host:port" strings; at
            least one.
          ps: the parameter-server addresses, [num_ps] "host:port" strings; at
            least one.
          chief: the coordinator's address: a "host:port" string, a one-element
            list, or None for no chief job.
          evaluator: the sidecar evaluator's address, in the same forms as
            `chief`.

        Raises:
          TFConfigError: if an argument is not of the form above, an address
            is invalid, or two tasks share an address.

        Example:

        >>> ClusterConfig(workers=["w0:2222"], ps=["ps0:2222"], chief=["c0:2222"]).chief
        'c0:2222'
        """
        cluster: dict[str, Any] = {}
        scalar_jobs = set()
        for task_type, value in (("chief", chief), ("worker", workers), ("ps", ps), ("evaluator", evaluator)):
            if task_type in SINGLE_TASK_TYPES:
                if value is None:
                    continue
                if isinstance(value, str):
                    scalar_jobs.add(task_type)
                    value = [value]
                elif not isinstance(value, (list, tuple)):
                    raise TFConfigError(
                        f'Argument `{task_type}` must be a "host:port" string, a one-element list '
                        f"or None; received {_show_typed(value)}. Fix: pass "
                        f'{task_type}="host:{_EXAMPLE_PORT}".'
                    )
            cluster[task_type] = value
        paths = _argument_paths(frozenset(scalar_jobs))
        self._set(_check_cluster(cluster, paths), paths, None, None)

    def _set(
        self,
        jobs: dict[str, tuple[str, ...]],
        paths: _Paths,
        task_type: str | None,
        task_index: int | None,
    ) -> None:
        self._jobs = jobs
        self._paths = paths
        self._task_type = task_type
        self._task_index = task_index

    @classmethod
    def from_tf_config(cls, value: str | Mapping[str, Any] | None = None) -> ClusterConfig:
        """Reads and checks a TF_CONFIG.

        Any valid TensorFlow cluster is accepted, including one with only
        workers (MultiWorkerMirroredStrategy) or with an "evaluator" job. Code
        that needs parameter servers calls `validate_for_parameter_server()`.

        The optional "task" part is checked against the cluster and kept as
        `task_type` / `task_index`. As in TensorFlow, a task of type
        "evaluator" (index 0) is accepted when the cluster has no evaluator job.

        Args:
          value: the TF_CONFIG as a JSON string or a dict; None reads the
            TF_CONFIG environment variable.

        Returns:
          The checked `ClusterConfig`.

        Raises:
          TFConfigError: if TF_CONFIG is unset or empty, is not valid JSON, is
            not an object with a "cluster" dict, or anything in it is invalid
            (see the class docstring for the rules).

        Example:

        >>> cfg = ClusterConfig.from_tf_config(
        ...     '{"cluster": {"worker": ["w0:2222", "w1:2222"]},'
        ...     ' "task": {"type": "worker", "index": 1}}')
        >>> cfg.num_workers, cfg.num_ps, cfg.task_type, cfg.task_index
        (2, 0, 'worker', 1)
        """
        tf_config = _load_tf_config(value)
        if not isinstance(tf_config, Mapping):
            raise TFConfigError(
                f"{TF_CONFIG_ENV} must be a JSON object like {_TF_CONFIG_EXAMPLE}; received "
                f'{_show_typed(tf_config)}. Fix: put the jobs under a "cluster" key of an object.'
            )
        paths = _tf_config_paths()
        if "cluster" not in tf_config:
            raise TFConfigError(
                f"{paths.cluster} is missing; received {_show(tf_config)}, expected an object "
                f'like {_TF_CONFIG_EXAMPLE}. Fix: add a "cluster" key with the addresses of every job.'
            )
        jobs = _check_cluster(tf_config["cluster"], paths)
        task_type = task_index = None
        if "task" in tf_config:
            task = tf_config["task"]
            if not isinstance(task, Mapping) or "type" not in task or "index" not in task:
                raise TFConfigError(
                    f'{TF_CONFIG_ENV}["task"] must be a dict with "type" and "index", like '
                    f'{{"type": "worker", "index": 0}}; received {_show_typed(task)}. Fix: name '
                    'this task\'s job and its position in that job, or leave out "task".'
                )
            task_type, task_index = task["type"], task["index"]
            _check_task(jobs, task_type, task_index, paths, allow_absent_evaluator=True)
        config = cls.__new__(cls)
        config._set(jobs, paths, task_type, task_index)
        return config

    def validate_for_parameter_server(self) -> ClusterConfig:
        """Checks that the cluster can run parameter-server training.

        `ParameterServerStrategy` needs at least one worker and one parameter
        server. The constructor already requires both; a config read with
        `from_tf_config` may lack them.

        Returns:
          self, so that calls can be chained.

        Raises:
          TFConfigError: if there is no "worker" or no "ps" job.

        Example:

        >>> cfg = ClusterConfig.from_tf_config({"cluster": {"worker": ["w0:2222"]}})
        >>> cfg.validate_for_parameter_server()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        tf_psx.errors.TFConfigError: TF_CONFIG["cluster"] has no "ps" job; ...
        """
        for task_type in PS_REQUIRED_TASK_TYPES:
            if task_type not in self._jobs:
                raise TFConfigError(
                    f"{self._paths.cluster} has no {json.dumps(task_type)} job; parameter-server "
                    f"training needs at least one address in each of {_quoted(PS_REQUIRED_TASK_TYPES)} "
                    f"(received jobs: {_quoted(list(self._jobs))}). Fix: add a "
                    f"{json.dumps(task_type)} list to the cluster, or use a strategy that needs "
                    "no parameter servers, such as MultiWorkerMirroredStrategy."
                )
        return self

    @property
    def workers(self) -> tuple[str, ...]:
        """The worker addresses, [num_workers]; empty if there is no worker job."""
        return self._jobs.get("worker", ())

    @property
    def ps(self) -> tuple[str, ...]:
        """The parameter-server addresses, [num_ps]; empty if there is no ps job."""
        return self._jobs.get("ps", ())

    @property
    def chief(self) -> str | None:
        """The chief's address, or None."""
        return self._jobs.get("chief", (None,))[0]

    @property
    def evaluator(self) -> str | None:
        """The evaluator's address, or None. Never part of `cluster_spec()`."""
        return self._jobs.get("evaluator", (None,))[0]

    @property
    def num_workers(self) -> int:
        """The number of workers, not counting the chief."""
        return len(self.workers)

    @property
    def num_ps(self) -> int:
        """The number of parameter servers."""
        return len(self.ps)

    @property
    def task_type(self) -> str | None:
        """The "task" type of the TF_CONFIG this was read from, or None."""
        return self._task_type

    @property
    def task_index(self) -> int | None:
        """The "task" index of the TF_CONFIG this was read from, or None."""
        return self._task_index

    def as_dict(self) -> dict[str, list[str]]:
        """The whole cluster, evaluator included, as {task type: [addresses]}.

        Returns:
          A new dict in "chief", "worker", "ps", "evaluator" order, holding
          only the jobs present.

        Example:

        >>> ClusterConfig(workers=["w0:2222"], ps=["ps0:2222"], evaluator="e0:2222").as_dict()
        {'worker': ['w0:2222'], 'ps': ['ps0:2222'], 'evaluator': ['e0:2222']}
        """
        return {task_type: list(addresses) for task_type, addresses in self._jobs.items()}

    def _training_cluster(self) -> dict[str, list[str]]:
        return {t: list(a) for t, a in self._jobs.items() if t in TRAINING_TASK_TYPES}

    def tf_config(self, task_type: str, index: int) -> dict[str, Any]:
        """The TF_CONFIG of one task, as a dict.

        For "chief", "worker" and "ps" the cluster holds the training jobs
        only; for "evaluator" it holds only the evaluator job (see the class
        docstring for why).

        Args:
          task_type: one of "chief", "worker", "ps", "evaluator", present in
            this cluster.
          index: the task's position in its job, 0..len(job) - 1.

        Returns:
          {"cluster": {task type: [addresses]}, "task": {"type": task_type,
          "index": index}}.

        Raises:
          TFConfigError: if the task type is not a job of this cluster or the
            index is out of range.

        Example:

        >>> ClusterConfig(workers=["w0:2222"], ps=["ps0:2222"]).tf_config("ps", 0)["task"]
        {'type': 'ps', 'index': 0}
        """
        paths = _argument_paths()
        _check_task(self._jobs, task_type, index, paths, allow_absent_evaluator=False)
        if task_type == "evaluator":
            cluster = {"evaluator": list(self._jobs["evaluator"])}
        else:
            cluster = self._training_cluster()
        return {"cluster": cluster, "task": {"type": task_type, "index": index}}

    def to_json(self, task_type: str, index: int) -> str:
        """The TF_CONFIG of one task, as the JSON string to put in the environment.

        Args:
          task_type: as in `tf_config`.
          index: as in `tf_config`.

        Returns:
          `json.dumps(self.tf_config(task_type, index))`.

        Raises:
          TFConfigError: as in `tf_config`.

        Example:

        >>> ClusterConfig(workers=["w0:2222"], ps=["ps0:2222"]).to_json("worker", 0)
        '{"cluster": {"worker": ["w0:2222"], "ps": ["ps0:2222"]}, "task": {"type": "worker", "index": 0}}'
        """
        return json.dumps(self.tf_config(task_type, index))

    def cluster_spec(self) -> tf.train.ClusterSpec:
        """The training cluster (chief, worker, ps; never the evaluator).

        Imports TensorFlow on first use.

        Returns:
          A `tf.train.ClusterSpec` of the training jobs.

        Example:

        >>> cfg = ClusterConfig(workers=["w0:2222"], ps=["ps0:2222"], evaluator="e0:2222")
        >>> cfg.cluster_spec().as_dict()
        {'worker': ['w0:2222'], 'ps': ['ps0:2222']}
        """
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        return tf.train.ClusterSpec(self._training_cluster())

    def _key(self) -> tuple[Any, ...]:
        return (tuple(self._jobs.items()), self._task_type, self._task_index)

    def __eq__(self, other: object) -> bool:
        """Equal when the clusters (evaluator included) and the tasks are equal."""
        if not isinstance(other, ClusterConfig):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        parts = [
            f"workers={list(self.workers)!r}",
            f"ps={list(self.ps)!r}",
            f"chief={self.chief!r}",
            f"evaluator={self.evaluator!r}",
        ]
        if self._task_type is not None:
            parts += [f"task_type={self._task_type!r}", f"task_index={self._task_index!r}"]
        return f"{type(self).__name__}({', '.join(parts)})"
