"""`StallDoctor`: when `fit` stops making progress, logs why (closures by worker, task states, stacks).

The watching and the report are `tf_psx.training.stalls.StallWatch`'s; this module
starts and stops it with fit.
"""

from __future__ import annotations

from tf_psx._tf import runtime as _runtime
from tf_psx.callbacks.base import _RunCallback
from tf_psx.callbacks.probe import _coordinator
from tf_psx.training import stalls as _stalls

__all__ = ["StallDoctor", "DEFAULT_STALL_TIMEOUT_S"]

# StallDoctor: 10 minutes without a finished step. Far above a first trace
# (~20 s on 2 cores) and the time TF takes to notice a dead worker and re-run
# its step elsewhere, so a report means a real stall.
DEFAULT_STALL_TIMEOUT_S = 600.0


class StallDoctor(_RunCallback):
    """Logs why `fit` stopped making progress: closures by worker, task states, stacks.

    Under `ParameterServerStrategy`, when no step finishes for `timeout_s`
    while steps are pending, it logs one report (`tf_psx.training.stalls.StallWatch`):
    which worker runs which step since when and on which attempt, the state
    of each task process it knows (a worker stopped by SIGSTOP stands out),
    the coordinator's Python stacks, and it asks each running
    `tf_psx.server` task to write its stacks into its log. It changes
    nothing in training. Under other strategies it does nothing.

    Example:

    >>> doctor = tf_psx.callbacks.StallDoctor(timeout_s=300)  # doctest: +SKIP
    >>> model.fit(..., callbacks=[doctor])  # doctest: +SKIP
    >>> doctor.reports  # doctest: +SKIP
    []

    Args:
      timeout_s: number > 0, seconds without a finished step that make a stall.
      cluster: the `tf_psx.LocalCluster(processes=True)` the strategy runs
        on, for the task processes; under `tf-psx launch` the launcher's
        tasks are found without it.
      signal_tasks: ask the running tasks for their stacks (SIGUSR1).

    Attributes:
      reports: the text of every report of this callback's fits.

    Raises:
      ValueError: a bad `timeout_s`.
    """

    def __init__(self, timeout_s: float = DEFAULT_STALL_TIMEOUT_S, cluster=None, signal_tasks: bool = True):
        super().__init__()
        self.timeout_s = _stalls.check_timeout(timeout_s, "StallDoctor")
        self.cluster, self.signal_tasks = cluster, bool(signal_tasks)
        self.reports: list[str] = []
        self._watch: _stalls.StallWatch | None = None

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        if _runtime.is_parameter_server_strategy(self.model.distribute_strategy):
            self._watch = _stalls.StallWatch(_coordinator(self.model), self.timeout_s, cluster=self.cluster,
                                             signal_tasks=self.signal_tasks)
            self._watch.reports = self.reports
            self._watch.start()

    def on_train_end(self, logs=None):
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
