"""Device layouts (tf_hetbatch.distribute.layout): the checks every worker makes of the
exchanged entries, the all-reduce decided from them, and the host all-reduce in one process.

Kinds that do not exist here (GPUs) are simulated as exchanged entries: the decision and its
errors are pure functions of the entries, the same on every worker. Real clusters of uneven
layouts are in test_multi_worker.py (`-k layout`).
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from helpers import BatchLogs, build_under, conv_syncbn_model, image_data, max_weight_diff
from tf_hetbatch.distribute import layout

SETTINGS = {"switch_margin": 8}


def entry(*devices, error=None, **settings):
    return {"devices": list(devices), "error": error, "settings": dict(SETTINGS, **settings)}


def gpus(task, n):
    return [f"/job:worker/task:{task}/device:GPU:{i}" for i in range(n)]


def cpus_of(task, n):
    return [f"/job:worker/task:{task}/device:CPU:{i}" for i in range(n)]


def test_replicas_are_numbered_in_worker_order_whatever_each_worker_hosts():
    entries = [entry(*gpus(0, 4)), entry(*gpus(1, 2)), entry(*gpus(2, 1))]
    lay = layout.layout_from_entries(entries, 1, None, "AUTO")
    assert lay.counts == (4, 2, 1) and lay.total == 7 and lay.offset == 4
    assert lay.local_devices == tuple(gpus(1, 2))
    assert lay.all_reduce == "device"
    assert lay.replica_kinds == ("GPU",) * 7
    assert lay.describe() == (
        "3 workers: [4 GPU] [2 GPU] [1 GPU]; 7 replicas; all-reduce device (AUTO)")


@pytest.mark.parametrize("entries, all_reduce, implementation, decided", [
    ([entry(*gpus(0, 4)), entry(*gpus(1, 2))], None, "AUTO", ("device", "AUTO")),
    ([entry(*gpus(0, 4)), entry(*gpus(1, 2))], None, "NCCL", ("device", "NCCL")),
    ([entry(*gpus(0, 4)), entry(*gpus(1, 2))], None, "RING", ("device", "RING")),
    ([entry(*gpus(0, 4)), entry(*gpus(1, 2))], "host", "AUTO", ("host", "RING")),
    ([entry(*gpus(0, 2)), entry(*cpus_of(1, 1))], None, "AUTO", ("host", "RING")),
    ([entry(*gpus(0, 2)), entry(*cpus_of(1, 1))], None, "RING", ("host", "RING")),
    ([entry(*cpus_of(0, 1)), entry(*cpus_of(1, 2))], None, "AUTO", ("device", "AUTO")),
], ids=["gpus auto", "gpus nccl", "gpus ring", "gpus host", "gpu+cpu auto", "gpu+cpu ring",
        "cpus auto"])
def test_the_all_reduce_is_decided_once_from_the_layout_and_an_explicit_choice_wins(
        entries, all_reduce, implementation, decided):
    # Every worker decides from the same exchanged entries: the same on each.
    found = {(lay.all_reduce, lay.implementation) for lay in (
        layout.layout_from_entries(entries, w, all_reduce, implementation)
        for w in range(len(entries)))}
    assert found == {decided}


@pytest.mark.parametrize("entries", [
    [entry(*gpus(0, 2)), entry(*cpus_of(1, 1))],
    [entry(gpus(0, 1)[0], cpus_of(0, 1)[0]), entry(*gpus(1, 1))],
], ids=["gpu worker and cpu worker", "a worker with a gpu and a cpu replica"])
def test_kinds_that_differ_anywhere_all_reduce_through_the_hosts(entries):
    lay = layout.layout_from_entries(entries, 0, None, "AUTO")
    assert lay.all_reduce == "host"
    assert layout.layout_from_entries(entries, 1, "host", "RING").all_reduce == "host"
    with pytest.raises(ValueError, match=re.escape(
            "`all_reduce='device'` needs every replica of every worker on devices of one kind")):
        layout.layout_from_entries(entries, 0, "device", "AUTO")


@pytest.mark.parametrize("entries, all_reduce, where", [
    ([entry(*gpus(0, 2)), entry(*cpus_of(1, 1))], None, "kinds per worker {0: ['GPU'], 1: ['CPU']}"),
    ([entry(*cpus_of(0, 1)), entry(*cpus_of(1, 2))], None, "kinds per worker {0: ['CPU'], 1: ['CPU']}"),
    ([entry(*gpus(0, 2)), entry(*gpus(1, 1))], "host", "the host all-reduce runs between the workers' CPUs"),
], ids=["mixed", "cpus", "host path"])
def test_nccl_is_refused_where_it_cannot_work(entries, all_reduce, where):
    with pytest.raises(ValueError) as info:
        layout.layout_from_entries(entries, 0, all_reduce, "NCCL")
    message = str(info.value)
    assert message.startswith("`communication_options.implementation` NCCL needs every replica")
    assert where in message and "Fix: CommunicationImplementation.RING or AUTO." in message


def test_every_workers_problem_is_named_in_the_same_error():
    entries = [entry(*cpus_of(0, 1)), entry(error="'/cpu:5' does not exist here"),
               entry(error="it names no device")]
    with pytest.raises(ValueError) as info:
        layout.layout_from_entries(entries, 0, None, "AUTO")
    assert str(info.value).startswith(
        "`devices` must name existing devices of each worker, each once. Received: worker 1: "
        "'/cpu:5' does not exist here; worker 2: it names no device. Fix: pass every worker")


def test_workers_created_with_different_settings_are_refused():
    entries = [entry(*cpus_of(0, 1)), entry(*cpus_of(1, 2), switch_margin=16)]
    with pytest.raises(ValueError, match=re.escape(
            "Every worker must create the strategy with the same `switch_margin`, and see the "
            "same cluster. Received: worker 0: 8; worker 1: 16.")):
        layout.layout_from_entries(entries, 0, None, "AUTO")


@pytest.mark.parametrize("requested, problem", [
    (["/cpu:0", "/cpu:9"], "'/cpu:9' does not exist here (this worker has CPU:0, CPU:1, "),
    (["/cpu:1", "/cpu:1"], "['/cpu:1', '/cpu:1'] names a device twice"),
    ([], "it names no device"),
    (["/cpu"], "'/cpu' names no device type and index (e.g. '/gpu:0')"),
    (["/job:worker/task:3/device:CPU:0"], "'/job:worker/task:3/device:CPU:0' is another task's"),
    (["/gpu:0"], "'/gpu:0' does not exist here"),
])
def test_a_workers_own_problem_is_published_not_raised(requested, problem):
    found = layout.local_entry(requested, "/job:worker/task:1", SETTINGS)
    assert found["devices"] == [] and problem in found["error"]


def test_a_workers_devices_get_their_full_names(cpus):
    found = layout.local_entry(["/cpu:1", "CPU:0"], "/job:worker/task:2", SETTINGS)
    assert found == {"devices": ["/job:worker/task:2/device:CPU:1",
                                 "/job:worker/task:2/device:CPU:0"],
                     "error": None, "settings": SETTINGS}


@pytest.mark.parametrize("kwargs, error, match", [
    ({"devices": "/cpu:0"}, TypeError, "`devices` must be this worker's list of device names"),
    ({"devices": tf.distribute.cluster_resolver.TFConfigClusterResolver()}, TypeError,
     "a cluster resolver goes to cluster_resolver=..."),
    ({"all_reduce": "nccl"}, ValueError, "`all_reduce` must be None (decided from the layout)"),
    ({"devices": ["/cpu:0", "/cpu:7"]}, ValueError, "worker 0: '/cpu:7' does not exist here"),
])
def test_bad_arguments_are_refused_with_the_value_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=re.escape(match)):
        hb.HeteroMultiWorkerMirroredStrategy(**kwargs)


def test_the_host_all_reduce_trains_exactly_like_one_device(cpus):
    """One process, three logical CPUs, the host path forced: each step's sums (gradients,
    SyncBatchNormalization's statistics, the metrics) go through the host's CPU; uneven split,
    Adam, true global logs."""
    x, y = image_data()
    ref = build_under(None, conv_syncbn_model)
    ref_logs = BatchLogs()
    ref.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[ref_logs])
    strategy = hb.HeteroMultiWorkerMirroredStrategy(cpus[:3], all_reduce="host")
    assert strategy.layout.all_reduce == "host" and strategy.num_replicas_in_sync == 3
    strategy.set_batch_sizes([3, 7, 22])
    ours = build_under(strategy, conv_syncbn_model)
    logs = BatchLogs()
    ours.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[logs])
    assert max_weight_diff(ref, ours) <= 1e-5
    for mine, theirs in zip(logs.batches, ref_logs.batches):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["accuracy"] == pytest.approx(theirs["accuracy"], rel=1e-5)
    np.testing.assert_array_equal(strategy.read_replica_times().samples_per_step, [3, 7, 22])
    np.testing.assert_array_equal(strategy.gather_replica_values([1.0, 2.0, 3.0]), [1, 2, 3])


def test_a_strategy_uses_the_decided_implementation_and_refuses_nccl_on_cpus(cpus):
    ring = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = hb.HeteroMultiWorkerMirroredStrategy(cpus[:2], communication_options=ring)
    assert strategy.layout.implementation == "RING"
    nccl = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.NCCL)
    with pytest.raises(ValueError, match=re.escape(
            "`communication_options.implementation` NCCL needs every replica on a GPU and the "
            "device all-reduce. Received: NCCL, all-reduce 'device', kinds per worker "
            "{0: ['CPU']}. Fix: CommunicationImplementation.RING or AUTO.")):
        hb.HeteroMultiWorkerMirroredStrategy(cpus[:2], communication_options=nccl)
