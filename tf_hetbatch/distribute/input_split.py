"""Splitting each global batch of a tf.data pipeline into uneven per-replica batches.

The pipeline yields global batches of B samples, as for every `tf.distribute` strategy. Each
global batch gets the split in force when it is produced (see `Allocation`; several workers
key it to the training step instead) and is emitted as K consecutive slices, in replica order;
`distribute_datasets_from_function` hands element i to replica i % K, so replica k gets slice k.
A split installed now applies to the global batches produced after it, i.e. a few steps later
(the distributed iterator prefetches), or from an agreed step in multi-worker training.

A batch of n samples is split by `split_sizes`: exactly the sizes when n == sum(sizes),
otherwise in proportion to them (each replica gets its share rounded down or up; the shares
sum to n), and evenly (the first n % K replicas one sample more) while no sizes are set.

TRAINING data: n < sum(sizes) is right for the partial last batch of an epoch and only for it:
a batch after a short one is an error, and so is n > sum(sizes) (naming both numbers).

EVALUATION data (Keras `evaluate`, `predict`, `fit`'s validation) may have any batch size, as
under the stock strategy, with no error. Its results are sums over samples, so the split does
not change them. Evaluation passes leave the training bookkeeping alone: they do not consume
the batches to skip on resuming and (several workers) count and record nothing.

Every global batch gives every replica a slice, possibly empty, so all replicas' data ends at
the same step.
"""

import itertools

import tensorflow as tf

from tf_hetbatch.distribute._upstream import tf_data



# The functions below run once per global batch inside the input pipeline: straight-line ops
# only (no tf.cond: its branches are function calls, and the pipeline's maps run inline, see
# `tf_data.map_inline`), and as few as possible: each op costs ~1-2 us there, on the CPU the
# replicas compute with (see BUILD_NOTES, "Overhead").
def split_sizes(n, bounds, num_replicas):
    """In-graph per-replica sizes (int64 [K]) of a global batch of `n` samples.

    Args:
        n: int64 scalar, the batch's number of samples.
        bounds: int64 [K + 1], the split's running sums [0, b_0, b_0 + b_1, ..., B]
            (`bounds_of`), or all zeros while no split is set.
        num_replicas: K.

    Replica k gets the samples from ceil(n * bounds[k] / B) to ceil(n * bounds[k+1] / B):
    exactly b_k when n == B, otherwise its share n * b_k / B rounded down or up, the shares
    summing to n. With no split set, evenly: the first n % K replicas get one sample more.
    """
    total = bounds[-1]
    k = tf.range(num_replicas + 1, dtype=tf.int64)
    quotient = n // num_replicas
    even = k * quotient + tf.minimum(k, n - quotient * num_replicas)
    divisor = tf.maximum(total, 1)
    proportional = (n * bounds + (divisor - 1)) // divisor
    ends = tf.where(total > 0, proportional, even)
    return ends[1:] - ends[:-1]


def bounds_of(sizes):
    """The running sums [0, b_0, b_0 + b_1, ..., B] of a split, as the pipeline reads it."""
    return [0, *itertools.accumulate(int(size) for size in sizes)]


def batch_dim(element):
    """The leading dimension (int64 scalar) shared by every component of a global batch."""
    flat = batched_components(element)
    if not flat:
        raise ValueError(
            "Dataset elements must contain at least one tensor with a batch dimension. "
            "Received an element with none (only scalars or no tensors)."
        )
    return tf.shape(flat[0], out_type=tf.int64)[0]


def batched_components(element):
    """The components of `element` that have a batch dimension: all but those of rank 0 (a
    scalar, e.g. a learning rate passed to `strategy.run`, carries no samples) and non-tensor
    leaves without a shape (Python numbers, strings). A component of unknown rank counts."""
    return [t for t in tf.nest.flatten(element)
            if t is not None and _rank(getattr(t, "shape", None)) != 0]


def _rank(shape):
    if shape is None:
        return 0
    return tf.TensorShape(shape).rank


def samples_of(element):
    """The number of samples (int64 scalar) of `element`: the batch dimension of its first
    component that has one (`batched_components`), 0 when none has."""
    flat = batched_components(element)
    if not flat:
        return tf.constant(0, tf.int64)
    return tf.shape(flat[0], out_type=tf.int64)[0]


