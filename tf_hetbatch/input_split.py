"""Splitting each global batch of a tf.data pipeline into uneven per-replica batches.

The pipeline yields global batches of B samples, as for every `tf.distribute` strategy. For each
global batch this module reads the current allocation (an int32 host variable holding one size
per replica, or all zeros for an even split) ONCE, and emits K consecutive slices, in replica
order; `distribute_datasets_from_function` hands element i to replica i % K, so replica k gets
slice k. A change of the allocation applies to the global batches produced after it, i.e. a few
steps later (the distributed iterator prefetches).

A batch of n samples is split as follows:
- no sizes set (all zeros): evenly, the first n % K replicas getting one sample more;
- n == sum(sizes): by the sizes;
- n < sum(sizes): in proportion to the sizes (largest remainder), which is right for the partial
  last batch of an epoch and only for it: a second short batch is an error;
- n > sum(sizes): an error naming both numbers.
"""

import tensorflow as tf


def even_sizes(n, num_replicas):
    """In-graph even split of `n` (int64 scalar) into `num_replicas` sizes."""
    k = tf.range(num_replicas, dtype=tf.int64)
    return n // num_replicas + tf.cast(k < n % num_replicas, tf.int64)


def proportional_sizes(n, sizes):
    """In-graph largest-remainder split of `n` in proportion to `sizes` (int64 vectors)."""
    total = tf.reduce_sum(sizes)
    scaled = n * sizes
    floor = scaled // total
    remainder = scaled - floor * total
    missing = n - tf.reduce_sum(floor)
    # Largest remainders first; ties go to the lower replica index (stable sort).
    order = tf.argsort(-remainder, stable=True)
    bonus = tf.scatter_nd(
        tf.expand_dims(order, 1),
        tf.cast(tf.range(tf.size(sizes)) < tf.cast(missing, tf.int32), tf.int64),
        tf.shape(sizes, out_type=tf.int32),
    )
    return floor + bonus


def sizes_for_batch(n, allocation, num_replicas):
    """The per-replica sizes (int64 [K]) for one global batch of `n` samples."""
    allocation = tf.cast(allocation, tf.int64)
    total = tf.reduce_sum(allocation)

    def by_allocation():
        check = tf.debugging.assert_less_equal(
            n,
            total,
            message=(
                "A global batch has more samples than `batch_sizes` sum to. Fix: batch the "
                "dataset with the global batch size sum(batch_sizes), or call "
                "set_batch_sizes() with sizes that sum to the dataset's batch size. "
                "[batch samples, sum(batch_sizes)]"
            ),
            summarize=2,
        )
        with tf.control_dependencies([check]):
            return tf.cond(
                tf.equal(n, total),
                lambda: tf.identity(allocation),
                lambda: proportional_sizes(n, allocation),
            )

    return tf.cond(
        tf.equal(total, 0), lambda: even_sizes(n, num_replicas), by_allocation
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


def _check_only_last_partial(dataset, allocation):
    """Fails on a short batch that is not the last one (batched by a size other than B)."""

    def scan_fn(previous_short, element):
        n = batch_dim(element)
        total = tf.reduce_sum(tf.cast(allocation, tf.int64))
        check = tf.debugging.Assert(
            tf.logical_not(previous_short),
            [
                "A global batch followed a short one: the dataset's batches do not have "
                "sum(batch_sizes) samples. Fix: batch the dataset with the global batch size "
                "sum(batch_sizes), or call set_batch_sizes() with sizes that sum to the "
                "dataset's batch size. [previous batch was short; this batch samples, "
                "sum(batch_sizes)]",
                n,
                total,
            ],
        )
        with tf.control_dependencies([check]):
            short = tf.logical_and(total > 0, n < total)
            return short, element

    return dataset.scan(tf.constant(False), scan_fn)


def split_global_batches(dataset, allocation, num_replicas, replica_range=None):
    """Turns a dataset of global batches into one of per-replica batches, K per global batch.

    Args:
        dataset: `tf.data.Dataset` of global batches (every component batched on axis 0).
        allocation: int32 `tf.Variable` of shape [K] (zeros for an even split).
        num_replicas: K, the number of replicas in sync (over all workers).
        replica_range: optional (first, count): emit only the slices of replicas
            first .. first + count - 1 (one worker's replicas in multi-worker training).

    Returns:
        A `tf.data.Dataset` whose consecutive groups of `count` elements are the slices of one
        global batch in replica order.
    """
    first, count = replica_range if replica_range is not None else (0, num_replicas)
    is_tuple = isinstance(dataset.element_spec, tuple)
    dataset = _check_only_last_partial(dataset, allocation)

    def to_slices(*args):
        element = args if is_tuple else args[0]
        n = batch_dim(element)
        sizes = sizes_for_batch(n, allocation.read_value(), num_replicas)
        offsets = tf.cumsum(sizes, exclusive=True)
        picks = tf.data.Dataset.from_tensor_slices(
            (offsets[first : first + count], sizes[first : first + count])
        )

        def take(offset, size):
            return tf.nest.map_structure(
                lambda t: t[offset : offset + size], element
            )

        return picks.map(take)

    return dataset.flat_map(to_slices)
