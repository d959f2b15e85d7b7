"""AutoGraph: tf_hetbatch's own functions run as they are; users' are converted as before.

AutoGraph (the rewrite of Python control flow into graph ops that `tf.function`, tf.data and
`Strategy.run` apply) rewrites every function that a rewritten function calls, unless its module
is on TensorFlow's list of libraries it leaves alone (tensorflow, keras, ...:
`tensorflow/python/autograph/core/config.py`; no public way to add one). tf_hetbatch's functions
that run while a step or a tf.data function is traced are written in TensorFlow ops, with no
Python control flow on tensors: the rewrite only costs CPU, at the first trace in each process
(measured: the split's tf.data functions 0.4 s, 0.8 s with several workers' gather; a custom
loop's `strategy.run` and `reduce` 3 s). A stock strategy's methods are left alone by module.

A function marked as an AutoGraph artifact (what AutoGraph marks its own output with,
`autograph/impl/api.py`) is called as it is, in the AutoGraph status of its caller; nothing it
calls is rewritten unless it asks, as TensorFlow's own library code does (`tf_convert`, the
status read where the user called in):
- `methods_as_is(cls)`: a strategy class whose methods a user's rewritten step calls
  (`strategy.run`, `strategy.reduce`);
- `as_is(fn)`: a function handed to TensorFlow code that would rewrite it (tf.data, the stock
  `Strategy.run`), run in the status captured where `as_is` was called, so that what it
  hands on (a user's map that tf.data traces inside it) is converted as before;
- `like_stock_run(fn)`: a user's step function, converted as the stock `Strategy.run` converts
  it (by the status where `run` was called; not by default).
Where TensorFlow's pieces are gone, all three return their argument (rewritten, as before:
slower, not wrong). Canaries: `tests/test_upstream_autograph.py`.
"""

import inspect
import logging

logger = logging.getLogger(__name__)

try:
    from tensorflow.python.autograph.core import ag_ctx
    from tensorflow.python.autograph.impl.api import autograph_artifact, tf_convert
except ImportError as error:  # pragma: no cover - upstream change
    logger.debug("AutoGraph's artifact mark unavailable (%s): tf_hetbatch's code is rewritten",
                 error)
    ag_ctx = autograph_artifact = tf_convert = None


def methods_as_is(cls):
    """Class decorator: every function defined in `cls`'s body is called by AutoGraph as it is."""
    if autograph_artifact is not None:
        for value in vars(cls).values():
            if inspect.isfunction(value):
                autograph_artifact(value)
    return cls


def as_is(fn):
    """`fn` in a new function that AutoGraph calls as it is, in the status captured here."""
    if ag_ctx is None:
        return fn
    captured = ag_ctx.control_status_ctx()

    def run_as_is(*args, **kwargs):
        with ag_ctx.ControlStatusCtx(status=captured.status, options=captured.options):
            return fn(*args, **kwargs)

    return autograph_artifact(run_as_is)


def like_stock_run(fn):
    """`fn` as the stock `Strategy.run` calls it: converted by AutoGraph's status here."""
    if tf_convert is None:
        return fn
    return tf_convert(fn, ag_ctx.control_status_ctx(), convert_by_default=False)
