"""Keras 3's TensorFlow trainer: its multi-step loop, its own train step, its extra step.

`inline_multi_step` (keras-team/keras#19246) with Keras's `_make_function` inlined (refused
unless the model's is the copied one: `KNOWN_MAKE_FUNCTION_DIGESTS`), the logs a multi-step
loop defers to its end, the `steps_per_execution` check, whether a step is Keras's own
`train_step`, and the optimizer step count after a resumed epoch's exhausted step.
Canaries: `tests/test_upstream_keras_trainer.py`.
"""

import contextlib
import functools
import hashlib
import inspect
import io
import logging
import textwrap
import threading
import tokenize
from typing import Optional

import tensorflow as tf

from tf_hetbatch.distribute._upstream.iterators import next_as_optional

logger = logging.getLogger(__name__)


# --- Keras's own train_step (keras: TensorFlowTrainer.train_step) ----------------------------
# Canary: `test_keras_train_step_does_nothing_after_the_update_but_the_metrics`.
def is_keras_own_train_step(fn):
    """Whether `fn` is Keras's own `train_step` (not a subclass's): it applies the gradients once
    and after that only updates and reads the metrics, so the update may wait until the end of
    the step (see `weighting`, "One all-reduce per step")."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return getattr(fn, "__func__", None) is TensorFlowTrainer.train_step


# --- keras-team/keras#19246: steps_per_execution > 1 under MirroredStrategy ---------------------
# Keras 3 builds the multi-step function (`TensorFlowTrainer._make_function`) with the one-step
# function as a nested `tf.function` inside tf.cond inside tf.while_loop, which fails under
# MirroredStrategy, the stock one included ("You must feed a value for placeholder tensor").
# With the one-step function inlined (a plain Python function, traced into the loop) it works.
# `inline_multi_step(model)` gives THE model being trained under a tf_hetbatch strategy an
# instance-level `_make_function` that does exactly what Keras 3.15's does, with that one
# difference; it is installed when our strategy distributes the model's data (before Keras
# builds its train/test function). `test_upstream_keras_trainer.py` checks that the stock strategy
# still fails.
# Not fixed upstream as of Keras 3.15.1.
STEPS_PER_EXECUTION_BROKEN = True

# The copy is only right while the model's `_make_function` is the one it was made from:
# before any multi-step loop is inlined, the token digest of `type(model)._make_function`
# (`source_digest`: comments, blank lines and line breaks inside brackets ignored) must be one
# of these, else steps_per_execution > 1 is refused. Keras 3.12.0-3.15.1 share one digest;
# Keras 3.8-3.11 have another (their loop has no `_autoconvert_optionals`, which the copy
# calls). When Keras changes the method: re-copy it into `_make_function_inlined` and add the
# new digest here. Canary: `test_inlined_multi_step_loop_is_a_copy_of_the_installed_one`.
KNOWN_MAKE_FUNCTION_DIGESTS = frozenset({
    "fe28d58e77c1ecd9",  # Keras 3.12.0 .. 3.15.1
})


def inline_multi_step(model):
    """Makes `model`'s multi-step train/test functions inline their one-step function.

    A no-op for steps_per_execution == 1, with `jit_compile` (the inlined step would not be
    compiled by XLA, and Keras's own loop, a jit-compiled one-step function in the loop, fails
    under several replicas as keras-team/keras#19246 does: `check_steps_per_execution` refuses
    it), or where the Keras trainer method is not there; idempotent.

    Raises:
        ValueError: steps_per_execution > 1 and the model's `_make_function` is not the one
            the inlined copy was made from (`KNOWN_MAKE_FUNCTION_DIGESTS`).
    """
    spe = int(getattr(model, "steps_per_execution", 1) or 1)
    if (not STEPS_PER_EXECUTION_BROKEN or spe <= 1 or getattr(model, "jit_compile", False)
            or not hasattr(model, "_make_function")
            or getattr(model, "_tf_hetbatch_inlined_steps", False)):
        return
    _check_make_function_is_the_copied_one(model, spe)
    import types

    model._make_function = types.MethodType(_make_function_inlined, model)
    model._tf_hetbatch_inlined_steps = True
    model.train_function = model.test_function = None  # rebuilt with the inlined step


@functools.lru_cache(maxsize=None)
def source_digest(fn) -> Optional[str]:
    """A digest of `fn`'s source as tokens (comments, blank lines and line breaks inside
    brackets left out), or None when its source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    marks = {tokenize.INDENT: "<indent>", tokenize.DEDENT: "<dedent>", tokenize.NEWLINE: ";"}
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER}
    words = [marks.get(t.type, t.string)
             for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type not in skip]
    return hashlib.sha256(" ".join(words).encode()).hexdigest()[:16]


