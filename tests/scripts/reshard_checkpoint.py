"""save DIR NUM_PS: train a ShardedEmbedding on NUM_PS ps, checkpoint it, keep its lookups.
restore DIR NUM_PS: restore that checkpoint on NUM_PS ps and compare the lookups."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tf_psx  # noqa: E402
import tensorflow as tf  # noqa: E402

mode, directory, num_ps = sys.argv[1], sys.argv[2], int(sys.argv[3])
ROWS, DIM = 1001, 3  # an odd size: the shards differ in length
ids = np.random.default_rng(0).integers(0, ROWS, size=(64, 5))

cluster = tf_psx.LocalCluster(num_workers=1, num_ps=num_ps).start()
strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="per_ps")
with strategy.scope():
    layer = tf_psx.layers.ShardedEmbedding(ROWS, DIM)
    inputs = tf.keras.Input((5,), dtype=tf.int64)
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(layer(inputs))))
    model.compile("adam", "mse")
assert layer.num_shards() == num_ps, layer.num_shards()
checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
if mode == "save":
    data = tf.keras.utils.experimental.DatasetCreator(
        lambda ctx: tf.data.Dataset.from_tensor_slices((ids, np.ones(64, np.float32))).repeat().batch(16))
    model.fit(data, epochs=1, steps_per_epoch=8, verbose=0)
    checkpoint.save(os.path.join(directory, "ckpt"))
    np.save(os.path.join(directory, "lookups.npy"), layer(tf.constant(ids)).numpy())
    print(f"saved with shards={num_ps}")
    os._exit(0)
checkpoint.restore(tf.train.latest_checkpoint(directory)).assert_existing_objects_matched()
want = np.load(os.path.join(directory, "lookups.npy"))
got = layer(tf.constant(ids)).numpy()
same = np.array_equal(got, want) and not np.allclose(want, 0)
print(f"shards={num_ps} identical lookups" if same else f"shards={num_ps} lookups differ: {np.abs(got - want).max()}")
os._exit(0 if same else 1)
