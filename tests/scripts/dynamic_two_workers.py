"""DynamicEmbedding under a 2-worker ParameterServerStrategy, with a checkable result.

Usage: dynamic_two_workers.py [--raw] OPTIMIZER [OPTIMIZER ...]
  OPTIMIZER: sgd, adam or adagrad; each trains a fresh model on the same
    in-process LocalCluster(num_workers=2, num_ps=2).
  --raw: use TFRA's de.keras.layers.Embedding and DynamicEmbeddingOptimizer
    directly, without tf_psx.layers.DynamicEmbedding (so without
    tf_psx._tf.shadows.install_per_worker_shadows), to measure what TFRA 0.8.1
    itself does with 2 workers.
  TF_PSX_LOG_PLACEMENT=1 logs every op's device (to check where the shadow
    buffers' VarHandleOps run).

Prints one line "RESULT <optimizer>: <verdict> ..." per optimizer and exits
0 when every trained table is correct, 1 when one is wrong, 2 when a fit
raised.

Why the result is checkable although the two workers run asynchronously:
each worker reads its own keys (a ps counter, bumped once by each worker's
dataset function, gives each worker an ordinal; worker o uses keys
BASE + o * WORKER_OFFSET + j), each of its steps sees the same batch, and
the loss is linear, loss = -mean(sum of the embedding entries of a row),
so the gradient of every entry of key k is -m_k / BATCH whatever the
parameters (m_k: occurrences of k in the batch). A worker runs one step at a
time, so with SGD(lr = BATCH) the table row of a key of worker o must be
exactly n_o * m_k in every entry, where n_o is the number of steps worker o
ran and n_0 + n_1 = STEPS. With Adagrad(lr) the row must be
sum_t lr * g / sqrt(a0 + t * g^2 + eps) for t = 1..n_o, with a0 Adagrad's
initial_accumulator_value (TFRA 0.8.1 alone starts a new key's accumulator
at 0; tf_psx starts it at a0, as tf-keras does).
With Adam the step of a key depends only on its gradient sequence and the
step number its update reads, and the gradients of the keys of one worker
differ only by the scale m_k, which Adam removes. tf_psx updates each table
shard on its ps task with a step counter of its own
(tf_psx.tables.tfra_updates.shard_steps), and two async workers may reach a step's
two shards in different orders, so one step can read different step numbers
on the two shards: all rows of one worker on one shard must be equal.
Rows mixed up between the workers break these equalities.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402

import tf_psx  # noqa: E402
import tensorflow as tf  # noqa: E402
from tf_psx._tf import tfra as _tfra  # noqa: E402

WORKERS, PS = 2, 2
FIELDS, DIM, BATCH = 4, 2, 8
STEPS = 12
BASE = 10**12
WORKER_OFFSET = 10**6
ADAM_RTOL = 1e-3  # Adam's epsilon (1e-7) against update sizes of ~lr
ADAGRAD_LR = 0.1
# tf-keras Adagrad's defaults. tf_psx starts a new key's accumulator at the
# initial value, as tf-keras does for a variable; TFRA alone (--raw) at 0.
ADAGRAD_INITIAL_ACCUMULATOR = 0.1
ADAGRAD_EPSILON = 1e-7
ATOL = 1e-4  # float32 sums of a dozen steps of size <= 4

# Batch layouts: slot s of worker o's flattened batch holds key index
# s % KEYS[o], so the workers' batches have different numbers of distinct
# keys (10 and 13: a shadow shared by the workers then also has the wrong
# size for the other worker's step) and keys occur 2, 3 or 4 times.
KEYS = (10, 13)
INDEX = np.stack([(np.arange(BATCH * FIELDS) % k).reshape(BATCH, FIELDS) for k in KEYS]).astype(np.int64)
MULT = [np.bincount(index.ravel(), minlength=k).astype(np.float64) for index, k in zip(INDEX, KEYS)]

args = [a for a in sys.argv[1:] if a != "--raw"]
raw = "--raw" in sys.argv[1:]

if os.environ.get("TF_PSX_LOG_PLACEMENT"):
    tf.debugging.set_log_device_placement(True)
cluster = tf_psx.LocalCluster(num_workers=WORKERS, num_ps=PS).start()
strategy = tf_psx.ParameterServerStrategy(cluster)

OPTIMIZERS = {
    "sgd": lambda: tf.keras.optimizers.SGD(float(BATCH)),
    "adam": lambda: tf.keras.optimizers.Adam(0.01),
    "adagrad": lambda: tf.keras.optimizers.Adagrad(ADAGRAD_LR),
}


def build(optimizer_name, index):
    """A fresh model, its TFRA table and the ps counter its datasets read."""
    with strategy.scope():
        ordinal_counter = tf.Variable(0, dtype=tf.int64, trainable=False)
        inputs = tf.keras.Input((FIELDS,), dtype=tf.int64)
        if raw:
            de = _tfra.tfra()  # pylint: disable=protected-access
            layer = de.keras.layers.Embedding(
                DIM, initializer=tf.keras.initializers.Zeros(), name=f"raw_table_{index}", with_unique=True,
                devices=[f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(PS)])
            table, shadow = layer.params, layer.shadow
        else:
            layer = tf_psx.layers.DynamicEmbedding(DIM, initializer=tf.keras.initializers.Zeros())
            table, shadow = layer.table, layer.embedding.shadow
        out = tf.reduce_sum(layer(inputs), axis=[1, 2])[:, None]
        model = tf.keras.Model(inputs, out)
        optimizer = OPTIMIZERS[optimizer_name]()
        if raw:
            optimizer = de.DynamicEmbeddingOptimizer(optimizer)
        model.compile(optimizer, loss=lambda y, p: -y[:, 0] * p[:, 0])
    print(f"{optimizer_name}: shadow {type(shadow).__name__} created on {shadow.device}")
    return model, table, ordinal_counter


def check(optimizer_name, table):
    """The verdict line for the trained table (see the module docstring)."""
    rows, shards = [], []
    for ordinal in range(WORKERS):
        keys = tf.constant(BASE + ordinal * WORKER_OFFSET + np.arange(KEYS[ordinal], dtype=np.int64))
        rows.append(table.lookup(keys).numpy().astype(np.float64))  # [KEYS[ordinal], DIM]
        shards.append(table.partition_fn(keys, len(table.devices)).numpy())  # each key's shard
    size = int(table.size())
    problems = []
    if optimizer_name in ("sgd", "adagrad"):
        # The row after n steps, for n = 0..STEPS (see the module docstring).
        if optimizer_name == "sgd":
            expected = [lambda n, o=o: n * MULT[o][:, None] for o in range(WORKERS)]
        else:
            # Step t of key k moves lr * g / sqrt(a0 + t * g^2 + eps), g = m_k / BATCH.
            initial = 0.0 if raw else ADAGRAD_INITIAL_ACCUMULATOR
            t = np.arange(1, STEPS + 1)[None, :]
            partial = [
                np.concatenate(
                    [np.zeros((KEYS[o], 1)),
                     np.cumsum(ADAGRAD_LR * g / np.sqrt(initial + t * g**2 + ADAGRAD_EPSILON), axis=1)],
                    axis=1,
                )
                for o, g in enumerate(m[:, None] / BATCH for m in MULT)
            ]
            expected = [lambda n, o=o: partial[o][:, n:n + 1] for o in range(WORKERS)]
        steps = []
        for ordinal, values in enumerate(rows):
            fits = [n for n in range(STEPS + 1) if np.allclose(values, expected[ordinal](n), atol=ATOL)]
            steps.append(fits[0] if fits else None)
            if not fits:
                problems.append(f"worker {ordinal}: rows {values[:, 0].round(4).tolist()} match no step count")
        if None not in steps and sum(steps) != STEPS:
            problems.append(f"steps per worker {steps} do not sum to {STEPS}")
        detail = f"steps per worker {steps}"
    else:
        for ordinal, (values, shard_of) in enumerate(zip(rows, shards)):
            for shard in np.unique(shard_of):
                on_shard = values[shard_of == shard]
                if not np.allclose(on_shard, on_shard[0, 0], rtol=ADAM_RTOL, atol=1e-6):
                    problems.append(f"worker {ordinal}, shard {shard}: rows differ: "
                                    f"{on_shard[:, 0].round(5).tolist()}")
        detail = f"row of each worker {[round(float(v[0, 0]), 5) for v in rows]}"
    trained = sum(int(np.abs(v).sum(axis=1).astype(bool).sum()) for v in rows)
    if size != trained:
        problems.append(f"table holds {size} keys, {trained} keys were trained")
    verdict = "WRONG " + "; ".join(problems) if problems else "OK"
    return f"RESULT {optimizer_name}: {verdict} ({detail}, table size {size})", bool(problems)


exit_code = 0
for index, optimizer_name in enumerate(args):
    model, table, ordinal_counter = build(optimizer_name, index)

    def dataset_fn(_ctx, counter=ordinal_counter):
        # Runs once on each worker: the counter gives each worker its ordinal.
        ordinal = counter.assign_add(1) - 1
        keys = tf.gather(tf.constant(BASE + INDEX), ordinal) + ordinal * WORKER_OFFSET
        return tf.data.Dataset.from_tensors((keys, tf.ones((BATCH, 1)))).repeat()

    try:
        model.fit(tf.keras.utils.experimental.DatasetCreator(dataset_fn), epochs=1, steps_per_epoch=STEPS, verbose=0)
    except Exception as error:  # pylint: disable=broad-except
        message = " ".join(str(error).split())
        print(f"RESULT {optimizer_name}: FIT RAISED {type(error).__name__}: {message[-600:]}", flush=True)
        exit_code = max(exit_code, 2)
        continue
    line, wrong = check(optimizer_name, table)
    print(line, flush=True)
    if wrong:
        exit_code = max(exit_code, 1)
sys.exit(exit_code)
