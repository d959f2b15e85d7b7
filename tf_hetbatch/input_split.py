"""Splitting each global batch of a tf.data pipeline into uneven per-replica batches.

The pipeline yields global batches of B samples, as for every `tf.distribute` strategy. Each
global batch gets its number in production order and the split in force for that number (see
`Allocation`), and is emitted as K consecutive slices, in replica order;
`distribute_datasets_from_function` hands element i to replica i % K, so replica k gets slice k.
A split installed now applies to the global batches produced after it, i.e. a few steps later
(the distributed iterator prefetches), or from an agreed batch number in multi-worker training.

A TRAINING batch of n samples is split as follows:
- no sizes set (all zeros): evenly, the first n % K replicas getting one sample more;
- n == sum(sizes): by the sizes;
- n < sum(sizes): in proportion to the sizes (largest remainder), which is right for the partial
  last batch of an epoch and only for it: a second short batch is an error;
- n > sum(sizes): an error naming both numbers.

EVALUATION data (Keras `evaluate`, `predict`, `fit`'s validation) may have any batch size, as
under the stock strategy: every batch of n samples is split in proportion to the sizes
(largest remainder; exactly the sizes when n == sum(sizes)), or evenly while none are set, with
no error. Its results are sums over samples, so the split does not change them. Evaluation
passes leave the training bookkeeping alone: they are not counted as produced batches, do not
consume the batches to skip on resuming, and do not move the newest training key.
"""

import tensorflow as tf

from tf_hetbatch import _compat



def even_sizes(n, num_replicas):
    """In-graph even split of `n` (int64 scalar) into `num_replicas` sizes."""
    k = tf.range(num_replicas, dtype=tf.int64)
    return n // num_replicas + tf.cast(k < n % num_replicas, tf.int64)


def proportional_sizes(n, sizes):
    """In-graph largest-remainder split of `n` in proportion to `sizes` (int64 vectors).

    All zeros (no split set) gives zeros.
    """
    total = tf.reduce_sum(sizes)
    scaled = n * sizes
    floor = scaled // tf.maximum(total, 1)
    remainder = scaled - floor * total
    missing = tf.where(total > 0, n - tf.reduce_sum(floor), 0)
    # Largest remainders first; ties go to the lower replica index (stable sort).
    order = tf.argsort(-remainder, stable=True)
    bonus = tf.scatter_nd(
        tf.expand_dims(order, 1),
        tf.cast(tf.range(tf.size(sizes)) < tf.cast(missing, tf.int32), tf.int64),
        tf.shape(sizes, out_type=tf.int32),
    )
    return floor + bonus


# The split functions below run once per global batch inside the input pipeline: straight-line
# ops only. A tf.cond there is a functional If whose branches are function calls, and each
# tf.data function call costs about as much as the whole split (see BUILD_NOTES, "Overhead").
def sizes_for_batch(n, allocation, num_replicas):
    """The per-replica sizes (int64 [K]) for one global batch of `n` samples."""
    allocation = tf.cast(allocation, tf.int64)
    total = tf.reduce_sum(allocation)
    check = _assert(
        tf.logical_or(tf.equal(total, 0), n <= total),
        "A global batch has more samples than `batch_sizes` sum to. Fix: batch the "
        "dataset with the global batch size sum(batch_sizes), or call "
        "set_batch_sizes() with sizes that sum to the dataset's batch size. "
        "[batch samples, sum(batch_sizes)]",
        [n, total],
    )
    with tf.control_dependencies([check]):
        return evaluation_sizes(n, allocation, num_replicas)


def evaluation_sizes(n, allocation, num_replicas):
    """The per-replica sizes (int64 [K]) for an evaluation batch of `n` samples: any n.

    Exactly `allocation` when n is its sum, else in proportion to it (largest remainder), or
    evenly while it is all zeros.
    """
    allocation = tf.cast(allocation, tf.int64)
    total = tf.reduce_sum(allocation)
    return tf.where(
        tf.equal(total, 0),
        even_sizes(n, num_replicas),
        tf.where(tf.equal(n, total), allocation, proportional_sizes(n, allocation)),
    )


def batch_dim(element):
    """The leading dimension (int64 scalar) shared by every component of a global batch."""
    flat = [t for t in tf.nest.flatten(element) if t is not None]
    if not flat:
        raise ValueError(
            "Dataset elements must contain at least one tensor. Received an element spec with "
            "no tensors."
        )
    return tf.shape(flat[0], out_type=tf.int64)[0]


