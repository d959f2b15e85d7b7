"""Micro-batches: a replica's share computed in pieces within one training step.

A replica with a memory bound m_k (`HeteroMixin.set_micro_batch_limits`) whose share b_k of
a step's global batch exceeds it runs the step function on n_k = ceil(b_k / m_k) micro-batches
of at most m_k samples, one after the other, within the same training step:

- micro-batch 0 runs in Python, as the step would (its variables are created, its output
  structure becomes known); micro-batches 1 .. n_k - 1 run in a `tf.while_loop` (one at a
  time, `parallel_iterations=1`, each after the previous one's gradients: the memory of one
  micro-batch) that traces the step function again;
- each micro-batch's loss is weighted by ITS share of the global batch (its samples, or
  sample-weight sum, over the step's), so the micro-batches' gradients add up to the
  replica's weighted gradient (`weighting`);
- the optimizer's `apply` (adapted by `updates`) captures each micro-batch's gradients instead
  of applying them; their sum (IndexedSlices made dense) goes where one step's gradients go:
  held for Keras's one all-reduce with the metrics (`updates.finish_step`) or summed across
  replicas and applied once. So the update is exactly the one-device update on the global
  batch. The replica's compute time ends when the summed gradients are ready;
- outputs: a metric's `result()` is the last micro-batch's, after every micro-batch updated
  the metric (its global value as always, `step_run`); any other float value the step returns
  (a loss already scaled by the global batch, or weighted by the strategy) is summed over the
  micro-batches, other values are the last micro-batch's; a value whose shape depends on the
  micro-batch (per-sample values) is refused when traced. A `keras.metrics.Mean` the step
  updates with a scalar per call (a loss tracker) counts the replica's micro-batches as one
  update (`weighting.adapt_metric`), so it reports what it reports without micro-batches.

The count follows each step's ACTUAL batch: the bound is read from a host variable in the step
(no retrace when it changes) and the share from the batch's shape (splits switch with a lag).
Counts differ per replica: each replica's loop is its own, and the step's one all-reduce
comes after it.

What differs from one device on the global batch, and where: layers whose forward pass
depends on the batch (BatchNormalization in training) see each micro-batch as a batch of its
own, as in any gradient accumulation: their statistics are per micro-batch, so such a model is
not exactly one device's (plain BatchNormalization is not exact across replicas either). A
model with SyncBatchNormalization is refused while limits are set (even all None): its
statistics all-reduce in every forward pass cannot run inside a replica's micro-batch loop,
and would need the same micro-batch count on every replica. Everything else is exact: the update equals one device's, and the logs are the true
global means.

Only training steps (Keras's `train_step`, a custom loop's step that applies gradients) are
computed in micro-batches: evaluation and prediction, which hold no gradients, compute each
replica's share at once.

Refused when traced (naming why): a step that applies gradients more than once (a GAN-style
step whose second update reads the first's cannot be accumulated), SyncBatchNormalization,
and `tf.nn.scale_regularization_loss` (its regularization would count once per micro-batch).
"""

import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_hetbatch.core import micro_batches as _core
from tf_hetbatch.distribute import out_of_memory
from tf_hetbatch.distribute import timing
from tf_hetbatch.distribute import updates
from tf_hetbatch.distribute import weighting
from tf_hetbatch.distribute._upstream import keras_trainer

_FIXED, _SUM, _LAST = "fixed", "sum", "last"


