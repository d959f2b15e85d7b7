"""Batch-size controllers: measured per-replica times in, per-replica batch sizes out.

Pure Python + numpy, explicit state (Optax style), no clocks, no module globals. The same
`(state, sizes, times, step_time)` always gives the same new sizes, on every worker. Returned
sizes are python ints that sum to the global batch (fixed at `init`) and respect the bounds.

One mechanism (BUILD_NOTES.md, "The batch-size controller"), in four parts, each in its
module:

1. Time models (`time_models`): per replica t_k = alpha_k + beta_k * b_k, least squares over
   the windows with exponential forgetting (`memory`), with its uncertainty (the residual
   noise, pooled over replicas relative to the time, and its degrees of freedom). Until the
   sizes seen identify a slope, a replica borrows its last identified shape, else the
   others', else alpha = 0: `ProportionalController` is the alpha = 0 case throughout, the
   source paper's rule.
2. One change detector (`time_models.learn`, `_stats.detect`) on standardised residuals,
   shared by the time models and the step-time search: a window off its level by more than
   the bound is held back; the second in a row on the same side is a change, whose
   confirming window replaces that replica's data. A change of the step time makes any
   replica off its level a change at once. Bounds hold with probability `false_move_rate`
   on noise alone (Student-t, Bonferroni).
3. The move (`move`): to the models' equal-finish split only when the saving it surely
   brings over `horizon` windows, less the window a switch leaves unmeasured, pays for what
   a switch costs (`dead_band`): no move on noise. A saving that would pay and that a full
   memory of windows could prove is waited for at the split in force.
4. For what compute times miss (a CPU quota spent in periods, a collective that waits for a
   throttled process): successive elimination on the measured step time over candidate
   splits around the held one (`step_search`). The step time judges the rule's moves too: a
   move that it shows surely slower than the fastest split measured since the last change
   goes back there, and the rule holds off until a change.

`update` asks its guards in order (`_decide`); the first that decides gives the `Decision`
(the sizes and the reason; `ControllerState.reason` keeps the reason).

Example:
    >>> ctrl = ModelBasedController()
    >>> state = ctrl.init([32, 32])
    >>> for _ in range(2):
    ...     sizes, state = ctrl.update(state, sizes=state.sizes, times=[0.1, 0.3])
    >>> sizes, sum(sizes)
    ((48, 16), 64)
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike

from tf_hetbatch.core import split as _split
from tf_hetbatch.core._stats import ROUNDING, WindowSums, t_quantile
from tf_hetbatch.core._validate import format_value
from tf_hetbatch.core.bounds import Bounds, resolve_bounds
from tf_hetbatch.core.controller_config import ControllerConfig
from tf_hetbatch.core.controller_state import ControllerState
from tf_hetbatch.core.measurements import at_split
from tf_hetbatch.core.move import pays, predicted_gain, worth_waiting
from tf_hetbatch.core.search_state import SearchState
from tf_hetbatch.core.step_search import Search
from tf_hetbatch.core.time_models import Learned, ReplicaStats, learn, least_squares_models

logger = logging.getLogger(__name__)

__all__ = ["ControllerConfig", "ControllerState", "ProportionalController",
           "ModelBasedController", "Decision", "Guard"]


class Guard(enum.Enum):
    """`update`'s guards, in the order asked: the first that decides gives the split."""

    NO_MEASUREMENT = "no valid measurement yet: keep"
    OUT_OF_BOUNDS = "the split in force is out of bounds: the rule's split"
    STRADDLES_SWITCH = "the window straddles a switch: keep"
    STEP_TIME_GOES_BACK = "the step time shows the rule's move slower: back"
    OUTLIER_HELD = "a window held back as an outlier: keep, to check it"
    STEP_TIME_VETO = "the step time chose this split over the rule's: keep"
    RACE = "a race runs: the rule's sure gain, else the race's next arm"
    RULE = "the rule: move if it pays, else keep (and maybe start a race)"


class Decision(NamedTuple):
    """What a guard decided: the split to hold or move to, and why."""

    sizes: np.ndarray  # int64 [K]
    reason: str
    guard: Guard


