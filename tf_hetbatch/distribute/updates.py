"""How a step's gradients reach the variables: summed by the strategy, then applied.

Every optimizer a step uses (`weighting.step_objects`) gets an instance-level `apply` under a
tf_hetbatch strategy; outside its replica steps it does exactly what the original does. In a
step it records the replica's compute time when the local gradients are ready (`timing`), sums
them across replicas itself, and applies the sum with the optimizer's own all-reduce passing it
on (`collectives.gradients_already_reduced`). So gradient clipping acts on the global gradient, as
on one device (stock Keras clips each replica's part), and a LossScaleOptimizer decides on the
same summed gradients on every replica (stock Keras checks the first replica's only,
keras-team/keras#18666). The sum's instance keys are fixed when traced
(`collectives.static_instance_keys`), so the cluster sets it up once.

One all-reduce per step: in Keras's own `train_step` (`ReplicaStep.carry_logs`) `apply` only
holds the gradients; at the end of the step (`finish_step`) one all-reduce sums them together
with every metric variable (the loss's total and count, each metric's), the update is applied
from the sum and the step's logs are computed from the sums: true global means at no second
collective. Keras's `train_step` does nothing after `apply` but update and read the metrics, so
holding the update to the end of the step changes nothing else. Any other step keeps its own
order (a GAN's generator step reads the discriminator its first update changed): each `apply`
sums and applies at once, and the logs take a second all-reduce.
"""

import tensorflow as tf

from tf_hetbatch.distribute import timing
from tf_hetbatch.distribute import weighting
from tf_hetbatch.distribute.weighting import ReplicaStep, current_step
from tf_hetbatch.distribute._upstream import collectives, merge_calls, metrics


def adapt_optimizer(optimizer) -> None:
    """Installs the strategy's `apply` on this one optimizer instance (idempotent)."""
    if optimizer is None or getattr(optimizer, "_tf_hetbatch_adapted", False):
        return
    merge_calls.adapt_accumulating_optimizer(optimizer)
    original_apply = optimizer.apply

    def apply(grads, trainable_variables=None):
        step = current_step()
        if step is None:
            return original_apply(grads, trainable_variables)
        grads = _weighted_average_loss_gradients(step, list(grads))
        step.gradients_applied = True
        if step.capture is not None:  # a micro-batch: summed with the others, then applied
            step.capture.append(weighting.CapturedApply(
                optimizer, original_apply, grads, trainable_variables))
            return None
        if _all_same_on_every_replica(grads):  # no replica's own: the stock reduction
            return original_apply(grads, trainable_variables)
        return _apply_replica_gradients(step, optimizer, original_apply, grads,
                                        trainable_variables)

    collectives.wrap_gradient_all_reduce(optimizer)
    apply.__doc__ = original_apply.__doc__
    optimizer.apply = apply
    optimizer._tf_hetbatch_adapted = True


def apply_captured(step: ReplicaStep, captured, grads) -> None:
    """Replica context: applies the sum of a replica's micro-batches' gradients as its one
    `apply` of the step (`micro_batches`)."""
    _apply_replica_gradients(step, captured.optimizer, captured.original_apply, grads,
                             captured.trainable_variables)


def _apply_replica_gradients(step, optimizer, original_apply, grads, trainable_variables):
    """The replica's weighted gradients of a step: timed, then held for the step's one
    all-reduce (Keras's own train step) or summed across replicas and applied."""
    if step.timing is not None and not step.timed:
        grads = _timed_gradients(step, grads)  # the replica's own work ends here
        step.timed = True
    if step.noise is not None and not step.noise_measured:
        step.noise_row = step.noise.row(grads, step.samples)
        step.noise_measured = True
    if step.carry_logs and step.held is None:
        step.held = (grads, lambda summed: _apply_summed(
            optimizer, original_apply, summed, trainable_variables))
        return None  # applied by finish_step, after the step's one all-reduce
    present = [g for g in grads if g is not None]
    summed = iter(_sum_with_timing(step, present))
    summed = [None if g is None else next(summed) for g in grads]
    return _apply_summed(optimizer, original_apply, summed, trainable_variables)


