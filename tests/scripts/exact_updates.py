"""Closed-form check of embedding updates under several async workers.

The model's loss is the mean over the batch of the sum of the looked-up rows,
so the gradient of row r is the constant g_r = count_r / batch (every dim),
whatever the weights. Every batch holds the same keys, so the workers collide
on purpose. After the run the optimizer has applied S = `iterations` steps,
and the table must equal S sequential applications of that same constant
gradient by a fresh optimizer of the same configuration on a local variable
(SGD: -lr * S * g; Adagrad: -sum_t lr * g / sqrt(a0 + t g^2 + eps); Adam:
-sum_t lr * g * c_t / (|g| c_t + eps), c_t = sqrt(1 - beta2^t); momentum
SGD: its geometric sum). Lost updates give a share below 1, updates applied
twice or raced slots give a share above 1.

Prints one line `RESULT {json}` with the share of the true move applied, the
largest row error relative to the largest move, the applied step count, the
keys in a hash table and the seconds taken.

With `--min-count n` the DynamicEmbedding (either store) admits a key once it has been
seen n times: the counting forward passes run one at a time under a lock, so
a key seen c times per batch is admitted from the ceil(n / c)-th step on, and
its row must equal S - ceil(n / c) + 1 applications of its gradient (SGD and
Adagrad, whose update of a zero gradient is zero); a key never seen n times
has no row, and every key's count is exactly S * c.

With `--sync` the strategy runs synchronous steps: each applies the mean
of one gradient per worker, which here equals the single gradient, so the
same closed form holds with S = the sync steps applied.

With `--layer dense` the model is one Dense layer on a fixed input (the
loss linear in its kernel and bias): dense gradients, constant, checked
against the same sequential applications on a local model. With
`--input arrays` the steps are fed by the coordinator (`fit` of arrays), so
they carry step tokens (tf_psx.training.step_once) and a step's dense updates run as
one unit per ps task (tf_psx.training.exact_updates.grouped_apply).

Usage: exact_updates.py --layer sharded|stock|dynamic|dense --optimizer NAME
       [--workers 2] [--processes] [--steps 40] [--spe 1] [--min-count 1] [--sync]
       [--input creator|arrays]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

import tf_psx  # noqa: F401  (routes tf.keras to tf-keras)
import tensorflow as tf

VOCAB = 1000
DIM = 4
NUM_KEYS = 200
BATCH = 16
# Key i appears 1 + (i % 3) times in every batch: rows get different gradients.
MULTIPLICITY = 3
OPTIMIZERS = ("sgd", "sgd_momentum", "adagrad", "adam", "lazyadam", "psx_sgd", "psx_sgd_momentum")
# "dynamic": DynamicEmbedding on its default store (TFRA's where installed); "native": on tf_psx's own tables.
LAYERS = ("sharded", "stock", "dynamic", "native", "dense")


def make_optimizer(name: str):
    keras = tf.keras.optimizers
    return {
        "sgd": lambda: keras.SGD(0.1),
        "sgd_momentum": lambda: keras.SGD(0.05, momentum=0.9),
        "adagrad": lambda: keras.Adagrad(0.1),
        "adam": lambda: keras.Adam(0.01),
        "lazyadam": lambda: tf_psx.optimizers.LazyAdam(0.01),
        "psx_sgd": lambda: tf_psx.optimizers.SGD(0.1),
        "psx_sgd_momentum": lambda: tf_psx.optimizers.SGD(0.05, momentum=0.9),
    }[name]()


def batch_ids() -> np.ndarray:
    keys = (np.arange(NUM_KEYS, dtype=np.int64) * 37) % VOCAB
    ids = np.concatenate([np.full(1 + i % MULTIPLICITY, k) for i, k in enumerate(keys)])
    pad = (-len(ids)) % BATCH
    ids = np.concatenate([ids, keys[:pad]])
    return ids.reshape(BATCH, -1)


def expected_table(name: str, ids: np.ndarray, steps: int) -> np.ndarray:
    """`steps` sequential applications of the constant gradient, on a local variable."""
    unique, counts = np.unique(ids, return_counts=True)
    grad = tf.IndexedSlices(
        tf.constant(np.repeat((counts / BATCH)[:, None], DIM, axis=1), tf.float32),
        tf.constant(unique),
        tf.constant([VOCAB, DIM], tf.int64),
    )
    with tf.device("/cpu:0"):
        var = tf.Variable(tf.zeros([VOCAB, DIM]))
        opt = make_optimizer(name)
        for _ in range(steps):
            opt.apply_gradients([(grad, var)])
    return var.numpy()


def expected_dense(name: str, ids: np.ndarray, steps: int) -> np.ndarray:
    """The "dense" model's weights (flattened) after `steps` sequential applications of its constant gradient."""
    with tf.device("/cpu:0"):
        model, _ = build_model("dense")
        model(ids)  # builds the weights
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(ids))
        grads = tape.gradient(loss, model.trainable_variables)
        opt = make_optimizer(name)
        for _ in range(steps):
            opt.apply_gradients(zip(grads, model.trainable_variables))
    return np.concatenate([w.ravel() for w in model.get_weights()])[None, :]


