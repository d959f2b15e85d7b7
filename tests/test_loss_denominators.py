"""Exact by the loss's own denominator: masks, sample weights, several outputs, added losses.

Keras divides each loss term by what it counts on the replica: its valid entries under a mask,
its sample weights' sum under "mean_with_sample_weight", else its elements. Each replica's term
is weighted by its share of that denominator over the global batch, so training equals one
device on the whole batch, and every log (the total, each output's loss, evaluate) is the value
one device reports. Each case runs at an uneven split and at the even one.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from helpers import BatchLogs, max_weight_diff

TOL = 1e-5
SPLITS = pytest.mark.parametrize("split", [[7, 25], [16, 16]], ids=["uneven", "even"])
N, T, VOCAB, CLASSES = 64, 8, 20, 5


def _padded_sequences(seed=0):
    """Token ids padded with 0 to length T (lengths 1..T), and a label per timestep."""
    rng = np.random.default_rng(seed)
    x = np.zeros((N, T), np.int32)
    for i, length in enumerate(rng.integers(1, T + 1, N)):
        x[i, :length] = rng.integers(1, VOCAB, length)
    return x, rng.integers(0, CLASSES, (N, T))


def _lstm_tagger():
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    h = keras.layers.LSTM(8, return_sequences=True)(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


def _transformer_tagger():
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inputs)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, attended]))
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


def _masking_gru():
    inputs = keras.Input((T, 3))
    h = keras.layers.Masking(0.0)(inputs)
    h = keras.layers.GRU(6, return_sequences=True)(h)
    return keras.Model(inputs, keras.layers.Dense(1)(h))


def _two_outputs():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, {"cls": keras.layers.Dense(3, name="cls")(h),
                                "reg": keras.layers.Dense(1, name="reg")(h)})


def _dense():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu",
                           kernel_regularizer=keras.regularizers.L2(1e-2))(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(h))


class _MeanPenalty(keras.layers.Layer):
    """`add_loss` of a mean over the samples: a data-dependent additional loss."""

    def call(self, x):
        self.add_loss(tf.reduce_mean(tf.square(x)))
        return x


def _dense_with_penalty():
    inputs = keras.Input((6,))
    h = _MeanPenalty()(keras.layers.Dense(8, activation="relu")(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(h))


def _train_pair(builder, x, y, split, *, loss, fit_kwargs=None, evaluate_kwargs=None,
                loss_weights=None, batch_size=32, epochs=2):
    """(max weight difference, [histories], [per-batch logs], [evaluate dicts]) of one device
    and of ours at `split`, from the same start."""
    fit_kwargs, evaluate_kwargs = dict(fit_kwargs or {}), dict(evaluate_kwargs or {})
    out = []
    for strategy in (None, hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1"])):
        if strategy is not None:
            strategy.set_batch_sizes(split)
        keras.utils.set_random_seed(1)
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = builder()
            model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss(),
                          loss_weights=loss_weights)
        logs = BatchLogs()
        history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
                            verbose=0, callbacks=[logs], **fit_kwargs).history
        evaluation = model.evaluate(x, y, verbose=0, return_dict=True,
                                    **{"batch_size": batch_size, **evaluate_kwargs})
        out.append((model, history, logs.batches, evaluation))
    (ref, ref_history, ref_batches, ref_eval), (ours, history, batches, evaluation) = out
    return max_weight_diff(ref, ours), (ref_history, history), (ref_batches, batches), (
        ref_eval, evaluation)


def _assert_logs_equal(pair, rtol=1e-5):
    theirs, mine = pair
    if isinstance(theirs, list) and theirs and isinstance(theirs[0], dict):
        assert len(mine) == len(theirs)
        for a, b in zip(theirs, mine):
            _assert_logs_equal((a, b), rtol)
        return
    assert set(mine) == set(theirs)
    for key in theirs:
        np.testing.assert_allclose(mine[key], theirs[key], rtol=rtol, err_msg=key)


def _assert_as_one_device(diff, *log_pairs):
    """Weights within TOL of one device's, and each (one device's, ours) pair of logs equal."""
    assert diff <= TOL
    for pair in log_pairs:
        _assert_logs_equal(pair)


def _two_output_data(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 6)).astype("float32")
    y = {"cls": rng.integers(0, 3, N), "reg": rng.normal(size=(N, 1)).astype("float32")}
    return x, y, rng


def _scce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@SPLITS
@pytest.mark.parametrize("builder", [_lstm_tagger, _transformer_tagger],
                         ids=["lstm", "transformer"])
def test_a_padded_sequence_model_trains_as_one_device(cpus, split, builder):
    # The LSTM's mask reaches the loss: each replica's loss divides by its valid timesteps.
    x, y = _padded_sequences()
    diff, histories, batches, evaluations = _train_pair(builder, x, y, split, loss=_scce)
    _assert_as_one_device(diff, histories, batches, evaluations)


@SPLITS
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight"])
def test_a_mask_and_per_timestep_sample_weights(cpus, split, reduction):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(N, T, 3)).astype("float32")
    for i, length in enumerate(rng.integers(1, T + 1, N)):
        x[i, length:] = 0.0  # padding, masked by Masking(0.0)
    y = rng.normal(size=(N, T, 1)).astype("float32")
    weights = rng.uniform(0.0, 2.0, (N, T)).astype("float32")
    diff, histories, batches, evaluations = _train_pair(
        _masking_gru, x, y, split, loss=lambda: keras.losses.MeanSquaredError(reduction=reduction),
        fit_kwargs={"sample_weight": weights}, evaluate_kwargs={"sample_weight": weights})
    _assert_as_one_device(diff, histories, batches, evaluations)


@SPLITS
def test_several_outputs_with_loss_weights_and_their_own_logs(cpus, split):
    # Each output's loss in History and evaluate is the global one, not a mean of replicas'.
    x, y, _ = _two_output_data(3)
    diff, histories, batches, evaluations = _train_pair(
        _two_outputs, x, y, split, loss=lambda: {"cls": _scce(), "reg": "mse"},
        loss_weights={"cls": 1.0, "reg": 0.5})
    assert {"cls_loss", "reg_loss", "loss"} <= set(histories[1])
    _assert_as_one_device(diff, histories, batches, evaluations)


@SPLITS
def test_outputs_with_different_reductions_each_weighted_by_their_own(cpus, split):
    x, y, rng = _two_output_data(4)
    weights = rng.uniform(0.0, 2.0, N).astype("float32")
    diff, histories, _, _ = _train_pair(
        _two_outputs, x, y, split, fit_kwargs={"sample_weight": weights},
        loss=lambda: {"cls": _scce(),
                      "reg": keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")})
    _assert_as_one_device(diff, histories)


@SPLITS
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean_with_sample_weight", "sum"])
def test_sample_weights_with_zeros(cpus, split, reduction):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(N, 6)).astype("float32")
    y = rng.normal(size=(N, 1)).astype("float32")
    weights = rng.uniform(0.0, 2.0, N).astype("float32")
    weights[::3] = 0.0
    diff, histories, batches, _ = _train_pair(
        _dense, x, y, split, loss=lambda: keras.losses.MeanSquaredError(reduction=reduction),
        fit_kwargs={"sample_weight": weights})
    _assert_as_one_device(diff, histories, batches)


@pytest.mark.parametrize("split", [[1, 24], [12, 13]], ids=["uneven", "even"])
def test_an_added_mean_loss_with_an_empty_replica_in_the_last_batch(cpus, split):
    # 70 samples in batches of 25: the last batch (20) leaves the first replica nothing at
    # [1, 24]; its mean penalty over no samples adds nothing (no NaN), as on one device.
    rng = np.random.default_rng(6)
    x = rng.normal(size=(70, 6)).astype("float32")
    y = rng.normal(size=(70, 1)).astype("float32")
    diff, histories, _, evaluations = _train_pair(
        _dense_with_penalty, x, y, split, loss=lambda: "mse", batch_size=25, epochs=1,
        evaluate_kwargs={"batch_size": 30})
    assert np.isfinite(evaluations[1]["loss"])
    _assert_as_one_device(diff, histories, evaluations)


# ---- a count the loss's own code computes: warned once, with the fix ------------------------
OWN_COUNT = "a scalar computed from its replica's own batch"


def _by_hand(y_true, y_pred):  # the exactness guide's: ignores label 0 by hand
    m = tf.cast(y_true > 0, "float32")
    losses = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    return tf.reduce_sum(losses * m) / tf.reduce_sum(m)


def _by_masked_size(y_true, y_pred):
    losses = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    kept = tf.boolean_mask(losses, y_true > 0)
    return tf.reduce_sum(kept) / tf.cast(tf.size(kept), "float32")


def _per_sequence_mean(y_true, y_pred):  # a mean per sample: the strategy's denominator
    m = tf.cast(y_true > 0, "float32")
    losses = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    return tf.reduce_sum(losses * m, axis=1) / (tf.reduce_sum(m, axis=1) + 1.0)


def _by_element_count(y_true, y_pred):
    losses = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    return tf.reduce_sum(losses) / tf.cast(tf.shape(losses)[0] * tf.shape(losses)[1], "float32")


def _relative_error(y_true, y_pred):  # an elementwise division by data
    y_true = tf.one_hot(tf.cast(y_true, "int32"), CLASSES)
    return tf.reduce_mean(tf.abs(y_true - y_pred) / (tf.abs(y_pred) + 1.0))


class OwnCountStep(keras.Model):
    """A `compute_loss` of raw ops, dividing by its replica's valid labels."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return _by_hand(y, y_pred)


