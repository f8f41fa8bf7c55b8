"""PeriodicSync resume: full | interrupt | resume, MODE DIR OUT.npz.

A 1-worker cluster trains 100 steps (5 epochs of 20, steps_per_execution=5)
of a model with a DynamicEmbedding table, a plain Embedding and Adam. Batch k
is a pure function of k, so a resumed run that starts at step s reads the same
batches as an uninterrupted one if it skips s batches.

* full: no callback, 100 steps; saves the final weights.
* interrupt: PeriodicSync every 20 steps; the process dies (os._exit) at step 70.
* resume: same fit with PeriodicSync; it must restore step 60 and run 40 steps.

A fourth argument, STORE, is the DynamicEmbedding's `table` ("tfra" by default; "native": tf_psx's own
tables, whose saved arrays are each key's whole value: row, Adam's slots and the bookkeeping).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tf_psx  # noqa: E402
import tensorflow as tf  # noqa: E402
from step_counter import StepCounter  # noqa: E402
from tf_psx._tf import tfra as _tfra  # noqa: E402

mode, directory, out = sys.argv[1], sys.argv[2], sys.argv[3]
store = sys.argv[4] if len(sys.argv) > 4 else "tfra"
EPOCHS, STEPS, EVERY, KILL_AT, BATCH, FIELDS, SPE = 5, 20, 20, 70, 16, 4, 5
KEYS = 10**12 + np.arange(50, dtype=np.int64) * 7919


def batch(k):
    # Batch k from a stateless RNG seeded by k: the same in every process.
    ids = tf.random.stateless_uniform([BATCH, FIELDS], seed=tf.stack([k, 7]), maxval=50, dtype=tf.int64)
    keys = tf.gather(tf.constant(KEYS), ids)
    labels = tf.cast(tf.math.floormod(ids[:, 0] + ids[:, 1], 2), tf.float32)
    return {"ids": ids, "keys": keys}, labels


def crash_at_kill_step(step, model):
    del model
    if mode == "interrupt" and step >= KILL_AT:
        print(f"killed at step {step}", flush=True)
        os._exit(3)  # a crash: no cleanup, no on_train_end


with tf_psx.LocalCluster(num_workers=1, num_ps=2) as cluster:
    strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
    with strategy.scope():
        ids = tf.keras.Input((FIELDS,), dtype=tf.int64, name="ids")
        keys = tf.keras.Input((FIELDS,), dtype=tf.int64, name="keys")
        static = tf.keras.layers.Embedding(
            50, 4, embeddings_initializer=tf.keras.initializers.RandomUniform(-0.1, 0.1, seed=1), name="static")(ids)
        dynamic = tf_psx.layers.DynamicEmbedding(
            4, initializer=tf.keras.initializers.Constant(0.05), name="dynamic", table=store)(keys)
        hidden = tf.keras.layers.Concatenate()([tf.keras.layers.Flatten()(static), tf.keras.layers.Flatten()(dynamic)])
        output = tf.keras.layers.Dense(1, activation="sigmoid",
                                       kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))(hidden)
        model = tf.keras.Model([ids, keys], output)
        model.compile(tf.keras.optimizers.Adam(0.05), "binary_crossentropy", steps_per_execution=SPE)

    latest = tf_psx.callbacks.PeriodicSync.latest(directory) if mode == "resume" else None
    start = latest.step if latest else 0

    def dataset_fn(_ctx):
        return tf.data.Dataset.range(start, EPOCHS * STEPS).map(batch)

    steps = StepCounter(STEPS, crash_at_kill_step)
    callbacks = [steps]
    sync = None
    if mode != "full":
        sync = tf_psx.callbacks.PeriodicSync(EVERY, directory)
        callbacks.insert(0, sync)
    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=EPOCHS, steps_per_epoch=STEPS,
              callbacks=callbacks, verbose=0)
    dynamic_layer = model.get_layer("dynamic")
    if store == "native":
        keys, values = dynamic_layer.native_table.export()
        table, slots = values[:, :4], [values[:, 4:8], values[:, 8:12], values[:, 12:], keys]
        dense_state = list(model.weights + model.optimizer.variables)
    else:
        table = dynamic_layer.table.lookup(tf.constant(KEYS)).numpy()
        slots = [s.lookup(tf.constant(KEYS)).numpy() for s in dynamic_layer.table.get_slot_variables(model.optimizer)]
        # TFRA's per-worker lookup buffers (ShadowVariable and its optimizer
        # slots) are scratch space whose shape follows the last batch: left out.
        de = _tfra.tfra()
        dense_state = [v for v in model.weights + model.optimizer.variables
                       if not isinstance(v, (de.shadow_ops.ShadowVariable, de.TrainableWrapper))
                       and "shadow" not in v.name.lower()]
    arrays = {f"v{i}": v.numpy() for i, v in enumerate(dense_state)}
    arrays.update(table=table, **{f"slot{i}": s for i, s in enumerate(slots)})
    np.savez(out, **arrays)
    report = {
        "restored_step": sync.restored.step if sync and sync.restored else None,
        "first_batch_end": steps.batch_ends[0],
        "executions": len(steps.batch_ends),
        "iterations": int(model.optimizer.iterations.numpy()),
        "table_size": dynamic_layer.size(),
        "num_slots": len(slots),
        "snapshots": [s.step for s in tf_psx.callbacks.PeriodicSync.snapshots(directory)],
        "saved": sorted(arrays),
    }
    print("REPORT " + json.dumps(report), flush=True)
