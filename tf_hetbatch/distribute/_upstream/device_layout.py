"""Workers with different numbers and kinds of devices under MultiWorkerMirroredStrategy.

TensorFlow's `CollectiveAllReduceExtended` assumes every worker has the same number of local
devices (its TODO in `_initialize_multi_worker`; users hit it as tensorflow/tensorflow#47203):
the collective group size is `len(local devices) * num_workers`, replica ids are
`worker * len(local devices) + r`, `cross_device_ops.CollectiveAllReduce` refuses a group size
that the local count does not divide, and one `CollectiveKeys` memoises a group key per device
LIST, so a one-device worker's device, host and broadcast groups share a key a two-device
worker keeps apart. On a CPU it hosts one replica whatever logical CPUs exist. The C++ runtime
itself keeps a device count per task (`CollGroupParams.num_devices_per_task`), so only the
Python side needs changing, at the seams TensorFlow marks:
- `LayoutExtended._initialize_local_devices` (called inside `_initialize_multi_worker` after
  the collective runtime and the coordination service are up, before any group is built):
  every worker publishes the devices it was given in the coordination service's key-value
  store, reads everyone's and waits at a barrier until every worker has read them
  (`tf_hetbatch.distribute.layout` checks them);
- `_initialize_multi_worker` / `_initialize_local`: the three collective groups rebuilt for
  the layout, one `CollectiveKeys` each (base + 1: all replicas, + 2: one CPU per worker,
  + 3: the initial-value broadcast);
- `_num_replicas_in_sync`, `_get_replica_id_in_sync_group`, `_get_local_replica_id`,
  `_experimental_distribute_values_from_function`: the offset of this worker's replicas;
- `_get_cross_device_ops`: always the replicas' group (stock sends a one-component value to
  the host group on a multi-device worker and to the device group on a one-device worker:
  with uneven counts the workers would wait in different groups);
- `_enable_check_health = False`: its first reduce would run before the rebuilt groups (TF
  turns it off itself when the coordination service runs, which it always does here);
- the host all-reduce (`HostAllReduce`, when device kinds differ): `_use_merge_call`,
  `_replica_ctx_all_reduce` and the initial-value broadcast go through the workers' CPUs.
A value that is not per-replica (a plain tensor) counts as the same value on every local
replica: on a one-device worker TensorFlow hands the strategy a plain tensor for a per-replica
value (`distribute_utils.regroup` unwraps one component), so "plain" cannot mean "one value per
worker" there. So `strategy.reduce(SUM, tf.constant(1.))` is the replica count (stock MWMS:
the worker count on multi-device workers). Canaries: `tests/test_upstream_device_layout.py`.
"""

import json
import logging
import time

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as _cars
from tensorflow.python.distribute import cross_device_ops as _cdo
from tensorflow.python.distribute import cross_device_utils as _cdu
from tensorflow.python.distribute import distribute_lib as _distribute_lib
from tensorflow.python.distribute import distribute_utils as _distribute_utils
from tensorflow.python.distribute import values as _values

from tf_hetbatch.distribute import layout as _layout
from tf_hetbatch.distribute._upstream import coordination

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = tf.distribute.experimental.CommunicationImplementation
RING = IMPLEMENTATIONS.RING


def make_strategy(strategy, devices, cluster_resolver, communication_options, all_reduce,
                  settings):
    """Builds `strategy` (a MultiWorkerMirroredStrategy subclass) on `LayoutExtended`.

    The stock `__init__` builds the stock extended (and sets two usage gauges); this one
    builds ours and passes it to `tf.distribute.Strategy.__init__`.
    """
    if communication_options is None:
        communication_options = tf.distribute.experimental.CommunicationOptions()
    _distribute_lib.Strategy.__init__(strategy, LayoutExtended(
        strategy, cluster_resolver, communication_options, devices, all_reduce, settings))


