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
