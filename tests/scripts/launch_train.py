"""A tiny training command for `tf-psx launch` tests: run as the chief (or evaluator).

    tf-psx launch --workers 2 --ps 1 -- python tests/scripts/launch_train.py --epochs 3 --steps 40

The task: ids in [0, VOCAB), two per example; the label is Bernoulli(sigmoid(
w[id0] + w[id1])) for fixed true weights w, so the model (an Embedding of dim
1, summed) can reach the Bayes loss. Everything is seeded: two runs see the
same data.

It prints, for the test to follow:
  * "tf_psx train start step=S attempt=A pid=P" once fit starts (S: the step it
    resumes from, after PeriodicSync restored a snapshot);
  * "tf_psx train step=N" after every batch, N = optimizer.iterations read
    from the ps (the steps really applied, not the steps scheduled);
  * "RESULT {json}" at the end (also written to --result): the final
    iterations, the steps of this fit that returned a finite loss to the
    coordinator, the start step, the epochs run and the holdout loss.

With --every N it uses tf_psx.callbacks.PeriodicSync(N, $TF_PSX_SNAPSHOT_DIR).
Run as the evaluator (`tf-psx launch --evaluator`) it evaluates the snapshots
with tf_psx.launch.run_sidecar_evaluator instead.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402

import tf_psx  # noqa: E402
from tf_psx import launch  # noqa: E402

VOCAB = 200
IDS_PER_EXAMPLE = 2
TRAIN_ROWS = 8192
HOLDOUT_ROWS = 4096
BATCH = 64
SEED = 0


def make_data(rows, seed):
    rng = np.random.default_rng(SEED)
    true_w = rng.normal(0.0, 1.5, size=VOCAB).astype(np.float32)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(rows, IDS_PER_EXAMPLE))
    probs = 1.0 / (1.0 + np.exp(-true_w[ids].sum(axis=1)))
    labels = (rng.random(rows) < probs).astype(np.float32)
    return ids, labels


def holdout_loss(weights):
    ids, labels = make_data(HOLDOUT_ROWS, seed=SEED + 1)
    emb, kernel, bias = weights  # [VOCAB, 1], [IDS_PER_EXAMPLE, 1], [1]
    logits = emb[ids, 0] @ kernel[:, 0] + bias[0]
    probs = np.clip(1.0 / (1.0 + np.exp(-logits)), 1e-7, 1 - 1e-7)
    return float(-np.mean(labels * np.log(probs) + (1 - labels) * np.log(1 - probs)))


def build_model(tf):
    inputs = tf.keras.Input((IDS_PER_EXAMPLE,), dtype=tf.int64)
    emb = tf.keras.layers.Embedding(VOCAB, 1, embeddings_initializer="zeros")(inputs)
    summed = tf.keras.layers.Flatten()(emb)
    out = tf.keras.layers.Dense(1, activation="sigmoid", kernel_initializer="ones")(summed)
    model = tf.keras.Model(inputs, out)
    model.compile(tf.keras.optimizers.SGD(0.5), "binary_crossentropy")
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch")
    parser.add_argument("--every", type=int, default=0, help="PeriodicSync interval (0: none)")
    parser.add_argument("--result", help="write the RESULT json here")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to wait after each batch")
    parser.add_argument("--slow-commit-at", type=int, default=0,
                        help="in the first attempt, hold the snapshot of this step for 30 s before its commit")
    args = parser.parse_args()

    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if launch.task_type() == "evaluator":
        model = build_model(tf)
        ids, labels = make_data(HOLDOUT_ROWS, seed=SEED + 1)
        data = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(512)
        count = launch.run_sidecar_evaluator(model, data)
        print(f"tf_psx evaluator done: {count} snapshot(s) evaluated", flush=True)
        return 0

    strategy = tf_psx.ParameterServerStrategy()
    with strategy.scope():
        model = build_model(tf)

    ids, labels = make_data(TRAIN_ROWS, seed=SEED)

    def dataset_fn(ctx):
        del ctx
        return tf.data.Dataset.from_tensor_slices((ids, labels)).shuffle(TRAIN_ROWS, seed=SEED).repeat().batch(BATCH)

    class Progress(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._supports_tf_logs = True  # batch hooks run under ParameterServerStrategy
            self.start_step = None
            self.step_losses = []

        def on_train_begin(self, logs=None):
            self.start_step = int(self.model.optimizer.iterations.numpy())
            attempt = os.environ.get(launch.CHIEF_ATTEMPT_ENV, "?")
            print(f"tf_psx train start step={self.start_step} attempt={attempt} pid={os.getpid()}", flush=True)

        def on_train_batch_end(self, batch, logs=None):
            # Under ParameterServerStrategy the logs are the RemoteValue of the
            # step's closure; kept to check that every step produced a loss.
            self.step_losses.append(logs)
            print(f"tf_psx train step={int(self.model.optimizer.iterations.numpy())}", flush=True)
            if args.step_sleep:
                time.sleep(args.step_sleep)

    progress = Progress()
    callbacks = []
    if args.every:
        from tf_psx.callbacks import PeriodicSync  # pylint: disable=import-outside-toplevel

        callbacks.append(PeriodicSync(args.every, launch.snapshot_dir()))
        if args.slow_commit_at and os.environ.get(launch.CHIEF_ATTEMPT_ENV, "0") == "0":
            import tf_psx.snapshots.engine as engine_module  # pylint: disable=import-outside-toplevel

            def slow_commit(path):
                # PeriodicSync's seam between a snapshot's files and its commit.
                if f"{args.slow_commit_at:012d}" in os.path.basename(path):
                    print(f"tf_psx committing snapshot step={args.slow_commit_at}", flush=True)
                    time.sleep(30)

            setattr(engine_module, "_hook_before_commit", slow_commit)
    callbacks.append(progress)
    history = model.fit(
        tf.keras.utils.experimental.DatasetCreator(dataset_fn),
        epochs=args.epochs,
        steps_per_epoch=args.steps,
        callbacks=callbacks,
        verbose=0,
    )
    logs = [v.fetch() if hasattr(v, "fetch") else v for v in progress.step_losses if v is not None]
    losses = [float(entry["loss"]) for entry in logs if "loss" in entry]
    result = {
        "iterations": int(model.optimizer.iterations.numpy()),
        # Steps of this fit whose closure returned a finite loss to the coordinator.
        "steps_with_loss": sum(1 for loss in losses if np.isfinite(loss)),
        "start_step": progress.start_step,
        "epochs_run": len(history.history["loss"]),
        "holdout_loss": holdout_loss(model.get_weights()),
        "attempt": int(os.environ.get(launch.CHIEF_ATTEMPT_ENV, "0")),
    }
    print("RESULT " + json.dumps(result), flush=True)
    if args.result:
        with open(args.result, "w", encoding="utf-8") as handle:
            json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