def _check_make_function_is_the_copied_one(model, spe):
    """Refuses a multi-step loop whose `_make_function` is not the one inlined here."""
    import keras

    digest = source_digest(getattr(type(model), "_make_function", None))
    if digest in KNOWN_MAKE_FUNCTION_DIGESTS:
        return
    raise ValueError(
        "`steps_per_execution` > 1 under a tf_hetbatch strategy runs tf_hetbatch's copy of "
        "Keras 3.12-3.15's multi-step loop (`TensorFlowTrainer._make_function` with the "
        "one-step function inlined, for keras-team/keras#19246), but the `_make_function` of "
        f"this model ({type(model).__name__}, keras=={keras.__version__}) is another one "
        f"(source digest {digest}). Received: steps_per_execution={spe}. Fix: pip install "
        "'keras>=3.12,<3.16' (and leave `_make_function` to Keras), or compile with "
        "steps_per_execution=1."
    )


def _make_function_inlined(self, step_function):
    """Keras 3.12-3.15's `_make_function` (`KNOWN_MAKE_FUNCTION_DIGESTS`), one step inlined."""
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = self.distribute_strategy.run(step_function, args=(data,))
        return reduce_per_replica(outputs, self.distribute_strategy, reduction="auto")

    one_step_on_data = self._autoconvert_optionals(one_step_on_data)

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_iterator(iterator):
        empty_outputs = tf.experimental.Optional.empty(None)  # spec set while tracing

        def cond(execution_step, optional_outputs, next_optional_inputs):
            return tf.logical_and(tf.less(execution_step, self.steps_per_execution),
                                  next_optional_inputs.has_value())

        def inner_body(execution_step, optional_outputs, next_optional_inputs):
            def has_next():
                next_optional_outputs = tf.experimental.Optional.from_value(
                    one_step_on_data(next_optional_inputs.get_value()))
                empty_outputs._element_spec = next_optional_outputs.element_spec
                return next_optional_outputs

            def no_has_next():
                optional_outputs._element_spec = empty_outputs._element_spec
                return optional_outputs

            next_optional_outputs = tf.cond(
                tf.logical_and(tf.less(execution_step, self.steps_per_execution),
                               next_optional_inputs.has_value()),
                has_next, no_has_next)
            return (execution_step + 1, next_optional_outputs,
                    tf.cond(tf.less(execution_step + 1, self.steps_per_execution),
                            lambda: next_as_optional(iterator),
                            lambda: next_optional_inputs))

        def body(execution_step, optional_outputs, next_optional_inputs):
            for _ in range(min(self.unrolled_steps_per_execution, self.steps_per_execution)):
                execution_step, optional_outputs, next_optional_inputs = inner_body(
                    execution_step, optional_outputs, next_optional_inputs)
            return execution_step, optional_outputs, next_optional_inputs

        with deferred_global_logs() as deferral:
            _, final, _ = tf.while_loop(
                cond, body,
                loop_vars=[tf.constant(0), empty_outputs, next_as_optional(iterator)])
        final._element_spec = empty_outputs.element_spec
        if not deferral.used:
            return final  # every step's logs were global already
        # The last step's logs, made global in one all-reduce per execution (every worker
        # takes the same branch: their data ends together). Installed only under our
        # strategies (`inline_multi_step`), which have `global_logs`.
        return tf.cond(
            final.has_value(),
            lambda: tf.experimental.Optional.from_value(
                self.distribute_strategy.global_logs(self, final.get_value())),
            lambda: final)

    if not self.run_eagerly:
        multi_step_on_iterator = tf.function(multi_step_on_iterator, reduce_retracing=True)

    guarded_step = _guarded_one_step(self, step_function, one_step_on_data)

    def function(iterator):
        if guarded_step is not None and isinstance(iterator, tf.distribute.DistributedIterator):
            return guarded_step(iterator)
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            opt_outputs = multi_step_on_iterator(iterator)
            if not opt_outputs.has_value():
                raise StopIteration
            return opt_outputs.get_value()
        for _, data in zip(range(self.steps_per_execution), iterator):
            outputs = one_step_on_data(data)
        return outputs

    function.multi_step = multi_step_on_iterator  # the traced execution, for inspection
    return function


