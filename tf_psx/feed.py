"""Exactly-once input under ParameterServerStrategy: the coordinator reads the batches.

With `model.fit` under `ParameterServerStrategy`, every worker runs its own
copy of the dataset (TF gives each one `input_pipeline_id` 0), and TF cannot
checkpoint those per-worker iterators: a resumed run starts the data again,
replaying or skipping examples. `CoordinatorFeed` trades some coordinator
work for an exact position:

* the coordinator iterates the dataset itself and hands each batch, as the
  arguments of one scheduled step, to whichever worker is free; a step that
  TF re-runs after a worker failure re-runs with the same batch;
* every `every_n_steps` steps it waits for the scheduled steps (a barrier)
  and writes one checkpoint of the model, the optimizer and the dataset
  iterator's position (`tf.train.Checkpoint` saves tf.data iterators), so
  the position always matches the weights;
* `fit` restores the newest checkpoint of `directory`: the steps applied
  after it are rolled back with the weights and fed again, so in the final
  model every batch was applied exactly once.

Example (a script run by `tf-psx launch`; tests/scripts/exactly_once_feed.py
is a complete one):

    strategy = tf_psx.ParameterServerStrategy()
    with strategy.scope():
        model = build_and_compile()
    feed = tf_psx.feed.CoordinatorFeed(model, dataset, tf_psx.launch.snapshot_dir(), every_n_steps=100)
    feed.fit(steps=10_000)

Known limitations:
  * The batches travel from the coordinator to the workers: the input rate
    is bounded by one process's reading and sending. Use it where exactness
    of the data position matters more than the input rate.
  * A worker that fails in the middle of applying a step can leave part of
    it applied before TF runs it again elsewhere (TF's at-least-once retry);
    exactly-once holds across coordinator crashes and restarts.
  * The dataset must be the same, in the same order, on every run (seeded
    shuffles), as for any iterator checkpoint; `dataset.repeat()` for more
    than one epoch.
  * Keras callbacks are not called; `fit` returns the losses it read.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tf_psx import _checks
from tf_psx._tf import runtime as _runtime

logger = logging.getLogger("tf_psx")

# Checkpoints kept in `directory` (the newest is restored; older ones are for a bad disk).
DEFAULT_MAX_TO_KEEP = 3


class CoordinatorFeed:
    """Trains `model` on `dataset` with each batch applied exactly once across restarts.

    Args:
      model: a compiled tf-keras model built under a `ParameterServerStrategy`
        scope.
      dataset: a `tf.data.Dataset` of (features, labels) batches, in the same
        order on every run.
      directory: where the checkpoints go (any `tf.io.gfile` path).
      every_n_steps: int >= 1, steps between checkpoints (the steps a
        coordinator crash makes you train again).
      max_to_keep: checkpoints kept.

    Attributes:
      start_step: the step `fit` resumed from (0 on a fresh start).
      losses: the loss of every step `fit` scheduled, read when it ended.

    Raises:
      ValueError: bad arguments, or a model that is not under a
        ParameterServerStrategy.
    """

    def __init__(self, model, dataset, directory, every_n_steps: int, max_to_keep: int = DEFAULT_MAX_TO_KEEP):
        strategy = getattr(model, "distribute_strategy", None)
        if strategy is None or not _runtime.is_parameter_server_strategy(strategy):
            raise ValueError(
                "CoordinatorFeed needs a model built under a tf_psx.ParameterServerStrategy scope. "
                f"Received a model under {type(strategy).__name__}. Fix: build and compile the model inside "
                "`with strategy.scope():`, or use model.fit with PeriodicSync under other strategies."
            )
        if not isinstance(dataset, tf.data.Dataset):
            raise ValueError(f"Argument `dataset` of CoordinatorFeed must be a tf.data.Dataset of batches. "
                             f"Received: {type(dataset).__name__}. Fix: pass e.g. tf.data.Dataset.from_tensor_slices("
                             "(x, y)).batch(64).")
        if not isinstance(directory, str) or not directory:
            raise ValueError(f"Argument `directory` of CoordinatorFeed must be a non-empty path. Received: "
                             f"{directory!r}. Fix: pass e.g. tf_psx.launch.snapshot_dir().")
        self.every_n_steps = _checks.int_at_least(every_n_steps, 1, "every_n_steps", owner="CoordinatorFeed",
                                                  fix="pass e.g. every_n_steps=100")
        max_to_keep = _checks.int_at_least(max_to_keep, 1, "max_to_keep", owner="CoordinatorFeed",
                                           fix=f"pass e.g. max_to_keep={DEFAULT_MAX_TO_KEEP}")
        self.model, self.strategy = model, strategy
        self.coordinator = _runtime.coordinator_of(strategy)
        self._iterator = iter(dataset)
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer, data=self._iterator)
        self._manager = tf.train.CheckpointManager(self._checkpoint, directory, max_to_keep=max_to_keep)
        self.start_step = 0
        self.losses: list[float] = []
        self._done: int | None = None  # batches fed so far, once restored
        self._pending: list = []  # RemoteValues of the losses not read yet

        @tf.function
        def step(features, labels):
            outputs = strategy.run(lambda x, y: model.train_step((x, y)), args=(features, labels))
            return outputs.get("loss", tf.constant(0.0)) if isinstance(outputs, dict) else tf.constant(0.0)

        self._step = step

    def restore(self) -> int:
        """Restores the newest checkpoint (weights, optimizer, data position); returns its step (0 if none).

        The step is the number of batches fed before it (its checkpoint number).
        """
        latest = self._manager.latest_checkpoint
        step = 0
        if latest is not None:
            self._checkpoint.restore(latest).expect_partial()
            logger.info("CoordinatorFeed: resumed from %s", latest)
            step = int(latest.rsplit("-", 1)[1])
        self.start_step = self._done = step
        return step

    def fit(self, steps: int, save_at_end: bool = True) -> int:
        """Feeds batches until `steps` were fed in all (from the newest checkpoint); returns the batches fed.

        Args:
          steps: the batches to have fed in all, this run and the runs before it.
          save_at_end: also wait for the steps and checkpoint when `steps` is
            reached (between the `every_n_steps` checkpoints). False lets a
            caller feed in small pieces; the steps then run on in the background.

        Raises:
          ValueError: `steps` is not an int >= 0, or the dataset ended
            before `steps` batches (the steps fed so far are checkpointed).
        """
        steps = _checks.int_at_least(steps, 0, "steps", owner="CoordinatorFeed.fit", fix="pass e.g. steps=1000")
        if self._done is None:
            self.restore()
        done = self._done
        pending = self._pending
        while done < steps:
            try:
                features, labels = next(self._iterator)
            except StopIteration:
                self.coordinator.join()
                self._manager.save(checkpoint_number=done)
                raise ValueError(
                    f"CoordinatorFeed.fit: the dataset ended after {done} batches; `steps` asked for {steps}. "
                    "Fix: add .repeat() to the dataset for more than one pass, or ask for fewer steps."
                ) from None
            # In the scope: the step's first trace builds the metrics' variables on the ps tasks.
            with self.strategy.scope():
                pending.append(self.coordinator.schedule(self._step, args=(features, labels)))
            done += 1
            if done % self.every_n_steps == 0 or (save_at_end and done == steps):
                self.coordinator.join()  # the barrier: the position saved is the weights' position
                self._manager.save(checkpoint_number=done)
                self.losses += [float(value.fetch()) for value in pending]
                pending.clear()
            self._done = done
        return done