def layout_of(strategy):
    """The `DeviceLayout` of a strategy built by `make_strategy`."""
    return strategy.extended.layout


class LayoutExtended(_cars.CollectiveAllReduceExtended):
    """`CollectiveAllReduceExtended` over this worker's own devices, any count per worker."""

    _enable_check_health = False

    def __init__(self, container_strategy, cluster_resolver, communication_options, devices,
                 all_reduce, settings):
        self._requested_devices = devices
        self._requested_all_reduce = all_reduce
        self._settings = dict(settings)
        self.layout = None
        self.exchange_seconds = 0.0
        super().__init__(container_strategy, cluster_resolver=cluster_resolver,
                         communication_options=communication_options)

    # ---- the layout -----------------------------------------------------------------------
    def _initialize_local_devices(self, cluster_resolver, worker_device):
        requested = self._requested_devices
        if requested is None:  # TensorFlow's choice (all GPUs, else CPU:0), exchanged too
            stock, _ = super()._initialize_local_devices(cluster_resolver, worker_device)
            requested = [d[len(worker_device):] for d in stock]
        options = self._communication_options
        settings = dict(self._settings, all_reduce=self._requested_all_reduce,
                        implementation=options.implementation.name,
                        bytes_per_pack=options.bytes_per_pack)
        if worker_device:
            settings["cluster"] = json.dumps(self._cluster_spec.as_dict(), sort_keys=True)
        entry = _layout.local_entry(requested, worker_device, settings)
        if worker_device:
            started = time.perf_counter()
            entries = _exchange(f"tf_hetbatch/layout/{self._collective_key_base}",
                                self._id_in_cluster, self._num_workers, entry,
                                options.timeout_seconds or _layout.EXCHANGE_TIMEOUT_S)
            self.exchange_seconds = time.perf_counter() - started
            worker = self._id_in_cluster
        else:
            entries, worker = [entry], 0
        self.layout = _layout.layout_from_entries(
            entries, worker, self._requested_all_reduce, options.implementation.name)
        kinds = self.layout.kinds[worker]
        return self.layout.local_devices, ("GPU" if "GPU" in kinds else kinds[0])

    def _initialize_multi_worker(self, cluster_resolver):
        super()._initialize_multi_worker(cluster_resolver)
        self._build_groups()
        logger.info("Device layout: %s; this worker hosts replicas %d-%d.",
                    self.layout.describe(), self.layout.offset,
                    self.layout.offset + len(self.layout.local_devices) - 1)

    def _initialize_local(self, cluster_resolver, devices=None):
        super()._initialize_local(cluster_resolver, devices)
        self._build_groups()

    def _build_groups(self):
        base = self._collective_key_base
        layout = self.layout
        # The implementation decided from the exchanged layout, the same on every worker.
        options = self._communication_options.merge(
            tf.distribute.experimental.CommunicationOptions(
                implementation=IMPLEMENTATIONS[layout.implementation]))
        self._communication_options = options
        if layout.all_reduce == "host":
            self._cross_device_ops = HostAllReduce(
                layout.local_devices, self._host_device, layout.num_workers, layout.total,
                options, _cdu.CollectiveKeys(group_key_start=base + 1))
        else:
            self._cross_device_ops = LayoutCollectiveAllReduce(
                layout.local_devices, layout.total, options,
                _cdu.CollectiveKeys(group_key_start=base + 1))
        self._host_cross_device_ops = _cdo.CollectiveAllReduce(
            [self._worker_device], layout.num_workers, options,
            _cdu.CollectiveKeys(group_key_start=base + 2))
        # Read by the initial-value broadcast (`_get_variable_creator_initial_value`).
        self._collective_keys = _cdu.CollectiveKeys(group_key_start=base + 3)

    @property
    def _host_device(self):
        if self._worker_device.endswith("CPU:0"):  # one process: already canonical
            return self._worker_device
        return f"{self._worker_device}/device:CPU:0"

    # ---- replica numbering ----------------------------------------------------------------
    @property
    def _num_replicas_in_sync(self):
        return self.layout.total

    def _get_replica_id_in_sync_group(self, replica_id):
        return self.layout.offset + replica_id

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group - self.layout.offset

    def _experimental_distribute_values_from_function(self, value_fn):
        per_replica = [
            value_fn(_distribute_lib.ValueContext(self.layout.offset + i, self.layout.total))
            for i in range(len(self.worker_devices))]
        return _distribute_utils.regroup(per_replica, always_wrap=True)

    # ---- which group reduces what -----------------------------------------------------------
    def _get_cross_device_ops(self, value):
        return self._cross_device_ops

    def _use_merge_call(self):
        return self.layout.all_reduce == "host" or super()._use_merge_call()

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        if self.layout.all_reduce == "host":  # the local sum needs every local replica's value
            return _distribute_lib.StrategyExtendedV2._replica_ctx_all_reduce(
                self, reduce_op, value, options)
        return super()._replica_ctx_all_reduce(reduce_op, value, options)

    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        if replica_id or self.layout.all_reduce != "host" or self._num_workers == 1:
            return super()._get_variable_creator_initial_value(
                replica_id, device, primary_var, **kwargs)
        # The chief's initial value, broadcast among the workers' CPUs (one device type),
        # then copied to this worker's first replica.
        on_host = super()._get_variable_creator_initial_value(
            replica_id, self._host_device, primary_var, **kwargs)

        def initial_value_fn():
            value = on_host()
            with tf.device(device):
                return tf.identity(value)
        return initial_value_fn