class Allocation:
    """Host variables that tell the input pipeline how to split each global batch.

    A split is stored as its running sums (`bounds_of`); all zeros mean none is set (even
    split). Two ways of switching:
    - one host (`keyed_by_step=False`): one split in force; each global batch uses the one in
      force when the pipeline produces it, so a split installed now applies to every batch
      produced after the call;
    - several workers (`keyed_by_step=True`): each global batch gets a key, the training step
      it will be trained in (the steps trained when its iterator produced its first batch,
      plus its position in that iterator), and uses the split installed with the largest
      start <= key (latest installed on a tie); a small ring of slots keeps switches that are
      not reached yet. Every worker computes the same keys whatever its prefetch timing, so
      the same (start, sizes) installed on every worker, with a start no worker has produced
      yet, switches all of them at the same global step.
    """

    SLOTS = 8
    NEVER = 2**62
    TOTALS = 64  # > any prefetch depth (the default switch margin assumes < 8 batches ahead)

    def __init__(self, num_replicas, device="/cpu:0", keyed_by_step=False):
        self.num_replicas = num_replicas
        self.keyed_by_step = keyed_by_step
        with tf.init_scope(), tf.device(device):

            def variable(value, name):
                return tf.Variable(value, trainable=False, name=name)

            zeros = tf.zeros([num_replicas + 1], tf.int64)
            if keyed_by_step:
                self.starts = variable(
                    tf.constant([0] + [self.NEVER] * (self.SLOTS - 1), tf.int64),
                    "hetbatch_split_starts",
                )
                self.bounds = variable(
                    tf.tile(zeros[tf.newaxis], [self.SLOTS, 1]), "hetbatch_split_bounds"
                )
                # Install order: among slots with the same start, the latest installed wins.
                self.sequence = variable(
                    tf.zeros([self.SLOTS], tf.int64), "hetbatch_split_sequence"
                )
                self.produced = variable(tf.constant(0, tf.int64), "hetbatch_batches_produced")
                self.last_key = variable(tf.constant(-1, tf.int64), "hetbatch_last_key")
                # Row key % TOTALS: (samples, summed sample weight) of the global batch keyed
                # for that training step, so each step's weights need no collective.
                self.totals = variable(
                    tf.zeros([self.TOTALS, 2], tf.float32), "hetbatch_step_totals"
                )
                # Row key % TOTALS: a fingerprint of that step's global batch; `fingerprint`
                # sums those of the steps trained, so workers can check that they trained the
                # same global batches (`batch_fingerprint`).
                self.fingerprints = variable(
                    tf.zeros([self.TOTALS], tf.int64), "hetbatch_batch_fingerprints"
                )
                self.fingerprint = variable(tf.constant(0, tf.int64), "hetbatch_fingerprint")
            else:
                self.bounds = variable(zeros, "hetbatch_split_bounds")
            self.trained = variable(tf.constant(0, tf.int64), "hetbatch_steps_trained")
            # Global batches the next iterator drops first (resuming mid-epoch); each
            # iterator reads it at its first batch, and every train step clears it.
            self.skip = variable(tf.constant(0, tf.int64), "hetbatch_skip_batches")
            # Whether the current iterator has produced a short batch (one that must be last).
            self.short_seen = variable(tf.constant(False), "hetbatch_short_batch_seen")
        # The value of `trained` before this process trained a step (0, or as `resume_at` set
        # it): a larger value proves every worker trained a step, so produced a batch.
        self.first_step = 0
        self._next_slot = 1
        self._installed = 0

    def install(self, sizes, start=None):
        """Makes global batches use `sizes` (eager, from Python): on one host every batch
        produced from now on; on several workers those with key >= `start`."""
        bounds = tf.constant(bounds_of(sizes), tf.int64)
        if not self.keyed_by_step:
            self.bounds.assign(bounds)  # one write: a batch sees the old split or the new one
            return
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.SLOTS
        self._installed += 1
        self.bounds[slot].assign(bounds)
        self.sequence[slot].assign(self._installed)
        # Written after the bounds: a pipeline that sees the new start sees the new split.
        self.starts[slot].assign(tf.constant(start, tf.int64))

    def step_totals(self):
        """In-graph, several workers: (samples, summed sample weight) of the global batch
        trained at the current step (read it after the step's inputs are there)."""
        return self.totals.read_value()[self.trained.read_value() % self.TOTALS]

    def step_variables(self):
        """What `count_trained_step` changes: a step that is run again restores them."""
        counted = [self.trained, self.skip]
        return counted + [self.fingerprint] if self.keyed_by_step else counted

    def count_trained_step(self):
        """In the train step (cross-replica context): one more step trained, skip cleared
        (several workers: its global batch's fingerprint added to the trained ones')."""
        if not self.keyed_by_step:
            return tf.group(self.trained.assign_add(1), self.skip.assign(0))
        row = self.fingerprints.read_value()[self.trained.read_value() % self.TOTALS]
        added = self.fingerprint.assign_add(row)
        with tf.control_dependencies([added]):
            return tf.group(self.trained.assign_add(1), self.skip.assign(0))

    def _bounds_for_key(self, key):
        """In-graph, several workers: the bounds in force for the global batch with this key."""
        starts = self.starts.read_value()
        valid = starts <= key
        latest_start = tf.reduce_max(tf.where(valid, starts, -1))
        candidates = tf.logical_and(valid, tf.equal(starts, latest_start))
        slot = tf.argmax(tf.where(candidates, self.sequence.read_value(), -1))
        return tf.gather(self.bounds.read_value(), slot)

    def annotate(self, dataset, emit, weights_in_raw=True):
        """One pass over the global batches: skip, look up the split, check.

        Each element becomes `emit(element, sizes)`:
        - the first `skip` batches of each iterator (read when it starts) give no element
          (resuming mid-epoch); they are checked as the others are;
        - every other batch gets its per-replica sizes: the split in force for it (see the
          class) applied to its actual number of samples (`split_sizes`);
        - a batch with more samples than the split sums to is an error, and so is one after a
          short batch (fewer samples than the split sums to, which must be the last of the
          data): the data is batched by another size than sum(batch_sizes).

        The user's dataset is an input of the pass, not built inside a per-iterator function:
        its iterator is made when ours is, as under the stock strategy. A seeded
        `shuffle(..., reshuffle_each_iteration=True)` draws its order for each new iterator
        from one stream, and Keras makes an iterator at each epoch's end that the next epoch
        discards; made lazily, at the first batch, ours skipped that draw and trained every
        epoch after the first in another order than the stock strategy.

        `weights_in_raw=False`: the batches are not yet Keras's (x, y, sample_weight), so
        their summed sample weight is unknown here (recorded as NaN).
        """
        num_replicas = self.num_replicas

        def annotate_batch(started, numbered):
            to_skip, base = started
            raw_position, element = numbered
            position = raw_position - to_skip
            kept = position >= 0
            deps = []
            n = batch_dim(element)
            if self.keyed_by_step:
                key = base + position
                bounds = self._bounds_for_key(key)
                row = key % self.TOTALS
                amounts = _step_amounts(element, n, weights_in_raw)
                fingerprint = batch_fingerprint(element)
                # A skipped batch writes nothing (its key is a step trained before).
                deps += [
                    # The newest key produced by the most recent iterator (a validation pass
                    # numbers its batches from the same step as the next epoch, but is over
                    # by then); the count tells whether any batch was produced yet.
                    self.last_key.assign(tf.where(
                        kept,
                        tf.where(position == 0, key, tf.maximum(self.last_key.read_value(), key)),
                        self.last_key.read_value(),
                    )),
                    self.produced.assign_add(tf.cast(kept, tf.int64)),
                    self.totals.scatter_nd_update(
                        [[row]], [tf.where(kept, amounts, self.totals.read_value()[row])]
                    ),
                    self.fingerprints.scatter_nd_update(
                        [[row]], [tf.where(kept, fingerprint, self.fingerprints.read_value()[row])]
                    ),
                ]
            else:
                bounds = self.bounds.read_value()
            total = bounds[-1]
            too_large = _assert(
                tf.logical_or(n <= total, tf.equal(total, 0)),
                "A global batch has more samples than `batch_sizes` sum to. Fix: batch the "
                "dataset with the global batch size sum(batch_sizes), or call "
                "set_batch_sizes() with sizes that sum to the dataset's batch size. "
                "[batch samples, sum(batch_sizes)]",
                [n, total],
            )
            after_short = _assert(
                tf.logical_not(self.short_seen.read_value()),
                "A global batch followed a short one: the dataset's batches do not have "
                "sum(batch_sizes) samples. Fix: batch the dataset with the global batch "
                "size sum(batch_sizes), or call set_batch_sizes() with sizes that sum to "
                "the dataset's batch size. [this batch's samples, sum(batch_sizes)]",
                [n, total],
            )
            with tf.control_dependencies([too_large, after_short]):
                deps.append(self.short_seen.assign(n < total))
            sizes = split_sizes(n, bounds, num_replicas)
            with tf.control_dependencies(deps):
                slices = emit(element, tf.identity(sizes))
            return slices.take(-tf.cast(kept, tf.int64))  # -1: all of them; 0: none

        def start(_):
            # Runs once when an iterator starts: clears the short-batch mark, reads the skip
            # count and (several workers) the step the iterator starts at.
            with tf.control_dependencies([self.short_seen.assign(False)]):
                base = self.trained.read_value() if self.keyed_by_step else tf.constant(0, tf.int64)
                return self.skip.read_value(), base

        started = _per_iterator(dataset, start, lambda *values: (
            tf.data.Dataset.from_tensors(values).repeat()))
        both = tf.data.Dataset.zip((started, dataset.enumerate()))
        return tf_data.map_inline(both, annotate_batch).with_options(dataset.options())

    def annotate_evaluation(self, dataset, emit):
        """One pass over evaluation batches: each element becomes `emit(element, sizes)`.

        The split is the one in force for the next training batch, looked up with no side
        effect on the training bookkeeping (nothing counted, skipped or recorded), applied to
        the batch's samples, whatever their number (`split_sizes`). Several workers use the
        key of the next training step, read when the pass starts, for the whole pass: the same
        on every worker, since every worker evaluates between the same two training steps.
        """
        num_replicas = self.num_replicas

        def per_iterator(base):
            def annotate_batch(_, element):
                if self.keyed_by_step:
                    bounds = self._bounds_for_key(base)
                else:
                    bounds = self.bounds.read_value()
                return emit(element, split_sizes(batch_dim(element), bounds, num_replicas))

            return _map_batches(dataset, annotate_batch)

        if not self.keyed_by_step:
            return per_iterator(None)  # nothing to read per iterator

        def start(_):
            return (self.trained.read_value(),)

        return _per_iterator(dataset, start, per_iterator)


