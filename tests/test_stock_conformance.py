"""The strategy where TensorFlow's own MirroredStrategy tests reach: what stock users do besides
batches of data, with the same results as the stock strategy (at the even split, and where the
meaning allows it at an uneven one).

- `strategy.run` with arguments that have no batch dimension (scalars, also per-replica ones
  from `experimental_distribute_values_from_function`): they carry no samples, and the step
  runs as the stock one's (all-reduces, gradients through them);
- reading a sync-on-read variable with MEAN aggregation (`strategy.reduce` of it);
- `experimental_distribute_dataset` while a graph is being built (a v1 graph).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from helpers import stock_mirrored

MODES = ["eager", "function"]


def _strategies(devices):
    return {"stock": stock_mirrored(devices), "ours": hb.HeteroMirroredStrategy(devices)}


def _local(strategy, value):
    return [np.asarray(t).tolist() for t in strategy.experimental_local_results(value)]


def _call(mode, fn):
    return tf.function(fn)() if mode == "function" else fn()


# --------------------------------------------------------------------- scalar arguments -----
def _scalar_step(strategy, mode, scale):
    """What TensorFlow's run/all-reduce tests do: a scalar argument, replica-dependent values,
    SUM and MEAN all-reduces in replica context and gradients through them."""
    with strategy.scope():
        w = tf.Variable(2.0)

    def replica_fn(s):
        ctx = tf.distribute.get_replica_context()
        rid = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
        with tf.GradientTape() as tape:
            value = s * w * (rid + 1.0)
            summed = ctx.all_reduce("SUM", value)
            mean = ctx.all_reduce("MEAN", value)
        grad = tape.gradient(summed + mean, w)
        return s * (rid + 1.0), summed, mean, grad

    def step():
        out = strategy.run(replica_fn, args=(scale,))
        return out + (strategy.reduce("SUM", out[0], axis=None),
                      strategy.reduce("MEAN", out[0], axis=None))

    out = _call(mode, step)
    return [_local(strategy, v) for v in out[:4]] + [float(v) for v in out[4:]]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("replicas", [1, 2])
def test_run_with_a_scalar_argument_is_as_stock(cpus, mode, replicas):
    strategies = _strategies(cpus[:replicas])
    results = {name: _scalar_step(s, mode, tf.constant(3.0)) for name, s in strategies.items()}
    assert results["ours"] == results["stock"]
    if replicas == 2:  # the values themselves: [3, 6] doubled by w, summed 18, mean 9
        assert results["ours"][:3] == [[3.0, 6.0], [18.0, 18.0], [9.0, 9.0]]


@pytest.mark.parametrize("mode", MODES)
def test_run_with_a_scalar_argument_at_an_uneven_split_is_as_stock(cpus, mode):
    # The split concerns batches of data: a run with scalars is not weighted by it.
    strategies = _strategies(cpus[:2])
    strategies["ours"].set_batch_sizes([1, 3])
    results = {name: _scalar_step(s, mode, tf.constant(3.0)) for name, s in strategies.items()}
    assert results["ours"] == results["stock"]


def _values_from_function(strategy, mode):
    """TensorFlow's input tutorial: per-replica scalars from a function, run and reduced."""
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(float(ctx.replica_id_in_sync_group + 1)))

    def replica_fn(v):
        ctx = tf.distribute.get_replica_context()
        return v * 10.0, ctx.all_reduce("SUM", v), ctx.all_reduce("MEAN", v)

    def step():
        out = strategy.run(replica_fn, args=(values,))
        return out + (strategy.reduce("SUM", out[0], axis=None),
                      strategy.reduce("MEAN", out[0], axis=None))

    out = _call(mode, step)
    return [_local(strategy, v) for v in out[:3]] + [float(v) for v in out[3:]]


@pytest.mark.parametrize("mode", MODES)
def test_per_replica_scalars_from_a_function_are_as_stock(cpus, mode):
    strategies = _strategies(cpus[:2])
    results = {name: _values_from_function(s, mode) for name, s in strategies.items()}
    assert results["ours"] == results["stock"]
    assert results["ours"] == [[10.0, 20.0], [3.0, 3.0], [1.5, 1.5], 30.0, 15.0]
    strategies["ours"].set_batch_sizes([3, 1])  # no batch: nothing to weight
    assert _values_from_function(strategies["ours"], mode) == results["stock"]


