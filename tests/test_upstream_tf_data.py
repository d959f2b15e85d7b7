"""Canaries of `_upstream.tf_data`: tf.data internals the input split reads and builds on.

When one fails after an upgrade, read the matching section of
`tf_hetbatch/distribute/_upstream/tf_data.py`: the workaround may be obsolete
(lift it) or broken (fix it), but it must not go on silently.
"""

import numpy as np
import pytest
import tensorflow as tf

from tf_hetbatch.distribute._upstream import tf_data


def test_static_batch_size_inference():
    """`tf_data.static_batch_size`: tf.data's private `compute_batch_size` finds a pipeline's
    last batch through transformations that keep it, and gives up (None) where one may not."""
    ds = tf.data.Dataset.range(100).batch(32)
    assert tf_data.static_batch_size(ds) == 32
    assert tf_data.static_batch_size(ds.prefetch(2)) == 32
    assert tf_data.static_batch_size(ds.map(lambda t: t + 1)) is None  # falls back to run time


def test_static_batch_size_in_a_graph_is_unknown():
    """`tf_data.static_batch_size` while a graph is built (a v1 graph, a tf.function): the
    inference is an op that does not fold to a constant, so None (the split then takes each
    batch's size at run time). If this starts to give 32, graphs learn the batch size too."""
    with tf.Graph().as_default():
        assert tf_data.static_batch_size(tf.data.Dataset.range(100).batch(32)) is None
    seen = []

    @tf.function
    def infer():
        seen.append(tf_data.static_batch_size(tf.data.Dataset.range(100).batch(32)))
        return 0

    infer()
    assert seen == [None]


def _dataset_graph(dataset):
    """The GraphDef TensorFlow serializes `dataset` to: its ops and its function library."""
    serialized = tf.raw_ops.DatasetToGraphV2(input_dataset=dataset._variant_tensor)
    return tf.compat.v1.GraphDef.FromString(serialized.numpy())


def test_the_splits_tf_data_functions_run_inline_as_host_functions():
    """The split's bookkeeping runs through `tf_data.map_inline` and its flattening through
    `tf_data.flat_map_host`: functions with the single-device attribute (no Grappler pass at
    every iterator's instantiation), the map run without inter-op threads. If TensorFlow
    drops the private pieces, they fall back to Dataset.map / flat_map (correct, slower):
    fail here first."""
    counter = tf.Variable(tf.constant(0, tf.int64))

    def bookkeeping(position, element):
        # What the split does per batch: variable updates, an unguarded assert, no tf.cond.
        produced = counter.assign_add(1, read_value=True)
        check = tf.raw_ops.Assert(condition=position < 100, data=["position", position])
        with tf.control_dependencies([check]):
            return tf.data.Dataset.from_tensors((produced, element * 2))

    mapped = tf_data.map_inline(tf.data.Dataset.range(5).enumerate(), bookkeeping)
    ds = tf_data.flat_map_host(mapped, lambda slices: slices)
    assert ds.element_spec == (tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64))
    assert [tuple(int(v) for v in e) for e in ds] == [(i + 1, 2 * i) for i in range(5)]
    assert int(counter.numpy()) == 5

    graph = _dataset_graph(ds)
    ops = {node.op: node for node in graph.node}
    assert ops["MapDataset"].attr["use_inter_op_parallelism"].b is False
    functions = {f.signature.name: f for f in graph.library.function}
    for op in ("MapDataset", "FlatMapDataset"):
        attrs = functions[ops[op].attr["f"].func.name].attr
        assert attrs["experimental_ints_on_device"].b is True, op
    # A user's map keeps tf.data's default (multi-device, optimized).
    user = _dataset_graph(tf.data.Dataset.range(5).map(lambda v: v + 1))
    assert all("experimental_ints_on_device" not in f.attr for f in user.library.function)


