"""What a synchronous tf_hetbatch strategy does around each `strategy.run`.

Keras's `fit`/`evaluate` and custom training loops call `strategy.run(step_fn, args)`; the
strategy runs the step as the stock one does, and adds, per replica:
- the loss weights (`weighting`): the step's optimizers, loss objects, metrics and models
  (`weighting.step_objects`) are adapted once, and each replica's share of the global batch
  comes from the actual batches of the step;
- the replica's compute time (`timing`), from its inputs (or its release by the previous
  all-reduce) to its local gradients; none in a step XLA compiles (`jit_compile=True`);
- the step's logs as true global means: every log that is a metric's `result()` is replaced
  by the metric's global value, from all replicas' metric variables summed in one all-reduce
  (Keras's own train step: in the gradients' all-reduce, `updates.finish_step`). The stock
  strategy averages the replicas' local means, which is biased under uneven batches.
A step that applies gradients counts as a trained step (the split's bookkeeping keys switches
and resuming by it), so a custom loop should run one such step per global batch.
"""

import dataclasses
import weakref
from typing import Any, Callable, Dict, Tuple

import keras
import tensorflow as tf

from tf_hetbatch.distribute import input_split
from tf_hetbatch.distribute import micro_batches
from tf_hetbatch.distribute import timing
from tf_hetbatch.distribute import updates
from tf_hetbatch.distribute import weighting
from tf_hetbatch.distribute._upstream import autograph, keras_callers, keras_trainer, metrics


