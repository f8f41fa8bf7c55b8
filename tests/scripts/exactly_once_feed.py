"""The chief of the exactly-once test: numbered records, one epoch, through tf_psx.feed.CoordinatorFeed.

Record r looks up row r of a 1-wide Embedding (zeros at first) and the loss
is the batch mean of the looked-up values, so every step moves each of its
rows by -LR / BATCH, whatever the other rows hold: after the run, row r is
-LR / BATCH times the number of times record r was applied. Exactly once:
every row equals -LR / BATCH.

Prints "feed start step=S" and, at the end, "RESULT {json}" with the rows.
The checkpoints (ckpt-N) in $TF_PSX_SNAPSHOT_DIR show its progress.
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
    feed = tf_psx.feed.CoordinatorFeed(model, dataset, launch.snapshot_dir(), every_n_steps=args.every)
    start = feed.restore()
    print(f"feed start step={start} pid={os.getpid()}", flush=True)
    total = RECORDS // BATCH
    done = start
    while done < total:
        # One batch at a time, --step-sleep apart: the test can kill the coordinator between checkpoints.
        done = feed.fit(done + 1, save_at_end=done + 1 == total)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    try:
        feed.fit(total + 1)  # one pass only: the data ends first
        ended = None
    except ValueError as err:
        ended = str(err)
    weights = model.get_layer("records").get_weights()[0][:, 0]
    print("RESULT " + json.dumps({"start": start, "done": done, "ended": ended, "rows": [float(w) for w in weights]}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
