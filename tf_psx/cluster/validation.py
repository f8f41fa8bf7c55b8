"""TF_CONFIG checks: every rule an address, a cluster, a task and the JSON must meet.

`ClusterConfig` (tf_psx.cluster.config) holds a checked cluster; this module
holds the checks and their messages. Every invalid input raises
`TFConfigError`, whose message gives the JSON path of the bad value
(``TF_CONFIG["cluster"]["ps"][1]``), the value received, the expected form and
the fix. The places are named by a `Paths`: `tf_config_paths()` for a
TF_CONFIG, `argument_paths()` for the arguments of `ClusterConfig(...)`.

Importing this module does not import TensorFlow.

Example:

>>> check_address("[::1]:2222", "x")
('::1', 2222)
>>> check_address("w0", 'TF_CONFIG["cluster"]["worker"][0]')  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
tf_psx.errors.TFConfigError: TF_CONFIG[...][0] must be "host:port" ... Fix: add the port after a colon, e.g. "w0:2222".
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tf_psx.errors import TFConfigError

__all__ = [
    "EXAMPLE_PORT",
    "PORT_RANGE",
    "PS_REQUIRED_TASK_TYPES",
    "SINGLE_TASK_TYPES",
    "TF_CONFIG_ENV",
    "TF_CONFIG_EXAMPLE",
    "TRAINING_TASK_TYPES",
    "VALID_TASK_TYPES",
    "Paths",
    "argument_paths",
    "check_address",
    "check_cluster",
    "check_task",
    "load_tf_config",
    "quoted",
    "show",
    "show_typed",
    "tf_config_paths",
]

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
EXAMPLE_PORT = 2222

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
TF_CONFIG_EXAMPLE = (
    f'{{"cluster": {{"chief": ["host0:{EXAMPLE_PORT}"], "worker": ["host1:{EXAMPLE_PORT}"], '
    f'"ps": ["host2:{EXAMPLE_PORT}"]}}, "task": {{"type": "chief", "index": 0}}}}'
)
_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?"
_HOSTNAME_RE = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*\Z")
_NUMERIC_HOST_RE = re.compile(r"[0-9.]+\Z")
_PORT_RE = re.compile(r"[0-9]+\Z")
_BRACKETED_RE = re.compile(r"\[(?P<host>[^\[\]]*)\](?::(?P<port>.*))?\Z", re.DOTALL)


def show(value: Any) -> str:
    """The value as JSON when it is JSON (strings in double quotes), else repr."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > _MAX_SHOWN_CHARS:
        text = text[: _MAX_SHOWN_CHARS - 3] + "..."
    return text


def show_text(text: str) -> str:
    """A JSON text as a Python literal, so its double quotes are not escaped."""
    if len(text) > _MAX_SHOWN_CHARS:
        text = text[: _MAX_SHOWN_CHARS - 3] + "..."
    return repr(text)


def show_typed(value: Any) -> str:
    """`show` plus the Python type, for errors about the kind of value."""
    name = type(value).__name__
    article = "an" if name[:1] in "aeiou" else "a"
    return f"{show(value)} ({article} {name})"


def quoted(names: Sequence[str]) -> str:
    return ", ".join(json.dumps(name) for name in names)


class Paths:
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
        return f"{self.cluster}[{show(task_type)}]"

    def address(self, task_type: str, index: int) -> str:
        if task_type in self._scalar_jobs:
            return self.job(task_type)
        return f"{self.job(task_type)}[{index}]"


def tf_config_paths() -> Paths:
    cluster = f'{TF_CONFIG_ENV}["cluster"]'
    return Paths(
        cluster=cluster,
        jobs={t: f"{cluster}[{json.dumps(t)}]" for t in VALID_TASK_TYPES},
        task_type=f'{TF_CONFIG_ENV}["task"]["type"]',
        task_index=f'{TF_CONFIG_ENV}["task"]["index"]',
    )


