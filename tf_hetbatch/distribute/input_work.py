"""Input work follows the split: each worker decodes and augments only its own samples.

Every worker reads the same sequence of global batches, so that every sample of an epoch is
trained once whatever the split (`tf_hetbatch.distribute.input_split`). What is shared is only the
pipeline up to the point where a global batch's samples are chosen; the work after that point,
done per sample, is moved after the split, so each worker does it for its own replicas'
samples only. The global batches stay exactly what they were (same samples, same order): only
where each sample's work runs changes.

Recognised automatically (`plan`):
- `source [.shuffle(n, seed)] .map(f, ...)* .batch(B) [.prefetch(p)]`, the idiomatic form
  (maps and shuffles in any order under the batch; `repeat`, `take` and `skip` of global
  batches may follow it): the maps run per replica slice, on that slice's samples. A shuffle
  moves samples by position whatever they hold, so shuffling the raw samples before the maps
  gives the same global batches (and holds raw, often smaller, samples in its buffer).
- Keras's array input, `fit(x, y, batch_size=B)`: batches of sample indices, then a gather;
  each worker gathers only its own replicas' indices.
- `... .batch(B).apply(tf_hetbatch.split_here()).map(g)*`: the explicit form for anything
  else: the maps after the marker act on each sample of a batch on its own (e.g. decoding or
  augmenting a batch with vectorised ops), so they run on each replica slice.

Anything else runs unsplit, as before; with several workers the chief logs one WARNING per
dataset that says why and how to write it so it splits. A worker that owns every replica (one
host) always runs it unsplit, and nothing is said (there is nothing to gain).

Random augmentation stays reproducible for a seeded pipeline, but its draws differ from the
unsplit pipeline's (each worker's maps see a different sequence of samples).

An unseeded shuffle directly under the split point would give each worker a different order
(samples trained twice or never): several workers give it one seed agreed by all of them
(`agreed_seed`), so each epoch still gets a new order, the same on every worker.
"""

import logging
from typing import Callable, Optional

import tensorflow as tf

from tf_hetbatch.distribute._upstream import tf_data

logger = logging.getLogger(__name__)

# Transformations of whole global batches after the split point: re-applied to the raw ones.
_KEPT_ON_TOP = ("prefetch", "options", "repeat", "take", "skip")
# Per-sample transformations right under the batch that the split can see through.
_UNDER_BATCH = ("map", "shuffle", "split_marker")


def split_here():
    """Marks where a tf_hetbatch strategy may split the global batches of a pipeline.

    For `Dataset.apply`, right after the `batch` by the global batch size, when what follows
    it works on each sample of a batch on its own: every worker then runs the maps after the
    marker only on its own replicas' samples. The marker itself adds no op: without a
    tf_hetbatch strategy, or on one host, the pipeline runs as written.

    Only maps (and `prefetch`) may follow the marker, and they must treat the rows of a batch
    independently (a per-sample decode or augmentation written with batched ops; not, e.g., a
    mixup across samples or a normalisation by the batch's statistics).

    Example:

    ```python
    ds = (tf.data.TFRecordDataset(files).shuffle(10_000, seed=0).batch(256)
          .apply(tf_hetbatch.split_here())
          .map(parse_and_augment_batch, num_parallel_calls=tf.data.AUTOTUNE))
    ```

    Returns:
        A function for `tf.data.Dataset.apply`.
    """
    return tf_data.mark_split


class InputPlan:
    """How one worker builds its per-replica batches from a user's pipeline.

    Attributes:
        raw: the dataset of global batches every worker produces identically (the user's
            pipeline when nothing is moved; its part before the split point otherwise).
        per_slice: None, or a function of ONE replica's slice of a raw global batch that
            returns a dataset of exactly one element: the finished slice.
        on_slice_stream: None, or a function applied to the dataset of ALL slices, in order
            (e.g. Keras's array gather, which zips the slices with the arrays).
        moved: the number of transformations moved after the split (0: runs unsplit).
        reason: why nothing is moved (empty when something is, or there is nothing to move).
        weights_in_raw: whether the raw global batches carry the finished structure, so a
            sample weight can be read from them (not when maps run after the split).
    """

    def __init__(self, raw, per_slice=None, on_slice_stream=None, moved=0, reason=""):
        self.raw = raw
        self.per_slice: Optional[Callable] = per_slice
        self.on_slice_stream: Optional[Callable] = on_slice_stream
        self.moved = moved
        self.reason = reason

    @property
    def weights_in_raw(self) -> bool:
        return self.moved == 0


