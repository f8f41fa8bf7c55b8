"""`ClusterMonitor`: TensorBoard scalars about the cluster every N steps, and a Prometheus endpoint.

Throughput, gradient norms and staleness come from the shared step probe
(`tf_psx.callbacks.probe`); bytes and latency per ps task, ps memory and
table rows are read from the model and the cluster at each write.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

import tensorflow as tf

from tf_psx import _checks, metrics as _metrics, tables as _tables
from tf_psx._tf import runtime as _runtime
from tf_psx.callbacks.base import _SNAPSHOT_SECONDS, _RunCallback, _check_path
from tf_psx.callbacks.probe import _components, _coordinator, _probe, _stats_between
from tf_psx.errors import ArgumentError
from tf_psx.snapshots.store import first_line

__all__ = ["ClusterMonitor", "DEFAULT_MONITOR_STEPS"]

logger = logging.getLogger("tf_psx")

# ClusterMonitor: often enough to see a trend within one epoch of a test run,
# rare enough that its few small remote reads cost < 1 % of steps.
DEFAULT_MONITOR_STEPS = 100
# Bytes of one TFRA table key (int64).
_TFRA_KEY_BYTES = 8
_PS_TASK_RE = re.compile(r"/job:ps/replica:\d+/task:(\d+)")


def _ps_task(device: str) -> int | None:
    match = _PS_TASK_RE.search(device or "")
    return int(match.group(1)) if match else None


class ClusterMonitor(_RunCallback):
    """Writes TensorBoard scalars about the cluster every N steps, and serves them to Prometheus.

    Tags (`<i>` is a ps task, `<name>` an embedding layer):

    | tag | what |
    |---|---|
    | `throughput/examples_per_sec` | examples the cluster finished per second since the last write |
    | `throughput/step_time_ms` | wall ms per finished step (all workers together) |
    | `throughput/steps_per_sec` | steps the cluster finished per second since the last write |
    | `gradients/norm` | mean global L2 norm of the gradients of the steps since the last write |
    | `ps/<i>/latency_ms` | round trip of a one-element read from a worker to ps task i (a probe per write) |
    | `ps/<i>/bytes_from_ps_per_step`, `ps/<i>/bytes_to_ps_per_step` | estimated bytes a step reads from ps task i (variables, embedding rows) and sends to it (gradients) |
    | `ps/<i>/variable_bytes` | bytes of the dense and sharded variables on ps task i (model and optimizer) |
    | `ps/<i>/table_bytes` | bytes of the TFRA tables (and their slots) on ps task i: keys plus values |
    | `sparsity/<name>` | mean fraction of the rows of the embedding that a step touched |
    | `staleness/mean`, `staleness/max`, `staleness/dropped` | mean staleness of the steps since the last write, the epoch's max so far, gradients dropped since the last write |
    | `sync/snapshot_seconds` | seconds of the latest PeriodicSync snapshot (written once there is one) |
    | `cluster/closure_retries` | closures the coordinator ran again after a worker failure, since fit began |
    | `ps/<i>/rss_bytes` | resident memory of ps task i (only for `LocalCluster(processes=True)`, passed as `cluster`) |
    | `tables/<name>/rows` | rows in the hash table of DynamicEmbedding `<name>` (all ps tasks) |
    | `tables/<name>/rows_evicted`, `tables/<name>/rows_spilled` | rows `TableEviction` removed (and moved to disk) since the layer was built |

    Example:

    >>> import tempfile, numpy as np, tensorflow as tf, tf_psx
    >>> log_dir = tempfile.mkdtemp()
    >>> model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> monitor = tf_psx.callbacks.ClusterMonitor(log_dir, every_n_steps=2)
    >>> _ = model.fit(np.ones((16, 2)), np.ones(16), batch_size=4, verbose=0, callbacks=[monitor])
    >>> "throughput/examples_per_sec" in monitor.last_values
    True

    With `metrics_port`, the same values (as `tf_psx.metrics.METRICS`) are
    served at `http://HOST:PORT/metrics` for Prometheus; with a `cluster`,
    also each task's memory and CPU and the host's CPU and swap. A port in
    use is logged as an error naming it, and training goes on
    (`metrics_error` says why nothing is served).

    Args:
      log_dir: the TensorBoard log directory (events go to `<log_dir>/cluster`);
        None to serve Prometheus metrics only.
      every_n_steps: int >= 1, steps between writes.
      cluster: the `tf_psx.LocalCluster` the strategy runs on, for the ps
        RSS; optional.
      metrics_port: the Prometheus port (0 for a free one, see
        `metrics_server.port`); None reads `TF_PSX_METRICS_PORT` (set by
        `tf-psx launch --metrics-port`), and serves nothing when it is unset.
      metrics_host: the address the endpoint listens on.

    Attributes:
      last_values: {tag: value} of the last write.
      metrics_server: the `tf_psx.metrics.MetricsServer`, or None.
      metrics_error: why no endpoint is served despite a port, or None.

    Raises:
      ValueError: bad arguments.

    Known limitations:
      * Under the default strategy there is one ps-less process: no ps tags,
        staleness 0. Under CentralStorageStrategy (several replicas) only the
        snapshot seconds are written.
      * Counters are read while steps run, so one write may include a step
        or two that was finishing.
      * Retries before fit started are not counted.
      * Bytes per ps are estimated from the model (every dense variable read
        and its gradient sent each step; embedding rows and their gradients
        as the rows touched, spread over the shards by size), not counted on
        the wire; `wire_dtype` and the exact hash-table update's slot moves
        are not in them.
      * The latency probe is a closure on a worker, scheduled beside the
        training steps at each write and read at the next one.
    """

    def __init__(self, log_dir=None, every_n_steps: int = DEFAULT_MONITOR_STEPS, cluster=None,
                 metrics_port: int | None = None, metrics_host: str = _metrics.DEFAULT_HOST):
        super().__init__()
        if metrics_port is None:
            metrics_port = _metrics.port_from_env()
        elif not (_checks.is_int_at_least(metrics_port, 0) and metrics_port <= 65535):
            raise ArgumentError(f"Argument `metrics_port` of ClusterMonitor must be an int in 0..65535 or None. "
                                f"Received: {metrics_port!r}. Fix: pass e.g. metrics_port=9400, or 0 for a free port.")
        if log_dir is None and metrics_port is None:
            raise ArgumentError("ClusterMonitor needs a `log_dir` (TensorBoard) or a `metrics_port` (Prometheus). "
                                "Received neither. Fix: pass e.g. ClusterMonitor(\"/tmp/logs\") or "
                                "ClusterMonitor(metrics_port=9400).")
        self.log_dir = None if log_dir is None else _check_path("ClusterMonitor", "log_dir", log_dir)
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.metrics_server: _metrics.MetricsServer | None = None
        self.metrics_error: str | None = None
        self._samples: list = []
        self._latency: tuple | None = None  # (ps tasks, RemoteValue) of the probe in flight
        self._latency_fn = None
        self.every_n_steps = _checks.int_at_least(every_n_steps, 1, "every_n_steps", owner="ClusterMonitor",
                                        fix='pass e.g. ClusterMonitor("/tmp/logs", every_n_steps=100)')
        if cluster is not None and not all(hasattr(cluster, attr) for attr in ("pid", "processes", "config")):
            raise ArgumentError(
                "Argument `cluster` of ClusterMonitor must be None or a tf_psx.LocalCluster. "
                f"Received: {cluster!r}. Fix: pass the LocalCluster the strategy was built on, or nothing."
            )
        self.cluster = cluster
        self.last_values: dict[str, float] = {}
        self._writer = None
        self._unsized_slots: set[str] = set()

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        model = self.model
        self._probe = _probe(model)
        self._probe.acquire(self, None)
        self._retries = _runtime.closure_retries(_coordinator(model)) if self._probe.is_ps else None
        self._retries_start = self._retries.count if self._retries else 0
        if self._writer is None and self.log_dir is not None:
            with tf.init_scope():
                self._writer = tf.summary.create_file_writer(os.path.join(self.log_dir, "cluster"))
        self._serve_metrics()
        self._seconds = _SNAPSHOT_SECONDS.setdefault(model, [])
        self._seconds_seen = len(self._seconds)
        self._batches = 0
        self._mark = (time.perf_counter(), self._probe.totals())

    def on_epoch_begin(self, epoch, logs=None):
        self._probe.begin_epoch(self._run_id, epoch)

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % self.every_n_steps == 0:
            self._write()

    def on_train_end(self, logs=None):
        self._probe.join()
        self._write(final=True)
        if self._writer is not None:
            self._writer.flush()
        self._probe.release(self)

    def _serve_metrics(self) -> None:
        if self.metrics_port is None or self.metrics_server is not None or self.metrics_error is not None:
            return
        try:
            self.metrics_server = _metrics.serve(self.metrics_port, self.metrics_host)
        except _metrics.MetricsPortError as err:
            self.metrics_error = str(err)
            logger.error("ClusterMonitor serves no Prometheus metrics; training goes on: %s", err)
            return
        self.metrics_server.set_source("ClusterMonitor", lambda: self._samples)
        logger.info("ClusterMonitor serves Prometheus metrics at http://%s:%d/metrics", self.metrics_host,
                    self.metrics_server.port)
        if self.cluster is not None and self.cluster.processes:
            self.metrics_server.set_source("LocalCluster", _metrics.ProcessSampler(self.cluster.task_pids))

    # -- measurements ---------------------------------------------------------

    def _write(self, final: bool = False) -> None:
        now, totals = time.perf_counter(), self._probe.totals()
        then, before = self._mark
        values: dict[str, float] = {}
        elapsed = max(now - then, 1e-9)
        steps = totals["steps"] - before["steps"]
        if self._probe.enabled and steps == 0 and (self.last_values or not final):
            return  # no step finished since the last write (e.g. the first is being traced)
        if self._probe.enabled:
            values["throughput/examples_per_sec"] = (totals["examples"] - before["examples"]) / elapsed
            if steps:
                values["throughput/step_time_ms"] = 1000.0 * elapsed / steps
                for name, rows in self._probe.embedding_rows.items():
                    size = rows if isinstance(rows, int) else max(rows.size(), 1)
                    touched = totals["rows"][name] - before["rows"][name]
                    values[f"sparsity/{name}"] = touched / steps / size
            stats = _stats_between(before, totals)
            values["throughput/steps_per_sec"] = steps / elapsed
            values["staleness/mean"] = stats["staleness_mean"]
            values["staleness/max"] = float(totals["epoch_max"])
            values["staleness/dropped"] = float(stats["dropped_gradients"])
            if steps:
                values["gradients/norm"] = (totals["gradient_norm_sum"] - before["gradient_norm_sum"]) / steps
        if self._probe.is_ps:
            values.update(self._ps_bytes())
            values.update(self._traffic(totals, before, steps))
            values.update(self._latency_values(final))
            values["cluster/closure_retries"] = float(self._retries.count - self._retries_start)
        if self._seconds:
            values["sync/snapshot_seconds"] = float(self._seconds[-1])
        values.update(self._ps_rss())
        values.update(_table_values(self.model))
        if self._writer is not None:
            step = int(self.model.optimizer.iterations.numpy()) if self.model.optimizer is not None else self._batches
            with self._writer.as_default(step=step):
                for tag, value in values.items():
                    tf.summary.scalar(tag, value)
            self._writer.flush()
        self.last_values = values
        self._samples = _prometheus_samples(values, totals["steps"])
        self._mark = (now, totals)

    def _ps_components(self) -> list:
        """(ps task, variable component, embedding name or None) of the model's trainable variables."""
        out, seen = [], set()
        for variable in self.model.trainable_variables:
            for component in _components(variable):
                task = _ps_task(getattr(component, "device", ""))
                if task is None or id(component) in seen or not component.shape.is_fully_defined():
                    continue
                seen.add(id(component))
                out.append((task, component, self._probe.groups.get(id(component))))
        return out

    def _traffic(self, totals: dict, before: dict, steps: int) -> dict[str, float]:
        """Estimated bytes per step from and to each ps task (see Known limitations)."""
        if not steps:
            return {}
        num_ps = _runtime.num_ps(self.model.distribute_strategy)
        per_ps = [0.0] * num_ps
        parts = self._ps_components()
        rows_of = {}  # embedding name -> total rows of its components
        for _, component, name in parts:
            if name is not None:
                rows_of[name] = rows_of.get(name, 0) + int(component.shape[0])
        for task, component, name in parts:
            if task >= num_ps:
                continue
            if name is None:
                per_ps[task] += component.shape.num_elements() * component.dtype.size
            else:
                touched = (totals["rows"][name] - before["rows"][name]) / steps
                row_bytes = component.shape[1:].num_elements() * component.dtype.size
                per_ps[task] += touched * int(component.shape[0]) / max(rows_of[name], 1) * row_bytes
        for name, layer in self._probe.embedding_rows.items():
            if isinstance(layer, int) or layer.store == "native":  # native tables: rows only (`_table_values`)
                continue
            table_var = layer.table
            touched = (totals["rows"][name] - before["rows"][name]) / steps
            row_bytes = int(table_var.dim) * tf.as_dtype(table_var.value_dtype).size
            for device in table_var.devices:
                task = _ps_task(device)
                if task is not None and task < num_ps:
                    per_ps[task] += touched / len(table_var.devices) * row_bytes
        values = {}
        for task in range(num_ps):
            # A gradient has the shape of what was read.
            values[f"ps/{task}/bytes_from_ps_per_step"] = float(per_ps[task])
            values[f"ps/{task}/bytes_to_ps_per_step"] = float(per_ps[task])
        return values

    def _latency_values(self, final: bool) -> dict[str, float]:
        """The previous probe's round trips (ms per ps task); schedules the next probe."""
        values = {}
        if self._latency is not None:
            tasks, remote = self._latency
            self._latency = None
            try:
                seconds = remote.fetch()
            except Exception as err:  # pylint: disable=broad-except  (a worker lost mid-probe: no value this time)
                logger.info("ClusterMonitor: the latency probe failed: %s", first_line(err))
            else:
                values = {f"ps/{task}/latency_ms": 1000.0 * float(s) for task, s in zip(tasks, seconds)}
        if not final:
            self._schedule_latency_probe()
        return values

    def _schedule_latency_probe(self) -> None:
        if self._latency_fn is None:
            smallest: dict[int, Any] = {}
            for task, component, _ in self._ps_components():
                size = component.shape.num_elements()
                if task not in smallest or size < smallest[task].shape.num_elements():
                    smallest[task] = component
            tasks = sorted(smallest)
            reads = [smallest[task] for task in tasks]
            if not reads:
                return

            @tf.function
            def probe():
                # One element from each ps task in turn, timed on the worker:
                # the control edges order clock, read, clock.
                times, previous = [], tf.timestamp()
                for variable in reads:
                    with tf.control_dependencies([previous]):
                        start = tf.timestamp()
                    with tf.control_dependencies([start]):
                        value = variable.sparse_read([0]) if variable.shape.rank else variable.read_value()
                    with tf.control_dependencies([value]):
                        previous = tf.timestamp()
                    times.append(previous - start)
                return tf.stack(times)

            self._latency_fn = (tasks, probe)
        tasks, probe = self._latency_fn
        self._latency = (tasks, _coordinator(self.model).schedule(probe))

    def _ps_bytes(self) -> dict[str, float]:
        model = self.model
        num_ps = _runtime.num_ps(model.distribute_strategy)
        variable_bytes = [0] * num_ps
        table_bytes = [0] * num_ps
        seen = set()
        candidates = list(model.variables)
        if model.optimizer is not None:
            candidates += list(model.optimizer.variables)
        for variable in candidates:
            for component in _components(variable):
                if id(component) in seen:
                    continue
                seen.add(id(component))
                task = _ps_task(getattr(component, "device", ""))
                if task is not None and task < num_ps and component.shape.is_fully_defined():
                    variable_bytes[task] += component.shape.num_elements() * component.dtype.size
        for table_var in self._tfra_variables():
            row_bytes = _TFRA_KEY_BYTES + int(table_var.dim) * tf.as_dtype(table_var.value_dtype).size
            for device, table in zip(table_var.devices, table_var.tables):
                task = _ps_task(device)
                if task is not None and task < num_ps:
                    table_bytes[task] += int(table.size()) * row_bytes
        values = {}
        for task in range(num_ps):
            values[f"ps/{task}/variable_bytes"] = float(variable_bytes[task])
            values[f"ps/{task}/table_bytes"] = float(table_bytes[task])
        return values

    def _tfra_variables(self) -> list:
        tables = []
        for rows in self._probe.embedding_rows.values():
            if isinstance(rows, int) or rows.store == "native":
                continue
            table = rows.table
            tables.append(table)
            try:
                # [] for an optimizer without slots (SGD).
                tables.extend(table.get_slot_variables(self.model.optimizer))
            except TypeError as error:  # TFRA 0.8.1: an optimizer class it does not know
                if table.name not in self._unsized_slots:
                    self._unsized_slots.add(table.name)
                    logger.warning("ClusterMonitor: ps/<i>/table_bytes leaves out the optimizer slots of table %s: %s",
                                   table.name, first_line(error))
        return tables

    def _ps_rss(self) -> dict[str, float]:
        cluster = self.cluster
        if cluster is None or not cluster.processes:
            return {}
        import psutil  # pylint: disable=import-outside-toplevel

        values = {}
        for task in range(cluster.config.num_ps):
            try:
                values[f"ps/{task}/rss_bytes"] = float(psutil.Process(cluster.pid("ps", task)).memory_info().rss)
            except psutil.NoSuchProcess:  # a task that is down right now (ZombieProcess included)
                continue
        return values


