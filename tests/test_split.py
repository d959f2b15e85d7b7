"""Tests for tf_hetbatch.core.split: exact sums, bounds, proportionality, clear errors."""

import numpy as np
import pytest

from tf_hetbatch.core.split import (equal_finish_fill, equal_finish_level, round_preserving_sum,
                                    split_evenly, split_proportionally, validate_sizes,
                                    water_fill)


def _random_cases(n=300):
    rng = np.random.default_rng(0)
    for _ in range(n):
        k = int(rng.integers(1, 40))
        total = int(rng.integers(0, 5000))
        caps = rng.uniform(0, 10, k) * (rng.uniform(size=k) > 0.1)
        if not caps.any():
            caps[0] = 1.0
        yield rng, total, caps


def test_split_evenly_sums_and_differs_by_at_most_one():
    for total in range(0, 50):
        for parts in range(1, 9):
            sizes = split_evenly(total, parts)
            assert sum(sizes) == total and len(sizes) == parts
            assert max(sizes) - min(sizes) <= 1
            assert list(sizes) == sorted(sizes, reverse=True)  # extras go to the first parts
            assert all(type(s) is int for s in sizes)


@pytest.mark.parametrize("total, parts", [(-1, 2), (4, 0), (4.5, 2), (True, 2)])
def test_split_evenly_rejects_bad_arguments(total, parts):
    with pytest.raises(ValueError, match="Received"):
        split_evenly(total, parts)


def test_unbounded_split_is_within_one_of_exact_proportion():
    for _, total, caps in _random_cases():
        sizes = np.array(split_proportionally(total, caps))
        assert sizes.sum() == total
        exact = total * caps / caps.sum()
        assert np.all(np.abs(sizes - exact) < 1.0)


