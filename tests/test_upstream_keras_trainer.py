"""Canaries of `_upstream.keras_trainer`: Keras 3's multi-step loop and its own train step.

When one fails after an upgrade, read the matching section of
`tf_hetbatch/distribute/_upstream/keras_trainer.py`: the workaround may be obsolete
(lift it) or broken (fix it), but it must not go on silently.
"""

import keras
import pytest
import tensorflow as tf

from tf_hetbatch.distribute._upstream import keras_trainer
from helpers import OwnStep, dense_model, regression_data, stock_mirrored


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
