"""Keras's `gradient_accumulation_steps` under the synchronous strategies: exactly one device
accumulating the same global batches (the stock strategies fail every traced step with it:
"`merge_call` called while defining a new graph", keras-team/keras#17429; the canary of that
is in `test_upstream_merge_calls.py`). Workers with different device layouts:
`test_multi_worker.py`."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from helpers import build_under, dense_model, max_weight_diff, regression_data

BATCH = 32


def _optimizer(kind):
    """A fresh optimizer accumulating 3 steps: momentum SGD; AdamW with weight decay, global
    clipping and EMA (each acts in the accumulation's update branch); a LossScaleOptimizer
    around an accumulating Adam (its cond holds the inner one's)."""
    if kind == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=3)
    if kind == "adamw":
        return keras.optimizers.AdamW(0.01, weight_decay=0.1, global_clipnorm=0.5, use_ema=True,
                                      gradient_accumulation_steps=3)
    return keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01, gradient_accumulation_steps=3))


def _fit(strategy, kind, steps_per_execution=1):
    x, y = regression_data(n=BATCH * 8)
    model = build_under(strategy, dense_model, optimizer=lambda: _optimizer(kind),
                        steps_per_execution=steps_per_execution)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return model, history.history


@pytest.mark.parametrize("sizes", [[7, 25], [16, 16]], ids=["uneven", "even"])
@pytest.mark.parametrize("kind", ["sgd", "adamw", "lso"])
def test_fit_accumulates_as_one_device(cpus, kind, sizes):
    ref, ref_history = _fit(None, kind)
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    strategy.set_batch_sizes(sizes)
    ours, history = _fit(strategy, kind)
    assert max_weight_diff(ours, ref) <= 1e-5
    np.testing.assert_allclose(history["loss"], ref_history["loss"], rtol=1e-5)
    # Negative control: the accumulation matters here.
    plain = build_under(None, dense_model, optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    plain.fit(*regression_data(n=BATCH * 8), batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert max_weight_diff(plain, ref) > 1e-3


@pytest.mark.parametrize("limits", [None, [4, 10]], ids=["whole", "micro_batches"])
def test_accumulation_with_steps_per_execution_and_micro_batches(cpus, limits):
    """4 steps per execution (not a multiple of the 3 accumulated), and micro-batches (each
    replica's share in pieces of at most 4 and 10 samples, one update per step)."""
    ref, _ = _fit(None, "sgd", steps_per_execution=4)
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    strategy.set_batch_sizes([9, 23])
    strategy.set_micro_batch_limits(limits)
    ours, _ = _fit(strategy, "sgd", steps_per_execution=4)
    assert max_weight_diff(ours, ref) <= 1e-5


def test_a_custom_loop_accumulates_as_one_device(cpus):
    """TensorFlow's custom-loop form: `apply_gradients` in the function a traced
    `strategy.run` calls."""
    x, y = regression_data(n=BATCH * 6)

    def make():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        return model, keras.optimizers.Adam(0.01, gradient_accumulation_steps=3)

    ref, ref_optimizer = make()
    for i in range(6):
        xb, yb = x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(ref(xb) - yb))
        ref_optimizer.apply_gradients(
            zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables))

    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    strategy.set_batch_sizes([7, 25])
    with strategy.scope():
        model, optimizer = make()

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(tf.square(model(xb) - yb)[:, 0],
                                              global_batch_size=BATCH)
        optimizer.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    @tf.function
    def train(xb, yb):
        strategy.run(step, args=(xb, yb))

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    for xb, yb in strategy.experimental_distribute_dataset(data):
        train(xb, yb)
    assert max_weight_diff(model, ref) <= 1e-5
