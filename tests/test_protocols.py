"""The strategies implement the public protocols their users rely on (core.protocols)."""

import re

import numpy as np
import pytest

import tf_hetbatch as hb
from tf_hetbatch.core import protocols
from tf_hetbatch.core._validate import check_int


def _members(protocol):
    return sorted(n for n in dir(protocol) if not n.startswith("_"))


@pytest.mark.parametrize("cls, protocol", [
    (hb.HeteroMirroredStrategy, protocols.SynchronousSplitStrategy),
    (hb.HeteroMultiWorkerMirroredStrategy, protocols.SynchronousSplitStrategy),
    (hb.HeteroParameterServerStrategy, protocols.AsynchronousSplitStrategy),
])
def test_every_strategy_has_every_member_of_its_protocol(cls, protocol):
    assert _members(protocols.SplitStrategy)  # the common part is not empty
    missing = [n for n in _members(protocol) if not hasattr(cls, n)]
    assert missing == []


def test_the_kind_is_a_property_not_a_guess(cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    assert strategy.asynchronous is False and strategy.num_local_replicas == 2


def test_gathered_values_come_in_replica_order(cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:3])
    np.testing.assert_array_equal(strategy.gather_replica_values([0.5, 1.5, 2.5]),
                                  [0.5, 1.5, 2.5])
    assert strategy.gather_replica_values(np.ones((3, 2))).shape == (3, 2)
    assert strategy.read_replica_times().num_replicas == 3
    with pytest.raises(ValueError, match=re.escape("one row per local replica (3)")):
        strategy.gather_replica_values([1.0, 2.0])


def test_the_built_in_controllers_are_controllers():
    assert isinstance(hb.ModelBasedController(), protocols.Controller)
    assert isinstance(hb.ProportionalController(), protocols.Controller)
    assert not isinstance(object(), protocols.Controller)


@pytest.mark.parametrize("margin", [3, 2.5, True, None])
def test_switch_margin_is_a_checked_argument_named_in_the_error(margin):
    with pytest.raises(ValueError, match=re.escape(f"`switch_margin` must be an integer >= 4. "
                                                   f"Received: switch_margin={margin!r}. Fix:")):
        hb.HeteroMultiWorkerMirroredStrategy(switch_margin=margin)


@pytest.mark.parametrize("value", [0, -1, 1.0, True, "2"])
def test_check_int_names_the_value_and_the_fix(value):
    with pytest.raises(ValueError) as info:
        check_int("keep", value, 1, "e.g. keep=2.")
    assert str(info.value) == (f"`keep` must be an integer >= 1. Received: keep={value!r}. "
                               "Fix: e.g. keep=2.")
    assert check_int("keep", np.int64(3), 1) == 3
