"""Exactness: an uneven split trains exactly like one device on the whole global batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from helpers import (
    BatchLogs,
    build_under,
    conv_syncbn_model,
    dense_model,
    image_data,
    max_weight_diff,
    regression_data,
    stock_mirrored,
    SwitchAtBatch,
)

TOL = 1e-5
SPLIT = [3, 7, 22]


def _fit_pair(builder, x, y, split, cpus, batch=32, epochs=1, fit_kwargs=None, **build_kwargs):
    """Trains a reference on one device and ours on len(split) replicas from the same start.

    Callable build_kwargs values are factories, called once per model (optimizers, losses).
    """
    fit_kwargs = dict(fit_kwargs or {})
    ref = build_under(None, builder, **build_kwargs)
    ref_logs = BatchLogs()
    ref_hist = ref.fit(
        x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
        callbacks=[ref_logs], **fit_kwargs,
    )
    strategy = hb.HeteroMirroredStrategy(cpus[: len(split)] if split else cpus[:3])
    if split:
        strategy.set_batch_sizes(split)
    ours = build_under(strategy, builder, **build_kwargs)
    logs = BatchLogs()
    hist = ours.fit(
        x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
        callbacks=[logs], **fit_kwargs,
    )
    return ref, ours, ref_hist, hist, ref_logs, logs, strategy


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.SGD(0.05),
        lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
        lambda: keras.optimizers.Adam(1e-2),
        lambda: keras.optimizers.RMSprop(1e-2),
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05)),
    ],
    ids=["sgd", "nesterov", "adam", "rmsprop", "loss_scale"],
)
def test_dense_uneven_split_matches_one_device(cpus, optimizer):
    x, y = regression_data()
    ref, ours, ref_hist, hist, ref_logs, logs, strategy = _fit_pair(
        dense_model, x, y, SPLIT, cpus, optimizer=optimizer
    )
    assert len(logs.batches) == 10
    assert max_weight_diff(ref, ours) <= TOL
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    # Per-batch logs (what callbacks and the progress bar see) are the true global means.
    for mine, theirs in zip(logs.batches, ref_logs.batches):
        for key in ("loss", "mae"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), key
    times = strategy.read_replica_times()
    np.testing.assert_array_equal(times.samples_per_step, SPLIT)


def test_conv_syncbn_adam_uneven_split_matches_one_device(cpus):
    x, y = image_data()
    ref, ours, ref_hist, hist, ref_logs, logs, _ = _fit_pair(
        conv_syncbn_model, x, y, SPLIT, cpus, epochs=2
    )
    assert len(logs.batches) == 10
    assert max_weight_diff(ref, ours) <= TOL
    np.testing.assert_allclose(hist.history["accuracy"], ref_hist.history["accuracy"], rtol=1e-6)
    for mine, theirs in zip(logs.batches, ref_logs.batches):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["accuracy"] == pytest.approx(theirs["accuracy"], rel=1e-6)


def test_even_split_with_global_batch_not_divisible_by_replicas(cpus):
    # B=32 over 3 replicas: 11/11/10, where the stock strategy crashes (see test_upstream_keras_callers).
    x, y = regression_data()
    ref, ours, *_ , strategy = _fit_pair(dense_model, x, y, None, cpus)
    assert max_weight_diff(ref, ours) <= TOL
    assert strategy.batch_sizes == (11, 11, 10)


def test_partial_last_batch_is_split_in_proportion(cpus):
    # 300 samples at B=32: the last global batch has 12 samples.
    x, y = regression_data(n=300)
    ref, ours, ref_hist, hist, *_ , strategy = _fit_pair(dense_model, x, y, [4, 8, 20], cpus)
    assert max_weight_diff(ref, ours) <= TOL
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    times = strategy.read_replica_times()
    np.testing.assert_array_equal(times.samples, np.array([4, 8, 20]) * 9 + [2, 3, 7])


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size", "mean_with_sample_weight"])
def test_loss_reductions_and_sample_weights(cpus, reduction):
    x, y = regression_data()
    sample_weight = np.random.default_rng(3).uniform(0.1, 2.0, size=len(x)).astype("float32")
    ref, ours, *_ = _fit_pair(
        dense_model, x, y, SPLIT, cpus,
        loss=lambda: keras.losses.MeanSquaredError(reduction=reduction),
        optimizer=lambda: keras.optimizers.SGD(0.002 if reduction == "sum" else 0.05),
        fit_kwargs={"sample_weight": sample_weight},
    )
    assert max_weight_diff(ref, ours) <= TOL


@pytest.mark.parametrize("clip", [{"global_clipnorm": 0.05}, {"clipnorm": 0.02},
                                  {"clipvalue": 0.01}], ids=["global_clipnorm", "clipnorm",
                                                             "clipvalue"])
def test_gradient_clipping_acts_on_the_global_gradient_as_on_one_device(cpus, clip):
    # The clip bites on every step (thresholds far below the gradient's norm), and acts on the
    # summed gradient, as one device clips its gradient on the global batch (stock Keras
    # clips each replica's local gradient before the all-reduce).
    x, y = regression_data()
    ref, ours, ref_hist, hist, *_ = _fit_pair(
        dense_model, x, y, SPLIT, cpus, optimizer=lambda: keras.optimizers.SGD(0.5, **clip))
    assert max_weight_diff(ref, ours) <= TOL
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    # Negative control: the same optimizer without the clip ends elsewhere (the clip bites).
    unclipped = build_under(None, dense_model, optimizer=lambda: keras.optimizers.SGD(0.5))
    unclipped.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(ref, unclipped) > 1e-3


def test_mixed_precision_loss_scaling(cpus):
    # A loss scale low enough that neither run overflows, so both take the same steps.
    x, y = regression_data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        ref, ours, *_ = _fit_pair(
            dense_model, x, y, SPLIT, cpus,
            optimizer=lambda: keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.05), initial_scale=64.0
            ),
        )
        assert ours.optimizer.dynamic_scale.numpy() == ref.optimizer.dynamic_scale.numpy()
        assert max_weight_diff(ref, ours) <= 1e-3  # float16 compute: rounding, not weighting
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_stock_averaging_of_uneven_batches_differs(cpus):
    """Negative control: the stock aggregation (mean of per-replica means) is not exact."""
    x, y = regression_data()
    ref = dense_model()
    ref.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)

    stock = stock_mirrored(cpus[:3])
    with stock.scope():
        model = dense_model()
    offsets = np.cumsum([0] + SPLIT)

    @tf.function
    def step(xb, yb):
        def replica_fn(xr, yr):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xr, training=True) - yr)) / 3.0
                loss += tf.add_n(model.losses) / 3.0
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply(grads, model.trainable_variables)

        per_replica = stock.experimental_distribute_values_from_function(
            lambda ctx: (
                xb[offsets[ctx.replica_id_in_sync_group] : offsets[ctx.replica_id_in_sync_group + 1]],
                yb[offsets[ctx.replica_id_in_sync_group] : offsets[ctx.replica_id_in_sync_group + 1]],
            )
        )
        stock.run(replica_fn, args=per_replica)

    for i in range(0, len(x), 32):
        step(tf.constant(x[i : i + 32]), tf.constant(y[i : i + 32]))
    assert max_weight_diff(ref, model) > 100 * TOL


@pytest.mark.parametrize("spe", [1, 3, 8])
def test_steps_per_execution_with_a_switch_matches_one_device(cpus, spe):
    # SyncBatchNorm + Adam, an uneven split switched mid-epoch, a partial last batch
    # (150 = 4 x 32 + 22), 2 epochs; per-batch logs are the global means at each call.
    x, y = image_data(n=150)
    ref = conv_syncbn_model()
    ref_logs = BatchLogs()
    ref.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[ref_logs])
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes(SPLIT)
    with strategy.scope():
        ours = conv_syncbn_model()
        ours.compile(optimizer=keras.optimizers.Adam(1e-2), loss=ours.loss,
                     metrics=["accuracy"], steps_per_execution=spe)
    logs = BatchLogs()
    switch = SwitchAtBatch(strategy, 1, [16, 8, 8])
    ours.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[switch, logs])
    assert switch.done and strategy.steps_trained == 10
    assert max_weight_diff(ref, ours) <= TOL
    # One call per execution: the logs of its last step, equal to one device's there.
    per_epoch = [min(spe * (i + 1), 5) - 1 for i in range(-(-5 // spe))]
    expected = [ref_logs.batches[e * 5 + b] for e in range(2) for b in per_epoch]
    assert len(logs.batches) == len(expected)
    for mine, theirs in zip(logs.batches, expected):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["accuracy"] == pytest.approx(theirs["accuracy"], rel=1e-6)


def test_evaluate_and_predict_with_steps_per_execution_match_one_device(cpus):
    # 150 samples in batches of 32 (5 batches, a partial last one: 2 executions of 3 steps,
    # the second cut short by the data), split unevenly: the same results, in order.
    x, y = image_data(n=150)
    ref = conv_syncbn_model()
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes(SPLIT)
    with strategy.scope():
        ours = conv_syncbn_model()
        ours.compile(optimizer="sgd", loss=ours.loss, metrics=["accuracy"],
                     steps_per_execution=3)
    ours.set_weights(ref.get_weights())
    expected = ref.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    got = ours.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert got["accuracy"] == pytest.approx(expected["accuracy"], rel=1e-6)
    np.testing.assert_allclose(ours.predict(x, batch_size=32, verbose=0),
                               ref.predict(x, batch_size=32, verbose=0), rtol=1e-5, atol=1e-6)
