"""Canaries of `_upstream.device_layout`: workers with different numbers and kinds of devices.

When one fails after an upgrade, read `tf_hetbatch/distribute/_upstream/device_layout.py`: the
workaround may be obsolete (TensorFlow supports uneven layouts itself: lift it) or broken (fix
it), but it must not go on silently. Each canary fails where its mechanism would silently
misbehave; the real clusters are in test_multi_worker.py (`-k layout`).
"""

import dataclasses
import inspect

import pytest
import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as cars
from tensorflow.python.distribute import cross_device_ops as cdo
from tensorflow.python.distribute import cross_device_utils
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import values

from tf_hetbatch.distribute._upstream import collectives, device_layout


class LayoutProbe(tf.distribute.MultiWorkerMirroredStrategy):
    """A stock MWMS subclass on `LayoutExtended` (no tf_hetbatch split): one process."""

    def __init__(self, devices, all_reduce=None):
        collectives.assign_collective_key_base(self)
        device_layout.make_strategy(self, devices, None, None, all_reduce, {})


def _op_inputs(graph, op_type):
    """{node name: [(input op type, constant value or None), ...]} of every `op_type` node."""
    nodes = {n.name: n for n in graph.as_graph_def().node}
    out = {}
    for node in nodes.values():
        if node.op == op_type:
            values = []
            for name in node.input:
                source = nodes.get(name.split(":")[0].lstrip("^"))
                value = None
                if source is not None and source.op == "Const":
                    value = tf.make_ndarray(source.attr["value"].tensor)
                values.append((source.op if source is not None else None, value))
            out[node.name] = (node.device, values)
    return out


def test_a_the_local_devices_are_asked_for_after_the_collective_runtime_is_up():
    """(a) `_initialize_local_devices` (where the layout is exchanged, through the coordination
    service) is called by `_initialize_multi_worker` after `enable_collective_ops` and before
    any group is built; the one-process `_initialize_local` asks it too. If TensorFlow moved
    the call before the server starts, the exchange would have no store to use; if it built a
    group before it, that group would have the stock size."""
    source = inspect.getsource(cars.CollectiveAllReduceExtended._initialize_multi_worker)
    enable = source.index("enable_collective_ops(")
    ask = source.index("self._initialize_local_devices(")
    build = source.index("cross_device_ops_lib.CollectiveAllReduce(")
    assert enable < ask < build
    assert "self._collective_keys = " in source[ask:build]  # rebuilt by us afterwards
    assert "self._initialize_local_devices(" in inspect.getsource(
        cars.CollectiveAllReduceExtended._initialize_local)
    params = list(inspect.signature(
        cars.CollectiveAllReduceExtended._initialize_local_devices).parameters)
    assert params == ["self", "cluster_resolver", "worker_device"]
    # The health check's first reduce (in `_initialize_multi_worker`, before our groups) is
    # skipped through this class attribute.
    assert "self._enable_check_health" in source
    assert cars.CollectiveAllReduceExtended._enable_check_health is True


def test_b_a_device_group_launches_with_the_size_of_the_whole_layout(cpus):
    """(b) `LayoutCollectiveAllReduce` of 2 local devices in a group of 3 (a 1 + 2 layout):
    the traced CollectiveReduceV2 carries group_size 3 (the launcher reads `_group_size` at
    every launch). Traced only, not run."""
    keys = cross_device_utils.CollectiveKeys(group_key_start=7_000_001)
    ops = device_layout.LayoutCollectiveAllReduce(
        cpus[:2], 3, tf.distribute.experimental.CommunicationOptions(), keys)

    @tf.function
    def all_reduce(x):
        return ops._all_reduce(tf.distribute.ReduceOp.SUM, [x], 1, ops._options)

    graph = all_reduce.get_concrete_function(tf.TensorSpec([4], tf.float32)).graph
    reduces = _op_inputs(graph, "CollectiveReduceV2")
    assert len(reduces) == 1
    (device, inputs), = reduces.values()
    assert int(inputs[1][1]) == 3  # (tensor, group_size, group_key, instance_key, ...)
    assert device.endswith("CPU:1")


def test_c_the_stock_device_group_still_refuses_uneven_counts(cpus):
    """(c) The stock `CollectiveAllReduce` refuses 2 local devices in a group of 3. When it
    stops refusing, TensorFlow may support uneven layouts: drop the size hack."""
    with pytest.raises(ValueError, match="group_size must be divisible"):
        cdo.CollectiveAllReduce(cpus[:2], 3, tf.distribute.experimental.CommunicationOptions())


