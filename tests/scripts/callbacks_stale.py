"""StalenessBound on 3 workers (task processes), one of them slow; LOG_DIR.

Worker 0 gets batches 64x larger than the others, so its steps take much
longer and the fast workers apply several updates while one of its steps
runs: its gradients are stale. Two fits on one model:

* drop at max_staleness=1: dropped_gradients must equal the steps whose
  staleness exceeds 1 (the histogram), and optimizer.iterations must grow
  by the steps that were applied;
* scale: nothing is dropped, every step applies.

A ClusterMonitor with the LocalCluster writes the ps RSS as well.
Prints one JSON line starting with REPORT.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tf_psx  # noqa: E402
import tensorflow as tf  # noqa: E402

log_dir = sys.argv[1]
STEPS, FAST_BATCH, SLOW_BATCH, FIELDS, ROWS = 60, 16, 1024, 8, 2000

rng = np.random.default_rng(0)
ids = rng.integers(0, ROWS, size=(SLOW_BATCH * 4, FIELDS))
labels = (ids[:, 0] % 2).astype(np.float32)


def dataset_fn(ctx):
    size = SLOW_BATCH if ctx.input_pipeline_id == 0 else FAST_BATCH
    return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(size).prefetch(2)


report = {}
with tf_psx.LocalCluster(num_workers=3, num_ps=1, processes=True) as cluster:
    strategy = tf_psx.ParameterServerStrategy(cluster)
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((FIELDS,), dtype=tf.int64), tf.keras.layers.Embedding(ROWS, 16, name="emb"),
            tf.keras.layers.Flatten(), tf.keras.layers.Dense(256, activation="relu"),
            tf.keras.layers.Dense(1, activation="sigmoid")])
        model.compile(tf.keras.optimizers.SGD(0.05), "binary_crossentropy", steps_per_execution=2)
    data = tf.keras.utils.experimental.DatasetCreator(dataset_fn)
    for policy in ("drop", "scale"):
        bound = tf_psx.callbacks.StalenessBound(1, policy)
        monitor = tf_psx.callbacks.ClusterMonitor(os.path.join(log_dir, policy), every_n_steps=10, cluster=cluster)
        before = int(model.optimizer.iterations.numpy())
        history = model.fit(data, epochs=2, steps_per_epoch=STEPS, callbacks=[bound, monitor], verbose=0)
        report[policy] = {
            "applied": int(model.optimizer.iterations.numpy()) - before,
            "steps": 2 * STEPS,
            "histogram": bound.histogram[:12].tolist(),
            "histogram_total": int(bound.histogram.sum()),
            "stale_above_bound": int(bound.histogram[2:].sum()),
            "dropped": history.history["dropped_gradients"],
            "staleness_max": history.history["staleness_max"],
            "staleness_mean": history.history["staleness_mean"],
            "monitor": monitor.last_values,
        }
print("REPORT " + json.dumps(report), flush=True)
