"""Holdout AUC with `wire_dtype="bfloat16"` against float32 rows and gradients, 3 seeds.

Planted logistic CTR (`tf_psx.data.synthetic_ctr`: 8 fields x 20,000 ids
per field, Zipf 1.05), 100k training and 20k holdout examples; a
FeatureEmbeddings of dim 8 (one feature per field) into a 64-32 MLP,
Adagrad 0.05, batch 256, 2 epochs; one process without a cluster (the casts
are the same ops on a ps task). Each (seed, wire) runs in a fresh process
with the same initial weights per seed. Target (issue: speed where CTR
models spend it): the AUC difference within the seed-to-seed spread.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FIELDS, VOCAB, TRAIN, HOLDOUT, DIM = 8, 20_000, 100_000, 20_000, 8
SEEDS = (0, 1, 2)


def child(wire: str, seed: str) -> None:
    import tf_psx  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    seed = int(seed)
    data = tf_psx.data.synthetic_ctr(TRAIN + HOLDOUT, FIELDS, VOCAB, seed=seed)
    train, holdout = data.split(HOLDOUT / (TRAIN + HOLDOUT))
    names = [f"f{i}" for i in range(FIELDS)]

    def features(ids):
        return {name: ids[:, i] - i * VOCAB for i, name in enumerate(names)}

    tf.keras.utils.set_random_seed(seed)
    inputs = {name: tf.keras.Input((), dtype=tf.int64, name=name) for name in names}
    layer = tf_psx.layers.FeatureEmbeddings({name: VOCAB for name in names}, DIM,
                                            wire_dtype=None if wire == "float32" else wire)
    out = layer(inputs)
    hidden = tf.keras.layers.Concatenate()([out[name] for name in names])
    for width in (64, 32):
        hidden = tf.keras.layers.Dense(width, activation="relu")(hidden)
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(hidden))
    model.compile(tf.keras.optimizers.Adagrad(0.05), "binary_crossentropy")
    model.fit(features(train.ids), train.labels, batch_size=256, epochs=2, verbose=0, shuffle=False)
    scores = model.predict(features(holdout.ids), batch_size=4096, verbose=0).ravel()
    print(json.dumps({"auc": tf_psx.data.roc_auc(holdout.labels, scores), "bayes_auc": holdout.bayes_auc}), flush=True)


def main() -> None:
    from _common import run_child, write_result  # pylint: disable=import-outside-toplevel

    runs = {wire: [run_child(__file__, wire, str(seed))["auc"] for seed in SEEDS] for wire in ("float32", "bfloat16")}
    diffs = [b - f for f, b in zip(runs["float32"], runs["bfloat16"])]
    spread = max(runs["float32"]) - min(runs["float32"])
    mean_diff = statistics.mean(diffs)
    write_result(
        "wire_dtype_quality",
        f"synthetic_ctr: {FIELDS} fields x {VOCAB:,} ids (Zipf 1.05), {TRAIN:,} training / {HOLDOUT:,} holdout examples; "
        f"FeatureEmbeddings dim {DIM} + MLP 64-32, Adagrad 0.05, batch 256, 2 epochs, one process; seeds {SEEDS}.",
        [
            {"metric": "float32 holdout AUC per seed", "value": ", ".join(f"{a:.4f}" for a in runs["float32"])},
            {"metric": "bfloat16 holdout AUC per seed", "value": ", ".join(f"{a:.4f}" for a in runs["bfloat16"])},
            {"metric": "bfloat16 - float32, mean of the seeds (per seed)",
             "value": f"{mean_diff:+.4f} ({', '.join(f'{d:+.4f}' for d in diffs)})"},
            {"metric": "seed-to-seed spread of float32 (max - min)", "value": round(spread, 4)},
            {"metric": "|mean difference| within the spread", "value": abs(mean_diff) <= spread, "target": "True",
             "ok": abs(mean_diff) <= spread},
        ],
        extra=runs,
    )


if __name__ == "__main__":
    from _common import entry  # pylint: disable=import-outside-toplevel

    entry(child, main, 2)
