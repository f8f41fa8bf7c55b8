"""Raw TF 2.16.2, no tf_psx: a worker killed mid-step makes `ClusterCoordinator` apply a step's update twice.

The reproduction behind tf_psx's step tokens (tf_psx.training.step_once). Plain
`tf.distribute.Server` processes (2 ps, `--workers` workers) on 127.0.0.1,
`tf.distribute.experimental.ParameterServerStrategy` with TF's own
`FixedShardsPartitioner(2)` and `ClusterCoordinator`, no tf_psx import in
any process. Each step adds 1 to its own BATCH rows of a table split over
the two ps tasks (`ShardedVariable.scatter_add`) and 1 to a step counter,
so after S steps every row must be 1 and the counter S. A killer thread
SIGKILLs a random worker at random moments and starts it again on its port
(one down at a time). TF re-runs the killed worker's closure on another
worker with the same arguments; where the first attempt had already applied
its update on one ps, the re-run applies it there again.

Prints `RESULT {json}`: how many rows were applied 0, 1, 2, ... times, the
counter against the steps, and the kills. Measured here (2026-12-05) with 2
workers, 20,000 steps, 4 kills in 51 s: 8 of 160,000 rows applied twice (one
whole step) and the counter at 20,001: one re-run step applied twice.

Usage: raw_tf_rerun.py [--workers 2] [--steps 20000] [--kills 4] [--seed 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402  pylint: disable=wrong-import-position

BATCH = 8
GAP_S = (0.5, 2.0)  # seconds between a restart and the next kill
SERVER = ("import json, sys, tensorflow as tf\n"
          "tf.distribute.Server(tf.train.ClusterSpec(json.loads(sys.argv[1])), job_name=sys.argv[2],\n"
          "                     task_index=int(sys.argv[3]), protocol='grpc', start=True).join()\n")
# Bounds: a server listening, the killer's last restart, the whole run.
LISTEN_WAIT_S, RESTART_WAIT_S, RUN_WAIT_S = 60, 120, 900


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_listening(port: int, what: str) -> None:
    deadline = time.monotonic() + LISTEN_WAIT_S
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {LISTEN_WAIT_S} s")


class Servers:
    """The ps and worker processes of `spec`, started and stopped by pid."""

    def __init__(self, spec: dict):
        self.spec, self.procs = spec, {}
        for job in ("ps", "worker"):
            for index in range(len(spec[job])):
                self.start(job, index)

    def start(self, job: str, index: int) -> None:
        self.procs[(job, index)] = subprocess.Popen(
            [sys.executable, "-c", SERVER, json.dumps(self.spec), job, str(index)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_listening(int(self.spec[job][index].rsplit(":", 1)[1]), f"{job} {index}")

    def kill(self, job: str, index: int) -> None:
        proc = self.procs[(job, index)]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


class Killer(threading.Thread):
    def __init__(self, servers: Servers, workers: int, kills: int, seed: int):
        super().__init__(daemon=True)
        self.servers, self.workers, self.kills = servers, workers, kills
        self.rng, self.done, self.log, self.errors = random.Random(seed), threading.Event(), [], []

    def run(self):
        start = time.monotonic()
        while len(self.log) < self.kills and not self.done.wait(self.rng.uniform(*GAP_S)):
            victim = self.rng.randrange(self.workers)
            self.servers.kill("worker", victim)
            self.log.append((round(time.monotonic() - start, 2), victim))
            try:
                self.servers.start("worker", victim)
            except Exception as error:  # pylint: disable=broad-except  (reported in the RESULT)
                self.errors.append(repr(error))
                return


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    spec = {"chief": [f"127.0.0.1:{_free_port()}"],
            "ps": [f"127.0.0.1:{_free_port()}" for _ in range(2)],
            "worker": [f"127.0.0.1:{_free_port()}" for _ in range(args.workers)]}
    servers = Servers(spec)
    killer = Killer(servers, args.workers, args.kills, args.seed)
    try:
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(spec), task_type="chief", task_id=0, rpc_layer="grpc")
        strategy = tf.distribute.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
        rows = args.steps * BATCH
        with strategy.scope():
            table = tf.Variable(tf.zeros([rows]), name="table")
            counter = tf.Variable(tf.constant(0, tf.int64), name="counter")

        @tf.function
        def step(first):
            ids = tf.range(first, first + BATCH)
            table.scatter_add(tf.IndexedSlices(tf.ones([BATCH]), ids))
            counter.assign_add(1)

        for index in range(min(args.steps, 200)):  # the trace, and every worker busy before the first kill
            coordinator.schedule(step, args=(tf.constant(index * BATCH, tf.int64),))
        killer.start()
        started = time.monotonic()
        for index in range(200, args.steps):
            coordinator.schedule(step, args=(tf.constant(index * BATCH, tf.int64),))
            if time.monotonic() - started > RUN_WAIT_S:
                raise TimeoutError(f"scheduling {args.steps} steps took over {RUN_WAIT_S} s")
        coordinator.join()
        killer.done.set()
        killer.join(RESTART_WAIT_S)
        values = tf.convert_to_tensor(table).numpy()
        applied = collections.Counter(int(round(value)) for value in values)
        print("RESULT " + json.dumps({
            "workers": args.workers, "steps": args.steps, "rows": rows, "seconds": round(time.monotonic() - started, 1),
            "kills": killer.log, "killer_errors": killer.errors,
            "rows_applied": {str(k): v for k, v in sorted(applied.items())},
            "counter": int(counter.numpy()),
        }), flush=True)
    finally:
        killer.done.set()
        servers.stop()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # pylint: disable=protected-access  (TF's teardown of a cluster whose tasks are gone can hang)