# ClusterMonitor tag -> (Prometheus metric, label name of the tag's middle part, scale).
_PROMETHEUS_TAGS = {
    "throughput/examples_per_sec": ("tf_psx_examples_per_second", None, 1.0),
    "throughput/steps_per_sec": ("tf_psx_steps_per_second", None, 1.0),
    "staleness/mean": ("tf_psx_staleness_mean", None, 1.0),
    "staleness/max": ("tf_psx_staleness_max", None, 1.0),
    "staleness/dropped": ("tf_psx_dropped_gradients", None, 1.0),
    "gradients/norm": ("tf_psx_gradient_norm", None, 1.0),
    "sync/snapshot_seconds": ("tf_psx_snapshot_seconds", None, 1.0),
    "cluster/closure_retries": ("tf_psx_closure_retries", None, 1.0),
    "ps/*/variable_bytes": ("tf_psx_ps_variable_bytes", "ps", 1.0),
    "ps/*/table_bytes": ("tf_psx_ps_table_bytes", "ps", 1.0),
    "ps/*/latency_ms": ("tf_psx_ps_latency_seconds", "ps", 1e-3),
    "ps/*/bytes_from_ps_per_step": ("tf_psx_ps_bytes_per_step", "ps", 1.0),
    "ps/*/bytes_to_ps_per_step": ("tf_psx_ps_bytes_per_step", "ps", 1.0),
    "sparsity/*": ("tf_psx_gradient_row_share", "layer", 1.0),
    "tables/*/rows": ("tf_psx_table_rows", "layer", 1.0),
    "tables/*/rows_evicted": ("tf_psx_table_rows_evicted", "layer", 1.0),
    "tables/*/rows_spilled": ("tf_psx_table_rows_spilled", "layer", 1.0),
}