class _RuleMove(NamedTuple):
    decision: Decision
    waiting: bool      # a saving that would pay is waited for (no race meanwhile)
    fill: np.ndarray   # the models' unrounded split at the kept tilt (a race's incumbent's)


@dataclasses.dataclass
class _Window:
    """One window, and what the controller made of it before deciding."""

    state: ControllerState
    searching: bool    # a step time came and the step-time search is on
    at_split: bool     # the window ran at the split in force (`measurements.at_split`)
    learned: Learned   # the time models and the detector after the window
    race: Search       # the step-time search (changed by the guards that decide)


def _measurement(name: str, value: ArrayLike, num: int) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be {num} numbers, one per replica. "
                         f"Received: {name}={value!r}") from None
    if arr.shape != (num,):
        raise ValueError(f"`{name}` must have one entry per replica ({num}). "
                         f"Received: {name}={format_value(value)} (shape {arr.shape})")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"`{name}` must be finite and >= 0 (window means per step). "
                         f"Received: {name}={format_value(value)}. Drop replicas with no "
                         "measurement by passing time 0, which means 'no data'.")
    return arr


def _step_time(value) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"`step_time` must be a number of seconds > 0 or None. "
                         f"Received: step_time={value!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"`step_time` must be a finite number of seconds > 0 or None. "
                         f"Received: step_time={value!r}")
    return value


