"""A notebook's sequence in one process: fit on 2 workers, then 3, then 2 again (each a new LocalCluster).

Prints what a user's cell output would show; tests/test_first_hours.py
counts its lines. Prints `RESULT {"fits": 3}` at the end.
"""

import json
import os
import sys

import numpy as np

import tf_psx  # noqa: F401  (routes tf.keras to tf-keras)
import tensorflow as tf

data = tf_psx.data.synthetic_ctr(4_096, num_fields=4, vocab_size=200, seed=0)
fits = 0
for workers in (2, 3, 2):
    with tf_psx.LocalCluster(num_workers=workers, num_ps=1, processes=True) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster)
        with strategy.scope():
            model = tf.keras.Sequential([
                tf.keras.Input((4,), dtype=tf.int64),
                tf.keras.layers.Embedding(data.num_rows, 4),
                tf.keras.layers.Flatten(),
                tf.keras.layers.Dense(1, activation="sigmoid"),
            ])
            model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy")
        history = model.fit(data.ids, data.labels, batch_size=256, epochs=1, verbose=2)
        assert np.isfinite(history.history["loss"][0])
        fits += 1
print("RESULT " + json.dumps({"fits": fits}), flush=True)
sys.stdout.flush()
os._exit(0)  # pylint: disable=protected-access  (skip TF's slow teardown of the cluster connection)
