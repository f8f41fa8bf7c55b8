"""Writes tests/data/tfra_snapshot/: a checkpoint of a TFRA-backed DynamicEmbedding model, for the restore test.

Run on the TFRA stack (TF 2.16.2 + TFRA 0.8.1): `.venv-tfra/bin/python tests/scripts/make_tfra_snapshot.py DIR`.
A 1-worker, 2-ps LocalCluster trains DynamicEmbedding(3, name="items", table="tfra") + Dense(1) with Adam
for 6 steps (TFRA saves one table per ps task: 2 shards of rows, of m and of v), then writes
`tf.train.Checkpoint(model=model, optimizer=model.optimizer)` to DIR/ckpt and, in DIR/expected.npz, the keys,
rows, m and v read from TFRA's tables and the Dense weights, which tests/layers/test_native_tables.py compares
a native table restored from it against.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tf_psx  # noqa: E402
import tensorflow as tf  # noqa: E402

KEYS = 10**12 + np.arange(24, dtype=np.int64) * 7919


def build():
    inputs = tf.keras.Input((4,), dtype=tf.int64)
    layer = tf_psx.layers.DynamicEmbedding(3, name="items", table="tfra", initializer="zeros")
    dense = tf.keras.layers.Dense(1, name="head", kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1))
    model = tf.keras.Model(inputs, dense(tf.keras.layers.Flatten()(layer(inputs))))
    model.compile(tf.keras.optimizers.Adam(0.05), "mse")
    return model, layer


def main(directory: str) -> int:
    rng = np.random.default_rng(3)
    ids = KEYS[rng.integers(0, len(KEYS), size=(48, 4))]
    labels = rng.normal(size=48).astype(np.float32)
    with tf_psx.LocalCluster(num_workers=1, num_ps=2) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster)
        with strategy.scope():
            model, layer = build()
        model.fit(tf.keras.utils.experimental.DatasetCreator(
            lambda _: tf.data.Dataset.from_tensor_slices((ids, labels)).batch(8).repeat()),
            epochs=1, steps_per_epoch=6, verbose=0)
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(os.path.join(directory, "ckpt"))
        keys, rows = layer.export()
        m, v = (s.lookup(tf.constant(keys)).numpy() for s in layer.table.get_slot_variables(model.optimizer))
        np.savez(os.path.join(directory, "expected.npz"), keys=keys, rows=rows, m=m, v=v,
                 kernel=model.get_layer("head").kernel.numpy(), bias=model.get_layer("head").bias.numpy(),
                 iterations=int(model.optimizer.iterations.numpy()))
        print(f"wrote {directory}: {len(keys)} keys, iterations {int(model.optimizer.iterations.numpy())}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
