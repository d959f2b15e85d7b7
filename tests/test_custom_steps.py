"""Custom train_steps as Keras's guide writes them, and custom training loops: exact or refused.

Every variant trains under an uneven split exactly like one device on the global batches
(weights, History and `evaluate`), and at the even split exactly like the stock strategy. The
logs are what one device reports (the stock strategy reports a loss tracker fed with the
replica-scaled loss at loss / K). A loss scaled by the replica count that the strategy cannot
weight is refused when the step is traced.
"""

import io
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import custom_models
import tf_hetbatch as hb
from tf_hetbatch.launch import launch
from helpers import max_weight_diff, run_once, stock_mirrored

TOL = 1e-5
SPLIT = [4, 12, 16]


def _under(strategy, variant):
    if strategy is None:
        return custom_models.build(variant)
    with strategy.scope():
        return custom_models.build(variant)


def _dataset(variant, n=160):
    columns = custom_models.data(n, sample_weight=variant == "sample_weight")
    return lambda: tf.data.Dataset.from_tensor_slices(columns).batch(32)


def _train(strategy, variant, split=None, epochs=2, n=160):
    model = _under(strategy, variant)
    if split is not None:
        strategy.set_batch_sizes(split)
    history = model.fit(_dataset(variant, n)(), epochs=epochs, verbose=0).history
    return model, history


@pytest.mark.parametrize("variant", custom_models.VARIANTS)
def test_guide_train_steps_under_an_uneven_split_equal_one_device(cpus, variant):
    ref, ref_history = _train(None, variant)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    ours, history = _train(strategy, variant, SPLIT)
    assert max_weight_diff(ref, ours) <= TOL  # 10 steps
    assert history.keys() == ref_history.keys()
    for key in ref_history:
        np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-5)
    times = strategy.read_replica_times()
    np.testing.assert_array_equal(times.samples, np.array(SPLIT) * 10)
    assert np.all(times.compute_seconds > 0)


@pytest.mark.parametrize("variant", ["compute_loss", "two_optimizers"])
def test_guide_train_steps_at_the_even_split_equal_the_stock_strategy(cpus, variant):
    stock, _ = _train(stock_mirrored(cpus[:4]), variant)
    ours, _ = _train(hb.HeteroMirroredStrategy(cpus[:4]), variant)
    assert max_weight_diff(stock, ours) <= 1e-6


def test_a_custom_test_step_evaluates_as_one_device(cpus):
    x, y = custom_models.data(100, seed=5)
    ref = custom_models.build("compute_loss")
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([4, 12, 16])
    ours = _under(strategy, "compute_loss")
    for batch in (50, 32):  # evaluation batches of any size, split in proportion
        expected = ref.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
        got = ours.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
        assert got.keys() == expected.keys()
        for key in expected:
            assert got[key] == pytest.approx(expected[key], rel=1e-5), key


