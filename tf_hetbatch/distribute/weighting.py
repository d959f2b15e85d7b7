"""Exact weighting of uneven replica batches: at each loss term, wherever Keras scales it.

Under a `tf.distribute` strategy Keras divides every loss it reduces by the replica count K
(`Loss.__call__`, `Model.compute_loss`) and the replicas' gradients are summed: the mean of the
replicas' means, exact only when every replica's term has the same denominator. A term divides
the sum of its weighted values by its replica's denominator D_k: its valid entries under a
Keras mask ("sum_over_batch_size"/"mean"), its masked sample weights' sum
("mean_with_sample_weight"), else its elements. One device divides by the global D = sum D_k,
so replica k's Keras-scaled term must be multiplied by K * D_k / D, its share. Without a mask
the shares are the replica's share of the step's samples (or of its sample weights), known from
the input pipeline before the step; a mask is known only once the model ran, so a masked
term's denominators are summed across replicas in the step (one small all-reduce per masked
term, before the backward pass). Applied to the loss, before any gradient is taken, every
linear thing downstream (SyncBatchNormalization's backward all-reduce, mixed-precision loss
scaling, the gradient sum) sees correctly weighted values. The shares come from the ACTUAL
per-replica batches of each step, never from the allocation (which lags behind a switch).

Where a loss is scaled is where it is weighted (the "seams"), under a tf_hetbatch strategy
only, on the instances a step uses:
- every `keras.losses.Loss` a step reaches (a model's attributes, a loop's closure) and each
  term of a model's compiled loss: by its own reduction and mask ("sum" needs no weight,
  "none" is left to the caller);
- the model's additional losses (regularizers, `add_loss`), by the replica's share of the
  samples (a replica with none adds nothing);
- the model's `compute_loss`: what an override adds beyond those seams, by samples; one whose
  seams did not run (raw ops only) as a whole.

A seam's value is in the SUM form: the replicas' values sum to the global loss, the stock
strategy's convention (a custom loop's `strategy.reduce(SUM, loss)` is the global loss).
Keras's own steps count every replica's loss alike (B / K each, `_adapt_total_loss_tracker`),
so their logs and each output's loss are global means. A Keras model's custom step (a guide's
`train_step` updating a `Mean` with the loss) gets the MEAN form from the outermost seam: the
value times K, whose plain mean over the replicas is the global loss; its gradient stays the
sum form's (`value + stop_gradient((K - 1) * value)`).

`tf.nn.compute_average_loss` without `global_batch_size` (TensorFlow's custom-loop tutorial)
divides each replica's loss by its own batch size times K, which Keras's and TensorFlow's
helpers cannot know is wrong under uneven batches; the strategy sees it read
`num_replicas_in_sync` while the step is traced and weights that step's gradients by
K * lambda_k instead, in each optimizer's `apply` before the sum (`updates`): exact, also for
a `tf.nn.scale_regularization_loss` added to it (its K copies weighted by lambda_k sum to
one). Its VALUE stays each replica's mean divided by K (summed over the replicas: the mean of
their means, not the global mean): said once in a warning. Not exact after
SyncBatchNormalization has mixed the replicas (refused), nor with an optimizer the step does
not reach (refused). A Keras loss the step does not reach (so no seam weights it) is refused
when traced, naming the fix. A loss not divided by the replica count
(`tf.nn.compute_average_loss(..., global_batch_size=B)`, a "sum") is summed across replicas
as it is: exact when it is scaled by the global batch, as TensorFlow's guide teaches.
"""

import contextlib
import dataclasses
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import keras
import tensorflow as tf
from tf_hetbatch.distribute import own_counts
from tf_hetbatch.distribute._upstream import keras_callers, keras_losses


_local = threading.local()

BATCH = "batch"  # divided by the sample count and by K: weight by samples
SAMPLE_WEIGHT = "sample_weight"  # divided by the sample-weight sum and by K: by weight sums
SUM = "sum"  # not divided: already the replica's share of the global sum
UNREDUCED = "unreduced"  # per-sample values: the caller reduces them

