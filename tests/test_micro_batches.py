"""Memory-bounded replicas: a share above the bound is computed in micro-batches within the
step, and the update, the logs and the split's bookkeeping stay one device's."""

import collections

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from helpers import (BatchLogs, OutOfMemoryAbove, ShapeRecorder, Sink, SwitchAtBatch,
                     max_weight_diff, regression_data)

TOL = 1e-5
BOUND = 6
SPLIT = [8, 3 * BOUND, 6]  # replica 1: a share of 3 bounds


def bounded_model(sink=None, seed=1, steps_per_execution=1):
    """Dense, Adam, an L2 regulariser (added once per step, whatever the micro-batches)."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((8,))]
    if sink is not None:
        layers.append(ShapeRecorder(sink))
    layers += [keras.layers.Dense(16, activation="tanh",
                                  kernel_regularizer=keras.regularizers.L2(1e-2)),
               keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


def _reference(x, y, epochs=1, callbacks=()):
    ref = bounded_model()
    logs = BatchLogs()
    hist = ref.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                   callbacks=[logs, *callbacks])
    return ref, logs, hist


def _sizes_per_step(sink, num_replicas):
    """Per replica: the micro-batch sizes it computed, in order."""
    seen = collections.defaultdict(list)
    for replica, n in sink.items:
        seen[replica].append(n)
    return seen


def micro_batch_sizes(share, bound):
    """The sizes of a share's micro-batches: ceil(share / bound) near-equal parts."""
    count = max(-(-share // bound), 1) if bound else 1
    return [((j + 1) * share + count - 1) // count - (j * share + count - 1) // count
            for j in range(count)]


@pytest.mark.parametrize("spe", [1, 3])
def test_bounded_replica_matches_one_device(cpus, spe):
    x, y = regression_data(n=320)  # 10 steps of 32
    ref, ref_logs, ref_hist = _reference(x, y)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes(SPLIT)
    strategy.set_micro_batch_limits([None, BOUND, None])
    assert strategy.micro_batch_limits == (None, BOUND, None)
    sink = Sink()
    with strategy.scope():
        ours = bounded_model(sink, steps_per_execution=spe)
    logs = BatchLogs()
    hist = ours.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[logs])
    assert strategy.steps_trained == 10
    assert max_weight_diff(ref, ours) <= TOL
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    expected = ref_logs.batches[spe - 1::spe] if spe > 1 else ref_logs.batches
    for mine, theirs in zip(logs.batches, expected):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["mae"] == pytest.approx(theirs["mae"], rel=1e-5)
    seen = _sizes_per_step(sink, 3)
    assert seen[1] == [BOUND] * 30  # 3 micro-batches of the bound in each of 10 steps
    assert seen[0] == [8] * 10 and seen[2] == [6] * 10


@pytest.mark.parametrize("spe", [1, 4])
def test_micro_batch_count_follows_the_share_across_a_switch(cpus, spe):
    # Replicas 0 and 1 bounded; the split switches mid-epoch (the new one reaches the replicas
    # a few steps later, with the pipeline's lag): each step's count is ceil(share / bound) of
    # the share it actually got, and the run stays one device's, over 2 epochs.
    x, y = regression_data(n=320)
    ref, ref_logs, ref_hist = _reference(x, y, epochs=2)
    limits, before, after = [7, BOUND, None], SPLIT, [20, 4, 8]
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes(before)
    strategy.set_micro_batch_limits(limits)
    sink = Sink()
    with strategy.scope():
        ours = bounded_model(sink, steps_per_execution=spe)
    switch = SwitchAtBatch(strategy, 2, after)
    hist = ours.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[switch])
    assert switch.done and strategy.steps_trained == 20
    assert max_weight_diff(ref, ours) <= TOL
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    seen = _sizes_per_step(sink, 3)
    old = [micro_batch_sizes(b, m) for b, m in zip(before, limits)]
    new = [micro_batch_sizes(b, m) for b, m in zip(after, limits)]
    assert old[0] == [4, 4] and old[1] == [6, 6, 6] and new[0] == [7, 7, 6] and new[1] == [4]
    switched = [k for k in range(1, 20)
                if seen[2] == [before[2]] * k + [after[2]] * (20 - k)]
    assert len(switched) == 1, seen[2]  # the step the new split arrived at
    k = switched[0]
    for replica in (0, 1):
        assert seen[replica] == old[replica] * k + new[replica] * (20 - k), replica