class Allocation:
    """Host variables that tell the input pipeline how to split each global batch.

    Each global batch gets a number, its key, and uses the split installed with the largest
    start <= key (latest installed on a tie). A small ring of slots keeps switches that are not
    reached yet. Two ways of numbering:
    - one host (`keyed_by_step=False`): the count of global batches produced so far, by any
      iterator; a split installed with start = that count applies to every batch produced
      after the call;
    - several workers (`keyed_by_step=True`): the training step the batch will be trained in,
      i.e. the steps trained when its iterator produced its first batch, plus its position in
      that iterator. Every worker computes the same keys whatever its prefetch timing, so the
      same (start, sizes) installed on every worker, with a start no worker has produced yet,
      switches all of them at the same global step.
    """

    SLOTS = 8
    NEVER = 2**62

    def __init__(self, num_replicas, device="/cpu:0", keyed_by_step=False):
        self.num_replicas = num_replicas
        self.keyed_by_step = keyed_by_step
        with tf.init_scope(), tf.device(device):

            def variable(value, name):
                return tf.Variable(value, trainable=False, name=name)

            self.starts = variable(
                tf.constant([0] + [self.NEVER] * (self.SLOTS - 1), tf.int64),
                "hetbatch_split_starts",
            )
            # Zeros mean "even split of whatever the batch holds".
            self.sizes = variable(
                tf.zeros([self.SLOTS, num_replicas], tf.int32), "hetbatch_split_sizes"
            )
            # Install order: among slots with the same start, the latest installed wins.
            self.sequence = variable(tf.zeros([self.SLOTS], tf.int64), "hetbatch_split_sequence")
            self.produced = variable(tf.constant(0, tf.int64), "hetbatch_batches_produced")
            self.trained = variable(tf.constant(0, tf.int64), "hetbatch_steps_trained")
            self.last_key = variable(tf.constant(-1, tf.int64), "hetbatch_last_key")
            # Global batches the next iterator drops first (resuming mid-epoch); each
            # iterator reads it at its first batch, and every train step clears it.
            self.skip = variable(tf.constant(0, tf.int64), "hetbatch_skip_batches")
            # Key of the first short batch of the current iterator (NEVER: none yet).
            self.short_key = variable(tf.constant(self.NEVER, tf.int64), "hetbatch_short_key")
        self._next_slot = 1
        self._installed = 0

    def install(self, sizes, start):
        """Makes global batches with key >= `start` use `sizes` (eager, from Python)."""
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.SLOTS
        self._installed += 1
        self.sizes[slot].assign(tf.constant(sizes, tf.int32))
        self.sequence[slot].assign(self._installed)
        # Written after the sizes: a pipeline that sees the new start sees the new sizes.
        self.starts[slot].assign(tf.constant(start, tf.int64))

    def count_trained_step(self):
        """In the train step (cross-replica context): one more step trained, skip cleared."""
        return tf.group(self.trained.assign_add(1), self.skip.assign(0))

    def sizes_for_key(self, key):
        """In-graph: the sizes in force for the global batch with this key."""
        starts = self.starts.read_value()
        valid = starts <= key
        latest_start = tf.reduce_max(tf.where(valid, starts, -1))
        candidates = tf.logical_and(valid, tf.equal(starts, latest_start))
        slot = tf.argmax(tf.where(candidates, self.sequence.read_value(), -1))
        return tf.gather(self.sizes.read_value(), slot)

    def annotate(self, dataset):
        """One pass over the global batches: skip, number, look up the split, check.

        Each element becomes (element, sizes):
        - the first `skip` batches of each iterator (read when it starts) are dropped
          (resuming mid-epoch);
        - every other batch gets its key (see the class) and its per-replica sizes: the split
          in force for the key applied to the batch's actual number of samples;
        - a short batch (fewer samples than the split sums to) must be the last of the data: a
          batch after a short one means the data is batched by another size than
          sum(batch_sizes), an error.
        """

        def per_iterator(to_skip, base):
            def annotate_batch(position, element):
                produced = self.produced.assign_add(1, read_value=True) - 1
                key = base + position if self.keyed_by_step else produced
                allocated = self.sizes_for_key(key)
                n = batch_dim(element)
                total = tf.reduce_sum(tf.cast(allocated, tf.int64))
                check = _assert(
                    key <= self.short_key.read_value(),
                    "A global batch followed a short one: the dataset's batches do not have "
                    "sum(batch_sizes) samples. Fix: batch the dataset with the global batch "
                    "size sum(batch_sizes), or call set_batch_sizes() with sizes that sum to "
                    "the dataset's batch size. [this batch's samples, sum(batch_sizes)]",
                    [n, total],
                )
                with tf.control_dependencies([check]):
                    short = tf.logical_and(total > 0, n < total)
                    mark = self.short_key.assign(
                        tf.where(short, tf.minimum(self.short_key.read_value(), key),
                                 self.short_key.read_value())
                    )
                # The newest key produced by the most recent iterator (a validation pass numbers
                # its batches from the same step as the next epoch, but is over by then).
                record = self.last_key.assign(
                    tf.where(position == 0, key, tf.maximum(self.last_key.read_value(), key))
                )
                sizes = sizes_for_batch(n, allocated, self.num_replicas)
                with tf.control_dependencies([mark, record]):
                    return element, tf.identity(sizes)

            return _compat.map_inline(dataset.skip(to_skip).enumerate(), annotate_batch)

        def start(_):
            # Runs once when an iterator starts: clears the short-batch mark, reads the skip
            # count and (several workers) the step the iterator starts at.
            with tf.control_dependencies([self.short_key.assign(self.NEVER)]):
                base = self.trained.read_value() if self.keyed_by_step else tf.constant(0, tf.int64)
                return self.skip.read_value(), base

        return _per_iterator(dataset, start, per_iterator)

    def annotate_evaluation(self, dataset):
        """One pass over evaluation batches: each element becomes (element, sizes).

        The split is the one in force for the next training batch, looked up with no side
        effect on the training bookkeeping (no batch counted, nothing skipped, no key
        recorded). Several workers use the key of the next training step, read when the pass
        starts, for the whole pass: the same on every worker, since every worker evaluates
        between the same two training steps.
        """

        def per_iterator(base):
            def annotate_batch(_, element):
                key = base if self.keyed_by_step else self.produced.read_value()
                return element, evaluation_sizes(
                    batch_dim(element), self.sizes_for_key(key), self.num_replicas
                )

            # enumerate(): the element arrives as one argument, whatever its structure.
            return _compat.map_inline(dataset.enumerate(), annotate_batch)

        def start(_):
            return (self.trained.read_value(),)

        return _per_iterator(dataset, start, per_iterator)