def expected_admitted(name: str, ids: np.ndarray, steps: int, min_count: int) -> np.ndarray:
    """The table when keys are admitted after `min_count` occurrences (see the module doc)."""
    unique, counts = np.unique(ids, return_counts=True)
    table = np.zeros([VOCAB, DIM], np.float32)
    for count in np.unique(counts):
        applied = steps - math.ceil(min_count / count) + 1
        if applied > 0:
            keys = unique[counts == count]
            table[keys] = expected_table(name, ids, applied)[keys]
    return table


def build_model(layer: str, min_count: int = 1):
    if layer == "dense":
        inputs = tf.keras.Input((batch_ids().shape[1],), dtype=tf.int64)
        # Dense gradients, constant: the loss is linear in the kernel and bias (the input is fixed).
        features = tf.keras.layers.Lambda(lambda i: tf.cast(i % 7 + 1, tf.float32) / 7.0)(inputs)
        dense = tf.keras.layers.Dense(DIM, kernel_initializer="zeros", bias_initializer="zeros")
        out = tf.keras.layers.Lambda(lambda r: tf.reduce_sum(r, axis=1))(dense(features))
        return tf.keras.Model(inputs, out), dense
    inputs = tf.keras.Input((None,), dtype=tf.int64)
    if layer == "sharded":
        emb = tf_psx.layers.ShardedEmbedding(VOCAB, DIM, embeddings_initializer="zeros")
    elif layer == "stock":
        emb = tf.keras.layers.Embedding(VOCAB, DIM, embeddings_initializer="zeros")
    elif layer == "native":
        emb = tf_psx.layers.DynamicEmbedding(DIM, initializer="zeros", min_count=min_count, table="native")
    else:
        emb = tf_psx.layers.DynamicEmbedding(DIM, initializer="zeros", min_count=min_count)
    rows = emb(inputs)
    out = tf.keras.layers.Lambda(lambda r: tf.reduce_sum(r, axis=[1, 2]))(rows)
    return tf.keras.Model(inputs, out), emb


def table_of(layer: str, emb) -> tuple[np.ndarray, int]:
    if layer == "dense":
        return np.concatenate([w.ravel() for w in emb.get_weights()])[None, :], 0
    ids = tf.range(VOCAB, dtype=tf.int64)
    if layer == "sharded":
        return emb.lookup_table(), VOCAB
    if layer == "stock":
        return tf.nn.embedding_lookup(emb.embeddings, ids).numpy(), VOCAB
    keys, values = emb.export()  # the rows a lookup reads, from the ps tasks
    table = np.zeros([VOCAB, DIM], np.float32)
    table[keys] = values
    return table, len(keys)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layer", choices=LAYERS, nargs="+", required=True)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, nargs="+", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--processes", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--spe", type=int, default=1)
    parser.add_argument("--no-exact", action="store_true", help="TF's own update path (the baseline)")
    parser.add_argument("--min-count", type=int, default=1, help="admission of the DynamicEmbedding")
    parser.add_argument("--sync", action="store_true", help="synchronous steps (ParameterServerStrategy(sync=True))")
    parser.add_argument("--input", choices=("creator", "arrays"), default="creator",
                        help="each worker's own dataset (DatasetCreator), or fit of arrays (the coordinator feeds them)")
    parser.add_argument("--warn-check", action="store_true",
                        help="also compile with a legacy Adam and print tf_psx's warnings")
    args = parser.parse_args(argv)

    ids = batch_ids()
    with tf_psx.LocalCluster(num_workers=args.workers, num_ps=args.ps, processes=args.processes) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, "fixed:2", exact_updates=not args.no_exact,
                                                  sync=args.sync)
        for layer in args.layer:
            for optimizer in args.optimizer:
                result = run_pair(strategy, layer, optimizer, ids, args)
                print("RESULT " + json.dumps(result), flush=True)
        if args.warn_check:
            warn_check(strategy)
    return 0


