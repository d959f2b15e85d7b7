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
