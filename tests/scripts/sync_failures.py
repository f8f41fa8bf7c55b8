"""Sync steps off the happy path: backup workers, a worker killed mid-step, every worker gone.

Modes (one `RESULT {json}` line each):

* `backup`: 3 workers, `replicas_to_aggregate=2`. Every step's gradient is
  either in an applied sync step or dropped as late, and counted:
  applied + dropped = scheduled steps.
* `kill`: 2 workers on task processes, `sync_timeout_s=5`. Worker 1 is
  killed with SIGKILL during `fit` and restarted later. `fit` completes; each
  step is applied once (a closure cut short by the kill is run again
  elsewhere; one that had already arrived counts twice, as in async).
* `stuck`: 2 in-process workers, `sync_timeout_s=3`. One step takes a slot
  and fails before its gradient (an assertion in the step): the next sync
  step has a slot that never arrives. It completes once the slot is
  reassigned, 3 s on, and every later step is applied.
* `gone`: 2 workers on task processes, both killed before `fit`. `fit`
  raises `SyncStepError` within the timeout (plus the watchdog's poll).

Usage: sync_failures.py backup|kill|stuck|gone
"""

from __future__ import annotations

import json
import math
import sys
import time

import numpy as np

import tf_psx
import tensorflow as tf

STEPS = 20
BATCH = 32


def make_model(strategy):
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((4,), dtype=tf.int64), tf_psx.layers.ShardedEmbedding(500, 4),
            tf.keras.layers.Flatten(), tf.keras.layers.Dense(1, activation="sigmoid")])
        model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy")
    return model


def dataset_fn(_ctx):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 500, size=(2048, 4))
    labels = (ids[:, 0] % 2).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(BATCH)


def backup() -> dict:
    with tf_psx.LocalCluster(num_workers=3, num_ps=2) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, "fixed:2", sync=True, replicas_to_aggregate=2)
        model = make_model(strategy)
        model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=3, steps_per_epoch=STEPS, verbose=0)
        stats = strategy.sync_stats()
        return {"mode": "backup", "scheduled": 3 * STEPS, **stats,
                "iterations": int(model.optimizer.iterations.numpy())}


class _KillAndRestart(tf.keras.callbacks.Callback):
    def __init__(self, cluster, kill_at: int, restart_at: int):
        super().__init__()
        self._supports_tf_logs = True
        self.cluster, self.kill_at, self.restart_at, self.seen = cluster, kill_at, restart_at, 0
        self.killed_at = self.restarted_at = None

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.kill_at:
            self.cluster.kill("worker", 1)
            self.killed_at = time.monotonic()
        elif self.seen == self.restart_at:
            self.cluster.restart("worker", 1)
            self.restarted_at = time.monotonic()


def kill() -> dict:
    with tf_psx.LocalCluster(num_workers=2, num_ps=2, processes=True) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, "fixed:2", sync=True, sync_timeout_s=5)
        model = make_model(strategy)
        callback = _KillAndRestart(cluster, kill_at=25, restart_at=35)
        start = time.monotonic()
        history = model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=3,
                            steps_per_epoch=STEPS, callbacks=[callback], verbose=0)
        stats = strategy.sync_stats()
        return {"mode": "kill", "scheduled": 3 * STEPS, "epochs": len(history.history["loss"]), **stats,
                "iterations": int(model.optimizer.iterations.numpy()),
                "worker1_alive": cluster.alive("worker", 1),
                "seconds": round(time.monotonic() - start, 1),
                "min_steps": math.ceil(3 * STEPS / 2)}


def stuck() -> dict:
    with tf_psx.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, sync=True, sync_timeout_s=3)
        with strategy.scope():
            weight = tf.Variable(tf.zeros([3]))
            optimizer = tf.keras.optimizers.SGD(0.5)

        @tf.function
        def step(fail):
            def replica(fail):
                tf.debugging.assert_equal(fail, False, message="this step fails after its claim")
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(weight)
                optimizer.apply_gradients([(tape.gradient(loss, weight), weight)])

            return strategy.run(replica, args=(fail,))

        coordinator = strategy.coordinator
        coordinator.schedule(step, args=(tf.constant(True),))
        try:
            coordinator.join()
            failed = False
        except tf.errors.InvalidArgumentError:
            failed = True
        start = time.monotonic()
        for _ in range(6):
            coordinator.schedule(step, args=(tf.constant(False),))
        coordinator.join()
        seconds = time.monotonic() - start
        strategy.flush_sync()
        return {"mode": "stuck", "failed_step_raised": failed, "seconds": round(seconds, 1), **strategy.sync_stats(),
                "weight": weight.numpy().tolist(), "iterations": int(optimizer.iterations.numpy())}


def gone() -> dict:
    with tf_psx.LocalCluster(num_workers=2, num_ps=2, processes=True) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, "fixed:2", sync=True, sync_timeout_s=5)
        model = make_model(strategy)
        model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=2, verbose=0)
        cluster.kill("worker", 0)
        cluster.kill("worker", 1)
        start = time.monotonic()
        try:
            model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=STEPS,
                      verbose=0)
            error, message = None, ""
        except Exception as caught:  # pylint: disable=broad-except  (the type is the result)
            error, message = type(caught).__name__, str(caught)
        return {"mode": "gone", "error": error, "message": message[:400],
                "seconds": round(time.monotonic() - start, 1)}


def main(argv=None) -> int:
    mode = (argv or sys.argv[1:])[0]
    result = {"backup": backup, "kill": kill, "stuck": stuck, "gone": gone}[mode]()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