def test_d_replica_ids_come_from_the_overridden_numbering(cpus):
    """(d) `mirrored_run`/`ReplicaContext` and `experimental_distribute_values_from_function`
    number replicas through `_get_replica_id_in_sync_group` / `_num_replicas_in_sync`: with
    the layout of worker 1 of a 1 + 2 cluster, its replicas are 1 and 2 of 3. If TensorFlow
    computed ids elsewhere, they would silently be 0 and 1 (and all-reduces would mix up
    replicas)."""
    probe = LayoutProbe(cpus[:2])
    extended = probe.extended
    here = extended.layout
    extended.layout = dataclasses.replace(
        here, devices=(("/job:worker/task:0/device:CPU:0",),) + here.devices, worker=1)
    assert probe.num_replicas_in_sync == 3

    def replica_id():
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    ids = [int(t) for t in probe.experimental_local_results(probe.run(replica_id))]
    assert ids == [1, 2]
    values = probe.experimental_distribute_values_from_function(
        lambda ctx: tf.constant([ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync]))
    assert [t.numpy().tolist() for t in probe.experimental_local_results(values)] == [
        [1, 3], [2, 3]]
    assert extended._get_local_replica_id(2) == 1


def test_e_one_component_per_replica_values_arrive_plain():
    """(e) `distribute_utils.regroup` unwraps a one-component value: on a one-device worker
    the strategy gets a plain tensor where a per-replica value is meant. That is why a plain
    value counts once per replica in `LayoutCollectiveAllReduce` and `HostAllReduce` (the
    workers must agree on what it means)."""
    t = tf.constant(1.0)
    assert distribute_utils.regroup((t,)) is t
    assert isinstance(distribute_utils.regroup((t, t + 1)), tf.distribute.DistributedValues)


def test_the_host_path_goes_through_merge_call_and_the_hosts_group(cpus):
    """The host all-reduce: TensorFlow's `ReplicaContext.all_reduce` and sync-on-read reads
    consult `_use_merge_call` / `_replica_ctx_all_reduce`, so a replica-context all-reduce
    reaches `HostAllReduce.batch_reduce` in cross-replica context (`HostAllReduce._all_reduce`
    raises if reached per replica). The cross-worker part is one CollectiveReduceV2 on the
    host CPU with the worker count as group size (traced, not run)."""
    probe = LayoutProbe(cpus[:3], all_reduce="host")
    assert isinstance(probe.extended._cross_device_ops, device_layout.HostAllReduce)
    with probe.scope():
        total = tf.Variable(0.0, synchronization=tf.VariableSynchronization.ON_READ,
                            aggregation=tf.VariableAggregation.SUM)

    @tf.function
    def step():
        def fn():
            ctx = tf.distribute.get_replica_context()
            value = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
            total.assign_add(value)
            return ctx.all_reduce("SUM", value), ctx.all_reduce("MEAN", [value, 2 * value])
        return probe.run(fn)

    summed, (mean, double) = step()
    assert [float(t) for t in probe.experimental_local_results(summed)] == [6.0] * 3
    assert [float(t) for t in probe.experimental_local_results(double)] == [4.0] * 3
    assert float(total.read_value()) == 6.0
    ops = device_layout.HostAllReduce(
        cpus[1:3], "/job:localhost/replica:0/task:0/device:CPU:0", 2, 3,
        tf.distribute.experimental.CommunicationOptions(),
        cross_device_utils.CollectiveKeys(group_key_start=7_000_101))

    @tf.function
    def across(a, b):
        value = values.PerReplica((a, b))
        return ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(value, value)])

    spec = tf.TensorSpec([2], tf.float32)
    graph = across.get_concrete_function(spec, spec).graph
    reduces = _op_inputs(graph, "CollectiveReduceV2")
    assert len(reduces) == 1
    (device, inputs), = reduces.values()
    assert int(inputs[1][1]) == 2 and device.endswith("task:0/device:CPU:0")


def test_the_initial_value_broadcast_reads_the_keys_and_the_device_it_is_given():
    """The host path broadcasts a variable's initial value among the workers' CPUs by calling
    the stock `_get_variable_creator_initial_value` with the host device: it must still build
    its group from `self._collective_keys.get_group_key([device])` and place the broadcast on
    `device`. Otherwise GPU and CPU workers would meet in one group of two device types."""
    source = inspect.getsource(
        cars.CollectiveAllReduceExtended._get_variable_creator_initial_value)
    assert "self._collective_keys.get_group_key([device])" in source
    assert "with ops.device(device):" in source
    params = list(inspect.signature(
        cars.CollectiveAllReduceExtended._get_variable_creator_initial_value).parameters)
    assert params[:4] == ["self", "replica_id", "device", "primary_var"]
