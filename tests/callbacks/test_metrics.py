"""Prometheus metrics: scraped during a real fit on the session cluster, checked against closed forms."""

from __future__ import annotations

import json
import os
import socket
import urllib.request

import numpy as np
import pytest
import tensorflow as tf
import yaml
from prometheus_client.parser import text_string_to_metric_families

import tf_psx
from tf_psx import callbacks as cb, metrics
from tf_psx.errors import MetricsPortError

from conftest import REPO

pytestmark = pytest.mark.unit

DASHBOARD = os.path.join(REPO, "deploy", "grafana", "tf_psx_dashboard.json")
ALERTS = os.path.join(REPO, "deploy", "prometheus", "tf_psx_alerts.yml")
SCRAPE_TIMEOUT_S = 30
ROWS, FIELDS, BATCH, STEPS, EVERY = 1000, 4, 16, 24, 4
# fit schedules steps without waiting for them, so the test waits for the steps
# scheduled so far at JOIN_AT: the monitor's writes after batches 11 and 15
# then see finished steps, and the latency probe scheduled at the first is read
# at the second. The scrape comes between that write and the end.
JOIN_AT, SCRAPE_AT = (9, 13), 17


def scrape(port: int) -> dict[tuple, float]:
    """{(metric name, sorted label items): value} from the text format."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S).read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _batch_ids():
    # Each batch holds the same ids: example i has ids (i, i, i+100, 200) for field 0..3,
    # so row i (i < BATCH) is looked up twice, rows 100+i once, and row 200 BATCH times.
    rows = np.arange(BATCH)
    return np.stack([rows, rows, rows + 100, np.full(BATCH, 200)], axis=1).astype(np.int64)


def _expected_norm() -> float:
    # loss = mean over the batch of the sum of the looked-up (1-wide) rows, so the gradient of
    # row r is (times r is looked up) / BATCH, whatever the weights: a constant norm.
    counts = np.bincount(_batch_ids().ravel(), minlength=ROWS)
    return float(np.sqrt(np.sum((counts / BATCH) ** 2)))


class _Scraper(tf.keras.callbacks.Callback):
    def __init__(self, monitor):
        super().__init__()
        self._supports_tf_logs = True  # batch hooks under ParameterServerStrategy
        self.monitor, self.mid = monitor, None

    def on_train_batch_end(self, batch, logs=None):
        if batch in JOIN_AT:
            tf.distribute.experimental.coordinator.ClusterCoordinator(self.model.distribute_strategy).join()
        if batch == SCRAPE_AT:
            self.mid = scrape(self.monitor.metrics_server.port)


@pytest.mark.cluster
def test_a_fit_serves_its_metrics_and_they_hold_closed_forms(ps_strategy):
    with ps_strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((FIELDS,), dtype=tf.int64),
            tf.keras.layers.Embedding(ROWS, 1, name="ids"),
            tf.keras.layers.Flatten(),
        ])
        model.compile(tf.keras.optimizers.SGD(0.01), loss=lambda y, p: tf.reduce_sum(p, axis=-1))
    ids = _batch_ids()

    def dataset_fn(_ctx):
        return tf.data.Dataset.from_tensors((ids, np.zeros(BATCH, np.float32))).repeat()

    monitor = cb.ClusterMonitor(metrics_port=0, metrics_host="127.0.0.1", every_n_steps=EVERY)
    scraper = _Scraper(monitor)
    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=STEPS,
              callbacks=[monitor, scraper], verbose=0)
    try:
        mid, end = scraper.mid, scrape(monitor.metrics_server.port)
        assert mid is not None and mid[("tf_psx_steps", ())] < STEPS
        assert end[("tf_psx_steps", ())] == STEPS
        for sample in (mid, end):
            assert sample[("tf_psx_examples_per_second", ())] > 0
            assert sample[("tf_psx_steps_per_second", ())] > 0
            np.testing.assert_allclose(sample[("tf_psx_gradient_norm", ())], _expected_norm(), atol=1e-5)
            # 2 * BATCH + 1 distinct rows of ROWS have a gradient in every step.
            np.testing.assert_allclose(sample[("tf_psx_gradient_row_share", (("layer", "ids"),))],
                                       (2 * BATCH + 1) / ROWS, rtol=1e-6)
            assert sample[("tf_psx_staleness_max", ())] == 0
            assert sample[("tf_psx_closure_retries", ())] == 0
        # The probe read from each of the 2 ps tasks (scheduled at one write, read at the next).
        for task in ("0", "1"):
            assert 0 < mid[("tf_psx_ps_latency_seconds", (("ps", task),))] < SCRAPE_TIMEOUT_S
            assert mid[("tf_psx_ps_variable_bytes", (("ps", task),))] > 0
        # The estimate: the table is split in 2 shards of ROWS/2 rows, each 1 float32 wide; a step
        # reads its 2 * BATCH + 1 rows (and sends as many gradient rows back).
        for direction in ("from_ps", "to_ps"):
            total = sum(mid[("tf_psx_ps_bytes_per_step", (("direction", direction), ("ps", t)))] for t in "01")
            np.testing.assert_allclose(total, (2 * BATCH + 1) * 4, rtol=1e-6)
        # The TensorBoard side is off (no log_dir) and the values are the monitor's own.
        assert monitor.log_dir is None
        assert monitor.last_values["gradients/norm"] == pytest.approx(_expected_norm(), abs=1e-5)
    finally:
        monitor.metrics_server.close()


def test_a_metrics_port_in_use_is_named_and_training_goes_on(tmp_path):
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        monitor = cb.ClusterMonitor(tmp_path, every_n_steps=2, metrics_port=port, metrics_host="127.0.0.1")
        history = model.fit(np.ones((16, 2)), np.ones(16), batch_size=4, epochs=2, verbose=0, callbacks=[monitor])
    finally:
        taken.close()
    assert len(history.history["loss"]) == 2 and int(model.optimizer.iterations.numpy()) == 8
    assert monitor.metrics_server is None
    assert f"The metrics port {port} on 127.0.0.1 is already in use" in monitor.metrics_error
    assert "throughput/examples_per_sec" in monitor.last_values  # TensorBoard went on
    reserved = socket.create_server(("127.0.0.1", 0))
    port = reserved.getsockname()[1]
    try:
        with pytest.raises(MetricsPortError, match=f"port {port} .*already in use.*Fix: pass another port") as info:
            metrics.serve(port, "127.0.0.1")
    finally:
        reserved.close()
    assert isinstance(info.value, OSError)


def test_one_process_shares_a_port_between_monitors():
    first = metrics.serve(0, "127.0.0.1")
    try:
        assert metrics.serve(first.port, "127.0.0.1") is first
        first.set_source("ClusterMonitor", lambda: [("tf_psx_steps", {}, 1.0)])
        first.set_source("ClusterMonitor", lambda: [("tf_psx_steps", {}, 2.0)])  # a rerun cell's monitor
        assert scrape(first.port)[("tf_psx_steps", ())] == 2.0
        first.set_source("broken", lambda: 1 / 0)
        assert scrape(first.port)[("tf_psx_steps", ())] == 2.0  # a failing source is left out, not the scrape
    finally:
        first.close()


def test_the_process_sampler_reads_a_live_task_and_marks_a_gone_one_down():
    sampler = metrics.ProcessSampler(lambda: {"ps:0": os.getpid(), "worker:0": None})
    samples = {(name, labels.get("task")): value for name, labels, value in sampler()}
    assert samples[("tf_psx_task_up", "ps:0")] == 1.0 and samples[("tf_psx_task_rss_bytes", "ps:0")] > 0
    assert samples[("tf_psx_task_up", "worker:0")] == 0.0 and ("tf_psx_task_rss_bytes", "worker:0") not in samples
    assert samples[("tf_psx_host_swap_used_bytes", None)] >= 0


@pytest.mark.parametrize("kwargs, match", [
    ({}, "ClusterMonitor needs a `log_dir` .* or a `metrics_port`"),
    ({"log_dir": "/tmp/x", "metrics_port": 70000}, r"`metrics_port` of ClusterMonitor must be an int in 0..65535 or None. Received: 70000"),
    ({"log_dir": "/tmp/x", "metrics_port": "9400"}, r"`metrics_port`.*Received: '9400'"),
])
def test_bad_monitor_arguments_are_named(kwargs, match, monkeypatch):
    monkeypatch.delenv(metrics.ENV_PORT, raising=False)
    with pytest.raises(ValueError, match=match):
        cb.ClusterMonitor(**kwargs)


def test_the_port_comes_from_the_launchers_variable(monkeypatch):
    monkeypatch.setenv(metrics.ENV_PORT, "9401")
    assert cb.ClusterMonitor().metrics_port == 9401
    monkeypatch.setenv(metrics.ENV_PORT, "x1")
    with pytest.raises(ValueError, match=r"TF_PSX_METRICS_PORT must be a port in 0..65535. Received: 'x1'"):
        cb.ClusterMonitor("/tmp/x")


def _metric_names(expr: str) -> set[str]:
    import re  # pylint: disable=import-outside-toplevel

    return set(re.findall(r"\btf_psx_[a-z_]+", expr))


def test_the_dashboard_and_the_alert_rules_use_only_served_metrics():
    with open(DASHBOARD, encoding="utf-8") as handle:
        dashboard = json.load(handle)
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    used = set().union(*map(_metric_names, exprs))
    assert used and used <= set(metrics.METRICS), sorted(used - set(metrics.METRICS))
    # Every metric has a panel.
    assert set(metrics.METRICS) <= used, sorted(set(metrics.METRICS) - used)
    with open(ALERTS, encoding="utf-8") as handle:
        rules = [rule for group in yaml.safe_load(handle)["groups"] for rule in group["rules"]]
    names = {rule["alert"] for rule in rules}
    assert {"PsCpuHigh", "SwapInUse", "StalenessJump", "GradientSparsityJump", "SnapshotTimeGrowing"} <= names
    for rule in rules:
        assert _metric_names(rule["expr"]) <= set(metrics.METRICS), rule
        assert rule["annotations"]["summary"] and rule["labels"]["severity"] in ("warning", "critical")
