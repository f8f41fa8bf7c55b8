"""The one door to TensorFlow's, tf-keras's and TFRA's private APIs and process-wide hooks.

Nothing else in tf_psx imports `tensorflow.python` or touches a private
attribute of a TF, tf-keras or TFRA object (tests/test_architecture.py greps
for it). One small module per patched thing, each naming the versions it was
read from (TF 2.16.2, tf-keras 2.16, TFRA 0.8.1); tests/test_tf_hooks.py
fails loudly when an upgrade moves one of them.

| module | what it reaches into |
|---|---|
| `keras` | `tf.keras` routing to tf-keras (TF_USE_LEGACY_KERAS), Keras 3 detection |
| `runtime` | gRPC fail-fast, the eager context, the coordinator, the ps count, closure retries |
| `tfra` | importing TFRA quietly, its ops on servers, `Model.compile`/`save` hooks for hash tables |
| `shadows` | per-worker copies of TFRA's shadow buffers |
| `fit_hooks` | `train_step` / optimizer-apply wrappers and fit's resume counters, for the callbacks |
| `exact_updates` | the per-variable lock around tf-keras optimizer updates and TFRA table updates |
| `weights` | `Layer.set_weights` taking unsharded lists |
| `checkpoint` | which objects a checkpoint restore matched |
| `data` | a tf.data dataset rebuilt from its serialized graph |

Importing this package is cheap: no module here imports TensorFlow at import
time except through the functions that need it.
"""