def _exchange(prefix, worker, num_workers, entry, timeout_s):
    """Publishes this worker's entry and returns every worker's, in worker order."""
    if not coordination.insert_coordination_key(f"{prefix}/{worker}", json.dumps(entry)):
        raise RuntimeError(f"A device layout was already published as worker {worker} under "
                           f"{prefix!r}: two strategies share a collective key base.")
    deadline = time.monotonic() + timeout_s
    entries = []
    for i in range(num_workers):
        text = coordination.get_coordination_key(f"{prefix}/{i}",
                                                 max(deadline - time.monotonic(), 0.001))
        if text is None:
            raise RuntimeError(
                f"Worker {i} did not publish its devices within {timeout_s:g} s. Every worker "
                "must create a HeteroMultiWorkerMirroredStrategy at start-up, in the same order "
                "as the others. Fix: run the same script with the same tf_hetbatch version on "
                "every worker (communication_options.timeout_seconds sets this wait).")
        entries.append(json.loads(text))
    # The leader's process hosts the store: a worker that refuses the layout must not exit
    # (and take the store with it) before every worker has read every entry, so that every
    # worker refuses it with the same message.
    coordination.wait_at_coordination_barrier(f"{prefix}/read", timeout_s)
    return entries


def _per_local_replica(value, devices):
    """The local replicas' values of `value`: a plain value counts on every local replica."""
    if isinstance(value, _values.DistributedValues):
        if len(value.values) != len(devices):
            raise ValueError(
                f"A distributed value with {len(value.values)} components cannot be reduced "
                f"over this worker's {len(devices)} replicas.")
        return value
    return _values.PerReplica(tuple(value for _ in devices))


def _same_device(a: str, b: str) -> bool:
    """Whether two device names name one device (fields only one of them names match any)."""
    a, b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return all(x is None or y is None or x == y for x, y in (
        (a.job, b.job), (a.replica, b.replica), (a.task, b.task))) and (
        (a.device_type, a.device_index or 0) == (b.device_type, b.device_index or 0))


def _no_device(destinations):
    if isinstance(destinations, str):
        return not destinations
    return isinstance(destinations, tf.Tensor) and not destinations.device