_SAME_SIZE_INT = {1: tf.int8, 2: tf.int16, 4: tf.int32, 8: tf.int64}


def batch_fingerprint(element):
    """In-graph int64 fingerprint of a global batch: its values and the order of its samples.

    Each component's bits (strings hashed) are summed per sample, and the samples' sums are
    weighted by their positions, with wrapping integer arithmetic: the same batch gives the
    same value on every worker, bit for bit; other samples, or the same in another order,
    almost surely another. Straight-line ops only (it runs in the inline bookkeeping map).
    """
    total = tf.constant(0, tf.int64)
    for t in tf.nest.flatten(element):
        if not isinstance(t, tf.Tensor) or t.shape.rank == 0:
            continue
        if t.dtype == tf.string:
            bits = tf.strings.to_hash_bucket_fast(t, 2**62)
        elif t.dtype.is_floating or t.dtype.is_complex:  # complex128: two int64 per value
            bits = tf.bitcast(t, _SAME_SIZE_INT[min(t.dtype.size, 8)])
        else:
            bits = t
        bits = tf.cast(tf.reshape(bits, [tf.shape(t)[0], -1]), tf.int64)
        positions = tf.range(1, tf.shape(t, out_type=tf.int64)[0] + 1)
        total += tf.reduce_sum(tf.reduce_sum(bits, axis=1) * (positions * 2654435761 + 1))
    return total


