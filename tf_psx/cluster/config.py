"""`ClusterConfig`: where the tasks of a parameter-server cluster are.

A cluster is a set of jobs ("chief", "worker", "ps", "evaluator"), each a list
of "host:port" addresses. `ClusterConfig` builds one from Python lists or
reads one from a `TF_CONFIG` (the environment variable, a JSON string or a
dict), checks it completely before anything connects, and writes it back out
as the `TF_CONFIG` of each task or as a `tf.train.ClusterSpec`.

Every invalid input raises `TFConfigError`, whose message gives the JSON path
of the bad value (``TF_CONFIG["cluster"]["ps"][1]``), the value received, the
expected form and the fix; the checks themselves are in
`tf_psx.cluster.validation`. `ClusterSource` is what a cluster that starts on
demand (`tf_psx.LocalCluster`) is to a strategy: a way to its `ClusterConfig`.

Importing this module does not import TensorFlow; only `cluster_spec()` does.

Example:

>>> cfg = ClusterConfig(workers=["w0:2222", "w1:2222"], ps=["ps0:2222"])
>>> cfg.tf_config("worker", 1)
{'cluster': {'worker': ['w0:2222', 'w1:2222'], 'ps': ['ps0:2222']}, 'task': {'type': 'worker', 'index': 1}}
>>> ClusterConfig.from_tf_config(cfg.to_json("ps", 0)).task_type
'ps'
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tf_psx.cluster.validation import (  # noqa: F401  (the constants stay `tf_psx.cluster.config.X` too)
    EXAMPLE_PORT,
    PORT_RANGE,
    PS_REQUIRED_TASK_TYPES,
    SINGLE_TASK_TYPES,
    TF_CONFIG_ENV,
    TF_CONFIG_EXAMPLE,
    TRAINING_TASK_TYPES,
    VALID_TASK_TYPES,
    Paths,
    argument_paths,
    check_cluster,
    check_task,
    load_tf_config,
    quoted,
    show,
    show_typed,
    tf_config_paths,
)
from tf_psx.errors import TFConfigError

if TYPE_CHECKING:  # Only for annotations: importing this module must stay TF-free.
    import tensorflow as tf

__all__ = ["ClusterConfig", "ClusterSource", "TFConfigError"]


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
                        f"or None; received {show_typed(value)}. Fix: pass "
                        f'{task_type}="host:{EXAMPLE_PORT}".'
                    )
            cluster[task_type] = value
        paths = argument_paths(frozenset(scalar_jobs))
        self._set(check_cluster(cluster, paths), paths, None, None)

    def _set(
        self,
        jobs: dict[str, tuple[str, ...]],
        paths: Paths,
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
        tf_config = load_tf_config(value)
        if not isinstance(tf_config, Mapping):
            raise TFConfigError(
                f"{TF_CONFIG_ENV} must be a JSON object like {TF_CONFIG_EXAMPLE}; received "
                f'{show_typed(tf_config)}. Fix: put the jobs under a "cluster" key of an object.'
            )
        paths = tf_config_paths()
        if "cluster" not in tf_config:
            raise TFConfigError(
                f"{paths.cluster} is missing; received {show(tf_config)}, expected an object "
                f'like {TF_CONFIG_EXAMPLE}. Fix: add a "cluster" key with the addresses of every job.'
            )
        jobs = check_cluster(tf_config["cluster"], paths)
        task_type = task_index = None
        if "task" in tf_config:
            task = tf_config["task"]
            if not isinstance(task, Mapping) or "type" not in task or "index" not in task:
                raise TFConfigError(
                    f'{TF_CONFIG_ENV}["task"] must be a dict with "type" and "index", like '
                    f'{{"type": "worker", "index": 0}}; received {show_typed(task)}. Fix: name '
                    'this task\'s job and its position in that job, or leave out "task".'
                )
            task_type, task_index = task["type"], task["index"]
            check_task(jobs, task_type, task_index, paths, allow_absent_evaluator=True)
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
                    f"training needs at least one address in each of {quoted(PS_REQUIRED_TASK_TYPES)} "
                    f"(received jobs: {quoted(list(self._jobs))}). Fix: add a "
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
        paths = argument_paths()
        check_task(self._jobs, task_type, index, paths, allow_absent_evaluator=False)
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


class ClusterSource(abc.ABC):
    """A cluster that can be started on demand, such as `tf_psx.LocalCluster`.

    `tf_psx.ParameterServerStrategy(cluster)` accepts one and trains on the
    cluster it returns from `running_config()`. The strategy depends only on
    this interface, not on the process supervision behind a local cluster.

    Example:

    >>> class Fixed(ClusterSource):
    ...     def running_config(self):
    ...         return ClusterConfig(workers=["w0:2222"], ps=["ps0:2222"])
    >>> Fixed().running_config().num_workers
    1
    """

    @abc.abstractmethod
    def running_config(self) -> ClusterConfig:
        """Starts the cluster if it is not running; returns where its tasks are."""
