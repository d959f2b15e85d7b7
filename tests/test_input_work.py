"""Input work after the split (tf_hetbatch.distribute.input_work), in one process.

Each worker's view is built as its strategy builds it (`split_global_batches` with the
worker's replica range and the worker's `InputPlan`) and compared with the unsplit pipeline's
slices: the same samples in the same order, while the per-sample work runs on the worker's own
samples only. Real multi-worker runs are in test_multi_worker.py and test_recovery.py.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch.distribute import input_split, input_work

K = 3
B = 12
N = 40  # 3 full global batches and a partial one of 4


def worker_slices(make_dataset, worker, sizes, moved, evaluation=False):
    """The slices worker `worker` gets, as numpy tuples: an int for K workers of one replica
    each, or the worker's (first replica, count) of an uneven layout."""
    replicas = (worker, 1) if isinstance(worker, int) else worker
    allocation = input_split.Allocation(K, keyed_by_step=True)
    allocation.install(sizes, 0)
    dataset = make_dataset()
    plan = input_work.plan(dataset, owns_every_replica=not moved, evaluation=evaluation)
    out = input_split.split_global_batches(
        dataset, allocation, K, replicas, evaluation=evaluation, plan=plan
    )
    return [tuple(np.asarray(c) for c in tf.nest.flatten(e)) for e in out.as_numpy_iterator()], plan


def assert_same_slices(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v)


class Counter:
    """Counts the samples a pipeline's map works on (a variable the map's function captures)."""

    def __init__(self):
        self.variable = tf.Variable(0, dtype=tf.int64, trainable=False)

    def count(self, n=1):
        return self.variable.assign_add(tf.cast(n, tf.int64))

    def take(self):
        value = int(self.variable.numpy())
        self.variable.assign(0)
        return value


def per_sample_pipeline(counter, num_parallel_calls=None, prefetch=True):
    def decode(x, y):
        counter.count()
        return tf.cast(x, tf.float32) * 2.0, y

    def augment(x, y):
        return tf.stack([x, x + 1.0]), y

    def make():
        ds = tf.data.Dataset.from_tensor_slices((np.arange(N), np.arange(N) % 5))
        ds = ds.shuffle(N, seed=3).map(decode, num_parallel_calls=num_parallel_calls)
        ds = ds.map(augment).batch(B)
        return ds.prefetch(2) if prefetch else ds

    return make


@pytest.mark.parametrize("sizes", [[2, 3, 7], [0, 4, 8], [12, 0, 0]])
@pytest.mark.parametrize("num_parallel_calls", [None, 4])
def test_each_worker_maps_its_own_samples_into_the_same_slices(sizes, num_parallel_calls):
    counter = Counter()
    make = per_sample_pipeline(counter, num_parallel_calls)
    mapped = 0
    for worker in range(K):
        ours, plan = worker_slices(make, worker, sizes, moved=True)
        ours_count = counter.take()
        theirs, _ = worker_slices(make, worker, sizes, moved=False)
        assert counter.take() == N  # unsplit: every worker maps every sample
        assert plan.moved == 2 and not plan.reason
        assert_same_slices(ours, theirs)
        # One map call per own sample: the slices' samples, partial last batch included.
        assert ours_count == sum(len(s[1]) for s in ours)
        mapped += ours_count
    assert mapped == N


@pytest.mark.parametrize("layout", [(1, 2), (2, 1)], ids=["1+2", "2+1"])
def test_workers_of_an_uneven_layout_map_their_own_replicas_samples(layout):
    # K replicas on workers hosting different numbers of them: each worker keeps (and maps)
    # the slices of all its replicas, in replica order, and every sample is mapped once.
    counter = Counter()
    make = per_sample_pipeline(counter)
    sizes = [2, 3, 7]
    first = mapped = 0
    for count in layout:
        ours, plan = worker_slices(make, (first, count), sizes, moved=True)
        ours_count = counter.take()
        theirs, _ = worker_slices(make, (first, count), sizes, moved=False)
        assert counter.take() == N
        assert_same_slices(ours, theirs)
        assert [len(s[1]) for s in ours[:count]] == sizes[first:first + count]
        assert ours_count == sum(len(s[1]) for s in ours)
        mapped += ours_count
        first += count
    assert mapped == N


