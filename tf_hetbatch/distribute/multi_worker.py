"""HeteroMultiWorkerMirroredStrategy: uneven, exactly weighted batches across workers."""

import logging
from typing import Optional, Sequence

import tensorflow as tf

from tf_hetbatch.core import _validate
from tf_hetbatch.distribute import clean_exit
from tf_hetbatch.distribute.layout import (DeviceLayout, check_all_reduce_argument,
                                          check_devices_argument)
from tf_hetbatch.distribute import topology
from tf_hetbatch.distribute.strategy import HeteroMixin, is_mean
from tf_hetbatch.distribute.topology import PIPELINE_LEAD_STEPS
from tf_hetbatch.distribute._upstream import autograph, collectives, device_layout, keras_callers

logger = logging.getLogger(__name__)

# The default `switch_margin`: a new split starts this many steps after the current one, so
# no worker's input pipeline has produced that step's batch yet (it runs at most
# PIPELINE_LEAD_STEPS batches ahead of training). Checked after every switch.
DEFAULT_SWITCH_MARGIN = 8


@autograph.methods_as_is  # `reduce` in a user's tf.function: as a stock strategy's
class HeteroMultiWorkerMirroredStrategy(HeteroMixin, tf.distribute.MultiWorkerMirroredStrategy):
    """`tf.distribute.MultiWorkerMirroredStrategy` with uneven, exactly weighted batches.

    Everything `HeteroMirroredStrategy` promises, across workers: configured by TF_CONFIG as
    stock (or a cluster resolver), one split of each global batch over ALL replicas of all
    workers, gradients weighted by b_k / B so the model equals one device on the global batch
    and is identical on every worker.

    Workers may host different numbers and kinds of replicas (a 4-GPU box beside a 2-GPU box
    and a CPU-only box): each worker names its own `devices`, the workers exchange them once
    at start-up (`tf_hetbatch.distribute.layout`), and the replicas in sync are all of them,
    numbered in worker order (the chief first): `num_replicas_in_sync` is the total, and the
    split, weights, timing, input slices, gathers, checkpoints and dashboards are per replica
    in that order. A layout that cannot work (a device a worker does not have, one named
    twice, workers created with different arguments, a worker that never publishes) is
    refused with the same error on every worker before any step. The all-reduce is decided
    once from the exchanged layout: one collective group of all replicas when they are all of
    one kind, else (a TensorFlow collective group has one device type) through each worker's
    host CPU: its replicas summed there, the workers' CPUs all-reduced (RING), the result
    copied back to each replica.

    Input: every worker reads the same sequence of global batches (use a seeded shuffle, as
    with the stock DATA auto-shard policy; an unseeded `Dataset.shuffle` right under the
    per-sample maps gets a seed all workers agree on) and keeps its own replicas' slices, so
    every sample of an epoch is used exactly once, whatever the split. The per-sample work
    (maps before `batch`, Keras's array gather, maps after `split_here()`) runs after the
    split, on the worker's own samples only (`input_work`). Every gather of this
    strategy also checks that all workers trained the same global batches. A user's
    `distribute_datasets_from_function` gets TensorFlow's `InputContext` (one pipeline per
    worker); with uneven replica counts, shard by the worker's replicas, not evenly.

    It implements `tf_hetbatch.core.protocols.SynchronousSplitStrategy`. Collectives:
    `gather_replica_values`, `part_capacities` and `check_input_agreement` talk to all
    workers, so every worker must call them at the same point (a callback does).
    `read_replica_times` is local: every step's all-reduce brought every replica's
    measurements to every worker. `set_batch_sizes` must be called on every worker at the
    same point with the same sizes: a new split takes effect on every worker at the same
    training step, `switch_margin` steps after the call, a step each worker computes from the
    steps trained (no collective); only before the first step this process trains do the
    workers ask each other (one small collective) whether any has read data yet (if none has,
    the split applies at once). So a `Balancer` or `DynamicBatching`, which calls it at the
    same step on every worker with the split the same measurements gave, issues no collective
    at a window end. Sizes that differ between workers are not detected there (they would
    split a batch differently); `check_input_agreement` finds the result.

    Keras 3 `fit` works without patching Keras: its two multi-worker crashes (a reduce of the
    data batch in its symbolic build, and axis=0 reduces of scalar logs) pass through this
    strategy's `reduce`, which handles them (see `keras_callers`). A value that is not
    per-replica (a plain tensor) given to `strategy.reduce` or an all-reduce counts once per
    replica: `strategy.reduce("SUM", tf.constant(1.0), axis=None)` is `num_replicas_in_sync`
    (the stock strategy counts it once per worker on workers with several devices).

    Args:
        devices: this worker's replica devices, as for `HeteroMirroredStrategy`, e.g.
            `["/gpu:0", "/gpu:1"]`, `["/cpu:0", "/cpu:1"]` (logical CPUs) or
            `["/gpu:0", "/cpu:0"]`; each worker passes its own. Default None: as stock, all
            of the worker's GPUs, else its CPU.
        cluster_resolver: as for `tf.distribute.MultiWorkerMirroredStrategy`.
        communication_options: as for `tf.distribute.MultiWorkerMirroredStrategy`; the same
            on every worker. NCCL needs every replica on a GPU; `timeout_seconds` also bounds
            the wait for the other workers' devices at start-up (default 120 s).
        switch_margin: int, training steps from `set_batch_sizes` to the step the new split
            starts at on every worker. It must exceed how far the input pipeline runs ahead
            of training (at most 3 global batches: a larger margin is needed only if a
            switch fails saying so). Default 8 (`DEFAULT_SWITCH_MARGIN`). The same on every
            worker.
        all_reduce: None (default: decided from the layout), "device" (one collective group
            of all replicas; all must be of one kind) or "host" (through each worker's CPU;
            works for any layout). The same on every worker.

    Raises:
        ValueError: `switch_margin` is not an integer >= 4, `all_reduce` is not one of the
            three, or the layout cannot work (the same error on every worker).
        TypeError: `devices` is not a list of device names.
        RuntimeError: a worker did not publish its devices in time.
    """

    def __init__(self, devices: Optional[Sequence[str]] = None, cluster_resolver=None,
                 communication_options=None, switch_margin: int = DEFAULT_SWITCH_MARGIN,
                 all_reduce: Optional[str] = None):
        devices = check_devices_argument(devices)
        all_reduce = check_all_reduce_argument(all_reduce)
        self._switch_margin = _validate.check_int(
            "switch_margin", switch_margin, PIPELINE_LEAD_STEPS + 1,
            f"the input pipeline runs up to {PIPELINE_LEAD_STEPS} global batches ahead of "
            f"training; pass e.g. switch_margin={DEFAULT_SWITCH_MARGIN} (the default).")
        # Every worker creates its strategies in the same order, so the bases agree.
        collectives.assign_collective_key_base(self)
        device_layout.make_strategy(self, devices, cluster_resolver, communication_options,
                                    all_reduce, {"switch_margin": self._switch_margin})
        collectives.warn_if_second_multi_worker_strategy(self.layout.num_workers)
        self._init_hetero(topology.Workers(self, self.layout, self._switch_margin))
        # At exit, the tasks wait for each other, so a successful run ends quietly.
        clean_exit.register_exit_together(self.cluster_resolver)

    @property
    def layout(self) -> DeviceLayout:
        """The cluster's `DeviceLayout`: every worker's replica devices, in worker order, and
        the all-reduce they agreed on ("device" or "host", and its implementation)."""
        return device_layout.layout_of(self)

    @property
    def switch_margin(self) -> int:
        """Training steps from `set_batch_sizes` to the step the new split starts at."""
        return self._switch_margin

    # ----------------------------------------------------------------- Keras crashes -----------
    def reduce(self, reduce_op, value, axis):
        """As the stock `reduce`, handling what Keras 3 `fit` asks of a multi-worker strategy."""
        if axis is not None and keras_callers.is_scalar_reduce_with_axis(self, value, axis):
            if is_mean(reduce_op) and not isinstance(value, tf.distribute.DistributedValues):
                # Keras's logs: this strategy's `run` made them global already (the same
                # tensor on every worker), and their mean is themselves: no collective.
                return value
            return super().reduce(reduce_op, value, None)
        if axis is None and keras_callers.is_data_batch_reduce(self, reduce_op, value):
            return tf.nest.map_structure(
                lambda v: keras_callers.largest_local_batch(self, v), value)
        return super().reduce(reduce_op, value, axis)