def _per_iterator(dataset, start, per_iterator):
    """`per_iterator(*start(...))` as a dataset: `start` runs once when each iterator starts.

    This gives each iterator its own values read at its start (the skip count, the step it
    starts at) without a `scan`, whose function call per batch costs as much as the split.
    """
    once = tf.data.Dataset.range(1).map(start)  # `start` returns a tuple: per_iterator's args
    return once.flat_map(per_iterator).with_options(dataset.options())


def _assert(condition, message, data):
    """An assert op without tf.debugging.Assert's cond guard (inline tf.data maps refuse it)."""
    return tf.raw_ops.Assert(condition=condition, data=[message] + list(data), summarize=3)


def split_global_batches(
    dataset, allocation, num_replicas, replica_range=None, evaluation=False
):
    """Turns a dataset of global batches into one of per-replica batches, K per global batch.

    Args:
        dataset: `tf.data.Dataset` of global batches (every component batched on axis 0).
        allocation: the strategy's `Allocation`.
        num_replicas: K, the number of replicas in sync (over all workers).
        replica_range: optional (first, count): emit only the slices of replicas
            first .. first + count - 1 (one worker's replicas in multi-worker training).
        evaluation: True for evaluation/prediction data: batches of any size, each split in
            proportion to the sizes (see the module docs). Default False: training data.

    Returns:
        A `tf.data.Dataset` whose consecutive groups of `count` elements are the slices of one
        global batch in replica order.

    Cost per global batch: one inline map (the bookkeeping, run in the pipeline's thread) and
    one flat_map call that only slices: a chain of from_tensors datasets, no nested map. Each
    extra tf.data function call per batch, or one scheduled on the inter-op threads the
    replicas compute with, cost several percent of a small model's step on 2 cores (see
    BUILD_NOTES, "Overhead"). Slicing several batches per call (`window` + C++ `rebatch` with
    their sizes) measured no saving beyond the noise (about 1% of a small CNN's step) and would
    delay every split switch by the window, so each batch is sliced on its own.
    """
    first, count = replica_range if replica_range is not None else (0, num_replicas)

    def to_slices(element, sizes):
        ends = tf.cumsum(sizes)
        slices = None
        for k in range(first, first + count):
            begin, end = ends[k] - sizes[k], ends[k]
            piece = tf.data.Dataset.from_tensors(
                tf.nest.map_structure(lambda t: t[begin:end], element)
            )
            slices = piece if slices is None else slices.concatenate(piece)
        return slices

    if evaluation:
        return allocation.annotate_evaluation(dataset).flat_map(to_slices)
    return allocation.annotate(dataset).flat_map(to_slices)
