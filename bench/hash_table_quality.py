"""Holdout AUC of a DynamicEmbedding with admission and a row budget, against neither.

Planted logistic CTR (`tf_psx.data.synthetic_ctr`: 8 fields x 200k ids per
field, Zipf 1.05, so most ids are rare), 150k training examples, 30k
holdout; logistic regression (a dim-1 DynamicEmbedding summed over the
fields, plus a bias), Adagrad 0.1, batch 256, 1 epoch, one process with no
cluster (the policies do not depend on the cluster). Variants: no policy;
`min_count=2`; `max_rows` = a quarter of the distinct training keys with
eviction (`TableEviction`) every 100 steps; both. Each variant runs with 2
data seeds in fresh processes; the difference to "none" is per seed, then
averaged.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FIELDS, VOCAB, TRAIN, HOLDOUT = 8, 200_000, 150_000, 30_000
BATCH, EPOCHS, LEARNING_RATE = 256, 1, 0.1
SEEDS = (0, 1)
VARIANTS = ("none", "min_count_2", "budget", "both")


def _data(seed: int):
    from tf_psx.data import synthetic_ctr  # pylint: disable=import-outside-toplevel

    return synthetic_ctr(TRAIN + HOLDOUT, FIELDS, VOCAB, seed=seed).split(HOLDOUT / (TRAIN + HOLDOUT))


def child(variant: str, seed: str) -> None:
    import numpy as np  # pylint: disable=import-outside-toplevel

    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    train, holdout = _data(int(seed))
    distinct = int(len(np.unique(train.ids)))
    budget = distinct // 4
    policy = {"none": {}, "min_count_2": {"min_count": 2}, "budget": {"max_rows": budget},
              "both": {"min_count": 2, "max_rows": budget}}[variant]
    tf.keras.utils.set_random_seed(int(seed))
    inputs = tf.keras.Input((FIELDS,), dtype=tf.int64)
    layer = tf_psx.layers.DynamicEmbedding(1, initializer="zeros", name="ids", **policy)
    logit = tf.keras.layers.Dense(1, kernel_initializer="ones", trainable=True)(
        tf.keras.layers.Lambda(lambda rows: tf.reduce_sum(rows, axis=1))(layer(inputs)))
    model = tf.keras.Model(inputs, tf.keras.layers.Activation("sigmoid")(logit))
    model.compile(tf.keras.optimizers.Adagrad(LEARNING_RATE), "binary_crossentropy")
    callbacks = [tf_psx.callbacks.TableEviction(every_n_steps=100)] if "max_rows" in policy else []
    model.fit(train.ids, train.labels, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=True, callbacks=callbacks)
    scores = model.predict(holdout.ids, batch_size=4096, verbose=0).ravel()
    auc = tf_psx.data.roc_auc(holdout.labels, scores)
    print(json.dumps({"auc": auc, "bayes_auc": holdout.bayes_auc, "rows": layer.size(), "distinct": distinct,
                      "budget": budget if "max_rows" in policy else None}), flush=True)


def main() -> None:
    from _common import run_child, write_result  # pylint: disable=import-outside-toplevel

    runs = {variant: [run_child(__file__, variant, str(seed)) for seed in SEEDS] for variant in VARIANTS}
    rows = []
    for variant in VARIANTS:
        aucs = [run["auc"] for run in runs[variant]]
        diffs = [run["auc"] - base["auc"] for run, base in zip(runs[variant], runs["none"])]
        rows.append({"metric": f"{variant}: holdout AUC (mean of {len(SEEDS)} seeds)", "value": round(statistics.mean(aucs), 4)})
        if variant != "none":
            rows.append({"metric": f"{variant}: AUC - none (per seed: {', '.join(f'{d:+.4f}' for d in diffs)})",
                         "value": round(statistics.mean(diffs), 4)})
        rows.append({"metric": f"{variant}: rows in the table at the end (mean)",
                     "value": round(statistics.mean(run["rows"] for run in runs[variant]))})
    rows.append({"metric": "Bayes AUC of the holdout (mean)",
                 "value": round(statistics.mean(run["bayes_auc"] for run in runs["none"]), 4)})
    print(json.dumps(runs, indent=1))
    write_result(
        "hash_table_quality",
        f"synthetic_ctr: {FIELDS} fields x {VOCAB:,} ids (Zipf 1.05), {TRAIN:,} training / {HOLDOUT:,} holdout "
        f"examples; logistic regression on a dim-1 DynamicEmbedding, Adagrad {LEARNING_RATE}, batch {BATCH}, "
        f"{EPOCHS} epochs, one process without a cluster; budget = max_rows of a quarter of the distinct "
        f"training keys ({runs['none'][0]['distinct']:,} for seed 0), evicted every 100 steps; seeds {SEEDS}.",
        rows,
        extra=runs,
    )


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 2)