def _weighted_average_loss_gradients(step, grads):
    """The step's gradients weighted by K * lambda_k where its loss came from
    `tf.nn.compute_average_loss` without the global batch (see `weighting`)."""
    if not step.average_loss_reads:
        return grads
    if step.seams_weighted:
        raise ValueError(
            "A step mixes `tf.nn.compute_average_loss` without `global_batch_size` with a Keras "
            "loss the strategy weights: their gradients need different weights, and are summed "
            "before the optimizer sees them. Fix: pass global_batch_size=B to "
            "tf.nn.compute_average_loss.")
    weight = step.num_replicas * step.share(weighting.BATCH)
    return [None if g is None else g * tf.cast(weight, g.dtype) for g in grads]


def _apply_summed(optimizer, original_apply, summed, trainable_variables):
    with collectives.gradients_already_reduced(optimizer):
        return original_apply(summed, trainable_variables)


def _sum_with_timing(step, values, gate=None, flags=None, gradients=None):
    """Replica context: `values` summed across replicas; the step's first sum also carries the
    replica's timing table (`timing`), records it and stamps the release, and its gradient
    noise table (`gradient_noise`: the first `gradients` values are the gradients, default
    all). With `gate` (an
    `out_of_memory.UpdateGate`) the sum starts once every local replica's values are there
    and the gate records it; with `flags` (`out_of_memory.StepFlags`) the sum also carries
    them, and `step.apply_if` says whether the step may apply its update (a step another
    worker could not finish records no time)."""
    row, step.timing_row = step.timing_row, None
    noise, step.noise_row = step.noise_row, None
    extra = [t for t in (row, noise) if t is not None] + ([] if flags is None else [flags.none()])
    summed = sum_across_replicas(values + extra, gate=gate)
    if flags is not None:
        step.apply_if = flags.received(summed.pop(), values + extra)
    if noise is not None:
        table = summed.pop()
        step.noise.record(table, summed[:len(values) if gradients is None else gradients],
                          step.apply_if)
    if row is None:
        return summed
    table = summed.pop()
    if step.apply_if is not None:
        table = table * tf.cast(step.apply_if, table.dtype)
    step.timing.record(table)
    return step.timing.record_release(summed, step.timing_kept)


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
    flags = step.failure_flags if metric_values is not None else None  # one all-reduce only
    gate = step.update_gate if step.micro_batched else None
    summed = _sum_with_timing(step, dense + locals_, gate, flags, gradients=len(dense))
    summed_grads, sums = summed[:len(dense)], summed[len(dense):]
    summed_grads = iter(summed_grads)
    summed_grads = [None if g is None else next(summed_grads) for g in grads]
    if step.apply_if is None:
        apply_summed(summed_grads)
    else:  # not where another worker's replica ran out of memory (`out_of_memory`)
        _apply_if(step.apply_if, apply_summed, summed_grads)
    if metric_values is None:
        return outputs, False
    merged = dict(outputs)
    for name, value in metrics.metric_results_from_sums(model.metrics, sums).items():
        if name in merged:
            merged[name] = tf.convert_to_tensor(value)
    return merged, True


def _apply_if(condition, apply_summed, grads):
    """Replica context: `apply_summed(grads)` where `condition` (the same on every replica)
    holds. The condition is taken in cross-replica context, as a LossScaleOptimizer does: a
    `tf.cond` in replica context cannot hold the optimizer's `merge_call`."""
    def cross_replica(strategy, condition, grads):
        def apply():
            strategy.extended.call_for_each_replica(apply_summed, args=(grads,))
            return tf.constant(True)

        first = strategy.experimental_local_results(condition)[0]
        return tf.cond(first, apply, lambda: tf.constant(False))

    tf.distribute.get_replica_context().merge_call(cross_replica, args=(condition, grads))