def plan(dataset, owns_every_replica, seed=None, evaluation=False):
    """The `InputPlan` for one worker's copy of `dataset` (global batches).

    Args:
        dataset: the user's `tf.data.Dataset` of global batches.
        owns_every_replica: True on one host: nothing to move.
        seed: None, or an int all workers agree on, for an unseeded shuffle under the split.
        evaluation: evaluation data (no shuffle is reseeded: order does not change results).

    Never raises for a pipeline it cannot read: that pipeline runs unsplit.
    """
    pipeline = _Pipeline(dataset)
    gather = tf_data.keras_array_gather(pipeline.steps[pipeline.top])
    if gather is not None:  # Keras's array input: index batches, then a gather of each
        return _array_input_plan(pipeline, gather, owns_every_replica)
    after = pipeline.top
    while pipeline.steps[after].kind == "map":
        after += 1
    if pipeline.steps[after].kind == "split_marker":  # maps after it act on each sample
        return _marked_plan(pipeline, after, owns_every_replica)
    if after > pipeline.top:
        return InputPlan(dataset, reason=(
            f"{after - pipeline.top} map(s) run after batch() on whole global batches, and "
            "nothing says they act on each sample on its own. Fix: map per sample before "
            "batch(), or mark batch-level maps that are per sample with "
            ".apply(tf_hetbatch.split_here()) right after batch()"
        ))
    return _batch_plan(pipeline, owns_every_replica, seed, evaluation)