def _scaled_loss_training(strategy, scale, split=None):
    """A custom loop whose replica step takes a scalar next to its batch:
    run(train_step, args=(scale, batch)). Without a strategy: one device on the global batch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
        return model

    loss_object = keras.losses.MeanSquaredError()

    def train_step(s, batch):
        features, labels = batch
        with tf.GradientTape() as tape:
            loss = s * loss_object(labels, model(features, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if strategy is None:
        model = build()
        step = tf.function(train_step)
        for batch in data:
            step(scale, batch)
        return model.get_weights()
    with strategy.scope():
        model = build()
    if split is not None:
        strategy.set_batch_sizes(split)

    @tf.function
    def distributed_step(batch):
        return strategy.run(train_step, args=(scale, batch))

    for batch in strategy.experimental_distribute_dataset(data):
        distributed_step(batch)
    return model.get_weights()


def test_a_scalar_next_to_a_batch_leaves_the_batch_weighted(cpus):
    # run(fn, args=(scale, batch)): the scalar carries no samples, the batch does, so each
    # replica's loss is weighted by its share of the batch, exactly like one device.
    scale = tf.constant(0.5)
    reference = _scaled_loss_training(None, scale)
    ours = _scaled_loss_training(hb.HeteroMirroredStrategy(cpus[:2]), scale, split=[2, 6])
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(reference, ours)) <= 1e-5
    unscaled = _scaled_loss_training(None, tf.constant(1.0))  # negative control
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(reference, unscaled)) > 1e-3


# --------------------------------------------------------------------- sync-on-read MEAN -----
def _sync_on_read_reads(strategy, mode, aggregation):
    with strategy.scope():
        v = tf.Variable(1.0, synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=aggregation)

    def replica_fn():
        rid = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        v.assign(rid + 1.0)

    def reads():
        return (strategy.extended.read_var(v), v.read_value(), tf.convert_to_tensor(v),
                strategy.reduce(aggregation.name, v, axis=None))

    first = [float(t) for t in _call(mode, reads)]
    _call(mode, lambda: strategy.run(replica_fn))
    after_run = [float(t) for t in _call(mode, reads)]
    v.assign(6.0)  # cross-replica assignment
    after_assign = [float(t) for t in _call(mode, reads)]
    return first, after_run, after_assign


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("aggregation", [tf.VariableAggregation.MEAN,
                                         tf.VariableAggregation.SUM])
def test_reading_a_sync_on_read_variable_is_as_stock(cpus, mode, aggregation):
    strategies = _strategies(cpus[:2])
    strategies["ours"].set_batch_sizes([1, 3])  # variables are not data: no weighting
    results = {name: _sync_on_read_reads(s, mode, aggregation)
               for name, s in strategies.items()}
    assert results["ours"] == results["stock"]
    if aggregation == tf.VariableAggregation.MEAN:
        assert results["ours"] == ([1.0] * 4, [1.5] * 4, [6.0] * 4)


def test_a_mean_of_a_sync_on_read_variable_is_not_said_to_be_unweighted(cpus, caplog):
    # Only per-replica outputs of a step are asked whether nothing weighted them.
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    with strategy.scope():
        v = tf.Variable(1.0, synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=tf.VariableAggregation.MEAN)
    with caplog.at_level("WARNING", logger="tf_hetbatch"):
        assert float(strategy.reduce("MEAN", v, axis=None)) == 1.0
    assert not [r for r in caplog.records if "equal weights" in r.getMessage()]


# --------------------------------------------------------------------- data in a graph ------
@pytest.mark.parametrize("fetch_to_device", [True, False])
def test_distributing_a_dataset_in_a_graph_is_as_stock(cpus, fetch_to_device):
    # TensorFlow's prefetch tests in graph mode: the dataset is distributed (its iteration is
    # eager-only for both strategies).
    options = tf.distribute.InputOptions(experimental_fetch_to_device=fetch_to_device)
    specs = {}
    for name in ("stock", "ours"):
        with tf.Graph().as_default():
            strategy = _strategies(cpus[:2])[name]
            dist = strategy.experimental_distribute_dataset(
                tf.data.Dataset.range(8).batch(4), options=options)
            assert isinstance(dist, tf.distribute.DistributedDataset)
            specs[name] = dist.element_spec
    assert specs["ours"] == specs["stock"]



# --------------------------------------------------------------- a reshuffling dataset -----
def _epoch_weights(strategy, sizes=None):
    """`fit` over `shuffle(n, seed).batch(B)` (reshuffled each epoch): the weights after each
    epoch."""
    if sizes is not None:
        strategy.set_batch_sizes(sizes)
    keras.utils.set_random_seed(1)  # the shuffle's seeds are (global seed, its own)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) + rng.normal(size=(32, 1))).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(32, seed=0).batch(8)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.2), "mse")
    weights = []
    model.fit(data, epochs=3, verbose=0, callbacks=[keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: weights.append(model.get_weights()))])
    return weights


def test_each_epoch_of_a_reshuffling_dataset_trains_in_stocks_order(cpus):
    """A seeded `shuffle` draws each new iterator's order from one stream, and Keras makes an
    iterator at each epoch's end that the next epoch discards: an iterator made lazily skipped
    that draw, and every epoch after the first trained in another order than stock's."""
    stock = _epoch_weights(stock_mirrored(cpus[:2]))
    ours = _epoch_weights(hb.HeteroMirroredStrategy(cpus[:2]), [3, 5])
    for epoch, (a, b) in enumerate(zip(stock, ours)):
        diff = max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))
        assert diff < 1e-5, f"epoch {epoch}: {diff}"
