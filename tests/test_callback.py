"""DynamicBatching: static split, measured adjustment, exactness, errors, state and config.

Real strategies on logical CPUs (tests/conftest.py). Replicas are made unequal by
`ReplicaCost`: on replica k every sample costs `costs[k]` units of device time, as if replica
k ran on a device `costs[k]` times slower. The cost is a wait (in a `tf.py_function`), not
arithmetic, on purpose: the logical CPUs share 2 physical cores and one intra-op thread pool,
and TensorFlow interleaves the replicas' ops, so with an arithmetic cost every replica's
measured time mixes in the others' work (costs 1:2:4 measured as about 1:1.2:1.6, and the
balanced split is no longer 4:2:1). `py_function`s of the replicas run one at a time (as
under the stock MirroredStrategy), so each replica's compute time is its own cost.
"""

import json
import re
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch.distribute._upstream import clock
from helpers import build_under, dense_model, max_weight_diff, regression_data
from tf_hetbatch.core.controllers import ControllerState

COSTS = (1, 2, 4)
GLOBAL_BATCH = 84
# One cost unit: the even split's replicas sleep 14, 28 and 56 ms a step. The suite runs three
# test processes on two cores: at half this, a neighbour's load (and a bounded replica's extra
# micro-batch passes) was enough to keep one run from rebalancing or end it 5 samples off.
SECONDS_PER_SAMPLE = 5e-4
BALANCED = (48, 24, 12)  # equal finish times for costs 1:2:4


class ReplicaCost(keras.layers.Layer):
    """Identity in value; in training, replica k spends costs[k] * unit seconds per sample."""

    def __init__(self, costs, unit=SECONDS_PER_SAMPLE, **kwargs):
        super().__init__(**kwargs)
        self.costs = tuple(float(c) for c in costs)
        self.unit = float(unit)

    def call(self, x, training=None):
        if not training:
            return x
        ctx = tf.distribute.get_replica_context()
        replica = ctx.replica_id_in_sync_group if ctx is not None else 0
        cost = tf.gather(tf.constant(self.costs, tf.float64), replica)

        def spend(cost, samples):
            time.sleep(float(cost) * int(samples) * self.unit)
            return np.float32(0.0)

        token = tf.py_function(spend, [cost, tf.shape(x)[0]], tf.float32)
        # As a device's kernels, a replica's sleep waits for no other replica's: tf.function
        # would run the replicas' py_functions (stateful ops) one after another.
        clock.independent(token)
        token.set_shape([])
        return x + 0.0 * token


def cost_model(costs=COSTS, seed=1, unit=SECONDS_PER_SAMPLE):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((8,)),
        ReplicaCost(costs, unit),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def cost_dataset(batch=GLOBAL_BATCH):
    x, _ = regression_data(n=batch * 8)
    return tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(
        batch, drop_remainder=True).repeat()


def imbalance(window):
    t = np.asarray(window["time_per_step"])
    return float(t.max() / t.min())


def settled_imbalance(windows):
    """The median imbalance of the last three windows that ran one split whole (no straddling
    window). One window alone can read a neighbour's load: the suite runs two tests at once on
    two cores, and one CI run read 1.34 in a last window where runs alone read 1.02-1.07."""
    whole = [w for w in windows[1:] if all(v == int(v) for v in w["samples_per_step"])]
    assert len(whole) >= 3, windows
    return float(np.median([imbalance(w) for w in whole[-3:]]))


class CyclingController:
    """A deterministic test controller: each update moves to the next split of `splits`."""

    def __init__(self, splits):
        self.splits = [tuple(int(v) for v in s) for s in splits]

    def init(self, sizes):
        total = int(sum(sizes))
        return ControllerState(total, list(sizes), [0] * len(sizes), [total] * len(sizes))

    def update(self, state, sizes, times, step_time=None):
        new = self.splits[state.updates % len(self.splits)]
        return new, state.replace(sizes=list(new), updates=state.updates + 1,
                                  reason=f"cycle step {state.updates}")

    def get_config(self):
        return {"splits": [list(s) for s in self.splits]}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


