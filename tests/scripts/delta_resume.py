"""PeriodicSync delta snapshots under a crash: full | interrupt | resume, MODE DIR OUT.npz.

A 1-worker, 2-ps cluster trains 60 steps (3 epochs of 20) of a model with a
4000-row Embedding split over both ps tasks (2000 rows a shard: rows
fingerprinted), a Dense layer and non-lazy Adam, whose update moves every
row ever touched (so deltas must carry more than the batch's rows). Batch k
is a pure function of k, so a resumed run that starts at step s reads the
same batches as an uninterrupted one if it skips s batches.

* full: no callback, 60 steps; saves the final weights and optimizer state.
* interrupt: PeriodicSync every 20 steps with a delta every 5; the process
  dies (os._exit) at step 38, after the delta of step 35; saves the state
  at step 35 first (read right after PeriodicSync's barrier).
* resume: same fit with PeriodicSync; it must restore step 35 (the full
  snapshot of step 20 plus its delta) and run 25 steps.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tf_psx  # noqa: E402
import tensorflow as tf  # noqa: E402
from step_counter import StepCounter  # noqa: E402

mode, directory, out = sys.argv[1], sys.argv[2], sys.argv[3]
EPOCHS, STEPS, EVERY, DELTA_EVERY, KILL_AT, BATCH, FIELDS, ROWS = 3, 20, 20, 5, 38, 16, 4, 4000
DELTA_STEP = KILL_AT // DELTA_EVERY * DELTA_EVERY


def batch(k):
    # Batch k from a stateless RNG seeded by k: the same in every process.
    ids = tf.random.stateless_uniform([BATCH, FIELDS], seed=tf.stack([k, 7]), maxval=ROWS, dtype=tf.int64)
    labels = tf.cast(tf.math.floormod(ids[:, 0] + ids[:, 1], 2), tf.float32)
    return ids, labels


def state(model) -> dict:
    variables = list(model.weights) + list(model.optimizer.variables)
    return {f"v{i}": tf.convert_to_tensor(v).numpy() for i, v in enumerate(variables)}


def save_then_crash(step, model):
    if mode == "interrupt" and step == DELTA_STEP:
        np.savez(out, **state(model))  # PeriodicSync (first in the list) has joined: nothing in flight
    if mode == "interrupt" and step >= KILL_AT:
        print(f"killed at step {step} after deltas of {len(sync.delta_rows)} steps: "
              f"DELTAS {json.dumps(sync.delta_rows)}", flush=True)
        os._exit(3)  # a crash: no cleanup, no on_train_end


with tf_psx.LocalCluster(num_workers=1, num_ps=2) as cluster:
    strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
    with strategy.scope():
        ids = tf.keras.Input((FIELDS,), dtype=tf.int64, name="ids")
        rows = tf.keras.layers.Embedding(
            ROWS, 4, embeddings_initializer=tf.keras.initializers.RandomUniform(-0.1, 0.1, seed=1), name="table")(ids)
        output = tf.keras.layers.Dense(1, activation="sigmoid",
                                       kernel_initializer=tf.keras.initializers.GlorotUniform(seed=2))(
            tf.keras.layers.Flatten()(rows))
        model = tf.keras.Model(ids, output)
        model.compile(tf.keras.optimizers.Adam(0.05), "binary_crossentropy")

    sync = None
    if mode != "full":
        sync = tf_psx.callbacks.PeriodicSync(EVERY, directory, delta_every_n_steps=DELTA_EVERY)
    start = 0
    if mode == "resume":
        start = DELTA_STEP  # checked below against what PeriodicSync restored

    def dataset_fn(_ctx):
        return tf.data.Dataset.range(start, EPOCHS * STEPS).map(batch)

    steps = StepCounter(STEPS, save_then_crash)
    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=EPOCHS, steps_per_epoch=STEPS,
              callbacks=[sync, steps] if sync else [steps], verbose=0)
    if mode != "interrupt":
        np.savez(out, **state(model))
    report = {
        "restored_step": sync.restored.step if sync and sync.restored else None,
        "restored_delta_of": sync.restored.delta_of if sync and sync.restored else None,
        "first_batch_end": steps.batch_ends[0],
        "iterations": int(model.optimizer.iterations.numpy()),
        "snapshots": [s.step for s in tf_psx.callbacks.PeriodicSync.snapshots(directory)] if sync else [],
        "delta_rows": sync.delta_rows if sync else [],
        "tracking": sync.delta_tracking if sync else {},
        # Adam's per-variable step counters (tf_psx.training.exact_updates) in each full snapshot.
        "counters_per_snapshot": [
            sum("_tf_psx_local_steps" in key for key in tf.train.load_checkpoint(s.checkpoint).get_variable_to_shape_map())
            for s in tf_psx.callbacks.PeriodicSync.snapshots(directory)] if sync else [],
    }
    print("REPORT " + json.dumps(report), flush=True)
