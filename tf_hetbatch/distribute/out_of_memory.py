"""A training step that runs out of memory lowers a replica's bound and is run again.

Once a strategy has micro-batch limits (`HeteroMixin.set_micro_batch_limits`, even all None),
Keras's `fit` runs each training step (`steps_per_execution` 1) through `StepGuard`: the batch
is taken from the iterator first, so a step that fails with `tf.errors.ResourceExhaustedError`
can be run again on the same batch. The replica that failed is read from the error (the device
TensorFlow names in its "OOM when allocating ... on <device>" message); its bound becomes half
the micro-batch it failed on (`core.micro_batches.lowered_limit`), the strategy logs one line
naming the replica and its new bound, and the step is run again, until it fits or a
micro-batch of one sample does not (then the error is raised, as without the guard).

**Only a step that failed before its update gate runs again.** The gate (`UpdateGate`) is the
point where every local replica's micro-batches are done and the step's one all-reduce may
start (`updates.sum_across_replicas`); the step records it in a host variable, closed at the
step's start. Before the gate the step applied nothing: the update waits for the all-reduce.
What it changed (the metric variables, the optimizer's step count, the strategy's count of
steps trained, and each trainable layer's non-trainable variables: BatchNormalization's
moving statistics, the dropout seeds) is restored from a copy taken before the step, so the
run is the one that never failed. After the gate the all-reduce packs the gradients (on a GPU
its concatenation, output and split take 2-3x their bytes) and the optimizer updates the
variables one by one: a failure there may have applied part of the update, on some replicas,
and may have aborted the collective for good. Such a step is never run again (it would apply
the applied part twice, and the replicas' copies would drift): its error is raised, naming the
replica and the fix (free that memory: a lower micro-batch bound does not shrink it). A step
that never closes the gate (its batch is not cut: one replica) cannot tell where it failed, and
is not run again either. The gate's cost: one assign of a host boolean per guarded step.

Several workers: the other workers' replicas are waiting in the step's all-reduce when one
worker's replica fails before its gate. The failing worker joins that all-reduce with a
stand-in of the same values (`FailureFlags.join`: zeros of the same dtypes and shapes, so the
collective's instance keys, derived from them, are the same), whose last entry carries, per
replica, the bound the failure asks for (0: none failed; -1: nothing can help). Every
worker's step applies its update only where that entry is all zeros (as a LossScaleOptimizer
applies only finite gradients) and keeps it in `FailureFlags.variable`; each worker's guard
reads it after the step, restores what the step changed, lowers the same bounds and runs the
same batch again. So no worker applies a step another could not finish, and they all re-run
it together. A failure after the gate ends the run on that worker (the launcher stops the
others). This covers Keras's own `train_step` (its one all-reduce carries the gradients and
the metrics); a step with another collective (a guide-style `train_step`, whose logs take a
second all-reduce) cannot be stood in for: its out-of-memory error ends the run as before.

The cost: the batch taken eagerly and the metric and state variables copied, about 0.6-0.8 ms
a step (one host, 3 logical CPUs, a small dense model: 2.5-3.2 ms a step without limits,
3.2-3.6 with limits all None, 2.8-3.0 with limits but no guard); across workers also one read
of the flags after each step (the loop waits for the step there).

On a GPU this is where TensorFlow reports a full device. TensorFlow's GPU allocator (BFC)
waits up to 10 s for memory to be freed before it fails an allocation (`kMaxMillisToWait` in
its `AllocateRawInternalWithRetry`; not settable from Python) and logs its memory map, so each
step that runs out of memory costs at least 10 s before it can run again. On CPUs the same
path is exercised by tests that allocate beyond the machine's memory above a chosen
micro-batch size (the system allocator, `TF_ONEDNN_USE_SYSTEM_ALLOCATOR`, fails at once), and
after the gate in an optimizer's update.

With `steps_per_execution` > 1 no step is guarded: a failed execution has applied its
earlier steps.
"""

import dataclasses
import logging
import re
import weakref
from typing import Any, Callable, Optional

import tensorflow as tf

from tf_hetbatch.core import micro_batches as _core
from tf_hetbatch.distribute import updates

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


class UpdateGate:
    """Whether the running step got past the point after which it cannot run again: every
    local replica's micro-batches done, the step's one all-reduce about to start (module docs).

    Args:
        device: the host device of its variable.
    """

    def __init__(self, device: str):
        with tf.init_scope(), tf.device(device):
            # Open until a step closes it: a step that never does (no replica's batch to cut,
            # e.g. one replica, whose data is not split) cannot tell where it failed.
            self.variable = tf.Variable(True, trainable=False, name="hetbatch_update_gate")

    def close(self):
        """At the step's start (cross-replica context)."""
        return self.variable.assign(False)

    def open(self):
        """Once every local replica's values for the all-reduce are there (cross-replica)."""
        return self.variable.assign(True)

    def passed(self) -> bool:
        """Eager, after a step failed: whether it failed past the gate."""
        return bool(self.variable.numpy())


