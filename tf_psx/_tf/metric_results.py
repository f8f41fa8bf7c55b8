"""The logs of `fit` and `evaluate` under a cluster: the metrics' state over the epoch, not one step's return.

tf-keras 2.16-2.21's `Model._validate_and_get_metrics_result(logs)` replaces
the last step's logs by the model's metric results only when the two have
the same keys; otherwise, under a `ClusterCoordinator`, it logs "Could not
get Model metric results" and keeps the logs of whichever step was
scheduled last. TensorFlow Recommenders' `train_step` / `test_step` return
`loss`, `regularization_loss` and `total_loss` beside the metrics, so every
TFRS model fell back: with 2 workers an evaluation of 800 examples in 4
batches reported the top-k accuracies of 600 (the step read them while the
other worker's step was still running).

Here, under a coordinator, every key that names a metric of the model is
its metric result, read after the epoch's steps are done; a key that names
no metric (TFRS's losses) keeps the value the last step returned, as
before. Without a coordinator, tf-keras's own method runs unchanged.
"""

from __future__ import annotations

_INSTALLED = False


def install() -> None:
    """Patches `Model._validate_and_get_metrics_result` once."""
    global _INSTALLED  # pylint: disable=global-statement
    if _INSTALLED:
        return
    from tf_keras.src.engine import training  # pylint: disable=import-outside-toplevel
    from tf_keras.src.utils import tf_utils  # pylint: disable=import-outside-toplevel

    from tf_psx._tf.keras import wrapped_like  # pylint: disable=import-outside-toplevel

    original = training.Model._validate_and_get_metrics_result  # pylint: disable=protected-access

    def _validate_and_get_metrics_result(self, logs):
        if not getattr(self, "_cluster_coordinator", None) or not isinstance(logs, dict):
            return original(self, logs)
        try:
            metric_logs = self.get_metrics_result()
        except TypeError:
            return original(self, logs)
        if set(logs) == set(metric_logs):
            return tf_utils.sync_to_numpy_or_python_type(metric_logs)
        merged = dict(logs)
        merged.update(metric_logs)
        return tf_utils.sync_to_numpy_or_python_type(merged)

    training.Model._validate_and_get_metrics_result = wrapped_like(  # pylint: disable=protected-access
        _validate_and_get_metrics_result, original)
    _INSTALLED = True
