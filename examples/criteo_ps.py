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
  script loads it in a fresh Python process (no cluster, no tf_psx) and
  checks that it predicts what the trained model predicts.

Two workers by default: their asynchronous updates of the hash table are
exact (tf_psx/training/exact_updates.py): one worker's update of a row never
overwrites another's.

On 200 rows this is a smoke run, not a benchmark: the loss and AUC it
reports are measured on the rows it trained on. Exits 1 when the served
predictions differ from the model's.

`main()` returns the numbers as a dict; run as a script, the last line printed
is `RESULT {...}`, that dict as JSON (tests/test_examples.py reads it).

    python examples/criteo_ps.py [--out DIR] [--steps 60] [--workers 2] [--data FILE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # hide TF's C++ start-up chatter

import numpy as np
import tf_psx  # routes tf.keras to tf-keras; import before using tf.keras
import tensorflow as tf

from tf_psx.callbacks import ClusterMonitor, PeriodicSync, StalenessBound
from tf_psx.data import CriteoStats, criteo, criteo_dataset_fn, holdout_quality, write_criteo_sample
from tf_psx.data.layout import NUM_CATEGORICAL, NUM_DENSE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Real Criteo rows (non-commercial licence, see examples/data/README.md): an
# optional input; by default the example generates GENERATED_ROWS rows, as many.
REAL_SAMPLE = os.path.join(REPO, "examples", "data", "criteo_kaggle_sample.tsv")
GENERATED_ROWS = 200
BATCH_SIZE = 32  # per worker
EMBED_DIM = 8
# Several workers, as a real job has; their table updates are exact.
DEFAULT_WORKERS = 2
# The trained and the served model are compared on the first EVAL_ROWS rows
# of the data: every row of the generated sample.
EVAL_ROWS = 256
# The served model runs the same float32 graph on the same values.
SERVING_TOLERANCE = 1e-5

# Run in a fresh Python: loads the SavedModel with TensorFlow alone and writes
# its predictions for the features in FEATURES_NPZ to OUT_NPY.
SERVE_SCRIPT = """
import sys
import numpy as np
import tensorflow as tf
path, features_npz, out_npy = sys.argv[1:]
features = {name: tf.constant(value) for name, value in np.load(features_npz).items()}
np.save(out_npy, tf.saved_model.load(path).signatures["serving_default"](**features)["click"].numpy())
"""


def build_model() -> tf.keras.Model:
    """26 categorical keys through a DynamicEmbedding, 13 dense values, an MLP."""
    dense = tf.keras.Input((NUM_DENSE,), dtype=tf.float32, name="dense")
    cat = tf.keras.Input((NUM_CATEGORICAL,), dtype=tf.int64, name="cat")
    vectors = tf_psx.layers.DynamicEmbedding(EMBED_DIM, name="categories")(cat)
    joined = tf.keras.layers.Concatenate()([tf.keras.layers.Flatten()(vectors), dense])
    hidden = tf.keras.layers.Dense(32, activation="relu", name="hidden")(joined)
    click = tf.keras.layers.Dense(1, activation="sigmoid", name="click")(hidden)
    return tf.keras.Model({"dense": dense, "cat": cat}, click)



def serve_in_fresh_process(path: str, features: dict, scratch: str) -> np.ndarray:
    """The SavedModel's predictions [rows, 1], computed by a Python with no cluster and no tf_psx.

    `features` ({"dense": [rows, 13], "cat": [rows, 26]}) and the predictions
    pass through files in `scratch`.
    """
    features_npz, out_npy = os.path.join(scratch, "serve_features.npz"), os.path.join(scratch, "served.npy")
    np.savez(features_npz, **{name: value.numpy() for name, value in features.items()})
    subprocess.run([sys.executable, "-c", SERVE_SCRIPT, path, features_npz, out_npy], check=True)
    return np.load(out_npy)


def main(argv: list[str] | None = None) -> dict:
    """Trains, snapshots, monitors and exports; returns the numbers (see the end of this function)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", default=None,
                        help=f"Criteo files (TSV or CSV with header), e.g. {REAL_SAMPLE}; "
                             f"default: {GENERATED_ROWS} generated rows")
    parser.add_argument("--out", default=None, help="snapshots, logs and the export go here (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=60, help="training steps in all")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=20, help="steps between snapshots")
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="worker tasks")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="criteo_ps-")
    start = time.time()
    bayes_auc = None  # known for generated rows only
    if args.data is None:
        generated = os.path.join(tempfile.mkdtemp(prefix="criteo_ps-data-"), "criteo_generated.tsv")
        sample = write_criteo_sample(generated, GENERATED_ROWS, seed=0)
        args.data, bayes_auc = [sample.path], sample.bayes_auc
        print(f"input: {GENERATED_ROWS} generated Criteo rows in {generated} (real rows: --data {REAL_SAMPLE})")

    # Checked here, before any server starts: a missing file fails at once.
    dataset_fn = criteo_dataset_fn(args.data, BATCH_SIZE, repeat=True, shuffle_buffer=1_000, seed=0)

    # Task processes: the ps memory shows in ClusterMonitor, and the example
    # runs as a real job would (an in-process cluster also works).
    # Alone: a LocalCluster; under `tf-psx launch` (TF_CONFIG set): the launched cluster.
    with tf_psx.launched_or(tf_psx.LocalCluster(num_workers=args.workers, num_ps=2, processes=True)) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
        with strategy.scope():
            model = build_model()
            # Adagrad: its cost per step follows the rows touched (docs/benchmarks.md, vocab_scaling).
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
        snapshots = [snapshot.step for snapshot in PeriodicSync.snapshots(os.path.join(out, "snapshots"))]
        keys = int(model.get_layer("categories").size())
        print(f"training loss {history.history['loss'][-1]:.4f}   staleness max "
              f"{max(history.history['staleness_max'])}   dropped gradients {sum(history.history['dropped_gradients'])}")
        print(f"snapshots at steps {snapshots}")
        print(f"monitor: {monitor.last_values.get('throughput/examples_per_sec', 0):.0f} examples/s; "
              f"TensorBoard: tensorboard --logdir {os.path.join(out, 'logs')}")
        print(f"category keys learned: {keys}")

        path = tf_psx.export_serving(model, os.path.join(out, "serving"), overwrite=True)
        # The first rows of the data, in the file's order, to compare both models on.
        features, labels = next(iter(criteo(args.data, EVAL_ROWS, stats=CriteoStats())))
        trained = model(features, training=False).numpy()

    served = serve_in_fresh_process(path, features, out)
    labels = labels.numpy()
    # Measured on rows the model trained on: a smoke test of learning, not a holdout score.
    quality = holdout_quality(labels, trained)
    result = {
        "data": args.data,
        "workers": args.workers,
        "train_loss": history.history["loss"][-1],
        "train_auc": quality["auc"],
        "train_log_loss": quality["log_loss"],
        "base_rate_log_loss": quality["base_rate_log_loss"],
        "bayes_auc": bayes_auc,
        "staleness_max": max(history.history["staleness_max"]),
        "dropped_gradients": sum(history.history["dropped_gradients"]),
        "restored_step": None if sync.restored is None else sync.restored.step,
        "snapshots": snapshots,
        "keys_learned": keys,
        "export_max_diff": float(np.abs(served - trained).max()),
        "export_path": path,
        "seconds": time.time() - start,
    }
    print(f"on the {len(labels)} rows it trained on: AUC {result['train_auc']:.4f}, log loss "
          f"{result['train_log_loss']:.4f} (click rate alone {result['base_rate_log_loss']:.4f})")
    print(f"exported to {path}; served vs trained predictions: max difference {result['export_max_diff']:.2e}   "
          f"({result['seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    RESULT = main()
    print("RESULT " + json.dumps(RESULT), flush=True)
    if RESULT["export_max_diff"] > SERVING_TOLERANCE:
        print(f"FAIL: the served model differs from the trained one by {RESULT['export_max_diff']} "
              f"(> {SERVING_TOLERANCE}).", file=sys.stderr)
        sys.exit(1)
