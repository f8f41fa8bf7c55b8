"""Loads an export_serving SavedModel in a fresh process with no cluster and serves a batch.

    python tests/scripts/export_serve.py SAVED_MODEL_DIR INPUTS.npz OUTPUTS.npz

Imports TensorFlow only (not tf_psx, not TFRA): a served model must need
neither. Writes the `serving_default` outputs and those of `serve(inputs)`
(prefixed "serve/") to OUTPUTS.npz, and prints what it loaded.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main(path: str, inputs_path: str, outputs_path: str) -> int:
    loaded = tf.saved_model.load(path)
    inputs = {key: tf.constant(value) for key, value in np.load(inputs_path).items()}
    signature = loaded.signatures["serving_default"]
    outputs = {key: value.numpy() for key, value in signature(**inputs).items()}
    outputs.update({f"serve/{key}": value.numpy() for key, value in loaded.serve(inputs).items()})
    np.savez(outputs_path, **outputs)
    report = {
        "signatures": sorted(loaded.signatures),
        "signature_inputs": sorted(signature.structured_input_signature[1]),
        "variables": [[v.name, v.shape.as_list()] for v in loaded.model_variables],
        "tables": len(loaded.tables),
        # A restored table keeps its resource but not its Python methods.
        "table_sizes": [int(tf.raw_ops.LookupTableSizeV2(table_handle=t.resource_handle)) for t in loaded.tables],
        "devices": sorted({v.device for v in loaded.model_variables}),
        "modules": sorted(m for m in ("tf_psx", "tensorflow_recommenders_addons") if m in sys.modules),
        "remote_devices": [d.name for d in tf.config.list_logical_devices() if "/job:" in d.name and "localhost" not in d.name],
    }
    print("REPORT " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
