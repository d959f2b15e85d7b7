"""Tests for tf_hetbatch.core.sim: the simulator's bookkeeping, effects and references."""

import itertools

import numpy as np
import pytest

from tf_hetbatch.core.controllers import ModelBasedController, ProportionalController
from tf_hetbatch.core.measurements import at_split, straddles_switch
from tf_hetbatch.core.sim import (SCENARIOS, ClusterModel, Slowdown, best_split, ideal_split,
                                  scenario, simulate)


def _random_cluster(rng, k, **kwargs):
    return ClusterModel(rng.uniform(0, 0.1, k), rng.uniform(1e-4, 1e-3, k), **kwargs)


def test_fixed_split_step_time_is_slowest_replica_plus_allreduce():
    cluster = ClusterModel([0.0, 0.1], [0.01, 0.02], allreduce=0.05)
    result = simulate(None, cluster, steps=5, initial_sizes=[10, 20])
    np.testing.assert_allclose(result.step_times, max(0.1, 0.1 + 0.4) + 0.05)
    assert result.adjustments == 0 and result.sizes.tolist() == [[10, 20]] * 5


@pytest.mark.parametrize("controller", [None, ProportionalController(), ModelBasedController()])
def test_sizes_sum_to_global_batch_and_no_split_beats_the_ideal(controller):
    rng = np.random.default_rng(0)
    cluster = _random_cluster(rng, 12, noise=0.1, allreduce=0.01,
                              slowdowns=(Slowdown(3, 50, 120, 3.0),), losses={7: 150})
    result = simulate(controller, cluster, steps=300, global_batch=600, seed=1)
    assert np.all(result.sizes.sum(axis=1) == 600)
    assert np.all(result.sizes[150:, 7] == 0) and np.all(result.sizes[:150, 7] > 0)
    assert np.all(result.model_step_times >= result.best_step_times - 1e-12)
    assert np.all(result.best_step_times >= result.ideal_step_times - 1e-12)
    assert np.all(result.flow_step_times <= result.ideal_step_times + 1e-12)


def test_ideal_split_equalises_finish_times_of_busy_replicas():
    rng = np.random.default_rng(0)
    for _ in range(50):
        k = int(rng.integers(1, 30))
        alpha, beta = rng.uniform(0, 0.2, k), rng.uniform(1e-3, 1e-2, k)
        x, t = ideal_split(100.0, alpha, beta)
        assert x.sum() == pytest.approx(100.0) and np.all(x >= 0)
        finish = alpha + beta * x
        busy = x > 1e-9
        level = finish[busy].max()
        np.testing.assert_allclose(finish[busy], level, rtol=1e-9)
        assert np.all(alpha[~busy] >= level - 1e-9)   # idle replicas would only be later
        assert t == pytest.approx(max(level, alpha.max()))  # everyone pays its fixed cost


def test_same_seed_gives_the_same_run_and_another_seed_differs():
    cluster = _random_cluster(np.random.default_rng(0), 8, noise=0.1)
    a = simulate(ModelBasedController(), cluster, 200, global_batch=256, seed=3)
    b = simulate(ModelBasedController(), cluster, 200, global_batch=256, seed=3)
    c = simulate(ModelBasedController(), cluster, 200, global_batch=256, seed=4)
    np.testing.assert_array_equal(a.step_times, b.step_times)
    np.testing.assert_array_equal(a.sizes, b.sizes)
    assert not np.array_equal(a.step_times, c.step_times)


@pytest.mark.parametrize("lag", [0, 3])
def test_changes_apply_after_the_lag_and_the_straddled_window_is_not_fed(lag):
    cluster = ClusterModel([0.0, 0.0], [0.001, 0.003])
    result = simulate(ProportionalController(), cluster, 60, adjust_every=10,
                      initial_sizes=[50, 50], switch_lag=lag)
    # The first window gives no noise estimate; the second moves the split.
    assert result.adjust_steps[0] == 20 + lag
    assert result.sizes[19 + lag].tolist() == [50, 50]
    assert result.sizes[20 + lag].tolist() == [75, 25]
    # The window after the decision straddles the switch when the lag is not 0.
    assert result.fed.tolist()[:3] == [True, True, lag == 0]
    assert len(result.reasons) == int(result.fed.sum())


def test_no_window_that_started_before_a_long_lag_ended_is_fed():
    # As DynamicBatching: a lag beyond a window leaves two windows unfed, the second mixed.
    cluster = ClusterModel([0.0, 0.0], [0.001, 0.003])
    result = simulate(ProportionalController(), cluster, 60, adjust_every=10,
                      initial_sizes=[50, 50], switch_lag=15)
    assert result.adjust_steps[0] == 35
    assert result.fed.tolist()[:5] == [True, True, False, False, True]


