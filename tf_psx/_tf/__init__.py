"""The one door to TensorFlow's, tf-keras's and TFRA's private APIs and process-wide hooks.

Nothing else in tf_psx imports `tensorflow.python` or touches a private
attribute of a TF, tf-keras or TFRA object (tests/test_architecture.py greps
for it). One small module per patched thing, each naming the versions it was
read from (TF 2.16.2 and 2.21, tf-keras 2.16 and 2.21, TFRA 0.8.1); tests/test_tf_hooks.py
fails loudly when an upgrade moves one of them.

| module | what it reaches into |
|---|---|
| `keras` | `tf.keras` routing to tf-keras (TF_USE_LEGACY_KERAS), Keras 3 detection |
| `runtime` | gRPC fail-fast, the eager context, the coordinator, the ps count, closure retries |
| `tfra` | importing TFRA quietly, its ops on servers, `Model.compile`/`save` hooks for hash tables |
| `shadows` | per-worker copies of TFRA's shadow buffers; direct writes of a shadow and its slots |
| `fit_hooks` | `train_step` / optimizer-apply wrappers and fit's resume counters, for the callbacks |
| `fit_inputs` | `fit` / `evaluate` under a coordinator: tf-keras's local DataHandler, resume position |
| `fed_steps` | `ClusterCoordinator.schedule` given a step's batches, packed |
| `fit_progress` | the `verbose=1` progress bar under a coordinator |
| `exact_updates` | tf-keras's optimizer `_update_step` (runs tf_psx.training.exact_updates' locked update) |
| `step_tokens` | the token of a scheduled step, the same in TF's re-runs of its closure |
| `lock_release` | a CriticalSection's release out of TF's program-order chain |
| `sync_training` | what tf_psx.training.sync_training patches: `strategy.run`, the apply, fit's tail flush |
| `weights` | `Layer.set_weights` taking unsharded lists; `.keras` / `.h5` tables saved whole |
| `lookup_layers` | a Keras lookup layer's per-worker table handle |
| `checkpoint` | which objects a checkpoint restore matched |
| `data` | a tf.data dataset rebuilt from its serialized graph |
| `loss_reduction` | tf-keras's refusal of a default-reduction loss object under a strategy, for one-replica workers |
| `captured_datasets` | a coordinator's `tf.data.Dataset` used inside a scheduled step: rebuilt in the step, or refused |
| `versions` | what differs between the TF versions supported (2.16.2-2.21): AutoGraph's rules, the profiler proto |

Importing this package is cheap: no module here imports TensorFlow at import
time except through the functions that need it.
"""