def test_tf_data_pipeline_structure_is_readable_from_its_python_objects():
    """`tf_data.pipeline_steps`, `replay_map`, `replay_shuffle`, `mark_split`:
    distribute.input_work moves per-sample maps after the split by reading this structure."""
    ds = tf.data.Dataset.from_tensor_slices(np.arange(10)).shuffle(10, seed=1)
    ds = ds.map(lambda x: x * 2, num_parallel_calls=3, deterministic=False).batch(4).prefetch(2)
    steps = tf_data.pipeline_steps(ds)
    assert [s.kind for s in steps] == ["prefetch", "batch", "map", "shuffle", "other"]
    prefetch, batch, mapped, shuffle, _ = steps
    assert prefetch.buffer_size == 2
    assert (batch.batch_size, batch.drop_remainder) == (4, False)
    assert (mapped.num_parallel_calls, mapped.deterministic) == (3, False)
    assert callable(mapped.map_function)
    assert shuffle.buffer_size == 10 and shuffle.seeded
    tf.random.set_seed(None)  # no global seed (another test may have set one)
    unseeded = tf_data.pipeline_steps(tf.data.Dataset.range(4).shuffle(4))[0]
    assert unseeded.kind == "shuffle" and not unseeded.seeded
    # The replayed map is the same traced function on a new input.
    replayed = tf_data.replay_map(tf.data.Dataset.from_tensor_slices(np.arange(5)), mapped)
    assert replayed._map_func.function is mapped.dataset._map_func.function
    assert list(replayed.as_numpy_iterator()) == [0, 2, 4, 6, 8]
    # A shuffle replayed over another input gives the original's order.
    step = tf_data.pipeline_steps(tf.data.Dataset.range(20).shuffle(20, seed=5))[0]
    replayed = tf_data.replay_shuffle(step, tf.data.Dataset.range(20))
    fresh = tf.data.Dataset.range(20).shuffle(20, seed=5)
    assert list(replayed.as_numpy_iterator()) == list(fresh.as_numpy_iterator())
    # The split marker adds no op.
    marked = tf_data.mark_split(ds)
    assert marked._variant_tensor is ds._variant_tensor
    assert tf_data.pipeline_steps(marked)[0].kind == "split_marker"


def test_keras_array_input_is_index_batches_zipped_with_the_arrays_then_gathered():
    """`tf_data.keras_array_gather`: Keras's array input is index batches zipped with the
    repeated arrays, gathered by `grab_batch` (a worker gathers only its replicas' rows)."""
    from keras.src.trainers.data_adapters import array_data_adapter

    adapter = array_data_adapter.ArrayDataAdapter(
        np.zeros((10, 3), "float32"), np.arange(10), batch_size=4, shuffle=True
    )
    steps = tf_data.pipeline_steps(adapter.get_tf_dataset())
    assert [s.kind for s in steps] == ["prefetch", "options", "options", "map", "other"]
    found = tf_data.keras_array_gather(steps[3])
    assert found is not None
    indices, arrays = found
    assert indices.element_spec.shape.rank == 1 and indices.element_spec.dtype == tf.int64
    assert type(arrays).__name__ == "_RepeatDataset"


def test_map_and_batch_fusion_still_fails_on_two_stateful_chains_in_one_function(cpus):
    """`tf_data.without_map_and_batch_fusion`: a flat_map whose function builds two
    `map(f).batch(n)` chains, f capturing a variable (a worker hosting two replicas, per-sample
    maps after the split), fails when a multi-device iterator is created, unless the fusion is
    off. When the first half stops raising, the workaround can go."""
    from tensorflow.python.data.ops import multi_device_iterator_ops

    counted = tf.Variable(0, dtype=tf.int64)

    def per_sample(x):
        counted.assign_add(1)
        return x * 2.0

    def two_slices(batch):
        chains = [tf.data.Dataset.from_tensor_slices(part).map(per_sample).batch(4)
                  for part in tf.split(batch, 2)]
        return chains[0].concatenate(chains[1])

    data = tf.data.Dataset.from_tensor_slices(np.ones((16, 3), "float32")).batch(8)
    data = data.flat_map(two_slices)
    with pytest.raises(tf.errors.InvalidArgumentError, match="retained fanouts"):
        multi_device_iterator_ops.MultiDeviceIterator(data, cpus[:2])
    iterator = multi_device_iterator_ops.MultiDeviceIterator(
        tf_data.without_map_and_batch_fusion(data), cpus[:2])
    assert [t.shape.as_list() for t in iterator.get_next()] == [[4, 3], [4, 3]]


def test_a_shuffle_says_whether_it_reshuffles_each_iteration():
    """`tf_data.reshuffles_each_iteration` finds a shuffle by its class (`_ShuffleDataset`)
    through the transformations above it and reads its `_reshuffle_each_iteration`: if
    TensorFlow renames the class, no pipeline reads as reshuffling and a resumed run's other
    order goes unsaid; if it renames the attribute, every shuffle reads as reshuffling."""
    data = tf.data.Dataset.range(8)
    assert tf_data.reshuffles_each_iteration(data.shuffle(8, seed=1).map(lambda t: t).batch(2))
    assert not tf_data.reshuffles_each_iteration(
        data.shuffle(8, seed=1, reshuffle_each_iteration=False).batch(2).prefetch(1))
    assert not tf_data.reshuffles_each_iteration(data.batch(2))
    assert tf.data.Dataset.range(8).shuffle(8)._reshuffle_each_iteration is True
