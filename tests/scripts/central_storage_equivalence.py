"""CentralStorageStrategy on 2 logical CPUs equals one device with the same global batch."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tf_psx  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

GLOBAL_BATCH = 64
rng = np.random.default_rng(0)
x = rng.normal(size=(GLOBAL_BATCH * 5, 6)).astype(np.float32)
y = (x @ rng.normal(size=(6, 1)) > 0).astype(np.float32)


def build():
    tf.keras.utils.set_random_seed(3)
    model = tf.keras.Sequential([tf.keras.Input((6,)), tf.keras.layers.Dense(8, activation="relu"), tf.keras.layers.Dense(1)])
    model.compile(tf.keras.optimizers.SGD(0.1), tf.keras.losses.BinaryCrossentropy(from_logits=True))
    return model


single = build()
initial = single.get_weights()
single.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)

strategy = tf_psx.CentralStorageStrategy(compute_devices=["/cpu:0", "/cpu:1"], parameter_device="/cpu:0")
with strategy.scope():
    central = build()
central.set_weights(initial)
central.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)

diff = max(float(np.max(np.abs(a - b))) for a, b in zip(single.get_weights(), central.get_weights()))
moved = max(float(np.max(np.abs(a - b))) for a, b in zip(initial, central.get_weights()))
print(f"replicas={strategy.num_replicas_in_sync} max_abs_diff={diff:.2e} moved={moved:.2e}")
sys.exit(0 if strategy.num_replicas_in_sync == 2 and diff < 1e-5 and moved > 1e-3 else 1)
