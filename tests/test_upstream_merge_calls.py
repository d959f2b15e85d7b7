"""Canaries of `_upstream.merge_calls`: an accumulating optimizer's update without merge calls.

When one fails after an upgrade, read `tf_hetbatch/distribute/_upstream/merge_calls.py`: the
workaround may be obsolete (lift it) or broken (fix it), but it must not go on silently.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch.distribute._upstream import merge_calls
from helpers import dense_model, regression_data, stock_mirrored


def test_the_stock_strategy_fails_a_traced_accumulating_step(cpus):
    """The upstream bug (keras-team/keras#17429): if the stock strategy trains this, the
    workaround may be obsolete."""
    x, y = regression_data(n=64)
    with stock_mirrored(cpus[:2]).scope():
        model = dense_model(keras.optimizers.SGD(0.05, gradient_accumulation_steps=2))
    with pytest.raises(RuntimeError, match="merge_call"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_keras_asks_the_extended_and_each_replica_updates_its_own_copy(cpus):
    """What the answer relies on: Keras's `maybe_merge_call` asks the strategy's extended
    (`strategy_supports_no_merge_call`), only in the thread that is told so; and without merge
    calls `extended.update` in replica context updates the replica's own copy with the replica's
    own value (so the same summed value keeps every copy equal), in a traced step and inside a
    `tf.cond` branch, where a merge call is refused."""
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    with strategy.scope():
        variable = tf.Variable(0.0, aggregation=tf.VariableAggregation.NONE)

    answers = []

    def replica_fn():
        replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group,
                          tf.float32)
        answers.append(tf.__internal__.distribute.strategy_supports_no_merge_call())
        with merge_calls._without_merge_calls(strategy.extended):
            answers.append(tf.__internal__.distribute.strategy_supports_no_merge_call())

            def update():
                strategy.extended.update(variable, lambda v, value: v.assign(value),
                                         args=(replica + 1.0,), group=False)
                return tf.constant(True)
            tf.cond(replica >= 0.0, update, lambda: tf.constant(False))

    tf.function(lambda: strategy.run(replica_fn))()
    assert answers == [False, True, False, True]
    assert [float(v.numpy()) for v in strategy.experimental_local_results(variable)] == [1.0, 2.0]
