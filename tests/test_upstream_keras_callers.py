"""Canaries of `_upstream.keras_callers`: how Keras 3 calls a strategy, and from where.

When one fails after an upgrade, read the matching section of
`tf_hetbatch/distribute/_upstream/keras_callers.py`: the workaround may be obsolete
(lift it) or broken (fix it), but it must not go on silently.
"""

import keras
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch.distribute._upstream import collectives, keras_callers
from helpers import build_under, dense_model, regression_data, stock_mirrored


def test_keras_passes_the_bound_train_and_test_steps_to_strategy_run(cpus):
    """`keras_callers.keras_model_of_step`: Keras 3 passes the model's bound `train_step` and
    `test_step` to `strategy.run`; that is how our strategies find the model (and the optimizer)
    whose gradients they weight."""
    seen = []

    class Recording(tf.distribute.MirroredStrategy):
        def __init__(self, devices):
            collectives.assign_collective_key_base(self)
            super().__init__(devices)

        def run(self, fn, args=(), kwargs=None, options=None):
            seen.append(keras_callers.keras_model_of_step(fn))
            return super().run(fn, args=args, kwargs=kwargs, options=options)

    strategy = Recording(cpus[:2])
    model = build_under(strategy, dense_model)
    x, y = regression_data(n=64)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    model.evaluate(x, y, batch_size=32, verbose=0)
    assert (model, "train_step") in seen and (model, "test_step") in seen


def test_keras_distributes_data_from_fit_evaluate_and_predict_iterators(cpus):
    """`keras_callers.keras_loop_distributing_data`: Keras 3 distributes every dataset from a
    `TFEpochIterator` built in fit (training first, then validation inside the epoch loop),
    evaluate or predict. Evaluation data of any batch size relies on telling them apart."""
    seen = []

    class Recording(tf.distribute.MirroredStrategy):
        def __init__(self, devices):
            collectives.assign_collective_key_base(self)
            super().__init__(devices)

        def experimental_distribute_dataset(self, dataset, options=None):
            seen.append(keras_callers.keras_loop_distributing_data())
            return super().experimental_distribute_dataset(dataset, options)

    strategy = Recording(cpus[:2])
    model = build_under(strategy, dense_model)
    x, y = regression_data(n=64)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0,
              validation_data=(x, y), validation_batch_size=16)
    model.evaluate(x, y, batch_size=8, verbose=0)
    model.predict(x, batch_size=16, verbose=0)
    strategy.experimental_distribute_dataset(tf.data.Dataset.range(4).batch(2))  # custom loop
    # The validation iterator is built once per fit and cached by Keras.
    assert seen == ["train", "validation", "evaluate", "predict", None]
    assert set(keras_callers.EVALUATION_LOOPS) == {"validation", "evaluate", "predict"}


def test_stock_symbolic_build_reduces_the_data_batch_and_crashes_on_uneven_shapes(cpus):
    """`keras_callers.is_uneven_batch_reduce`: why HeteroMirroredStrategy.reduce handles uneven
    per-replica data batches (Keras's symbolic build reduces the first batch)."""
    strategy = stock_mirrored(cpus[:3])
    model = build_under(strategy, dense_model)
    x, y = regression_data(n=64)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # 32 over 3 replicas
    ours = hb.HeteroMirroredStrategy(cpus[:3])
    build_under(ours, dense_model).fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_all_layers_walks_nested_models():
    """`keras_callers.all_layers`: the private `_flatten_layers` walks nested models."""
    inner = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization()])
    outer = keras.Sequential([keras.Input((4,)), inner, keras.layers.Dense(1)])
    kinds = [type(layer).__name__ for layer in keras_callers.all_layers(outer)]
    assert "BatchNormalization" in kinds and "Dense" in kinds


def test_keras_own_steps_call_compute_loss(cpus):
    """`keras_callers.called_from_keras_own_step`: Keras's own train and test steps (also
    reached through a subclass's `super().train_step`) call `compute_loss`, and a custom step
    is told apart. If it fails, the loss value a step reads is weighted for the wrong reader."""
    seen = []

    class Recording(keras.Sequential):
        def compute_loss(self, *args, **kwargs):
            seen.append((type(self).__name__, keras_callers.called_from_keras_own_step()))
            return super().compute_loss(*args, **kwargs)

    class Custom(Recording):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                                 self.trainable_variables)
            return {"loss": loss}

    class Super(Recording):
        def train_step(self, data):
            return super().train_step(data)

    x, y = regression_data(n=32)
    for cls in (Recording, Custom, Super):
        model = cls([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        model.evaluate(x, y, batch_size=32, verbose=0)
    assert seen == [("Recording", True), ("Recording", True), ("Custom", False),
                    ("Custom", True), ("Super", True), ("Super", True)]


def test_keras_symbolic_build_reduces_the_data_batch_from_its_named_method(cpus):
    """`keras_callers.is_data_batch_reduce` (the multi-worker `reduce` answers Keras's
    build-time reduce of a data batch locally) finds Keras's `_maybe_symbolic_build` on the
    stack; if Keras renames or moves it, the multi-worker strategy would reduce a data batch
    across workers. A user's own reduce is not taken for it."""
    seen = []

    class Recording(tf.distribute.MirroredStrategy):
        def __init__(self, devices):
            collectives.assign_collective_key_base(self)
            super().__init__(devices)

        def reduce(self, reduce_op, value, axis):
            if axis is None:
                seen.append(keras_callers.is_data_batch_reduce(self, reduce_op, value))
            return super().reduce(reduce_op, value, axis)

    strategy = Recording(cpus[:2])
    model = build_under(strategy, dense_model)
    x, y = regression_data(n=64)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert True in seen, seen
    seen.clear()
    values = strategy.experimental_distribute_values_from_function(lambda ctx: tf.ones([2]))
    strategy.reduce("MEAN", values, axis=None)
    assert seen == [False]