def argument_paths(scalar_jobs: frozenset[str] = frozenset()) -> Paths:
    return Paths(
        cluster="the cluster",
        jobs={"chief": "chief", "worker": "workers", "ps": "ps", "evaluator": "evaluator"},
        task_type="Argument `task_type`",
        task_index="Argument `index`",
        scalar_jobs=scalar_jobs,
        required_jobs=frozenset(PS_REQUIRED_TASK_TYPES),
    )


def _address_error(path: str, value: Any, problem: str, fix: str) -> TFConfigError:
    return TFConfigError(f"{path} must be {_ADDRESS_FORM}; received {show(value)}{problem}. Fix: {fix}")


def check_address(value: Any, path: str) -> tuple[str, int]:
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
            f"{path} must be {_ADDRESS_FORM}; received {show_typed(value)}. "
            f'Fix: write the address as a string, e.g. "host:{EXAMPLE_PORT}".'
        )
    if value.startswith("["):
        match = _BRACKETED_RE.match(value)
        if match is None or match["port"] is None:
            raise _address_error(
                path, value, ", which is not \"[IPv6]:port\"",
                f'write the IPv6 address in brackets followed by the port, e.g. "[::1]:{EXAMPLE_PORT}".',
            )
        host_text, port_text = match["host"], match["port"]
        try:
            host = str(ipaddress.IPv6Address(host_text))
        except ValueError:
            raise _address_error(
                path, value, f", whose bracketed host {show(host_text)} is not an IPv6 address",
                f'put only an IPv6 address in the brackets, e.g. "[::1]:{EXAMPLE_PORT}".',
            ) from None
    else:
        host_text, colon, port_text = value.rpartition(":")
        if not colon:
            raise _address_error(
                path, value, "", f"add the port after a colon, e.g. {show(f'{value}:{EXAMPLE_PORT}')}."
            )
        if ":" in host_text:
            raise _address_error(
                path, value, ", an IPv6 address without brackets",
                f"put the IPv6 address in brackets, e.g. {show(f'[{host_text}]:{port_text}')}.",
            )
        if not host_text:
            raise _address_error(
                path, value, ", whose host is empty",
                f"put the host before the colon, e.g. {show(f'localhost{value}')}.",
            )
        if not _HOSTNAME_RE.match(host_text):
            raise _address_error(
                path, value, f", whose host {show(host_text)} is not a valid hostname or IPv4 address",
                "use letters, digits, '-', '_' and '.' only, with no spaces.",
            )
        if _NUMERIC_HOST_RE.match(host_text):
            try:
                ipaddress.IPv4Address(host_text)
            except ValueError:
                raise _address_error(
                    path, value, f", whose host {show(host_text)} is not a valid IPv4 address",
                    "use four numbers 0..255 separated by dots, e.g. \"10.0.0.1\".",
                ) from None
        host = host_text.lower()
    if not _PORT_RE.match(port_text):
        raise _address_error(
            path, value, f", whose port {show(port_text)} is not a number",
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


def check_cluster(cluster: Any, paths: Paths) -> dict[str, tuple[str, ...]]:
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
            f'{{"worker": ["host1:{EXAMPLE_PORT}"], "ps": ["host2:{EXAMPLE_PORT}"]}}; '
            f"received {show_typed(cluster)}. Fix: make it a JSON object."
        )
    if not cluster:
        raise TFConfigError(
            f"{paths.cluster} must name at least one job (one of {quoted(VALID_TASK_TYPES)}); "
            f'received {{}}. Fix: add the jobs, e.g. {{"worker": ["host1:{EXAMPLE_PORT}"], '
            f'"ps": ["host2:{EXAMPLE_PORT}"]}}.'
        )
    for task_type in cluster:
        if task_type not in VALID_TASK_TYPES:
            raise TFConfigError(
                f"{paths.cluster} has unknown task type {show(task_type)}; expected one of "
                f"{quoted(VALID_TASK_TYPES)}. Fix: {_unknown_task_type_fix(task_type)}"
            )
    jobs: dict[str, tuple[str, ...]] = {}
    seen: dict[tuple[str, int], tuple[str, str]] = {}  # normalised -> (path, as written)
    for task_type in VALID_TASK_TYPES:
        if task_type not in cluster:
            continue
        addresses = cluster[task_type]
        job_path = paths.job(task_type)
        if not isinstance(addresses, (list, tuple)):
            example = [addresses] if isinstance(addresses, str) else [f"host:{EXAMPLE_PORT}"]
            raise TFConfigError(
                f'{job_path} must be a non-empty list of "host:port" strings; received '
                f"{show_typed(addresses)}. Fix: write it as a list, e.g. {show(example)}."
            )
        if not addresses:
            fix = (
                f"list at least one address (parameter-server training needs at least one in each "
                f"of {quoted(PS_REQUIRED_TASK_TYPES)})."
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
                f"{json.dumps(task_type)} task); received {show(list(addresses))} "
                f"({len(addresses)} addresses). Fix: {fix}"
            )
        for index, address in enumerate(addresses):
            path = paths.address(task_type, index)
            key = check_address(address, path)
            if key in seen:
                first_path, first = seen[key]
                same = f" (written {show(first)} there)" if first != address else ""
                raise TFConfigError(
                    f"{path} must be an address no other task uses; received {show(address)}, "
                    f"which {first_path} already holds{same}. Fix: give each task its own "
                    "host:port, e.g. a different port on the same host."
                )
            seen[key] = (path, address)
        jobs[task_type] = tuple(addresses)
    return jobs