def _step_amounts(element, n, weights_in_raw=True):
    """float32 [2]: a global batch's samples (`n`) and summed sample weight (Keras's
    (x, y, sample_weight) tuples; the samples where it has none; NaN if not `weights_in_raw`)."""
    samples = tf.cast(n, tf.float32)
    if not weights_in_raw:
        weight = tf.constant(float("nan"))
    elif isinstance(element, tuple) and len(element) == 3 and element[2] is not None:
        weight = tf.add_n([tf.reduce_sum(tf.cast(w, tf.float32))
                           for w in tf.nest.flatten(element[2])])
    else:
        weight = samples
    return tf.stack([samples, weight])


def _map_batches(dataset, fn):
    """`tf_data.map_inline` calling fn(None, element), whatever the element's structure."""
    if type(dataset.element_spec) is tuple:  # noqa: E721 - tf.data unpacks exactly tuples
        return tf_data.map_inline(dataset, lambda *element: fn(None, element))
    return tf_data.map_inline(dataset, lambda element: fn(None, element))


def _per_iterator(dataset, start, per_iterator):
    """`per_iterator(*start(...))` as a dataset: `start` runs once when each iterator starts.

    This gives each iterator its own values read at its start (the skip count, the step it
    starts at) without a `scan`, whose function call per batch costs as much as the split.
    Both functions are host functions (`tf_data.flat_map_host`): an iterator's start
    instantiates them without a Grappler pass each (35 -> 3 ms CPU to start one).
    """
    once = tf_data.map_inline(tf.data.Dataset.range(1), start)  # a tuple: per_iterator's args
    return tf_data.flat_map_host(once, per_iterator).with_options(dataset.options())


