"""Canary of `_upstream.xla`: TensorFlow's reader of the XLA context a graph is traced in, and
that the host clock cannot be read inside a function XLA compiles (why a step traced there
takes no replica timing stamps, `timing.stamps_possible`)."""

import time

import pytest
import tensorflow as tf

from tf_hetbatch.distribute import timing
from tf_hetbatch.distribute._upstream import xla


def _traced(fn, **kwargs):
    seen = []

    def body():
        seen.append(fn())
        return tf.constant(0)

    tf.function(body, **kwargs)()
    return seen[0]


def test_the_reader_is_true_inside_a_jit_compiled_function_and_functions_nested_in_it():
    assert _traced(xla.in_xla_context, jit_compile=True)
    inner = []

    @tf.function
    def nested():  # a plain function traced inside the compiled one (Keras's step in a loop)
        inner.append(xla.in_xla_context())
        return tf.constant(0)

    _traced(nested, jit_compile=True)
    assert inner == [True]
    assert _traced(timing.stamps_possible, jit_compile=True) is False


def test_the_reader_is_false_eagerly_and_in_a_plain_function():
    assert not xla.in_xla_context()
    assert not _traced(xla.in_xla_context)
    assert _traced(timing.stamps_possible) is True


@pytest.mark.parametrize("clock", [tf.timestamp, lambda: tf.py_function(time.time, [],
                                                                          tf.float64)],
                         ids=["timestamp", "py_function"])
def test_the_host_clock_has_no_xla_kernel(clock):
    # What timing.now would take inside the step: neither compiles.
    with pytest.raises(tf.errors.InvalidArgumentError, match="No registered"):
        tf.function(clock, jit_compile=True)()
    assert float(tf.function(clock)()) > 1.7e9  # outside XLA it runs