def test_a_keras_loss_the_model_does_not_hold_is_refused_when_traced(cpus):
    loss_fn = keras.losses.MeanSquaredError()  # not an attribute of the model

    class Hidden(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = loss_fn(y, self(x, training=True))
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                                 self.trainable_variables)
            return {"loss": loss}

    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    with strategy.scope():
        model = Hidden([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile("sgd")
    before = model.get_weights()
    with pytest.raises(ValueError, match="held by the model.*self.loss_fn"):
        model.fit(*custom_models.data(64), batch_size=32, epochs=1, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # refused before any step ran


def _custom_loop(strategy, model, per_replica_loss, split=None, n=96, batch=32):
    """TensorFlow's custom-loop guide: strategy.run of a replica step per global batch."""
    x, y = custom_models.data(n)
    if split is not None:
        strategy.set_batch_sizes(split)
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(batch))
    optimizer = model.optimizer

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = per_replica_loss(labels, model(features, training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(inputs):
        losses = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return [float(distributed_train_step(batch)) for batch in dist]


def _dense(strategy=None, regularize=False):
    def build():
        keras.utils.set_random_seed(1)
        regularizer = keras.regularizers.L2(1e-2) if regularize else None
        model = keras.Sequential([keras.Input((8,)),
                                  keras.layers.Dense(16, activation="tanh",
                                                     kernel_regularizer=regularizer),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05), "mse")
        return model

    if strategy is None:
        return build()
    with strategy.scope():
        return build()


def global_batch_loss():
    """TensorFlow's custom-loop tutorial's loss: per-example MSE scaled by the global batch."""
    per_example = keras.losses.MeanSquaredError(reduction="none")

    def loss(labels, predictions):
        return tf.nn.compute_average_loss(per_example(labels, predictions), global_batch_size=32)
    return loss


def one_device_reference():
    """The dense model trained on one device on the custom loops' global batches."""
    ref = _dense()
    ref.fit(*custom_models.data(96), batch_size=32, epochs=1, shuffle=False, verbose=0)
    return ref


def test_custom_loop_scaled_by_the_global_batch_is_exact_and_timed(cpus):
    loss, ref = global_batch_loss(), one_device_reference()
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = _dense(strategy)
    _custom_loop(strategy, model, loss, SPLIT)
    assert max_weight_diff(ref, model) <= TOL
    times = strategy.read_replica_times()
    np.testing.assert_array_equal(times.samples, np.array(SPLIT) * 3)
    assert np.all(times.compute_seconds > 0) and np.all(times.steps == 3)


def test_compute_average_loss_without_the_global_batch_is_weighted(cpus, caplog):
    # TensorFlow's custom-loop tutorial divides by the replica's own batch times K (and adds
    # the regularisation scaled by K): the strategy weights the gradients, and says once that
    # the returned value is the mean of the replicas' means.
    per_example = keras.losses.MeanSquaredError(reduction="none")

    def loss(labels, predictions):
        value = tf.nn.compute_average_loss(per_example(labels, predictions))
        return value + tf.nn.scale_regularization_loss(tf.add_n(model.losses))

    ref = _dense(regularize=True)
    ref.fit(*custom_models.data(96), batch_size=32, epochs=1, shuffle=False, verbose=0)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = _dense(strategy, regularize=True)
    with caplog.at_level("WARNING", logger="tf_hetbatch"):
        _custom_loop(strategy, model, loss, SPLIT)
        _custom_loop(strategy, model, loss, SPLIT, n=32)  # a second trace: said once
    ref.fit(*custom_models.data(32), batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) <= TOL
    assert [r.levelname for r in caplog.records if "compute_average_loss" in r.message] \
        == ["WARNING"]


def test_compute_average_loss_without_the_global_batch_after_sync_batch_norm_is_refused(cpus):
    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, use_bias=False),
                                  keras.layers.BatchNormalization(synchronized=True),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.05))
        return model

    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    with strategy.scope():
        model = build()
    per_example = keras.losses.MeanSquaredError(reduction="none")
    before = model.get_weights()
    with pytest.raises(ValueError, match="SyncBatchNormalization.*global_batch_size=B"):
        _custom_loop(strategy, model,
                     lambda labels, p: tf.nn.compute_average_loss(per_example(labels, p)), SPLIT)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_custom_loop_with_a_keras_loss_it_holds_is_weighted(cpus):
    # A mean-reduced Keras loss object the step function reaches (here through its closure)
    # is weighted like the model's own: exact, and its values summed over the replicas are the
    # global loss, as under the stock strategy (TensorFlow's tutorials reduce it with SUM).
    loss_object = keras.losses.MeanSquaredError()
    ref = _dense()
    ref_history = ref.fit(*custom_models.data(96), batch_size=32, epochs=1, shuffle=False,
                          verbose=0).history
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = _dense(strategy)
    losses = _custom_loop(strategy, model, lambda labels, p: loss_object(labels, p), SPLIT)
    assert max_weight_diff(ref, model) <= TOL
    # SUM over the replicas of share * loss_k: the global mean, as one device reports it.
    assert np.mean(losses) == pytest.approx(ref_history["loss"][0], rel=1e-5)


def test_a_mean_over_replicas_of_their_own_means_is_said_once_with_the_fix(cpus, caplog):
    # A loop that averages per-replica means over the replicas (strategy.reduce MEAN, axis
    # None) weights replicas holding 2 and 6 samples alike: under an uneven split that is not
    # the global mean, so the strategy says so, once, naming the fix. Values the strategy
    # weighted (a Keras loss the step reaches) and Keras's own steps are not in question.
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([2, 4, 6])
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.range(24).map(lambda i: tf.cast(i, tf.float32)).batch(12))

    @tf.function
    def step(x):
        means, values = strategy.run(lambda v: (tf.reduce_mean(v), v), args=(x,))
        return (strategy.reduce("MEAN", means, axis=None),
                strategy.reduce("MEAN", values, axis=0), strategy.reduce("SUM", means, axis=None))

    with caplog.at_level("WARNING", logger="tf_hetbatch"):
        results = [[float(t) for t in step(x)] for x in dist]
    said = [r.getMessage() for r in caplog.records if "equal weights" in r.getMessage()]
    assert len(said) == 1 and "axis=0" in said[0] and "ReduceOp.SUM" in said[0], said
    assert [r[1] for r in results] == [5.5, 17.5]  # per-example values: the global means
    assert results[0][0] == pytest.approx((0.5 + 3.5 + 8.5) / 3)  # what was said
    caplog.clear()
    loss_object = keras.losses.MeanSquaredError()
    weighted = hb.HeteroMirroredStrategy(cpus[:3])
    model = _dense(weighted)
    with caplog.at_level("WARNING", logger="tf_hetbatch"):
        _custom_loop(weighted, model, lambda labels, p: loss_object(labels, p), SPLIT)
        model.fit(*custom_models.data(64), batch_size=32, epochs=1, verbose=0)
        x, y = custom_models.data(32)
        means = weighted.run(lambda a, b: loss_object(b, model(a)),
                             args=next(iter(weighted.experimental_distribute_dataset(
                                 tf.data.Dataset.from_tensor_slices((x, y)).batch(32)))))
        weighted.reduce("MEAN", means, axis=None)
    assert not [r for r in caplog.records if "equal weights" in r.getMessage()]