# --------------------------------------------------------------------------- end to end ---
def test_the_rule_converges_towards_the_cheap_replica_and_improves_balance(cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = build_under(strategy, cost_model)
    # The default controller, the rule alone: on one host the replicas share 2 cores, so
    # the step-time search rightly moves past the equal finish (less work in all is faster).
    callback = hb.DynamicBatching(  # initial="flops": identical logical CPUs -> even split
        controller=hb.ModelBasedController(step_time_search=False))
    model.fit(cost_dataset(), steps_per_epoch=75, epochs=1, shuffle=False, verbose=0,
              callbacks=[callback])

    initial = callback.history[0]
    assert initial["new"] == [28, 28, 28] and initial["reason"].startswith("initial split")
    sizes = callback.batch_sizes
    assert sum(sizes) == GLOBAL_BATCH and strategy.batch_sizes == sizes
    # The order follows the costs, and the split is close to equal finish times (4:2:1).
    assert sizes[0] > sizes[1] > sizes[2], callback.history
    assert np.max(np.abs(np.subtract(sizes, BALANCED))) <= 4, callback.history
    # Balance: the even split's window against the last windows of the new split.
    first = callback.windows[0]
    assert first["samples_per_step"] == [28.0, 28.0, 28.0]
    assert imbalance(first) > 2.5  # 14 : 28 : 56 ms
    assert settled_imbalance(callback.windows) < 1.3, callback.windows
    # The state of a real controller survives JSON and restores identically.
    state = json.loads(json.dumps(callback.get_state()))
    restored = hb.DynamicBatching(controller=hb.ModelBasedController(step_time_search=False))
    restored.set_state(state)
    assert restored.get_state() == state
    assert restored.batch_sizes == sizes


def test_probe_split_follows_measured_throughput(cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = build_under(strategy, cost_model)
    callback = hb.DynamicBatching(initial="probe", warmup_steps=3, probe_steps=6, interval=1000)
    model.fit(cost_dataset(), steps_per_epoch=12, epochs=1, shuffle=False, verbose=0,
              callbacks=[callback])

    (entry,) = callback.history
    assert entry["step"] == 9 and entry["old"] == [28, 28, 28]
    assert "probed samples/s" in entry["reason"]
    sizes = callback.batch_sizes
    assert sum(sizes) == GLOBAL_BATCH and sizes[0] > sizes[1] > sizes[2], entry


@pytest.mark.parametrize("spe", [1, 3])
def test_training_stays_exact_while_the_split_changes(cpus, spe):
    x, y = regression_data()  # 320 samples, global batch 32: 10 steps per epoch
    splits = [(20, 8, 4), (4, 8, 20), (11, 0, 21), (1, 30, 1)]
    ref = build_under(None, dense_model)
    ref.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    ours = build_under(strategy, dense_model, steps_per_execution=spe)
    callback = hb.DynamicBatching(initial=[10, 12, 10], controller=CyclingController(splits),
                                  min_sizes=0, warmup_steps=1, interval=2)
    ours.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0, callbacks=[callback])

    assert max_weight_diff(ref, ours) <= 1e-5
    # Windows count steps, not calls: each ends at the first execution end (with 3: steps
    # 3, 6, 9, 10 of each epoch) at least `interval` steps after the last.
    steps = [w["step"] for w in callback.windows]
    assert steps[-1] <= strategy.steps_trained == 30
    assert all(b - a >= 2 for a, b in zip(steps, steps[1:])), steps
    assert all(s % 10 in ({0, 3, 6, 9} if spe == 3 else set(range(10))) for s in steps), steps
    changes = callback.history[1:]
    assert len(changes) >= 4, callback.history
    assert [tuple(c["new"]) for c in changes[:4]] == splits
    applied = {tuple(w["samples_per_step"]) for w in callback.windows}
    assert len(applied & {tuple(map(float, s)) for s in splits}) >= 2, callback.windows
    # A window that straddles a change is never fed to the controller.
    for w in callback.windows:
        if w["used"]:
            assert all(float(v) == int(v) for v in w["samples_per_step"]), w


class StepTimeRecorder(CyclingController):
    """Keeps one split and records the `step_time` each update receives."""

    def __init__(self, split):
        super().__init__([split])
        self.step_times = []

    def update(self, state, sizes, times, step_time=None):
        self.step_times.append(step_time)
        return super().update(state, sizes, times, step_time=step_time)


def test_each_windows_step_time_reaches_a_controller_that_takes_it(cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = build_under(strategy, cost_model)
    recorder = StepTimeRecorder((28, 28, 28))  # the split in force: every window is used
    callback = hb.DynamicBatching(controller=recorder, warmup_steps=2, interval=3)
    model.fit(cost_dataset(), steps_per_epoch=14, epochs=1, shuffle=False, verbose=0,
              callbacks=[callback])
    used = [w["step_time"] for w in callback.windows if w["used"]]
    assert len(used) >= 3 and all(t > 0 for t in used), callback.windows
    assert recorder.step_times == pytest.approx(used)


@pytest.mark.parametrize("thread_safe_backend", [False, True],
                         ids=["tensorflow-backend", "thread-safe-backend"])
def test_fit_with_dynamic_batching_dispatches_steps_as_without_it(cpus, monkeypatch,
                                                                  thread_safe_backend):
    """Keras dispatches `on_train_batch_end` asynchronously unless a callback has a batch-end
    hook; DynamicBatching has none, so `fit` dispatches its steps as without it: on the
    TensorFlow backend (Keras 3.15: synchronously, tensorflow/tensorflow#78338) and on a
    backend that allows asynchronous dispatch (its flag set for this test), where batch ends
    then run on Keras's thread pool while DynamicBatching still balances."""
    from tf_hetbatch.distribute._upstream import keras_callbacks

    if thread_safe_backend:
        monkeypatch.setattr(keras_callbacks.BACKEND_THREAD_SAFE_FLAG, True)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = build_under(strategy, cost_model)
    dispatch = {}
    for name, extra in (("without", []), ("with", [hb.DynamicBatching(
            initial="uniform", warmup_steps=2, interval=3)])):
        # Keras's own CallbackList, as fit makes it (fit uses one it is given).
        callbacks = keras.callbacks.CallbackList(extra, add_history=True, model=model)
        dispatch[name] = keras_callbacks.async_train_dispatch(callbacks)
        model.fit(cost_dataset(), steps_per_epoch=14, epochs=2, shuffle=False, verbose=0,
                  callbacks=callbacks)
    callback = extra[0]
    assert dispatch["with"] == dispatch["without"] == thread_safe_backend
    # It measured meanwhile: a window every 3 steps after the 2 of warm-up, across the
    # epoch boundary, each with its step time.
    assert [w["step"] for w in callback.windows] == list(range(5, 29, 3)), callback.windows
    assert all(w["step_time"] > 0 for w in callback.windows), callback.windows


def test_explicit_initial_sizes_are_applied(cpus):
    x, y = regression_data()
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = build_under(strategy, dense_model)
    callback = hb.DynamicBatching(initial=[4, 8, 20], warmup_steps=100)
    assert callback.batch_sizes is None and callback.settled_batch_sizes is None
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
    assert strategy.batch_sizes == callback.batch_sizes == (4, 8, 20)
    assert callback.settled_batch_sizes == (4, 8, 20)
    assert callback.history == [{"step": 0, "old": [11, 11, 10], "new": [4, 8, 20],
                                 "reason": "initial split: given sizes"}]
    assert callback.windows == []  # warm-up never ended: nothing measured, nothing changed
    times = strategy.read_replica_times()
    np.testing.assert_array_equal(times.samples_per_step, [4, 8, 20])  # from the first step


def test_unknown_global_batch_defers_the_static_split_to_the_first_window(cpus):
    x, y = regression_data()

    def global_batches():  # a generator: tf.data cannot infer the batch size
        for i in range(0, len(x), 32):
            yield x[i:i + 32], y[i:i + 32]

    spec = (tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None, 1], tf.float32))
    data = tf.data.Dataset.from_generator(global_batches, output_signature=spec)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = build_under(strategy, dense_model)
    callback = hb.DynamicBatching(initial="flops", warmup_steps=1, interval=3)
    model.fit(data, epochs=1, verbose=0, callbacks=[callback])
    first = callback.history[0]
    assert first["step"] == 4 and first["reason"].startswith("initial split: proportional")
    assert first["new"] == [11, 11, 10]  # identical logical CPUs: the even split of B = 32
    assert callback.windows[0]["used"] is False  # gave B; not fed to the controller
    assert sum(callback.batch_sizes) == 32


