"""Canaries of `_upstream.keras_losses`: where Keras and TensorFlow divide a loss by the
replica count, and a loss's Keras mask.

The loss weights (`tf_hetbatch.distribute.weighting`) multiply each replica's Keras-scaled loss
by K * its share and learn from the reads of `num_replicas_in_sync` which scalings a step made.
If Keras stops dividing by K, or divides without reading the strategy's property, these fail:
the weights would then be silently wrong, or a scaling we must refuse would go unseen.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_hetbatch.distribute._upstream import collectives, keras_losses


class ReadRecording(tf.distribute.MirroredStrategy):
    """A stock strategy that records who reads its replica count in replica context."""

    def __init__(self, devices):
        collectives.assign_collective_key_base(self)
        super().__init__(devices)
        self.readers = []

    @property
    def num_replicas_in_sync(self):
        if tf.distribute.in_cross_replica_context() is False:
            self.readers.append(keras_losses.replica_count_reader())
        return super().num_replicas_in_sync


def _in_replicas(strategy, fn):
    values = strategy.run(tf.function(fn))
    return [float(v) for v in strategy.experimental_local_results(values)]


@pytest.mark.parametrize("scaling, reader, divided", [
    (lambda y, p: keras.losses.MeanSquaredError()(y, p), keras_losses.KERAS_SCALE, True),
    (lambda y, p: keras.losses.MeanSquaredError(reduction="sum")(y, p), None, False),
    (lambda y, p: tf.nn.compute_average_loss(keras.losses.mean_squared_error(y, p)),
     keras_losses.TF_AVERAGE_LOSS, True),
    (lambda y, p: tf.nn.compute_average_loss(keras.losses.mean_squared_error(y, p),
                                             global_batch_size=4), None, False),
    (lambda y, p: tf.nn.scale_regularization_loss(tf.reduce_sum(tf.square(p))),
     keras_losses.TF_REGULARIZATION, True),
], ids=["keras_mean", "keras_sum", "tf_average_loss", "tf_average_loss_global_batch",
        "tf_regularization"])
def test_loss_scalings_read_the_replica_count(cpus, scaling, reader, divided):
    """Keras's mean reductions and TensorFlow's helpers divide by the replica count they read
    from the strategy in replica context, and only then: the weights rely on the first, the
    refusals on the second."""
    strategy = ReadRecording(cpus[:2])
    y = tf.constant([[1.0], [2.0]])
    p = tf.constant([[0.0], [0.0]])
    values = _in_replicas(strategy, lambda: scaling(y, p))
    expected = float(scaling(y, p))  # no strategy: K = 1
    np.testing.assert_allclose(values, [expected / 2 if divided else expected] * 2, rtol=1e-6)
    readers = [r for r in strategy.readers if r is not None]
    assert readers == ([reader] * 2 if reader else []), strategy.readers


def test_keras_own_train_step_unscales_the_loss_for_its_tracker(cpus):
    """Keras's own steps read the replica count again to undo it for the loss tracker
    (`unscale_loss_for_distribution`): why the seams leave Keras's value alone there."""
    strategy = ReadRecording(cpus[:2])
    with strategy.scope():
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    model.fit(np.ones((4, 2), "float32"), np.ones((4, 1), "float32"), batch_size=4, verbose=0)
    assert keras_losses.KERAS_UNSCALE in strategy.readers
    assert keras_losses.KERAS_SCALE in strategy.readers


def test_a_weighted_loss_keeps_its_keras_mask():
    """`keep_keras_mask`: Keras keeps a tensor's mask where `Loss.__call__` reads it."""

    @tf.function
    def masked():
        values = tf.constant([1.0, 2.0, 3.0])
        mask = tf.constant([True, False, True])
        keras.src.backend.common.masking.set_keras_mask(values, mask)
        weighted = keras_losses.keep_keras_mask(values * 2.0, values)
        return keras.src.backend.common.masking.get_keras_mask(weighted)

    np.testing.assert_array_equal(masked().numpy(), [True, False, True])


class _ReadsItsInputs(keras.losses.Loss):
    """A loss whose `call` reads what `Loss.__call__` holds, as the weighting seam does."""

    seen = []

    def call(self, y_true, y_pred):
        self.seen.append(keras_losses.loss_call_inputs())
        return tf.square(y_true - y_pred)


