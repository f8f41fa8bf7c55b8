"""Central storage: one machine, several devices, variables kept in one place.

`tf_psx.CentralStorageStrategy` keeps every variable on one device (the
CPU when there are several GPUs) and runs a replica of each step on every
compute device; gradients are summed before the single update, so a step
with global batch B is the step a single device would take with batch B.
No cluster, no servers: it is the strategy for one multi-GPU machine whose
embedding tables fit in its memory.

With no GPUs (as here) the example splits the CPU into `--replicas` logical
devices so that there really are several replicas. It trains a click model
on synthetic data with `model.fit` and compares the holdout AUC with the
best AUC possible on the data, and the holdout log loss with that of the best
constant guess (the click rate). Exits 1 when the model does not clearly beat
chance.

`main()` returns the numbers as a dict; run as a script, the last line printed
is `RESULT {...}`, that dict as JSON (tests/test_examples.py reads it).

    python examples/central_storage.py [--steps 200] [--replicas 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # hide TF's C++ start-up chatter

import tf_psx  # routes tf.keras to tf-keras; import before using tf.keras
import tensorflow as tf

from tf_psx.data import describe_quality, holdout_quality, synthetic_ctr

NUM_FIELDS = 8
VOCAB_SIZE = 1_000
NUM_EXAMPLES = 100_000
HOLDOUT_FRACTION = 0.2
# The global batch; each replica computes GLOBAL_BATCH / replicas of it.
GLOBAL_BATCH = 512
EMBED_DIM = 8
# "Clearly beats chance": a model that learned nothing scores 0.5 +- 0.01 here.
MIN_AUC = 0.6


def split_cpu(replicas: int) -> list[str]:
    """Compute devices: the GPUs if there are any, else `replicas` logical CPUs."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return [f"/gpu:{i}" for i in range(len(gpus))]
    cpu = tf.config.list_physical_devices("CPU")[0]
    # Must run before TF initializes its devices (before the first op).
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    return [f"/cpu:{i}" for i in range(replicas)]


def build_model(num_rows: int) -> tf.keras.Model:
    ids = tf.keras.Input(shape=(NUM_FIELDS,), dtype=tf.int64, name="ids")
    emb = tf.keras.layers.Embedding(num_rows, EMBED_DIM, name="embedding")(ids)
    hidden = tf.keras.layers.Dense(32, activation="relu")(tf.keras.layers.Flatten()(emb))
    click = tf.keras.layers.Dense(1, activation="sigmoid", name="click")(hidden)
    return tf.keras.Model(ids, click)



def main(argv: list[str] | None = None) -> dict:
    """Trains and evaluates; returns the holdout numbers (see the end of this function)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="training steps in all")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=2, help="logical CPUs when there is no GPU")
    args = parser.parse_args(argv)

    devices = split_cpu(args.replicas)
    strategy = tf_psx.CentralStorageStrategy(compute_devices=devices, parameter_device="/cpu:0")
    print(f"{strategy.num_replicas_in_sync} replicas on {devices}; variables on /cpu:0")

    data = synthetic_ctr(NUM_EXAMPLES, NUM_FIELDS, VOCAB_SIZE, seed=1)
    train, holdout = data.split(HOLDOUT_FRACTION)
    start = time.time()
    with strategy.scope():
        model = build_model(data.num_rows)
        model.compile(tf.keras.optimizers.Adagrad(0.05), "binary_crossentropy")
    # fit splits each global batch over the replicas.
    dataset = tf.data.Dataset.from_tensor_slices((train.ids, train.labels))
    dataset = dataset.shuffle(10_000, seed=0).repeat().batch(GLOBAL_BATCH)
    history = model.fit(dataset, epochs=args.epochs, steps_per_epoch=max(1, args.steps // args.epochs),
              verbose=2 if not sys.stdout.isatty() else 1)
    table_device = model.get_layer("embedding").embeddings.device
    print(f"the embedding table lives on {table_device}")
    scores = model.predict(holdout.ids, batch_size=4096, verbose=0).reshape(-1)
    result = {
        "replicas": strategy.num_replicas_in_sync,
        "compute_devices": devices,
        "table_device": table_device,
        **holdout_quality(holdout.labels, scores, holdout.probs),
        "train_loss": history.history["loss"][-1],
        "seconds": time.time() - start,
    }
    print(describe_quality(result) + f"   ({result['seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    RESULT = main()
    print("RESULT " + json.dumps(RESULT), flush=True)
    if RESULT["auc"] < MIN_AUC:
        print(f"FAIL: AUC {RESULT['auc']:.4f} does not clearly beat chance (needs >= {MIN_AUC}).", file=sys.stderr)
        sys.exit(1)
