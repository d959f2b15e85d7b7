"""Per-replica bounds: one type, one rule (integers >= 0) for the controllers, DynamicBatching
and the split functions, and errors that name the value and the fix."""

import numpy as np
import pytest

from tf_hetbatch.core.bounds import check_bound, check_bounds_order, resolve_bounds
from tf_hetbatch.core.controllers import ModelBasedController
from tf_hetbatch.core.split import split_proportionally


def test_a_max_of_zero_keeps_a_replica_out_of_the_split():
    ctrl = ModelBasedController(min_sizes=[0, 1, 1], max_sizes=[0, 96, 96])
    state = ctrl.init([32, 32, 32])  # out of bounds: re-split within them
    assert state.sizes.tolist()[0] == 0 and state.sizes.sum() == 96
    for _ in range(6):  # (time 0: replica 0 measured nothing)
        sizes, state = ctrl.update(state, state.sizes, [0.0, 0.01, 0.03], step_time=0.04)
        assert sizes[0] == 0 and sum(sizes) == 96
    assert sizes[1] > sizes[2]
    assert split_proportionally(10, [1, 1], min_sizes=0, max_sizes=[0, 10]) == (0, 10)


@pytest.mark.parametrize("name, value, allow_none", [
    ("min_sizes", -1, False), ("min_sizes", None, False), ("min_sizes", 1.5, False),
    ("max_sizes", [4, "8"], True), ("max_sizes", [], True), ("max_sizes", True, True),
    ("max_sizes", [[1, 2]], True),
])
def test_one_rule_for_every_bound_with_the_value_and_the_fix(name, value, allow_none):
    with pytest.raises(ValueError) as err:
        check_bound(name, value, allow_none)
    text = str(err.value)
    assert text.startswith(f"`{name}` must be an integer >= 0") and "Fix:" in text
    assert f"Received: {name}=" in text
    if name == "min_sizes":  # the controllers say the same
        with pytest.raises(ValueError, match=f"`{name}` must be an integer >= 0"):
            ModelBasedController(min_sizes=value)


def test_bounds_normalise_to_ints_and_tuples():
    assert check_bound("min_sizes", np.int64(2), False) == 2
    assert check_bound("max_sizes", np.array([0, 3]), True) == (0, 3)
    assert check_bound("max_sizes", None, True) is None


def test_order_and_admission_errors_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"\(replica 1: 9 > 4\).*Fix:"):
        check_bounds_order((1, 9), (3, 4))
    with pytest.raises(ValueError, match="must not exceed"):
        ModelBasedController(min_sizes=5, max_sizes=[4, 9])
    with pytest.raises(ValueError, match=r"min_sizes=\[20, 20\] \(sum 40\)\. Fix:"):
        resolve_bounds(32, 2, (20, 20), None)
    with pytest.raises(ValueError, match=r"max_sizes=\[8, 8\] \(sum 16\)\. Fix:"):
        resolve_bounds(32, 2, 1, (8, 8))
    with pytest.raises(ValueError, match=r"one entry per replica \(3\)"):
        resolve_bounds(None, 3, 1, (8, 8))
    assert resolve_bounds(None, 2, 1, (8, 8)) is None
    lo, hi = resolve_bounds(32, 2, 1, None)
    assert lo.tolist() == [1, 1] and hi.tolist() == [32, 32]


def test_a_max_entry_of_none_caps_nothing_as_a_micro_batch_limit_of_none():
    """`max_sizes=[8, None]` (as `set_micro_batch_limits([8, None])` spells it): replica 0 at
    most 8, replica 1 uncapped; min_sizes entries stay integers."""
    assert check_bound("max_sizes", [8, None], True) == (8, None)
    lo, hi = resolve_bounds(32, 3, 1, [8, None, 20])
    assert hi.tolist() == [8, 32, 20]
    check_bounds_order([9, 30], [None, 40])  # no cap: any minimum
    with pytest.raises(ValueError, match=r"\(replica 0: 9 > 8\)"):
        check_bounds_order([9, 1], [8, None])
    with pytest.raises(ValueError, match="min_sizes"):
        check_bound("min_sizes", [1, None], False)
    assert split_proportionally(32, [3, 1], max_sizes=[8, None]) == (8, 24)
    ctrl = ModelBasedController(max_sizes=[8, None])
    state = ctrl.init([16, 16])
    assert state.sizes.tolist() == [8, 24]
    import tf_hetbatch as hb  # the callback's config keeps it (JSON-plain)

    config = hb.DynamicBatching(max_sizes=[8, None]).get_config()
    assert config["max_sizes"] == [8, None]
    assert hb.DynamicBatching.from_config(config).max_sizes == (8, None)