# Entries of the flags: per replica 0 (it fitted), the bound its failure asks for, or _HOPELESS.
_HOPELESS = -1.0


class FailureFlags:
    """Across workers: per replica, what its step's failure asks for, carried in the step's
    all-reduce (see the module docs).

    Args:
        num_replicas: the replicas in sync.
        device: the host device of `variable`.
    """

    def __init__(self, num_replicas: int, device: str):
        self.num_replicas = num_replicas
        with tf.init_scope(), tf.device(device):
            # The last step's flags, summed across replicas (read by the guard after it).
            self.variable = tf.Variable(tf.zeros([num_replicas], tf.float32), trainable=False,
                                        name="hetbatch_out_of_memory_flags")
        self.in_steps = False  # set once a guard across workers is installed
        # model -> [(dtype, shape)] of its step's all-reduce, at the step's latest trace
        self._packs = weakref.WeakKeyDictionary()
        self._join = None  # (specs, the traced stand-in of the last join)

    def of_step(self, model) -> "StepFlags":
        """What `model`'s step carries and receives (`updates`)."""
        return StepFlags(self, model)

    def can_join(self, model) -> bool:
        """Whether `model`'s step had one all-reduce that carried the flags when traced."""
        return model in self._packs

    def none(self) -> tf.Tensor:
        """Replica context: this replica's entry of a step that fitted."""
        return tf.zeros([self.num_replicas], tf.float32)

    def received(self, summed: tf.Tensor, pack, model) -> tf.Tensor:
        """Replica context: keeps the step's summed flags; whether its update may apply.
        `pack`: the values `model`'s step all-reduce summed (the stand-in's shapes, dtypes)."""
        self._packs[model] = [(v.dtype, tuple(v.shape)) for v in pack]
        kept = self.variable.assign(summed)
        with tf.control_dependencies([kept]):
            return tf.reduce_all(tf.equal(summed, 0.0))

    def join(self, strategy, model, asked) -> None:
        """Eager, on the worker whose step of `model` failed: joins the other workers' step
        all-reduce with zeros and this worker's flags `asked` ([K], see the module docs)."""
        specs = list(self._packs[model])
        join = self._join
        if join is None or join[0] != specs:
            def stand_in(flags):
                def replica_fn():
                    ctx = tf.distribute.get_replica_context()
                    mine = tf.one_hot(ctx.replica_id_in_sync_group, self.num_replicas) * flags
                    pack = [tf.zeros(shape, dtype) for dtype, shape in specs[:-1]] + [mine]
                    summed = updates.sum_across_replicas(pack, after_every_local_replica=True)
                    return self.variable.assign(summed[-1]).read_value()
                with strategy.scope():
                    return strategy.extended.call_for_each_replica(replica_fn)

            join = self._join = (specs, tf.function(stand_in, autograph=False))
        join[1](tf.constant(asked, tf.float32))

    def read(self):
        return self.variable.numpy()


@dataclasses.dataclass
class StepFlags:
    """The failure flags as one model's step carries them (`FailureFlags.of_step`)."""

    flags: FailureFlags
    model: Any

    def none(self) -> tf.Tensor:
        return self.flags.none()

    def received(self, summed: tf.Tensor, pack) -> tf.Tensor:
        return self.flags.received(summed, pack, self.model)


