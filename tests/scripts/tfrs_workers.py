"""TFRS's basic retrieval tutorial (FactorizedTopK over a candidates dataset: `Streaming`) with several async workers.

`Streaming` keeps a per-call row counter in a variable; with 2 workers on
one ps task, both steps reset and advance it at once (before tf_psx made it
per worker: "Requires start <= limit when delta > 0"). Fits `--epochs`
epochs on an in-process LocalCluster, evaluates, then evaluates the same
weights in one process (no strategy): evaluation of given weights is
deterministic, so the two must agree. Prints `RESULT {json}`.

Usage: tfrs_workers.py [--workers 2] [--epochs 2] [--movies 600]
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402  pylint: disable=wrong-import-position

import tf_psx  # noqa: E402  pylint: disable=wrong-import-position
import tensorflow as tf  # noqa: E402  pylint: disable=wrong-import-position
import tensorflow_recommenders as tfrs  # noqa: E402  pylint: disable=wrong-import-position


class RetrievalModel(tfrs.Model):
    """The tutorial's model: two StringLookup + Embedding towers, `tasks.Retrieval` with `FactorizedTopK`."""

    def __init__(self, users, titles, movies):
        super().__init__()
        self.user_model = tf.keras.Sequential([tf.keras.layers.StringLookup(vocabulary=users, mask_token=None),
                                               tf.keras.layers.Embedding(len(users) + 1, 16)])
        self.movie_model = tf.keras.Sequential([tf.keras.layers.StringLookup(vocabulary=titles, mask_token=None),
                                                tf.keras.layers.Embedding(len(titles) + 1, 16)])
        self.task = tfrs.tasks.Retrieval(metrics=tfrs.metrics.FactorizedTopK(
            candidates=movies.batch(128).map(self.movie_model)))

    def compute_loss(self, features, training=False):
        return self.task(self.user_model(features["user_id"]), self.movie_model(features["movie_title"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--movies", type=int, default=600)
    args = parser.parse_args()
    rng = np.random.default_rng(5)
    users = np.array([f"u{i}" for i in range(200)])
    titles = np.array([f"m{i}" for i in range(args.movies)])
    ratings = {"user_id": rng.choice(users, 4000), "movie_title": rng.choice(titles, 4000)}

    def build():
        # Datasets are made after the process connects to the cluster (one made before it cannot be iterated).
        model = RetrievalModel(users, titles, tf.data.Dataset.from_tensor_slices(titles))
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.1))
        data = tf.data.Dataset.from_tensor_slices(ratings)
        return model, data.take(3200).batch(128), data.skip(3200).batch(200)

    with tf_psx.LocalCluster(num_workers=args.workers, num_ps=1) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster)
        with strategy.scope():
            model, train, test = build()
        history = model.fit(train, epochs=args.epochs, verbose=0).history
        evaluated = model.evaluate(test, return_dict=True, verbose=0)
        weights = tf_psx.unsharded_weights(model)
        from tf_psx._tf.shadows import _PerWorkerHandle  # pylint: disable=import-outside-toplevel

        scratch = sorted({v.name for v in tf.Module._flatten(model, predicate=lambda v: isinstance(getattr(v, "_v", v), _PerWorkerHandle))})  # pylint: disable=protected-access
        local, _, test = build()  # no strategy (a process stays connected to its cluster: evaluated before it stops)
        local.user_model(users[:1])
        local.movie_model(titles[:1])
        local.set_weights(weights)
        local_evaluated = local.evaluate(test, return_dict=True, verbose=0)
    print("RESULT " + json.dumps({"history": {k: [float(x) for x in v] for k, v in history.items()},
                                  "evaluated": {k: float(v) for k, v in evaluated.items()},
                                  "local_evaluated": {k: float(v) for k, v in local_evaluated.items()},
                                  "per_worker": scratch}), flush=True)


if __name__ == "__main__":
    main()