def failing_model(replica, size, seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((8,)), OutOfMemoryAbove(replica, size),
        keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2)),
        keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


@pytest.mark.parametrize("limits,lowered,lines", [
    ([None, 12, None], (None, 4, None), 1),  # 2 micro-batches of 9 fail: bound 4 (5 of <= 4)
    ([None, None, None], (None, 4, None), 2),  # 18 fails, then 9: bound 4
])
def test_out_of_memory_step_runs_again_with_a_lower_bound(cpus, caplog, limits, lowered, lines):
    x, y = regression_data(n=320)
    ref, ref_logs, ref_hist = _reference(x, y)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes(SPLIT)
    strategy.set_micro_batch_limits(limits)
    with strategy.scope():
        ours = failing_model(replica=1, size=5)
    logs = BatchLogs()
    with caplog.at_level("WARNING", logger="tf_hetbatch.distribute.out_of_memory"):
        hist = ours.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                        callbacks=[logs])
    said = [r.getMessage() for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert len(said) == lines, said
    assert said[-1].startswith("Replica 1 ") and "bound is now 4 samples" in said[-1]
    assert strategy.micro_batch_limits == lowered
    assert strategy.steps_trained == 10 and int(ours.optimizer.iterations.numpy()) == 10
    assert max_weight_diff(ref, ours) <= TOL
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    for mine, theirs in zip(logs.batches, ref_logs.batches):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        assert mine["mae"] == pytest.approx(theirs["mae"], rel=1e-5)


def test_a_lowered_bound_is_kept_by_a_checkpoint_and_resumed(cpus, caplog, tmp_path):
    # Epoch 1 lowers replica 1's bound (a step out of memory); the run is restarted from its
    # checkpoint with the bounds it sets at start: the lowered bound comes back, no step runs
    # out of memory again, and the two halves equal one device's two epochs.
    x, y = regression_data(n=320)
    ref, _, ref_hist = _reference(x, y, epochs=2)
    said = []
    for epoch in (0, 1):
        strategy = hb.HeteroMirroredStrategy(cpus[:3])
        strategy.set_batch_sizes(SPLIT)
        strategy.set_micro_batch_limits([None, None, None])
        with strategy.scope():
            ours = failing_model(replica=1, size=5)
        ckpt = hb.ResumableCheckpoint(tmp_path / "ckpt")
        caplog.clear()
        with caplog.at_level("INFO"):
            assert ckpt.restore(ours) == epoch
            hist = ours.fit(x, y, batch_size=32, epochs=epoch + 1, initial_epoch=epoch,
                            shuffle=False, verbose=0, callbacks=[ckpt])
        said.append([r.getMessage() for r in caplog.records])
        assert strategy.micro_batch_limits == (None, 4, None)
        assert hist.history["loss"] == pytest.approx(ref_hist.history["loss"][epoch:epoch + 1],
                                                     rel=1e-5)
    assert sum("ran out of memory" in line for line in said[0]) == 2
    assert not any("ran out of memory" in line for line in said[1])
    assert any("micro-batch bounds it saved: [None, 4, None]" in line for line in said[1])
    assert max_weight_diff(ref, ours) <= TOL


def test_dynamic_batching_balances_bounded_replicas_exactly(cpus):
    # Every replica bounded at 16 samples: the balanced split (48, 24, 12) for costs 1:2:4
    # is reached all the same (replica 0 in 3 micro-batches, replica 1 in 2), and the run
    # equals one device's on the same global batches.
    from test_callback import (BALANCED, GLOBAL_BATCH, SECONDS_PER_SAMPLE, cost_dataset,
                               cost_model, imbalance, settled_imbalance)

    # Each micro-batch pass has its own overhead (a ms or two when the suite loads the
    # machine), which the nominal BALANCED split leaves out: with test_callback's unit, a CI run
    # settled at [43, 27, 14] (replica 0 runs 3 passes). Twice the unit keeps it small beside
    # the modelled costs.
    unit = 2 * SECONDS_PER_SAMPLE
    steps = 75
    ref = cost_model(unit=unit)
    ref.fit(cost_dataset(), steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_micro_batch_limits([16, 16, 16])
    with strategy.scope():
        model = cost_model(unit=unit)
    callback = hb.DynamicBatching(controller=hb.ModelBasedController(step_time_search=False))
    model.fit(cost_dataset(), steps_per_epoch=steps, epochs=1, shuffle=False, verbose=0,
              callbacks=[callback])
    sizes = callback.batch_sizes
    assert sum(sizes) == GLOBAL_BATCH and strategy.batch_sizes == sizes
    assert sizes[0] > 2 * 16 and sizes[0] > sizes[1] > sizes[2], callback.history
    assert np.max(np.abs(np.subtract(sizes, BALANCED))) <= 4, callback.history
    assert imbalance(callback.windows[0]) > 2.5
    assert settled_imbalance(callback.windows) < 1.3, callback.windows
    assert strategy.micro_batch_limits == (16, 16, 16)
    assert max_weight_diff(ref, model) <= TOL


# --------------------------------------------------------------------- custom steps -----------
@pytest.mark.parametrize("variant", ["compute_loss", "loss_object", "sample_weight"])
def test_guide_train_steps_with_a_bounded_replica_equal_one_device(cpus, variant):
    # Custom train_steps as Keras's guide writes them (a loss tracker and metrics updated by
    # hand): replica 2's share 16 in 3 micro-batches of <= 6, replica 1's 12 in 3 of 4.
    import custom_models

    columns = custom_models.data(160, sample_weight=variant == "sample_weight")
    data = lambda: tf.data.Dataset.from_tensor_slices(columns).batch(32)  # noqa: E731
    ref = custom_models.build(variant)
    ref_history = ref.fit(data(), epochs=2, verbose=0).history
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([4, 12, 16])
    strategy.set_micro_batch_limits([None, 4, 6])
    with strategy.scope():
        ours = custom_models.build(variant)
    history = ours.fit(data(), epochs=2, verbose=0).history
    assert max_weight_diff(ref, ours) <= TOL
    assert history.keys() == ref_history.keys()
    for key in ref_history:
        np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-5)


def test_a_step_applying_two_optimizers_is_refused_under_bounds(cpus):
    import custom_models

    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes([4, 12, 16])
    strategy.set_micro_batch_limits([None, 4, None])
    with strategy.scope():
        model = custom_models.build("two_optimizers")
    data = tf.data.Dataset.from_tensor_slices(custom_models.data(64)).batch(32)
    with pytest.raises(ValueError, match=r"applies gradients more than once.*Received: 2 "
                       r"optimizer applies.*Fix:"):
        model.fit(data, epochs=1, verbose=0)


def test_custom_loop_with_a_bounded_replica_is_exact(cpus):
    # TensorFlow's custom-loop guide (the loss scaled by the global batch): the returned
    # losses and the weights are those of the same loop without bounds, and one device's.
    from test_custom_steps import (SPLIT as CUSTOM_SPLIT, _custom_loop, _dense,
                                   global_batch_loss, one_device_reference)

    loss, ref = global_batch_loss(), one_device_reference()
    plain = hb.HeteroMirroredStrategy(cpus[:3])
    expected = _custom_loop(plain, _dense(plain), loss, CUSTOM_SPLIT)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_micro_batch_limits([None, 5, 6])
    model = _dense(strategy)
    got = _custom_loop(strategy, model, loss, CUSTOM_SPLIT)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert max_weight_diff(ref, model) <= TOL
    assert strategy.steps_trained == 3


@pytest.mark.parametrize("per_micro_batch_ms", [0.0, 5.0, 20.0])
def test_the_controller_prices_in_a_per_micro_batch_fixed_cost(per_micro_batch_ms):
    # Pure core. Workers of speeds 3:5:12 at B = 128, the fast one bounded at 48 (below its
    # fair share) with a fixed cost per micro-batch: t_k = alpha + beta_k b_k + c ceil(b_k/m).
    # The affine time model learns it from the measured times (its slope c/m per sample): the
    # settled split is within 3% of the best integer split's step time, found by brute force,
    # and the fast worker keeps a share above its bound.
    from tf_hetbatch.core import micro_batches as core

    batch, limits = 128, [None, None, 48]
    alpha = np.full(3, 0.010)
    beta = 1e-3 * np.array([12 / 3, 12 / 5, 1.0])
    cost = np.array([0.0, 0.0, per_micro_batch_ms * 1e-3])

    def times(sizes):
        return alpha + beta * np.asarray(sizes) + cost * core.micro_batch_counts(sizes, limits)

    best = min(times((a, b, batch - a - b)).max()
               for a in range(1, batch - 1) for b in range(1, batch - a))
    for search in (False, True):
        controller = hb.ModelBasedController(step_time_search=search)
        sizes = (43, 43, 42)
        state = controller.init(sizes)
        rng = np.random.default_rng(0)
        for _ in range(40):
            measured = times(sizes) * rng.uniform(0.97, 1.03, 3)
            sizes, state = controller.update(state, list(sizes), list(measured),
                                             step_time=float(measured.max()) + 0.002)
        assert times(sizes).max() <= 1.03 * best, (sizes, state.reason)
        assert sizes[2] > 48


# --------------------------------------------------------------------- rules and errors -------
def test_micro_batch_counts_and_sizes_cover_the_share_within_the_bound():
    from tf_hetbatch.core import micro_batches as core

    rng = np.random.default_rng(0)
    for _ in range(200):
        share, bound = int(rng.integers(0, 300)), int(rng.integers(1, 64))
        count = core.micro_batch_counts([share], [bound])[0]
        assert count == max(-(-share // bound), 1)
        sizes = micro_batch_sizes(share, bound)
        assert len(sizes) == count and sum(sizes) == share and max(sizes) <= bound
        assert max(sizes) - min(sizes) <= 1
    assert core.micro_batch_counts([10, 96, 97, 0], [None, 48, 48, 48]).tolist() == [
        1, 2, 3, 1]
    assert core.micro_batch_counts([10, 20], None).tolist() == [1, 1]
    assert core.lowered_limit(9) == 4 and core.lowered_limit(2) == 1
    assert core.lowered_limit(1) is None


@pytest.mark.parametrize("limits,match", [
    ([4, 4], r"one entry per replica \(3\).*limits=\[4, 4\]"),
    ([4, 0, None], r"ints >= 1 or None, found 0 at index 1"),
    ([4, 2.5, None], r"found 2.5 at index 1"),
    ([True, 4, None], r"found True at index 0"),
    ("abc", r"one entry per replica"),
])
def test_bad_limits_are_refused_naming_the_value_and_the_fix(cpus, limits, match):
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    with pytest.raises(ValueError, match=match) as error:
        strategy.set_micro_batch_limits(limits)
    assert "Fix: pass one entry per replica (3)" in str(error.value)
    assert strategy.micro_batch_limits is None
    strategy.set_micro_batch_limits([4.0, None, 2])
    assert strategy.micro_batch_limits == (4, None, 2)
    strategy.set_micro_batch_limits(None)
    assert strategy.micro_batch_limits is None


def test_sync_batch_normalization_is_refused_under_bounds(cpus):
    from helpers import conv_syncbn_model, image_data

    x, y = image_data(n=64)
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    strategy.set_micro_batch_limits([8, None])
    with strategy.scope():
        model = conv_syncbn_model()
    with pytest.raises(ValueError, match=r"SyncBatchNormalization.*micro_batch_limits="
                       r"\(8, None\).*Fix:"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_the_first_step_at_a_new_micro_batch_count_is_not_timed(cpus):
    # Same share, another micro-batch count: new shapes to build, so one untimed step.
    x, y = regression_data(n=320)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_batch_sizes(SPLIT)
    strategy.set_micro_batch_limits([None, None, None])
    with strategy.scope():
        model = bounded_model()
    timed = []

    def lower_at_4(batch, logs):
        timed.append(tuple(strategy.read_replica_times(reset=True).timed_steps))
        if batch == 4:
            strategy.set_micro_batch_limits([None, BOUND, None])

    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=lower_at_4)])
    assert timed[0] == (0.0, 0.0, 0.0) and timed[5] == (1.0, 0.0, 1.0)
    assert all(t == (1.0, 1.0, 1.0) for i, t in enumerate(timed) if i not in (0, 5)), timed


class OutOfMemoryInUpdate(keras.optimizers.Adam):
    """Adam whose update of the first Dense kernel on replica `replica`'s device runs out of
    memory (a real allocation beyond the machine's memory) at step `at`: past the step's update
    gate, where a GPU's optimizer update allocates its temporaries."""

    def __init__(self, replica, at, kernel, **kwargs):
        super().__init__(**kwargs)
        self.replica, self.at, self.kernel = replica, at, kernel

    def update_step(self, gradient, variable, learning_rate):
        if f"CPU:{self.replica}" in str(variable.device) and variable.name.split(":")[0] in (
                self.kernel, f"{self.kernel}/replica_{self.replica}"):
            # Depends on the summed gradient: allocated after the step's all-reduce, not before.
            too_big = tf.logical_and(tf.equal(self.iterations, self.at),
                                     tf.reduce_all(tf.math.is_finite(gradient)))
            length = tf.where(too_big, tf.constant(2**40, tf.int64), tf.constant(1, tf.int64))
            gradient = gradient + 0.0 * tf.zeros(tf.reshape(length, [1]), gradient.dtype)[0]
        return super().update_step(gradient, variable, learning_rate)


@pytest.mark.parametrize("replicas", [3, 1])
def test_out_of_memory_after_the_update_gate_is_raised_not_run_again(cpus, caplog, replicas):
    # Past the gate part of the update may be applied (here: the step count, and any variable
    # updated before the kernel): running the step again would apply it twice. One replica:
    # its batch is not cut, so no step closes the gate.
    x, y = regression_data(n=320)
    devices = cpus[:3] if replicas == 3 else cpus[1:2]
    strategy = hb.HeteroMirroredStrategy(devices)
    limits = [None, 12, None][:replicas]
    if replicas == 3:
        strategy.set_batch_sizes(SPLIT)
    strategy.set_micro_batch_limits(limits)
    with strategy.scope():
        model = bounded_model()
        kernel = model.layers[0].kernel.path  # the replicas' copies: "<path>/replica_1:0"
        model.compile(optimizer=OutOfMemoryInUpdate(1, 2, kernel, learning_rate=1e-2),
                      loss="mse")
    with caplog.at_level("WARNING", logger="tf_hetbatch.distribute.out_of_memory"):
        with pytest.raises(tf.errors.ResourceExhaustedError,
                           match=rf"^Replica {min(replicas, 2) - 1} ran out of memory where its "
                                 r"step cannot run again.*Fix:.*OOM when allocating"):
            model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert "ran out of memory" not in caplog.text  # no bound lowered, no step run again
    assert strategy.micro_batch_limits == tuple(limits)


def batch_norm_model(seed=1):
    """A model whose step changes state besides its weights: BatchNormalization's moving
    statistics and Dropout's seed; replica 1 runs out of memory above 5 samples, after both."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.3), OutOfMemoryAbove(replica=1, size=5), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def test_a_step_run_again_is_the_step_that_never_failed(cpus, caplog):
    # The failed attempts (18 samples, then 9, on replica 1) updated the moving statistics
    # and advanced the dropout seeds on the replicas they reached; restored, the run equals
    # one that had the lowered bound from the start, state and weights on every replica.
    x, y = regression_data(n=320)
    runs = []
    for limits in ([None, None, None], [None, 4, None]):
        strategy = hb.HeteroMirroredStrategy(cpus[:3])
        strategy.set_batch_sizes(SPLIT)
        strategy.set_micro_batch_limits(limits)
        with strategy.scope():
            model = batch_norm_model()
        caplog.clear()
        with caplog.at_level("WARNING", logger="tf_hetbatch.distribute.out_of_memory"):
            hist = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        runs.append((strategy, model, hist, caplog.text.count("ran out of memory")))
    (failed, model, hist, lines), (clean, ref, ref_hist, ref_lines) = runs
    assert (lines, ref_lines) == (2, 0) and failed.micro_batch_limits == (None, 4, None)
    assert model.layers[1].moving_mean is not None
    for mine, theirs in zip(model.variables, ref.variables):
        for a, b in zip(failed.experimental_local_results(mine),
                        clean.experimental_local_results(theirs)):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7,
                                       err_msg=mine.path)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-6)


def test_state_variables_are_the_trainable_layers_non_trainable_ones():
    from tf_hetbatch.distribute import out_of_memory

    model = batch_norm_model()
    frozen = keras.layers.BatchNormalization()
    outer = keras.Sequential([model, frozen])
    outer.build((None, 8))
    frozen.trainable = False
    names = [v.path for v in out_of_memory.state_variables(outer)]
    bn, dropout = model.layers[1], model.layers[2]
    assert names == [bn.moving_mean.path, bn.moving_variance.path,
                     dropout.seed_generator.state.path]


def test_the_replica_of_an_out_of_memory_error_is_read_from_its_device(cpus):
    from tf_hetbatch.distribute import out_of_memory

    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    message = ("OOM when allocating tensor with shape[1099511627776] and type float on "
               "/job:localhost/replica:0/task:0/device:CPU:{} by allocator mklcpu")
    for replica in range(3):
        error = tf.errors.ResourceExhaustedError(None, None, message.format(replica))
        assert out_of_memory.replica_of_error(strategy, error) == replica
    other = tf.errors.ResourceExhaustedError(None, None, "out of memory somewhere")
    assert out_of_memory.replica_of_error(strategy, other) is None
    assert out_of_memory.micro_batch_size(18, 12) == 9
    assert out_of_memory.micro_batch_size(18, None) == 18


def test_a_lowered_bound_halves_the_share_the_failed_step_had(cpus, caplog):
    # A step in flight after a switch still has its old share (18 samples on replica 1) while
    # `batch_sizes` says 1: the bound is half the micro-batch that failed (9), not of the new
    # share (1 sample: no bound could help, and the run would end).
    from tf_hetbatch.distribute import out_of_memory

    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    strategy.set_micro_batch_limits([None, None, None])
    strategy.set_batch_sizes([8, 1, 23])
    shares = [8, 18, 6]
    data = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.zeros([shares[ctx.replica_id_in_sync_group], 8]))
    error = tf.errors.ResourceExhaustedError(
        None, None, "OOM when allocating tensor with shape[1099511627776] and type float on "
        "/job:localhost/replica:0/task:0/device:CPU:1 by allocator mklcpu")
    guard = out_of_memory.StepGuard(strategy, keras.Sequential([keras.Input((8,))]))
    with caplog.at_level("WARNING"):
        asked = guard._asked(error, data)
        assert asked == [0.0, 9.0, 0.0]
        guard._lower(asked, error)
    assert strategy.micro_batch_limits == (None, 9, None)
    assert "Replica 1 " in caplog.text and "bound is now 9 samples" in caplog.text


# --------------------------------------------------------------------- two workers ------------
@pytest.mark.cluster
def test_two_workers_bounded_replica_exact_with_a_switch(tmp_path):
    # Worker 1's replica is bounded at 9 with a share of 27 (3 micro-batches); the switch to
    # [20, 12] lands at the same step on both workers, from which it computes 2 of 6.
    from test_multi_worker import assert_every_worker_equals, mw_train, run_cluster

    from tf_hetbatch.distribute.multi_worker import DEFAULT_SWITCH_MARGIN

    outputs = run_cluster(tmp_path, 2, "--sizes", "5,27", "--switch-step", "4",
                          "--switch-sizes", "20,12", "--micro-batch-limits", "0,9")
    x, y = mw_train.data(320)
    ref = mw_train.build()
    ref_hist = ref.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), epochs=2,
                       verbose=0)
    assert_every_worker_equals(ref.get_weights(), outputs)
    switch = 4 + DEFAULT_SWITCH_MARGIN
    assert outputs[0][1]["calls"] == [5] * switch + [20] * (20 - switch)
    assert outputs[1][1]["calls"] == [9, 9, 9] * switch + [6, 6] * (20 - switch)
    for _, info in outputs:
        np.testing.assert_allclose(info["history"]["loss"], ref_hist.history["loss"],
                                   rtol=1e-5)


@pytest.mark.cluster
def test_two_workers_resume_keeps_micro_batches_following_the_restored_share(tmp_path):
    # Attempt 0 sets the split [5, 27] (worker 1 bounded at 9: 3 micro-batches a step); its
    # worker 1 dies after step 7. The relaunch does not set a split: the one restored from the
    # checkpoint of step 4 gives worker 1 its 27 samples again, in 3 micro-batches, and the
    # run ends equal to one device's.
    from test_recovery import (TOTAL_STEPS, attempt_of, max_diff, outputs_of,
                               reference_weights, run_cluster, weights_of)

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    result, log = run_cluster(out, ckpt, 2, "--every", "4", "--sizes", "5,27",
                              "--micro-batch-limits", "0,9", "--die-worker", "1",
                              "--die-attempt", "0", "--die-step", "7", max_restarts=1)
    assert result.ok, result.message + "\n" + log[-4000:]
    assert result.attempts == 2
    ref = reference_weights()
    for worker, (weights, info) in enumerate(outputs_of(out, 2)):
        assert info["restored"]["step"] == 4 and info["restored_sizes"] == [5, 27]
        resumed, _ = attempt_of(out, worker, 1)
        steps = TOTAL_STEPS - 4
        assert resumed["calls"] == ([5] if worker == 0 else [9, 9, 9]) * steps
        assert max_diff(weights_of(weights, len(ref)), ref) <= 1e-5



@pytest.mark.cluster
def test_a_worker_hosting_two_replicas_one_bounded_trains_exactly(tmp_path):
    # Worker 1 hosts replicas 1 and 2 (logical CPUs); replica 1 is bounded at 6 with a share of
    # 16 (3 micro-batches of at most 6), its neighbour is not: the model and the logs equal
    # one device's, and only the bounded replica's calls are micro-batches.
    from test_multi_worker import assert_every_worker_equals, reference_run, run_cluster

    outputs = run_cluster(tmp_path, 2, "--layout", "1,2", "--sizes", "5,16,11",
                          "--micro-batch-limits", "0,6,0")
    weights, history = reference_run()
    assert_every_worker_equals(weights, outputs)
    steps = 20
    assert outputs[0][1]["calls"] == [5] * steps
    calls = outputs[1][1]["calls"]  # both replicas of worker 1, in no set order
    assert [c for c in calls if c > 6] == [11] * steps
    micro = [c for c in calls if c <= 6]
    assert len(micro) == 3 * steps and sum(micro) == 16 * steps
    for _, info in outputs:
        np.testing.assert_allclose(info["history"]["loss"], history["loss"], rtol=1e-5)


@pytest.mark.cluster
@pytest.mark.parametrize("layout, sizes, above, lowered", [
    ("1,1", "5,27", "1,10", [None, 13]),  # 27 fails: bound 13 (micro-batches of 9)
    ("1,2", "5,16,11", "2,4", [None, None, 5]),  # worker 1's second replica: 11 fails
], ids=["1+1", "1+2"])
def test_two_workers_survive_a_step_out_of_memory_exactly(tmp_path, layout, sizes, above,
                                                          lowered):
    # A replica of worker 1 runs out of memory above `above` samples (a real allocation
    # beyond the machine's memory). Its worker joins the step's all-reduce with a stand-in;
    # no worker applies that step, every worker lowers the same bound and runs the same
    # batch again: the model and the logs equal one device's, and the chief says each new
    # bound once.
    import io

    from test_multi_worker import assert_every_worker_equals, reference_run, run_cluster

    log = io.StringIO()
    outputs = run_cluster(tmp_path, 2, "--layout", layout, "--sizes", sizes,
                          "--micro-batch-limits", ",".join("0" for _ in lowered),
                          "--out-of-memory-above", above, log=log)
    weights, history = reference_run()
    assert_every_worker_equals(weights, outputs)
    for _, info in outputs:
        assert info["micro_batch_limits"] == lowered
        np.testing.assert_allclose(info["history"]["loss"], history["loss"], rtol=1e-5)
    said = [line for line in log.getvalue().splitlines() if "ran out of memory" in line]
    replica = int(above.split(",")[0])
    assert len(said) == 1 and said[0].startswith(f"[worker 0] Replica {replica} "), said
    assert f"bound is now {lowered[replica]} samples" in said[0]


@pytest.mark.cluster
def test_two_workers_stop_together_when_one_sample_does_not_fit(tmp_path):
    # Replica 1 runs out of memory on any batch: after its bound reached one sample, every
    # worker raises ResourceExhaustedError (none waits in the step's all-reduce for ever).
    import io

    from test_multi_worker import WORKER

    from tf_hetbatch.launch import launch

    log = io.StringIO()
    result = launch([WORKER, "--out", str(tmp_path), "--sizes", "5,27",
                     "--micro-batch-limits", "0,0", "--out-of-memory-above", "1,0"], 2,
                    threads=1, timeout=120, stdout=log, stderr=log, handle_signals=False)
    text = log.getvalue()
    assert not result.ok and "timed out" not in result.message, result.message
    for worker in (0, 1):
        assert any(line.startswith(f"[worker {worker}] ") and "ResourceExhaustedError" in line
                   for line in text.splitlines()), text[-3000:]
    assert "another worker's" in text  # worker 0 names the replica it could not wait for


# --------------------------------------------------------------------- the up-front probe ----
def test_the_probe_bounds_a_step_by_the_memory_it_may_use():
    # Real peaks of TensorFlow's CPU allocator (one device probed at a time, in processes of
    # their own: this one uses the system allocator, which keeps no statistics). They grow with
    # the batch; a budget of the line's value at 64 samples gives a bound near 64 on both
    # devices, a step at that bound fits the budget and one at twice it does not, and a model
    # with 4x the activations per sample fits far fewer samples in room for 512 of the small
    # one's.
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "workers", "memory_probe_run.py")

    def probe(*requests):
        run = subprocess.run([sys.executable, script, json.dumps(requests)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.split("PROBES ", 1)[1])

    (first,), = probe({"filters": 16, "devices": ["/cpu:0"]})
    assert first["peak_bytes"][1] > first["peak_bytes"][0] > 0 and first["bound"] is None
    # After the warm-up step the line's fixed part still counts the model: its weights, their
    # gradients and Adam's two slots are all live when the update runs, whatever the batch
    # (measured ~8x the trainable bytes; ~3x where the model's own memory was left out). No
    # all-reduce headroom on CPUs.
    (small, large), (size_s, size_l) = first["peak_bytes"], first["sizes"]
    slope = (large - small) / (size_l - size_s)
    assert small - slope * size_s > 4 * first["trainable_bytes"] > 0, first
    assert first["headroom_bytes"] == 0 and first["memory_source"] == "unknown"
    budget = int(small + (64 - size_s) * slope)
    at_64, big = probe({"filters": 16, "devices": ["/cpu:0", "/cpu:1"], "memory_bytes": budget},
                       # room for about 512 samples of the small model
                       {"filters": 64, "devices": ["/cpu:0"],
                        "memory_bytes": int(small + (512 - size_s) * slope)})
    assert at_64[0]["memory_source"] == "memory_bytes"
    bounds = [p["bound"] for p in at_64]
    assert all(32 < b < 128 for b in bounds), at_64  # between the probed sizes
    assert 1 <= big[0]["bound"] < 256, big
    # What steps at the bound found for /cpu:0, and at twice it, really peak at.
    bound = at_64[0]["bound"]
    (check,), = probe({"filters": 16, "devices": ["/cpu:0"], "sizes": [bound, 2 * bound]})
    at_bound, at_twice = check["peak_bytes"]
    assert at_bound <= 1.15 * budget < 1.15 * at_twice, (budget, check)


@pytest.mark.parametrize("kwargs, match", [
    ({"sizes": (128, 32)}, "two increasing ints"),
    ({"steps": 0}, "steps must be"),
    ({"memory_bytes": [1, 2, 3]}, "3 entries for 1 devices"),
])
def test_the_probe_refuses_bad_arguments_naming_them(cpus, kwargs, match):
    with pytest.raises(ValueError, match=match):
        hb.probe_micro_batch_limits(lambda: None, ([0.0],), [cpus[0]], **kwargs)
