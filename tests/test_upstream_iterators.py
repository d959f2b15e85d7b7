"""Canaries of `_upstream.iterators`: the iterators of a distributed dataset.

When one fails after an upgrade, read the matching section of
`tf_hetbatch/distribute/_upstream/iterators.py`: the workaround may be obsolete
(lift it) or broken (fix it), but it must not go on silently.
"""

import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch.distribute._upstream import iterators
from helpers import stock_mirrored


def _get_next_op_types(distributed):
    iterator = iter(distributed)

    @tf.function
    def get_next():
        return iterator.get_next()

    return {op.type for op in get_next.get_concrete_function().graph.get_operations()}


def test_partial_batch_handling_is_a_per_dataset_flag_read_by_its_iterators(cpus):
    """`iterators.disable_partial_batch_handling` sets a private flag of TensorFlow's distributed
    dataset. Finite data of unknown batch shape gets the per-step optional + cond by default;
    if the flag goes, our iterators silently get it back (correct, slower; across workers a
    collective before every step)."""
    strategy = stock_mirrored(cpus[:2])
    data = tf.data.Dataset.range(10).batch(3)  # a partial last batch: shape [None]

    def per_worker(_):
        return data

    assert "OptionalHasValue" in _get_next_op_types(
        strategy.distribute_datasets_from_function(per_worker)
    )
    disabled = iterators.disable_partial_batch_handling(
        strategy.distribute_datasets_from_function(per_worker)
    )
    assert "OptionalHasValue" not in _get_next_op_types(disabled)
    # Our one-host strategy distributes every dataset without the check; its iterators still
    # end with the data (every replica gets a slice of every global batch, maybe empty).
    ours = hb.HeteroMirroredStrategy(cpus[:3])
    distributed = ours.experimental_distribute_dataset(data)
    assert "OptionalHasValue" not in _get_next_op_types(distributed)
    batches = [[int(tf.size(t)) for t in ours.experimental_local_results(b)] for b in distributed]
    assert batches == [[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0]]


def test_iterators_read_the_dataset_options(cpus):
    """`iterators.plain_iterators` replaces the options a distributed dataset's iterators read: a
    worker's one CPU replica then reads a plain iterator, not a MultiDeviceIterator (which
    every PER_WORKER iterator gets upstream, also for one device). If TensorFlow stops
    reading them there, the multi-device iterator comes back (correct, slower)."""
    from tensorflow.python.data.ops import iterator_ops

    def local_iterator(strategy, data):  # the worker's iterator, and its first batch
        iterator = iter(strategy.experimental_distribute_dataset(data))
        first = [t.numpy().tolist() for t in strategy.experimental_local_results(next(iterator))]
        return type(iterator._iterators[0]._iterator), first

    data = tf.data.Dataset.range(10).batch(4)
    stock, first = local_iterator(stock_mirrored(cpus[:1]), data)
    assert stock is not iterator_ops.OwnedIterator and first == [[0, 1, 2, 3]]
    kind, first = local_iterator(hb.HeteroMirroredStrategy(cpus[:1]), data)
    assert kind is iterator_ops.OwnedIterator and first == [[0, 1, 2, 3]]
    kind, first = local_iterator(hb.HeteroMirroredStrategy(cpus[:2]), data)  # 2 replicas
    assert kind is stock and first == [[0, 1], [2, 3]]


def test_next_as_optional_reads_what_it_needs(cpus):
    """`iterators.next_as_optional` (Keras's multi-step loop, steps_per_execution > 1) rebuilds
    TensorFlow's get_next_as_optional without the replica count from private parts of the
    distributed iterator. It must yield what get_next yields, then an empty optional; if
    those parts go, it falls back to TensorFlow's own (correct, with the count)."""
    ours = hb.HeteroMirroredStrategy(cpus[:3])
    ours.set_batch_sizes([2, 0, 1])
    data = tf.data.Dataset.range(10).batch(3)  # a partial last batch
    iterator = iter(ours.experimental_distribute_dataset(data))
    for attribute in ("_enable_get_next_as_optional", "_cardinality", "_iterators",
                      "_input_workers", "_replica_order", "_reorder_replicas", "_strategy"):
        assert hasattr(iterator, attribute), attribute
    from tensorflow.python.distribute import input_lib
    assert callable(input_lib._create_per_replica)
    assert iterator._enable_get_next_as_optional is False

    @tf.function
    def take(it):
        optional = iterators.next_as_optional(it)
        if optional.has_value():
            return True, [tf.size(t) for t in ours.experimental_local_results(
                optional.get_value())]
        return False, [tf.constant(-1)] * 3

    seen = []
    for _ in range(5):
        has, sizes = take(iterator)
        seen.append([int(s) for s in sizes] if bool(has) else None)
    assert seen == [[2, 0, 1], [2, 0, 1], [2, 0, 1], [1, 0, 0], None]


def test_destroying_a_used_iterator_releases_the_gil():
    """`iterators.adapt_iterators`: iterator_release destroys used iterators on a thread of its
    own, because their destruction can wait seconds for tf.data's autotuning thread. That keeps
    the training loop going only while TensorFlow releases the GIL as it destroys a tensor
    handle (EagerTensor_dealloc). Here a destruction waits for two map calls in flight (chains
    of matrix products); the main thread must run Python meanwhile."""
    import threading
    import time

    big = tf.random.normal((1000, 1000))

    def slow(i):
        x = big
        for _ in range(8):
            x = tf.matmul(x, big) / 1000.0
        return tf.reduce_sum(x) + tf.cast(i, tf.float32)

    iterator = iter(tf.data.Dataset.range(100).map(slow, num_parallel_calls=2).prefetch(4))
    next(iterator)
    time.sleep(0.05)  # the next calls are in flight
    held = [iterator]
    del iterator
    releasing = threading.Thread(target=held.clear)
    started = time.perf_counter()
    releasing.start()
    turns = 0
    while releasing.is_alive() and time.perf_counter() - started < 60:
        time.sleep(0.001)
        turns += 1
    releasing.join(60)
    assert not releasing.is_alive()
    assert turns >= 10, f"the main thread ran {turns} times during the destruction"


def test_a_step_on_next_values_is_traced_once_for_every_split(cpus):
    """`iterators.adapt_iterators` types the PerReplica values `next(iterator)` gives by the
    iterator's element spec (batch dimension unknown), so a `tf.function` step called on them
    is traced once for all splits. If TensorFlow stops tracing a PerReplica by its `_type_spec`
    (or the class goes), every new split is traced again (correct, slower)."""
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    data = tf.data.Dataset.range(12 * 16).map(lambda i: tf.cast(i, tf.float32)).batch(12)
    iterator = iter(strategy.experimental_distribute_dataset(data))

    @tf.function
    def step(x):
        return strategy.run(lambda v: (tf.size(v), tf.reduce_sum(v)), args=(x,))

    seen, totals = set(), []
    for i in range(16):
        if i % 4 == 0:
            strategy.set_batch_sizes([[4, 4, 4], [6, 4, 2], [2, 2, 8], [1, 9, 2]][i // 4])
        sizes, sums = step(next(iterator))
        seen.add(tuple(int(s) for s in strategy.experimental_local_results(sizes)))
        totals.append(sum(float(s) for s in strategy.experimental_local_results(sums)))
    assert len(seen) >= 3, seen
    assert step.experimental_get_tracing_count() == 1
    assert totals == [float(sum(range(12 * i, 12 * i + 12))) for i in range(16)]
