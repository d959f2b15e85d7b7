"""`jit_compile=True` under the synchronous strategies: the step XLA compiles takes no replica
timing stamps (`timing.stamps_possible`), trains exactly, and leaves the split where it is.

On logical CPUs only one replica per process compiles: the stock MirroredStrategy with XLA on
2 logical CPUs fails on its own ("Trying to access resource ... located in device CPU:1 from
device CPU:0"), so these run one replica, against one device without a strategy and against
the stock strategy.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from helpers import max_weight_diff, regression_data, stock_mirrored

TOL = 1e-6  # the same XLA program on the same device: rounding only


def jit_model(steps_per_execution=1):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"],
                  jit_compile=True, steps_per_execution=steps_per_execution)
    return model


def _fit(strategy, callbacks=()):
    x, y = regression_data(n=96)
    if strategy is None:
        model = jit_model()
    else:
        with strategy.scope():
            model = jit_model()
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                        validation_data=(x[:32], y[:32]), callbacks=list(callbacks))
    return model, history.history


@pytest.mark.parametrize("kind", ["mirrored", "multi_worker"])
def test_jit_compiled_fit_trains_like_one_device_and_the_stock_strategy(kind, caplog):
    ref, ref_logs = _fit(None)
    stock, stock_logs = _fit(stock_mirrored(["/cpu:0"]) if kind == "mirrored"
                             else tf.distribute.MultiWorkerMirroredStrategy())
    strategy = (hb.HeteroMirroredStrategy(["/cpu:0"]) if kind == "mirrored"
                else hb.HeteroMultiWorkerMirroredStrategy())
    with caplog.at_level(logging.WARNING, logger="tf_hetbatch"):
        ours, logs = _fit(strategy)
    assert max_weight_diff(ours, ref) <= TOL and max_weight_diff(ours, stock) <= TOL
    for key in ("loss", "mae", "val_loss", "val_mae"):
        np.testing.assert_allclose(logs[key], ref_logs[key], rtol=1e-5)
        np.testing.assert_allclose(logs[key], stock_logs[key], rtol=1e-5)
    # The steps took no stamps: nothing recorded, and the chief said so once, naming the fix.
    times = strategy.read_replica_times()
    assert times.steps.tolist() == [0.0] and times.compute_seconds.tolist() == [0.0]
    said = [r for r in caplog.records if "compiled by XLA" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"
    assert "jit_compile=False" in said[0].getMessage()
    assert "split stays where it is" in said[0].getMessage()


@pytest.mark.parametrize("initial", ["flops", "probe"])
def test_dynamic_batching_keeps_the_split_of_steps_that_are_not_timed(initial, caplog):
    strategy = hb.HeteroMirroredStrategy(["/cpu:0"])
    dynamic = hb.DynamicBatching(initial=initial, warmup_steps=1, interval=2, probe_steps=2)
    with caplog.at_level(logging.INFO, logger="tf_hetbatch"):
        _fit(strategy, callbacks=[dynamic])
    assert strategy.batch_sizes == (32,) and dynamic.settled_batch_sizes == (32,)
    assert [entry["new"] for entry in dynamic.history] == [[32]]  # the static split only
    if initial == "probe":
        assert dynamic.history[0]["reason"] == \
            "initial split: uniform (the probe measured no replica)"
    assert len(dynamic.windows) >= 2 and not any(w["used"] for w in dynamic.windows)
    # No window says a worker finished no update (these are synchronous steps, all trained).
    assert not [r for r in caplog.records if r.levelno >= logging.INFO
                and "finished no update" in r.getMessage()]


def test_a_custom_loop_in_a_jit_compiled_function_trains_like_the_stock_strategy():
    x, y = regression_data(n=64)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)

    def train(strategy):
        with strategy.scope():
            model = jit_model()
            optimizer = keras.optimizers.SGD(0.05)
            optimizer.build(model.trainable_variables)

        def step(batch):
            features, labels = batch
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(
                    tf.reduce_mean(tf.square(model(features) - labels), axis=-1),
                    global_batch_size=32)
            optimizer.apply(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables)
            return loss

        @tf.function(jit_compile=True)
        def run(batch):
            return strategy.run(step, args=(batch,))

        for batch in strategy.experimental_distribute_dataset(dataset):
            run(batch)
        return model

    ours = train(hb.HeteroMirroredStrategy(["/cpu:0"]))
    stock = train(stock_mirrored(["/cpu:0"]))
    assert max_weight_diff(ours, stock) <= TOL


def test_steps_per_execution_with_jit_compile_is_refused_naming_the_fix():
    x, y = regression_data(n=64)
    strategy = hb.HeteroMirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = jit_model(steps_per_execution=2)
    with pytest.raises(ValueError, match=r"steps_per_execution=2, jit_compile=True\. Fix: "
                                         r"compile with steps_per_execution=1"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