class LayoutCollectiveAllReduce(_cdo.CollectiveAllReduce):
    """One collective group of every replica of every worker, whatever each one's count.

    The stock constructor needs group_size % len(devices) == 0; it is built with a multiple,
    then the object and its launchers get the true size (both read it at every launch: the
    op's group_size, MEAN's division, the all-gather).
    """

    def __init__(self, devices, group_size, options, collective_keys):
        super().__init__(devices, group_size * len(devices), options, collective_keys)
        self._group_size = group_size
        for launcher in self._launchers:
            launcher._group_size = group_size

    def _pair(self, value, destinations):
        value = _per_local_replica(value, self._devices)
        # A replica-context all-reduce of a tensor with no device (a function input) on a
        # one-device worker comes with destinations "": onto the replicas' own devices.
        return value, (value if _no_device(destinations) else destinations)

    def reduce(self, reduce_op, per_replica_value, destinations, options=None):
        return super().reduce(reduce_op, *self._pair(per_replica_value, destinations), options)

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        return super().batch_reduce(
            reduce_op, [self._pair(v, d) for v, d in value_destination_pairs], options)

    def _gather(self, per_replica_value, destinations, axis, options=None):
        value, destinations = self._pair(per_replica_value, destinations)
        return super()._gather(value, destinations, axis, options)


