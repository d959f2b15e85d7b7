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
And where a step's graph orders a clock op: `tf.function` runs every stateful op that takes
no resource in program order (its automatic control dependencies chain them), and a clock op
is one. In a step of several replicas, traced one after another, each replica's stamps would
wait for the previous replica's: replica 1's start stamp for replica 0's gradients, so every
replica but the first read a fraction of its compute time (3 equal CPU replicas at the even
split: 15-29 ms, 1.4-6 ms, 2.4-3.9 ms per step). `independent` exempts a stamp from that chain
through the graph's control-dependency manager (`Graph.experimental_acd_manager`, its
`run_independently`: the op still runs before the function returns, in parallel with the
rest); the stamp's own control inputs (what it waits for) stay.
Canary: tests/test_upstream_clock.py.
"""

import logging

import tensorflow as tf

from tf_hetbatch.distribute._upstream import versions

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


def independent(tensor) -> None:
    """Exempts the op of `tensor`, a stateful op of the function being traced, from the
    program order `tf.function` imposes on such ops (the module docs); a no-op eagerly or
    outside a function.

    Raises:
        RuntimeError: TensorFlow's manager lacks `run_independently` (the stamps would chain).
    """
    if tf.executing_eagerly():
        return
    manager = getattr(tf.compat.v1.get_default_graph(), "experimental_acd_manager", None)
    if manager is None:
        return  # not traced by tf.function: no automatic control dependencies to escape
    run_independently = getattr(manager, "run_independently", None)
    if run_independently is None:  # pragma: no cover - upstream change, the canary fails
        raise RuntimeError(
            "This TensorFlow's automatic control dependencies have no run_independently: the "
            "timing stamps of a step's replicas would wait for each other. Fix: use a "
            f"TensorFlow version tf_hetbatch supports: {versions.INSTALL_SUPPORTED}.")
    run_independently(tensor.op)
