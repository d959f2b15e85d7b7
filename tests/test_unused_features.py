"""What a run does not use costs its steps nothing: without micro-batch limits a step touches
none of their state (the limits, the out-of-memory update gate and failure flags) and has no
micro-batch loop; without `measure_gradient_noise` none of the noise scale's. Checked in the
traced step of Keras's own `train_step` on 2 logical CPUs at an uneven split; the same step
with limits set (the noise measured) shows what the check looks for."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb

# The state of micro-batching and of surviving out of memory (`set_micro_batch_limits`).
MICRO_BATCH_STATE = {"hetbatch_micro_batch_limits", "hetbatch_update_gate",
                     "hetbatch_out_of_memory_flags"}


def _traced_train_step(cpus, limits, noise=False):
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    strategy.set_batch_sizes([10, 22])
    if limits is not None:
        strategy.set_micro_batch_limits(limits)
    if noise:
        strategy.measure_gradient_noise()
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                  keras.layers.Dense(1)])
        model.compile("sgd", "mse", metrics=["mae"])
    x = np.zeros((32, 4), np.float32)
    batches = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(32)
    model.fit(batches, verbose=0)  # builds the metrics, and with limits guards the step
    data = strategy.experimental_distribute_dataset(batches)

    @tf.function
    def step(batch):
        return strategy.run(model.train_step, args=(batch,))

    graph = step.get_concrete_function(next(iter(data))).graph
    state = {v.name.split("/")[0].split(":")[0] for v in graph.variables}
    op_types = {op.type for op in graph.get_operations()}
    for function in graph._functions.values():  # loop bodies, conditions
        op_types |= {op.type for op in function.graph.get_operations()}
    return state, op_types


@pytest.mark.parametrize("limits", [None, [8, None]], ids=["no limits", "limits"])
def test_a_step_without_micro_batch_limits_has_none_of_their_work(cpus, limits):
    state, op_types = _traced_train_step(cpus, limits)
    if limits is None:
        assert not state & MICRO_BATCH_STATE
        assert not op_types & {"While", "StatelessWhile"}
    else:
        assert {"hetbatch_micro_batch_limits", "hetbatch_update_gate"} <= state
        assert op_types & {"While", "StatelessWhile"}


@pytest.mark.parametrize("noise", [False, True], ids=["off", "measured"])
def test_a_step_without_the_noise_scale_has_none_of_its_state(cpus, noise):
    state, _ = _traced_train_step(cpus, None, noise)
    assert ("hetbatch_gradient_noise" in state) == noise
