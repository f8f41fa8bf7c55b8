"""A sync step of N workers equals one step of batch N*b, checked weight by weight.

Trains a small CTR-like model (an embedding of 3 id features, 4 dense
features, two Dense layers, log loss) with `sync=True` on a cluster of
`--workers` workers, in a custom `ClusterCoordinator` loop whose steps each
return the sync step their gradient joined (`strategy.sync_version()`). Then
switches the strategy to async and trains a second model, from the same
initial weights and rows, one step at a time (each step joined before the
next is scheduled, so nothing overlaps): step k's batch is the
concatenation of the batches that sync step k combined. The batch count is
not a multiple of N, so the last sync step is the partial one that
`flush_sync` applies.

Prints `RESULT {json}` per layer x optimizer: the largest difference of any
weight or table row between the two runs, the sync steps, the step of each
batch and the sync statistics.

Usage: sync_equivalence.py --layer sharded dynamic native --optimizer adagrad lazyadam
       [--workers 2] [--batches 61] [--schedule exponential|cosine]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import numpy as np

import tf_psx
import tensorflow as tf

VOCAB = 300
DIM = 4
FEATURES = 3
DENSE = 4
BATCH = 8


def make_optimizer(name: str, schedule: str | None):
    rate = {"adagrad": 0.1, "lazyadam": 0.01}[name]
    if schedule == "exponential":
        rate = tf.keras.optimizers.schedules.ExponentialDecay(rate, decay_steps=4, decay_rate=0.5)
    elif schedule == "cosine":
        rate = tf.keras.optimizers.schedules.CosineDecay(rate, decay_steps=20)
    if name == "adagrad":
        return tf.keras.optimizers.Adagrad(rate)
    return tf_psx.optimizers.LazyAdam(rate)


def make_data(batches: int):
    rng = np.random.default_rng(7)
    ids = (rng.zipf(1.3, size=[batches, BATCH, FEATURES]) % VOCAB).astype(np.int64)
    dense = rng.normal(size=[batches, BATCH, DENSE]).astype(np.float32)
    labels = (rng.random([batches, BATCH, 1]) < 0.3).astype(np.float32)
    return ids, dense, labels


def build_model(layer: str):
    ids = tf.keras.Input((FEATURES,), dtype=tf.int64)
    dense = tf.keras.Input((DENSE,))
    if layer == "sharded":
        emb = tf_psx.layers.ShardedEmbedding(VOCAB, DIM, embeddings_initializer=tf.keras.initializers.RandomNormal(seed=1))
    elif layer == "native":
        # tf_psx's own tables: a key's initial row is drawn from the key and the layer's name, so the two models'
        # layers (one name) start from the same rows.
        emb = tf_psx.layers.DynamicEmbedding(DIM, table="native", name="rows")
    else:
        emb = tf_psx.layers.DynamicEmbedding(DIM, table="tfra")
    rows = tf.keras.layers.Flatten()(emb(ids))
    hidden = tf.keras.layers.Dense(8, activation="relu")(tf.keras.layers.Concatenate()([rows, dense]))
    out = tf.keras.layers.Dense(1)(hidden)
    return tf.keras.Model([ids, dense], out), emb


def rows_of(layer: str, emb) -> np.ndarray:
    if layer == "sharded":
        return emb.lookup_table()
    keys, values = emb.export() if layer == "native" else (t.numpy() for t in emb.table.export())
    table = np.zeros([VOCAB, DIM], np.float32)
    table[keys] = values
    return table


def make_step(strategy, model, data):
    ids, dense, labels = (tf.constant(x) for x in data)
    loss_fn = tf.keras.losses.BinaryCrossentropy(from_logits=True, reduction="none")
    optimizer = model.optimizer

    @tf.function
    def step(batches):
        def replica(batches):
            x_ids = tf.reshape(tf.gather(ids, batches), [-1, FEATURES])
            x_dense = tf.reshape(tf.gather(dense, batches), [-1, DENSE])
            y = tf.reshape(tf.gather(labels, batches), [-1, 1])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(y, model([x_ids, x_dense], training=True)))
            variables = model.trainable_variables
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return strategy.sync_version()

        return strategy.run(replica, args=(batches,))

    return step


def run_pair(strategy, layer: str, optimizer: str, args) -> dict:
    start = time.monotonic()
    data = make_data(args.batches)
    coordinator = strategy.coordinator
    strategy.set_sync(True)
    models = []
    for _ in range(2):
        with strategy.scope():
            model, emb = build_model(layer)
            model.compile(make_optimizer(optimizer, args.schedule), loss="mse")
        models.append((model, emb))
    (sync_model, sync_emb), (ref_model, ref_emb) = models
    if layer == "dynamic":
        keys = tf.range(VOCAB, dtype=tf.int64)
        initial = tf.random.stateless_normal([VOCAB, DIM], seed=[1, 2])
        sync_emb.table.upsert(keys, initial)
        ref_emb.table.upsert(keys, initial)
    ref_model.set_weights(sync_model.get_weights())
    initial_rows = rows_of(layer, sync_emb)

    before = strategy.sync_stats()
    sync_step = make_step(strategy, sync_model, data)
    versions = [coordinator.schedule(sync_step, args=(tf.constant([i]),)) for i in range(args.batches)]
    coordinator.join()
    strategy.flush_sync()
    after = strategy.sync_stats()
    versions = [int(v.fetch()) for v in versions]

    strategy.set_sync(False)
    ref_step = make_step(strategy, ref_model, data)
    steps = sorted(set(versions))
    for version in steps:
        batches = [i for i, v in enumerate(versions) if v == version]
        coordinator.schedule(ref_step, args=(tf.constant(batches),))
        coordinator.join()
    differences = [float(np.abs(a - b).max()) for a, b in zip(sync_model.get_weights(), ref_model.get_weights())
                   if a.size]
    rows_difference = float(np.abs(rows_of(layer, sync_emb) - rows_of(layer, ref_emb)).max())
    return {
        "layer": layer,
        "optimizer": optimizer,
        "schedule": args.schedule,
        "workers": args.workers,
        "batches": args.batches,
        "sync_steps": len(steps),
        "iterations_sync": int(sync_model.optimizer.iterations.numpy()),
        "iterations_reference": int(ref_model.optimizer.iterations.numpy()),
        "batches_per_step": sorted({versions.count(v) for v in steps}),
        "applied_batches": after["applied_batches"] - before["applied_batches"],
        "dropped": after["dropped"] - before["dropped"],
        "max_weight_difference": max(differences + [rows_difference]),
        "rows_difference": rows_difference,
        "rows_moved": float(np.abs(rows_of(layer, sync_emb) - initial_rows).max()),
        "seconds": round(time.monotonic() - start, 1),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer", choices=("sharded", "dynamic", "native"), nargs="+", required=True)
    parser.add_argument("--optimizer", choices=("adagrad", "lazyadam"), nargs="+", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=61)
    parser.add_argument("--schedule", choices=("exponential", "cosine"), default=None)
    args = parser.parse_args(argv)
    with tf_psx.LocalCluster(num_workers=args.workers, num_ps=2) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, "fixed:2", sync="switchable")
        for layer, optimizer in itertools.product(args.layer, args.optimizer):
            print("RESULT " + json.dumps(run_pair(strategy, layer, optimizer, args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
