"""Canaries for every private API use and upstream workaround in tf_hetbatch.distribute._compat.

Each test pins the upstream behaviour a workaround relies on or works around. When one fails
after an upgrade, read the matching section of _compat.py: the workaround may be obsolete
(lift it) or broken (fix it), but it must not go on silently.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch.distribute import _compat
from helpers import build_under, dense_model, regression_data, stock_mirrored


def test_supported_versions_are_the_tested_ones():
    assert tf.__version__.startswith(_compat.TESTED_TF), tf.__version__
    assert keras.__version__.startswith(_compat.TESTED_KERAS), keras.__version__


def test_keras_passes_the_bound_train_and_test_steps_to_strategy_run(cpus):
    seen = []

    class Recording(tf.distribute.MirroredStrategy):
        def __init__(self, devices):
            _compat.assign_collective_key_base(self)
            super().__init__(devices)

        def run(self, fn, args=(), kwargs=None, options=None):
            seen.append(_compat.keras_model_of_step(fn))
            return super().run(fn, args=args, kwargs=kwargs, options=options)

    strategy = Recording(cpus[:2])
    model = build_under(strategy, dense_model)
    x, y = regression_data(n=64)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    model.evaluate(x, y, batch_size=32, verbose=0)
    assert (model, "train_step") in seen and (model, "test_step") in seen


def test_stock_strategy_still_fails_with_steps_per_execution(cpus):
    """keras-team/keras#19246: while this fails, tf_hetbatch inlines the one-step function
    (`_compat.inline_multi_step`); once it passes, drop that workaround."""
    strategy = stock_mirrored(cpus[:2])
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse", steps_per_execution=4)
    x, y = regression_data(n=64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="placeholder|Placeholder"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert _compat.STEPS_PER_EXECUTION_BROKEN


def test_stock_symbolic_build_reduces_the_data_batch_and_crashes_on_uneven_shapes(cpus):
    """Why HeteroMirroredStrategy.reduce handles uneven per-replica data batches."""
    strategy = stock_mirrored(cpus[:3])
    model = build_under(strategy, dense_model)
    x, y = regression_data(n=64)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # 32 over 3 replicas
    ours = hb.HeteroMirroredStrategy(cpus[:3])
    build_under(ours, dense_model).fit(x, y, batch_size=32, epochs=1, verbose=0)


class OwnStep(keras.Sequential):
    """A model with its own train_step (Keras's order: the update inside the step)."""

    def train_step(self, data):
        return super().train_step(data)


@pytest.mark.parametrize("model_class", [keras.Sequential, OwnStep],
                         ids=["keras_train_step", "own_train_step"])
def test_loss_scale_optimizer_checks_only_the_first_replica_upstream(cpus, model_class):
    """Keras's LossScaleOptimizer applies an overflowed step if replica 0 did not overflow.
    Ours skips it on every replica: Keras's own train step checks the summed gradients
    (`weighting.finish_step`), any other step agrees on a flag
    (`_compat.agree_on_finite_gradients`)."""
    x, y = regression_data(n=32)
    x[16:] *= 1e30  # only the second replica's half overflows

    def run(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(1)
            model = model_class([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)), "mse")
        before = model.get_weights()
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        return before, model.get_weights(), float(model.optimizer.dynamic_scale.numpy())

    _, stock_after, _ = run(stock_mirrored(cpus[:2]))
    assert not all(np.all(np.isfinite(w)) for w in stock_after)  # the upstream bug

    ours = hb.HeteroMirroredStrategy(cpus[:2])
    before, after, scale = run(ours)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)  # the step is skipped on every replica
    assert scale < 32768.0  # and the loss scale lowered


def test_collective_key_base_is_read_from_the_strategy_object(cpus):
    first = hb.HeteroMirroredStrategy(cpus[:2])
    second = hb.HeteroMirroredStrategy(cpus[:2])
    keys = [s.extended._collective_keys._group_key for s in (first, second)]
    assert keys[0] != keys[1]
    assert abs(keys[0] - keys[1]) >= _compat._COLLECTIVE_KEY_STRIDE


def test_static_batch_size_inference():
    ds = tf.data.Dataset.range(100).batch(32)
    assert _compat.static_batch_size(ds) == 32
    assert _compat.static_batch_size(ds.prefetch(2)) == 32
    assert _compat.static_batch_size(ds.map(lambda t: t + 1)) is None  # falls back to run time


def test_all_layers_walks_nested_models():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization()])
    outer = keras.Sequential([keras.Input((4,)), inner, keras.layers.Dense(1)])
    kinds = [type(layer).__name__ for layer in _compat.all_layers(outer)]
    assert "BatchNormalization" in kinds and "Dense" in kinds


