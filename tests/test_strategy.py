"""HeteroMirroredStrategy behaviour: the split, changing it mid-fit, evaluate/predict, errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from helpers import (
    BatchLogs,
    ShapeRecorder,
    Sink,
    build_under,
    dense_model,
    max_weight_diff,
    regression_data,
    stock_mirrored,
)


def recording_model(sink, seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((8,)), ShapeRecorder(sink), keras.layers.Dense(4, activation="tanh"),
         keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


class CountingModel(keras.Sequential):
    """Counts traces of train_step (Python runs only while tracing)."""

    traces = 0

    def train_step(self, data):
        CountingModel.traces += 1
        return super().train_step(data)


def test_replicas_receive_the_sizes_set(cpus):
    sink = Sink()
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([5, 0, 27])
    model = build_under(strategy, recording_model, sink=sink)
    x, y = regression_data(n=128)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    per_replica = {}
    for replica, n in sink.items:
        per_replica.setdefault(replica, []).append(n)
    assert per_replica == {0: [5] * 4, 1: [0] * 4, 2: [27] * 4}
    assert strategy.batch_sizes == (5, 0, 27)
    np.testing.assert_array_equal(strategy.read_replica_times().samples, [20, 0, 108])


def test_change_mid_fit_applies_within_a_few_steps_without_retrace(cpus):
    x, y = regression_data(n=640)
    ref = dense_model()
    ref.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)

    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([16, 8, 8])
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = CountingModel(
            [keras.Input((8,)),
             keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2)),
             keras.layers.Dense(1)]
        )
        model.compile(keras.optimizers.SGD(0.05), "mse", metrics=["mae"])
    seen, timed = [], []

    class Switch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times = strategy.read_replica_times(reset=True)
            seen.append(tuple(times.samples))
            timed.append(tuple(times.timed_steps))
            if batch == 4:
                self.traces_before = CountingModel.traces
                strategy.set_batch_sizes([2, 10, 20])

    switch = Switch()
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[switch])
    assert CountingModel.traces == switch.traces_before  # no retrace after the change
    first_new = seen.index((2.0, 10.0, 20.0))
    assert 5 <= first_new <= 9, seen  # lands a few steps later (prefetch)
    assert all(s == (16.0, 8.0, 8.0) for s in seen[:first_new])
    assert all(s == (2.0, 10.0, 20.0) for s in seen[first_new:])
    # The first step at each replica's new shape builds what the shape needs (cuDNN's
    # autotuning on a GPU, oneDNN's primitives here): its compute is not timed; the first
    # step of the fit is one such step.
    untimed = [i for i, t in enumerate(timed) if t != (1.0, 1.0, 1.0)]
    assert untimed == [0, first_new] and timed[0] == timed[first_new] == (0.0, 0.0, 0.0)
    # Whatever the split and whenever it changed, the maths is one device on the global batch.
    assert max_weight_diff(ref, model) <= 1e-5


def test_evaluate_and_predict_match_one_device_in_input_order(cpus):
    x, y = regression_data(n=100)  # B=32: three full batches and a short one of 4
    ref = dense_model()
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([3, 7, 22])
    ours = build_under(strategy, dense_model)
    np.testing.assert_allclose(
        ours.predict(x, batch_size=32, verbose=0), ref.predict(x, batch_size=32, verbose=0),
        rtol=1e-6, atol=1e-6,
    )
    ref_eval = ref.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    our_eval = ours.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    for key in ref_eval:
        assert our_eval[key] == pytest.approx(ref_eval[key], rel=1e-5)


def test_several_strategies_in_one_process(cpus):
    x, y = regression_data()
    ref = dense_model()
    ref.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    first = hb.HeteroMirroredStrategy(cpus[:3])
    second = hb.HeteroMirroredStrategy(cpus[1:4])
    first.set_batch_sizes([3, 7, 22])
    second.set_batch_sizes([20, 2, 10])
    models = [build_under(s, dense_model) for s in (first, second)]
    for _ in range(2):  # interleaved epochs
        for m in models:
            m.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for m in models:
        assert max_weight_diff(ref, m) <= 1e-5


def test_read_replica_times_accumulates_and_resets(cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    strategy.set_batch_sizes([12, 20])
    model = build_under(strategy, dense_model)
    x, y = regression_data(n=96)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    times = strategy.read_replica_times(reset=True)
    np.testing.assert_array_equal(times.steps, [3, 3])
    np.testing.assert_array_equal(times.timed_steps, [2, 2])  # not the first, at a new shape
    np.testing.assert_array_equal(times.samples_per_step, [12, 20])
    assert np.all(times.compute_seconds > 0)
    # Step cycles, release to release, each carried by the next step's all-reduce: of 3 steps,
    # the first closes none and the third's is carried by a later step. The cluster's step
    # time is the longest replica's mean cycle.
    np.testing.assert_array_equal(times.cycles, [1, 1])
    assert times.step_time == pytest.approx(np.max(times.cycle_seconds))
    assert np.all(times.cycle_time > 0)
    assert np.all(strategy.read_replica_times().steps == 0)
    assert strategy.read_replica_times().step_time is None


def test_a_read_with_reset_counts_only_the_cycles_wholly_after_it(cpus):
    # A measurement window's step time holds neither the split before it nor the host's work
    # between two reads (a controller's update, a switch): of the 4 steps after a read,
    # the first two carry no cycle (the one before the read, and the one across it).
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model = build_under(strategy, dense_model)
    x, y = regression_data(n=192)
    reads = []
    read = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: reads.append(
        strategy.read_replica_times(reset=True)) if batch == 1 else None)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[read])
    window = strategy.read_replica_times(reset=True)
    np.testing.assert_array_equal(reads[0].steps, [2, 2])
    np.testing.assert_array_equal(reads[0].cycles, [0, 0])
    np.testing.assert_array_equal(window.steps, [4, 4])
    np.testing.assert_array_equal(window.cycles, [2, 2])
    assert np.all(window.cycle_time > 0)


@pytest.mark.parametrize(
    "sizes, match",
    [
        ([16, 16], "one entry per replica"),
        ([40, -4, -4], "batch_sizes"),
        ([10.5, 10.5, 11], "batch_sizes"),
        (["a", 1, 2], "batch_sizes"),
    ],
)
def test_bad_batch_sizes_are_rejected_with_the_value(cpus, sizes, match):
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    with pytest.raises(ValueError, match=match) as info:
        strategy.set_batch_sizes(sizes)
    assert "Received" in str(info.value)


def test_sizes_not_summing_to_the_data_batch_fail_when_the_data_arrives(cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([10, 10, 10])
    model = build_under(strategy, dense_model)
    x, y = regression_data(n=128)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"global batch size 32.*sum 30"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # nothing trained, nothing lost
    strategy.set_batch_sizes([10, 10, 12])
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    # Set after the data: kept for the next training data, whose batch size it must match.
    strategy.set_batch_sizes([10, 10, 11])
    assert strategy.batch_sizes == (10, 10, 11)
    with pytest.raises(ValueError, match=r"global batch size 32.*sum 31"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_a_later_fit_with_another_global_batch(cpus, caplog):
    x, y = regression_data(n=256)
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model = build_under(strategy, dense_model)
    strategy.set_batch_sizes([96, 32])
    model.fit(x, y, batch_size=128, epochs=1, shuffle=False, verbose=0)
    ref = _one_device_copy(model)
    # The split of the earlier fit is re-made for the new global batch in its proportions.
    with caplog.at_level("INFO", logger="tf_hetbatch"):
        model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert strategy.batch_sizes == (48, 16)
    assert [r.levelname for r in caplog.records if "re-split" in r.message] == ["INFO"]
    ref.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) <= 1e-5
    times = strategy.read_replica_times()
    np.testing.assert_array_equal(times.samples, [96 * 2 + 48 * 4, 32 * 2 + 16 * 4])
    # A split set between fits for the next data's batch size applies to it.
    strategy.set_batch_sizes([8, 24])
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    ref.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) <= 1e-5
    np.testing.assert_array_equal(strategy.read_replica_times().samples - times.samples,
                                  [8 * 8, 24 * 8])


@pytest.mark.parametrize("first", ["arrays", "dataset"])
def test_a_later_fit_at_another_batch_after_arrays_with_a_partial_batch(cpus, first):
    # 100 rows: Keras's array input then ends each epoch with a short batch, and tf.data
    # cannot infer its batch size; the strategy takes it from Keras's data adapter.
    x, y = regression_data(n=100)
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model = build_under(strategy, dense_model)
    strategy.set_batch_sizes([10, 22])
    if first == "arrays":
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    else:
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=1, verbose=0)
    ref = _one_device_copy(model)
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert strategy.batch_sizes == (5, 11)
    ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_weight_diff(ref, model) <= 1e-5


def test_data_batched_by_a_users_dataset_function_is_said_not_to_follow_the_split(cpus,
                                                                                   caplog):
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    x, y = regression_data(n=64)
    with caplog.at_level("WARNING", logger="tf_hetbatch"):
        for _ in range(2):
            strategy.distribute_datasets_from_function(
                lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).batch(
                    ctx.get_per_replica_batch_size(32)))
    assert [r.levelname for r in caplog.records
            if "does not reach it" in r.message] == ["WARNING"]


def test_data_batched_by_another_size_fails_at_the_second_batch(cpus):
    # .map after .batch hides the batch size from tf.data, so this is caught in the pipeline.
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([10, 10, 12])
    model = build_under(strategy, dense_model)
    x, y = regression_data(n=128)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).map(lambda a, b: (a, b))
    with pytest.raises(tf.errors.InvalidArgumentError, match="followed a short one"):
        model.fit(ds, epochs=1, verbose=0)


def test_unbatched_and_distributed_data_are_rejected(cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    x, y = regression_data(n=64)
    with pytest.raises(ValueError, match="must be batched"):
        strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y[:, 0])))
    with pytest.raises(ValueError, match="must be batched"):
        strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)))
    distributed = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    )
    with pytest.raises(ValueError, match="already distributed"):
        strategy.experimental_distribute_dataset(distributed)
    with pytest.raises(TypeError, match="tf.data.Dataset"):
        strategy.experimental_distribute_dataset([x, y])
    per_replica = tf.distribute.InputOptions(
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
        experimental_place_dataset_on_device=False,
    )
    with pytest.raises(ValueError, match="PER_WORKER"):
        strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(32), per_replica
        )


def test_empty_replica_with_plain_batch_norm_is_refused(cpus):
    def model_fn():
        keras.utils.set_random_seed(1)
        m = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
             keras.layers.Dense(1)]
        )
        m.compile("sgd", "mse")
        return m

    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([0, 10, 22])
    model = build_under(strategy, model_fn)
    x, y = regression_data(n=64)
    with pytest.raises(ValueError, match="at least 1 sample.*batch_sizes=\\[0, 10, 22\\]"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    strategy.set_batch_sizes([4, 6, 22])
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="at least 1 sample"):
        strategy.set_batch_sizes([0, 16, 16])
    # A partial last batch of 1 sample leaves two replicas empty: refused in the step, before
    # its work runs, so no NaN statistics reach the weights.
    x, y = regression_data(n=33)
    with pytest.raises(tf.errors.InvalidArgumentError, match="A replica got an empty batch"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_steps_per_execution_with_data_distributed_by_hand_is_refused_clearly(cpus):
    # Keras's own loops get the keras#19246 workaround; a dataset the user distributed
    # bypasses the strategy's hook, so the step refuses it instead of failing deep in TF.
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse", steps_per_execution=4)
    x, y = regression_data(n=64)
    data = strategy.distribute_datasets_from_function(
        lambda _: tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    with pytest.raises(ValueError, match="steps_per_execution.*19246"):
        model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)


def test_custom_loop_with_global_batch_loss_scaling_is_exact(cpus):
    x, y = regression_data(n=64)
    ref = dense_model(regularize=False)
    ref.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([3, 7, 22])
    model = build_under(strategy, dense_model, regularize=False)
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    )

    @tf.function
    def step(batch):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=32)
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.apply(grads, model.trainable_variables)

        strategy.run(replica_fn, args=batch)

    for batch in dist:
        step(batch)
    assert max_weight_diff(ref, model) <= 1e-5


def _conformance_body(strategy):
    x, y = regression_data(n=192)
    model = build_under(strategy, dense_model)
    logs = BatchLogs()
    hist = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[logs])
    return {
        "weights": np.concatenate([np.ravel(w) for w in model.get_weights()]),
        "history": hist.history,
        "eval": model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True),
        "predict": model.predict(x[:50], batch_size=32, verbose=0),
        "batch_losses": [b["loss"] for b in logs.batches],
    }


def test_conformance_even_split_matches_stock(cpus):
    """The same body against the stock strategy and ours: identical results with an even split."""
    stock = _conformance_body(stock_mirrored(cpus[:2]))
    ours = _conformance_body(hb.HeteroMirroredStrategy(cpus[:2]))
    np.testing.assert_allclose(ours["weights"], stock["weights"], rtol=0, atol=1e-6)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(ours["history"][key], stock["history"][key], rtol=1e-6)
    for key in stock["eval"]:
        assert ours["eval"][key] == pytest.approx(stock["eval"][key], rel=1e-6)
    np.testing.assert_allclose(ours["predict"], stock["predict"], rtol=1e-6)
    np.testing.assert_allclose(ours["batch_losses"], stock["batch_losses"], rtol=1e-6)


# ----------------------------------------------------------------- evaluation data -----------
# Evaluation and prediction data of any batch size is split in proportion to `batch_sizes`;
# only training data must be batched by sum(batch_sizes).


class EvalBatchLogs(keras.callbacks.Callback):
    """Records the per-batch logs of evaluation (what callbacks and the progress bar see)."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_test_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs))