def _prometheus_samples(values: dict[str, float], steps: int) -> list:
    """ClusterMonitor's values as `tf_psx.metrics` samples (rss comes from the process sampler)."""
    samples = [("tf_psx_steps", {}, float(steps))]
    for tag, value in values.items():
        parts = tag.split("/")
        key = tag if tag in _PROMETHEUS_TAGS or len(parts) < 2 else "/".join([parts[0], "*", *parts[2:]])
        if key not in _PROMETHEUS_TAGS:
            continue
        name, label, scale = _PROMETHEUS_TAGS[key]
        labels = {label: "/".join(parts[1:-1] if len(parts) > 2 else parts[1:])} if label else {}
        if name == "tf_psx_ps_bytes_per_step":
            labels["direction"] = "from_ps" if "from_ps" in tag else "to_ps"
        samples.append((name, labels, value * scale))
    return samples


def _table_values(model) -> dict[str, float]:
    """ClusterMonitor's `tables/...` tags."""
    values = {}
    for layer in _tables.table_layers(model):
        values[f"tables/{layer.name}/rows"] = float(layer.size())
        if getattr(layer, "policy", None) is not None:
            values[f"tables/{layer.name}/rows_evicted"] = float(layer.policy.rows_evicted)
            values[f"tables/{layer.name}/rows_spilled"] = float(layer.policy.rows_spilled)
    return values
