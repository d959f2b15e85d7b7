"""Used iterators are destroyed off the training loop (tf_hetbatch.distribute.iterator_release)."""

import threading
import time
import weakref

import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch.distribute import iterator_release
from helpers import dense_model, regression_data

DESTROYER = "tf_hetbatch-iterator-destroy"


class Thing:
    """A stand-in for an iterator: any object the keeper can hold."""


def destroyed_on(obj, threads):
    """Records the name of the thread that destroys `obj` in `threads`."""
    weakref.finalize(obj, lambda: threads.append(threading.current_thread().name))


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_iterator_is_destroyed_off_the_callers_thread_once_nothing_else_refers_to_it():
    keeper = iterator_release.IteratorKeeper(poll_s=0.01)
    threads = []
    thing = Thing()
    destroyed_on(thing, threads)
    keeper.hold(thing)
    time.sleep(0.1)  # ten looks: still referred to here, so still held
    assert keeper.num_held == 1 and threads == []
    del thing
    assert wait_until(lambda: keeper.num_held == 0)
    assert wait_until(lambda: threads == [DESTROYER])
    assert keeper.close(timeout=10)


def test_a_long_destruction_delays_neither_the_caller_nor_the_next_one():
    keeper = iterator_release.IteratorKeeper(poll_s=0.01)
    events, threads = [], []

    class SlowToDestroy:
        def __del__(self):
            events.append("slow started")
            time.sleep(0.5)
            events.append("slow destroyed")

    keeper.hold(SlowToDestroy())  # nothing else refers to it: the keeper destroys it
    assert wait_until(lambda: events == ["slow started"])
    quick = Thing()
    destroyed_on(quick, threads)
    keeper.hold(quick)
    del quick
    assert wait_until(lambda: threads == [DESTROYER])
    assert events == ["slow started"]  # the quick one did not wait for the slow one
    assert keeper.close(timeout=10)
    assert events == ["slow started", "slow destroyed"]  # close waits for the destructions


def test_close_lets_go_of_everything_and_later_iterators_are_not_held():
    keeper = iterator_release.IteratorKeeper(poll_s=60)  # no look before close
    threads = []
    things = [Thing() for _ in range(3)]
    for thing in things:
        destroyed_on(thing, threads)
        keeper.hold(thing)
    del thing, things  # only the keeper refers to them
    assert threads == []
    assert keeper.close(timeout=10)
    assert threads == [DESTROYER] * 3 and keeper.num_held == 0
    keeper.hold(Thing())  # after close: not held
    assert keeper.num_held == 0


def test_the_keepers_thread_runs_only_while_it_holds_something():
    keeper = iterator_release.IteratorKeeper(poll_s=0.01)
    keeper.hold(Thing())
    assert wait_until(lambda: keeper.num_held == 0)
    assert wait_until(lambda: keeper._thread is None)
    keeper.hold(Thing())  # a new thread takes over
    assert wait_until(lambda: keeper.num_held == 0)
    assert keeper.close(timeout=10)


@pytest.mark.parametrize("poll_s", [0, -1.0])
def test_a_keeper_needs_a_positive_poll_interval(poll_s):
    with pytest.raises(ValueError, match=rf"`poll_s` must be a positive.*Received: {poll_s}"):
        iterator_release.IteratorKeeper(poll_s=poll_s)


def test_fit_destroys_every_used_iterator_off_the_training_loop(cpus, monkeypatch):
    """Keras drops each epoch's iterator at the next epoch's first step: under our strategy
    none of them is destroyed on the training loop's thread, and none is held after fit."""
    keeper = iterator_release.IteratorKeeper(poll_s=0.01)
    threads, used = [], []

    def hold(iterator):
        destroyed_on(iterator, threads)
        used.append(weakref.ref(iterator))
        keeper.hold(iterator)

    monkeypatch.setattr(iterator_release, "hold", hold)
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    strategy.set_batch_sizes([3, 13])
    with strategy.scope():
        model = dense_model()
        model.compile("sgd", "mse")
    x, y = regression_data(n=64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=1).batch(16)
    model.fit(data, epochs=4, verbose=0)
    model.evaluate(data, verbose=0)
    assert len(used) >= 5  # an iterator per epoch, Keras's spare one and evaluate's
    assert wait_until(lambda: keeper.num_held == 0)
    # a destruction may wait for its autotuning thread's sleep (<= its iterator's age here)
    assert wait_until(lambda: len(threads) == len(used), timeout=iterator_release.EXIT_TIMEOUT_S)
    assert set(threads) == {DESTROYER}
    assert keeper.close(timeout=10)


def test_an_iterator_made_in_a_function_is_not_held(cpus, monkeypatch):
    held = []
    monkeypatch.setattr(iterator_release, "hold", held.append)
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    distributed = strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4))

    @tf.function
    def first_sum():
        return strategy.reduce("SUM", next(iter(distributed)), axis=0)

    assert int(first_sum()) == 0 + 1 + 2 + 3
    assert held == []
    eager = iter(distributed)
    assert held == [eager]
    assert np.concatenate([t.numpy() for t in strategy.experimental_local_results(
        next(eager))]).tolist() == [0, 1, 2, 3]