def test_bounded_split_holds_sum_and_bounds_and_is_proportional_among_free_replicas():
    for rng, total, caps in _random_cases():
        k = caps.size
        lo = rng.integers(0, max(1, total // (2 * k)) + 1, k)
        hi = lo + rng.integers(0, max(2, 3 * total // k), k)
        if lo.sum() > total or hi.sum() < total:
            continue
        sizes = np.array(split_proportionally(total, caps, lo.tolist(), hi.tolist()))
        assert sizes.sum() == total
        assert np.all(sizes >= lo) and np.all(sizes <= hi)
        x = water_fill(float(total), np.zeros(k), caps, lo.astype(float), hi.astype(float))
        assert np.all(np.abs(sizes - x) < 1.0)
        free = (x > lo + 1e-9) & (x < hi - 1e-9) & (caps > 0)
        if free.sum() >= 2:
            level = x[free] / caps[free]
            assert np.allclose(level, level[0])
            # Clamped replicas are clamped in the right direction relative to the level.
            at_hi = (x >= hi - 1e-9) & (hi > lo) & (caps > 0)
            at_lo = (x <= lo + 1e-9) & (hi > lo) & (caps > 0)
            assert np.all(level[0] * caps[at_hi] >= hi[at_hi] - 1e-6)
            assert np.all(level[0] * caps[at_lo] <= lo[at_lo] + 1e-6)


def test_equal_finish_level_is_the_finish_time_of_every_replica_with_a_share():
    rng = np.random.default_rng(0)
    for _ in range(300):
        k = int(rng.integers(1, 12))
        total = float(rng.integers(1, 2000))
        alpha = rng.uniform(0, 0.05, k) * (rng.uniform(size=k) < 0.7)
        rates = rng.uniform(10, 10_000, k)
        level, x = equal_finish_level(total, alpha, rates)
        assert x.sum() == pytest.approx(total) and np.all(x >= 0)
        share = x > 1e-9
        np.testing.assert_allclose(alpha[share] + x[share] / rates[share], level, rtol=1e-9)
        assert np.all(alpha[~share] >= level - 1e-12)  # would finish later even with none
    # No fixed cost: the level is B / sum(rates), the proportional split's time.
    level, x = equal_finish_level(90.0, np.zeros(3), [10.0, 20.0, 0.0])
    assert level == pytest.approx(3.0) and x.tolist() == pytest.approx([30.0, 60.0, 0.0])


def test_the_controllers_equal_finish_fill_is_water_filling():
    # One level search (`_fill_level`) under both: in the finish time's units, as the
    # controllers solve it, and in water-filling's offsets and slopes.
    rng = np.random.default_rng(0)
    for _ in range(300):
        k = int(rng.integers(1, 40))
        alpha, beta = rng.uniform(0, 0.2, k) * (rng.uniform(size=k) < 0.8), rng.uniform(
            1e-3, 1e-2, k)
        lo = rng.integers(0, 5, k)
        hi = lo + rng.integers(0, 100, k)
        total = float(rng.integers(lo.sum(), hi.sum() + 1))
        x = equal_finish_fill(total, alpha, beta, lo, hi)
        np.testing.assert_allclose(x, water_fill(total, -alpha / beta, 1 / beta, lo, hi),
                                   atol=1e-6)
        assert x.sum() == pytest.approx(total) and np.all(x >= lo) and np.all(x <= hi)


def test_scalar_bounds_apply_to_every_replica():
    sizes = split_proportionally(100, [1, 1, 8], min_sizes=10, max_sizes=60)
    assert sum(sizes) == 100 and min(sizes) >= 10 and max(sizes) <= 60


def test_ties_are_broken_by_replica_index_deterministically():
    assert split_proportionally(10, [1, 1, 1]) == (4, 3, 3)
    assert split_proportionally(10, [1, 1, 1]) == split_proportionally(10, np.ones(3))


def test_zero_capacity_replicas_get_their_minimum_unless_others_are_full():
    assert split_proportionally(10, [0, 1, 2], min_sizes=1) == (1, 3, 6)
    sizes = split_proportionally(10, [0, 1, 0], max_sizes=4)
    assert sizes[1] == 4 and sum(sizes) == 10


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(capacities=[1, -1]), "capacities"),
    (dict(capacities=[1, float("nan")]), "capacities"),
    (dict(capacities=[0, 0]), "capacities"),
    (dict(capacities=[]), "capacities"),
    (dict(capacities=[[1, 2]]), "capacities"),
    (dict(capacities=[1, 1], min_sizes=6), "min_sizes"),
    (dict(capacities=[1, 1], max_sizes=[4, 4]), "max_sizes"),
    (dict(capacities=[1, 1], max_sizes=[4, 4, 4]), "max_sizes"),
    (dict(capacities=[1, 1], min_sizes=[5, 2], max_sizes=[4, 9]), "min_sizes"),
    (dict(capacities=[1, 1], min_sizes=-1), "min_sizes"),
    (dict(capacities=[1, 1], min_sizes=1.5), "min_sizes"),
])
def test_split_proportionally_errors_name_the_argument_and_echo_the_value(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        split_proportionally(10, **kwargs)
    assert f"`{fragment}`" in str(err.value) and "Received" in str(err.value)


def test_validate_sizes_accepts_whole_floats_and_returns_python_ints():
    sizes = validate_sizes([16, 48.0, np.int64(0)], 3, global_batch=64)
    assert sizes == (16, 48, 0) and all(type(s) is int for s in sizes)
    assert validate_sizes(np.array([3, 5]), 2) == (3, 5)


@pytest.mark.parametrize("sizes, fragment", [
    ([1, 2, 3], "one entry per replica"),
    ([1.5, 2], "whole numbers"),
    ([True, 2], "booleans"),
    ([-1, 2], ">= 0"),
    ([float("nan"), 2], "whole numbers"),
    ("ab", "1-D"),
    (5, "1-D"),
    ([10, 20], "sum to the global batch size 64"),
])
def test_validate_sizes_rejects_bad_allocations_with_the_value(sizes, fragment):
    with pytest.raises(ValueError) as err:
        validate_sizes(sizes, 2, global_batch=64 if fragment.startswith("sum") else None)
    assert fragment in str(err.value) and "Received: batch_sizes=" in str(err.value)


def test_round_preserving_sum_respects_priority_and_bounds():
    x = np.array([1.5, 1.5, 1.0])
    out = round_preserving_sum(x, 4, np.zeros(3), np.full(3, 4.0), priority=np.array([0, 1, 0]))
    assert out.tolist() == [1, 2, 1]
