"""Prometheus metrics: one `/metrics` endpoint per port, fed by whoever measures.

Two things serve metrics:

* `tf_psx.callbacks.ClusterMonitor(..., metrics_port=P)` in the training
  process: throughput, staleness, dropped gradients, bytes to and from each
  ps, worker-to-ps latency, gradient sparsity and norm, rows per table,
  snapshot time, closure retries (and task memory and CPU when given a
  `LocalCluster`).
* `tf-psx launch --metrics-port P`: each task's process (up, restarts,
  memory, CPU) and the host's CPU and swap. The launcher hands `P + 1` to
  the chief in `TF_PSX_METRICS_PORT`, where a `ClusterMonitor` without a
  port serves the training metrics.

Every metric is a gauge named in `METRICS`, so dashboards and alert rules
(`deploy/grafana/`, `deploy/prometheus/`) and the tests use one list.

Example:

>>> import urllib.request
>>> server = serve(0, host="127.0.0.1")
>>> server.set_source("demo", lambda: [("tf_psx_steps_per_second", {}, 12.5)])
>>> text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read().decode()
>>> [line for line in text.splitlines() if line.startswith("tf_psx_steps_per_second")]
['tf_psx_steps_per_second 12.5']
>>> server.close()

Known limitations:
  * The endpoint has no authentication or TLS; it listens on every
    interface by default (`DEFAULT_HOST`). Pass `host="127.0.0.1"` where
    the port must not be reachable from other hosts.
  * Values are those of the latest `ClusterMonitor` write (every
    `every_n_steps` steps); only the process metrics are read at scrape time.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Callable, Iterable

from tf_psx import _checks
from tf_psx.errors import ArgumentError, MetricsPortError

logger = logging.getLogger("tf_psx")

# The launcher passes the chief's metrics port in this variable; a
# ClusterMonitor without `metrics_port` serves there.
ENV_PORT = "TF_PSX_METRICS_PORT"
# Prometheus scrapes from another host: listen on every interface unless told otherwise.
DEFAULT_HOST = "0.0.0.0"
# Every metric tf_psx serves, with its help text: gauges all, so that a
# restarted process starting from 0 is not mistaken for a counter reset.
METRICS = {
    "tf_psx_steps_per_second": "training steps the cluster finished per second since the last write",
    "tf_psx_examples_per_second": "examples the cluster finished per second since the last write",
    "tf_psx_steps": "training steps finished since the monitor's model was built",
    "tf_psx_staleness_mean": "mean staleness (updates by others between a step's read and its apply) since the last write",
    "tf_psx_staleness_max": "largest staleness of the epoch so far",
    "tf_psx_dropped_gradients": "gradients StalenessBound dropped since the last write",
    "tf_psx_ps_bytes_per_step": "estimated bytes per step between the workers and ps task `ps`, by `direction` "
                                "(from_ps: variable reads and embedding rows; to_ps: gradients)",
    "tf_psx_ps_latency_seconds": "round trip of a one-element read from a worker to ps task `ps` (periodic probe)",
    "tf_psx_ps_variable_bytes": "bytes of dense and sharded variables on ps task `ps`",
    "tf_psx_ps_table_bytes": "bytes of hash tables (keys, values, slots) on ps task `ps`",
    "tf_psx_gradient_row_share": "mean share of an embedding layer's rows with a nonzero gradient in one step",
    "tf_psx_gradient_norm": "mean global gradient norm of the steps since the last write",
    "tf_psx_table_rows": "rows in a DynamicEmbedding's hash table (all ps tasks)",
    "tf_psx_table_rows_evicted": "rows TableEviction removed from a layer since it was built",
    "tf_psx_table_rows_spilled": "rows TableEviction moved to the disk tier since the layer was built",
    "tf_psx_snapshot_seconds": "seconds of the latest PeriodicSync snapshot, barrier included",
    "tf_psx_closure_retries": "steps the coordinator ran again after a worker failure, since fit began",
    "tf_psx_task_up": "1 while the task's process runs, 0 while it is down",
    "tf_psx_task_restarts": "times the launcher started the task again (after a failure, a ps recovery or a rescale)",
    "tf_psx_task_rss_bytes": "resident memory of the task's process",
    "tf_psx_task_cpu_percent": "CPU of the task's process since the previous scrape (100 = one core)",
    "tf_psx_host_cpu_percent": "CPU of the whole host since the previous scrape (100 = every core busy)",
    "tf_psx_host_swap_used_bytes": "swap in use on the host",
}

Sample = tuple  # (metric name, {label: value}, float)
_JOIN_TIMEOUT_S = 5.0  # close() waits this long for the server thread
_SERVERS: dict[tuple[str, int], "MetricsServer"] = {}
_SERVERS_LOCK = threading.Lock()


class _Collector:
    """A prometheus_client collector over the server's sources, read at scrape time."""

    def __init__(self, server: "MetricsServer"):
        self._server = server

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily  # pylint: disable=import-outside-toplevel

        families: dict[str, GaugeMetricFamily] = {}
        for name, labels, value in self._server.samples():
            family = families.get(name)
            if family is None:
                family = families[name] = GaugeMetricFamily(name, METRICS[name], labels=sorted(labels))
            family.add_metric([str(labels[key]) for key in sorted(labels)], float(value))
        return list(families.values())