class _Pipeline:
    """A user's pipeline read as steps (`tf_data.pipeline_steps`): `top` is the first step
    under the transformations of whole global batches that stay on top (`_KEPT_ON_TOP`)."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.steps = tf_data.pipeline_steps(dataset)
        self.top = 0
        while self.steps[self.top].kind in _KEPT_ON_TOP:
            self.top += 1

    def rebuilt(self, raw):
        """`raw` with the top transformations the user put after the split point."""
        for step in reversed(self.steps[:self.top]):
            if step.kind == "prefetch":
                raw = raw.prefetch(step.buffer_size)
            elif step.kind in ("repeat", "take", "skip"):
                raw = getattr(raw, step.kind)(step.count)
        return raw.with_options(self.dataset.options())


def _array_input_plan(pipeline, gather, owns_every_replica):
    """Keras's array input: each worker gathers only its own replicas' indices."""
    if owns_every_replica:
        return InputPlan(pipeline.dataset)
    indices, arrays = gather
    step = pipeline.steps[pipeline.top]

    def on_slice_stream(slices):
        return tf_data.replay_map(tf.data.Dataset.zip((slices, arrays)), step)

    return InputPlan(pipeline.rebuilt(indices), on_slice_stream=on_slice_stream, moved=1)


def _marked_plan(pipeline, marker, owns_every_replica):
    """`.batch(B).apply(split_here()).map(g)*`: the maps run on each replica slice."""
    maps = pipeline.steps[pipeline.top:marker]
    if owns_every_replica or not maps:
        return InputPlan(pipeline.dataset)

    def on_slice_stream(slices):
        for step in reversed(maps):
            slices = tf_data.replay_map(slices, step)
        return slices

    return InputPlan(pipeline.rebuilt(pipeline.steps[marker].input),
                     on_slice_stream=on_slice_stream, moved=len(maps))


def _batch_plan(pipeline, owns_every_replica, seed, evaluation):
    """The idiomatic form: per-sample maps (and shuffles) right under `batch(B)`."""
    steps, top, dataset = pipeline.steps, pipeline.top, pipeline.dataset
    batch = steps[top]
    if batch.kind != "batch":
        return InputPlan(dataset, reason=(
            f"its outermost transformation is {batch.name}, not batch(global_batch_size). Fix: "
            "end the pipeline with .batch(B) (then .prefetch), or mark the split point with "
            ".apply(tf_hetbatch.split_here())"
        ))
    # Under the batch: per-sample maps and shuffles (maps commute with a shuffle: it moves
    # samples by position, whatever they hold), and maybe the marker.
    below = top + 1
    while steps[below].kind in _UNDER_BATCH:
        below += 1
    under = steps[top + 1:below]  # outermost first
    maps = [step for step in under if step.kind == "map"]
    reseed = (seed is not None and not evaluation
              and any(step.kind == "shuffle" and not step.seeded for step in under))
    empty = _empty_batch(batch.dataset.element_spec)
    reason = "" if owns_every_replica else _why_not_moved(steps, batch, below, under, maps,
                                                          empty)
    move = bool(maps) and not owns_every_replica and not reason
    if not move and not reseed:
        return InputPlan(dataset, reason=reason)
    source = steps[below - 1].input if under else batch.input
    for step in reversed(under):  # innermost first, as the user built it
        if step.kind == "shuffle":
            agreed = seed if reseed and not step.seeded else None
            source = tf_data.replay_shuffle(step, source, agreed)
        elif step.kind == "map" and not move:
            source = tf_data.replay_map(source, step)
    if reseed:
        logger.debug("unseeded shuffle given the workers' agreed seed %d", seed)
    raw = pipeline.rebuilt(source.batch(batch.batch_size, drop_remainder=batch.drop_remainder))
    if not move:
        return InputPlan(raw, reason=reason)

    def per_slice(raw_slice):
        samples = tf.data.Dataset.from_tensor_slices(raw_slice)
        for step in reversed(maps):  # innermost first
            samples = tf_data.replay_map(samples, step)
        n = tf.shape(tf.nest.flatten(raw_slice)[0], out_type=tf.int64)[0]
        # One batch of all n samples; for n == 0 the batch() gives nothing and the empty
        # batch stands in.
        batched = samples.batch(tf.maximum(n, 1))
        return batched.concatenate(tf.data.Dataset.from_tensors(empty)).take(1)

    return InputPlan(raw, per_slice=per_slice, moved=len(maps))


def _why_not_moved(steps, batch, below, under, maps, empty):
    """Why the per-sample maps under the batch cannot run after the split ("" if they can)."""
    if not maps:
        between = tf_data.first_map_below(steps[below - 1].input if under else batch.input)
        if between is not None:
            return (f"its per-sample maps are not right under batch(): {between} stands "
                    "between them. Fix: put the per-sample maps right before batch(), or mark "
                    "the split point with .apply(tf_hetbatch.split_here())")
    elif empty is None:
        return ("the per-sample maps' outputs have no static shape, so an empty replica slice "
                f"cannot be built (element_spec={batch.dataset.element_spec}). Fix: give them "
                "static shapes, e.g. with tf.ensure_shape in the last map")
    return ""


def has_unseeded_shuffle(dataset) -> bool:
    """Whether `plan` would reseed a shuffle of `dataset` (workers must then agree a seed)."""
    steps = tf_data.pipeline_steps(dataset)
    index = 0
    while steps[index].kind in _KEPT_ON_TOP:
        index += 1
    if steps[index].kind != "batch":
        return False
    index += 1
    while steps[index].kind in _UNDER_BATCH:
        if steps[index].kind == "shuffle" and not steps[index].seeded:
            return True
        index += 1
    return False


def _empty_batch(element_spec):
    """A batch of 0 samples with `element_spec` (leading batch dimension), or None if a
    component is not a tensor of static non-batch shape."""
    specs = tf.nest.flatten(element_spec)
    empties = []
    for spec in specs:
        if not isinstance(spec, tf.TensorSpec) or spec.shape.rank is None or spec.shape.rank < 1:
            return None
        rest = spec.shape[1:]
        if not rest.is_fully_defined():
            return None
        empties.append(tf.reshape(tf.constant([], dtype=spec.dtype), [0, *rest.as_list()]))
    return tf.nest.pack_sequence_as(element_spec, empties)