class HostAllReduce(_cdo.CollectiveAllReduce):
    """The host path: local replicas summed on this worker's CPU, the workers' CPUs
    all-reduced (one collective group of one device type: their CPUs), the result copied to
    each local replica (or the destinations asked for).

    Built as a `CollectiveAllReduce` of the one host device in a group of `num_workers`, so
    its launcher is the one the step's static instance keys adapt (`collectives`). Reached
    only in cross-replica context (`LayoutExtended` sends replica-context all-reduces through
    `merge_call`).

    Dense values of one dtype bound for the local replicas travel packed (`_packs`): each
    replica's are flattened and concatenated on its own device, so each replica makes one copy
    to the host and receives one back (a copy between a GPU and the host is a transfer of its
    own: one per tensor would be one per gradient), the host sums the replicas' packs and the
    workers all-reduce one tensor; each replica splits its copy of the sum. IndexedSlices and
    values bound elsewhere go one by one.
    """

    def __init__(self, devices, host, num_workers, num_replicas, options, collective_keys):
        super().__init__([host], num_workers, options, collective_keys)
        self._replica_devices = tuple(devices)
        self._host = host
        self._num_workers = num_workers
        self._num_replicas = num_replicas

    def reduce(self, reduce_op, per_replica_value, destinations, options=None):
        return self.batch_reduce(reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce(self, reduce_op, value_destination_pairs, options=None):
        options = self._ring(options)
        packs = self._packs(value_destination_pairs)
        packed = {i for pack in packs for i in pack}
        single = [i for i in range(len(value_destination_pairs)) if i not in packed]
        sums = [self._local_pack_sum([value_destination_pairs[i][0] for i in pack])
                for pack in packs]
        sums += [self._local_sum(value_destination_pairs[i][0]) for i in single]
        if self._num_workers > 1:
            sums = self._across_workers(sums, options)
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            with tf.device(self._host):
                sums = [_cdu.divide_by_n_tensors_or_indexed_slices(summed, self._num_replicas)
                        for summed in sums]
        out = [None] * len(value_destination_pairs)
        for pack, summed in zip(packs, sums):
            for i, result in zip(pack, self._unpacked_on_replicas(
                    summed, [value_destination_pairs[i][0] for i in pack])):
                out[i] = result
        for i, summed in zip(single, sums[len(packs):]):
            out[i] = self._to_destinations(summed, value_destination_pairs[i][1])
        return out

    def _packs(self, value_destination_pairs):
        """Indices of the values that travel packed, one list per dtype (module docs)."""
        by_dtype = {}
        for i, (value, destinations) in enumerate(value_destination_pairs):
            local = _per_local_replica(value, self._replica_devices).values
            if all(isinstance(v, tf.Tensor) for v in local) and self._on_replicas(
                    destinations):
                by_dtype.setdefault(local[0].dtype, []).append(i)
        return [pack for pack in by_dtype.values() if len(pack) > 1]

    def _on_replicas(self, destinations):
        if _no_device(destinations):
            return True
        try:
            devices = _cdo.get_devices_from(destinations, self._canonicalize_devices)
        except (AttributeError, ValueError):
            return False
        return len(devices) == len(self._replica_devices) and all(
            _same_device(a, b) for a, b in zip(devices, self._replica_devices))

    def _local_pack_sum(self, values):
        """On the host: the sum over the local replicas of their packs of `values`."""
        packs = []
        for r, device in enumerate(self._replica_devices):
            parts = [_per_local_replica(v, self._replica_devices).values[r] for v in values]
            with tf.device(device):
                packs.append(tf.concat([tf.reshape(t, [-1]) for t in parts], 0))
        with tf.device(self._host):
            return tf.add_n([tf.identity(pack) for pack in packs])

    def _unpacked_on_replicas(self, summed, values):
        """Mirrored values of `values`' shapes: `summed` copied once to each local replica and
        split there."""
        shapes = []
        for value in values:
            first = _per_local_replica(value, self._replica_devices).values[0]
            shapes.append(first.shape if first.shape.is_fully_defined() else tf.shape(first))
        pieces = []
        for device in self._replica_devices:
            with tf.device(device):
                copy = tf.identity(summed)
                sizes = [shape.num_elements() if isinstance(shape, tf.TensorShape)
                         else tf.reduce_prod(shape) for shape in shapes]
                if not all(isinstance(size, int) for size in sizes):
                    sizes = tf.stack([tf.cast(size, tf.int64) for size in sizes])
                pieces.append([tf.reshape(part, shape) for part, shape in
                               zip(tf.split(copy, sizes), shapes)])
        return [_distribute_utils.regroup([per_device[j] for per_device in pieces],
                                          wrap_class=_values.Mirrored)
                for j in range(len(values))]

    def _gather(self, per_replica_value, destinations, axis, options=None):
        local = _per_local_replica(per_replica_value, self._replica_devices)
        with tf.device(self._host):
            gathered = tf.concat([tf.identity(v) for v in local.values], axis)
        if self._num_workers > 1:
            gathered = _one(self._batch_all_gather(
                [_values.PerReplica((gathered,))], axis, self._ring(options))[0])
        return self._to_destinations(gathered, destinations)

    def _all_reduce(self, reduce_op, value, replica_id, options):
        raise RuntimeError("The host all-reduce runs in cross-replica context (merge_call); "
                           "this replica-context call bypassed the strategy.")

    def _ring(self, options):
        options = self._options if options is None else self._options.merge(options)
        return options.merge(tf.distribute.experimental.CommunicationOptions(
            implementation=RING))

    def _local_sum(self, value):
        local = _per_local_replica(value, self._replica_devices).values
        with tf.device(self._host):
            return _cdu.aggregate_tensors_or_indexed_slices(
                [_cdu.copy_tensor_or_indexed_slices_to_device(v, self._host) for v in local])

    def _across_workers(self, sums, options):
        with self._lock:
            summed = super()._all_reduce(tf.distribute.ReduceOp.SUM, list(sums), 0, options)
        return list(summed)

    def _to_destinations(self, result, destinations):
        if _no_device(destinations):  # a plain value's all-reduce: onto the local replicas
            copies = [_cdu.copy_tensor_or_indexed_slices_to_device(result, d)
                      for d in self._replica_devices]
            return _distribute_utils.regroup(copies, wrap_class=_values.Mirrored)
        return _cdo.simple_broadcast(result, destinations, always_mirrored=True,
                                     canonicalize_devices=self._canonicalize_devices)


def _one(value):
    return value.values[0] if isinstance(value, _values.DistributedValues) else value
