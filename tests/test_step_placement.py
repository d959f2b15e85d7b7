"""Where a step's host-side work is placed: the timing stamps and the micro-batch loop's integers.

On a GPU replica every control edge from a device op to a host op is a send/recv pair of its
own, and a loop whose condition or slice bounds live on the device makes each micro-batch wait
for the device. Checked here in the traced graph's device strings, on logical CPUs (a worker
hosting several CPU devices is the shape of a multi-GPU worker); the GPU mapping of a replica
to its host CPU is checked on device names.
"""

import keras
import numpy as np
import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch.distribute import timing


def test_a_replica_s_host_is_its_task_s_cpu():
    gpu = "/job:worker/replica:0/task:3/device:GPU:1"
    assert timing.host_device(gpu) == "/job:worker/replica:0/task:3/device:CPU:0"
    cpu = "/job:worker/replica:0/task:3/device:CPU:2"
    assert timing.host_device(cpu) == cpu  # a CPU replica is its own host
    assert timing.host_device("") == ""


def _traced_step(strategy, limits=None):
    """A custom loop's step under `strategy` (3 replicas, uneven split), traced: its GraphDef."""
    strategy.set_batch_sizes([4, 12, 16])
    if limits is not None:
        strategy.set_micro_batch_limits(limits)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.zeros((32, 8), np.float32)
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(32))
    loss_fn = keras.losses.MeanSquaredError()

    def replica_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(inputs):
        return strategy.run(replica_step, args=(inputs,))

    batch = next(iter(dist))
    step(batch)
    return step.get_concrete_function(batch).graph.as_graph_def()


def _all_nodes(graph_def):
    yield from graph_def.node
    for function in graph_def.library.function:
        yield from function.node_def


def test_each_stamp_waits_on_one_edge_and_names_its_device(cpus):
    graph_def = _traced_step(hb.HeteroMirroredStrategy(cpus[:3]))
    stamps = [n for n in _all_nodes(graph_def) if n.op == "Timestamp"]
    assert len(stamps) == 3 * 3  # start, gradients ready, release: per replica
    for node in stamps:
        control = [i for i in node.input if i.startswith("^")]
        assert len(control) <= 1, (node.name, control)  # one no-op, not one per tensor
        assert tf.DeviceSpec.from_string(node.device).device_type == "CPU", node.device
    assert sum(1 for n in stamps if n.input) == 3 * 3  # none floats free of its step


def test_the_micro_batch_loop_counts_on_the_replica_s_host(cpus):
    graph_def = _traced_step(hb.HeteroMirroredStrategy(cpus[:3]), limits=[None, 4, None])
    conditions = [n for n in _all_nodes(graph_def) if n.op == "Less"]
    assert conditions, "no loop condition traced"
    for node in conditions:
        spec = tf.DeviceSpec.from_string(node.device)
        assert spec.device_type == "CPU" and timing.host_device(node.device) == node.device


def _cross_device_inputs(graph_def, into):
    """(source device, source tensor) of the data inputs that nodes on `into` take from
    another device."""
    def device(name):  # "/device:CPU:0" and "/job:localhost/.../device:CPU:0" are one
        spec = tf.DeviceSpec.from_string(name)
        return (spec.device_type, spec.device_index) if name else None

    nodes = {n.name: n for n in _all_nodes(graph_def)}
    found = set()
    for node in _all_nodes(graph_def):
        if device(node.device) != device(into):
            continue
        for name in node.input:
            if name.startswith("^"):
                continue
            source = nodes.get(name.split(":")[0])
            if source is not None and source.device and device(source.device) != device(into):
                found.add((source.device, name))
    return found


def test_the_host_all_reduce_copies_one_pack_per_replica_and_dtype(cpus):
    # Four gradients (two Dense layers) and the timing row, all float32: each replica other
    # than the host's own hands the host one packed tensor, not one per gradient.
    strategy = hb.HeteroMultiWorkerMirroredStrategy(cpus[:3], all_reduce="host")
    graph_def = _traced_step(strategy)
    host = tf.DeviceSpec.from_string(strategy.extended.worker_devices[0]).to_string()
    edges = _cross_device_inputs(graph_def, host)
    per_replica = {}
    for device, _ in edges:
        per_replica[device] = per_replica.get(device, 0) + 1
    assert len(per_replica) == 2 and all(count == 1 for count in per_replica.values()), edges