class StepRunner:
    """Runs steps for one strategy (it calls back `strategy._step_totals` and the stock run)."""

    def __init__(self, strategy):
        self._strategy = strategy
        # model -> {path of a log in the step's outputs: (metric, path in its result)}, from
        # the last trace of its step: the multi-step loop makes the last step's logs global
        # after the loop (`global_logs`), where the traced tensors are gone.
        self._log_paths = weakref.WeakKeyDictionary()
        self._function_clones = autograph.function_clones()  # tf.functions handed to `run`

    def run(self, fn, args, kwargs, options, stock_run):
        strategy = self._strategy
        in_function = autograph.function_around_run(strategy, fn, options,
                                                    self._function_clones)
        if in_function is not None:  # a tf.function: run inside a clone of it, as stock does
            return in_function(*args, **(kwargs or {}))
        model, kind = keras_callers.keras_model_of_step(fn)
        if model is not None:
            keras_trainer.check_steps_per_execution(model)
        models, optimizers, losses, metrics = weighting.step_objects(fn)
        updates.adapt_step_objects(models, optimizers, losses, metrics)
        data = _step_data(args)
        distributed = data is not None and _is_split_batch(strategy, data)
        training_step = kind == "train_step"
        check_nonempty = training_step and _has_batch_norm(model, synchronized=False)
        if check_nonempty:
            strategy._note_local_batch_norm()
        totals = strategy._step_totals(data, kind) if distributed else None
        timed = timing.stamps_possible()  # not in a step XLA compiles (`timing`)
        if not timed and (training_step or (kind is None and optimizers)):
            strategy._note_untimed_step()  # (evaluation is timed by no one)
        carry_logs = training_step and keras_trainer.is_keras_own_train_step(fn)
        sync_batch_norm = any(_has_batch_norm(m, synchronized=True) for m in models)
        steps, logs_global = [], []
        plan = None
        if distributed and strategy._micro_batches.in_use and (
                training_step or (kind is None and optimizers)):
            plan = micro_batches.plan_step(strategy, args, kwargs, sync_batch_norm)

        user_fn = autograph.like_stock_run(fn)  # ours below run as they are (`autograph`)

        def replica_fn(*replica_args, **replica_kwargs):
            replica_args, start_time, samples = _start_stamp(replica_args, check_nonempty, timed)
            data_here = _step_data(replica_args)
            shares_of, total_samples = _shares_of(totals, data_here) if distributed \
                else (None, None)
            step = weighting.ReplicaStep(
                num_replicas=strategy.num_replicas_in_sync,
                shares=shares_of(data_here) if distributed else None,
                model_step=model is not None, total_samples=total_samples,
                sum_across=updates.sum_across_replicas,
                has_sample_weight=has_sample_weight(data_here),
                start_time=start_time, samples=samples,
                timing=strategy._timing if timed else None,
                noise=strategy._noise if distributed and samples is not None else None,
                carry_logs=carry_logs, optimizers_reached=bool(optimizers),
                sync_batch_norm=sync_batch_norm,
                failure_flags=None if plan is None else strategy._micro_batches.flags_of_step(
                    carry_logs, model),
                update_gate=None if plan is None else plan.gate,
            )
            steps.append(step)
            with weighting.replica_step(step):
                if plan is not None:
                    outputs = micro_batches.run(step, user_fn, replica_args, replica_kwargs,
                                                dataclasses.replace(plan, shares_of=shares_of,
                                                                    data_of=_step_data))
                else:
                    with weighting.user_code(step):
                        outputs = user_fn(*replica_args, **replica_kwargs)
                if carry_logs:
                    outputs, is_global = updates.finish_step(step, model, outputs)
                    logs_global.append(is_global)
            return outputs

        outputs = stock_run(autograph.as_is(replica_fn), args=args, kwargs=kwargs,
                            options=options)
        if any(step.gradients_applied for step in steps):
            with tf.control_dependencies(_local_tensors(strategy, outputs)):
                strategy._allocation.count_trained_step()
        if logs_global and all(logs_global):  # the same global values on every replica
            return tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0] if _is_distributed(v)
                else v, outputs)
        paths = _log_paths(strategy, outputs, steps)
        if model is not None:
            self._log_paths[model] = paths
        if paths:
            # Within a multi-step loop only the last step's logs are read: they are made global
            # once, after the loop (`keras_trainer.deferred_global_logs`).
            outputs = _logs(strategy, outputs, paths, reduce=not keras_trainer.defer_global_logs())
        if model is None and distributed and not any(step.seams_weighted for step in steps):
            _mark_replica_values(strategy, outputs)
        return outputs

    def global_logs(self, model, outputs):
        """Cross-replica context: `outputs` of `model`'s step with every metric result made its
        global value (see the module docs); other entries as they are."""
        paths = self._log_paths.get(model)
        if not paths or not isinstance(outputs, dict):
            return outputs
        return _logs(self._strategy, outputs, paths, reduce=True)


class UnweightedValues:
    """A custom step's per-replica float outputs that nothing weighted (no Keras loss reached,
    no metric result): what each replica computed over its own samples. Averaged over the
    replicas with equal weights (`strategy.reduce("MEAN", v, axis=None)`) they are not the
    global mean under an uneven split, and the strategy says so (`HeteroMixin.reduce`).

    Held by identity, weakly, in the strategy's own registry: asking a value whether it is one
    must not look up an attribute on it, since a distributed variable's fallback `__getattr__`
    reads it across replicas, through `strategy.reduce` again (endless recursion for a MEAN
    sync-on-read variable).
    """

    def __init__(self):
        self._values = weakref.WeakValueDictionary()  # id(value) -> value

    def add(self, value):
        self._values[id(value)] = value

    def __contains__(self, value):
        return self._values.get(id(value)) is value


def _mark_replica_values(strategy, outputs):
    for leaf in tf.nest.flatten(outputs):
        if _is_distributed(leaf) and all(
                isinstance(t, tf.Tensor) and t.dtype.is_floating
                for t in strategy.experimental_local_results(leaf)):
            strategy._unweighted_values.add(leaf)


def _step_data(args):
    """The data of a step: Keras passes one argument, a custom loop any number."""
    if not args:
        return None
    return args[0] if len(args) == 1 else tuple(args)


