"""The rule that makes a step's scratch variables per worker (tf_psx._tf.worker_scratch), on traced graphs (unit tier)."""

from __future__ import annotations

import pytest
import tensorflow as tf

from tf_psx._tf import worker_scratch

pytestmark = pytest.mark.unit


def _scratch_of(step, *variables):
    graph = tf.function(step).get_concrete_function().graph
    found = {id(v) for v in worker_scratch.scratch_variables(graph)}
    return [v.name.split(":")[0] for v in variables if id(v) in found]


@pytest.mark.smoke
def test_a_variable_overwritten_before_any_read_is_scratch_and_the_others_are_not():
    counter = tf.Variable(0, trainable=False, name="counter")
    total = tf.Variable(0.0, trainable=False, name="total")
    state = tf.Variable(1.0, trainable=False, name="state")
    weight = tf.Variable(1.0, name="weight")
    overwritten_late = tf.Variable(0.0, trainable=False, name="overwritten_late")

    def step():
        counter.assign(0)  # TFRS Streaming: reset, then read and advanced
        start = counter.read_value()
        counter.assign_add(3)
        total.assign_add(2.0)  # a metric's total: global
        state.assign(state * 0.5)  # read first: carries a value from step to step
        weight.assign(4.0)  # trainable: never per worker
        seen = overwritten_late.read_value()
        overwritten_late.assign(1.0)  # read before the overwrite
        return start, seen

    assert _scratch_of(step, counter, total, state, weight, overwritten_late) == ["counter"]


def test_a_variable_first_used_inside_a_nested_function_is_left_where_it_is():
    buffer = tf.Variable(0, trainable=False, name="buffer")

    @tf.function
    def inner():
        buffer.assign(0)
        return buffer.read_value()

    assert not _scratch_of(lambda: inner(), buffer)  # pylint: disable=unnecessary-lambda