# --- A training step re-run with the same data (keras: TensorFlowTrainer._make_function) ------
# Keras's one-step training function takes its batch from the iterator inside the traced
# function, so a step that fails has consumed its data. `guard_train_step(model, guard)` gives
# THE model an instance-level `_make_function` (the one above) whose one-step training function
# (steps_per_execution == 1) takes the batch eagerly and calls the traced step through
# `guard(run_step)`, which may call `run_step()` again with the same batch. Canary:
# `test_upstream_keras_trainer.test_keras_one_step_function_takes_its_batch_inside`.
def guard_train_step(model, guard) -> bool:
    """Runs `model`'s training steps (steps_per_execution == 1, no jit_compile, Keras's own
    `_make_function` of `KNOWN_MAKE_FUNCTION_DIGESTS`) through `guard(run_step, data)`, with
    `data` the step's distributed batch; returns whether it could (idempotent: the latest
    `guard` is used)."""
    spe = int(getattr(model, "steps_per_execution", 1) or 1)
    if spe != 1 or getattr(model, "jit_compile", False) or source_digest(getattr(
            type(model), "_make_function", None)) not in KNOWN_MAKE_FUNCTION_DIGESTS:
        return False  # another Keras's loop, or the model's own: left as it is
    model._tf_hetbatch_step_guard = guard
    if getattr(model, "_tf_hetbatch_guarded_steps", False):
        return True
    import types

    model._make_function = types.MethodType(_make_function_inlined, model)
    model._tf_hetbatch_guarded_steps = True
    model.train_function = None  # rebuilt with the guard
    return True


def _guarded_one_step(model, step_function, one_step_on_data):
    """The guarded one-step training function (`guard_train_step`), or None."""
    guard = getattr(model, "_tf_hetbatch_step_guard", None)
    if guard is None or int(model.steps_per_execution) != 1 or getattr(
            step_function, "__func__", None) is not getattr(type(model), "train_step", None):
        return None
    one_step = one_step_on_data
    if not model.run_eagerly:
        one_step = tf.function(one_step_on_data, reduce_retracing=True)

    def guarded_step(iterator):
        data = iterator.get_next()  # eager: OutOfRangeError ends the epoch, as in Keras
        return model._tf_hetbatch_step_guard(lambda: one_step(data), data)

    return guarded_step


_DEFERRED = threading.local()


class _Deferral:
    used = False  # a step of the loop returned logs that are not global yet


