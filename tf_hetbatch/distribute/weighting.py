"""Exact weighting of uneven replica batches, and the per-replica timing hook.

Keras scales each replica's loss by 1/K and sums the replicas' gradients, i.e. it averages the
replicas' mean gradients: exact only when every replica has B/K samples. With uneven batches
b_1..b_K, replica k's loss must be multiplied by K * b_k / B, so the summed gradient is the mean
gradient over the whole global batch, exactly what one device computes on it.

The weight is applied in the optimizer's `scale_loss`, which `model.train_step` calls on the
loss before taking gradients: every linear thing downstream (regularisation losses, the
SyncBatchNormalization backward all-reduce, LossScaleOptimizer unscaling, the gradient
all-reduce) then sees correctly weighted values, while the loss tracker, updated before
`scale_loss`, keeps reporting unweighted losses. The weights come from the ACTUAL per-replica
batch shapes of each step, never from the allocation (which lags behind `set_batch_sizes`).

Which weight is exact depends on how the compiled loss reduces:
- "sum_over_batch_size" (Keras's default) and "mean": lambda_k = b_k / B;
- "mean_with_sample_weight" with sample weights: lambda_k = W_k / W, W_k the sum of replica k's
  sample weights (its loss divides by W_k);
- "sum": no weight at all; the summed replica sums are already the global sum.
Sample weights with the default reduction need no special care (Keras divides by the sample
count, so lambda_k = b_k / B stays exact). Masked sequence losses divide by the number of valid
(unmasked) entries, which the strategy cannot see: they are weighted by samples, as close as the
stock strategy gets with even batches, not exact.

The hook is installed on ONE optimizer instance, the model's, when a tf_hetbatch strategy runs
that model's train step; outside a tf_hetbatch replica step the adapted methods do exactly what
the originals do. Installing it also wraps `apply`, to take the per-replica compute time when
the local gradients are ready, before they are all-reduced.

One all-reduce per step: in Keras's own `train_step` (`ReplicaStep.carry_logs`) the optimizer's
`apply` only holds the gradients; at the end of the step (`finish_step`) one all-reduce sums the
gradients together with every metric variable (the loss's total and count, each metric's), the
update is applied from the summed gradients (the optimizer's own all-reduce passes them on) and
the step's logs are computed from the sums: true global means at no second collective. Keras's
`train_step` does nothing after `apply` but update and read the metrics, so holding the update
to the end of the step changes nothing else. Gradient clipping then acts on the global
gradient, as on one device (stock Keras clips each replica's local gradient), and a
LossScaleOptimizer's finite check sees the same summed gradients on every replica. Any other
train step keeps Keras's order (the gradient all-reduce inside `apply`, the logs in a second
all-reduce) and, for a LossScaleOptimizer, the replicas agree on skipping an overflowed step
(see `collectives.agree_on_finite_gradients`).
"""

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Optional, Tuple

import keras
import tensorflow as tf

from tf_hetbatch.distribute._upstream import collectives, metrics

_local = threading.local()

BATCH = "batch"
SAMPLE_WEIGHT = "sample_weight"
NONE = "none"

_MODE_OF_REDUCTION = {
    "sum_over_batch_size": BATCH,
    "mean": BATCH,
    "mean_with_sample_weight": SAMPLE_WEIGHT,
    "sum": NONE,
}


@dataclasses.dataclass
class ReplicaStep:
    """What one replica's train step needs from the strategy (trace time, per replica thread)."""

    weight: Optional[tf.Tensor]
    start_time: Optional[tf.Tensor]
    samples: Optional[tf.Tensor]
    timing: Any = None
    carry_logs: bool = False  # Keras's own train step: one all-reduce at its end (finish_step)
    loss_scaled: bool = False
    gradients_applied: bool = False
    # (local gradients, the function that applies them once summed), held by `apply`
    held: Optional[Tuple[list, Callable[[list], Any]]] = None


def current_step() -> Optional[ReplicaStep]:
    return getattr(_local, "step", None)


@contextlib.contextmanager
def replica_step(step: ReplicaStep):
    previous = current_step()
    _local.step = step
    try:
        yield step
    finally:
        _local.step = previous


def weighting_mode(model) -> str:
    """How replica losses must be weighted for `model`'s compiled loss(es): BATCH, SAMPLE_WEIGHT or NONE.

    Raises:
        ValueError: if the model's losses mix reductions that need different weights.
    """
    losses = [l for l in tf.nest.flatten(getattr(model, "loss", None)) if l is not None]
    modes = {}
    for loss in losses:
        reduction = getattr(loss, "reduction", "sum_over_batch_size") if isinstance(
            loss, keras.losses.Loss
        ) else "sum_over_batch_size"
        modes.setdefault(_MODE_OF_REDUCTION.get(reduction, BATCH), []).append(
            getattr(loss, "name", None) or getattr(loss, "__name__", str(loss))
        )
    if not modes:
        return BATCH
    if len(modes) > 1:
        raise ValueError(
            "The model's losses mix reductions that need different replica weights under "
            "uneven batches, so no single weight per replica is exact. Received losses by "
            f"weighting: {modes}. Fix: give every loss the same kind of reduction "
            '("sum_over_batch_size"/"mean", or "sum", or "mean_with_sample_weight").'
        )
    return next(iter(modes))


def adapt_optimizer(optimizer):
    """Installs the weighting and timing hooks on this one optimizer instance (idempotent)."""
    if optimizer is None or getattr(optimizer, "_tf_hetbatch_adapted", False):
        return
    original_scale_loss = optimizer.scale_loss
    original_apply = optimizer.apply

    def scale_loss(loss):
        loss = original_scale_loss(loss)
        step = current_step()
        if step is not None:
            step.loss_scaled = True
            if step.weight is not None:
                loss = loss * tf.cast(step.weight, loss.dtype)
        return loss

    def apply(grads, trainable_variables=None):
        step = current_step()
        if step is not None and not step.gradients_applied:
            step.gradients_applied = True
            if step.timing is not None:
                grads = _timed_gradients(step, list(grads))
            if step.carry_logs:
                step.held = (list(grads), lambda summed: _apply_summed(
                    optimizer, original_apply, summed, trainable_variables))
                return None  # applied by finish_step, after the step's one all-reduce
            if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
                grads = collectives.agree_on_finite_gradients(list(grads))
        return original_apply(grads, trainable_variables)

    def on_reduced(grads_and_vars):
        step = current_step()
        if step is None or step.timing is None:
            return grads_and_vars
        return step.timing.record_release(grads_and_vars)

    collectives.wrap_gradient_all_reduce(optimizer, on_reduced)
    scale_loss.__doc__ = original_scale_loss.__doc__
    apply.__doc__ = original_apply.__doc__
    optimizer.scale_loss = scale_loss
    optimizer.apply = apply
    optimizer._tf_hetbatch_adapted = True


def _apply_summed(optimizer, original_apply, summed, trainable_variables):
    with collectives.gradients_already_reduced(optimizer):
        return original_apply(summed, trainable_variables)


def finish_step(step: ReplicaStep, model, outputs):
    """Replica context, at the end of Keras's own train step: (outputs, logs_are_global).

    The held gradients and the metric variables are summed across replicas in one all-reduce
    (one per dtype present: a pack is one concatenated tensor), the update is applied from the
    summed gradients, and every metric result in `outputs` is replaced by its global value.
    If a metric variable cannot be summed (not SUM-on-read), only the gradients are, and the
    logs are left to the strategy's usual reduce (logs_are_global False)."""
    if step.held is None:
        return outputs, False  # no gradients (no trainable weights): the usual logs reduce
    grads, apply_summed = step.held
    metric_values = metrics.summable_metric_variables(model.metrics)
    locals_ = [tf.identity(v) for v in metric_values] if metric_values is not None else []
    dense = [g for g in grads if g is not None]
    summed = _sum_across_replicas(dense + locals_)
    summed_grads, sums = summed[:len(dense)], summed[len(dense):]
    if step.timing is not None:
        summed_grads = step.timing.record_release(summed_grads)
    summed_grads = iter(summed_grads)
    apply_summed([None if g is None else next(summed_grads) for g in grads])
    if metric_values is None:
        return outputs, False
    merged = dict(outputs)
    for name, value in metrics.metric_results_from_sums(model.metrics, sums).items():
        if name in merged:
            merged[name] = tf.convert_to_tensor(value)
    return merged, True


def _sum_across_replicas(values):
    """Replica context: `values` summed across all replicas, one all-reduce per dtype."""
    ctx = tf.distribute.get_replica_context()
    by_dtype = {}
    for i, v in enumerate(values):
        by_dtype.setdefault(v.dtype, []).append(i)
    out = [None] * len(values)
    launchers = collectives.collective_launchers(ctx.strategy)
    with collectives.instance_keys_from_values(launchers, values):  # resolved once, not per step
        for indices in by_dtype.values():
            for i, r in zip(indices, ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                                    [values[i] for i in indices])):
                out[i] = r
    return out


def _timed_gradients(step, grads):
    """Records the replica's compute time once its local gradients are ready.

    The record is a stateful op the step runs anyway; the gradients do not wait for it, so
    timing adds no barrier before the all-reduce.
    """
    ready = [g for g in tf.nest.flatten(grads, expand_composites=True) if g is not None]
    with tf.control_dependencies(ready):
        end_time = tf.timestamp()
    start_time = step.timing.step_start(step.start_time)
    step.timing.record(end_time - start_time, step.samples)
    return grads