def test_a_window_straddles_a_switch_until_the_split_is_surely_in_force():
    # Switch decided before step 20, lag 3: in force from step 23.
    assert straddles_switch([40.0, 24.0], (48, 16), 20, 20, 3)
    assert not straddles_switch([48.0, 16.0], (48, 16), 20, 20, 3)  # already at the split
    assert not straddles_switch([40.0, 24.0], (48, 16), 23, 20, 3)  # started once in force
    assert not straddles_switch([40.0, 24.0], (48, 16), 20, None, 3)  # no switch watched
    assert at_split([48.0 + 1e-12, 16.0], (48, 16)) and not at_split([48.1, 15.9], (48, 16))


def test_a_quota_is_spent_in_periods():
    # 0.2 of a core in 10 ms periods: 2 ms of CPU per period, then a wait to the period's end.
    cluster = ClusterModel([0.0], [0.001], quota=0.2, quota_period=0.01)
    wall = cluster.wall(np.array([0.001, 0.002, 0.0021, 0.004, 0.0055]))
    np.testing.assert_allclose(wall, [0.001, 0.002, 0.0101, 0.012, 0.0215])
    free = ClusterModel([0.0], [0.001])
    np.testing.assert_allclose(free.wall(np.array([0.0055])), [0.0055])


def test_the_collective_counts_in_the_step_time_not_in_the_compute_times():
    cluster = ClusterModel([0.01, 0.01], [0.001, 0.001], collective=0.002, quota=[1.0, 0.5],
                           quota_period=0.01, allreduce=0.001)
    compute, step = cluster.times(np.array([10.0, 4.0]), np.ones(2))
    np.testing.assert_allclose(compute, [0.02, 0.024])  # 14 ms at half a core: 24 ms
    assert step == pytest.approx(0.031 + 0.001)  # 16 ms at half a core: 31 ms; + network


@pytest.mark.parametrize("k, total", [(2, 40), (3, 30)])
def test_best_split_is_the_brute_force_optimum(k, total):
    rng = np.random.default_rng(k)
    for _ in range(5):
        cluster = ClusterModel(rng.uniform(0, 0.01, k), rng.uniform(1e-4, 1e-3, k),
                               collective=rng.uniform(0, 0.003, k), allreduce=0.001,
                               quota=rng.choice([0.2, 0.5, 1.0], k), quota_period=0.01)
        sizes, seconds = best_split(cluster, total)
        assert sizes.sum() == total and np.all(sizes >= 1)
        brute = min(cluster.times(np.array(s, float), np.ones(k))[1]
                    for s in itertools.product(range(1, total + 1), repeat=k)
                    if sum(s) == total)
        assert seconds == pytest.approx(brute)
        assert cluster.times(sizes.astype(float), np.ones(k))[1] == pytest.approx(seconds)


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_builds_and_runs(name):
    sc = scenario(name, 5, 90, seed=1)
    assert sc.cluster.num_replicas == 5 and sc.phases[0] == 0
    result = simulate(ModelBasedController(), sc.cluster, 90, global_batch=320, seed=1)
    assert np.all(result.sizes.sum(axis=1) == 320)
    with pytest.raises(ValueError, match="name='cpu'"):
        scenario("cpu", 5)


def test_thousand_replicas_for_a_thousand_steps_completes():
    rng = np.random.default_rng(0)
    k = 1024
    cluster = _random_cluster(rng, k, noise=0.1, allreduce=0.02,
                              slowdowns=(Slowdown(5, 300, 600, 2.0),), losses={9: 700})
    result = simulate(ModelBasedController(), cluster, 1000, global_batch=64 * k, seed=0)
    assert result.step_times.shape == (1000,) and result.sizes.shape == (1000, k)
    assert np.all(result.sizes.sum(axis=1) == 64 * k)
    assert result.steady_ratio() < 1.1


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(alpha=[0.0], beta=[0.0]), "beta"),
    (dict(alpha=[-1.0], beta=[1.0]), "alpha"),
    (dict(alpha=[0.0, 0.0], beta=[1.0]), "alpha"),
    (dict(alpha=[0.0], beta=[1.0], noise=1.5), "noise"),
    (dict(alpha=[0.0], beta=[1.0], slowdowns=(Slowdown(3, 0),)), "replica"),
    (dict(alpha=[0.0], beta=[1.0], losses={0: 5}), "alive"),
    (dict(alpha=[0.0], beta=[1.0], quota=0.0), "quota"),
    (dict(alpha=[0.0, 0.0], beta=[1.0, 1.0], quota=[1.0, 1.5]), "quota"),
    (dict(alpha=[0.0], beta=[1.0], collective=-1.0), "collective"),
    (dict(alpha=[0.0], beta=[1.0], quota_period=0), "quota_period"),
])
def test_bad_cluster_models_are_rejected(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        ClusterModel(**kwargs)


def test_simulate_needs_a_starting_split():
    with pytest.raises(ValueError, match="global_batch"):
        simulate(None, ClusterModel([0.0], [1.0]), steps=3)
    with pytest.raises(ValueError, match="factor"):
        Slowdown(0, 0, None, factor=0.0)
