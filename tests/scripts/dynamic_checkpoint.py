"""save DIR [STORE]: train a DynamicEmbedding model with Adam and checkpoint it (tables + slots).
restore DIR [STORE]: build the same model in a fresh process, restore, compare rows and slots.

STORE: the layer's `table` ("tfra" by default; "native": tf_psx's own tables, whose one value per key
holds the row, both Adam slots and the bookkeeping)."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tf_psx  # noqa: E402
import tensorflow as tf  # noqa: E402

mode, directory = sys.argv[1], sys.argv[2]
store = sys.argv[3] if len(sys.argv) > 3 else "tfra"
rng = np.random.default_rng(0)
vocab = (10**12 + rng.choice(10**9, size=40, replace=False)).astype(np.int64)
keys = vocab[rng.integers(0, 40, size=(256, 5))]
keys[:40, 0] = vocab  # every key is trained at least once
labels = (keys[:, 1] % 2).astype(np.float32)

inputs = tf.keras.Input((5,), dtype=tf.int64)
layer = tf_psx.layers.DynamicEmbedding(4, name="items", table=store)
model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Flatten()(layer(inputs))))
model.compile(tf.keras.optimizers.Adam(0.05), "binary_crossentropy")
checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)


def state():
    if store == "native":
        keys, values = layer.native_table.export()
        assert np.array_equal(keys, np.sort(vocab))
        return [values[:, :4], values[:, 4:8], values[:, 8:12]]  # the row, Adam's m and v
    rows = layer.table.lookup(tf.constant(vocab)).numpy()
    slots = [s.lookup(tf.constant(vocab)).numpy() for s in layer.table.get_slot_variables(model.optimizer)]
    return [rows] + slots


if mode == "save":
    model.fit(keys, labels, batch_size=32, epochs=2, verbose=0)
    checkpoint.save(os.path.join(directory, "ckpt"))
    np.savez(os.path.join(directory, "state.npz"), *state())
    print(f"saved {layer.size()} keys")
    sys.exit(0)
model.fit(keys[:32], labels[:32], batch_size=32, epochs=1, verbose=0)  # build the optimizer's slots
checkpoint.restore(tf.train.latest_checkpoint(directory))
saved = np.load(os.path.join(directory, "state.npz"))
want = [saved[f"arr_{i}"] for i in range(len(saved.files))]
got = state()
ok = len(got) == len(want) == 3 and all(np.allclose(g, w) for g, w in zip(got, want)) and layer.size() == 40
ok = ok and all(np.abs(w).sum() > 0 for w in want)
print(f"rows, m and v restored: {layer.size()} keys" if ok else f"mismatch: sizes {layer.size()}")
sys.exit(0 if ok else 1)