def test_coordinator_internals_used_for_per_worker_iterators_exist():
    """`_compat.per_worker_iterator` and the step-status checks use these internals."""
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc
    from tensorflow.python.distribute.coordinator import remote_value as rv
    from tensorflow.python.distribute.coordinator import values as cv

    assert callable(getattr(cc.Worker, "create_resource", None))
    assert hasattr(cv, "PerWorkerDistributedIterator")
    assert {"NOT_READY", "READY", "ABORTED"} <= set(rv.RemoteValueStatus.__members__)
    value = cv.RemoteValueImpl(None, None)
    assert value._status is rv.RemoteValueStatus.NOT_READY
    assert not _compat.remote_value_done(value)
    _compat.wait_remote_value(value, timeout=0.01)  # an event with a timeout: returns
    value._set_values(tf.constant(1))
    assert _compat.remote_value_done(value)


def test_keras_variable_assign_add_is_read_modify_write_upstream():
    """keras-team/keras#18668: Keras 3 `Variable.assign_add` is `assign(self + value)`, so
    concurrent asynchronous updates can lose increments of `optimizer.iterations`. The
    parameter-server strategy therefore counts updates in a tf.Variable of its own
    (`HeteroParameterServerStrategy.updates`, one atomic AssignAddVariableOp per update)."""
    import inspect

    source = inspect.getsource(keras.Variable.assign_add)
    assert "self.assign(self + value)" in source, source


def test_keras_distributes_data_from_fit_evaluate_and_predict_iterators(cpus):
    """`_compat.keras_loop_distributing_data`: Keras 3 distributes every dataset from a
    `TFEpochIterator` built in fit (training first, then validation inside the epoch loop),
    evaluate or predict. Evaluation data of any batch size relies on telling them apart."""
    seen = []

    class Recording(tf.distribute.MirroredStrategy):
        def __init__(self, devices):
            _compat.assign_collective_key_base(self)
            super().__init__(devices)

        def experimental_distribute_dataset(self, dataset, options=None):
            seen.append(_compat.keras_loop_distributing_data())
            return super().experimental_distribute_dataset(dataset, options)

    strategy = Recording(cpus[:2])
    model = build_under(strategy, dense_model)
    x, y = regression_data(n=64)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0,
              validation_data=(x, y), validation_batch_size=16)
    model.evaluate(x, y, batch_size=8, verbose=0)
    model.predict(x, batch_size=16, verbose=0)
    strategy.experimental_distribute_dataset(tf.data.Dataset.range(4).batch(2))  # custom loop
    # The validation iterator is built once per fit and cached by Keras.
    assert seen == ["train", "validation", "evaluate", "predict", None]
    assert set(_compat.EVALUATION_LOOPS) == {"validation", "evaluate", "predict"}


def _dataset_graph(dataset):
    """The GraphDef TensorFlow serializes `dataset` to: its ops and its function library."""
    serialized = tf.raw_ops.DatasetToGraphV2(input_dataset=dataset._variant_tensor)
    return tf.compat.v1.GraphDef.FromString(serialized.numpy())


def test_the_splits_tf_data_functions_run_inline_as_host_functions():
    # The split's bookkeeping runs through _compat.map_inline and its flattening through
    # _compat.flat_map_host: functions with the single-device attribute (no Grappler pass at
    # every iterator's instantiation), the map run without inter-op threads. If TensorFlow
    # drops the private pieces, they fall back to Dataset.map / flat_map (correct, slower):
    # fail here first.
    counter = tf.Variable(tf.constant(0, tf.int64))

    def bookkeeping(position, element):
        # What the split does per batch: variable updates, an unguarded assert, no tf.cond.
        produced = counter.assign_add(1, read_value=True)
        check = tf.raw_ops.Assert(condition=position < 100, data=["position", position])
        with tf.control_dependencies([check]):
            return tf.data.Dataset.from_tensors((produced, element * 2))

    mapped = _compat.map_inline(tf.data.Dataset.range(5).enumerate(), bookkeeping)
    ds = _compat.flat_map_host(mapped, lambda slices: slices)
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


def _get_next_op_types(distributed):
    iterator = iter(distributed)

    @tf.function
    def get_next():
        return iterator.get_next()

    return {op.type for op in get_next.get_concrete_function().graph.get_operations()}


