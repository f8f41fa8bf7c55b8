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
import tensorflow as tf  # noqa: E402
from tf_psx._tf import runtime as _runtime  # noqa: E402

STEPS, STOP_AFTER, TIMEOUT_S, WAIT_S = 3000, 5, 6.0, 120.0

rng = np.random.default_rng(0)
ids = rng.integers(0, 1000, size=(1024, 4))
labels = (ids[:, 0] % 2).astype(np.float32)


def freeze_then_thaw(cluster, coordinator, doctor, events):
    table = _runtime.closure_table(coordinator)
    deadline = time.monotonic() + WAIT_S
    while table.finished < STOP_AFTER and time.monotonic() < deadline:
        time.sleep(0.005)
    pid = cluster.pid("worker", 0)
    os.kill(pid, signal.SIGSTOP)
    events["stopped_after"] = table.finished
    while not doctor.reports and time.monotonic() < deadline:
        time.sleep(0.1)
    events["reported"] = bool(doctor.reports)
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
    coordinator = _runtime.coordinator_of(strategy)
    events = {}
    thread = threading.Thread(target=freeze_then_thaw, args=(cluster, coordinator, doctor, events), daemon=True)
    thread.start()
    model.fit(dataset, epochs=1, steps_per_epoch=STEPS, callbacks=[doctor], verbose=0)
    thread.join(WAIT_S)
    with open(cluster.log_path("ps", 0), encoding="utf-8", errors="replace") as handle:
        ps_log = handle.read()
    result = {"reports": doctor.reports, "iterations": int(model.optimizer.iterations.numpy()), "events": events,
              "worker_pid": cluster.pid("worker", 0), "ps_log_has_stacks": "Current thread" in ps_log or
              "Thread 0x" in ps_log}
print("RESULT " + json.dumps(result), flush=True)
sys.exit(0)