class Limits:
    """A strategy's memory bounds: the values set, and the host variable the step reads.

    Args:
        num_replicas: the replicas in sync.
        device: the host device of the variable.
    """

    def __init__(self, num_replicas: int, device: str):
        self.num_replicas = num_replicas
        self._values: Optional[_core.Limits] = None
        with tf.init_scope(), tf.device(device):
            # One entry per replica, 0: no bound. Read once per step (no retrace).
            self.variable = tf.Variable(tf.zeros([num_replicas], tf.int64), trainable=False,
                                        name="hetbatch_micro_batch_limits")
        self.failures = out_of_memory.FailureFlags(num_replicas, device)
        self.gate = out_of_memory.UpdateGate(device)

    @property
    def values(self) -> Optional[_core.Limits]:
        """The bounds (None: never set, steps run without micro-batches)."""
        return self._values

    @property
    def in_use(self) -> bool:
        return self._values is not None

    def set(self, limits: Optional[Sequence[Optional[int]]]) -> None:
        """Sets the bounds (validated: `core.micro_batches.check_limits`); None: none."""
        if limits is None:
            self._values = None
            self.variable.assign(tf.zeros([self.num_replicas], tf.int64))
            return
        values = _core.check_limits(limits, self.num_replicas)
        self._values = values
        self.variable.assign(_core.limits_array(values))

    def guard_steps(self, strategy, model) -> None:
        """With limits set, `model`'s Keras training steps survive running out of memory
        (`out_of_memory`); a no-op without limits. Across workers the steps then also carry
        the failure flags (`flags_of_step`)."""
        if not self.in_use or model is None:
            return
        across = strategy.num_local_replicas != strategy.num_replicas_in_sync
        guard = out_of_memory.StepGuard(strategy, model, self.failures if across else None)
        if keras_trainer.guard_train_step(model, guard) and across:
            self.failures.in_steps = True

    def flags_of_step(self, carry_logs: bool, model):
        """The failure flags `model`'s step's one all-reduce carries (Keras's own train step,
        across workers, once guarded), or None."""
        if carry_logs and model is not None and self.failures.in_steps:
            return self.failures.of_step(model)
        return None

    def lower(self, replica: int, limit: int) -> None:
        """Lowers one replica's bound (after a step ran out of memory)."""
        values = list(self._values or [None] * self.num_replicas)
        values[replica] = int(limit)
        self.set(values)


class LimitsMixin:
    """The synchronous strategies' public face of the memory bounds (their `_micro_batches`,
    a `Limits`)."""

    @property
    def micro_batch_limits(self) -> Optional[Tuple[Optional[int], ...]]:
        """Per replica, the most samples it computes at once (None: no bound), in replica
        order; None while no bounds were set (see `set_micro_batch_limits`)."""
        return self._micro_batches.values

    def set_micro_batch_limits(self, limits: Optional[Sequence[Optional[int]]]) -> None:
        """Bounds how many samples each replica computes at once (its memory), not its share.

        A replica whose share b_k of a step exceeds its bound m_k computes it in
        ceil(b_k / m_k) micro-batches within the same training step and contributes their
        weighted sum to the step's one all-reduce: the update stays exactly the one-device
        update on the global batch, and the logs true global means (see the module docs). So a fast replica with little memory keeps
        its fair share; `DynamicBatching(max_sizes=...)` stays a hard cap on the share.
        The bounds change without retrace (the step reads them from a host variable) and the
        count follows each step's actual batch. Once set (even all None), Keras's `fit` also
        survives a step that runs out of memory: that replica's bound is lowered and the step
        re-run with the same batch (`tf_hetbatch.distribute.out_of_memory`).

        Takes effect in steps traced after the first call: Keras's next `fit`, a custom
        loop's step traced anew. Several workers: call it on every worker with the same
        values (as `set_batch_sizes`).

        Args:
            limits: one entry per replica, in replica order: an int >= 1 (samples computed
                at once) or None (no bound); or None for no bounds at all.

        Raises:
            ValueError: wrong length, or an entry that is not an int >= 1 or None.
        """
        self._micro_batches.set(limits)


# --------------------------------------------------------------------- the step's plan -------
@dataclasses.dataclass
class StepPlan:
    """What each replica's micro-batches need, made in cross-replica context (`plan_step`)."""

    limits: tf.Tensor             # int64 [K], 0: no bound
    sliced: List[bool]            # per leaf of (args, kwargs): a per-replica batch (sliced)
    gate: Any = None              # the step's `out_of_memory.UpdateGate`, closed at its start
    shares_of: Optional[Callable] = None  # replica context: a micro-batch's data -> shares
    data_of: Optional[Callable] = None    # (args) -> the step's data


