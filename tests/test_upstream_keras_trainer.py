"""Canaries of `_upstream.keras_trainer`: Keras 3's multi-step loop and its own train step.

When one fails after an upgrade, read the matching section of
`tf_hetbatch/distribute/_upstream/keras_trainer.py`: the workaround may be obsolete
(lift it) or broken (fix it), but it must not go on silently.
"""

import keras
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch.distribute._upstream import keras_trainer
from helpers import OwnStep, build_under, dense_model, regression_data, stock_mirrored


def test_stock_strategy_still_fails_with_steps_per_execution(cpus):
    """keras-team/keras#19246: while this fails, tf_hetbatch inlines the one-step function
    (`keras_trainer.inline_multi_step`); once it passes, drop that workaround."""
    strategy = stock_mirrored(cpus[:2])
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse", steps_per_execution=4)
    x, y = regression_data(n=64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="placeholder|Placeholder"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert keras_trainer.STEPS_PER_EXECUTION_BROKEN


def test_keras_train_step_does_nothing_after_the_update_but_the_metrics():
    """Why the update of Keras's own train step may wait for the step's one all-reduce
    (`weighting.finish_step`): after `apply_gradients` it only computes and returns the
    metrics. If Keras changes the step, this fails: re-check
    `keras_trainer.is_keras_own_train_step`."""
    import inspect

    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    source = inspect.getsource(TensorFlowTrainer.train_step)
    assert source.count("apply_gradients(") == 1
    after = [line.strip() for line in source.split("apply_gradients(", 1)[1].splitlines()[1:]]
    assert [line for line in after if line and not line.startswith("#")] == [
        "else:",
        'warnings.warn("The model does not have any trainable weights.")',
        "return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)",
    ]
    assert keras_trainer.is_keras_own_train_step(keras.Sequential().train_step)
    assert not keras_trainer.is_keras_own_train_step(OwnStep().train_step)


def test_inlined_multi_step_loop_is_a_copy_of_the_installed_one():
    """`keras_trainer._make_function_inlined` is Keras's `TensorFlowTrainer._make_function`
    with the one-step function inlined, so it is right only while Keras's is the one copied
    (`KNOWN_MAKE_FUNCTION_DIGESTS`; else steps_per_execution > 1 is refused). Keras 3.8-3.11
    have another loop, without `_autoconvert_optionals`, which the copy calls. If this fails
    after an upgrade: re-copy the method and record its digest."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    digest = keras_trainer.source_digest(TensorFlowTrainer._make_function)
    assert digest in keras_trainer.KNOWN_MAKE_FUNCTION_DIGESTS, digest
    assert callable(getattr(TensorFlowTrainer, "_autoconvert_optionals", None))


class OwnLoop(keras.Sequential):
    """A model with a multi-step loop of its own (Keras's, wrapped): not the one copied."""

    def _make_function(self, step_function):
        return super()._make_function(step_function)


def own_loop_model(steps_per_execution):
    model = OwnLoop([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", steps_per_execution=steps_per_execution)
    return model


def test_steps_per_execution_with_another_multi_step_loop_is_refused(cpus):
    """`keras_trainer.inline_multi_step` replaces the model's `_make_function`: where it is not
    the copied one (another Keras, or a model's own) steps_per_execution > 1 is refused,
    before any step, naming the fix; steps_per_execution == 1 does not use it."""
    x, y = regression_data(n=64)
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model = build_under(strategy, own_loop_model, steps_per_execution=2)
    with pytest.raises(ValueError, match=r"_make_function.*OwnLoop.*steps_per_execution=2"
                       r".*pip install 'keras>=3\.12,<3\.16'"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
    model = build_under(strategy, own_loop_model, steps_per_execution=1)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2


def test_keras_one_step_function_takes_its_batch_inside():
    """Why a training step that runs out of memory needs our own one-step function to run
    again (`keras_trainer.guard_train_step`): Keras's takes its batch from the iterator inside
    the traced function (so a failed step has consumed it), and `fit` calls
    `train_function(iterator)` and ends the epoch on OutOfRangeError. If Keras changes either,
    re-check `_make_function_inlined` and `_guarded_one_step` against the new code."""
    import inspect

    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    make = inspect.getsource(TensorFlowTrainer._make_function)
    assert "if self.steps_per_execution == 1:" in make
    assert "one_step_on_data(iterator.get_next())" in "".join(make.split())
    fit = inspect.getsource(TensorFlowTrainer.fit)
    assert "self.train_function(iterator)" in fit
    from keras.src.backend.tensorflow.trainer import TFEpochIterator

    stop = inspect.getsource(TFEpochIterator.catch_stop_iteration)
    assert "except tf.errors.OutOfRangeError:" in stop and "raise StopIteration" in stop