# ---------------------------------------------------------------------------- controller --
class _Controller:
    """The mechanism; `ModelBasedController` (affine) and `ProportionalController` (alpha=0)."""

    affine = True

    def __init__(self, *, min_sizes: Bounds = 1, max_sizes: Bounds = None,
                 memory: float = 10.0, false_move_rate: float = 1e-3, horizon: int = 50,
                 dead_band: float = 0.0, step_time_search: bool = True,
                 search_step: float = 0.1):
        self.config = ControllerConfig(
            min_sizes=min_sizes, max_sizes=max_sizes, memory=memory,
            false_move_rate=false_move_rate, horizon=horizon, dead_band=dead_band,
            step_time_search=step_time_search, search_step=search_step)
        # The bounds also read as attributes (`DynamicBatching` makes its static split in them).
        self.min_sizes, self.max_sizes = self.config.min_sizes, self.config.max_sizes

    # ----- public API -------------------------------------------------------------------
    def get_config(self) -> Dict[str, Any]:
        """Constructor arguments as a JSON-serialisable dict (see `from_config`)."""
        return self.config.to_dict()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]):
        return cls(**dict(config))

    @staticmethod
    def state_from_dict(d: Mapping[str, Any]) -> ControllerState:
        """Rebuilds a state from `ControllerState.to_dict()` output."""
        return ControllerState.from_dict(d)

    def init(self, sizes: ArrayLike) -> ControllerState:
        """Starts from an allocation; its sum becomes the fixed global batch size.

        Args:
            sizes: the current per-replica batch sizes (e.g. the even or static split).

        Returns:
            The initial `ControllerState`. If `sizes` violate the bounds they are re-split
            proportionally within the bounds (logged).

        Raises:
            ValueError: on invalid sizes or bounds that no split can satisfy.
        """
        num = int(np.size(sizes)) if np.ndim(sizes) == 1 else -1
        if num < 1:
            raise ValueError(f"`sizes` must be a non-empty 1-D sequence of integers. "
                             f"Received: sizes={format_value(sizes)}")
        sizes = np.array(_split.validate_sizes(sizes, num), dtype=np.int64)
        total = int(sizes.sum())
        if total < 1:
            raise ValueError(f"`sizes` must sum to a global batch >= 1. Received: "
                             f"sizes={sizes.tolist()}")
        lo, hi = resolve_bounds(total, num, self.config.min_sizes, self.config.max_sizes)
        if (sizes < lo).any() or (sizes > hi).any():
            fixed = _split.split_proportionally(total, np.maximum(sizes, 1), lo, hi)
            logger.info("Initial sizes %s violate the bounds; using %s.", sizes.tolist(), fixed)
            sizes = np.array(fixed, np.int64)
        return ControllerState(total, sizes, lo, hi, replica_stats=ReplicaStats.fresh(num))

    def time_models(self, state: ControllerState) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Current per-replica time models (least squares): `(alpha, beta, has_slope)` arrays;
        `has_slope` is False where no identified model (own data or an earlier one) stands
        behind the slope."""
        stats = self._replica_stats(state)
        models = least_squares_models(stats, self.affine, self.config.false_move_rate)
        return models.alpha, models.beta, models.identified | stats.shape_known

    def update(self, state: ControllerState, sizes: ArrayLike, times: ArrayLike,
               step_time: Optional[float] = None) -> Tuple[Tuple[int, ...], ControllerState]:
        """Takes one window of measurements and returns the next allocation.

        Args:
            state: the state from `init` or the previous `update`.
            sizes: mean samples per step of each replica over the window (floats, length K).
            times: mean compute seconds per step of each replica over the window; 0 means
                "no measurement" for that replica.
            step_time: mean wall seconds per step of the whole synchronous step over the
                window, the same value on every worker (`DynamicBatching` passes it), or None.
                With it and `step_time_search`, the held split is refined on it (part 4).

        Returns:
            `(new_sizes, new_state)`: a tuple of K python ints summing to the global batch,
            within bounds, and the new state (with `reason` and `adjustments` updated).

        Raises:
            ValueError: on wrong lengths, NaN, infinite or negative measurements.
        """
        window = self._take(state, sizes, times, step_time)
        decision = self._decide(window)
        target = np.asarray(decision.sizes, np.int64)
        moved = not np.array_equal(target, state.sizes)
        if moved:
            window.race.switched(target)
        reason = "; ".join([decision.reason] + window.learned.notes)
        new_state = ControllerState(state.global_batch, target, state.min_sizes,
                                    state.max_sizes, updates=state.updates + 1,
                                    adjustments=state.adjustments + int(moved), reason=reason,
                                    replica_stats=window.learned.stats,
                                    search=window.race.to_state())
        if moved:
            logger.debug("Batch sizes -> %s (%s)", target.tolist(), reason)
        return tuple(target.tolist()), new_state

    def remove_replicas(self, state: ControllerState,
                        keep: ArrayLike) -> Tuple[Tuple[int, ...], ControllerState]:
        """Drops replicas (e.g. lost workers) and re-splits the global batch over the rest.

        Args:
            state: the current state.
            keep: boolean mask of length K, True for replicas that stay.

        Returns:
            `(sizes, state)` for the survivors; their time models are kept, a step-time
            search starts over (at the tilt it kept).

        Raises:
            ValueError: if the mask is malformed or the survivors' bounds cannot hold B.
        """
        keep = np.asarray(keep)
        if keep.shape != (state.num_replicas,) or keep.dtype != bool or not keep.any():
            raise ValueError(f"`keep` must be a boolean mask of length {state.num_replicas} "
                             f"with at least one True. Received: keep={format_value(keep)}")
        lo, hi = state.min_sizes[keep], state.max_sizes[keep]
        resolve_bounds(state.global_batch, int(keep.sum()), lo.tolist(), hi.tolist())
        sizes = _split.split_proportionally(state.global_batch,
                                            np.maximum(state.sizes[keep], 1), lo, hi)
        new = state.replace(sizes=sizes, min_sizes=lo, max_sizes=hi,
                            replica_stats=self._replica_stats(state).select(keep),
                            search=SearchState(tilt=state.search.tilt),
                            reason=f"removed {int((~keep).sum())} replica(s); re-split")
        return sizes, new

    # ----- one window -------------------------------------------------------------------
    def _replica_stats(self, state: ControllerState) -> ReplicaStats:
        stats = state.replica_stats
        if stats is not None and stats.num_replicas == state.num_replicas:
            return stats
        logger.info("Controller state without this version's time models (an older "
                    "checkpoint?): the models start afresh from the saved split.")
        return ReplicaStats.fresh(state.num_replicas)

    def _take(self, state: ControllerState, sizes, times, step_time) -> _Window:
        """Parts 1 and 2, and the search's measurements: what the window says before any
        decision."""
        num, cfg = state.num_replicas, self.config
        sizes = _measurement("sizes", sizes, num)
        times = _measurement("times", times, num)
        searching = cfg.step_time_search and step_time is not None
        step_time = _step_time(step_time) if step_time is not None else None
        here = at_split(sizes, state.sizes)
        race = Search(state.search, cfg, state.global_batch, state.min_sizes, state.max_sizes)
        if searching and here:
            race.observe(step_time)
        # A change the step time shows: the replicas it came from (during a race no replica
        # stays at one size for its level to show it) start again from this window.
        learned = learn(self._replica_stats(state), sizes, times, self.affine, cfg.forgetting,
                        cfg.false_move_rate, race.current_arm_levels() if here else None,
                        race.all_arm_levels(), race.changed)
        if here:
            race.add_times(times, learned.accepted)
        if learned.changed.any() or race.changed:
            race.restart(step_time_changed=race.changed)
            if searching and here:  # the step times start again from the confirming window
                race.observe(step_time)
            learned.notes.append("change on " + (
                f"replica(s) {np.flatnonzero(learned.changed).tolist()}"
                if learned.changed.any() else "the step time"))
        return _Window(state, searching, here, learned, race)

    def _decide(self, w: _Window) -> Decision:
        """The first of the guards, in this order, that decides (each returns None to pass)."""
        for guard in (self._no_measurement_yet, self._out_of_bounds, self._straddles_switch,
                      self._step_time_goes_back, self._outlier_held, self._step_time_veto,
                      self._race, self._rule):
            decision = guard(w)
            if decision is not None:
                return decision
        raise AssertionError("the rule always decides")

    # ----- the guards -------------------------------------------------------------------
    def _no_measurement_yet(self, w: _Window) -> Optional[Decision]:
        if not (w.learned.stats.sums.weight > 0).any():
            return Decision(w.state.sizes, "kept: no valid measurement yet", Guard.NO_MEASUREMENT)
        return None

    def _out_of_bounds(self, w: _Window) -> Optional[Decision]:
        current = w.state.sizes
        if (current > w.state.max_sizes).any() or (current < w.state.min_sizes).any():
            return self._rule_move(w, Guard.OUT_OF_BOUNDS, forced=True).decision
        return None

    def _straddles_switch(self, w: _Window) -> Optional[Decision]:
        if not w.at_split:
            return Decision(w.state.sizes, "kept: the window straddles a switch",
                            Guard.STRADDLES_SWITCH)
        return None

    def _step_time_goes_back(self, w: _Window) -> Optional[Decision]:
        back = w.race.judge(w.state.sizes) if w.searching else None
        if back is None:
            return None
        return Decision(back, f"back to {back.tolist()}: the step time shows the rule's move "
                              f"surely slower ({w.race.held_ms()})", Guard.STEP_TIME_GOES_BACK)

    def _outlier_held(self, w: _Window) -> Optional[Decision]:
        if (w.learned.stats.held_sign != 0).any():
            return Decision(w.state.sizes, "kept: a window held back is checked at the same "
                                           "split", Guard.OUTLIER_HELD)
        return None

    def _step_time_veto(self, w: _Window) -> Optional[Decision]:
        if w.race.vetoed:
            return Decision(w.state.sizes, "kept: the step time chose this split over the "
                                           "rule's move", Guard.STEP_TIME_VETO)
        return None

    def _race(self, w: _Window) -> Optional[Decision]:
        if not w.race.racing:
            return None
        # The rule still judges, from the split the race would go back to: a sure gain
        # of its own (new data identified a slope, say) ends the race.
        incumbent = w.race.incumbent_split()
        rule = self._rule_move(w, Guard.RACE, current=incumbent)
        if not np.array_equal(rule.decision.sizes, incumbent):
            return rule.decision
        split, reason = w.race.step()
        return Decision(split, reason, Guard.RACE)

    def _rule(self, w: _Window) -> Decision:
        rule = self._rule_move(w, Guard.RULE)
        current, models = w.state.sizes, w.learned.models
        if not (w.searching and not rule.waiting and np.array_equal(rule.decision.sizes, current)
                and math.isfinite(t_quantile(1.0 - self.config.false_move_rate, models.dof))):
            return rule.decision
        # The rule holds the split in force: a race around it, if there is one to run.
        levels = w.learned.stats.levels
        here = np.abs(levels.size - current) <= ROUNDING * (1.0 + current)
        incumbent_levels = WindowSums(*(np.where(here, v, 0.0) for v in levels.windows))
        target, started = w.race.start(current, models.alpha, models.beta, rule.fill,
                                       incumbent_levels)
        return Decision(target, f"{rule.decision.reason}; {started}" if started
                        else rule.decision.reason, Guard.RULE)

    def _rule_move(self, w: _Window, guard: Guard, forced: bool = False,
                   current=None) -> _RuleMove:
        """Part 3: the equal-finish split (with the search's kept tilt) if it pays against
        `current` (default the split in force), or at once if `forced`."""
        cfg, race, models = self.config, w.race, w.learned.models
        current = w.state.sizes if current is None else np.asarray(current, np.int64)
        target, fill = race.tilted(models.alpha, models.beta)
        if np.array_equal(target, current):
            return _RuleMove(Decision(current, "kept: at the models' split", guard), False, fill)
        kind = "affine models" if self.affine else "throughput-proportional"
        if forced:
            race.restart(changed=False)
            return _RuleMove(Decision(target, f"rebalanced: current split out of bounds "
                                              f"({kind})", guard), False, fill)
        gain = predicted_gain(models, current, target, cfg.false_move_rate)
        gains = f"predicted gain {gain.percent(gain.predicted):.1f}%, surely " \
                f"{gain.percent(gain.sure):.1f}%"
        # The sure saving must pay (a saving within rounding error of the step time is none:
        # ties of the models).
        if not (gain.sure > ROUNDING * gain.current and pays(gain.sure, gain, cfg)):
            waiting = worth_waiting(models, gain, cfg, self.affine)
            return _RuleMove(Decision(current, f"kept: {gains}" + (
                ", waiting for data" if waiting else ""), guard), waiting, fill)
        race.restart(changed=False, leaving=current)
        return _RuleMove(Decision(target, f"rebalanced: {gains} ({kind})", guard), False, fill)


class ProportionalController(_Controller):
    """The source paper's rule as the alpha = 0 case: b_k proportional to throughput.

    Throughput is b_k / t_k over the forgotten windows (`memory`: the paper's EWMA), and the
    split moves when the saving it surely brings pays for the switch (the paper's 5%
    dead-band on top: `dead_band=0.05`). Everything else (detector, search) is shared with
    `ModelBasedController`. (The paper's lowering of b_max after a throughput drop is not
    kept: the detector takes such a drop as a change and the models follow it.)

    Its arguments are `ControllerConfig`'s (min_sizes, max_sizes, memory, false_move_rate,
    horizon, dead_band, step_time_search, search_step).

    Example:
        >>> ctrl = ProportionalController()
        >>> state = ctrl.init([50, 50])
        >>> for _ in range(2):
        ...     sizes, state = ctrl.update(state, state.sizes, times=[1.0, 4.0])
        >>> sizes
        (80, 20)
    """

    affine = False


class ModelBasedController(_Controller):
    """Fits t_k = alpha_k + beta_k * b_k per replica and moves to the equal-finish split.

    See the module docstring for the mechanism and `ControllerConfig` for the arguments
    (min_sizes, max_sizes, memory, false_move_rate, horizon, dead_band, step_time_search,
    search_step).

    Example:
        >>> ctrl = ModelBasedController()
        >>> state = ctrl.init([40, 40])
        >>> for _ in range(2):
        ...     sizes, state = ctrl.update(state, state.sizes, [0.5, 1.0])
        >>> sizes
        (53, 27)
    """

    affine = True