def plan_step(strategy, args, kwargs, sync_batch_norm: bool) -> StepPlan:
    """Cross-replica context: reads the bounds once and marks the per-replica leaves of the
    step's arguments.

    Raises:
        ValueError: a model with SyncBatchNormalization (see the module docs).
    """
    if sync_batch_norm:
        raise ValueError(
            "A model with SyncBatchNormalization cannot compute a replica's share in "
            "micro-batches (`set_micro_batch_limits`): its statistics are all-reduced across "
            "replicas in every forward pass, and replicas with different micro-batch counts "
            "would not meet in those all-reduces. Received: micro_batch_limits="
            f"{strategy.micro_batch_limits}. Fix: lift the limits "
            "(strategy.set_micro_batch_limits(None)) and bound the shares instead "
            "(DynamicBatching(max_sizes=...)), or use plain BatchNormalization.")
    limits = strategy._micro_batches.variable.read_value()
    gate = strategy._micro_batches.gate
    gate.close()
    leaves = tf.nest.flatten((tuple(args), dict(kwargs or {})))
    sliced = [isinstance(v, tf.distribute.DistributedValues) for v in leaves]
    return StepPlan(limits, sliced, gate)


def _counts(sizes, limits):
    """int64 counts: ceil(b / m) (at least 1), 1 where unbounded."""
    sizes = tf.cast(sizes, tf.int64)
    safe = tf.maximum(limits, 1)
    return tf.where(limits > 0, tf.maximum((sizes + safe - 1) // safe, 1),
                    tf.ones_like(sizes))


# --------------------------------------------------------------------- a replica's step ------
def run(step: weighting.ReplicaStep, fn, args, kwargs, plan: StepPlan):
    """Replica context: `fn(*args, **kwargs)` over the replica's micro-batches (module docs).

    Returns:
        The step's outputs, combined over the micro-batches.

    Raises:
        ValueError: a step that applies gradients more than once, or returns per-sample
            values (when traced).
    """
    kwargs = dict(kwargs or {})
    structure = (tuple(args), kwargs)
    leaves = tf.nest.flatten(structure)
    batched = [i for i, (leaf, dist) in enumerate(zip(leaves, plan.sliced))
               if dist and _has_batch_dim(leaf)]
    if not batched:
        return _call(step, fn, structure, plan)[0]  # nothing per replica to cut
    # The loop's integers (its counter, count, slice bounds) live on the replica's host CPU:
    # the loop's condition and the slices' bounds are read there, so on a GPU each micro-batch
    # would otherwise wait for the device to hand them back.
    host = timing.replica_host()
    with tf.device(host):
        samples = _batch_size(leaves[batched[0]])
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        count = _counts(samples, tf.gather(plan.limits, replica))
    step.micro_batched, step.micro_batch_count = True, count

    def part(j):
        with tf.device(host):
            start = (j * samples + count - 1) // count
            end = ((j + 1) * samples + count - 1) // count
        cut = list(leaves)
        for i in batched:
            cut[i] = leaves[i][start:end]
        return tf.nest.pack_sequence_as(structure, cut)

    outputs, captured = _call(step, fn, part(tf.constant(0, tf.int64)), plan)
    flat = tf.nest.flatten(outputs)
    kinds = _output_kinds(step, flat)
    grads0 = list(captured[0].grads) if captured else []
    present = [i for i, g in enumerate(grads0) if g is not None]

    def cond(j, acc, outs):
        with tf.device(host):
            return j < count

    def body(j, acc, outs):
        with tf.control_dependencies(acc or outs):  # one micro-batch at a time: memory
            piece = part(j)
        more, cap = _call(step, fn, piece, plan)
        _check_same_apply(captured, cap, present)
        acc = [a + _dense(cap[0].grads[i]) for a, i in zip(acc, present)]
        more_flat = tf.nest.flatten(more)
        if len(more_flat) != len(flat):
            raise ValueError("A micro-batched step returned outputs of another structure for a "
                             "later micro-batch. Fix: return the same structure every call.")
        kept = [t for t, kind in zip(more_flat, kinds) if kind != _FIXED]
        outs = [o + t if kind == _SUM else t for o, t, kind in
                zip(outs, kept, [k for k in kinds if k != _FIXED])]
        with tf.device(host):
            j = j + 1
        return j, acc, outs

    initial = [flat[i] for i, kind in enumerate(kinds) if kind != _FIXED]
    with tf.device(host):
        first = tf.constant(1, tf.int64)
    loop_vars = [first, [_dense(grads0[i]) for i in present], initial]
    _, acc, outs = tf.while_loop(cond, body, loop_vars, parallel_iterations=1)
    outs = iter(outs)
    combined = [t if kind == _FIXED else next(outs) for t, kind in zip(flat, kinds)]
    for old, new in zip(flat, combined):
        hit = step.metric_results.get(id(old))
        if new is not old and hit is not None and hit[0] is old:
            step.metric_results[id(new)] = (new,) + tuple(hit[1:])
    if captured:
        grads = [None] * len(grads0)
        for i, a in zip(present, acc):
            grads[i] = a
        updates.apply_captured(step, captured[0], grads)
    return tf.nest.pack_sequence_as(outputs, combined)


def _call(step, fn, structure, plan):
    """One micro-batch: (outputs, the `apply` calls it made, captured)."""
    args, kwargs = structure
    step.shares = plan.shares_of(plan.data_of(args))
    step.capture = []
    with weighting.user_code(step):
        outputs = fn(*args, **kwargs)
    captured, step.capture = step.capture, None
    if len(captured) > 1:
        raise ValueError(
            "A step that applies gradients more than once cannot be computed in micro-batches "
            "(the strategy has micro-batch limits, `set_micro_batch_limits`): each "
            "later update reads the earlier one (e.g. a GAN's generator step after its "
            "discriminator's), but micro-batches accumulate every gradient before any update. "
            f"Received: {len(captured)} optimizer applies in one step. Fix: lift the bounds "
            "(strategy.set_micro_batch_limits(None)).")
    return outputs, captured


def _check_same_apply(first, later, present):
    if bool(first) != bool(later) or (first and (
            [i for i, g in enumerate(later[0].grads) if g is not None] != present
            or later[0].optimizer is not first[0].optimizer)):
        raise ValueError("A micro-batched step applied other gradients for a later "
                         "micro-batch than for the first. Fix: apply the same variables' "
                         "gradients with the same optimizer in every call of the step.")


def _output_kinds(step, flat):
    kinds = []
    for t in flat:
        if not isinstance(t, tf.Tensor):
            kinds.append(_FIXED)
            continue
        hit = step.metric_results.get(id(t))
        if hit is not None and hit[0] is t:
            kinds.append(_LAST)  # a metric's result: its value after every micro-batch
        elif not t.shape.is_fully_defined():
            raise ValueError(
                "A micro-batched step (the strategy has micro-batch limits, "
                "`set_micro_batch_limits`) returned a value whose shape depends on the batch "
                f"(per-sample values?), which micro-batches cannot combine. Received: {t!r}. "
                "Fix: return metric results or scalars (e.g. a loss), or lift the bounds "
                "(strategy.set_micro_batch_limits(None)).")
        elif t.dtype.is_floating or t.dtype.is_complex:
            kinds.append(_SUM)
        else:
            kinds.append(_LAST)
    return kinds


def _has_batch_dim(leaf):
    if isinstance(leaf, tf.RaggedTensor):
        return True
    if isinstance(leaf, tf.SparseTensor):
        raise ValueError("A micro-batched step's data holds a tf.SparseTensor, which the "
                         "strategy cannot cut into micro-batches. Fix: densify it in the input "
                         "pipeline, or lift the bounds (strategy.set_micro_batch_limits(None)).")
    return isinstance(leaf, tf.Tensor) and leaf.shape.rank != 0


def _batch_size(leaf):
    if isinstance(leaf, tf.RaggedTensor):
        return leaf.nrows(out_type=tf.int64)
    return tf.shape(leaf, out_type=tf.int64)[0]


def _dense(grad):
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad

