"""save DIR PS POLICY: train a DynamicEmbedding model on 1 worker and PS ps tasks with
PeriodicSync; write the table's rows, Adagrad accumulators and counts to DIR/state.npz.
restore DIR PS POLICY: in a fresh process, on PS ps tasks, fit with PeriodicSync(DIR):
right after the restore, the rows, accumulators and counts must equal the saved ones.

POLICY is "none" (no admission or eviction), "admit" (min_count=2, max_rows=10_000), or "native" (no policy,
on tf_psx's own tables: `table="native"`).
OPTIMIZER (optional) is "adagrad" (the default) or "adam"; the restore reports the table's
step counters after its 6 steps (Adam's bias correction counts the steps of each shard).
Prints `RESULT {json}`.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tf_psx  # noqa: E402
import tensorflow as tf  # noqa: E402

MIN_COUNT = 2
STEPS = 6
mode, directory, num_ps, policy = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
optimizer_name = sys.argv[5] if len(sys.argv) > 5 else "adagrad"
rng = np.random.default_rng(0)
vocab = (10**12 + rng.choice(10**9, size=300, replace=False)).astype(np.int64)
# Zipf-like: many keys seen once (never admitted with min_count=2).
keys = vocab[np.minimum(rng.zipf(1.3, size=(STEPS * 32, 4)) - 1, len(vocab) - 1)]
labels = (keys[:, 0] % 2).astype(np.float32)


def build(strategy):
    kwargs = {"min_count": MIN_COUNT, "max_rows": 10_000} if policy == "admit" else {}
    kwargs["table"] = "native" if policy == "native" else "tfra"
    with strategy.scope():
        inputs = tf.keras.Input((4,), dtype=tf.int64)
        layer = tf_psx.layers.DynamicEmbedding(3, name="items", **kwargs)
        out = tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Flatten()(layer(inputs)))
        model = tf.keras.Model(inputs, out)
        optimizer = tf.keras.optimizers.Adam(0.01) if optimizer_name == "adam" else tf.keras.optimizers.Adagrad(0.1)
        model.compile(optimizer, "binary_crossentropy")
    return model, layer


def state(model, layer):
    if policy == "native":
        stored, values = layer.native_table.export()
        exists = np.isin(vocab, stored)
        full = np.zeros([len(vocab), values.shape[1]], np.float32)
        full[exists] = values[np.searchsorted(stored, vocab[exists])]
        return {"rows": full[:, :3], "exists": exists, "accumulators": full[:, 3:-tf_psx.tables.native.BOOKKEEPING], "counts": np.zeros(0, np.int64),
                "size": np.int64(layer.size())}
    rows = layer.table.lookup(tf.constant(vocab)).numpy()
    _, exists = layer.table.lookup(tf.constant(vocab), return_exists=True)
    slots = tf_psx.tables.slot_tables(layer)
    accumulators = slots[0].lookup(tf.constant(vocab)).numpy() if slots else np.zeros(0)
    counts = layer.policy.counts(vocab) if layer.policy is not None else np.zeros(0, np.int64)
    return {"rows": rows, "exists": exists.numpy(), "accumulators": accumulators, "counts": counts,
            "size": np.int64(layer.size())}


def dataset(_ctx=None):
    return tf.data.Dataset.from_tensor_slices((keys, labels)).batch(32).repeat()


class Capture(tf.keras.callbacks.Callback):
    def __init__(self, layer):
        super().__init__()
        self.layer, self.state = layer, None

    def on_train_begin(self, logs=None):
        self.state = state(self.model, self.layer)


def _table_steps(model, layer) -> dict:
    if policy == "native":
        steps = tf_psx.tables.updates.shard_steps(model.optimizer, layer.native_table)
        return {f"shard_{index}": value for index, value in enumerate(steps or [])}
    return {name: int(counter.numpy()) for name, counter in model.optimizer._tf_psx_local_steps.items()
            if name in tf_psx.tables.tfra_updates.counter_names(layer.table)}


with tf_psx.LocalCluster(num_workers=1, num_ps=num_ps) as cluster:
    strategy = tf_psx.ParameterServerStrategy(cluster)
    model, layer = build(strategy)
    data = tf.keras.utils.experimental.DatasetCreator(dataset)
    sync = tf_psx.callbacks.PeriodicSync(every_n_steps=STEPS, directory=directory)
    if mode == "save":
        model.fit(data, epochs=1, steps_per_epoch=STEPS, verbose=0, callbacks=[sync])
        saved = state(model, layer)
        np.savez(os.path.join(directory, "state.npz"), **saved)
        print("RESULT " + json.dumps({"size": int(saved["size"]), "ps": num_ps, "policy": policy}))
        sys.exit(0)
    capture = Capture(layer)
    model.fit(data, epochs=2, steps_per_epoch=STEPS, verbose=0, callbacks=[sync, capture])
    saved = np.load(os.path.join(directory, "state.npz"))
    got = capture.state
    result = {
        "restored_step": sync.restored.step if sync.restored else None,
        "size_saved": int(saved["size"]), "size_restored": int(got["size"]),
        "exists_equal": bool(np.array_equal(saved["exists"], got["exists"])),
        "rows_max_diff": float(np.abs(saved["rows"][saved["exists"]] - got["rows"][got["exists"]]).max())
        if np.array_equal(saved["exists"], got["exists"]) else None,
        "accumulators_equal": bool(saved["accumulators"].shape == got["accumulators"].shape
                                   and np.allclose(saved["accumulators"][saved["exists"]],
                                                   got["accumulators"][got["exists"]])),
        "counts": got["counts"].tolist()[:5],
        "counts_equal_saved": bool(np.array_equal(saved["counts"], got["counts"])),
        "counts_seeded": bool(len(got["counts"]) and np.all(got["counts"][got["exists"]] == MIN_COUNT)),
        "ps_saved": None, "ps": num_ps, "policy": policy,
        # The table's step counters made by the updates (per shard, or the whole table's), by name.
        "table_steps": _table_steps(model, layer),
    }
    print("RESULT " + json.dumps(result))