@pytest.mark.parametrize("after", ["repeat", "take", "skip"])
def test_repeat_take_and_skip_of_global_batches_keep_the_split_before_the_maps(after):
    counter = Counter()

    def make():
        ds = per_sample_pipeline(counter, prefetch=False)()
        ds = {"repeat": lambda d: d.take(3).repeat(2), "take": lambda d: d.take(2),
              "skip": lambda d: d.skip(1)}[after](ds)
        return ds.prefetch(1)

    ours, plan = worker_slices(make, 1, [2, 3, 7], moved=True)
    own = counter.take()
    theirs, _ = worker_slices(make, 1, [2, 3, 7], moved=False)
    counter.take()
    assert plan.moved == 2
    assert_same_slices(ours, theirs)
    assert own == sum(len(s[1]) for s in ours)


def test_an_empty_slice_is_an_empty_batch_of_the_finished_shape():
    counter = Counter()
    ours, _ = worker_slices(per_sample_pipeline(counter), 0, [0, 4, 8], moved=True)
    assert [s[0].shape for s in ours] == [(0, 2)] * 4
    assert counter.take() == 0


def test_evaluation_batches_of_any_size_split_the_same_way():
    counter = Counter()

    def make():
        ds = tf.data.Dataset.from_tensor_slices(np.arange(N)).map(
            lambda x: (counter.count(), x * 3)[1])
        return ds.batch(7)

    for worker in range(K):
        ours, _ = worker_slices(make, worker, [2, 3, 7], moved=True, evaluation=True)
        own = counter.take()
        theirs, _ = worker_slices(make, worker, [2, 3, 7], moved=False, evaluation=True)
        counter.take()
        assert_same_slices(ours, theirs)
        assert own == sum(len(s[0]) for s in ours)


def test_keras_array_input_gathers_only_own_rows():
    import keras
    from keras.src.trainers.data_adapters import array_data_adapter  # how fit(x, y) batches

    x = np.arange(N * 2, dtype="float32").reshape(N, 2)
    y = np.arange(N, dtype="int32")

    def make():
        adapter = array_data_adapter.ArrayDataAdapter(x, y, batch_size=B, shuffle=False)
        return adapter.get_tf_dataset()

    del keras
    for worker in range(K):
        ours, plan = worker_slices(make, worker, [2, 3, 7], moved=True)
        theirs, _ = worker_slices(make, worker, [2, 3, 7], moved=False)
        assert plan.moved == 1
        assert_same_slices(ours, theirs)


def test_marked_batch_level_maps_run_on_each_slice():
    counter = Counter()

    def per_batch(x):
        counter.count(tf.shape(x)[0])
        return tf.cast(x, tf.float32) / 2.0

    def make():
        ds = tf.data.Dataset.from_tensor_slices(np.arange(N)).batch(B)
        return ds.apply(hb.split_here()).map(per_batch, num_parallel_calls=2).prefetch(1)

    for worker in range(K):
        ours, plan = worker_slices(make, worker, [2, 3, 7], moved=True)
        own = counter.take()
        theirs, _ = worker_slices(make, worker, [2, 3, 7], moved=False)
        assert counter.take() == N
        assert plan.moved == 1
        assert_same_slices(ours, theirs)
        assert own == sum(len(s[0]) for s in ours)


def test_split_here_changes_nothing_without_a_strategy():
    ds = tf.data.Dataset.range(10).batch(4)
    marked = ds.apply(hb.split_here())
    assert marked.element_spec == ds.element_spec
    batches = [list(b) for b in ds.as_numpy_iterator()]
    assert [list(b) for b in marked.as_numpy_iterator()] == batches


# Named functions, not lambdas, for the maps: autograph finds a lambda's source by parsing the
# lines around it, which took 75-81 s for these in three full-suite runs (a parametrize list
# with nested lambdas on its lines).
def double(x):
    return x * 2


def ragged_row(x):
    return tf.fill([x % 3 + 1], x)


def map_after_batch():
    return tf.data.Dataset.range(N).batch(B).map(double)


def unbatch_between():
    return tf.data.Dataset.range(N).map(double).batch(B).unbatch().batch(B)


def padded_batch():
    return tf.data.Dataset.range(N).map(ragged_row).padded_batch(B)


@pytest.mark.parametrize("make, why", [
    (map_after_batch, "after batch()"),
    (unbatch_between, "stands between"),
    (padded_batch, "not batch"),
])
def test_unrecognised_pipelines_run_unsplit_and_say_why(make, why):
    for worker in range(K):
        ours, plan = worker_slices(make, worker, [2, 3, 7], moved=True)
        theirs, _ = worker_slices(make, worker, [2, 3, 7], moved=False)
        assert plan.moved == 0
        assert why in plan.reason and "Fix:" in plan.reason
        assert_same_slices(ours, theirs)


def test_maps_without_static_shapes_run_unsplit_and_say_why():
    def make():
        return tf.data.Dataset.range(N).map(lambda x: tf.fill([x % 2 + 1], x)).batch(1)

    ours, plan = worker_slices(make, 0, [0, 0, 1], moved=True)
    assert plan.moved == 0 and "static shape" in plan.reason
    theirs, _ = worker_slices(make, 0, [0, 0, 1], moved=False)
    assert_same_slices(ours, theirs)