def test_loss_call_holds_the_mask_and_the_sample_weight_its_call_reads():
    """`loss_call_inputs`: `Loss.__call__` keeps `in_mask` (y_pred's Keras mask) and
    `sample_weight` as locals while it calls `call`; the denominators rely on reading them."""
    from keras.src.backend.common import masking

    y_pred = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    mask = tf.constant([[True, False], [True, True]])
    masking.set_keras_mask(y_pred, mask)
    weights = tf.constant([0.5, 2.0])
    _ReadsItsInputs.seen.clear()
    _ReadsItsInputs()(tf.zeros((2, 2)), y_pred, sample_weight=weights)
    in_mask, sample_weight = _ReadsItsInputs.seen[-1]
    np.testing.assert_array_equal(in_mask.numpy(), mask.numpy())
    np.testing.assert_array_equal(sample_weight.numpy(), weights.numpy())


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean", "mean_with_sample_weight"])
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("weighted", ["none", "per_sample", "per_entry"])
def test_loss_denominator_is_what_keras_divides_by(reduction, masked, weighted):
    """`loss_denominator`: Keras's reduction of a term is its "sum" reduction divided by it
    (valid entries under a mask, masked sample weights' sum, or elements)."""
    from keras.src.losses import loss as keras_loss

    rng = np.random.default_rng(0)
    values = tf.constant(rng.normal(size=(5, 4)), tf.float32)
    mask = tf.constant(rng.random((5, 4)) > 0.4) if masked else None
    sample_weight = {"none": None,
                     "per_sample": tf.constant(rng.uniform(0, 2, (5, 1)), tf.float32),
                     "per_entry": tf.constant(rng.uniform(0, 2, (5, 4)), tf.float32)}[weighted]
    reduced = keras_loss.reduce_weighted_values(values, sample_weight, mask, reduction)
    summed = keras_loss.reduce_weighted_values(values, sample_weight, mask, "sum")
    denominator = keras_losses.loss_denominator(values, sample_weight, mask, reduction)
    np.testing.assert_allclose(float(reduced) * float(denominator), float(summed), rtol=1e-5)


def test_a_compiled_model_holds_its_loss_terms_trackers_and_additional_losses(cpus):
    """The compiled loss is a container of one Loss per output (built with the model), Keras's
    own steps keep a total loss tracker, and `compute_loss` adds each additional loss through
    `ADDITIONAL_LOSS_METHOD`, divided by the replica count: the seams the weights sit on."""
    strategy = ReadRecording(cpus[:2])
    with strategy.scope():
        inputs = keras.Input((2,))
        h = keras.layers.Dense(2, kernel_regularizer=keras.regularizers.L2(0.5))(inputs)
        model = keras.Model(inputs, {"a": keras.layers.Dense(1)(h), "b": keras.layers.Dense(1)(h)})
        model.compile("sgd", {"a": "mse", "b": keras.losses.MeanAbsoluteError()})
    assert keras_losses.is_compile_loss(model._compile_loss)
    assert keras_losses.compiled_loss_terms(model._compile_loss) == []  # not built yet
    assert keras_losses.is_keras_compute_loss(model)
    x, y = np.ones((4, 2), "float32"), {"a": np.ones((4, 1), "float32"),
                                         "b": np.ones((4, 1), "float32")}
    model.fit(x, y, batch_size=4, verbose=0)
    terms = keras_losses.compiled_loss_terms(model._compile_loss)
    assert len(terms) == 2 and all(isinstance(t, keras.losses.Loss) for t in terms)
    tracker = keras_losses.total_loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean) and tracker.name == "loss"

    calls = []
    original = getattr(model, keras_losses.ADDITIONAL_LOSS_METHOD)

    def counting(loss):
        calls.append(loss)
        return original(loss)

    setattr(model, keras_losses.ADDITIONAL_LOSS_METHOD, counting)
    values = _in_replicas(strategy, lambda: tf.add_n(
        [getattr(model, keras_losses.ADDITIONAL_LOSS_METHOD)(loss) for loss in model.losses]))
    assert values == pytest.approx([float(tf.add_n(model.losses)) / 2] * 2, rel=1e-6)
    calls.clear()
    model.compute_loss(x=x, y=y, y_pred=model(x))
    assert len(calls) == len(model.losses) == 1

    class Override(keras.Model):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    assert not keras_losses.is_keras_compute_loss(Override(inputs, h))