def _shares_of(totals, data) -> Tuple[Callable[[Any], Dict[str, tf.Tensor]], tf.Tensor]:
    """Replica context: (a function from data of this replica's step (its whole batch, or a
    micro-batch of it) to that data's share of the step's samples and of its sample weight,
    the step's global samples). `totals` is a pair of tensors or a function of the replica's
    `amounts(data)` (called once here: it may all-reduce)."""
    total_samples, total_weight = totals(*amounts(data)) if callable(totals) else totals

    def shares(part):
        samples, weight = amounts(part)
        return {
            weighting.BATCH: tf.math.divide_no_nan(samples, total_samples),
            weighting.SAMPLE_WEIGHT: tf.math.divide_no_nan(weight, total_weight),
        }
    return shares, total_samples


def amounts(data) -> Tuple[tf.Tensor, tf.Tensor]:
    """A replica's samples and summed sample weight (its samples where it has none)."""
    _, _, sample_weight = _unpack(data)
    samples = tf.cast(samples_of(data), tf.float32)
    if sample_weight is None:
        return samples, samples
    return samples, tf.add_n(
        [tf.reduce_sum(tf.cast(w, tf.float32)) for w in tf.nest.flatten(sample_weight)])


def samples_of(data) -> tf.Tensor:
    """A replica's number of samples (int64 scalar): the batch dimension of its inputs x, or
    where x has none (a custom loop's `run(fn, args=(learning_rate, batch))`) of the first of
    its arguments that has one. Arguments without a batch dimension (rank 0) carry no samples:
    0 when no argument has one."""
    x = _unpack(data)[0]
    return input_split.samples_of(x if input_split.batched_components(x) else data)


def _unpack(data):
    if isinstance(data, tuple) and len(data) in (2, 3):
        return keras.utils.unpack_x_y_sample_weight(data)
    return data, None, None


def has_sample_weight(data) -> bool:
    return data is not None and _unpack(data)[2] is not None


def _is_distributed(value):
    return isinstance(value, tf.distribute.DistributedValues)


def _is_split_batch(strategy, data):
    """Whether a step's `data` is a batch split over the replicas, weighted by its samples:
    per-replica values with a batch dimension, and no undistributed ones with one. Arguments
    without a batch dimension (rank 0: a learning rate, a per-replica scalar) carry no samples
    and decide nothing; with nothing else, the step runs as the stock one's."""
    flat = [t for t in tf.nest.flatten(data) if t is not None]
    batched = [t for t in flat if input_split.batched_components(
        strategy.experimental_local_results(t)[0] if _is_distributed(t) else t)]
    return bool(batched) and all(_is_distributed(t) for t in batched)


def _local_tensors(strategy, outputs):
    return [t for t in tf.nest.flatten(strategy.experimental_local_results(outputs))
            if isinstance(t, tf.Tensor)]


def _log_paths(strategy, outputs, steps):
    """{path in `outputs`: (metric, path in its result)} for every log that is a metric's
    result() (recorded by `weighting.adapt_metric` on every replica)."""
    if not isinstance(outputs, dict):
        return {}
    recorded = {}
    for step in steps:
        recorded.update(step.metric_results)
    paths = {}
    for path, value in _flatten_with_paths(outputs):
        locals_ = strategy.experimental_local_results(value) if _is_distributed(value) \
            else (value,)
        for t in locals_:
            hit = recorded.get(id(t))
            if hit is not None and hit[0] is t:
                paths[path] = hit[1:]  # (metric, path in its result)
                break
    return paths


def _flatten_with_paths(structure, prefix=()):
    if isinstance(structure, dict):
        for key in structure:
            yield from _flatten_with_paths(structure[key], prefix + (key,))
    elif isinstance(structure, (list, tuple)) and not _is_distributed(structure):
        for i, item in enumerate(structure):
            yield from _flatten_with_paths(item, prefix + (i,))
    else:
        yield prefix, structure


