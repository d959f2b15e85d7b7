"""The strategies' split state: what is set, what the training data asks, what applies."""

import logging

import pytest

from tf_hetbatch.core.split_state import SplitState


def test_even_until_set_and_the_data_known():
    state = SplitState(3)
    assert state.sizes is None and state.global_batch is None
    assert state.data_arrived(32) is None
    assert state.sizes == (11, 11, 10) and state.global_batch == 32


def test_a_split_set_before_the_data_must_fit_it():
    state = SplitState(2)
    assert state.set([10, 20])  # no data yet: applies now
    with pytest.raises(ValueError, match=r"global batch size 32.*sum 30"):
        state.data_arrived(32)
    assert state.sizes == (10, 20)
    assert state.data_arrived(30) is None  # installed when set


def test_a_split_of_the_data_in_use_is_remade_for_other_data(caplog):
    state = SplitState(2)
    state.data_arrived(128)
    assert state.set([96, 32])  # a controller's split, during the fit: applies now
    with caplog.at_level(logging.INFO, logger="tf_hetbatch"):
        assert state.data_arrived(64) == (48, 16)
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert state.sizes == (48, 16) and state.global_batch == 64


def test_a_split_set_for_the_next_data_waits_for_it(caplog):
    state = SplitState(2)
    state.data_arrived(128)
    with caplog.at_level(logging.INFO, logger="tf_hetbatch"):
        assert not state.set([48, 16])
    assert state.pending and state.sizes == (48, 16)
    assert "next training data" in caplog.records[0].message
    assert state.data_arrived(64) == (48, 16)  # installed now
    assert not state.pending
    state.set([40, 24])
    assert state.data_arrived(64) is None  # fits: installed when set


def test_a_pending_split_that_does_not_fit_the_next_data_is_refused_and_kept():
    state = SplitState(2)
    state.data_arrived(128)
    state.set([48, 16])
    with pytest.raises(ValueError, match=r"global batch size 128.*sum 64"):
        state.data_arrived(128)
    assert state.pending and state.data_batch == 128
    assert state.data_arrived(64) == (48, 16)


@pytest.mark.parametrize("sizes", [[1, 2, 3], [-1, 5], [1.5, 2]])
def test_bad_sizes_are_refused_with_the_value(sizes):
    with pytest.raises(ValueError, match="batch_sizes"):
        SplitState(2).set(sizes)
