"""What the Keras-level callbacks need to adjust in how Keras 3 `fit` drives a strategy.

The workarounds themselves, and their canaries, are in `_upstream.keras_trainer`.
"""

from typing import Optional

import keras

from tf_hetbatch.distribute._upstream import keras_trainer as _keras_trainer


def undo_iteration_of_exhausted_step(model: keras.Model, iterations_at_begin: Optional[int],
                                     steps_trained: int) -> None:
    """Resets `model.optimizer.iterations` after a resumed epoch's exhausted extra step.

    A resumed epoch is shorter than Keras expects, so Keras runs one more train step, which
    finds the data out; under a tf.distribute strategy that step can still count one
    optimizer iteration. Local, no collective; the same value on every worker.

    Args:
        model: the model being fitted.
        iterations_at_begin: `optimizer.iterations` at the epoch's start, or None (nothing is
            done).
        steps_trained: the steps the epoch trained.
    """
    _keras_trainer.undo_iteration_of_exhausted_step(model, iterations_at_begin, steps_trained)
