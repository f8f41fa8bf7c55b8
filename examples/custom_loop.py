"""A custom training loop on a parameter-server cluster: schedule / join.

`model.fit` hides the ClusterCoordinator. When the step is yours (several
losses, a custom update, extra metrics), drive the coordinator directly:

1. `strategy.coordinator` is the strategy's ClusterCoordinator;
2. `coordinator.create_per_worker_dataset(dataset_fn)` builds the input
   pipeline on every worker (each worker reads its own shard);
3. `coordinator.schedule(step, args=(iterator,))` queues one step on any free
   worker and returns at once with a RemoteValue;
4. `coordinator.join()` waits until every queued step has run.

The step is a `tf.function` that calls `strategy.run`. Exits 1 when the
model does not clearly beat chance on held-out data.

`main()` returns the numbers as a dict (the mean loss of every report, the
holdout AUC and log loss, and what they compare with); run as a script, the
last line printed is `RESULT {...}`, that dict as JSON (tests/test_examples.py
reads it).

    python examples/custom_loop.py [--steps 300] [--processes]
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
BATCH_SIZE = 256  # per worker
EMBED_DIM = 8
LEARNING_RATE = 0.05
# Steps scheduled between two joins: the loss printed is the mean over them.
STEPS_PER_REPORT = 100
# "Clearly beats chance": a model that learned nothing scores 0.5 +- 0.01 here.
MIN_AUC = 0.6


def build_model(num_rows: int) -> tf.keras.Model:
    ids = tf.keras.Input(shape=(NUM_FIELDS,), dtype=tf.int64, name="ids")
    emb = tf_psx.layers.ShardedEmbedding(num_rows, EMBED_DIM, name="embedding")(ids)
    hidden = tf.keras.layers.Dense(32, activation="relu")(tf.keras.layers.Flatten()(emb))
    click = tf.keras.layers.Dense(1, activation="sigmoid", name="click")(hidden)
    return tf.keras.Model(ids, click)



def main(argv: list[str] | None = None) -> dict:
    """Trains with schedule/join and evaluates; returns the numbers (see the end of this function)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="steps in all (over all workers)")
    parser.add_argument("--processes", action="store_true", help="run tasks as processes")
    args = parser.parse_args(argv)

    data = synthetic_ctr(NUM_EXAMPLES, NUM_FIELDS, VOCAB_SIZE, seed=2)
    train, holdout = data.split(HOLDOUT_FRACTION)
    start = time.time()
    # Alone: a LocalCluster; under `tf-psx launch` (TF_CONFIG set): the launched cluster.
    with tf_psx.launched_or(tf_psx.LocalCluster(num_workers=2, num_ps=2, processes=args.processes)) as cluster:
        strategy = tf_psx.ParameterServerStrategy(cluster, partitioner="fixed:2")
        coordinator = strategy.coordinator
        with strategy.scope():
            model = build_model(data.num_rows)
            optimizer = tf.keras.optimizers.Adagrad(LEARNING_RATE)
            loss_metric = tf.keras.metrics.Mean("loss")  # lives on a ps; every worker adds to it
        bce = tf.keras.losses.BinaryCrossentropy(reduction=tf.keras.losses.Reduction.NONE)

        def dataset_fn(input_context: tf.distribute.InputContext | None = None) -> tf.data.Dataset:
            ds = tf.data.Dataset.from_tensor_slices((train.ids, train.labels))
            if input_context is not None:
                ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
            return ds.shuffle(10_000).repeat().batch(BATCH_SIZE).prefetch(2)

        @tf.function
        def per_worker_dataset_fn():
            return strategy.distribute_datasets_from_function(dataset_fn)

        per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
        per_worker_iterator = iter(per_worker_dataset)

        @tf.function
        def train_step(iterator):
            def replica_fn(batch):
                ids, labels = batch
                with tf.GradientTape() as tape:
                    scores = model(ids, training=True)
                    per_example = bce(tf.reshape(labels, [-1, 1]), scores)
                    loss = tf.nn.compute_average_loss(per_example, global_batch_size=BATCH_SIZE)
                gradients = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(gradients, model.trainable_variables))
                loss_metric.update_state(loss)
                return loss

            losses = strategy.run(replica_fn, args=(next(iterator),))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

        scheduled = 0
        last_loss = None
        reports = []  # (steps run so far, mean loss of the steps since the previous report)
        while scheduled < args.steps:
            chunk = min(STEPS_PER_REPORT, args.steps - scheduled)
            for _ in range(chunk):
                last_loss = coordinator.schedule(train_step, args=(per_worker_iterator,))
            coordinator.join()  # every step scheduled so far has run
            scheduled += chunk
            reports.append((scheduled, float(loss_metric.result().numpy())))
            print(f"steps {scheduled:5d}   mean loss {reports[-1][1]:.4f}   "
                  f"last step's loss {last_loss.fetch():.4f}", flush=True)
            loss_metric.reset_state()

        scores = tf.reshape(model(holdout.ids, training=False), [-1]).numpy()
        iterations = int(optimizer.iterations.numpy())
    result = {
        "report_steps": [steps for steps, _ in reports],
        "report_losses": [loss for _, loss in reports],
        "iterations": iterations,  # updates the optimizer applied: one per step
        **holdout_quality(holdout.labels, scores, holdout.probs),
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
