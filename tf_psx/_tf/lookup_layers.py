"""Keras lookup layers (StringLookup, IntegerLookup) in exact evaluation under ParameterServerStrategy (TF 2.16.2).

Under ParameterServerStrategy a `StaticHashTable` made in the strategy's
scope is a `ps_values.DistributedTable`: one copy per worker, and in a traced
function its handle is a call-time capture that resolves to the copy of the
worker the step runs on. TF captures it into the graph being built. Inside a
loop or a branch that graph is the body's, whose call-time placeholders are
never fed: the step failed on the worker with "You must feed a value for
placeholder tensor '.../integer_lookup/None_Lookup/Placeholder' with dtype
resource". That was every model with a lookup layer in exact evaluation,
whose shard function loops over the batches (`evaluate(test_ds)`, `fit`'s
validation). Here the capture goes to the outermost function, where TF feeds
it, and the loop body captures that tensor as it captures any outer value.
(Training with `steps_per_execution > 1`, also a loop, ran with and without
this; tests/training/test_lookup_layers.py keeps both.)
"""

from __future__ import annotations

import threading

_install_lock = threading.Lock()
_INSTALLED = False


def install() -> None:
    """Makes `DistributedTable.resource_handle` capture into the outermost traced function (once)."""
    global _INSTALLED  # pylint: disable=global-statement
    with _install_lock:
        if _INSTALLED:
            return
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        from tensorflow.python.distribute import ps_values  # pylint: disable=import-outside-toplevel,no-name-in-module
        from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
        from tensorflow.python.saved_model import save_context  # pylint: disable=import-outside-toplevel

        from tf_psx._tf.shadows import outermost_func_graph  # pylint: disable=import-outside-toplevel

        original = ps_values.DistributedTable.resource_handle

        def resource_handle(self):
            if context.executing_eagerly() or save_context.in_save_context():
                return original.fget(self)
            self._maybe_build_distributed_table()  # pylint: disable=protected-access
            closure, spec = self.resource_handle_call_time_value()
            graph = outermost_func_graph(tf.compat.v1.get_default_graph())
            with graph.as_default():
                return graph.capture_call_time_value(
                    closure, spec, key=("tf_psx_distributed_table", id(self)),
                    default_value=self._coordinator_instance.resource_handle)  # pylint: disable=protected-access

        ps_values.DistributedTable.resource_handle = property(resource_handle, doc=original.__doc__)
        _INSTALLED = True