def warn_check(strategy) -> None:
    """Compiles with legacy optimizers (with and without a current twin); prints tf_psx's notices as WARNED/INFO lines."""
    import logging  # pylint: disable=import-outside-toplevel

    class Collect(logging.Handler):
        def emit(self, record):
            print(("WARNED " if record.levelno >= logging.WARNING else "INFO ") + record.getMessage(), flush=True)

    handler = Collect(logging.INFO)
    logger = logging.getLogger("tf_psx")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        with strategy.scope():
            model, _ = build_model("sharded")
            model.compile(tf.keras.optimizers.legacy.Adam(0.01), loss=lambda y, p: p)
            assert type(model.optimizer) is tf.keras.optimizers.Adam, model.optimizer  # its current twin
            model, _ = build_model("sharded")
            model.compile(tf.keras.optimizers.legacy.Adam(0.01, decay=0.1), loss=lambda y, p: p)  # no twin
            model, _ = build_model("sharded")
            model.compile(tf.keras.optimizers.Adam(0.01), loss=lambda y, p: p)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run_pair(strategy, layer: str, optimizer: str, ids: np.ndarray, args) -> dict:
    """Trains one layer x optimizer pair on the cluster; returns its closed-form check."""
    start = time.monotonic()
    with strategy.scope():
        model, emb = build_model(layer, args.min_count if layer in ("dynamic", "native") else 1)
        model.compile(make_optimizer(optimizer), loss=lambda y, p: p, steps_per_execution=args.spe)

    def dataset_fn(_ctx):
        labels = np.zeros([BATCH], np.float32)
        return tf.data.Dataset.from_tensors((ids, labels)).repeat()

    if args.input == "arrays":
        # The coordinator feeds the steps (step tokens: tf_psx.training.step_once), `--steps` batches of the same ids.
        model.fit(np.tile(ids, (args.steps, 1)), np.zeros([BATCH * args.steps], np.float32), batch_size=BATCH,
                  epochs=1, shuffle=False, verbose=0)  # every batch the same rows
    else:
        model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1,
                  steps_per_epoch=args.steps, verbose=0)
    steps = int(model.optimizer.iterations.numpy())
    actual, keys = table_of(layer, emb)
    admission = layer in ("dynamic", "native") and args.min_count > 1
    if admission:
        expected = expected_admitted(optimizer, ids, steps, args.min_count)
        unique, counts = np.unique(ids, return_counts=True)
        counted = emb.policy.counts(unique)
        extra = {"min_count": args.min_count, "counts_exact": bool(np.array_equal(counted, steps * counts)),
                 "rows_of_unadmitted_keys": int(np.count_nonzero(actual[unique[steps * counts < args.min_count]]))}
    elif layer == "dense":
        expected = expected_dense(optimizer, ids, steps)
        extra = {}
    else:
        expected = expected_table(optimizer, ids, steps)
        extra = {}
    move = float(np.abs(expected).sum())
    if args.sync:
        # Every batch has the same gradient, so a sync step (their mean) moves as one batch does.
        extra["sync"] = strategy.sync_stats()
    return {**extra,
        "layer": layer,
        "optimizer": optimizer,
        "workers": args.workers,
        "processes": args.processes,
        "spe": args.spe,
        "input": args.input,
        "exact_updates": not args.no_exact,
        "steps": steps,
        "grouped": len(tf_psx.training.exact_updates.grouped_variables(model.optimizer)),
        "iterations_in_unit": tf_psx.training.exact_updates.iterations_in_unit(model.optimizer),
        # Each shard's update counter (a table updated per shard on its ps task), else None.
        "table_steps": _table_steps(layer, model.optimizer, emb),
        "ps": args.ps,
        "share": float(np.abs(actual).sum()) / move,
        "max_row_error": float(np.abs(actual - expected).max() / np.abs(expected).max()),
        "keys": keys,
        "keys_trained": int(np.count_nonzero(np.abs(expected).sum(axis=1))),
        "seconds": round(time.monotonic() - start, 1),
    }


def _table_steps(layer: str, optimizer, emb):
    """Each shard's update counter of a hash table updated per shard on its ps task, else None."""
    if layer == "dynamic" and emb.store == "tfra":
        return tf_psx.tables.tfra_updates.shard_steps(getattr(optimizer, "inner_optimizer", optimizer), emb.table)
    if layer in ("dynamic", "native"):
        return tf_psx.tables.updates.shard_steps(optimizer, emb.native_table)
    return None


if __name__ == "__main__":
    sys.exit(main())
