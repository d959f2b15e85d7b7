"""The controller's state: typed records, one versioned JSON form, old saved states still load.

`data/controller_state_unversioned.json` was written by `ModelBasedController` before its
state was typed (the unversioned dict of string-keyed arrays then): for four simulator runs,
the windows fed to `update`, the decision after each, and the state saved after some of them
(idle with windows at the split, with a fallback held, mid-race, a held split, replicas' and
the step time's outliers held, the step time's veto, a race of a single arm). Each part of
the saved state changes some later decision: loading it wrong fails a test.
"""

import json
import os

import numpy as np
import pytest

from tf_hetbatch.core._stats import WindowSums
from tf_hetbatch.core.controller_state import STATE_FORMAT, ControllerState
from tf_hetbatch.core.controllers import Guard, ModelBasedController, ProportionalController
from tf_hetbatch.core.search_state import Phase, SearchState
from tf_hetbatch.core.sim import scenario

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                       "controller_state_unversioned.json")


def _fixture():
    with open(FIXTURE) as f:
        return json.load(f)["runs"]


def _replay(ctrl, state, windows):
    decisions = []
    for w in windows:
        new, state = ctrl.update(state, w["sizes"], w["times"], step_time=w["step_time"])
        decisions.append({"sizes": list(new), "reason": state.reason,
                          "settled": state.settled_sizes.tolist()})
    return decisions, state


@pytest.mark.parametrize("run", range(4))
def test_states_saved_before_the_typed_state_load_and_continue_with_the_same_decisions(run):
    data = _fixture()[run]
    ctrl = ModelBasedController.from_config(data["config"])
    # A run that never saved decides as the code that wrote the file did, window by window,
    # until the first decision today's step-time search makes otherwise (it has changed
    # since: races that cannot find anything are not run); a state saved before that
    # continues as today's run that never saved.
    kept, _ = _replay(ctrl, ctrl.init(data["initial_sizes"]), data["windows"])
    agree = next((i for i, (mine, theirs) in enumerate(zip(kept, data["decisions"]))
                  if mine != theirs), len(kept))
    assert agree >= 5, agree
    for saved in data["saved"]:
        state = ctrl.state_from_dict(json.loads(json.dumps(saved["state"])))
        assert state.to_dict()["format"] == STATE_FORMAT
        i = saved["after_window"]
        assert state.sizes.tolist() == data["decisions"][i]["sizes"]
        assert state.settled_sizes.tolist() == data["decisions"][i]["settled"]
        search = saved["state"]["search"]
        assert (state.search.tilt, state.search.held_sign, state.search.vetoed) == (
            search["tilt"], search["held_sign"], search["vetoed"]), saved["kinds"]
        if i < agree:
            resumed, _ = _replay(ctrl, state, data["windows"][i + 1:])
            assert resumed == kept[i + 1:], saved["kinds"]


def test_the_fixture_covers_every_kind_of_saved_state():
    kinds = {k for run in _fixture() for saved in run["saved"] for k in saved["kinds"]}
    assert kinds == {"idle-with-base", "fallback", "racing", "vetoed", "holding",
                     "holding-one-arm", "outlier-held", "step-time-outlier-held"}


def test_an_old_race_of_a_single_arm_loads_idle_as_that_code_read_it():
    saved = next(s["state"] for run in _fixture() for s in run["saved"]
                 if "holding-one-arm" in s["kinds"])
    assert saved["search"]["phase"] == "holding" and saved["search"]["race"]
    state = ControllerState.from_dict(saved)
    assert state.search.phase is Phase.IDLE and state.search.race is None
    assert state.search.held is not None


@pytest.mark.parametrize("cls", [ProportionalController, ModelBasedController])
def test_the_typed_state_round_trips_through_json_at_every_window(cls):
    sc = scenario("quota", 3, 400, 0)
    ctrl = cls()
    state = ctrl.init([64, 64, 64])
    rng = np.random.default_rng(0)
    phases = set()
    for _ in range(40):
        sizes = state.sizes.astype(float)
        times, step = sc.cluster.times(sizes, np.ones(3), rng.uniform(0.95, 1.05, 3))
        text = json.dumps(state.to_dict(), allow_nan=False)
        restored = ControllerState.from_dict(json.loads(text))
        assert json.dumps(restored.to_dict(), allow_nan=False) == text
        a, state = ctrl.update(state, sizes, times, step_time=step)
        b, again = ctrl.update(restored, sizes, times, step_time=step)
        assert a == b and again.to_dict() == state.to_dict()
        phases.add(state.search.phase)
    assert Phase.RACING in phases


def test_the_state_is_typed_and_read_only():
    ctrl = ModelBasedController()
    state = ctrl.init([32, 32])
    _, state = ctrl.update(state, [32, 32], [0.1, 0.3], step_time=0.4)
    assert isinstance(state.search, SearchState) and isinstance(state.search.base, WindowSums)
    assert state.replica_stats.sums.weight.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError):
        state.replica_stats.levels.count[0] = 5.0
    with pytest.raises(ValueError, match="format"):
        ControllerState.from_dict({**state.to_dict(), "format": "tf_hetbatch.ControllerState/9"})


def test_each_decision_names_its_guard_and_keeps_its_reason():
    ctrl = ModelBasedController()
    state = ctrl.init([32, 32])
    w = ctrl._take(state, [32, 32], [0.0, 0.0], None)
    assert ctrl._decide(w).guard is Guard.NO_MEASUREMENT
    _, state = ctrl.update(state, [32, 32], [0.1, 0.3])
    w = ctrl._take(state, [30, 34], [0.1, 0.3], None)  # not the split in force
    decision = ctrl._decide(w)
    assert decision.guard is Guard.STRADDLES_SWITCH and decision.sizes.tolist() == [32, 32]
    w = ctrl._take(state, [32, 32], [0.1, 0.3], None)
    decision = ctrl._decide(w)
    assert decision.guard is Guard.RULE and decision.sizes.tolist() == [48, 16]
    assert decision.reason.startswith("rebalanced")