def _one_device_copy(model):
    ref = dense_model()
    ref.set_weights(model.get_weights())
    return ref


def test_fit_validation_of_another_batch_size_matches_one_device(cpus):
    x, y = regression_data(n=320)
    xv, yv = regression_data(n=130, seed=3)  # batches of 50, 50 and 30
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([3, 7, 22])
    model = build_under(strategy, dense_model)
    epoch_weights = []

    class Weights(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            epoch_weights.append(self.model.get_weights())

    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    val = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(50)
    hist = model.fit(train, validation_data=val, epochs=2, shuffle=False, verbose=0,
                     callbacks=[Weights()])
    assert strategy.batch_sizes == (3, 7, 22) and strategy.global_batch_size == 32
    ref = dense_model()
    for epoch, weights in enumerate(epoch_weights):
        ref.set_weights(weights)
        expected = ref.evaluate(xv, yv, batch_size=50, verbose=0, return_dict=True)
        for key, value in expected.items():
            assert hist.history[f"val_{key}"][epoch] == pytest.approx(value, rel=1e-5, abs=1e-5)
    # The training data's checks are untouched by the validation data seen in between: a
    # split summing to 31 waits for training data batched by 31.
    strategy.set_batch_sizes([10, 10, 11])
    with pytest.raises(ValueError, match=r"global batch size 32.*sum 31"):
        model.fit(train, epochs=1, verbose=0)


@pytest.mark.parametrize("batch", [2, 20, 50, 512], ids=lambda b: f"batch{b}")
def test_evaluate_any_batch_size_matches_one_device(cpus, batch):
    # n=131: a partial last batch for 2, 20 and 50; one batch smaller than the data for 512.
    # Batches of 2 over [3, 7, 22] leave replica 0 empty.
    x, y = regression_data(n=131, seed=4)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([3, 7, 22])
    ours = build_under(strategy, dense_model)
    ref = _one_device_copy(ours)
    ref_logs, logs = EvalBatchLogs(), EvalBatchLogs()
    expected = ref.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True,
                            callbacks=[ref_logs])
    got = ours.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True, callbacks=[logs])
    from_dataset = ours.evaluate(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(batch), verbose=0, return_dict=True
    )
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert from_dataset[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    # Per-batch logs are the true global running means too.
    assert len(logs.batches) == len(ref_logs.batches) == -(-131 // batch)
    for mine, theirs in zip(logs.batches, ref_logs.batches):
        for key in theirs:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    assert strategy.batch_sizes == (3, 7, 22)


@pytest.mark.parametrize("batch", [2, 50, 1000], ids=lambda b: f"batch{b}")
def test_predict_any_batch_size_matches_one_device_in_input_order(cpus, batch):
    x, _ = regression_data(n=131, seed=5)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([3, 7, 22])
    ours = build_under(strategy, dense_model)
    ref = _one_device_copy(ours)
    expected = ref.predict(x, batch_size=batch, verbose=0)
    got = ours.predict(x, batch_size=batch, verbose=0)
    assert got.shape == expected.shape == (131, 1)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    from_dataset = ours.predict(tf.data.Dataset.from_tensor_slices(x).batch(batch), verbose=0)
    np.testing.assert_allclose(from_dataset, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sizes", [(0, 0, 0, 0, 0), (3, 7, 22), (1, 0, 5, 2, 9), (64, 64)],
                         ids=lambda s: "-".join(map(str, s)))
def test_the_pipeline_splits_any_batch_by_floor_or_ceiling_shares(sizes):
    # The rule the input pipeline applies to a batch of n samples (training's partial last
    # batch, evaluation batches of any size), checked against its definition for every n.
    from tf_hetbatch.distribute import input_split

    k = len(sizes)
    total = sum(sizes)
    bounds = tf.constant(input_split.bounds_of(sizes), tf.int64)
    for n in range(0, 3 * max(total, k) + 1):
        got = input_split.split_sizes(tf.constant(n, tf.int64), bounds, k).numpy().tolist()
        assert sum(got) == n and min(got) >= 0, (n, got)
        if total == 0:  # no split set: even, the first n % k replicas one sample more
            assert got == [n // k + (i < n % k) for i in range(k)], (n, got)
            continue
        if n == total:
            assert got == list(sizes)
        shares = [n * b / total for b in sizes]
        assert all(int(np.floor(q)) <= g <= int(np.ceil(q)) for q, g in zip(shares, got)), (
            n, got, shares)
        # The boundaries are the running shares rounded up: nothing is left to chance.
        ends = np.cumsum([0] + got)
        assert ends.tolist() == [-(-n * c // total) for c in np.cumsum([0] + list(sizes))]


def test_evaluation_data_splits_in_proportion_to_the_sizes(cpus):
    sink = Sink()

    class EvalRecorder(keras.layers.Layer):
        def call(self, inputs, training=None):
            ctx = tf.distribute.get_replica_context()
            replica = ctx.replica_id_in_sync_group if ctx is not None else -1  # symbolic build

            def record(rid, n):
                sink.append((int(rid), int(n)))
                return np.int32(0)

            token = tf.py_function(record, [replica, tf.shape(inputs)[0]], tf.int32)
            with tf.control_dependencies([token]):
                return tf.identity(inputs)

    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([8, 8, 16])
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), EvalRecorder(), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    x, y = regression_data(n=100)
    model.evaluate(x, y, batch_size=64, verbose=0)  # 64, 36: 2x the sizes, then 36 by 1:1:2
    per_replica = {}
    for replica, n in sink.items:
        per_replica.setdefault(replica, []).append(n)
    assert per_replica == {0: [16, 9], 1: [16, 9], 2: [32, 18]}


def test_fit_with_dynamic_batching_and_validation_of_another_batch_size(cpus):
    x, y = regression_data(n=320)
    xv, yv = regression_data(n=100, seed=3)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = build_under(strategy, dense_model)
    callback = hb.DynamicBatching(warmup_steps=1, interval=2)
    hist = model.fit(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(32),
        validation_data=tf.data.Dataset.from_tensor_slices((xv, yv)).batch(256),
        epochs=2, shuffle=False, verbose=0, callbacks=[callback],
    )
    assert len(hist.history["val_loss"]) == 2 and np.all(np.isfinite(hist.history["val_loss"]))
    assert sum(strategy.batch_sizes) == 32 and strategy.global_batch_size == 32
    assert model.evaluate(xv, yv, batch_size=512, verbose=0) == pytest.approx(
        _one_device_copy(model).evaluate(xv, yv, batch_size=512, verbose=0), rel=1e-5)
    assert model.predict(x, batch_size=1000, verbose=0).shape == (320, 1)


def test_evaluation_leaves_the_training_bookkeeping_alone(cpus):
    x, y = regression_data(n=128)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = build_under(strategy, dense_model)
    strategy.resume_at(0, skip_batches=1)  # resuming: the next TRAINING pass skips a batch
    expected = _one_device_copy(model).evaluate(x, y, batch_size=512, verbose=0)
    assert model.evaluate(x, y, batch_size=512, verbose=0) == pytest.approx(expected, rel=1e-5)
    model.predict(x, batch_size=100, verbose=0)
    # Neither the evaluation batch size nor the skip was taken by evaluation data.
    assert strategy.batch_sizes is None and strategy.global_batch_size is None
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert strategy.global_batch_size == 32 and strategy.batch_sizes == (11, 11, 10)
    assert strategy.steps_trained == 3  # 4 batches, the first skipped
    assert strategy.read_replica_times().samples.sum() == 96
    strategy.set_batch_sizes([2, 10, 20])  # still checked against the training data's 32