def test_explicit_initial_sizes_of_the_wrong_length_fail_in_fit(cpus):
    x, y = regression_data(n=64)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = build_under(strategy, dense_model)
    with pytest.raises(ValueError, match=re.escape("one batch size per replica (3)")):
        model.fit(x, y, batch_size=32, verbose=0,
                  callbacks=[hb.DynamicBatching(initial=[16, 16])])


@pytest.mark.parametrize("where", ["no_strategy", "stock_mirrored"])
def test_without_a_hetero_strategy_fails_naming_the_fix(cpus, where):
    strategy = None if where == "no_strategy" else tf.distribute.MirroredStrategy(cpus[:1])
    model = build_under(strategy, dense_model)
    x, y = regression_data(n=64)
    with pytest.raises(ValueError, match=r"DynamicBatching needs.*HeteroMirroredStrategy") as err:
        model.fit(x, y, batch_size=32, verbose=0, callbacks=[hb.DynamicBatching()])
    name = "_DefaultDistributionStrategy" if strategy is None else "MirroredStrategy"
    assert name in str(err.value)


# --------------------------------------------------------------------------- arguments ----
class NoStepTimeController:
    """Not a `protocols.Controller`: its `update` does not take the keyword `step_time`."""

    def init(self, sizes):
        return CyclingController([sizes]).init(sizes)

    def update(self, state, sizes, times):
        return state.sizes, state


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(initial="fast"), ValueError, "initial='fast'"),
    (dict(initial=[]), TypeError, "initial=[]"),
    (dict(initial=[4, -1]), ValueError, "must be >= 0"),
    (dict(initial=[0, 0]), ValueError, "initial=[0, 0]"),
    (dict(initial=[2.5, 3]), ValueError, "whole numbers"),
    (dict(controller="pid"), ValueError, "controller='pid'"),
    (dict(controller=object()), TypeError, "init(sizes) and update("),
    (dict(controller=NoStepTimeController()), TypeError, "update(self, state, sizes, times, "
     "step_time=None)"),
    (dict(min_sizes=-1), ValueError, "min_sizes=-1"),
    (dict(min_sizes=None), ValueError, "min_sizes=None"),
    (dict(max_sizes=0), ValueError, "max_sizes=0"),
    (dict(max_sizes=[4, "8"]), ValueError, "max_sizes=[4, '8']"),
    (dict(warmup_steps=-1), ValueError, "warmup_steps=-1"),
    (dict(interval=0), ValueError, "interval=0"),
    (dict(interval=2.5), ValueError, "interval=2.5"),
    (dict(probe_steps=0), ValueError, "probe_steps=0"),
    (dict(log_dir=""), ValueError, "log_dir=''"),
    (dict(verbose=-1), ValueError, "verbose=-1"),
    (dict(controller=hb.ModelBasedController(min_sizes=2), min_sizes=4), ValueError,
     "min_sizes=4 and a controller with min_sizes=2"),
    (dict(min_sizes=10, max_sizes=5), ValueError,
     "`min_sizes` must not exceed `max_sizes`. Received: min_sizes=10, max_sizes=5. Fix:"),
    (dict(min_sizes=[1, 9], max_sizes=[3, 4]), ValueError, "(replica 1: 9 > 4)"),
    (dict(min_sizes=4, max_sizes=[3, 8]), ValueError, "(replica 0: 4 > 3)"),
    (dict(min_sizes=[1, 2], max_sizes=[3, 4, 5]), ValueError, "must have the same length"),
])
def test_bad_constructor_arguments_fail_naming_the_value(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        hb.DynamicBatching(**kwargs)


@pytest.mark.parametrize("initial", ["flops", "probe", [10, 11, 11]])
@pytest.mark.parametrize("kwargs, message", [
    (dict(min_sizes=[20, 20, 20]),
     "`min_sizes` must sum to at most the global batch size 32 over the 3 replicas. "
     "Received: min_sizes=[20, 20, 20] (sum 60). Fix:"),
    (dict(min_sizes=11), "min_sizes=11 (sum 33)"),
    (dict(max_sizes=[8, 8, 8]),
     "`max_sizes` must sum to at least the global batch size 32 over the 3 replicas. "
     "Received: max_sizes=[8, 8, 8] (sum 24). Fix:"),
    (dict(max_sizes=[8, 40]), "`max_sizes` must have one entry per replica (3)"),
])
def test_bounds_no_split_of_the_global_batch_meets_fail_before_the_first_step(
        cpus, initial, kwargs, message):
    x, y = regression_data(n=64)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = build_under(strategy, dense_model)
    callback = hb.DynamicBatching(initial=initial, warmup_steps=0, interval=1, probe_steps=1,
                                  **kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[callback])
    assert int(model.optimizer.iterations.numpy()) == 0
    assert callback.history == [] and strategy.batch_sizes == (11, 11, 10)  # even: untouched


def test_bounds_fail_once_an_unknown_global_batch_is_measured(cpus):
    x, y = regression_data()

    def global_batches():  # a generator: tf.data cannot infer the batch size
        for i in range(0, len(x), 32):
            yield x[i:i + 32], y[i:i + 32]

    spec = (tf.TensorSpec([None, 8], tf.float32), tf.TensorSpec([None, 1], tf.float32))
    data = tf.data.Dataset.from_generator(global_batches, output_signature=spec)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = build_under(strategy, dense_model)
    callback = hb.DynamicBatching(min_sizes=[20, 20, 20], warmup_steps=1, interval=3)
    with pytest.raises(ValueError, match=re.escape(
            "`min_sizes` must sum to at most the global batch size 32 over the 3 replicas")):
        model.fit(data, epochs=1, verbose=0, callbacks=[callback])
    assert callback.history == []  # the first window gave B; no split was applied


def test_unknown_or_positional_arguments_are_type_errors():
    with pytest.raises(TypeError, match="intervall"):
        hb.DynamicBatching(intervall=3)
    with pytest.raises(TypeError):
        hb.DynamicBatching("probe")


def test_bad_state_fails_naming_the_fix():
    callback = hb.DynamicBatching()
    with pytest.raises(ValueError, match=re.escape("get_state()")):
        callback.set_state({"batch_sizes": [1, 2]})


# --------------------------------------------------------------------------- state ---------
def test_restored_state_resumes_with_the_saved_split_and_controller(cpus):
    x, y = regression_data()
    splits = [(20, 8, 4), (4, 8, 20), (6, 6, 20)]

    def run(callback, epochs):
        strategy = hb.HeteroMirroredStrategy(cpus[:3])
        model = build_under(strategy, dense_model)
        model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[callback])
        return strategy

    first = hb.DynamicBatching(initial="uniform", controller=CyclingController(splits),
                               warmup_steps=1, interval=3)
    run(first, epochs=1)  # windows end at steps 4, 7, 10
    state = json.loads(json.dumps(first.get_state()))
    assert state["batch_sizes"] == list(first.batch_sizes) != [11, 11, 10]
    assert state["global_step"] == 10

    # A fresh callback (as in a new process) built with another initial split: ignored.
    second = hb.DynamicBatching(initial=[30, 1, 1], controller=CyclingController(splits),
                                warmup_steps=100)
    second.set_state(state)
    strategy = run(second, epochs=1)
    assert strategy.batch_sizes == tuple(state["batch_sizes"])
    np.testing.assert_array_equal(strategy.read_replica_times().samples_per_step,
                                  state["batch_sizes"])  # from the very first step
    assert second.history == state["history"]  # no new static split
    assert second.get_state()["global_step"] == 20

    # The controller continues from its saved state: the next update is the next split.
    third = hb.DynamicBatching(controller=CyclingController(splits), warmup_steps=1,
                               interval=2)
    third.set_state(state)
    run(third, epochs=1)
    updates = state["controller_state"]["updates"]
    assert third.history[len(state["history"])]["new"] == list(splits[updates % len(splits)])