# --------------------------------------------------------------------- two workers -----------
WORKER = os.path.join(os.path.dirname(__file__), "workers", "custom_step_train.py")


# Trained one after the other in one launched cluster (custom_step_train.py): the first from
# [5, 27] switched to [20, 12] at its step 3, each later one from the split the one before left,
# switched back; the balanced loop last (its Balancer decides its splits).
TWO_WORKER_VARIANTS = (*custom_models.VARIANTS, "loop", "loop_balanced")
SIZES, SWITCH_SIZES = [5, 27], [20, 12]


@pytest.fixture(scope="module")
def two_worker_run(tmp_path_factory):
    """(results directory, {"ok", "message", "log"}) of the one launched 2-worker cluster that
    trains every variant; <directory>/<variant>/ holds each variant's results."""

    def produce(out):
        log = io.StringIO()
        result = launch([WORKER, "--out", str(out), "--variants", ",".join(TWO_WORKER_VARIANTS),
                         "--sizes", ",".join(map(str, SIZES)), "--n", "320",
                         "--switch-step", "3",
                         "--switch-sizes", ",".join(map(str, SWITCH_SIZES))],
                        2, threads=1, timeout=300, stdout=log, stderr=log,
                        handle_signals=False)
        return {"ok": result.ok, "message": result.message, "log": log.getvalue()[-4000:]}

    return run_once(tmp_path_factory, "custom_steps", produce)


@pytest.mark.cluster
@pytest.mark.parametrize("variant", TWO_WORKER_VARIANTS)
def test_custom_steps_on_two_workers_equal_one_device(two_worker_run, variant):
    out, result = two_worker_run
    assert result["ok"], result["message"] + "\n" + result["log"]
    run_dir = out / variant
    ref_variant = "compute_loss" if variant.startswith("loop") else variant
    ref, ref_history = _train(None, ref_variant, n=320)
    for index in range(2):
        weights = np.load(run_dir / f"worker{index}.npz")
        ours = [weights[f"arr_{i}"] for i in range(len(ref.get_weights()))]
        assert max(float(np.max(np.abs(a - b))) for a, b in zip(ours, ref.get_weights())) <= TOL
        info = json.loads((run_dir / f"worker{index}.json").read_text())
        for key in ref_history:
            np.testing.assert_allclose(info["history"][key], ref_history[key], rtol=1e-5)
        if variant.startswith("loop"):  # the tutorial's @tf.function step, every split
            assert info["history"]["later_traces"] == 0
        if variant == "loop_balanced":  # a Balancer in the loop: the same on both workers
            assert info["balancer"] == json.loads(
                (run_dir / "worker0.json").read_text())["balancer"]
            assert info["balancer"]["history"][0]["new"] == [16, 16]
        else:  # 20 steps: the first 3 + DEFAULT_SWITCH_MARGIN at one split, then the other.
            start, then = ((SIZES, SWITCH_SIZES) if TWO_WORKER_VARIANTS.index(variant) % 2 == 0
                           else (SWITCH_SIZES, SIZES))
            np.testing.assert_array_equal(info["samples"],
                                          [11 * a + 9 * b for a, b in zip(start, then)])
            assert all(s > 0 for s in info["seconds"])
        if variant == "compute_loss":
            xe, ye = custom_models.data(100, seed=5)
            expected = ref.evaluate(xe, ye, batch_size=50, verbose=0, return_dict=True)
            for key in expected:
                assert info["evaluation"][key] == pytest.approx(expected[key], rel=1e-5)