def _tagger(cls=keras.Model, mask_zero=False):
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=mask_zero)(inputs)
    return cls(inputs, keras.layers.Dense(CLASSES)(h))


def _own_count_warnings(cpus, caplog, model_fn, loss, split=(7, 25)):
    import logging

    caplog.set_level(logging.WARNING, logger="tf_hetbatch")
    x, y = _padded_sequences()
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    strategy.set_batch_sizes(list(split))
    with strategy.scope():
        model = model_fn()
        model.compile(optimizer="adam", loss=loss)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return [r.getMessage() for r in caplog.records if OWN_COUNT in r.getMessage()]


@pytest.mark.parametrize("model_fn, loss, name", [
    (_tagger, _by_hand, "'_by_hand'"),
    (_tagger, _by_masked_size, "'_by_masked_size'"),
    (lambda: _tagger(OwnCountStep), None, ".compute_loss"),
], ids=["sum-over-own-count", "boolean-mask-size", "compute-loss-override"])
def test_a_loss_normalised_by_its_replicas_own_count_is_warned_once_with_the_fix(
        cpus, caplog, model_fn, loss, name):
    # Weighted by samples, such a loss trains as the mean of the replicas' normalised losses
    # (the exactness guide measures the drift): said once per loss, naming it and the fix.
    [message] = _own_count_warnings(cpus, caplog, model_fn, loss)
    assert name in message and "mean_with_sample_weight" in message and "all_reduce" in message


