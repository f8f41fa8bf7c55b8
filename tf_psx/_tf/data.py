"""tf.data internals (TF 2.16.2): a dataset rebuilt from its serialized graph."""

from __future__ import annotations


def dataset_without_python_functions(dataset):
    """The same dataset, rebuilt from its serialized graph, holding no Python function.

    A dataset built eagerly registers its map and filter functions in this
    process's eager context. When such a dataset outlives the connection to a
    cluster (a batch peeked before `ParameterServerStrategy` was created),
    deleting it later asks every task to remove functions they never had:
    "Tried to remove non-existent function" errors in the log, some at exit.
    The rebuilt dataset keeps its functions inside its graph; the Python
    ones go away here, before any connection can happen.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.python.ops import gen_experimental_dataset_ops  # pylint: disable=import-outside-toplevel

    graph = dataset._as_serialized_graph(strip_device_assignment=True)  # pylint: disable=protected-access
    variant = gen_experimental_dataset_ops.dataset_from_graph(graph)
    return tf.data.experimental.from_variant(variant, dataset.element_spec)