def _logs(strategy, outputs, paths, reduce):
    """`outputs` with the logs at `paths` replaced by their metrics' global values (with
    `reduce=False`: the first local replica's, at no communication; see the multi-step loop)."""
    logged = list({id(m): m for m, _ in paths.values()}.values())
    with tf.control_dependencies(_local_tensors(strategy, outputs)):
        results = metrics.metric_results_of(strategy, logged, reduce=reduce)
    if results is None:
        return outputs  # a metric variable that cannot be summed: Keras reduces the logs
    merged = _copy(outputs)
    for path, (metric, result_path) in paths.items():
        value = results[id(metric)]
        for key in result_path:
            value = value[key]
        _set(merged, path, tf.convert_to_tensor(value))
    return merged


def _copy(structure):
    if isinstance(structure, dict):
        return {k: _copy(v) for k, v in structure.items()}
    if isinstance(structure, list):
        return [_copy(v) for v in structure]
    return structure


def _set(structure, path, value):
    for key in path[:-1]:
        structure = structure[key]
    if isinstance(structure, tuple):  # pragma: no cover - logs are dicts of tensors
        return
    structure[path[-1]] = value


# --------------------------------------------------------------------- the replica's start ---
_EMPTY_REPLICA_FIX = (
    "Fix: use keras.layers.BatchNormalization(synchronized=True), give every replica at least "
    "1 sample, or batch with drop_remainder=True so no short last batch leaves a replica empty."
)


def check_nonempty_sizes(sizes):
    if min(sizes) < 1:
        raise ValueError(
            "Every replica needs at least 1 sample: the model has plain BatchNormalization "
            "layers, whose batch statistics are NaN on an empty batch. Received: "
            f"batch_sizes={list(sizes)}. " + _EMPTY_REPLICA_FIX
        )


def _has_batch_norm(model, synchronized):
    """Whether `model` has BatchNormalization layers, synchronized ones or plain ones."""
    return model is not None and any(
        isinstance(layer, keras.layers.BatchNormalization)
        and bool(getattr(layer, "synchronized", False)) == synchronized
        for layer in keras_callers.all_layers(model)
    )


def _start_stamp(replica_args, check_nonempty, timed=True):
    """Replica context: (args, the time this replica's inputs are there, its number of samples).
    Without `timed` (a step XLA compiles, `timing`) the time is None: no stamp is taken.

    The stamp depends on the inputs only and nothing depends on it but the timing record, so it
    adds no barrier to the step: gating the replica's work on the stamp, or on all replicas'
    inputs, cost several percent of a small model's step on 2 cores (and 35-50% of a step of
    3 logical CPU replicas with while loops on 2 cores). Nor does it wait for another replica's
    stamps (`timing.now`: `tf.function` would chain them in program order, and every replica
    but the first would read a fraction of its time).
    Only with plain BatchNormalization (`check_nonempty`) are the returned args gated, on a
    check that the batch is not empty: the step then fails with a clear message before any of
    its work runs.
    """
    tensors = [
        t for t in tf.nest.flatten(replica_args, expand_composites=True) if isinstance(t, tf.Tensor)
    ]
    stamp = timing.now_after if timed else (lambda tensors: None)
    if not tensors:
        return replica_args, stamp([]), tf.constant(0, tf.int64)
    samples = samples_of(_step_data(replica_args))
    if check_nonempty:
        check = tf.debugging.assert_positive(
            samples,
            message=(
                "A replica got an empty batch, and the model has plain "
                "BatchNormalization layers, whose statistics are NaN on an empty batch. "
                + _EMPTY_REPLICA_FIX
            ),
        )
        with tf.control_dependencies([check]):
            replica_args = tf.nest.map_structure(
                lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t,
                replica_args,
                expand_composites=True,
            )
    return replica_args, stamp(tensors), samples