class MetricsServer:
    """One `/metrics` endpoint; its samples come from named sources (functions).

    Built by `serve()`, never directly. A source is a function returning
    samples `(name, labels, value)`, `name` one of `METRICS`; a source that
    raises is logged once and skipped, never the scrape.
    """

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, start_http_server  # pylint: disable=import-outside-toplevel

        self.host = host
        self._sources: dict[str, Callable[[], Iterable[Sample]]] = {}
        self._failed: set[str] = set()
        self._lock = threading.Lock()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        try:
            self._http, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise MetricsPortError(
                    errno.EADDRINUSE,
                    f"The metrics port {port} on {host} is already in use. "
                    "Fix: pass another port (or 0 for a free one), or stop what listens there.") from err
            raise MetricsPortError(err.errno, f"Cannot serve metrics on {host}:{port}: {err.strerror}. Fix: pass "
                                              "an address of this host as the host (or 0.0.0.0) and a free port.") from err
        self.port = self._http.server_port

    def set_source(self, key: str, source: Callable[[], Iterable[Sample]]) -> None:
        """Adds or replaces the source `key`."""
        with self._lock:
            self._sources[key] = source
            self._failed.discard(key)

    def remove_source(self, key: str) -> None:
        with self._lock:
            self._sources.pop(key, None)

    def samples(self) -> list[Sample]:
        """Every source's samples, unknown metric names refused loudly (a bug, not data)."""
        with self._lock:
            sources = list(self._sources.items())
        out = []
        for key, source in sources:
            try:
                got = list(source())
            except Exception as err:  # pylint: disable=broad-except  (a scrape must not fail for one source)
                if key not in self._failed:
                    self._failed.add(key)
                    logger.warning("tf_psx metrics: the source %s failed and is left out: %s", key, err)
                continue
            unknown = sorted({name for name, _, _ in got if name not in METRICS})
            if unknown:  # a bug in the source, not data: said once, the rest of the scrape goes on
                if key not in self._failed:
                    self._failed.add(key)
                    logger.warning("tf_psx metrics: the source %s gave metrics not in METRICS, left out: %s",
                                   key, unknown)
            out += [(name, labels, value) for name, labels, value in got if name in METRICS]
        return out

    def close(self) -> None:
        """Stops serving and frees the port."""
        with _SERVERS_LOCK:
            if _SERVERS.get((self.host, self.port)) is self:
                del _SERVERS[(self.host, self.port)]
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(_JOIN_TIMEOUT_S)


def serve(port: int, host: str = DEFAULT_HOST) -> MetricsServer:
    """The endpoint on `host:port`, started on first use and shared in this process.

    A notebook that builds a new `ClusterMonitor` on the same port gets the
    running server (the new monitor's source replaces the old one's), not
    a port-in-use error.

    Args:
      port: int in 0..65535; 0 picks a free port (see `MetricsServer.port`).
      host: the address to listen on.

    Raises:
      ValueError: a bad port.
      MetricsPortError: the port is taken by something else.
    """
    if not (_checks.is_int_at_least(port, 0) and port <= 65535):
        raise ArgumentError(f"Argument `metrics_port` must be an int in 0..65535. Received: {port!r}. "
                            "Fix: pass e.g. metrics_port=9400, or 0 for a free port.")
    with _SERVERS_LOCK:
        server = _SERVERS.get((host, int(port))) if port else None
        if server is None:
            server = MetricsServer(host, int(port))
            _SERVERS[(host, server.port)] = server
    return server


def port_from_env() -> int | None:
    """The port in `TF_PSX_METRICS_PORT`, or None when unset; ValueError naming the variable if malformed."""
    text = os.environ.get(ENV_PORT)
    if text is None or text == "":
        return None
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise ArgumentError(f"The environment variable {ENV_PORT} must be a port in 0..65535. Received: {text!r}. "
                            f"Fix: unset it or set e.g. {ENV_PORT}=9401.")
    return int(text)


class ProcessSampler:
    """Memory and CPU of named processes, and the host's CPU and swap, read at scrape time.

    Args:
      tasks: a function returning {task name: pid or None}, e.g.
        {"ps:0": 4242}; None (or a process that is gone) is a task down.
        The `role` label is the name's part before ":".
    """

    def __init__(self, tasks: Callable[[], dict[str, int | None]]):
        import psutil  # pylint: disable=import-outside-toplevel

        self._psutil = psutil
        self._tasks = tasks
        self._processes: dict[int, object] = {}
        psutil.cpu_percent(interval=None)  # the first call only sets the reference point

    def __call__(self) -> list[Sample]:
        psutil = self._psutil
        samples: list[Sample] = [
            ("tf_psx_host_cpu_percent", {}, psutil.cpu_percent(interval=None)),
            ("tf_psx_host_swap_used_bytes", {}, psutil.swap_memory().used),
        ]
        for name, pid in sorted(self._tasks().items()):
            labels = {"task": name, "role": name.split(":")[0]}
            process = self._process(pid)
            try:
                rss = process.memory_info().rss if process else None
                cpu = process.cpu_percent(interval=None) if process else None
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                rss = cpu = None
            samples.append(("tf_psx_task_up", labels, 0.0 if rss is None else 1.0))
            if rss is not None:
                samples += [("tf_psx_task_rss_bytes", labels, rss), ("tf_psx_task_cpu_percent", labels, cpu)]
        return samples

    def _process(self, pid: int | None):
        if pid is None:
            return None
        process = self._processes.get(pid)
        if process is None:
            try:
                process = self._processes[pid] = self._psutil.Process(pid)
                process.cpu_percent(interval=None)  # the reference point for the next scrape
            except self._psutil.NoSuchProcess:
                return None
        return process
