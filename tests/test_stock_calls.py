"""Calls the stock MirroredStrategy accepts run under HeteroMirroredStrategy, with its results.

Eager `strategy.run`s (a gradient made outside the step; float64 and float32 all-reduces in one
step), an eager loop followed by a traced one in one process, and a `tf.function` handed to
`strategy.run`: each equals the stock strategy on the same (even) split. Keras's own
tf.distribute tests: `test_keras_distribute_tests.py`; the multi-worker custom-loop tutorial on
an uneven device layout: `test_device_layout.py`.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from helpers import stock_mirrored


def _both(cpus, run):
    """`run(strategy)` under the stock strategy and ours, on 2 replicas: (stock's, ours)."""
    return run(stock_mirrored(cpus[:2])), run(hb.HeteroMirroredStrategy(cpus[:2]))


def _assert_same(stock, ours, rtol=1e-6):
    for a, b in zip(tf.nest.flatten(stock), tf.nest.flatten(ours)):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("accumulation", [None, 3], ids=["apply", "accumulated"])
def test_a_gradient_made_outside_an_eager_run_is_applied_as_stock(cpus, accumulation):
    """One tensor object on every replica: the stock all-reduce passes it on unsummed (Keras's
    gradient accumulation then sums the accumulated mean); ours failed batching it with its
    per-replica values (IndexError in `_all_reduce_per_replica_values`)."""
    def run(strategy):
        with strategy.scope():
            v = keras.Variable([[3.0, 4.0], [5.0, 6.0]])
            grads = tf.constant([[1.0, 1.0], [1.0, 2.0]])
            optimizer = keras.optimizers.SGD(1.0, use_ema=True, ema_momentum=0.9,
                                             gradient_accumulation_steps=accumulation)
            values = []
            for _ in range(4):
                strategy.run(lambda: optimizer.apply_gradients([(grads, v)]))
                values.append(v.numpy())
        return values

    stock, ours = _both(cpus, run)
    np.testing.assert_array_equal(ours, stock)


def test_an_eager_fit_in_float64_equals_stock(cpus):
    """`fit(run_eagerly=True)` with float64 weights: the step's float64 and float32 all-reduces
    each get an instance key of TensorFlow's (ours once gave both one fixed key: TensorFlow
    aborted every collective of the process, "expected data_type 2 but got data_type 1")."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8))
    y = x @ rng.normal(size=(8, 1))

    def run(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="tanh"),
                                      keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"], run_eagerly=True)
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return history.history, model.get_weights()

    # Keras fixes its global dtype policy from floatx when first read: both are set, and
    # both restored (a float64 policy left behind would build every later test's model in it).
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        stock, ours = _both(cpus, run)
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)
    assert ours[1][0].dtype == np.float64
    _assert_same(stock, ours, rtol=1e-12)


def _classification_loop(strategy, traced_epochs, as_tf_function=False,
                         optimizer=lambda: keras.optimizers.Adam(1e-2)):
    """Keras's "training loop from scratch" under `strategy` as TensorFlow's custom-loop
    tutorial distributes it: an eager epoch, then `traced_epochs` with the step in a
    tf.function. With `as_tf_function` the replica step itself is the tf.function handed to
    `strategy.run`. Returns (per-step losses, accuracies, weights, replica step traces)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = rng.integers(0, 3, size=(96,)).astype("int32")
    batch = 16
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(3)])
        optimizer = optimizer()
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(batch))
    traces = []

    def train_step(xb, yb):
        traces.append(1)
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.nn.compute_average_loss(loss_fn(yb, logits), global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        accuracy.update_state(yb, logits)
        return loss

    if as_tf_function:
        train_step = tf.function(train_step)

    def distributed_step(xb, yb):
        return strategy.reduce("SUM", strategy.run(train_step, args=(xb, yb)), axis=None)

    traced = tf.function(distributed_step)
    losses, accuracies = [], []
    for step in [distributed_step] + [traced] * traced_epochs:
        losses.append([float(step(xb, yb)) for xb, yb in dataset])
        accuracies.append(float(accuracy.result()))
        accuracy.reset_state()
    return losses, accuracies, model.get_weights(), len(traces)


def test_an_eager_loop_then_a_traced_loop_equals_stock(cpus):
    """Eager all-reduces take one instance key per tensor from TensorFlow's counter, traced
    ones one key per pack fixed at trace time: ours once gave an eager value and the traced
    pack one key ("Shape mismatch in the collective instance")."""
    stock, ours = _both(cpus, lambda s: _classification_loop(s, traced_epochs=2))
    _assert_same(stock[:3], ours[:3])


def test_a_tf_function_handed_to_run_runs_as_stock(cpus):
    """The stock `run` clones a tf.function around its replicas (its optimizer's merge call
    cannot run inside a nested function); ours runs its whole `run` inside such a clone, traced
    once as stock's, in an eager loop and inside a traced one. (Plain SGD: with an optimizer
    that builds its slots in a `cond`, momentum or Adam, the stock run of such a function
    fails, "You must feed a value for placeholder tensor 'cond/Placeholder'".)"""
    stock, ours = _both(cpus, lambda s: _classification_loop(
        s, traced_epochs=1, as_tf_function=True, optimizer=lambda: keras.optimizers.SGD(0.1)))
    _assert_same(stock[:3], ours[:3])
    assert ours[3] == stock[3]  # traces of the replica step: no retrace per call
