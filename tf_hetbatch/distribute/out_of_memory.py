"""A training step that runs out of memory lowers a replica's bound and is run again.

Once a strategy has micro-batch limits (`HeteroMixin.set_micro_batch_limits`, even all None),
Keras's `fit` runs each training step (`steps_per_execution` 1) through `StepGuard`: the batch
is taken from the iterator first, so a step that fails with `tf.errors.ResourceExhaustedError`
can be run again on the same batch. Such a step applied nothing: the update waits for every
micro-batch's gradients and the all-reduce after them (`micro_batches`, `updates`); what it
changed before failing (the metric variables of its first micro-batches, the optimizer's
step count) is restored from a copy taken before the step. The replica that failed is read from the error (the device
TensorFlow names in its "OOM when allocating ... on <device>" message); its bound becomes
half the micro-batch it failed on (`core.micro_batches.lowered_limit`), the strategy logs one
line naming the replica and its new bound, and the step is run again, until it fits or a
micro-batch of one sample does not (then the error is raised, as without the guard).

The cost: the batch taken eagerly and the metric variables copied, about 0.6-0.8 ms a step
(one host, 3 logical CPUs, a small dense model: 2.5-3.2 ms a step without limits, 3.2-3.6
with limits all None, 2.8-3.0 with limits but no guard).

On a GPU this is where TensorFlow reports a full device. On CPUs the same path is exercised by
tests that allocate beyond the machine's memory above a chosen micro-batch size.

One host only: every replica is in this process, so the failed step ends on all of them and
they all run it again. Across workers the guard is not installed: a worker that ran the step
again alone was seen to hang with the other workers waiting in the step's all-reduce (two
workers, TensorFlow 2.21), so the error ends the run as before; and with
`steps_per_execution` > 1 the failed execution has applied its earlier steps.
"""

import logging
import re
from typing import Callable, Optional

import tensorflow as tf

from tf_hetbatch.core import micro_batches as _core

logger = logging.getLogger(__name__)

_DEVICE = re.compile(r"OOM when allocating tensor.* on (\S+) by allocator")


def replica_of_error(strategy, error: tf.errors.OpError) -> Optional[int]:
    """The replica (in sync group order) whose device an out-of-memory error names, or None."""
    found = _DEVICE.search(error.message or "")
    if found is None:
        return None
    try:
        failed = tf.DeviceSpec.from_string(found.group(1))
    except ValueError:
        return None
    offset = _first_local_replica(strategy)
    for index, device in enumerate(strategy.extended.worker_devices):
        spec = tf.DeviceSpec.from_string(device)
        if (spec.device_type, spec.device_index, spec.task or 0) == (
                failed.device_type, failed.device_index, failed.task or 0):
            return offset + index
    return None


def _first_local_replica(strategy) -> int:
    replicas = strategy._topology.replica_range  # (first, count) across workers; None: one host
    return replicas[0] if replicas else 0


def micro_batch_size(share: int, limit: Optional[int]) -> int:
    """The largest micro-batch of a share of `share` samples under `limit` (None: unbounded)."""
    if not limit:
        return int(share)
    count = max(-(-int(share) // int(limit)), 1)
    return -(-int(share) // count)


class StepGuard:
    """Runs one training step; on out-of-memory lowers the failing replica's bound and runs it
    again (see the module docs).

    Args:
        strategy: the tf_hetbatch strategy (its `_micro_batches` limits are lowered).
        model: the Keras model whose steps are guarded (its metric variables are restored).
    """

    def __init__(self, strategy, model):
        self._strategy = strategy
        self._model = model
        self._read_metrics = (None, None)  # (ids of the variables, the traced read)

    def __call__(self, run_step: Callable, data=None):
        """Runs `run_step()` (the step on `data`, its distributed batch) until it fits."""
        variables = list(self._model.metrics_variables)
        optimizer = getattr(self._model, "optimizer", None)
        if optimizer is not None:
            # Its step count is advanced with no dependency on the data, so also by a step
            # that fails (as Keras's own extra step at the end of a resumed epoch).
            variables.append(optimizer.iterations)
        saved = self._snapshot(variables)
        while True:
            try:
                return run_step()
            except tf.errors.ResourceExhaustedError as error:
                if not self._lower_bound(error, data):
                    raise
                for variable, value in zip(variables, saved):
                    variable.assign(value)

    def _snapshot(self, variables):
        if not variables:
            return []
        ids, read = self._read_metrics
        if ids != [id(v) for v in variables]:
            read = tf.function(lambda: [tf.identity(v) for v in variables])
            self._read_metrics = ([id(v) for v in variables], read)
        return read()

    def _lower_bound(self, error, data) -> bool:
        """Lowers the bound of the replica `error` names; False when nothing can help."""
        strategy = self._strategy
        replica = replica_of_error(strategy, error)
        share = None if replica is None else _share(strategy, data, replica)
        if share is None:
            return False
        limits = strategy.micro_batch_limits or (None,) * strategy.num_replicas_in_sync
        tried = micro_batch_size(share, limits[replica])
        if limits[replica] is not None:
            tried = min(tried, limits[replica])
        lowered = _core.lowered_limit(tried)
        if lowered is None:
            return False
        strategy._micro_batches.lower(replica, lowered)
        logger.warning(
            "Replica %d ran out of memory in a training step (nothing was applied): its "
            "micro-batch bound is now %d samples, and the step runs again.", replica, lowered)
        return True


def _share(strategy, data, replica: int) -> Optional[int]:
    """The samples `replica` (this process's) got in the step's batch `data`: its actual
    share, which a switch of split reaches a few steps after `strategy.batch_sizes`; the
    split set where the batch does not say."""
    for leaf in tf.nest.flatten(data):
        if isinstance(leaf, tf.distribute.DistributedValues):
            local = replica - _first_local_replica(strategy)
            part = strategy.experimental_local_results(leaf)[local]
            if part.shape.rank:
                return int(part.shape[0])
    sizes = strategy.batch_sizes
    return None if sizes is None else int(sizes[replica])
