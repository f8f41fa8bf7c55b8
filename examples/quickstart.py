"""Quickstart: train a click model on a local parameter-server cluster.

Starts a LocalCluster (2 workers, 2 ps), or uses the launched cluster under
`tf-psx launch` (TF_CONFIG set), shards the embedding table over the ps
tasks, trains with `model.fit(x, y, epochs=...)` (each epoch trains every
example exactly once), and compares the holdout AUC with the best
AUC possible on the data (the planted model's), and the holdout log loss with
that of the best constant guess (the click rate). Exits 1 when the model does
not clearly beat chance.

`main()` returns the numbers as a dict; run as a script, the last line printed
is `RESULT {...}`, that dict as JSON (tests/test_examples.py reads it).

    python examples/quickstart.py [--epochs 8] [--processes]
    tf-psx launch --workers 2 --ps 1 -- python examples/quickstart.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # hide TF's C++ start-up chatter

import tf_psx  # routes tf.keras to tf-keras; import before using tf.keras
import tensorflow as tf

from tf_psx.data import describe_quality, holdout_quality, synthetic_ctr

# Fields and ids per field of the synthetic data; the table has 8 x 2,000 rows.
NUM_FIELDS = 8
VOCAB_SIZE = 2_000
NUM_EXAMPLES = 200_000
HOLDOUT_FRACTION = 0.2
BATCH_SIZE = 512
EMBED_DIM = 8
# "Clearly beats chance": a model that learned nothing scores 0.5 +- 0.01 here.
MIN_AUC = 0.6


def build_model(num_rows: int) -> tf.keras.Model:
    """An embedding + MLP click model over NUM_FIELDS categorical ids."""
    ids = tf.keras.Input(shape=(NUM_FIELDS,), dtype=tf.int64, name="ids")
    emb = tf.keras.layers.Embedding(num_rows, EMBED_DIM, name="embedding")(ids)
    hidden = tf.keras.layers.Dense(32, activation="relu")(tf.keras.layers.Flatten()(emb))
    click = tf.keras.layers.Dense(1, activation="sigmoid", name="click")(hidden)
    return tf.keras.Model(ids, click)



def main(argv: list[str] | None = None) -> dict:
    """Trains and evaluates; returns the holdout numbers (see the end of this function)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8, help="passes over the training rows (313 steps each)")
    parser.add_argument("--processes", action="store_true", help="run tasks as processes")
    args = parser.parse_args(argv)

    data = synthetic_ctr(NUM_EXAMPLES, NUM_FIELDS, VOCAB_SIZE, seed=0)
    train, holdout = data.split(HOLDOUT_FRACTION)
    start = time.time()
    # Alone: a LocalCluster; under `tf-psx launch` (TF_CONFIG set): the launched cluster.
    with tf_psx.launched_or(tf_psx.LocalCluster(num_workers=2, num_ps=2, processes=args.processes)) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
        with strategy.scope():
            model = build_model(data.num_rows)
            # Adagrad: its cost per step follows the rows touched (docs/benchmarks.md, vocab_scaling).
            model.compile(
                tf.keras.optimizers.Adagrad(0.05), "binary_crossentropy", steps_per_execution=10
            )

        # As without a strategy: each epoch is one shuffled pass, every example trained exactly once.
        history = model.fit(train.ids, train.labels, batch_size=BATCH_SIZE, epochs=args.epochs,
                            verbose=2 if not sys.stdout.isatty() else 1)
        scores = tf.reshape(model(holdout.ids, training=False), [-1]).numpy()
    result = {
        **holdout_quality(holdout.labels, scores, holdout.probs),
        "train_loss": history.history["loss"][-1],
        "seconds": time.time() - start,
    }
    print(describe_quality(result) + f"   ({result['seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    RESULT = main()
    print("RESULT " + json.dumps(RESULT), flush=True)
    if RESULT["auc"] < MIN_AUC:
        print(f"FAIL: AUC {RESULT['auc']:.4f} does not clearly beat chance (needs >= {MIN_AUC}).", file=sys.stderr)
        sys.exit(1)