def test_a_pipeline_without_per_sample_maps_has_nothing_to_move():
    plan = input_work.plan(tf.data.Dataset.range(N).batch(B), owns_every_replica=False)
    assert plan.moved == 0 and not plan.reason


def test_an_unseeded_shuffle_gets_the_agreed_seed_and_still_reshuffles():
    tf.random.set_seed(None)  # no global seed (another test may have set one)

    def make():
        return tf.data.Dataset.range(N).shuffle(N).map(lambda x: x + 0).batch(B)

    assert input_work.has_unseeded_shuffle(make())
    assert not input_work.has_unseeded_shuffle(
        tf.data.Dataset.range(N).shuffle(N, seed=1).batch(B))

    def epochs(seed):
        plan = input_work.plan(make(), owns_every_replica=False, seed=seed)
        raw = plan.raw
        return [np.concatenate(list(raw.as_numpy_iterator())) for _ in range(2)]

    first, second = epochs(7), epochs(7)  # two workers with the same agreed seed
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(np.sort(a), np.arange(N))
    assert not np.array_equal(first[0], first[1])  # a new order every epoch


def test_one_host_runs_the_pipeline_as_written(caplog):
    counter = Counter()
    dataset = per_sample_pipeline(counter)()
    plan = input_work.plan(dataset, owns_every_replica=True)
    assert plan.raw is dataset and plan.moved == 0
    with caplog.at_level(logging.INFO, logger="tf_hetbatch"):
        input_work.plan(tf.data.Dataset.range(N).batch(B).map(lambda x: x), True)
    assert not caplog.records


def test_seeded_random_augmentation_is_reproducible_and_varies_between_batches():
    def make():
        def augment(x):
            return tf.cast(x, tf.float32) + tf.random.uniform([], seed=11)

        return tf.data.Dataset.range(N).map(augment).batch(B)

    tf.random.set_seed(5)
    first, _ = worker_slices(make, 2, [2, 3, 7], moved=True)
    tf.random.set_seed(5)
    again, _ = worker_slices(make, 2, [2, 3, 7], moved=True)
    assert_same_slices(first, again)
    # The random stream goes on from slice to slice (it is not restarted per batch).
    noise = [s[0] - np.floor(s[0]) for s in first]
    assert len({round(float(n[0]), 6) for n in noise}) == len(noise)


def test_maps_under_a_seeded_shuffle_move_and_the_batches_stay_the_same():
    # map, then shuffle: the shuffle is replayed with its own seeds on the raw samples.
    counter = Counter()

    def make():
        ds = tf.data.Dataset.from_tensor_slices((np.arange(N), np.arange(N) % 5))
        ds = ds.map(lambda x, y: (counter.count(), (tf.cast(x, tf.float32) * 2.0, y))[1])
        return ds.shuffle(N, seed=4).map(lambda x, y: (x + 1.0, y)).batch(B)

    for worker in range(K):
        ours, plan = worker_slices(make, worker, [2, 3, 7], moved=True)
        own = counter.take()
        theirs, _ = worker_slices(make, worker, [2, 3, 7], moved=False)
        counter.take()
        assert plan.moved == 2
        assert_same_slices(ours, theirs)
        assert own == sum(len(s[1]) for s in ours)


def test_an_unseeded_shuffle_over_maps_is_reseeded_and_the_maps_move():
    tf.random.set_seed(None)

    def make():
        return tf.data.Dataset.range(N).map(lambda x: x * 2).shuffle(N).batch(B)

    assert input_work.has_unseeded_shuffle(make())
    plan = input_work.plan(make(), owns_every_replica=False, seed=9)
    again = input_work.plan(make(), owns_every_replica=False, seed=9)
    assert plan.moved == 1
    first = np.concatenate(list(plan.raw.as_numpy_iterator()))
    np.testing.assert_array_equal(first, np.concatenate(list(again.raw.as_numpy_iterator())))
    np.testing.assert_array_equal(np.sort(first), np.arange(N))  # raw: the map moved


def test_one_host_does_not_warn_of_an_unsplit_pipeline(cpus, caplog):
    # With one worker every replica's input is this process's: running a pipeline unsplit
    # costs nothing, so nothing is said.
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    with caplog.at_level("WARNING", logger="tf_hetbatch"):
        for _ in strategy.experimental_distribute_dataset(map_after_batch()):
            pass
    assert not [r for r in caplog.records if "runs unsplit" in r.getMessage()]