@contextlib.contextmanager
def deferred_global_logs():
    """While tracing a multi-step loop: our strategies' `run` may return logs of the right
    structure without the cross-replica reduce (`defer_global_logs()`); only the loop's last
    logs are read, and `_make_function_inlined` makes those global after the loop if a step
    deferred them (Keras's own train step does not: its logs ride on the gradients' all-reduce)."""
    previous = getattr(_DEFERRED, "state", None)
    _DEFERRED.state = state = _Deferral()
    try:
        yield state
    finally:
        _DEFERRED.state = previous


def defer_global_logs() -> bool:
    """Whether a step's logs may stay local (inside a multi-step loop); records that they did."""
    state = getattr(_DEFERRED, "state", None)
    if state is None:
        return False
    state.used = True
    return True


def check_steps_per_execution(model):
    """Refuses steps_per_execution > 1 where `inline_multi_step` could not be installed (data
    a user distributed, a jit-compiled model, another Keras multi-step loop), instead of
    failing deep inside TensorFlow.

    Raises:
        ValueError: steps_per_execution > 1 without the inlined multi-step loop.
    """
    spe = int(getattr(model, "steps_per_execution", 1) or 1)
    if STEPS_PER_EXECUTION_BROKEN and spe > 1 and not getattr(
            model, "_tf_hetbatch_inlined_steps", False):
        if getattr(model, "jit_compile", False):
            # Keras's own loop nests the jit-compiled one-step function in tf.cond inside
            # tf.while_loop: the stock strategy fails so with 2 replicas ("You must feed a
            # value for placeholder tensor"), and the inlined loop would not compile the step.
            raise ValueError(
                "`steps_per_execution` > 1 with `jit_compile=True` does not train under a "
                "tf_hetbatch strategy: Keras's multi-step loop with a jit-compiled step fails "
                "under several replicas (keras-team/keras#19246, the stock MirroredStrategy "
                "too), and tf_hetbatch's inlined loop would not compile the step. Received: "
                f"steps_per_execution={spe}, jit_compile=True. Fix: compile with "
                "steps_per_execution=1 (jit_compile=True trains so), or with "
                "jit_compile=False (steps_per_execution > 1 trains so).")
        _check_make_function_is_the_copied_one(model, spe)
        raise ValueError(
            "`steps_per_execution` > 1 works under a tf_hetbatch strategy when Keras's fit, "
            "evaluate or predict distributes the data (keras-team/keras#19246 breaks it in "
            "Keras itself otherwise), and without jit_compile. Received: steps_per_execution="
            f"{spe}, jit_compile={getattr(model, 'jit_compile', None)}. Fix: pass the "
            "tf.data.Dataset itself (not a distributed one) to fit, or compile with "
            "steps_per_execution=1."
        )


# --- A resumed (shortened) epoch: Keras runs one extra, empty train step ------------------------
def undo_iteration_of_exhausted_step(model, iterations_at_begin, steps_trained) -> None:
    """Resets `optimizer.iterations` after the step that found the shortened epoch's data out.

    A resumed epoch has fewer batches than Keras expects (`fit` takes the epoch length from the
    data's cardinality), so Keras runs one more train step, whose `get_next` ends the epoch
    with OutOfRangeError. Under a tf.distribute strategy that step's
    `optimizer.iterations.assign_add(1)` has no data dependency on the batch and can run
    before the error (seen with TensorFlow 2.21 / Keras 3.15: iterations one ahead of the
    steps trained); it would shift learning-rate schedules and Adam's bias correction. Nothing
    data-dependent runs (gradients, slots, weights, tf_hetbatch's step counter), so only the
    counter is restored. Local, no collective; the same value on every worker.
    """
    if iterations_at_begin is None:
        return
    expected = iterations_at_begin + steps_trained
    optimizer = getattr(model, "optimizer", None)
    actual = None if optimizer is None else int(optimizer.iterations.numpy())
    if actual is not None and actual != expected:
        logger.debug("optimizer.iterations %d after the resumed epoch's exhausted step; "
                     "reset to %d.", actual, expected)
        model.optimizer.iterations.assign(expected)
