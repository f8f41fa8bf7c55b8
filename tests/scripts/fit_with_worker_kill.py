"""A processes=True cluster trains, and fit completes every step after a worker is killed."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tf_psx  # noqa: E402
import tensorflow as tf  # noqa: E402

EPOCHS, STEPS, KILL_AT = 3, 40, 50


class KillWorker(tf.keras.callbacks.Callback):
    """Kills worker 1 once, at a batch in the middle of fit."""

    def __init__(self, cluster):
        super().__init__()
        self._supports_tf_logs = True  # batch hooks run under ParameterServerStrategy
        self.cluster, self.seen = cluster, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == KILL_AT:
            self.cluster.kill("worker", 1)
            print(f"worker 1 killed at batch {self.seen}", flush=True)


rng = np.random.default_rng(0)
ids = rng.integers(0, 5000, size=(4096, 4))
labels = (ids[:, 0] % 2).astype(np.float32)

with tf_psx.LocalCluster(num_workers=2, num_ps=2, processes=True) as cluster:
    strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((4,), dtype=tf.int64), tf.keras.layers.Embedding(5000, 8),
            tf.keras.layers.Flatten(), tf.keras.layers.Dense(1, activation="sigmoid")])
        model.compile("adagrad", "binary_crossentropy")

    def dataset_fn(ctx):
        return tf.data.Dataset.from_tensor_slices((ids, labels)).repeat().batch(64)

    history = model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=EPOCHS,
                        steps_per_epoch=STEPS, callbacks=[KillWorker(cluster)], verbose=0)
    done = int(model.optimizer.iterations.numpy())
    print(f"iterations={done} epochs={len(history.history['loss'])} worker1_alive={cluster.alive('worker', 1)}")
    # A closure cut short on the killed worker is run again elsewhere; one
    # that had already applied its update before the kill counts twice.
    ok = len(history.history["loss"]) == EPOCHS and EPOCHS * STEPS <= done <= EPOCHS * STEPS + 1
    print("all steps done" if ok else "steps missing", flush=True)
sys.exit(0 if ok else 1)
