"""Canaries of `_upstream.collectives`: collective keys, the gradient all-reduce, agreement.

When one fails after an upgrade, read the matching section of
`tf_hetbatch/distribute/_upstream/collectives.py`: the workaround may be obsolete
(lift it) or broken (fix it), but it must not go on silently.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch.distribute._upstream import collectives
from helpers import OwnStep, regression_data, stock_mirrored


def test_collective_key_base_is_read_from_the_strategy_object(cpus):
    """`collectives.assign_collective_key_base`: TensorFlow reads the strategy object's
    `_collective_key_base`, so two strategies in one process get keys apart."""
    first = hb.HeteroMirroredStrategy(cpus[:2])
    second = hb.HeteroMirroredStrategy(cpus[:2])
    keys = [s.extended._collective_keys._group_key for s in (first, second)]
    assert keys[0] != keys[1]
    assert abs(keys[0] - keys[1]) >= collectives._COLLECTIVE_KEY_STRIDE


def test_a_second_multi_worker_strategy_with_peers_is_warned_of(caplog):
    """`collectives.warn_if_second_multi_worker_strategy`: without peers nothing is said (the
    suite's own strategies); with peers the second is."""
    with caplog.at_level("WARNING", logger="tf_hetbatch.distribute._upstream.collectives"):
        collectives.warn_if_second_multi_worker_strategy(1)
        assert not caplog.records
        collectives.warn_if_second_multi_worker_strategy(3)
        collectives.warn_if_second_multi_worker_strategy(3)
    assert [r.levelname for r in caplog.records] == ["WARNING"]


@pytest.mark.parametrize("model_class", [keras.Sequential, OwnStep],
                         ids=["keras_train_step", "own_train_step"])
def test_loss_scale_optimizer_checks_only_the_first_replica_upstream(cpus, model_class):
    """Keras's LossScaleOptimizer applies an overflowed step if replica 0 did not overflow.
    Ours skips it on every replica: every step applies gradients summed across replicas
    first (`updates.adapt_optimizer`), so every replica checks the same sums."""
    x, y = regression_data(n=32)
    x[16:] *= 1e30  # only the second replica's half overflows

    def run(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = model_class([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), "mse")
        before = model.get_weights()
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        return before, model.get_weights(), float(model.optimizer.dynamic_scale.numpy())

    _, stock_after, _ = run(stock_mirrored(cpus[:2]))
    assert not all(np.all(np.isfinite(w)) for w in stock_after)  # the upstream bug

    ours = hb.HeteroMirroredStrategy(cpus[:2])
    before, after, scale = run(ours)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)  # the step is skipped on every replica
    assert scale < 32768.0  # and the loss scale lowered


def test_tensorflow_feeds_a_collective_a_new_instance_key_at_every_call():
    """Why the step's all-reduce gets its keys from `collectives.instance_keys_from_values`:
    TensorFlow's launcher feeds the instance key at every call (so a cluster resolves every
    step's collective anew, through task 0). If the first assert fails, TensorFlow fixed keys
    at trace time itself: re-measure bench_fixed_cost without the adaptation. Traced only: no
    group."""
    from tensorflow.python.distribute import collective_util
    from tensorflow.python.distribute import cross_device_utils

    keys = cross_device_utils.CollectiveKeys(group_key_start=7)
    launcher = cross_device_utils.CollectiveReplicaLauncher(
        keys.get_group_key(["/cpu:0"]), 2, keys, "/cpu:0", collective_util.Options())
    values = [tf.ones([3]), tf.ones([2, 2])]

    def instance_keys(fn):  # the instance key input of each all-reduce traced by fn
        graph = tf.function(fn).get_concrete_function().graph
        ops = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
        return [int(tf.get_static_value(op.inputs[3])) if op.inputs[3].op.type == "Const"
                else op.inputs[3].op.type for op in ops]

    def two_sums():
        return [launcher.all_reduce(v) for v in values]

    assert instance_keys(two_sums) == ["Placeholder", "Placeholder"]  # fed at every call
    with collectives.instance_keys_from_values([launcher], values):
        first, second = instance_keys(two_sums), instance_keys(two_sums)
    assert all(isinstance(k, int) and k >= 2 ** 30 for k in first), first
    assert first == second  # the same keys whenever (and wherever) it is traced
    assert first[0] != first[1]  # distinct collectives of one function: distinct keys
    with collectives.instance_keys_from_values([launcher], values[:1]):
        assert instance_keys(lambda: launcher.all_reduce(values[0])) != first[:1]  # other shapes
    assert instance_keys(two_sums) == ["Placeholder", "Placeholder"]  # outside: TensorFlow's


def test_keras_optimizer_all_reduces_through_the_wrapped_method(cpus):
    """`collectives.wrap_gradient_all_reduce` / `gradients_already_reduced`: Keras's TensorFlow
    optimizer sums the replicas' gradients in `_all_reduce_sum_gradients` when it applies
    them. If Keras sums them elsewhere, the gradients `updates` already summed would be
    summed again (an update K times too large)."""
    strategy = stock_mirrored(cpus[:2])
    with strategy.scope():
        variable = keras.Variable(np.zeros(2, "float32"))
        optimizer = keras.optimizers.SGD(1.0)
        optimizer.build([variable])
    collectives.wrap_gradient_all_reduce(optimizer)

    def step(already_reduced):
        def replica_fn():
            grads = [tf.ones(2)]
            if already_reduced:
                with collectives.gradients_already_reduced(optimizer):
                    optimizer.apply(grads, [variable])
            else:
                optimizer.apply(grads, [variable])
        tf.function(lambda: strategy.run(replica_fn))()

    step(False)  # summed over the 2 replicas: -2
    np.testing.assert_allclose(variable.numpy(), [-2.0, -2.0])
    step(True)  # passed on as it is: -1 more
    np.testing.assert_allclose(variable.numpy(), [-3.0, -3.0])
