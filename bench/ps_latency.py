"""Step time of the Criteo-shaped model (bench/fused_embeddings.py) with network latency on the ps links.

Loopback has no latency, so where a step waits on the parameter servers is
hidden. Here every byte between the worker (and the coordinator) and each of
the 2 ps task processes crosses a `tf_psx.cluster.netproxy.DelayProxy` that holds it
DELAY_MS in each direction: the ps tasks listen on their own ports, and the
worker's and the coordinator's TF_CONFIG name the proxy's ports instead. 1
worker, the same model and data as bench/fused_embeddings.py, the stock
(26 Embedding layers) and fused (one FeatureEmbeddings) variants, the whole
model and the embedding stage alone; one fresh process per run. At 0 ms the
bytes still cross the relay (a Python process on the same 2 cores), so both
delays carry its cost and only their difference is the latency's.

What it answers: how many ps round trips a step waits for in sequence
((ms/step with the delay - without) / round trip), which bounds what
prefetching rows (overlap) or a worker-side row cache could hide, and how the
fused / stock ratio moves when the network is slower than loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fused_embeddings import BATCH, WARMUP_STEPS, TIMED_STEPS, build  # noqa: E402  pylint: disable=wrong-import-position

DELAYS_MS = (0.0, 2.0)
VARIANTS = ("stock_stage", "fused_stage", "stock", "fused")
NUM_PS = 2
READY_TIMEOUT_S = 120


def _delayed_cluster(delay_ms: float, relay_worker: bool = False):
    """Starts 2 ps and 1 worker behind delay proxies; returns (the coordinator's ClusterConfig, stop).

    `relay_worker`: the worker is reached through the relay too. TF moves a
    tensor by a pull (the receiving task asks the sending one), so a ps task
    fetches what a worker sends it over its own connection to the worker;
    with the worker relayed, both directions are counted.
    """
    from tf_psx.cluster import supervisor as _supervisor  # pylint: disable=import-outside-toplevel
    from tf_psx.cluster import ClusterConfig  # pylint: disable=import-outside-toplevel
    from tf_psx.cluster.ports import free_ports  # pylint: disable=import-outside-toplevel
    from tf_psx.cluster import netproxy  # pylint: disable=import-outside-toplevel

    ports = free_ports(2 * NUM_PS + 3)
    real_ps = [f"127.0.0.1:{port}" for port in ports[:NUM_PS]]
    seen_ps = [f"127.0.0.1:{port}" for port in ports[NUM_PS:2 * NUM_PS]]
    worker, chief = f"127.0.0.1:{ports[-3]}", f"127.0.0.1:{ports[-1]}"
    seen_worker = f"127.0.0.1:{ports[-2]}" if relay_worker else worker
    # Each task listens on its own port and reaches the others as the coordinator does (through the relay).
    ps_view = ClusterConfig(workers=[seen_worker], ps=real_ps, chief=chief)
    worker_view = ClusterConfig(workers=[worker], ps=seen_ps, chief=chief)
    seen = ClusterConfig(workers=[seen_worker], ps=seen_ps, chief=chief)
    routes = list(zip(seen_ps, real_ps)) + ([(seen_worker, worker)] if relay_worker else [])
    log_dir = tempfile.mkdtemp(prefix="tf_psx_bench_latency_")
    # The relay runs in a process of its own: its threads would otherwise wait for this process's GIL.
    proxy_log = os.path.join(log_dir, "proxy.log")
    with open(proxy_log, "wb") as log:
        proxy = subprocess.Popen(  # pylint: disable=consider-using-with
            [sys.executable, "-m", "tf_psx.netproxy", "--delay-ms", str(delay_ms),
             *(f"{seen_address}={real_address}" for seen_address, real_address in routes)],
            stdout=log, stderr=subprocess.STDOUT)
    tasks = []
    for task_type, config, count in (("ps", ps_view, NUM_PS), ("worker", worker_view, 1)):
        for index in range(count):
            env = _supervisor.server_env(os.environ, config.to_json(task_type, index))
            tasks.append(_supervisor.TaskProcess(task_type, index, [sys.executable, "-m", "tf_psx.server"], env,
                                                 os.path.join(log_dir, f"{task_type}-{index}.log")))
    for task in tasks:
        task.start()

    def stop() -> dict:
        """Stops the tasks and the relay; returns the relay's byte counts."""
        _supervisor.stop(tasks)
        proxy.terminate()
        proxy.wait(READY_TIMEOUT_S)
        with open(proxy_log, encoding="utf-8") as handle:
            last = handle.read().strip().splitlines()[-1]
        return json.loads(last) if last.startswith("{") else {}

    failed = _supervisor.wait_ready(tasks, READY_TIMEOUT_S)
    if failed is not None:
        stop()
        raise SystemExit(f"{failed[0].name} {failed[1]}; logs in {log_dir}")
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        with open(proxy_log, encoding="utf-8") as handle:
            if netproxy.READY_MARK in handle.read():
                return seen, stop
        if proxy.poll() is not None or time.monotonic() > deadline:
            stop()
            raise SystemExit(f"the delay proxy did not start within {READY_TIMEOUT_S} s; its log is {proxy_log}")
        time.sleep(0.1)


def child(variant: str, delay_ms: str) -> None:
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from _common import time_fit  # pylint: disable=import-outside-toplevel

    config, stop = _delayed_cluster(float(delay_ms))
    try:
        os.environ["TF_CONFIG"] = config.to_json("chief", 0)
        strategy = tf_psx.ParameterServerStrategy(
            variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(NUM_PS))
        with strategy.scope():
            model, dataset_fn, _ = build(variant, 26)
        ms = time_fit(model, dataset_fn, WARMUP_STEPS, TIMED_STEPS)
    finally:
        stats = stop()
    relayed = sum(route["bytes_up"] + route["bytes_down"] for route in stats.values())
    print(json.dumps({"ms_per_step": ms, "examples_per_s": 1000.0 * BATCH / ms, "relayed_bytes": relayed}),
          flush=True)


def main() -> None:
    from _common import run_child, write_result  # pylint: disable=import-outside-toplevel

    results = {}
    for variant in VARIANTS:
        for delay in DELAYS_MS:
            result = run_child(__file__, variant, str(delay), timeout=900)
            results[(variant, delay)] = result
            print(f"{variant} delay {delay:g} ms: {result['ms_per_step']:.1f} ms/step", flush=True)
    low, high = DELAYS_MS
    round_trip = 2 * (high - low)
    rows = []
    for variant in VARIANTS:
        fast, slow = results[(variant, low)]["ms_per_step"], results[(variant, high)]["ms_per_step"]
        rows.append({"metric": f"{variant}: ms/step at {low:g} -> {high:g} ms each way",
                     "value": f"{fast:.1f} -> {slow:.1f}"})
        rows.append({"metric": f"{variant}: ps round trips waited per step ((slow - fast) / {round_trip:g} ms)",
                     "value": round((slow - fast) / round_trip, 2)})
    for scope in ("stage", "whole"):
        stock, fused = ("stock_stage", "fused_stage") if scope == "stage" else ("stock", "fused")
        for delay in DELAYS_MS:
            ratio = results[(stock, delay)]["ms_per_step"] / results[(fused, delay)]["ms_per_step"]
            rows.append({"metric": f"{'embedding stage' if scope == 'stage' else 'whole model'}, {delay:g} ms each "
                                   f"way: fused / stock examples/s", "value": round(ratio, 3)})
    write_result(
        "ps_latency",
        "bench/fused_embeddings.py's model (26 Criteo-capped features, dim 16, batch 512, Adagrad), 1 worker and "
        f"2 ps task processes; every byte between the worker or the coordinator and a ps crosses a DelayProxy "
        f"holding it {low:g} or {high:g} ms each way (at 0 ms the relay's own cost remains); ms/step over {TIMED_STEPS} steps after {WARMUP_STEPS}, "
        "one fresh process per run.",
        rows,
        extra={f"{v} {d:g}ms": r for (v, d), r in results.items()},
    )


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 2)
