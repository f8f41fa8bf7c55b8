"""tf_psx.data.criteo where a user calls it: peeked for the model's shapes, then in fit's dataset_fn.

Usage: criteo_everywhere.py DIR [--processes] [--workers N] [--order before|after] [--malformed K]

Writes a Criteo file of ROWS rows (seed 0) and K bad lines into DIR, peeks one batch of
`tf_psx.data.criteo(path, ...)` before or after creating the LocalCluster
(in-process, or task processes with --processes), builds a small model from
the batch's shapes, and fits it on `criteo(...)` built inside a
DatasetCreator's dataset_fn. The peeked dataset is kept alive until after
fit, as a notebook keeps it. Prints

    RESULT steps=<optimizer steps> malformed=<count> by_file=<path>:<count>

and exits 0 when fit ran every step and the count is the number of bad
lines written; 1 when not. A hang (the bug this script guards against: a
from_generator dataset deadlocked the coordinator after fit, or at exit)
makes the watchdog print "Timeout" and every thread's stack to stderr, and
exit 1.
"""

import argparse
import faulthandler
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tf_psx  # noqa: E402  (routes tf.keras to tf-keras)
import tensorflow as tf  # noqa: E402

from tf_psx.data import CriteoStats, write_criteo_sample  # noqa: E402

ROWS = 200
BATCH = 16
VOCAB = 1000
EPOCHS, STEPS_PER_EPOCH = 2, 5
# Longer than a run takes on a loaded 2-core machine (15 to 40 s), shorter
# than the test's subprocess timeout, so that a hang leaves its stacks.
WATCHDOG_S = 200


def build_model(features):
    """Dense and categorical inputs shaped like the peeked batch; one logit."""
    dense = tf.keras.Input(features["dense"].shape[1:], dtype=features["dense"].dtype, name="dense")
    cat = tf.keras.Input(features["cat"].shape[1:], dtype=features["cat"].dtype, name="cat")
    vectors = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(VOCAB, 4, name="categories")(cat))
    joined = tf.keras.layers.Concatenate()([vectors, dense])
    click = tf.keras.layers.Dense(1, activation="sigmoid", name="click")(joined)
    return tf.keras.Model({"dense": dense, "cat": cat}, click)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--processes", action="store_true")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--order", choices=("before", "after"), default="after")
    parser.add_argument("--malformed", type=int, default=7, help="bad lines to write (7: the 4 kinds, 3 twice)")
    args = parser.parse_args()
    start = time.monotonic()
    path = write_criteo_sample(os.path.join(args.dir, "day_0.tsv"), ROWS, seed=0, malformed=args.malformed).path

    def peek():
        # What a user writes to learn the shapes; the dataset object stays alive.
        ds = tf_psx.data.criteo(path, BATCH, vocab_size=VOCAB)
        return ds, next(iter(ds))[0]

    if args.order == "before":
        peeked, features = peek()
    with tf_psx.LocalCluster(num_workers=args.workers, num_ps=1, processes=args.processes) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster)
        if args.order == "after":
            peeked, features = peek()
        with strategy.scope():
            model = build_model(features)
            model.compile(tf.keras.optimizers.Adagrad(0.05), "binary_crossentropy")
        stats = CriteoStats()

        def dataset_fn(input_context):
            return tf_psx.data.criteo(
                path, BATCH, vocab_size=VOCAB, repeat=True, shuffle_buffer=64, input_context=input_context, stats=stats
            )

        model.fit(
            tf.keras.utils.experimental.DatasetCreator(dataset_fn),
            epochs=EPOCHS,
            steps_per_epoch=STEPS_PER_EPOCH,
            verbose=0,
        )
        steps = int(model.optimizer.iterations.numpy())
        print(f"fit done in {time.monotonic() - start:.1f} s", flush=True)
    del peeked  # after the connection: its deletion must not reach the tasks
    by_file = ",".join(f"{p}:{n}" for p, n in stats.malformed_by_file.items())
    print(f"RESULT steps={steps} malformed={stats.malformed} by_file={by_file}", flush=True)
    ok = steps == EPOCHS * STEPS_PER_EPOCH and stats.malformed == args.malformed
    return 0 if ok else 1


if __name__ == "__main__":
    # Armed until the process ends, so that it also catches a hang at exit.
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    sys.exit(main())
