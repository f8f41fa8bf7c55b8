"""`fit` over a tf.data service ("distributed_epoch") that LocalCluster started: each example trained once per epoch.

The counting model of tests/scripts/exact_epochs.py (one Adagrad row per
example, a loss linear in the rows, so a row's value says how many times
its example was applied). The dataset's elements are whole batches (the
service splits the source between its data workers; a batch made after the
split could come out partial and change the gradient), read by
`data_workers` data workers and sent by the coordinator with each step.

Prints `RESULT {json}`: how many rows were applied 0, 1, 2, ... times,
the epochs, and the service's address.

Usage: data_service_fit.py [--processes] [--data-workers 2] [--epochs 2] [--mode distributed_epoch] [--launched]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import numpy as np

import tf_psx
from tf_psx.cluster import data_service
import tensorflow as tf

from exact_epochs import BATCH, BATCHES, applications, build, rows_of  # pylint: disable=wrong-import-position


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", action="store_true")
    parser.add_argument("--data-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--launched", action="store_true",
                        help="the chief of tf-psx launch --data-workers N (TF_CONFIG's cluster, $TF_PSX_DATA_SERVICE)")
    parser.add_argument("--mode", default="distributed_epoch",
                        help='"parallel_epochs": every data worker reads all of it (the check must fail)')
    args = parser.parse_args(argv)
    count = BATCHES * BATCH
    local = tf_psx.LocalCluster(num_workers=2, num_ps=1, processes=args.processes, data_workers=args.data_workers)
    with (tf_psx.launched_or(local) if args.launched else local) as cluster:
        service = data_service.service_address(cluster)
        strategy = tf_psx.ParameterServerStrategy(cluster)
        model = build(strategy, count)
        ids = np.arange(count, dtype=np.int64).reshape(BATCHES, BATCH, 1)
        dataset = tf.data.Dataset.from_tensor_slices((ids, np.zeros((BATCHES, BATCH), np.float32))).apply(
            tf.data.experimental.service.distribute(processing_mode=args.mode,
                                                    service=service))
        history = model.fit(dataset, epochs=args.epochs, verbose=0)
        applied = [applications(row) for row in rows_of(model, count, tfra=False)]
        print("RESULT " + json.dumps({
            "service": service, "rows": count, "epochs": len(history.history["loss"]),
            "counts": {str(k): v for k, v in sorted(collections.Counter(applied).items())},
            "iterations": int(model.optimizer.iterations.numpy()),
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