def test_second_fit_continues_without_a_new_static_split(cpus):
    x, y = regression_data(n=96)
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    model = build_under(strategy, dense_model)
    callback = hb.DynamicBatching(initial=[4, 8, 20], warmup_steps=100)
    for _ in range(2):
        model.fit(x, y, batch_size=32, verbose=0, callbacks=[callback])
    assert len(callback.history) == 1
    assert strategy.batch_sizes == (4, 8, 20)


# --------------------------------------------------------------------------- config --------
@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(initial="probe", controller="proportional", min_sizes=2, max_sizes=[40, 40, 40],
         warmup_steps=0, interval=3, probe_steps=4, log_dir="logs", verbose=1),
    dict(initial=[4, 8, 20], controller=hb.ModelBasedController(dead_band=0.1, min_sizes=2)),
])
def test_get_config_round_trip(kwargs):
    callback = hb.DynamicBatching(**kwargs)
    config = callback.get_config()
    assert json.loads(json.dumps(config)) == config
    clone = hb.DynamicBatching.from_config(config)
    assert clone.get_config() == config
    assert type(clone.controller) is type(callback.controller)
    assert clone.controller.get_config() == callback.controller.get_config()


def test_get_config_of_a_custom_controller_needs_custom_objects():
    callback = hb.DynamicBatching(controller=CyclingController([(1, 2)]))
    config = callback.get_config()
    with pytest.raises(ValueError, match="custom_objects"):
        hb.DynamicBatching.from_config(config)
    clone = hb.DynamicBatching.from_config(
        config, custom_objects={"CyclingController": CyclingController})
    assert clone.controller.splits == [(1, 2)]