def test_partial_batch_handling_is_a_per_dataset_flag_read_by_its_iterators(cpus):
    # _compat.disable_partial_batch_handling sets a private flag of TensorFlow's distributed
    # dataset. Finite data of unknown batch shape gets the per-step optional + cond by default;
    # if the flag goes, our iterators silently get it back (correct, slower; across workers a
    # collective before every step).
    strategy = stock_mirrored(cpus[:2])
    data = tf.data.Dataset.range(10).batch(3)  # a partial last batch: shape [None]

    def per_worker(_):
        return data

    assert "OptionalHasValue" in _get_next_op_types(
        strategy.distribute_datasets_from_function(per_worker)
    )
    disabled = _compat.disable_partial_batch_handling(
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
    # _compat.plain_iterators replaces the options a distributed dataset's iterators read: a
    # worker's one CPU replica then reads a plain iterator, not a MultiDeviceIterator (which
    # every PER_WORKER iterator gets upstream, also for one device). If TensorFlow stops
    # reading them there, the multi-device iterator comes back (correct, slower).
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
    # _compat.next_as_optional (Keras's multi-step loop, steps_per_execution > 1) rebuilds
    # TensorFlow's get_next_as_optional without the replica count from private parts of the
    # distributed iterator. It must yield what get_next yields, then an empty optional; if
    # those parts go, it falls back to TensorFlow's own (correct, with the count).
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
        optional = _compat.next_as_optional(it)
        if optional.has_value():
            return True, [tf.size(t) for t in ours.experimental_local_results(
                optional.get_value())]
        return False, [tf.constant(-1)] * 3

    seen = []
    for _ in range(5):
        has, sizes = take(iterator)
        seen.append([int(s) for s in sizes] if bool(has) else None)
    assert seen == [[2, 0, 1], [2, 0, 1], [2, 0, 1], [1, 0, 0], None]


def test_tf_data_pipeline_structure_is_readable_from_its_python_objects():
    # distribute.input_work moves per-sample maps after the split by reading this structure.
    ds = tf.data.Dataset.from_tensor_slices(np.arange(10)).shuffle(10, seed=1)
    ds = ds.map(lambda x: x * 2, num_parallel_calls=3, deterministic=False).batch(4).prefetch(2)
    steps = _compat.pipeline_steps(ds)
    assert [s.kind for s in steps] == ["prefetch", "batch", "map", "shuffle", "other"]
    prefetch, batch, mapped, shuffle, _ = steps
    assert prefetch.buffer_size == 2
    assert (batch.batch_size, batch.drop_remainder) == (4, False)
    assert (mapped.num_parallel_calls, mapped.deterministic) == (3, False)
    assert callable(mapped.map_function)
    assert shuffle.buffer_size == 10 and shuffle.seeded
    tf.random.set_seed(None)  # no global seed (another test may have set one)
    unseeded = _compat.pipeline_steps(tf.data.Dataset.range(4).shuffle(4))[0]
    assert unseeded.kind == "shuffle" and not unseeded.seeded
    # The replayed map is the same traced function on a new input.
    replayed = _compat.replay_map(tf.data.Dataset.from_tensor_slices(np.arange(5)), mapped)
    assert replayed._map_func.function is mapped.dataset._map_func.function
    assert list(replayed.as_numpy_iterator()) == [0, 2, 4, 6, 8]
    # A shuffle replayed over another input gives the original's order.
    step = _compat.pipeline_steps(tf.data.Dataset.range(20).shuffle(20, seed=5))[0]
    replayed = _compat.replay_shuffle(step, tf.data.Dataset.range(20))
    fresh = tf.data.Dataset.range(20).shuffle(20, seed=5)
    assert list(replayed.as_numpy_iterator()) == list(fresh.as_numpy_iterator())
    # The split marker adds no op.
    marked = _compat.mark_split(ds)
    assert marked._variant_tensor is ds._variant_tensor
    assert _compat.pipeline_steps(marked)[0].kind == "split_marker"


def test_keras_array_input_is_index_batches_zipped_with_the_arrays_then_gathered():
    from keras.src.trainers.data_adapters import array_data_adapter

    adapter = array_data_adapter.ArrayDataAdapter(
        np.zeros((10, 3), "float32"), np.arange(10), batch_size=4, shuffle=True
    )
    steps = _compat.pipeline_steps(adapter.get_tf_dataset())
    assert [s.kind for s in steps] == ["prefetch", "options", "options", "map", "other"]
    found = _compat.keras_array_gather(steps[3])
    assert found is not None
    indices, arrays = found
    assert indices.element_spec.shape.rank == 1 and indices.element_spec.dtype == tf.int64
    assert type(arrays).__name__ == "_RepeatDataset"


def test_coordination_barrier_is_the_context_method():
    """`_compat.wait_at_coordination_barrier` (tensorflow/tensorflow#58434, used by
    tf_hetbatch.distribute.clean_exit at exit): the eager context's `wait_at_barrier(barrier_id,
    timeout_in_ms)` reaches the coordination service's barrier; in a process without one it
    fails at once (test_clean_exit runs the barrier in a real two-worker job)."""
    import inspect

    from tensorflow.python.eager import context

    params = list(inspect.signature(context.Context.wait_at_barrier).parameters)
    assert params == ["self", "barrier_id", "timeout_in_ms"]
    with pytest.raises(tf.errors.FailedPreconditionError, match="Coordination service"):
        _compat.wait_at_coordination_barrier("tf_hetbatch/canary", timeout_s=1)


def test_coordination_key_value_store_is_the_context_api():
    # Canary of the private API a multi-worker preemption notice agrees through
    # (_compat.insert_coordination_key, _compat.get_coordination_key).
    import inspect

    from tensorflow.python.eager import context

    ctx = context.context()
    assert callable(ctx.set_config_key_value)
    assert "timeout_in_ms" in inspect.signature(ctx.get_config_key_value).parameters


def test_a_second_multi_worker_strategy_with_peers_is_warned_of(caplog):
    # Without peers nothing is said (the suite's own strategies); with peers the second is.
    with caplog.at_level("WARNING", logger="tf_hetbatch.distribute._compat"):
        _compat.warn_if_second_multi_worker_strategy(1)
        assert not caplog.records
        _compat.warn_if_second_multi_worker_strategy(3)
        _compat.warn_if_second_multi_worker_strategy(3)
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_keras_train_step_does_nothing_after_the_update_but_the_metrics():
    """Why the update of Keras's own train step may wait for the step's one all-reduce
    (`weighting.finish_step`): after `apply_gradients` it only computes and returns the
    metrics. If Keras changes the step, this fails: re-check `is_keras_own_train_step`."""
    import inspect

    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    source = inspect.getsource(TensorFlowTrainer.train_step)
    assert source.count("apply_gradients(") == 1
    after = [line.strip() for line in source.split("apply_gradients(", 1)[1].splitlines()[1:]]
    assert [line for line in after if line and not line.startswith("#")] == [
        "else:",
        'warnings.warn("The model does not have any trainable weights.")',
        "return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)",
    ]
    assert _compat.is_keras_own_train_step(keras.Sequential().train_step)
    assert not _compat.is_keras_own_train_step(OwnStep().train_step)


def test_tensorflow_feeds_a_collective_a_new_instance_key_at_every_call():
    """Why the step's all-reduce gets its keys from `instance_keys_from_values`: TensorFlow's
    launcher feeds the instance key at every call (so a cluster resolves every step's
    collective anew, through task 0). If the first assert fails, TensorFlow fixed keys at trace
    time itself: re-measure bench_fixed_cost without the adaptation. Traced only: no group."""
    from tensorflow.python.distribute import collective_util
    from tensorflow.python.distribute import cross_device_utils

    keys = cross_device_utils.CollectiveKeys(group_key_start=7)
    launcher = cross_device_utils.CollectiveReplicaLauncher(
        keys.get_group_key(["/cpu:0"]), 2, keys, "/cpu:0", collective_util.Options())
    values = [tf.ones([3]), tf.ones([2, 2])]

    def instance_keys(fn):  # the instance key input of each all-reduce traced by fn
        graph = tf.function(fn).get_concrete_function().graph
        ops = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
        return [int(tf.get_static_value(op.inputs[3])) if op.inputs[3].op.type == "Const"
                else op.inputs[3].op.type for op in ops]

    def two_sums():
        return [launcher.all_reduce(v) for v in values]

    assert instance_keys(two_sums) == ["Placeholder", "Placeholder"]  # fed at every call
    with _compat.instance_keys_from_values([launcher], values):
        first, second = instance_keys(two_sums), instance_keys(two_sums)
    assert all(isinstance(k, int) and k >= 2 ** 30 for k in first), first
    assert first == second  # the same keys whenever (and wherever) it is traced
    assert first[0] != first[1]  # distinct collectives of one function: distinct keys
    with _compat.instance_keys_from_values([launcher], values[:1]):
        assert instance_keys(lambda: launcher.all_reduce(values[0])) != first[:1]  # other shapes
    assert instance_keys(two_sums) == ["Placeholder", "Placeholder"]  # outside: TensorFlow's


def test_destroying_a_used_iterator_releases_the_gil():
    # iterator_release destroys used iterators on a thread of its own, because their
    # destruction can wait seconds for tf.data's autotuning thread. That keeps the training
    # loop going only while TensorFlow releases the GIL as it destroys a tensor handle
    # (EagerTensor_dealloc). Here a destruction waits for two map calls in flight (chains of
    # matrix products); the main thread must run Python meanwhile.
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