@pytest.mark.parametrize("model_fn, loss", [
    (lambda: _tagger(mask_zero=True), _scce),
    (_tagger, _per_sequence_mean),
    (_tagger, _by_element_count),
    (_tagger, _relative_error),
], ids=["keras-mask", "per-sample-mean", "element-count", "elementwise-division"])
def test_losses_whose_denominator_the_strategy_sees_are_not_warned(cpus, caplog, model_fn, loss):
    loss = loss() if loss is _scce else loss
    assert _own_count_warnings(cpus, caplog, model_fn, loss) == []


class OverrideAddsATerm(keras.Model):
    """A `compute_loss` override: Keras's losses plus a per-sample mean of its own, divided by
    the replica count as under any `tf.distribute` strategy (its gradients are summed)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                    training=training)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        return loss + 0.1 * tf.reduce_mean(tf.abs(y_pred)) / replicas


def _override_model():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu",
                           kernel_regularizer=keras.regularizers.L2(1e-2))(inputs)
    return OverrideAddsATerm(inputs, keras.layers.Dense(1)(h))


@SPLITS
def test_a_compute_loss_override_that_adds_its_own_term(cpus, split):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N, 6)).astype("float32")
    y = rng.normal(size=(N, 1)).astype("float32")
    diff, histories, batches, evaluations = _train_pair(_override_model, x, y, split,
                                                        loss=lambda: "mse")
    _assert_as_one_device(diff, histories, batches)


def test_a_masked_loss_in_micro_batches_is_refused_with_the_fix(cpus):
    x, y = _padded_sequences()
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    strategy.set_batch_sizes([7, 25])
    strategy.set_micro_batch_limits([None, 10])
    with strategy.scope():
        model = _lstm_tagger()
        model.compile(optimizer="adam", loss=_scce())
    with pytest.raises(ValueError, match="valid entries.*set_micro_batch_limits"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)


@SPLITS
def test_a_custom_loop_sums_replica_losses_to_the_global_loss_as_stock(cpus, split):
    # TensorFlow's tutorials reduce a step's per-replica losses with SUM: a Keras loss of
    # default reduction then gives the global loss (masked here), as under the stock strategy.
    x, y = _padded_sequences()
    keras.utils.set_random_seed(1)
    reference = _lstm_tagger()
    expected = float(_scce()(y[:32], reference(x[:32])))
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    strategy.set_batch_sizes(split)
    loss_object = _scce()
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = _lstm_tagger()
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x[:32], y[:32])).batch(32))

    @tf.function
    def loss_of(batch):
        losses = strategy.run(lambda a, b: loss_object(b, model(a)), args=batch)
        return strategy.reduce("SUM", losses, axis=None)

    assert float(loss_of(next(iter(dist)))) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("loss", [lambda: "mse", keras.losses.MeanSquaredError],
                         ids=["by_name", "object"])
def test_a_custom_loop_of_compute_loss_before_any_fit(cpus, loss):
    # The compiled loss is built by the loop's first step (no fit built it): that step weights
    # it whole, once, whether its term is a Loss object the step reaches or one Keras made.
    rng = np.random.default_rng(8)
    x = rng.normal(size=(N, 6)).astype("float32")
    y = rng.normal(size=(N, 1)).astype("float32")
    keras.utils.set_random_seed(1)
    reference = _dense()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
    history = reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0).history
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    strategy.set_batch_sizes([7, 25])
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = _dense()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(32))

    @tf.function
    def train_step(batch):
        def replica(features, labels):
            with tf.GradientTape() as tape:
                loss_value = model.compute_loss(x=features, y=labels,
                                                y_pred=model(features, training=True))
            grads = tape.gradient(loss_value, model.trainable_variables)
            model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss_value
        return strategy.reduce("SUM", strategy.run(replica, args=batch), axis=None)

    losses = [float(train_step(batch)) for batch in dist]
    assert max_weight_diff(reference, model) <= TOL
    assert np.mean(losses) == pytest.approx(history["loss"][0], rel=1e-5)