def check_task(
    jobs: Mapping[str, tuple[str, ...]],
    task_type: Any,
    index: Any,
    paths: Paths,
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
        received = show_typed(task_type) if not isinstance(task_type, str) else show(task_type)
        raise TFConfigError(
            f"{paths.task_type} must be one of {quoted(VALID_TASK_TYPES)}; received {received}. "
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
            f"{quoted(list(jobs))}; received {json.dumps(task_type)}. Fix: add the "
            f"{json.dumps(task_type)} job to the cluster, or use one of its task types."
        )
    is_int = isinstance(index, int) and not isinstance(index, bool)  # JSON true is not 1.
    if not is_int or not 0 <= index < count:
        received = show(index) if is_int else show_typed(index)
        raise TFConfigError(
            f"{paths.task_index} must be an int in 0..{count - 1} ({why}); received {received}. "
            f"Fix: use the task's position in the {json.dumps(task_type)} list, counting from 0."
        )


def load_tf_config(value: Any) -> Any:
    """Returns the parsed TF_CONFIG from `value` or from the environment."""
    if value is None:
        value = os.environ.get(TF_CONFIG_ENV, "")
        if not value.strip():
            raise TFConfigError(
                f"{TF_CONFIG_ENV} is not set (the environment variable is missing or empty); "
                f"expected a JSON object like {TF_CONFIG_EXAMPLE}. Fix: set it before starting "
                f"the task, e.g. export {TF_CONFIG_ENV}='{TF_CONFIG_EXAMPLE}', or pass the JSON "
                "string or dict to ClusterConfig.from_tf_config(value)."
            )
    if isinstance(value, Mapping):
        return value
    if not isinstance(value, str):
        raise TFConfigError(
            f"Argument `value` must be None (read the {TF_CONFIG_ENV} environment variable), a "
            f"JSON string or a dict; received {show_typed(value)}. Fix: pass "
            f"json.dumps(...) of the {TF_CONFIG_ENV} dict, or the dict itself."
        )
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        start = max(0, err.pos - _JSON_CONTEXT_CHARS)
        near = value[start : err.pos + _JSON_CONTEXT_CHARS]
        raise TFConfigError(
            f"{TF_CONFIG_ENV} must be valid JSON like {TF_CONFIG_EXAMPLE}; received {show_text(value)}, "
            f"which fails with: {err.msg} at line {err.lineno}, column {err.colno} (char {err.pos}). "
            f"Fix: correct the JSON near {show_text(near)} (a common cause is single quotes or a "
            "trailing comma; json.dumps() of a dict writes valid JSON)."
        ) from None
