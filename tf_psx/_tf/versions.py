"""What differs between the TensorFlow versions tf_psx supports (2.16.2 through 2.21): the one place for it.

Each difference names the TF version it is for. tests/test_tf_hooks.py runs
every function here on the stack it runs on (CI runs it on both: TF 2.16.2
with TFRA, and the newest TF).

Importing this module does not import TensorFlow.
"""

from __future__ import annotations


def call_converted(fn, *args):
    """`fn(*args)` with `fn` converted by AutoGraph, as `tf.function` converts the function it is given.

    For tf-keras's own train and test functions, called by tf_psx from inside
    its own `tf.function` (`tf_psx._tf.fed_steps`). TF 2.21 added
    `DoNotConvert('tf_keras')` to AutoGraph's rules, so a call of tf-keras's
    Python function from converted code runs unconverted there, and its
    `for _ in tf.range(steps_per_execution)` fails ("Iterating over a
    symbolic tf.Tensor"). `user_requested=True` is what `tf.function` passes
    for its own function: it converts `fn` whatever the rules say, and the
    calls inside `fn` follow AutoGraph's rules as they would under
    tf-keras's own `tf.function` (the model's `train_step`, reached through
    `strategy.run`, is converted by it as it is without tf_psx). The rules
    themselves are not changed: a user's code is traced as it is without
    tf_psx. On TF 2.16 this is the conversion AutoGraph made anyway.
    """
    from tensorflow.python.autograph.core import ag_ctx, converter  # pylint: disable=import-outside-toplevel,no-name-in-module
    from tensorflow.python.autograph.impl import api  # pylint: disable=import-outside-toplevel,no-name-in-module

    # The options tf.function passes for its own function (no optional features: Feature.ALL also converts list
    # operations, which broke tf-keras's Layer internals on TF 2.16).
    options = converter.ConversionOptions(recursive=True, user_requested=True, optional_features=None)
    with ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED, options=options):
        return api.converted_call(fn, args, None, options=options)


def step_converted(fn):
    """`fn`, a function given to `strategy.run`, converted by AutoGraph as TF 2.16 converted it (where AutoGraph is on).

    TF's `strategy.run` converts its function with `tf_convert(fn, ctx)`,
    which leaves a function of an allowlisted module unconverted. TF 2.21
    allowlists `tf_keras`, so tf-keras's `run_step` runs unconverted and the
    model's own `train_step` / `test_step` with it: a `train_step` with a
    Python `if` or `for` on a tensor fails ("Using a symbolic `tf.Tensor` as
    a Python `bool` is not allowed") on TF 2.21 + tf-keras 2.21, even with
    no strategy (measured). Under tf_psx's strategy the function is
    converted as a user's own would be (`user_requested=True`), so the
    user's step is converted as on TF 2.16; with AutoGraph off
    (`tf.function(autograph=False)`) nothing is converted, as before. Only a
    function AutoGraph's rules leave unconverted (TF 2.21's tf_keras) is
    touched: on TF 2.16 `fn` is returned as it is (converting it there with
    `user_requested=True` reached tf-keras's Layer internals and failed).
    """
    from tensorflow.python.autograph.core import ag_ctx  # pylint: disable=import-outside-toplevel,no-name-in-module
    from tensorflow.python.autograph.impl import api, conversion  # pylint: disable=import-outside-toplevel,no-name-in-module

    if not conversion.is_allowlisted(fn):
        return fn
    return api.tf_convert(fn, ag_ctx.control_status_ctx(), user_requested=True)


def autograph_artifact(fn):
    """`fn` marked as AutoGraph's own: converted code calls it as it is (every TF version here)."""
    from tensorflow.python.autograph.impl import api  # pylint: disable=import-outside-toplevel,no-name-in-module

    return api.autograph_artifact(fn)


def xplane_pb2():
    """TF's profiler trace proto module (`XSpace`): in `tensorflow.tsl.profiler.protobuf` from TF 2.18 (2.21 checked),
    in `tensorflow.core.profiler.protobuf` before (2.16)."""
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2 as module  # pylint: disable=import-outside-toplevel
    except ImportError:
        from tensorflow.core.profiler.protobuf import xplane_pb2 as module  # pylint: disable=import-outside-toplevel
    return module
