"""A worker frozen by SIGSTOP mid-fit: the stall doctor reports it, then fit completes after SIGCONT.

Prints one JSON line: the reports, the steps, and what the ps task's log
holds after the doctor asked for its stacks.
"""

import json
import os
import signal
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tf_psx  # noqa: E402
from tf_psx._tf import runtime as _runtime  # noqa: E402
import tensorflow as tf  # noqa: E402

STEPS, STOP_AFTER, TIMEOUT_S, WAIT_S = 300, 20, 10.0, 120.0

rng = np.random.default_rng(0)
ids = rng.integers(0, 1000, size=(1024, 4))
labels = (ids[:, 0] % 2).astype(np.float32)


class Freeze(tf.keras.callbacks.Callback):
    """Stops worker 0 with SIGSTOP once STOP_AFTER steps were scheduled (fit goes on scheduling the
    rest, so steps are pending for sure), and continues it from a thread once the doctor reported."""

    def __init__(self, cluster, doctor, events):
        super().__init__()
        self._supports_tf_logs = True  # batch hooks under ParameterServerStrategy
        self.cluster, self.doctor, self.events, self.thread = cluster, doctor, events, None

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == STOP_AFTER:
            # The worker's first step (its remote function set-up) has finished, so what the doctor
            # sees next is the freeze, not a slow start.
            table = _runtime.closure_table(_runtime.coordinator_of(self.model.distribute_strategy))
            deadline = time.monotonic() + WAIT_S
            while table.finished < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            pid = self.cluster.pid("worker", 0)
            os.kill(pid, signal.SIGSTOP)
            self.thread = threading.Thread(target=self._thaw, args=(pid,), daemon=True)
            self.thread.start()

    def _thaw(self, pid):
        deadline = time.monotonic() + WAIT_S
        while not self.doctor.reports and time.monotonic() < deadline:
            time.sleep(0.1)
        self.events["reported"] = bool(self.doctor.reports)
        time.sleep(1.0)  # the ps task writes its stacks into its log
        os.kill(pid, signal.SIGCONT)


with tf_psx.LocalCluster(num_workers=1, num_ps=1, processes=True) as cluster:
    strategy = tf_psx.ParameterServerStrategy(cluster)
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((4,), dtype=tf.int64), tf.keras.layers.Embedding(1000, 4),
            tf.keras.layers.Flatten(), tf.keras.layers.Dense(1, activation="sigmoid")])
        model.compile("sgd", "binary_crossentropy")
    dataset = tf.keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(16))
    doctor = tf_psx.callbacks.StallDoctor(timeout_s=TIMEOUT_S, cluster=cluster)
    events = {}
    freeze = Freeze(cluster, doctor, events)
    model.fit(dataset, epochs=1, steps_per_epoch=STEPS, callbacks=[doctor, freeze], verbose=0)
    freeze.thread.join(WAIT_S)
    with open(cluster.log_path("ps", 0), encoding="utf-8", errors="replace") as handle:
        ps_log = handle.read()
    result = {"reports": doctor.reports, "iterations": int(model.optimizer.iterations.numpy()), "events": events,
              "worker_pid": cluster.pid("worker", 0), "ps_log_has_stacks": "Current thread" in ps_log or
              "Thread 0x" in ps_log}
print("RESULT " + json.dumps(result), flush=True)
sys.exit(0)
