"""Where a step's graph refuses a clock op (tensorflow: no public readers).

The per-replica timing stamps (`timing`) read the host clock inside the step's graph with
`tf.timestamp`. Two settings refuse it, and TensorFlow exposes a reader for neither:
- op determinism (`tf.config.experimental.enable_op_determinism()`): nondeterministic kernels
  refuse to run ("Timestamp cannot be called when determinism is enabled"); the reader is
  `tensorflow.python.framework.config.is_op_determinism_enabled`. A `tf.py_function` still
  reads the clock there.
- XLA (`model.compile(jit_compile=True)` makes Keras trace its one-step function, and with it
  the strategy's whole `run`, in `tf.function(jit_compile=True)`): no clock op has an XLA
  kernel ("No registered 'Timestamp' OpKernel for XLA_CPU_JIT"), `tf.py_function` neither.
  TensorFlow enters an XLA context while it traces such a function; the reader is
  `tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext` (the graph or any graph
  it is nested in).
Canary: tests/test_upstream_clock.py.
"""

import logging

import tensorflow as tf

logger = logging.getLogger(__name__)

try:
    from tensorflow.python.framework import config as _config
    from tensorflow.python.ops import control_flow_util as _control_flow_util
except ImportError as error:  # pragma: no cover - upstream change
    logger.debug("clock readers unavailable (%s)", error)
    _config = _control_flow_util = None


def op_determinism_enabled() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism()` is in force."""
    reader = getattr(_config, "is_op_determinism_enabled", None)
    return bool(reader()) if reader is not None else False


def in_xla_context() -> bool:
    """Whether the graph being built (or one it is nested in) is compiled by XLA: a function
    traced with `jit_compile=True`. False eagerly."""
    reader = getattr(_control_flow_util, "GraphOrParentsInXlaContext", None)
    if reader is None or tf.executing_eagerly():
        return False
    return bool(reader(tf.compat.v1.get_default_graph()))
