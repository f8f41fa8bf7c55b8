"""How many times `model.fit` applied each batch in each epoch, with several workers (the exact-epochs check).

The model: every example carries its own id and has one embedding row of
one column, which only it reads; the loss is the mean of the looked-up
values over the batch, and every batch is full (BATCHES batches of BATCH),
so every application of an example adds the same gradient g = 1 / BATCH to
its row. Under Adagrad
(initial accumulator a0, learning rate lr) a row that k applications moved
has the closed form

    row_k = -lr * sum_{i=1..k} g / sqrt(a0 + i * g^2)

whatever the order and the interleaving of the workers, so `k` is read off
each row exactly (tests/training/test_exact_epochs.py inverts it). SGD would do too;
Adagrad is the optimizer the issue names.

Inputs: arrays (shuffled each epoch by fit), a batched dataset, and the same
dataset behind a filter (TF cannot count it).

Prints `RESULT {json}` per run: every example's row after each epoch, the
steps applied, and the history's epochs.

In sync mode a step applies the mean of the workers' gradients, so an
example's gradient is GRAD / workers: pass --batches divisible by the
workers, so that no partial step (fewer gradients) is flushed.

Usage: exact_epochs.py --workers 2 [--sync] [--straggler] [--batches 40] [--inputs arrays,dataset,unknown]
  [--epochs 2] [--steps-per-execution 1] [--break-input] [--tfra | --native]
`--native`: the rows are a DynamicEmbedding on tf_psx's own hash tables (each example's id is its key).
`--break-input` reads one batch twice and skips another (the check must fail).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

import numpy as np

import tf_psx
import tensorflow as tf

if "--tfra" in sys.argv:  # before the strategy: its layers get per-worker shadows
    import tensorflow_recommenders_addons  # noqa: F401  pylint: disable=unused-import

BATCH = 8
BATCHES = 40
LR = 0.5
A0 = 0.1


GRAD = 1.0 / BATCH  # d(loss)/d(row) for one application of an example (the loss is the batch mean)


def closed_form(k: int, g: float = GRAD) -> float:
    return float(-LR * sum(g / np.sqrt(A0 + i * g * g) for i in range(1, k + 1)))


def applications(row: float, g: float = GRAD, limit: int = 20) -> int:
    """The k whose closed form is `row` (-1 when none is within 1e-4)."""
    for k in range(limit + 1):
        if abs(closed_form(k, g) - row) < 1e-4:
            return k
    return -1


class Straggler:
    """Stops a task process for 2/3 of every 30 ms (a 3x slower worker), from a process of its own.

    A thread of this process could wait for the GIL while a TF call waits
    for the stopped worker, and never send the SIGCONT.
    """

    def __init__(self, pid: int):
        self.pid = pid
        loop = (f"import os, signal, time\nwhile True:\n    os.kill({pid}, signal.SIGSTOP); time.sleep(0.02)\n"
                f"    os.kill({pid}, signal.SIGCONT); time.sleep(0.01)\n")
        self._process = subprocess.Popen([sys.executable, "-c", loop])

    def stop(self) -> None:
        self._process.kill()
        self._process.wait()
        os.kill(self.pid, signal.SIGCONT)


# The offsets' elements (`build(dense=True)`): each gets d(loss)/d(element) = 1 / OFFSETS per step.
OFFSETS = 4
OFFSET_GRAD = 1.0 / OFFSETS


class Offsets(tf.keras.layers.Layer):
    """Adds the means of two [OFFSETS] weights to every output: dense variables whose value counts the steps.

    Every step gives each element the same gradient, OFFSET_GRAD (the loss
    is the batch mean), so an element's value after k applied steps has the
    closed form of `closed_form(k, OFFSET_GRAD)` (`steps_of` reads k back).
    Split by "fixed:2", each ps task holds a shard of both: a step's dense
    updates of a task run as one unit (tf_psx.training.exact_updates.grouped_apply).
    """

    def build(self, input_shape):
        self.first = self.add_weight(name="first", shape=[OFFSETS], initializer="zeros")
        self.second = self.add_weight(name="second", shape=[OFFSETS], initializer="zeros")

    def call(self, inputs):
        return inputs + tf.reduce_mean(self.first) + tf.reduce_mean(self.second)


def steps_of(values, g: float = OFFSET_GRAD, limit: int = 20000) -> list[int]:
    """The k of each value under `closed_form(k, g)` (-1 where none is within a quarter of a step)."""
    terms = g / np.sqrt(A0 + np.arange(1, limit + 1, dtype=np.float64) * g * g)
    forms = np.concatenate([[0.0], -LR * np.cumsum(terms)])
    found = []
    for value in np.ravel(values):
        k = int(np.argmin(np.abs(forms - value)))
        step = LR * terms[min(k, limit - 1)]
        found.append(k if abs(forms[k] - value) < step / 4 else -1)
    return found


def build(strategy, rows: int, tfra: bool = False, name: str = "rows", dense: bool = False, native: bool = False):
    """The counting model; with `tfra`, written as TFRA's demos write it (TFRA's layer, a legacy optimizer).

    With `dense`, the output also carries `Offsets` (dense variables that count the steps applied).
    """
    with strategy.scope():
        inputs = tf.keras.Input((1,), dtype=tf.int64)
        if tfra:
            from tensorflow_recommenders_addons import dynamic_embedding as de  # pylint: disable=import-outside-toplevel

            # TFRA shares a table by name across models: one name per model.
            layer = de.keras.layers.Embedding(1, initializer=tf.keras.initializers.Zeros(), name=name,
                                              devices=[f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(2)])
            optimizer = de.DynamicEmbeddingOptimizer(
                tf.keras.optimizers.legacy.Adagrad(LR, initial_accumulator_value=A0))
        elif native:
            layer = tf_psx.layers.DynamicEmbedding(1, initializer="zeros", name=name, table="native")
            optimizer = tf.keras.optimizers.Adagrad(LR, initial_accumulator_value=A0)
        else:
            layer = tf.keras.layers.Embedding(rows, 1, embeddings_initializer="zeros", name=name)
            optimizer = tf.keras.optimizers.Adagrad(LR, initial_accumulator_value=A0)
        outputs = tf.keras.layers.Flatten()(layer(inputs))
        if dense:
            outputs = Offsets(name="offsets")(outputs)
        model = tf.keras.Model(inputs, outputs)
        model.compile(optimizer, loss=lambda _y, rows_: tf.reduce_sum(rows_, axis=-1))
    return model


def rows_of(model, count: int, tfra: bool, name: str = "rows", native: bool = False) -> list[float]:
    """Row i of the table for ids 0..count-1 (a hash table is read on the coordinator)."""
    if native:
        keys, rows = model.get_layer(name).export()
        table = np.zeros(count, np.float64)
        table[keys] = rows[:, 0]
        return table.tolist()
    if not tfra:
        return tf_psx.unsharded_weights(model)[0][:count, 0].tolist()
    params = model.get_layer(name).params
    return params.lookup(tf.range(count, dtype=tf.int64)).numpy()[:, 0].tolist()


def inputs_of(name: str, break_input: bool, batches: int = BATCHES):
    """(x, y) for fit: one pass of `batches` full batches of example ids."""
    ids = np.arange(batches * BATCH, dtype=np.int64)
    if name == "arrays":
        return ids[:, None], np.zeros(len(ids), np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((ids[:, None], np.zeros(len(ids), np.float32))).batch(BATCH)
    if break_input:  # batch 1 read twice, batch 2 never (the check must fail)
        dataset = dataset.take(2).concatenate(dataset.skip(1).take(1)).concatenate(dataset.skip(3))
    if name == "unknown":
        dataset = dataset.filter(lambda x, y: tf.reduce_all(x >= 0))  # TF cannot count it
    return dataset, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--straggler", action="store_true", help="worker 0 3x slower (task processes)")
    parser.add_argument("--inputs", default="arrays,dataset,unknown")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--batches", type=int, default=BATCHES, help="batches of one pass")
    parser.add_argument("--break-input", action="store_true")
    parser.add_argument("--tfra", action="store_true", help="TFRA's own layer and a legacy optimizer")
    parser.add_argument("--native", action="store_true", help="a DynamicEmbedding on tf_psx's own hash tables")
    args = parser.parse_args(argv)
    with tf_psx.LocalCluster(num_workers=args.workers, num_ps=2, processes=args.straggler) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, "fixed:2", sync=args.sync)
        for name in args.inputs.split(","):
            model = build(strategy, args.batches * BATCH, args.tfra, name=f"rows_{name}", native=args.native)
            if args.steps_per_execution != 1:
                model.compile(model.optimizer, model.loss, steps_per_execution=args.steps_per_execution)
            x, y = inputs_of(name, args.break_input, args.batches)
            per_epoch = []

            class Rows(tf.keras.callbacks.Callback):
                def on_epoch_end(self, epoch, logs=None):
                    per_epoch.append(rows_of(model, args.batches * BATCH, args.tfra, f"rows_{name}", args.native))

            slow = Straggler(cluster.pid("worker", 0)) if args.straggler else None
            try:
                history = model.fit(x, y, batch_size=BATCH, epochs=args.epochs, shuffle=True, verbose=0,
                                    callbacks=[Rows()])
            finally:
                if slow is not None:
                    slow.stop()
            print("RESULT " + json.dumps({
                "input": name, "workers": args.workers, "sync": args.sync, "tfra": args.tfra, "epochs": len(history.history["loss"]),
                "steps": int(model.optimizer.iterations.numpy()), "rows": per_epoch, "batches": args.batches,
                # A sync step applies the mean of one batch per worker: an example's gradient is 1 / workers of it.
                "grad": GRAD / (args.workers if args.sync else 1),
            }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
