"""Canary of `_upstream.determinism`: TensorFlow's reader of op determinism, and that
`tf.timestamp` refuses to run under it (why `timing.now` reads the clock another way then)."""

import pytest
import tensorflow as tf

from tf_hetbatch.distribute import timing
from tf_hetbatch.distribute._upstream import determinism


@pytest.fixture
def op_determinism():
    from tensorflow.python.framework import config

    tf.config.experimental.enable_op_determinism()
    try:
        yield
    finally:
        config.disable_op_determinism()


def test_the_reader_follows_the_public_setter(op_determinism):
    assert determinism.op_determinism_enabled()


def test_the_reader_is_off_by_default():
    assert not determinism.op_determinism_enabled()


def test_timestamp_refuses_under_op_determinism_and_the_stamp_does_not(op_determinism):
    with pytest.raises(tf.errors.FailedPreconditionError, match="determinism"):
        tf.function(tf.timestamp)()
    stamp = tf.function(timing.now)()
    assert stamp.dtype == tf.float64 and stamp.shape == () and float(stamp) > 1.7e9
