"""Criteo clicks on a parameter-server cluster, from the log file to a served model.

The whole production path on a small sample: by default 200 rows generated
in the Criteo Display Advertising layout from a planted model
(`tf_psx.data.write_criteo_sample`, written to a temp dir); give real files
with --data, e.g. the 200 real rows of examples/data/criteo_kaggle_sample.tsv:

* `tf_psx.data.criteo_dataset_fn` streams the files; each worker reads its
  own share, dense counts get log1p, categoricals become salted int64 keys;
* a `DynamicEmbedding` (a hash table on the ps tasks) learns one row per
  category value seen, with no vocabulary to build;
* `StalenessBound` measures how stale each asynchronous gradient is and
  drops the ones older than --max-staleness updates;
* `PeriodicSync` writes an atomic snapshot every --sync-every steps (run the
  script again with the same --out and fit resumes from the newest one);
* `ClusterMonitor` writes TensorBoard scalars (throughput, bytes per ps
  task, staleness) to <out>/logs;
* `export_serving` writes a SavedModel that serves with no cluster; the
  script loads it and checks it predicts what the trained model predicts.

On 200 rows this is a smoke run, not a benchmark: the loss it reports is the
training loss. Exits 1 when the served predictions differ from the model's.

    python examples/criteo_ps.py [--out DIR] [--steps 60] [--data FILE ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # hide TF's C++ start-up chatter

import numpy as np
import tf_psx  # routes tf.keras to tf-keras; import before using tf.keras
import tensorflow as tf

from tf_psx.callbacks import ClusterMonitor, PeriodicSync, StalenessBound
from tf_psx.data import CriteoStats, criteo, criteo_dataset_fn, write_criteo_sample
from tf_psx.data.criteo import NUM_CATEGORICAL, NUM_DENSE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Real Criteo rows (non-commercial licence, see examples/data/README.md): an
# optional input; by default the example generates GENERATED_ROWS rows, as many.
REAL_SAMPLE = os.path.join(REPO, "examples", "data", "criteo_kaggle_sample.tsv")
GENERATED_ROWS = 200
BATCH_SIZE = 32  # per worker
EMBED_DIM = 8
# The served model runs the same float32 graph on the same values.
SERVING_TOLERANCE = 1e-5


def build_model() -> tf.keras.Model:
    """26 categorical keys through a DynamicEmbedding, 13 dense values, an MLP."""
    dense = tf.keras.Input((NUM_DENSE,), dtype=tf.float32, name="dense")
    cat = tf.keras.Input((NUM_CATEGORICAL,), dtype=tf.int64, name="cat")
    vectors = tf_psx.layers.DynamicEmbedding(EMBED_DIM, name="categories")(cat)
    joined = tf.keras.layers.Concatenate()([tf.keras.layers.Flatten()(vectors), dense])
    hidden = tf.keras.layers.Dense(32, activation="relu", name="hidden")(joined)
    click = tf.keras.layers.Dense(1, activation="sigmoid", name="click")(hidden)
    return tf.keras.Model({"dense": dense, "cat": cat}, click)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", default=None,
                        help=f"Criteo files (TSV or CSV with header), e.g. {REAL_SAMPLE}; "
                             f"default: {GENERATED_ROWS} generated rows")
    parser.add_argument("--out", default=None, help="snapshots, logs and the export go here (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=60, help="training steps in all")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=20, help="steps between snapshots")
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1, help="worker tasks (see the DynamicEmbedding docstring on several workers)")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="criteo_ps-")
    start = time.time()
    if args.data is None:
        generated = os.path.join(tempfile.mkdtemp(prefix="criteo_ps-data-"), "criteo_generated.tsv")
        args.data = [write_criteo_sample(generated, GENERATED_ROWS, seed=0).path]
        print(f"input: {GENERATED_ROWS} generated Criteo rows in {generated} (real rows: --data {REAL_SAMPLE})")

    # Checked here, before any server starts: a missing file fails at once.
    dataset_fn = criteo_dataset_fn(args.data, BATCH_SIZE, repeat=True, shuffle_buffer=1_000, seed=0)

    # Task processes: the ps memory shows in ClusterMonitor, and the example
    # runs as a real job would (an in-process cluster also works).
    with tf_psx.LocalCluster(num_workers=args.workers, num_ps=2, processes=True) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
        with strategy.scope():
            model = build_model()
            # Adagrad: its cost per step follows the rows touched (DESIGN.md).
            model.compile(tf.keras.optimizers.Adagrad(0.05), "binary_crossentropy")

        sync = PeriodicSync(every_n_steps=args.sync_every, directory=os.path.join(out, "snapshots"))
        monitor = ClusterMonitor(os.path.join(out, "logs"), every_n_steps=10, cluster=cluster)
        bound = StalenessBound(max_staleness=args.max_staleness, policy="drop")
        history = model.fit(
            tf.keras.utils.experimental.DatasetCreator(dataset_fn),
            epochs=args.epochs,
            steps_per_epoch=max(1, args.steps // args.epochs),
            callbacks=[bound, sync, monitor],
            verbose=2 if not sys.stdout.isatty() else 1,
        )
        if sync.restored is not None:
            print(f"resumed from the snapshot of step {sync.restored.step}")
        print(f"training loss {history.history['loss'][-1]:.4f}   staleness max "
              f"{max(history.history['staleness_max'])}   dropped gradients {sum(history.history['dropped_gradients'])}")
        print(f"snapshots at steps {[s.step for s in PeriodicSync.snapshots(os.path.join(out, 'snapshots'))]}")
        print(f"monitor: {monitor.last_values.get('throughput/examples_per_sec', 0):.0f} examples/s; "
              f"TensorBoard: tensorboard --logdir {os.path.join(out, 'logs')}")
        print(f"category keys learned: {model.get_layer('categories').size()}")

        path = tf_psx.export_serving(model, os.path.join(out, "serving"), overwrite=True)
        # One batch of the data, in the file's order, to compare both models on.
        features, _ = next(iter(criteo(args.data, 64, stats=CriteoStats())))
        trained = model(features, training=False).numpy()

    served = tf.saved_model.load(path).signatures["serving_default"](**features)["click"].numpy()
    gap = float(np.abs(served - trained).max())
    print(f"exported to {path}; served vs trained predictions: max difference {gap:.2e}   "
          f"({time.time() - start:.0f} s)")
    if gap > SERVING_TOLERANCE:
        print(f"FAIL: the served model differs from the trained one by {gap} (> {SERVING_TOLERANCE}).",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
