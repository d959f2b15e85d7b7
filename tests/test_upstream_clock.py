"""Canaries of `_upstream.clock`: TensorFlow's readers of op determinism and of the XLA context
a graph is traced in, and that the host clock cannot be read as usual there: `tf.timestamp`
refuses to run under op determinism (`timing.now` then reads it another way), and no clock op
runs inside a function XLA compiles (a step traced there takes no stamps,
`timing.stamps_possible`)."""

import time

import pytest
import tensorflow as tf

from tf_hetbatch.distribute import timing
from tf_hetbatch.distribute._upstream import clock


@pytest.fixture
def op_determinism():
    from tensorflow.python.framework import config

    tf.config.experimental.enable_op_determinism()
    try:
        yield
    finally:
        config.disable_op_determinism()


def test_the_reader_follows_the_public_setter(op_determinism):
    assert clock.op_determinism_enabled()


def test_the_reader_is_off_by_default():
    assert not clock.op_determinism_enabled()


def test_timestamp_refuses_under_op_determinism_and_the_stamp_does_not(op_determinism):
    with pytest.raises(tf.errors.FailedPreconditionError, match="determinism"):
        tf.function(tf.timestamp)()
    stamp = tf.function(timing.now)()
    assert stamp.dtype == tf.float64 and stamp.shape == () and float(stamp) > 1.7e9


def _traced(fn, **kwargs):
    seen = []

    def body():
        seen.append(fn())
        return tf.constant(0)

    tf.function(body, **kwargs)()
    return seen[0]


def test_the_reader_is_true_inside_a_jit_compiled_function_and_functions_nested_in_it():
    assert _traced(clock.in_xla_context, jit_compile=True)
    inner = []

    @tf.function
    def nested():  # a plain function traced inside the compiled one (Keras's step in a loop)
        inner.append(clock.in_xla_context())
        return tf.constant(0)

    _traced(nested, jit_compile=True)
    assert inner == [True]
    assert _traced(timing.stamps_possible, jit_compile=True) is False


def test_the_reader_is_false_eagerly_and_in_a_plain_function():
    assert not clock.in_xla_context()
    assert not _traced(clock.in_xla_context)
    assert _traced(timing.stamps_possible) is True


@pytest.mark.parametrize("read_clock", [tf.timestamp, lambda: tf.py_function(time.time, [],
                                                                               tf.float64)],
                         ids=["timestamp", "py_function"])
def test_the_host_clock_has_no_xla_kernel(read_clock):
    # What timing.now would take inside the step: neither compiles.
    with pytest.raises(tf.errors.InvalidArgumentError, match="No registered"):
        tf.function(read_clock, jit_compile=True)()
    assert float(tf.function(read_clock)()) > 1.7e9  # outside XLA it runs


def _control_inputs(fn):
    graph = tf.function(fn).get_concrete_function().graph
    stamps = [op for op in graph.get_operations() if op.type in ("Timestamp", "EagerPyFunc")]
    return [[c.name for c in op.control_inputs] for op in stamps]


def test_tf_function_chains_clock_ops_in_program_order():
    # The fact `clock.independent` exists for: a replica's stamps would wait for the others'.
    def two_stamps():
        return tf.timestamp(), tf.timestamp()

    assert _control_inputs(two_stamps) == [[], ["Timestamp"]]


def test_an_independent_stamp_waits_for_nothing_but_still_runs():
    def two_stamps():
        return timing.now(), timing.now()

    assert _control_inputs(two_stamps) == [[], []]
    first, second = tf.function(two_stamps)()
    assert float(first) > 1.7e9 and float(second) > 1.7e9


def test_an_independent_stamp_under_op_determinism_waits_for_nothing(op_determinism):
    def two_stamps():
        return timing.now(), timing.now()

    assert _control_inputs(two_stamps) == [[], []]
