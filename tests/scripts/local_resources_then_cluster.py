"""A TFRA model built before the cluster: the strategy must refuse at once, not hang."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tf_psx  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow_recommenders_addons import dynamic_embedding as de  # noqa: E402

inputs = tf.keras.Input((4,), dtype=tf.int64)
local = tf.keras.Model(inputs, de.keras.layers.Embedding(4)(inputs))
local(tf.constant([[1, 2, 3, 4]], dtype=tf.int64))  # the notebook user's "try it locally first"

with tf_psx.LocalCluster(num_workers=1, num_ps=1) as cluster:
    try:
        tf_psx.ParameterServerStrategy(cluster)
    except tf_psx.LocalResourcesError as err:
        text = str(err)
        ok = "restart the kernel" in text and "before building any model" in text
        print(f"clear error: {text}" if ok else f"unclear error: {text}", flush=True)
        os._exit(0 if ok else 1)  # in-process servers cannot be stopped; skip their teardown
print("no error raised", flush=True)
os._exit(1)