_MODE_OF_REDUCTION = {
    "sum_over_batch_size": BATCH,
    "mean": BATCH,
    "mean_with_sample_weight": SAMPLE_WEIGHT,
    "sum": SUM,
    "none": UNREDUCED,
    None: UNREDUCED,
}
_SCALED_BY_KERAS = (BATCH, SAMPLE_WEIGHT)


@dataclasses.dataclass
class ReplicaStep:
    """What one replica's step needs from the strategy (trace time, per replica thread)."""

    num_replicas: int
    # mode -> lambda_k (this replica's share of the global batch), or None: every replica got
    # the same data (nothing distributed), lambda_k = 1 / K.
    shares: Optional[Dict[str, tf.Tensor]] = None
    has_sample_weight: bool = False
    start_time: Optional[tf.Tensor] = None
    samples: Optional[tf.Tensor] = None
    timing: Any = None
    carry_logs: bool = False  # Keras's own train step: one all-reduce at its end (`updates`)
    gradients_applied: bool = False
    # (local gradients, the function that applies them once summed), held by `apply`
    held: Optional[Tuple[list, Callable[[list], Any]]] = None
    # While the user's step function runs (not the strategy's own code around it).
    in_user_code: bool = False
    seam_depth: int = 0
    # Keras-scale reads still expected from Loss objects whose values a seam weighted.
    pending_scale_reads: int = 0
    # A Keras model's step (its own or a custom one), not a custom loop's function.
    model_step: bool = False
    # The step's global samples (Keras's own loss tracker weighs every replica by B / K).
    total_samples: Optional[tf.Tensor] = None
    # Replica context: a list of tensors summed across replicas (a masked loss's denominator).
    sum_across: Optional[Callable[[list], list]] = None
    term_depth: int = 0  # inside a loss term's `call`
    container_depth: int = 0  # inside a model's compiled loss
    # The weighted outputs of the seams a running `compute_loss` called (its compiled loss, its
    # additional losses), and the loss terms it called outside them.
    parts: Optional[list] = None
    unrecorded_terms: int = 0
    seams_weighted: int = 0
    # `tf.nn.compute_average_loss` without the global batch: its gradients need the weight.
    average_loss_reads: int = 0
    optimizers_reached: bool = False
    sync_batch_norm: bool = False
    # id(tensor returned by a metric's result()) -> (tensor, metric, path in the result), for
    # the global logs.
    metric_results: Dict[int, Tuple[tf.Tensor, Any, tuple]] = dataclasses.field(
        default_factory=dict)
    # Micro-batches (`micro_batches`): while a micro-batch runs, the optimizer `apply` calls it
    # makes (`CapturedApply`), accumulated instead of applied; and the replica's count.
    capture: Optional[List["CapturedApply"]] = None
    micro_batched: bool = False
    micro_batch_count: Optional[tf.Tensor] = None
    timed: bool = False  # the replica's compute time is stamped (once per step)
    # Its timing table (`timing.TimingAccumulators.row`), until the step's first sum carries it.
    timing_row: Optional[tf.Tensor] = None
    timing_kept: Optional[tf.Tensor] = None  # 1.0: the step has the last step's shape (timing)
    # Where the gradient noise is measured (`gradient_noise.NoiseAccumulators`): the replica's
    # table, until the step's first sum carries it.
    noise: Any = None
    noise_measured: bool = False
    noise_row: Optional[tf.Tensor] = None
    # Across workers, with micro-batch limits: the out-of-memory flags the step's one
    # all-reduce carries (`out_of_memory.FailureFlags`), and whether its update may apply.
    failure_flags: Any = None
    apply_if: Optional[tf.Tensor] = None
    # With micro-batch limits: the gate past which a failed step cannot run again
    # (`out_of_memory.UpdateGate`), opened before the step's one all-reduce.
    update_gate: Any = None

    def share(self, mode):
        if self.shares is None:
            return tf.constant(1.0 / self.num_replicas)
        if mode == SAMPLE_WEIGHT and self.has_sample_weight:
            return self.shares[SAMPLE_WEIGHT]
        return self.shares[BATCH]


