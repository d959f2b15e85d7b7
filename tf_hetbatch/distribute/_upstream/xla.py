"""XLA: whether the graph being built is compiled by XLA (tensorflow: no public reader).

`model.compile(jit_compile=True)` makes Keras trace its one-step function, and with it the
strategy's whole `run`, in `tf.function(jit_compile=True)`: one XLA cluster. `tf.timestamp` has
no XLA kernel ("No registered 'Timestamp' OpKernel for XLA_CPU_JIT"), so a step traced there
takes no replica timing stamps (`timing.stamps_possible`). TensorFlow enters an XLA control
flow context while it traces a function compiled by XLA; the reader is
`tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext` (the graph or any graph
it is nested in). Canary: tests/test_upstream_xla.py.
"""

import logging

import tensorflow as tf

logger = logging.getLogger(__name__)

try:
    from tensorflow.python.ops import control_flow_util as _control_flow_util
except ImportError as error:  # pragma: no cover - upstream change
    logger.debug("XLA context reader unavailable (%s)", error)
    _control_flow_util = None


def in_xla_context() -> bool:
    """Whether the graph being built (or one it is nested in) is compiled by XLA: a function
    traced with `jit_compile=True`. False eagerly."""
    reader = getattr(_control_flow_util, "GraphOrParentsInXlaContext", None)
    if reader is None or tf.executing_eagerly():
        return False
    return bool(reader(tf.compat.v1.get_default_graph()))
