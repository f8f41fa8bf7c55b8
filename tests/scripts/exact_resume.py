"""The chief of the exact-resume tests: numbered records, one epoch of `model.fit` with `PeriodicSync`.

Record r looks up row r of a 1-wide Embedding (zeros at first) and the loss
is the batch mean of the looked-up values, so every step moves each of its
rows by -LR / BATCH, whatever the other rows hold: after the run, row r is
-LR / BATCH times the number of times record r was applied. Exactly once:
every row equals -LR / BATCH.

A killed chief, relaunched, restores the newest snapshot (weights and the
step) and its `fit` continues the same epoch at that step: the coordinator
reads the dataset and skips the batches the snapshot holds, so the steps
applied after the snapshot are rolled back with the weights and fed again.

Prints "fit start step=S pid=P" (S: the newest snapshot's step), "first
applied step t=T" (T: time.time() once `iterations` has passed S: the
first step of this run applied on the ps; bench/exact_resume.py reads it)
and, at the end, "RESULT {json}" with the rows. The snapshots (snapshot-N) in
$TF_PSX_SNAPSHOT_DIR show its progress.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tf_psx  # noqa: E402
from tf_psx import launch  # noqa: E402

RECORDS, BATCH, LR = 960, 8, 0.5
# Every snapshot of the run is kept: the tests wait for given steps.
KEEP = RECORDS // BATCH


class _Sleep(tf.keras.callbacks.Callback):
    """--step-sleep between steps: the test can kill the coordinator between snapshots."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self._supports_tf_logs = True  # it reads no logs: no step is waited for

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


class _FirstApplied(tf.keras.callbacks.Callback):
    """Prints when the first step of this run is applied (`iterations` past `start`), once, within 60 s."""

    def __init__(self, start: int):
        super().__init__()
        self.start, self.done = start, False
        self._supports_tf_logs = True

    def on_train_batch_end(self, batch, logs=None):
        if self.done:
            return
        self.done = True
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if int(self.model.optimizer.iterations.numpy()) > self.start:
                print(f"first applied step t={time.time():.3f}", flush=True)
                return
            time.sleep(0.005)
        print("first applied step not seen within 60 s", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    strategy = tf_psx.ParameterServerStrategy()
    with strategy.scope():
        inputs = tf.keras.Input((1,), dtype=tf.int64)
        rows = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(RECORDS, 1, embeddings_initializer="zeros",
                                                                   name="records")(inputs))
        model = tf.keras.Model(inputs, rows)
        model.compile(tf.keras.optimizers.SGD(LR), loss=lambda y, p: p[:, 0])
    ids = tf.reshape(tf.range(RECORDS, dtype=tf.int64), [-1, 1])
    dataset = tf.data.Dataset.from_tensor_slices((ids, tf.zeros([RECORDS]))).batch(BATCH)
    directory = launch.snapshot_dir()
    snapshots = tf_psx.callbacks.PeriodicSync.snapshots(directory)
    start = max((s.step for s in snapshots), default=0)
    print(f"fit start step={start} pid={os.getpid()}", flush=True)
    sync = tf_psx.callbacks.PeriodicSync(args.every, directory, max_to_keep=KEEP)
    callbacks = [sync, _FirstApplied(start)] + ([_Sleep(args.step_sleep)] if args.step_sleep else [])
    history = model.fit(dataset, epochs=1, verbose=0, callbacks=callbacks)
    weights = model.get_layer("records").get_weights()[0][:, 0]
    print("RESULT " + json.dumps({"start": start, "done": int(model.optimizer.iterations.numpy()),
                                  "epochs": len(history.history["loss"]), "rows": [float(w) for w in weights]}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