class StepGuard:
    """Runs one training step; on out-of-memory lowers the failing replica's bound and runs it
    again, on every worker (see the module docs).

    Args:
        strategy: the tf_hetbatch strategy (its `_micro_batches` limits are lowered).
        model: the Keras model whose steps are guarded (its metric variables are restored).
        flags: the strategy's `FailureFlags` across workers; None on one host.
    """

    def __init__(self, strategy, model, flags: Optional[FailureFlags] = None):
        self._strategy = strategy
        self._model = model
        self._flags = flags
        self._read_metrics = (None, None)  # (ids of the variables, the traced read)

    def __call__(self, run_step: Callable, data=None):
        """Runs `run_step()` (the step on `data`, its distributed batch) until it fits."""
        variables = list(self._model.metrics_variables) + state_variables(self._model)
        optimizer = getattr(self._model, "optimizer", None)
        if optimizer is not None:
            # Its step count is advanced with no dependency on the data, so also by a step
            # that fails (as Keras's own extra step at the end of a resumed epoch).
            variables.append(optimizer.iterations)
        variables += self._strategy._allocation.step_variables()
        saved = self._snapshot(variables)
        while True:
            try:
                outputs = run_step()
            except tf.errors.ResourceExhaustedError as error:
                if self._strategy._micro_batches.gate.passed():
                    raise _after_gate(self._strategy, error) from error
                asked = self._asked(error, data)
                if asked is None:
                    raise
                if self._flags is None:
                    self._lower(asked, error)
                else:
                    self._flags.join(self._strategy, self._model, asked)
                    self._lower(self._flags.read(), error)
            else:
                if self._flags is None:
                    return outputs
                asked = self._flags.read()
                if not asked.any():
                    return outputs
                self._lower(asked, None)
            for variable, value in zip(variables, saved):
                variable.assign(value)

    def _snapshot(self, variables):
        if not variables:
            return []
        ids, read = self._read_metrics
        if ids != [id(v) for v in variables]:
            read = tf.function(lambda: [tf.identity(v) for v in variables], autograph=False)
            self._read_metrics = ([id(v) for v in variables], read)
        return read()

    def _asked(self, error, data):
        """[K] flags of this worker's failure (`_HOPELESS` where nothing can help), or None
        (raise it: nothing can help and no other worker waits for this one)."""
        strategy = self._strategy
        replica = replica_of_error(strategy, error)
        share = None if replica is None else _share(strategy, data, replica)
        lowered = None
        if share is not None:
            limits = strategy.micro_batch_limits or (None,) * strategy.num_replicas_in_sync
            tried = micro_batch_size(share, limits[replica])
            if limits[replica] is not None:
                tried = min(tried, limits[replica])
            lowered = _core.lowered_limit(tried)
        if self._flags is None:
            return None if lowered is None else _flags_of(strategy, {replica: lowered})
        if not self._flags.can_join(self._model):
            return None  # no all-reduce to stand in for: the error ends the run (module docs)
        if replica is None:
            replica = _first_local_replica(strategy)  # unknown: the others must still stop
        return _flags_of(strategy, {replica: lowered or _HOPELESS})

    def _lower(self, asked, error) -> None:
        """Lowers every bound the flags `asked` for, logging each (the chief, across workers);
        raises where nothing can help."""
        strategy = self._strategy
        hopeless = [r for r, v in enumerate(asked) if v < 0]
        if hopeless:
            if error is not None:
                raise error
            raise tf.errors.ResourceExhaustedError(None, None, (
                f"Replica {hopeless[0]} (another worker's) ran out of memory in a training step "
                "on a micro-batch of one sample, or on a device the strategy could not tell; "
                "its worker raised the error. Fix: a smaller model or a device with more "
                "memory for that replica."))
        for replica, bound in enumerate(asked):
            if bound <= 0:
                continue
            strategy._micro_batches.lower(replica, int(bound))
            if self._flags is None or strategy.is_chief:
                logger.warning(
                    "Replica %d ran out of memory in a training step (nothing was applied): "
                    "its micro-batch bound is now %d samples, and the step runs again.",
                    replica, int(bound))


def _after_gate(strategy, error) -> tf.errors.ResourceExhaustedError:
    """The error of a step that ran out of memory past its update gate (module docs)."""
    replica = replica_of_error(strategy, error)
    who = "A replica" if replica is None else f"Replica {replica}"
    return tf.errors.ResourceExhaustedError(error.node_def, error.op, (
        f"{who} ran out of memory where its step cannot run again: after its gradients were "
        "ready, in the step's all-reduce or the optimizer's update (part of the update may be "
        "applied; a lower micro-batch bound would not help: that memory does not grow with "
        "the batch), or in a step the strategy does not cut into micro-batches (one replica). "
        "Fix: free that much memory on the device (no other process on it, a "
        "smaller model or optimizer state, or micro-batch bounds from "
        "hb.probe_micro_batch_limits, which leave room for the all-reduce), then resume from "
        "the last checkpoint. TensorFlow's error: " + _oom_line(error)))


def _oom_line(error) -> str:
    """The line of `error`'s message that says what did not fit (else its first line)."""
    lines = [line.strip() for line in (error.message or "").splitlines() if line.strip()]
    return next((line for line in lines if _DEVICE.search(line)), lines[0] if lines else "")


def state_variables(model) -> list:
    """The variables a training step of `model` may change besides its trainable weights,
    the optimizer's and the metrics': each trainable layer's non-trainable variables
    (BatchNormalization's moving statistics, the seeds of dropout and other random layers). A
    frozen layer (`trainable=False`) changes none of its variables."""
    found, seen = [], set()

    def visit(layer):
        if not layer.trainable:
            return
        children = getattr(layer, "layers", None)
        for variable in ([] if children else layer.non_trainable_variables):
            if id(variable) not in seen:
                seen.add(id(variable))
                found.append(variable)
        for child in children or ():
            visit(child)

    visit(model)
    return found


def _flags_of(strategy, bounds):
    flags = [0.0] * strategy.num_replicas_in_sync
    for replica, bound in bounds.items():
        flags[replica] = float(bound)
    return flags


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
