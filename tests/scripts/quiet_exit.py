"""The short scripts a newcomer writes, for their line counts (tests/test_first_hours.py).

`imported_first`: imports TensorFlow before tf_psx (as most scripts do),
trains on an in-process LocalCluster(2, 1) for 2 epochs with
validation_split and evaluates. `processes`: trains inside
`with LocalCluster(num_workers=1, num_ps=2, processes=True)` and exits
normally. Both print one RESULT line last.
"""

import sys

import tensorflow as tf  # noqa: I001  (imported first on purpose)
import numpy as np
import tf_psx

mode = sys.argv[1]
cluster = (tf_psx.LocalCluster(num_workers=2, num_ps=1) if mode == "imported_first"
           else tf_psx.LocalCluster(num_workers=1, num_ps=2, processes=True))
rng = np.random.default_rng(0)
ids, labels = rng.integers(0, 100, (2000, 4)), rng.integers(0, 2, (2000, 1)).astype("float32")
with cluster:
    strategy = tf_psx.ParameterServerStrategy(cluster)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((4,), dtype="int64"), tf.keras.layers.Embedding(100, 4),
                                     tf.keras.layers.Flatten(), tf.keras.layers.Dense(1, activation="sigmoid")])
        model.compile("adagrad", "binary_crossentropy", steps_per_execution=5)
    model.fit(ids, labels, batch_size=100, epochs=2, validation_split=0.2, verbose=2)
    loss = model.evaluate(ids, labels, batch_size=100, verbose=0)
print("RESULT", {"loss": round(float(loss), 4)}, flush=True)
