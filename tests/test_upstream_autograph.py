"""Canaries of `_upstream.autograph`: tf_hetbatch's own functions are called by AutoGraph as
they are, and users' functions are converted as before.

If the artifact mark stops working, the "as it is" halves fail: tf_hetbatch's code is then
rewritten again (slower, not wrong). If it starts to switch AutoGraph off for what such a
function calls, the "converted" halves fail: a user's function with Python control flow on
tensors, called through tf_hetbatch, would be refused.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch.distribute._upstream import autograph, tf_data


def python_if(v):
    if v > 2:  # a tensor: only AutoGraph's rewrite makes this a tf.cond
        return v
    return -v


def test_tf_data_calls_the_splits_functions_as_they_are_and_converts_users_maps_inside():
    """`tf_data.map_inline` / `flat_map_host` hand tf.data their function through `as_is`."""
    # A function of the user's: tf.data converts it.
    assert [int(v) for v in tf.data.Dataset.range(5).map(python_if)] == [0, -1, -2, 3, 4]
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
        tf_data.map_inline(tf.data.Dataset.range(5), python_if)

    def host(batch):  # maps a user's function inside, as the split's moved per-sample maps do
        return tf.data.Dataset.from_tensor_slices(batch).map(python_if).batch(5)

    ds = tf_data.flat_map_host(tf.data.Dataset.range(5).batch(5), host)
    assert [[int(v) for v in b] for b in ds] == [[0, -1, -2, 3, 4]]


def test_a_method_of_a_marked_class_is_called_as_it_is_from_a_users_tf_function():
    """`methods_as_is`: a tf.function that AutoGraph converts calls the method as it is."""

    class Plain:
        def call(self, v):
            if v > 2:
                return v
            return -v

    @autograph.methods_as_is
    class Marked:
        def call(self, v):
            if v > 2:
                return v
            return -v

    def calling(obj):
        return tf.function(lambda v: obj.call(v))

    assert int(calling(Plain())(tf.constant(3))) == 3  # rewritten: the `if` is a tf.cond
    with pytest.raises(tf.errors.OperatorNotAllowedInGraphError):
        calling(Marked())(tf.constant(3))


def test_a_custom_loop_step_with_python_control_flow_is_converted_as_under_a_stock_strategy(cpus):
    """`like_stock_run` inside `strategy.run` (itself as it is): the user's replica function
    is converted, by the status of the user's tf.function, and trains as under the stock
    MirroredStrategy."""
    x = np.arange(16, dtype="float32").reshape(8, 2)

    def run_on(strategy):
        def replica_step(batch):
            per_example = tf.reduce_sum(batch, axis=1)
            if tf.reduce_sum(batch) > 20.0:  # Python control flow on a tensor
                per_example = per_example * 2.0
            return tf.nn.compute_average_loss(per_example, global_batch_size=4)

        @tf.function
        def step(batch):
            losses = strategy.run(replica_step, args=(batch,))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

        data = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices(x).batch(4))
        return [float(step(batch)) for batch in data]

    stock = run_on(tf.distribute.MirroredStrategy(cpus[:2]))
    ours = run_on(hb.HeteroMirroredStrategy(cpus[:2]))
    # Batch 1: replica 0's rows sum to 6 (not doubled), replica 1's to 22 (doubled).
    assert stock == [(1 + 5) / 4 + 2 * (9 + 13) / 4, 2 * (17 + 21 + 25 + 29) / 4]
    np.testing.assert_allclose(ours, stock, rtol=1e-6)


def test_a_tf_function_handed_to_the_stock_run_is_cloned_around_the_replicas(cpus):
    """`autograph.function_around_run`: the stock `run` of a tf.function whose replicas meet
    in a merge call works only because it clones the function around its replicas (called
    per replica, the merge call would be inside a nested function); `Function._clone` keeps
    the decorator's arguments. If this fails, TensorFlow changed how it runs a tf.function
    handed to `run`: follow it in `function_around_run`."""
    from tensorflow.python.distribute import mirrored_run
    from tensorflow.python.eager import def_function

    strategy = tf.distribute.MirroredStrategy(cpus[:2])

    @tf.function(reduce_retracing=True, input_signature=[])
    def replica_sum():
        ctx = tf.distribute.get_replica_context()
        own = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
        return ctx.all_reduce("SUM", own)  # a merge call

    summed = strategy.run(replica_sum)
    assert [float(t) for t in strategy.experimental_local_results(summed)] == [3.0, 3.0]
    clone = mirrored_run._cfer_fn_cache[strategy][replica_sum]  # stock's clone, cached
    assert isinstance(clone, def_function.Function) and clone is not replica_sum
    with pytest.raises(RuntimeError, match="`merge_call` called while defining a new graph"):
        mirrored_run._call_for_each_replica(strategy, replica_sum, (), {})

    ours, clones = hb.HeteroMirroredStrategy(cpus[:2]), autograph.function_clones()
    ours_clone = autograph.function_around_run(ours, replica_sum, None, clones)
    assert ours_clone is autograph.function_around_run(ours, replica_sum, None, clones)
    assert autograph.function_around_run(ours, replica_sum.python_function, None,
                                         clones) is None
    assert isinstance(ours_clone, def_function.Function)
    assert ours_clone.input_signature == replica_sum.input_signature
    assert ours_clone._reduce_retracing and ours_clone._autograph
    assert ours_clone.python_function is not replica_sum.python_function
    summed = ours.run(replica_sum)
    assert [float(t) for t in ours.experimental_local_results(summed)] == [3.0, 3.0]