def _assert(condition, message, data):
    """An assert op without tf.debugging.Assert's cond guard (inline tf.data maps refuse it)."""
    return tf.raw_ops.Assert(condition=condition, data=[message] + list(data), summarize=3)


def split_global_batches(
    dataset, allocation, num_replicas, replica_range=None, evaluation=False, plan=None
):
    """Turns a dataset of global batches into one of per-replica batches, K per global batch.

    Args:
        dataset: `tf.data.Dataset` of global batches (every component batched on axis 0).
            Ignored if `plan` is given: its raw global batches are split instead.
        allocation: the strategy's `Allocation`.
        num_replicas: K, the number of replicas in sync (over all workers).
        replica_range: optional (first, count): emit only the slices of replicas
            first .. first + count - 1 (one worker's replicas in multi-worker training).
        evaluation: True for evaluation/prediction data: batches of any size, each split in
            proportion to the sizes (see the module docs). Default False: training data.

    Returns:
        A `tf.data.Dataset` whose consecutive groups of `count` elements are the slices of one
        global batch in replica order.

    Cost per global batch: one inline map (`tf_data.map_inline`: run in the pipeline's own
    thread, no inter-op scheduling) does the bookkeeping, slices the batch (one `split` per
    component, no copy) and returns the slices as a small dataset; the `flat_map` that
    flattens it has an identity function, which tf.data runs without calling it. A flat_map
    whose function sliced cost a function call on the inter-op threads per batch, 1-3% of a
    small model's step on 2 cores (see BUILD_NOTES, "Overhead").
    """
    first, count = replica_range if replica_range is not None else (0, num_replicas)
    per_slice = plan.per_slice if plan is not None else None
    if plan is not None:
        dataset = plan.raw

    def to_slices(element, sizes):
        flat = tf.nest.flatten(element)
        ends = None
        columns = []  # per component: its K slices
        for t in flat:
            if isinstance(t, tf.Tensor):
                columns.append(tf.split(t, sizes, num=num_replicas))  # one op, no copy
            else:  # e.g. a RaggedTensor: slice by the running sums
                ends = tf.cumsum(sizes) if ends is None else ends
                columns.append([t[ends[k] - sizes[k]:ends[k]] for k in range(num_replicas)])
        slices = None
        for k in range(first, first + count):
            own = tf.nest.pack_sequence_as(element, [column[k] for column in columns])
            piece = tf.data.Dataset.from_tensors(own) if per_slice is None else per_slice(own)
            slices = piece if slices is None else slices.concatenate(piece)
        return slices

    if evaluation:
        per_batch = allocation.annotate_evaluation(dataset, to_slices)
    else:
        weights_in_raw = plan is None or plan.weights_in_raw
        per_batch = allocation.annotate(dataset, to_slices, weights_in_raw)
    slices = tf_data.flat_map_host(per_batch, _itself)
    if plan is not None and plan.on_slice_stream is not None:
        slices = plan.on_slice_stream(slices)
    if per_slice is not None and count > 1:  # several replicas' maps in one function
        slices = tf_data.without_map_and_batch_fusion(slices)
    # One global batch ahead of training (the moved work too, as the user's prefetch did it
    # before; that prefetch now holds raw batches, before the split's bookkeeping). A fixed
    # buffer bounds how far the bookkeeping runs ahead of training, which a switch's start
    # must exceed (`switch_margin`): ending on a synchronous map, the pipeline would get
    # tf.data's injected prefetch, whose autotuned buffer grows without that bound.
    return slices.prefetch(count)


def _itself(dataset):
    return dataset