def sum_across_replicas(values, after_every_local_replica: bool = False, gate=None):
    """Replica context: `values` summed across all replicas, one all-reduce per dtype.

    With `after_every_local_replica` the all-reduce starts only once every replica of this
    process has its values: a step that fails before (a micro-batch out of memory) then leaves
    no collective in flight, which TensorFlow would abort for good ("Collective ops is aborted
    by: group is cancelled"), and can run again (`out_of_memory`). A `gate`
    (`out_of_memory.UpdateGate`, implies `after_every_local_replica`) records that point
    before the all-reduce starts: a failure after it cannot be run again.
    """
    if not values:
        return []
    ctx = tf.distribute.get_replica_context()
    if after_every_local_replica or gate is not None:
        values = _after_every_local_replica(ctx, values, gate)
    by_dtype = {}
    for i, v in enumerate(values):
        by_dtype.setdefault(v.dtype, []).append(i)
    out = [None] * len(values)
    launchers = collectives.collective_launchers(ctx.strategy)
    with collectives.static_instance_keys(launchers):  # resolved once, not per step
        for indices in by_dtype.values():
            for i, r in zip(indices, ctx.all_reduce(tf.distribute.ReduceOp.SUM,
                                                    [values[i] for i in indices])):
                out[i] = r
    return out


def _all_same_on_every_replica(grads):
    """Replica context: whether every gradient present is one and the same object on every
    replica (a tensor made outside the step), where the strategy's topology tells
    (`tells_shared_values`). Such gradients are nothing a replica computed from its batch:
    the optimizer reduces and applies them as under the stock strategy (its all-reduce passes
    them on unsummed; Keras's gradient accumulation then sums the accumulated mean over the
    replicas). Batched with the step's timing row they failed in TensorFlow's all-reduce (a
    one-component value among per-replica ones); the stock strategy fails on a mix of such
    gradients and per-replica ones, and so does this one. Told in an eager `run` only (where
    such values come from: a gradient made once, outside the replicas)."""
    ctx = tf.distribute.get_replica_context()
    present = [g for g in grads if g is not None]
    if not present or not tf.executing_eagerly() or not getattr(
            getattr(ctx.strategy, "_topology", None), "tells_shared_values", False):
        return False
    # Eager only: a merge call in every traced step changed what the timing stamps measure (the
    # replicas' traces interleave at it; measured: with it, test_callback's cost model read
    # the slowest replica as the fastest and the controller moved samples to it).
    return ctx.merge_call(_all_plain, args=(present,))


def _all_plain(strategy, values):
    """Cross-replica context: whether no value is per-replica (one object on every replica)."""
    del strategy
    return not any(isinstance(v, tf.distribute.DistributedValues) for v in values)


def _after_every_local_replica(ctx, values, gate=None):
    """Replica context: `values`, available once every local replica's values are (and `gate`
    has recorded it)."""
    def ready_token(strategy, per_replica):
        local = [t for v in per_replica for t in strategy.experimental_local_results(v)]
        with tf.control_dependencies([tf.group(*local)]):  # one edge per device
            if gate is None:
                return tf.constant(True)
            with tf.control_dependencies([gate.open()]):
                return tf.constant(True)

    token = ctx.merge_call(ready_token, args=(values,))
    with tf.control_dependencies([token]):
        return [tf.identity(v) for v in values]


def _timed_gradients(step, grads):
    """Stamps the replica's compute time once its local gradients are ready: its timing table
    (`timing`) waits in `step.timing_row` for the step's first all-reduce.

    The all-reduce waits for the stamp only (taken once the gradients are there): timing adds
    no barrier before it. The stamp also waits for the start stamp: nothing else orders the two
    (the step's work does not wait for its start stamp), and on a loaded host a start stamp
    queued behind a small replica's whole computation read a time after its end (a replica's
    total compute time came out 0 or negative).
    """
    start_time = step.timing.step_start(step.start_time)
    end_time = timing.now_after(
        tf.nest.flatten(grads, expand_composites=True) + [step.start_time])
    step.timing_kept = step.timing.shape_kept(step.samples, step.micro_batch_count)
    step.timing_row = step.timing.row(end_time - start_time, step.samples, step.timing_kept)
    return grads


def adapt_step_objects(models, optimizers, losses, metrics) -> None:
    """Adapts what a step uses (see `weighting.step_objects`): each instance once."""
    for optimizer in optimizers:
        adapt_optimizer(optimizer)
    for loss in losses:
        weighting.adapt_loss(loss)
    for metric in metrics:
        weighting.adapt_metric(metric)
    for model in models:
        weighting.adapt_compute_loss(model)
