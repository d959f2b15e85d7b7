"""Models whose steps are written as Keras's guide "Customizing what happens in fit() with
TensorFlow" teaches, for the custom-step tests (one host and the multi-worker worker script).

Each variant follows the guide's code: `compute_loss` + `optimizer.apply` with the metrics
updated in a loop and returned as `{m.name: m.result()}`; a loss object and metrics by hand;
sample weights; a custom `test_step`; and a two-optimizer step in the guide's GAN pattern
(optimizers kept by a `compile()` override), made deterministic so it can equal one device.
"""

import keras
import numpy as np
import tensorflow as tf


def data(n=160, seed=0, sample_weight=False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    w = rng.normal(size=(8, 1)).astype("float32")
    y = (x @ w + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    if sample_weight:
        return x, y, rng.uniform(0.2, 2.0, size=(n,)).astype("float32")
    return x, y


def _update_metrics(model, loss, y, y_pred, sample_weight=None):
    for metric in model.metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
    return {m.name: m.result() for m in model.metrics}


class ComputeLossModel(keras.Model):
    """The guide's first example, with its custom test_step."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        return _update_metrics(self, loss, y, y_pred)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        return _update_metrics(self, loss, y, y_pred)


class LossObjectModel(keras.Model):
    """The guide's "going lower-level": a loss object and metrics of its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class SampleWeightModel(keras.Model):
    """The guide's "supporting sample_weight"."""

    def train_step(self, data):
        if len(data) == 3:
            x, y, sample_weight = data
        else:
            sample_weight = None
            x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return _update_metrics(self, loss, y, y_pred, sample_weight)


class TwoOptimizerModel(keras.Model):
    """The guide's GAN pattern: two networks, an optimizer each, kept by `compile()`; the
    second network's step reads the first network after its update."""

    def __init__(self):
        super().__init__()
        self.encoder = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "tanh")])
        self.head = keras.Sequential([keras.Input((16,)), keras.layers.Dense(1)])
        self.encoder_loss = keras.metrics.Mean(name="encoder_loss")
        self.head_loss = keras.metrics.Mean(name="head_loss")

    def call(self, x):
        return self.head(self.encoder(x))

    def compile(self, encoder_optimizer, head_optimizer, loss_fn):
        super().compile()
        self.encoder_optimizer = encoder_optimizer
        self.head_optimizer = head_optimizer
        self.loss_fn = loss_fn

    @property
    def metrics(self):
        return [self.encoder_loss, self.head_loss]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            encoder_loss = self.loss_fn(y, self(x))
        grads = tape.gradient(encoder_loss, self.encoder.trainable_weights)
        self.encoder_optimizer.apply(grads, self.encoder.trainable_weights)
        with tf.GradientTape() as tape:
            head_loss = self.loss_fn(y, self(x))
        grads = tape.gradient(head_loss, self.head.trainable_weights)
        self.head_optimizer.apply(grads, self.head.trainable_weights)
        self.encoder_loss.update_state(encoder_loss)
        self.head_loss.update_state(head_loss)
        return {"encoder_loss": self.encoder_loss.result(),
                "head_loss": self.head_loss.result()}


VARIANTS = ("compute_loss", "loss_object", "sample_weight", "two_optimizers")


def build(variant, seed=1):
    """A compiled model of `variant` (one of VARIANTS), the same weights for the same seed."""
    keras.utils.set_random_seed(seed)
    if variant == "two_optimizers":
        model = TwoOptimizerModel()
        model.compile(keras.optimizers.Adam(1e-2), keras.optimizers.SGD(0.05),
                      keras.losses.MeanSquaredError())
        model.build((None, 8))
        # Built up front: an optimizer first built inside a distributed step hits
        # keras-team/keras#19246 under the stock strategy too.
        model.encoder_optimizer.build(model.encoder.trainable_weights)
        model.head_optimizer.build(model.head.trainable_weights)
        return model
    cls = {"compute_loss": ComputeLossModel, "loss_object": LossObjectModel,
           "sample_weight": SampleWeightModel}[variant]
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh",
                                kernel_regularizer=keras.regularizers.L2(1e-2))(inputs)
    model = cls(inputs, keras.layers.Dense(1)(hidden))
    if variant == "loss_object":
        model.compile(optimizer=keras.optimizers.Adam(1e-2))
    else:
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model