@dataclasses.dataclass
class CapturedApply:
    """An optimizer `apply` of one micro-batch, held to be applied once summed (`updates`)."""

    optimizer: Any
    original_apply: Callable
    grads: list
    trainable_variables: Any


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


@contextlib.contextmanager
def user_code(step: ReplicaStep):
    """While the user's step function runs: the replica-count reads it makes are checked."""
    step.in_user_code = True
    try:
        yield
    finally:
        step.in_user_code = False


def weighting_mode(model) -> str:
    """How `model.compute_loss` must be weighted as a whole for the compiled loss(es): BATCH,
    SAMPLE_WEIGHT or SUM (a `compute_loss` of raw ops, whose terms no seam sees).

    Raises:
        ValueError: if the model's losses mix reductions that need different weights.
    """
    return _mode_of_losses(tf.nest.flatten(getattr(model, "loss", None)))


def _mode_of_losses(losses) -> str:
    losses = [l for l in losses if l is not None]
    modes = {}
    for loss in losses:
        reduction = getattr(loss, "reduction", "sum_over_batch_size") if isinstance(
            loss, keras.losses.Loss
        ) else "sum_over_batch_size"
        mode = _MODE_OF_REDUCTION.get(reduction, BATCH)
        modes.setdefault(SUM if mode == UNREDUCED else mode, []).append(
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


# --------------------------------------------------------------------- the weight ------------
def term_weight(step: ReplicaStep, mode: str, denominator=None):
    """K times this replica's share of a loss term's global denominator (1 for a "sum").

    Without `denominator` the share is the replica's share of the step's samples (or sample
    weights), known before the step. With it (a mask reached the loss: the term divides by its
    valid entries) the replicas' denominators are summed across replicas here.
    """
    if mode == SUM:
        return tf.constant(1.0)
    if denominator is None or step.shares is None:
        share = step.share(mode)
    else:
        share = _share_in_step(step, tf.cast(denominator, tf.float32))
    return float(step.num_replicas) * tf.cast(share, tf.float32)


def _share_in_step(step, denominator):
    if step.micro_batched or step.capture is not None:
        raise ValueError(
            "A loss with a Keras mask (e.g. from Embedding(mask_zero=True) or Masking) divides "
            "by its valid entries over the whole step, but this replica computes its share in "
            "micro-batches (`set_micro_batch_limits`), which cannot know the step's total. Fix: "
            "lift the bounds (strategy.set_micro_batch_limits(None)), or pass the padding as "
            "sample_weight with the default reduction instead of a mask.")
    total = step.sum_across([denominator])[0]
    return tf.math.divide_no_nan(denominator, total)


def _weighted(value, weight, to_mean_form: bool, num_replicas: int):
    """`value` (a loss, or per-sample values before their reduction) with its gradient weighted
    by `weight`; its value too (the sum form), times the replica count in the mean form."""
    if not isinstance(value, tf.Tensor) or not value.dtype.is_floating:
        return value
    weight = tf.cast(weight, value.dtype)
    weighted = weight * value
    if to_mean_form:
        weighted += tf.stop_gradient((num_replicas - 1.0) * weighted)
    return keras_losses.keep_keras_mask(weighted, value)


def _to_mean_form(step):
    """Whether the outermost seam hands its value over in the mean form: in a Keras model's
    custom step (its trackers average replicas), not in Keras's own steps or custom loops."""
    return step.model_step and not keras_callers.called_from_keras_own_step(max_depth=8)


@contextlib.contextmanager
def _seam(step):
    step.seam_depth += 1
    try:
        yield step.seam_depth == 1
    finally:
        step.seam_depth -= 1


# --------------------------------------------------------------------- the seams -------------
def adapt_compute_loss(model) -> None:
    """Weights `model.compute_loss` in our replica steps (instance attributes; idempotent).

    The loss terms inside it are weighted where they are computed: each compiled loss term
    (`adapt_loss`) and each additional loss (regularizers, `add_loss`: by samples). What a
    `compute_loss` override adds beyond them is weighted by samples; one whose seams did not
    run (raw ops only) is weighted as a whole, by the compiled losses' reduction.
    """
    if getattr(model, "_tf_hetbatch_compute_loss", None) is not None:
        return
    original = model.compute_loss
    own = keras_losses.is_keras_compute_loss(model)
    _adapt_additional_losses(model)
    tracker = keras_losses.total_loss_tracker(model)
    if tracker is not None:
        _adapt_total_loss_tracker(tracker)

    def compute_loss(*args, **kwargs):
        step = current_step()
        if step is None:
            return original(*args, **kwargs)
        parts, step.parts = step.parts, []
        terms = step.unrecorded_terms
        try:
            with _seam(step) as outermost:
                loss = original(*args, **kwargs)
            recorded, step.parts = step.parts, parts
        except BaseException:
            step.parts = parts
            raise
        if not outermost or not isinstance(loss, tf.Tensor) or not loss.dtype.is_floating:
            return loss
        if not recorded and step.unrecorded_terms == terms:  # raw ops: the whole loss
            mode = weighting_mode(model)
            if mode in _SCALED_BY_KERAS and step.num_replicas > 1:
                own_counts.warn_if_normalised_by_own_data(
                    loss, (args, kwargs), model, f"of {model.name}.compute_loss")
            step.seams_weighted += 1
            return _weighted(loss, term_weight(step, mode), _to_mean_form(step),
                             step.num_replicas)
        if recorded and not own and step.unrecorded_terms == terms:
            rest = loss - tf.add_n([tf.cast(p, loss.dtype) for p in recorded])
            loss += (term_weight(step, BATCH) - 1.0) * rest  # what an override added
        return _weighted(loss, 1.0, _to_mean_form(step), step.num_replicas)

    compute_loss.__doc__ = original.__doc__
    compute_loss.__wrapped__ = original
    model.compute_loss = compute_loss
    model._tf_hetbatch_compute_loss = original


def _adapt_additional_losses(model) -> None:
    """Weights each additional loss (`model.losses`: regularizers, `add_loss`) by the replica's
    share of the step's samples: a mean over the replica's samples becomes its share of the
    global mean, a constant its share of itself. A replica with no samples adds nothing."""
    original = getattr(model, keras_losses.ADDITIONAL_LOSS_METHOD, None)
    if original is None:
        return

    def aggregate(loss):
        value = original(loss)
        step = current_step()
        if step is None or step.seam_depth == 0 or not isinstance(value, tf.Tensor):
            return value
        share = tf.cast(step.share(BATCH), value.dtype)
        value = tf.where(share > 0, _weighted(value, term_weight(step, BATCH), False,
                                              step.num_replicas), tf.zeros_like(value))
        step.seams_weighted += 1
        if step.parts is not None:
            step.parts.append(value)
        return value

    setattr(model, keras_losses.ADDITIONAL_LOSS_METHOD, aggregate)


def _adapt_total_loss_tracker(tracker) -> None:
    """Keras's own steps update the loss tracker with the replica's loss weighted by its batch
    size; the seams hand them the sum form (the replicas' values sum to the global loss), so
    every replica counts B / K (the global batch over the replica count) instead."""
    original = tracker.update_state

    def update_state(values, sample_weight=None):
        step = current_step()
        if (step is None or step.total_samples is None
                or not keras_callers.called_from_keras_own_step(max_depth=2)):
            return original(values, sample_weight=sample_weight)
        weight = tf.cast(step.total_samples, tracker.dtype) / float(step.num_replicas)
        values = tf.cast(values, tracker.dtype)
        if step.micro_batched:  # the replica's micro-batches add up to its one update
            count = tf.cast(step.micro_batch_count, tracker.dtype)
            values, weight = values * count, weight / count
        return original(values, sample_weight=weight)

    update_state.__doc__ = original.__doc__
    tracker.update_state = update_state


def adapt_loss(loss_object) -> None:
    """Weights a `keras.losses.Loss` a step reaches, by its share of the term's denominator
    (idempotent).

    `Loss.__call__` calls `self.call` for the per-sample values and then reduces them; the
    weight is a per-replica scalar, so weighting the per-sample values is weighting the reduced
    loss (any reduction is linear in them). Keras then divides by K, reading the replica count:
    that read belongs to this seam (`pending_scale_reads`). A model's compiled loss is a
    container: its terms are weighted one by one, each by its own reduction and mask.
    """
    if getattr(loss_object, "_tf_hetbatch_call", None) is not None:
        return
    if keras_losses.is_compile_loss(loss_object):
        _adapt_compiled_loss(loss_object)
        return
    original = loss_object.call
    reduction = getattr(loss_object, "reduction", None)
    mode = _MODE_OF_REDUCTION.get(reduction, UNREDUCED)

    def call(*args, **kwargs):
        step = current_step()
        if step is None or mode == UNREDUCED or step.term_depth:
            return original(*args, **kwargs)
        in_mask, sample_weight = keras_losses.loss_call_inputs()
        step.term_depth += 1
        try:
            values = original(*args, **kwargs)
        finally:
            step.term_depth -= 1
        denominator = None
        if mode in _SCALED_BY_KERAS:
            step.pending_scale_reads += 1
            mask = keras_losses.loss_mask(in_mask, tf.nest.flatten(values)[0])
            if mask is not None:
                denominator = keras_losses.loss_denominator(
                    tf.nest.flatten(values)[0], sample_weight, mask, reduction)
            elif step.num_replicas > 1:
                own_counts.warn_if_normalised_by_own_data(
                    values, (args, kwargs), loss_object, repr(loss_object.name))
        weight = term_weight(step, mode, denominator)
        outermost = step.seam_depth == 0
        if not outermost and step.container_depth == 0:
            step.unrecorded_terms += 1
        step.seams_weighted += 1
        to_mean = outermost and _to_mean_form(step)
        return tf.nest.map_structure(
            lambda v: _weighted(v, weight, to_mean, step.num_replicas), values)

    call.__doc__ = original.__doc__
    loss_object.call = call
    loss_object._tf_hetbatch_call = original


def _adapt_compiled_loss(compile_loss) -> None:
    """The model's compiled loss: its terms weight themselves (`adapt_loss`), adapted once it
    is built (a call that builds it, where none of its terms weighted itself, is weighted as a
    whole); its total is recorded for `compute_loss`."""
    original = compile_loss.call

    def call(*args, **kwargs):
        step = current_step()
        if step is None:
            return original(*args, **kwargs)
        terms = keras_losses.compiled_loss_terms(compile_loss)
        for term in terms:
            adapt_loss(term)
        weighted_before = step.seams_weighted
        step.container_depth += 1
        try:
            with _seam(step) as outermost:
                total = original(*args, **kwargs)
        finally:
            step.container_depth -= 1
        if (not terms and step.seams_weighted == weighted_before
                and isinstance(total, tf.Tensor)):  # built by this call, no term weighted
            mode = _mode_of_losses(keras_losses.compiled_loss_terms(compile_loss))
            total = _weighted(total, term_weight(step, mode), False, step.num_replicas)
            step.seams_weighted += 1
        if step.parts is not None and isinstance(total, tf.Tensor):
            step.parts.append(total)
        if outermost and isinstance(total, tf.Tensor) and _to_mean_form(step):
            total = _weighted(total, 1.0, True, step.num_replicas)
        return total

    call.__doc__ = original.__doc__
    compile_loss.call = call
    compile_loss._tf_hetbatch_call = original


def adapt_metric(metric) -> None:
    """Records the tensors `metric.result()` returns in our replica steps, so the strategy can
    replace them by the metric's global value (idempotent)."""
    if getattr(metric, "_tf_hetbatch_result", None) is not None:
        return
    original = metric.result

    def result(*args, **kwargs):
        value = original(*args, **kwargs)
        step = current_step()
        if step is not None:
            for path, t in _paths(value):
                if isinstance(t, tf.Tensor):  # a container's entry stays its inner metric's
                    step.metric_results.setdefault(id(t), (t, metric, path))
        return value

    result.__doc__ = original.__doc__
    metric.result = result
    metric._tf_hetbatch_result = original
    if getattr(type(metric), "update_state", None) is keras.metrics.Mean.update_state:
        _count_micro_batches_as_one_update(metric)  # a plain Mean (not a metric wrapper)


def _count_micro_batches_as_one_update(metric) -> None:
    """A `Mean` updated with one scalar per call (a loss tracker), in a micro-batched step:
    each of the replica's n micro-batches adds its value with weight 1/n (as n * value, weight
    1/n), so the replica's micro-batches count as the one update it makes without them and
    the mean is what it is without micro-batches (`micro_batches`)."""
    original = metric.update_state

    def update_state(values, sample_weight=None):
        step = current_step()
        if (step is None or not step.micro_batched or sample_weight is not None
                or tf.convert_to_tensor(values).shape.rank != 0):
            return original(values, sample_weight=sample_weight)
        count = tf.cast(step.micro_batch_count, metric.dtype)
        return original(tf.cast(values, metric.dtype) * count, sample_weight=1.0 / count)

    update_state.__doc__ = original.__doc__
    metric.update_state = update_state


_said_average_loss = []


def _warn_average_loss_value():
    if _said_average_loss:
        return
    _said_average_loss.append(True)
    logging.getLogger(__name__).warning(
        "tf.nn.compute_average_loss without global_batch_size: the gradients are weighted "
        "exactly, but the loss it returns is each replica's mean divided by the replica count, "
        "so its sum over replicas is the mean of the replicas' means, not the global mean, "
        "when replicas get different batch sizes. Fix, for exact logged losses too: "
        "tf.nn.compute_average_loss(per_example_loss, global_batch_size=B).")


def _paths(value, prefix=()):
    if isinstance(value, dict):
        for key in value:
            yield from _paths(value[key], prefix + (key,))
    else:
        yield prefix, value


def check_replica_count_read(step: Optional[ReplicaStep]) -> None:
    """Called when our strategy's `num_replicas_in_sync` is read: refuses the loss scalings that
    divide by the replica count and cannot be weighted (see the module docs)."""
    if step is None or not step.in_user_code:
        return
    reader = keras_losses.replica_count_reader()
    if reader == keras_losses.TF_AVERAGE_LOSS:
        if step.sync_batch_norm or not step.optimizers_reached:
            why = ("the model has SyncBatchNormalization, whose backward all-reduce mixes the "
                   "replicas before the gradients could be weighted" if step.sync_batch_norm
                   else "the step applies its gradients with an optimizer the strategy does "
                   "not reach from the step function (its closure, the globals it names, its "
                   "model), so they cannot be weighted")
            raise ValueError(
                "`tf.nn.compute_average_loss` without `global_batch_size` divides each "
                "replica's loss by its own batch size times the replica count, which is wrong "
                f"when replicas get different batch sizes (a tf_hetbatch split), and here {why}."
                " Fix: pass the global batch size, tf.nn.compute_average_loss(per_example_loss,"
                " global_batch_size=B) (B: the dataset's batch size, sum(strategy.batch_sizes))."
            )
        step.average_loss_reads += 1
        _warn_average_loss_value()
        return
    if reader == keras_losses.TF_REGULARIZATION and step.micro_batched:
        raise ValueError(
            "`tf.nn.scale_regularization_loss` in a micro-batched step (the strategy has "
            "micro-batch limits, `set_micro_batch_limits`) adds the regularization once "
            "per micro-batch, so the update would not be one device's. Fix: compute the loss "
            "with `model.compute_loss` (it adds the model's regularization losses, weighted by "
            "each micro-batch's share), or lift the bounds "
            "(strategy.set_micro_batch_limits(None)).")
    if reader == keras_losses.KERAS_SCALE:
        if step.pending_scale_reads > 0 or step.seam_depth > 0:
            step.pending_scale_reads = max(step.pending_scale_reads - 1, 0)
            return
        raise ValueError(
            "A Keras loss was computed in a tf_hetbatch step by an object the strategy cannot "
            "see: Keras divides it by the replica count, which is exact only when every replica "
            "gets the same batch size, so training would silently differ from one device on "
            "the global batch. Fix: in a Model's train_step, compute the loss with "
            "`self.compute_loss(...)` or with a keras.losses.Loss held by the model (e.g. "
            "`self.loss_fn = keras.losses.MeanSquaredError()` in __init__ or compile); in a "
            "custom training loop, create the loss with reduction=\"none\" and reduce it with "
            "tf.nn.compute_average_loss(per_example_loss, global_batch_size=B)."
        )


# --------------------------------------------------------------------- a step's objects ------
def step_objects(fn) -> Tuple[List[Any], List[Any], List[Any], List[Any]]:
    """(models, optimizers, losses, metrics) a step function reaches.

    A Keras model's bound train/test step reaches its model; any other function the objects
    its closure holds and the globals its code names, and those of the functions found there
    (a few levels: what TensorFlow's custom-loop guide writes). From each model: its
    optimizer, its attributes (and the items of list, tuple and dict attributes: an optimizer
    a `compile()` override keeps, a loss object, a metric tracker) and its metrics. Objects a
    step reaches otherwise are not found: their losses are refused if they divide by the
    replica count (`check_replica_count_read`).
    """
    found = _reachable(fn)
    seen = {id(o) for o in found}
    models = [o for o in found if isinstance(o, keras.Model)]
    for model in models:
        for value in [getattr(model, "optimizer", None), *vars(model).values()]:
            for item in _items(value):
                if id(item) not in seen:
                    seen.add(id(item))
                    found.append(item)
    optimizers = [o for o in found if isinstance(o, keras.optimizers.Optimizer)]
    losses = [o for o in found if isinstance(o, keras.losses.Loss)]
    metrics = [o for o in found if isinstance(o, keras.metrics.Metric)]
    for model in models:
        metrics.extend(_leaf_metrics(getattr(model, "metrics", [])))
    return models, optimizers, losses, list({id(m): m for m in metrics}.values())


_SEARCH_DEPTH = 3  # functions through functions: a step, its loss helper, a lambda in it


def _reachable(fn, depth=_SEARCH_DEPTH, visited=None):
    visited = set() if visited is None else visited
    if id(fn) in visited or depth == 0:
        return []
    visited.add(id(fn))
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, keras.Model):
        return [owner]
    owned = [o for value in vars(owner).values() for o in _items(value)] \
        if hasattr(owner, "__dict__") else []  # a trainer object's method: its attributes
    fn = getattr(fn, "python_function", fn)  # a tf.function
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    values = [cell.cell_contents for cell in (fn.__closure__ or ()) if _filled(cell)]
    globals_ = getattr(fn, "__globals__", {})
    values += [globals_[name] for name in code.co_names if name in globals_]
    found = owned
    for value in values:
        found += _items(value)
        if callable(value) and hasattr(getattr(value, "python_function", value), "__code__"):
            found += _reachable(value, depth - 1, visited)
    return list({id(o): o for o in found}.values())


def _filled(cell):
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _items(value):
    if isinstance(value, (list, tuple)):
        return [v for v in value if _is_step_object(v)]
    if isinstance(value, dict):
        return [v for v in value.values() if _is_step_object(v)]
    return [value] if _is_step_object(value) else []


def _is_step_object(value):
    return isinstance(value, (keras.Model, keras.optimizers.Optimizer, keras.losses.Loss,
                              keras.metrics.Metric))


def _leaf_metrics(metrics):
    out = []
    for metric in metrics:
        inner = getattr(metric, "metrics", None)
        if isinstance(inner, (list, tuple)) and inner and all(
                isinstance(m, keras.metrics.Metric) for m in inner):
            out.extend(_leaf_metrics(inner))
        out.append(metric)
    return out
