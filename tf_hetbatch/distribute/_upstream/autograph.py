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
slower, not wrong).

A tf.function handed to `strategy.run` is run as the stock strategy runs one
(`function_around_run`). Canaries: `tests/test_upstream_autograph.py`.
"""

import inspect
import logging
import weakref

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


# --- A tf.function handed to `strategy.run` (tensorflow: mirrored_run.call_for_each_replica) --
# Given a tf.function, the stock `run` does not call it in each replica's thread (a merge_call,
# e.g. the optimizer's all-reduce, cannot run inside a nested function: "`merge_call` called
# while defining a new graph or a tf.function"): it clones the function (`Function._clone`:
# the same name, input signature, AutoGraph, jit_compile and retracing arguments) around
# `call_for_each_replica` of its Python function, so the replicas' threads and their merge
# calls run inside it, and caches the clone per strategy and function. A tf_hetbatch strategy
# does the same one level up: the clone's body is the strategy's whole `run` of the Python
# function (its weights, timing and global logs included), as if the user had written
# `tf.function(lambda *a: strategy.run(fn.python_function, a))` with the function's arguments;
# the clone, a user's function, is converted by AutoGraph as the original would have been.
# As stock, not for a function compiled by XLA when every device is a GPU (stock calls it per
# replica: no merge calls there). Private: `Function._clone`, `_jit_compile`; canary
# `test_a_tf_function_handed_to_the_stock_run_is_cloned_around_the_replicas`.
try:
    from tensorflow.python.eager import def_function
except ImportError as error:  # pragma: no cover - upstream change
    logger.debug("tf.function class unavailable (%s): a tf.function passed to run is called "
                 "per replica", error)
    def_function = None


def function_clones():
    """A cache for `function_around_run`, one per strategy (held by the strategy)."""
    return weakref.WeakKeyDictionary()  # function -> {options: clone}


def function_around_run(strategy, fn, options, clones):
    """If `fn` is a tf.function that the stock `run` would clone around its replicas: a clone
    of it (cached in `clones`, from `function_clones`) whose body is
    `strategy.run(fn.python_function, args, kwargs, options)`; else None (`run` goes on as for
    a Python function)."""
    if def_function is None or not isinstance(fn, def_function.Function):
        return None
    if getattr(fn, "_jit_compile", False) and all(
            "GPU" in (d.upper().rsplit("/", 1)[-1]) for d in strategy.extended.worker_devices):
        return None
    by_options = clones.setdefault(fn, {})
    key = _options_key(options)
    clone = by_options.get(key)
    if clone is None:
        python_function = fn.python_function

        def run_in_function(*args, **kwargs):
            return strategy.run(python_function, args=args, kwargs=kwargs, options=options)

        clone = by_options[key] = fn._clone(python_function=run_in_function)
    return clone


def _options_key(options):
    try:
        hash(options)
    except TypeError:
        return id(options)
    return options
