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


def _launcher(group_key):
    from tensorflow.python.distribute import collective_util
    from tensorflow.python.distribute import cross_device_utils

    keys = cross_device_utils.CollectiveKeys(group_key_start=group_key)
    return cross_device_utils.CollectiveReplicaLauncher(
        keys.get_group_key(["/cpu:0"]), 2, keys, "/cpu:0", collective_util.Options())


def _instance_keys(fn):
    """The instance key input of each all-reduce traced by `fn` (an int when fixed)."""
    graph = tf.function(fn).get_concrete_function().graph
    ops = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    return [int(tf.get_static_value(op.inputs[3])) if op.inputs[3].op.type == "Const"
            else op.inputs[3].op.type for op in ops]


def test_tensorflow_feeds_a_collective_a_new_instance_key_at_every_call():
    """Why the step's all-reduce gets its keys from `collectives.static_instance_keys`:
    TensorFlow's launcher feeds the instance key at every call (so a cluster resolves every
    step's collective anew, through task 0). If the first assert fails, TensorFlow fixed keys
    at trace time itself: re-measure bench_fixed_cost without the adaptation. Traced only: no
    group."""
    launcher = _launcher(7)
    values = [tf.ones([3]), tf.ones([2, 2]), tf.zeros([3])]

    def three_sums():
        return [launcher.all_reduce(v) for v in values]

    assert _instance_keys(three_sums) == ["Placeholder"] * 3  # fed at every call
    with collectives.static_instance_keys([launcher]):
        first, second = _instance_keys(three_sums), _instance_keys(three_sums)
    assert all(isinstance(k, int) and k >= 2 ** 30 for k in first), first
    assert first == second  # the same keys whenever (and wherever) it is traced
    assert len(set(first)) == 3  # distinct collectives of one function (one shape twice)
    with collectives.static_instance_keys([launcher]):
        assert _instance_keys(lambda: launcher.all_reduce(values[0])) == first[:1]
        assert _instance_keys(lambda: launcher.all_reduce(tf.ones([4]))) != first[:1]
    assert _instance_keys(three_sums) == ["Placeholder"] * 3  # outside: TensorFlow's


def test_a_nested_trace_keeps_its_own_ranks_and_eager_calls_keep_tensorflows_keys():
    """`collectives.static_instance_keys`: ranks count per function graph, so a function
    traced in the middle of another's trace neither restarts nor shares the outer count; an
    eager all-reduce (TensorFlow's counter) is never given a fixed key."""
    launcher = _launcher(11)

    def inner():
        return launcher.all_reduce(tf.ones([5]))

    def outer():
        first = launcher.all_reduce(tf.ones([5]))
        nested = tf.function(inner).get_concrete_function().graph  # traced meanwhile
        ops = [op for op in nested.get_operations() if op.type == "CollectiveReduceV2"]
        nested_keys.append(int(tf.get_static_value(ops[0].inputs[3])))
        return [first, launcher.all_reduce(tf.ones([5]))]

    nested_keys = []
    with collectives.static_instance_keys([launcher]):
        outer_keys = _instance_keys(outer)
        alone = _instance_keys(inner)
        eager = launcher._next_instance_key()  # as an eager all-reduce asks
    assert len(set(outer_keys)) == 2, outer_keys  # not restarted by the nested trace
    assert nested_keys == alone == outer_keys[:1]  # its own rank 0, like any other trace
    assert int(eager) < 2 ** 30  # TensorFlow's counter


def test_a_static_key_stands_for_one_dtype_shape_and_rank_in_the_process():
    """`collectives.static_instance_key`: TensorFlow keeps what it resolved for an instance
    key (dtype, shape) for the life of the process and aborts every collective when the key
    comes with another ("Shape mismatch in the collective instance"). A hash that lands on a
    key taken by something else moves on to a free one."""
    group = 987_654
    key = collectives.static_instance_key(group, tf.float32, [3], 0)
    assert key == collectives.static_instance_key(group, "float32", (3,), 0)  # stable
    others = {collectives.static_instance_key(group, dtype, shape, rank)
              for dtype in (tf.float32, tf.float64) for shape in ([3], [1, 3], [4])
              for rank in (0, 1)}
    assert len(others) == 12 and key in others
    taken = (group + 1, key)  # another group: the same hash, a key of its own
    collectives._static_keys[taken] = ("int32", (9, 9), 0)  # as if taken by another identity
    try:
        moved = collectives.static_instance_key(group + 1, tf.float32, [3], 0)
    finally:
        del collectives._static_keys[taken]
    assert moved != key and 2 ** 30 <= moved < 2 ** 31


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
