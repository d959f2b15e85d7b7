"""Batch-size controllers: measured per-replica times in, per-replica batch sizes out.

Pure Python + numpy, explicit state (Optax style), no clocks, no module globals. The same
`(state, sizes, times)` always gives the same new sizes, on every worker. Returned sizes
are python ints that sum to the global batch (fixed at `init`) and respect the bounds.

Two controllers share one shape:

- `ProportionalController`: the source paper's rule. Throughputs X_k = b_k / t_k are
  EWMA-smoothed and the global batch is re-split proportionally to them, with a dead-band.
  Exact in one step when time is proportional to batch size; slow when fixed per-step
  costs exist.
- `ModelBasedController` (default): fits t_k = alpha_k + beta_k * b_k per replica online
  and jumps to the equal-finish-time split in one step; rejects outliers, accepts
  persistent regime changes, falls back to the proportional rule while beta is unknown.

Both refine the split they settle on from the measured step time when `update` gets it
(`step_time=`, which `DynamicBatching` passes): a model of compute times cannot see every
cost of a step (a CPU quota spent in periods, a collective that waits for a throttled
process), so neighbouring splits are tried and a measurably faster one is kept.

Example:
    >>> ctrl = ModelBasedController()
    >>> state = ctrl.init([32, 32])
    >>> sizes, state = ctrl.update(state, sizes=[32, 32], times=[0.1, 0.3])
    >>> sizes, sum(sizes)
    ((48, 16), 64)
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

from tf_hetbatch import split as _split

logger = logging.getLogger(__name__)

__all__ = ["ControllerState", "ProportionalController", "ModelBasedController"]

Bounds = Union[int, Sequence[int], None]


@dataclasses.dataclass(frozen=True, eq=False)
class ControllerState:
    """Explicit, immutable state of a controller.

    Attributes:
        global_batch: the global batch size B, fixed at `init`.
        sizes: int64 array, the current allocation (sums to B).
        min_sizes, max_sizes: int64 arrays, the current bounds (max may be lowered).
        updates: number of `update` calls so far.
        adjustments: number of updates that changed the allocation.
        reason: why the last update changed or kept the allocation (for dashboards).
        stats: controller-specific per-replica float arrays (first axis = replica).
    """

    global_batch: int
    sizes: np.ndarray
    min_sizes: np.ndarray
    max_sizes: np.ndarray
    updates: int = 0
    adjustments: int = 0
    reason: str = "initial split"
    stats: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for name in ("sizes", "min_sizes", "max_sizes"):
            arr = np.array(getattr(self, name), dtype=np.int64)
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        stats = {}
        for key, value in dict(self.stats).items():
            arr = np.array(value, dtype=np.float64)
            arr.setflags(write=False)
            stats[key] = arr
        object.__setattr__(self, "stats", stats)

    @property
    def num_replicas(self) -> int:
        return int(self.sizes.size)

    @property
    def settled_sizes(self) -> np.ndarray:
        """The split held, leaving out a step-time search's try in flight: while the search
        measures a neighbouring split, the split it goes back to unless the try proves
        faster; `sizes` otherwise."""
        search = _Search.of(self)
        return search.base.copy() if search.phase == _Search.PROBE else self.sizes.copy()

    def replace(self, **changes) -> "ControllerState":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable dict (lists, ints, floats, str); see `from_dict`."""
        return {
            "global_batch": int(self.global_batch),
            "sizes": self.sizes.tolist(),
            "min_sizes": self.min_sizes.tolist(),
            "max_sizes": self.max_sizes.tolist(),
            "updates": int(self.updates),
            "adjustments": int(self.adjustments),
            "reason": str(self.reason),
            "stats": {k: v.tolist() for k, v in sorted(self.stats.items())},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ControllerState":
        return cls(global_batch=int(d["global_batch"]), sizes=d["sizes"],
                   min_sizes=d["min_sizes"], max_sizes=d["max_sizes"],
                   updates=int(d["updates"]), adjustments=int(d["adjustments"]),
                   reason=str(d["reason"]), stats=d.get("stats", {}))


def _check_fraction(name: str, value: float, upper_open: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value and (
        value < 1 if upper_open else value <= 1)
    if not ok:
        rule = "in [0, 1)" if upper_open else "in [0, 1]"
        raise ValueError(f"`{name}` must be a number {rule}. Received: {name}={value!r}")
    return float(value)


def _measurement(name: str, value: ArrayLike, num: int) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be {num} numbers, one per replica. "
                         f"Received: {name}={value!r}") from None
    if arr.shape != (num,):
        raise ValueError(f"`{name}` must have one entry per replica ({num}). "
                         f"Received: {name}={_split._fmt(value)} (shape {arr.shape})")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"`{name}` must be finite and >= 0 (window means per step). "
                         f"Received: {name}={_split._fmt(value)}. Drop replicas with no "
                         "measurement by passing time 0, which means 'no data'.")
    return arr


class _Controller:
    """Shared plumbing: bounds, validation, dead-band bookkeeping, b_max lowering."""

    def __init__(self, *, min_sizes: Bounds = 1, max_sizes: Bounds = None,
                 dead_band: float = 0.05, max_drop: Optional[float] = 0.15,
                 step_time_search: bool = True):
        self.min_sizes = min_sizes
        self.max_sizes = max_sizes
        self.dead_band = _check_fraction("dead_band", dead_band)
        self.max_drop = None if max_drop is None else _check_fraction("max_drop", max_drop)
        if not isinstance(step_time_search, bool):
            raise ValueError(f"`step_time_search` must be True or False. "
                             f"Received: step_time_search={step_time_search!r}")
        self.step_time_search = step_time_search

    # ----- public API -------------------------------------------------------------------
    def get_config(self) -> Dict[str, Any]:
        """Constructor arguments as a JSON-serialisable dict (see `from_config`)."""
        config = {"min_sizes": self.min_sizes, "max_sizes": self.max_sizes,
                  "dead_band": self.dead_band, "max_drop": self.max_drop,
                  "step_time_search": self.step_time_search}
        for key in ("min_sizes", "max_sizes"):
            if config[key] is not None and np.ndim(config[key]) == 1:
                config[key] = [int(v) for v in config[key]]
        return config

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
                             f"Received: sizes={_split._fmt(sizes)}")
        sizes = np.array(_split.validate_sizes(sizes, num), dtype=np.int64)
        total = int(sizes.sum())
        if total < 1:
            raise ValueError(f"`sizes` must sum to a global batch >= 1. Received: "
                             f"sizes={sizes.tolist()}")
        lo, hi = _split.resolve_bounds(total, num, self.min_sizes, self.max_sizes)
        if np.any(sizes < lo) or np.any(sizes > hi):
            fixed = _split.split_proportionally(total, np.maximum(sizes, 1), lo, hi)
            logger.info("Initial sizes %s violate the bounds; using %s.", sizes.tolist(), fixed)
            sizes = np.array(fixed, np.int64)
        stats = {**self._init_stats(num), "configured_max": hi.astype(np.float64)}
        return ControllerState(total, sizes, lo, hi, stats=stats)

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
                With it and `step_time_search`, once the rule holds a split (its anchor), a
                search measures that split's step time over two windows, then tries
                b_k ~ b_k ** 1.3 (more to the larger batches: a double first step, a gain
                large enough to measure) and keeps each try that is faster by more than the
                dead-band and the measured noise, also when it proves faster than the base
                measured again right after it, going on in single steps (b_k ** 1.15); a
                double step that was not faster is followed by the single one; if nothing was
                kept it tries b_k ~ b_k ** 0.85 once (at once if the bounds leave no split
                the first way). It holds the best split until the rule, judging from its
                anchor, predicts a gain of 3x its dead-band, or the split's step time moves
                by as much for two windows, or the rule proves a change of conditions (the
                model-based rule's regime change, after which it judges with its own
                dead-band); each starts a new search. Each try costs two windows, each
                check of the base two more.

        Returns:
            `(new_sizes, new_state)`: a tuple of K python ints summing to the global batch,
            within bounds, and the new state (with `reason` and `adjustments` updated).

        Raises:
            ValueError: on wrong lengths, NaN, infinite or negative measurements.
        """
        num = state.num_replicas
        sizes = _measurement("sizes", sizes, num)
        times = _measurement("times", times, num)
        searching = self.step_time_search and step_time is not None
        if searching:
            step_time = _step_time(step_time)
        search = _Search.of(state) if searching else None
        # While a search runs or holds its result, the rule keeps judging from where it
        # settled (the anchor), and moves only for a predicted gain well beyond its dead-band
        # (a change of conditions): small moves of its estimates would undo the search.
        model_state, dead_band = state, self.dead_band
        if search is not None and search.phase != search.IDLE:
            model_state = state.replace(sizes=search.anchor)
            if search.phase != search.BASE:
                dead_band = min(0.5, _Search.RULE_DEAD_BAND_FACTOR * self.dead_band)
        target, hi, stats, reason, proven = self._update(model_state, sizes, times, dead_band)
        stats = {**{k: v for k, v in state.stats.items()
                    if k.startswith(_Search.PREFIX) or k == "configured_max"}, **stats}
        target = np.asarray(target, np.int64)
        if search is not None:
            target, stats, reason = search.step(self, state, target, hi, stats, reason, sizes,
                                                step_time, proven)
        changed = not np.array_equal(target, state.sizes)
        new_state = ControllerState(state.global_batch, target, state.min_sizes, hi,
                                    updates=state.updates + 1,
                                    adjustments=state.adjustments + int(changed),
                                    reason=reason, stats=stats)
        if changed:
            logger.debug("Batch sizes -> %s (%s)", target.tolist(), new_state.reason)
        return tuple(target.tolist()), new_state

    def remove_replicas(self, state: ControllerState,
                        keep: ArrayLike) -> Tuple[Tuple[int, ...], ControllerState]:
        """Drops replicas (e.g. lost workers) and re-splits the global batch over the rest.

        Args:
            state: the current state.
            keep: boolean mask of length K, True for replicas that stay.

        Returns:
            `(sizes, state)` for the survivors; learned per-replica statistics are kept.

        Raises:
            ValueError: if the mask is malformed or the survivors' bounds cannot hold B.
        """
        keep = np.asarray(keep)
        if keep.shape != (state.num_replicas,) or keep.dtype != bool or not keep.any():
            raise ValueError(f"`keep` must be a boolean mask of length {state.num_replicas} "
                             f"with at least one True. Received: keep={_split._fmt(keep)}")
        lo, hi = state.min_sizes[keep], state.max_sizes[keep]
        _split.resolve_bounds(state.global_batch, int(keep.sum()), lo.tolist(), hi.tolist())
        sizes = _split.split_proportionally(state.global_batch,
                                            np.maximum(state.sizes[keep], 1), lo, hi)
        stats = {k: v[keep] for k, v in state.stats.items()
                 if not k.startswith(_Search.PREFIX)}  # a step-time search starts over
        new = state.replace(sizes=sizes, min_sizes=lo, max_sizes=hi, stats=stats,
                            reason=f"removed {int((~keep).sum())} replica(s); re-split")
        return sizes, new

    # ----- helpers for subclasses ----------------------------------------------------------
    def _init_stats(self, num: int) -> Dict[str, np.ndarray]:
        raise NotImplementedError

    def _update(self, state, sizes, times, dead_band):
        """(target, max_sizes, stats, reason, changed): `changed` is True when the window
        proved a change of conditions (a step-time search then starts over)."""
        raise NotImplementedError

    def _lower_max(self, state: ControllerState, sizes: np.ndarray, throughput: np.ndarray,
                   valid: np.ndarray, changed: Optional[np.ndarray] = None
                   ) -> Tuple[np.ndarray, str]:
        """The paper's rule: if throughput fell after a replica's batch grew, cap it there.

        A drop within 4x the replica's running noise level (where the rule measures one,
        `stats["noise"]`) is not taken for one: windows that noisy would lower bounds at
        random. A replica whose conditions proved to have changed (`changed`) gets its
        configured bound back: a cap lowered from its old throughput says nothing about the
        new."""
        hi = state.max_sizes.copy()
        note = ""
        configured = state.stats.get("configured_max")
        if changed is not None and configured is not None:
            back = changed & (configured > hi)
            hi = np.where(back, np.rint(configured).astype(np.int64), hi)
            if back.any():
                note += f" b_max restored on {int(back.sum())} replica(s);"
        if self.max_drop is None or "prev_size" not in state.stats:
            return hi, note
        prev_b, prev_x = state.stats["prev_size"], state.stats["prev_throughput"]
        grew = valid & (prev_x > 0) & (sizes > prev_b + 0.5)
        limit = self.max_drop
        if "noise" in state.stats:
            limit = np.maximum(limit, -np.expm1(-4.0 * state.stats["noise"]))
        dropped = grew & (throughput < prev_x * (1.0 - limit))
        for k in np.flatnonzero(dropped):
            cap = max(int(state.min_sizes[k]), int(math.floor(prev_b[k])))
            if cap < hi[k] and hi.sum() - (hi[k] - cap) >= state.global_batch:
                hi[k] = cap
                note += f" b_max[{k}] lowered to {cap} (throughput fell after growth);"
        return hi, note


class ProportionalController(_Controller):
    """The source paper's rule: b_k proportional to EWMA-smoothed throughput b_k / t_k.

    Args:
        min_sizes: lower bound per replica (int or sequence), default 1.
        max_sizes: upper bound per replica (int, sequence, or None for B).
        smoothing: EWMA weight of the previous throughput estimate, in [0, 1); 0 uses the
            last window only.
        dead_band: keep the allocation when the predicted step-time gain is below this.
        max_drop: lower b_max of a replica to its previous size when its throughput fell by
            more than this fraction after its batch was increased; None disables. (The
            model-based rule gives the configured bound back after a regime change.)
        step_time_search: when `update` gets the window's step time, refine the settled
            split on it (see `_Controller.update`); False keeps the rule alone.

    Example:
        >>> ctrl = ProportionalController()
        >>> state = ctrl.init([50, 50])
        >>> ctrl.update(state, sizes=[50, 50], times=[1.0, 4.0])[0]
        (80, 20)
    """

    def __init__(self, *, min_sizes: Bounds = 1, max_sizes: Bounds = None,
                 smoothing: float = 0.5, dead_band: float = 0.05,
                 max_drop: Optional[float] = 0.15, step_time_search: bool = True):
        super().__init__(min_sizes=min_sizes, max_sizes=max_sizes, dead_band=dead_band,
                         max_drop=max_drop, step_time_search=step_time_search)
        self.smoothing = _check_fraction("smoothing", smoothing)

    def get_config(self) -> Dict[str, Any]:
        return {**super().get_config(), "smoothing": self.smoothing}

    def _init_stats(self, num):
        zeros = np.zeros(num)
        return {"throughput": zeros, "prev_size": zeros, "prev_throughput": zeros}

    def _update(self, state, sizes, times, dead_band):
        valid = (times > 0) & (sizes > 0)
        x_now = np.where(valid, sizes / np.where(times > 0, times, 1.0), 0.0)
        old = state.stats["throughput"]
        known = old > 0
        est = np.where(valid & known, self.smoothing * old + (1 - self.smoothing) * x_now,
                       np.where(valid, x_now, old))
        hi, note = self._lower_max(state, sizes, x_now, valid)
        stats = {"throughput": est,
                 "prev_size": np.where(valid, sizes, state.stats["prev_size"]),
                 "prev_throughput": np.where(valid, x_now, state.stats["prev_throughput"])}
        if not np.any(est > 0):
            return state.sizes, hi, stats, "kept: no valid measurement yet", False
        cap = np.where(est > 0, est, est[est > 0].mean())
        target = np.array(_split.split_proportionally(state.global_batch, cap,
                                                      state.min_sizes, hi), np.int64)
        current = float(np.max(state.sizes / cap))
        gain = 1.0 - float(np.max(target / cap)) / current if current > 0 else 0.0
        in_bounds = np.all(state.sizes <= hi) and np.all(state.sizes >= state.min_sizes)
        if gain < dead_band and in_bounds:
            return state.sizes, hi, stats, (
                f"dead-band: max predicted gain {100 * gain:.1f}% < "
                f"{100 * dead_band:.0f}%;{note}".rstrip(";")), False
        return target, hi, stats, (
            f"rebalanced: predicted gain {100 * gain:.1f}% (throughput-proportional);"
            f"{note}".rstrip(";")), False


class ModelBasedController(_Controller):
    """Fits t_k = alpha_k + beta_k * b_k per replica and solves the equal-finish split.

    Per replica, exponentially forgotten least-squares sums of (b, t) give alpha_k (fixed
    per-step cost) and beta_k (seconds per sample). The new split solves, under the bounds,
    `b_k(T) = clip((T - alpha_k) / beta_k, min_k, max_k)` with `sum b_k(T) = B` (exact
    water-filling), then rounds to integers giving the spare samples to the replicas that
    would finish first, so the sum stays exact.

    - Unidentified slope (all sizes seen so far nearly equal, or a slope not significant
      against the noise): alpha = 0 is assumed, i.e. the proportional rule, while no
      replica is identified; afterwards the identified replicas' median alpha / beta is
      borrowed (the same model up to speed). Once a slope has been
      identified it is remembered: when the window of recent sizes collapses (equilibrium),
      the last identified model is rescaled through the current mean point instead.
    - Outliers: a window whose time lies outside the model's prediction (for an
      unidentified replica: outside the range spanned by alpha = 0 and beta = 0) by more
      than `outlier_threshold` (relative, or 4x the replica's running noise level if
      larger) is held back and moves nothing.
    - Regime change: `confirm_updates` consecutive held-back windows with the same sign
      replace that replica's data by the held-back windows (accepted within a few updates);
      its last identified model, rescaled through them, stands in until they identify a
      slope (a change of speed, the common case, is then right at once).
    - Dead-band: no change when the predicted step-time gain is below `dead_band`.

    Args:
        min_sizes: lower bound per replica (int or sequence), default 1.
        max_sizes: upper bound per replica (int, sequence, or None for B).
        forgetting: weight kept by past windows at each update, in [0, 1).
        dead_band: minimum predicted relative gain for a change.
        outlier_threshold: relative deviation beyond which a window is held back.
        confirm_updates: consecutive same-sign deviations that prove a regime change (>= 1).
        min_spread: relative spread of observed sizes needed to identify the slope.
        max_drop: b_max lowering tolerance as in `ProportionalController`; None disables.
        step_time_search: refine the settled split on the measured step time, as in
            `ProportionalController`.

    Example:
        >>> ctrl = ModelBasedController()
        >>> state = ctrl.init([40, 40])
        >>> sizes, state = ctrl.update(state, [40, 40], [0.5, 1.0])
        >>> sizes
        (54, 26)
    """

    def __init__(self, *, min_sizes: Bounds = 1, max_sizes: Bounds = None,
                 forgetting: float = 0.8, dead_band: float = 0.05,
                 outlier_threshold: float = 0.3, confirm_updates: int = 2,
                 min_spread: float = 0.02, max_drop: Optional[float] = 0.15,
                 step_time_search: bool = True):
        super().__init__(min_sizes=min_sizes, max_sizes=max_sizes, dead_band=dead_band,
                         max_drop=max_drop, step_time_search=step_time_search)
        self.forgetting = _check_fraction("forgetting", forgetting)
        if not (isinstance(outlier_threshold, (int, float)) and outlier_threshold > 0):
            raise ValueError(f"`outlier_threshold` must be a number > 0 (relative deviation)."
                             f" Received: outlier_threshold={outlier_threshold!r}")
        self.outlier_threshold = float(outlier_threshold)
        if isinstance(confirm_updates, bool) or not isinstance(confirm_updates, int) or \
                confirm_updates < 1:
            raise ValueError(f"`confirm_updates` must be an integer >= 1. "
                             f"Received: confirm_updates={confirm_updates!r}")
        self.confirm_updates = confirm_updates
        self.min_spread = _check_fraction("min_spread", min_spread)

    def get_config(self) -> Dict[str, Any]:
        return {**super().get_config(), "forgetting": self.forgetting,
                "outlier_threshold": self.outlier_threshold,
                "confirm_updates": self.confirm_updates, "min_spread": self.min_spread}

    _SUMS = ("s0", "sb", "sbb", "st", "sbt", "stt")

    def _init_stats(self, num):
        zeros = np.zeros(num)
        stats = {k: zeros for k in self._SUMS}
        stats.update({"p" + k: zeros for k in self._SUMS})
        stats.update(noise=zeros, pending=zeros, prev_size=zeros, prev_throughput=zeros,
                     alpha_m=zeros, beta_m=zeros, fit_alpha=zeros, fit_beta=zeros, fit_ok=zeros)
        return stats

    def fit(self, state: ControllerState) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Current per-replica model: `(alpha, beta, has_slope)` arrays.

        `has_slope` is False where the proportional fallback (alpha = 0) is in use."""
        return self._fit(state.stats)

    def _fit(self, st):
        s0, sb, sbb, s_t, sbt, stt = (st[k] for k in self._SUMS)
        has = s0 > 0
        safe = np.where(has, s0, 1.0)
        mb, mt = sb / safe, s_t / safe
        var = np.maximum(sbb / safe - mb * mb, 0.0)
        cov = sbt / safe - mb * mt
        spread_ok = np.sqrt(var) >= np.maximum(0.5, self.min_spread * mb)
        beta = np.where(spread_ok, cov / np.where(var > 0, var, 1.0), 0.0)
        alpha = mt - beta * mb
        # Significance of the slope: its standard error from the residual scatter (or the
        # replica's running noise level, at least 0.5% of the time) must be < beta / 2.
        var_t = np.maximum(stt / safe - mt * mt, 0.0)
        resid_var = np.maximum(var_t - beta * cov, 0.0) * s0 / np.maximum(s0 - 2.0, 1.0)
        sigma = np.maximum(np.sqrt(resid_var), np.maximum(st["noise"], 0.005) * mt)
        beta_se = sigma / np.sqrt(np.maximum(s0 * var, 1e-300))
        spread_ok &= beta > 2.0 * beta_se
        origin = np.where(sbb > 0, sbt / np.where(sbb > 0, sbb, 1.0), 0.0)
        neg_alpha = spread_ok & (alpha < 0)
        beta = np.where(neg_alpha, origin, beta)
        alpha = np.where(neg_alpha, 0.0, alpha)
        identified = has & spread_ok & (beta > 0)
        # Slope not identified now: rescale the last identified model through the current
        # mean point (exact for a multiplicative change), else assume alpha = 0.
        mem_a, mem_b = st["alpha_m"], st["beta_m"]
        mem_t = mem_a + mem_b * mb
        remembered = has & ~identified & (mem_b > 0) & (mem_t > 0)
        scale = np.where(remembered, mt / np.where(mem_t > 0, mem_t, 1.0), 0.0)
        # Otherwise borrow the shape of the identified replicas' models: the median of
        # alpha / beta, the batch size whose compute costs as much as the fixed part (0, the
        # proportional rule, when none is identified yet). A replica that differs only in
        # speed (a CPU share, a slower device of the same kind) has the same alpha / beta, at
        # any batch size: a fixed-cost fraction alpha / t would not carry over to a replica
        # at a few samples, whose time is nearly all fixed cost.
        fixed = identified & (beta > 0)
        shape = float(np.median(alpha[fixed] / beta[fixed])) if fixed.any() else 0.0
        prop = np.where(mb > 0, mt / np.where(mb > 0, mb + shape, 1.0), 0.0)
        alpha = np.where(identified, alpha, np.where(
            remembered, scale * mem_a, np.where(mb > 0, shape * prop, mt)))
        beta = np.where(identified, beta, np.where(remembered, scale * mem_b, prop))
        known = beta > 0
        fill = float(np.median(beta[known])) if known.any() else 1.0
        beta = np.where(known, beta, fill)
        return alpha, beta, identified | remembered

    def _update(self, state, sizes, times, dead_band):
        st = dict(state.stats)  # entries are replaced, never written in place
        valid = times > 0
        has = st["s0"] > 0
        # The model fitted at the end of the previous update (same stats), else fit now.
        if has.any():
            alpha, beta, ident = st["fit_alpha"], st["fit_beta"], st["fit_ok"] > 0
        else:
            alpha, beta, ident = self._fit(st)
        # Prediction interval at the measured sizes (a point for identified replicas).
        safe = np.where(has, st["s0"], 1.0)
        mb, mt = st["sb"] / safe, st["st"] / safe
        prop = mt * sizes / np.where(mb > 0, mb, 1.0)
        model = alpha + beta * sizes
        p_lo = np.where(ident, model, np.minimum(mt, prop))
        p_hi = np.where(ident, model, np.maximum(mt, prop))
        t = np.where(valid, times, 1.0)
        resid = np.where(t > p_hi, np.log(t / np.maximum(p_hi, 1e-300)),
                         np.where(t < p_lo, np.log(t / np.maximum(p_lo, 1e-300)), 0.0))
        thr = np.maximum(math.log1p(self.outlier_threshold), 4.0 * st["noise"])
        large = valid & has & (np.abs(resid) > thr)
        accept = valid & ~large
        # Held-back windows: count consecutive same-sign deviations, keep their sums.
        sign = np.sign(resid)
        same = large & (np.sign(st["pending"]) == sign) & (st["pending"] != 0)
        point = {"s0": np.ones_like(t), "sb": sizes, "sbb": sizes * sizes, "st": t,
                 "sbt": sizes * t, "stt": t * t}
        for k in self._SUMS:
            st["p" + k] = np.where(same, st["p" + k] + point[k],
                                   np.where(large, point[k], 0.0))
        st["pending"] = np.where(same, st["pending"] + sign, np.where(large, sign, 0.0))
        regime = large & (np.abs(st["pending"]) >= self.confirm_updates)
        lam = self.forgetting
        for k in self._SUMS:
            st[k] = np.where(accept, lam * st[k] + point[k],
                             np.where(regime, st["p" + k], st[k]))
        st["noise"] = np.where(accept & has, 0.8 * st["noise"] + 0.2 * np.abs(resid), st["noise"])
        for k in self._SUMS:
            st["p" + k] = np.where(regime, 0.0, st["p" + k])
        st["pending"] = np.where(regime, 0.0, st["pending"])
        # The last identified model (alpha_m, beta_m) is kept: until the new data identify a
        # slope, it is rescaled through them, i.e. the change is taken as a change of speed.
        # That is what a CPU share, a noisy neighbour or a clock change does, and it is the
        # only guess left when the replica now runs a few samples whose time is nearly all
        # fixed cost (a recovered replica: its slope cannot be measured there).
        x_now = np.where(valid & (sizes > 0), sizes / t, 0.0)
        hi, note = self._lower_max(state, sizes, x_now, valid & (sizes > 0), regime)
        st["prev_size"] = np.where(valid, sizes, st["prev_size"])
        st["prev_throughput"] = np.where(valid & (sizes > 0), x_now, st["prev_throughput"])
        notes = note
        if large.any():
            held = int((large & ~regime).sum())
            notes += (f" {held} window(s) held back as outliers;" if held else "")
            notes += (f" regime change on {int(regime.sum())} replica(s);"
                      if regime.any() else "")
        if not np.any(st["s0"] > 0):
            return state.sizes, hi, st, "kept: no valid measurement yet", False
        alpha, beta, ident = self._fit(st)
        st["alpha_m"] = np.where(ident, alpha, st["alpha_m"])
        st["beta_m"] = np.where(ident, beta, st["beta_m"])
        st["fit_alpha"], st["fit_beta"], st["fit_ok"] = alpha, beta, ident.astype(np.float64)
        target = self._solve(state.global_batch, alpha, beta, state.min_sizes, hi)
        current = float(np.max(alpha + beta * state.sizes))
        new = float(np.max(alpha + beta * target))
        gain = 1.0 - new / current if current > 0 else 0.0
        in_bounds = np.all(state.sizes <= hi) and np.all(state.sizes >= state.min_sizes)
        changed = bool(regime.any())
        if changed:  # a proven change of conditions: the rule's own dead-band applies again
            dead_band = min(dead_band, self.dead_band)
        mode = "affine model" if ident.all() else (
            f"affine model, {int((~ident).sum())} replica(s) proportional (slope not yet "
            "identified)")
        if gain < dead_band and in_bounds:
            reason = (f"dead-band: max predicted gain {100 * gain:.1f}% < "
                      f"{100 * dead_band:.0f}%;{notes}")
            return state.sizes, hi, st, reason.rstrip(";"), changed
        reason = f"rebalanced: predicted gain {100 * gain:.1f}% ({mode});{notes}"
        return target, hi, st, reason.rstrip(";"), changed

    @staticmethod
    def _solve(total, alpha, beta, lo, hi) -> np.ndarray:
        """Equal-finish split under bounds, rounded to minimise the slowest finish time."""
        x = _split.water_fill(float(total), -alpha / beta, 1.0 / beta, lo, hi)
        return _split.round_preserving_sum(
            x, total, lo, hi, priority=lambda base: -(alpha + beta * (base + 1)))


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


class _Search:
    """Step-time search around the split a controller's rule settled on.

    A model of compute times cannot see every cost of a step: a CPU quota spent in periods, a
    collective that waits for a throttled process, kernels whose time jumps with the batch.
    So once the rule holds a split (its anchor), the search measures that split's step time
    over two windows, then tries the neighbouring split b_k ~ b_k ** (1 + s) (more to the
    replicas with more samples), first with a double step s = 0.3: on a noisy machine only
    a gain beyond the dead-band can be told from the noise, and a single step from the
    rule's equal finish rarely gains that much. A try faster than the base by more than the
    dead-band and the measured noise becomes the base, and the search goes on in that
    direction in single steps (s = 0.15). A try that is not faster is checked against the
    base measured again (the machine may have changed meanwhile: one window back at the
    base); if it was faster after all, it becomes the base; otherwise, after a double step,
    the single step the same way is tried (the double one may have gone past the fastest
    split), then the other direction (s = -0.15, towards the even split) once, if no try
    was kept yet (at once if the bounds leave no split the first way). Then the best split
    is held until the rule moves away from its anchor by a predicted gain of 3x its
    dead-band, or the held split's step time differs from the search's figure by as much in
    two windows running (a change of conditions: a worker slowed down or recovered), or the
    rule proves such a change from the replicas' own times (`changed`: the step times
    measured so far are then not comparable), which starts a new search. Each try or check
    costs two windows (the one straddling the change is not measured).

    State lives in `ControllerState.stats` under `search_*` (per-replica arrays; scalars are
    repeated per replica), so it survives `to_dict` / `from_dict`.
    """

    PREFIX = "search_"
    IDLE, BASE, PROBE, RECHECK, DONE = 0, 1, 2, 3, 4
    EXPONENT = 0.15
    RULE_DEAD_BAND_FACTOR = 3.0
    DRIFT_WINDOWS = 2
    _SCALARS = ("phase", "base_time", "probe_time", "noise", "direction", "accepted", "drift",
                "scale")
    _VECTORS = ("anchor", "base", "probe")

    def __init__(self, sizes, **values):
        self.phase, self.direction, self.accepted, self.drift, self.scale = self.IDLE, 1, 0, 0, 1
        self.base_time = self.probe_time = self.noise = 0.0
        self.anchor = self.base = self.probe = np.asarray(sizes, np.int64)
        for key, value in values.items():
            setattr(self, key, value)

    @classmethod
    def of(cls, state: ControllerState) -> "_Search":
        st, num = state.stats, state.num_replicas
        keys = [cls.PREFIX + k for k in cls._SCALARS + cls._VECTORS]
        if not all(k in st and st[k].size == num for k in keys):
            return cls(state.sizes)
        values = {k: float(st[cls.PREFIX + k][0]) for k in cls._SCALARS}
        for k in ("phase", "direction", "accepted", "drift", "scale"):
            values[k] = int(values[k])
        values.update({k: np.rint(st[cls.PREFIX + k]).astype(np.int64) for k in cls._VECTORS})
        return cls(state.sizes, **values)

    def _stats(self, stats, **changes) -> Dict[str, np.ndarray]:
        for key, value in changes.items():
            setattr(self, key, value)
        num = self.anchor.size
        out = dict(stats)
        for key in self._SCALARS:
            out[self.PREFIX + key] = np.full(num, float(getattr(self, key)))
        for key in self._VECTORS:
            out[self.PREFIX + key] = np.asarray(getattr(self, key), np.float64)
        return out

    def _neighbour(self, sizes, direction, lo, hi, scale=1) -> Optional[np.ndarray]:
        """The neighbouring split `scale` steps away in `direction`, or None if the bounds
        leave none."""
        total = int(np.sum(sizes))
        weights = np.maximum(sizes.astype(np.float64), 0.5)
        for mult in ((1, 2, 4) if scale == 1 else (scale, 2 * scale)):  # larger if rounding
            # keeps the split (a double step is not stretched: a bound in the way stops it)
            exponent = 1.0 + direction * mult * self.EXPONENT
            new = np.asarray(_split.split_proportionally(total, weights ** exponent, lo, hi),
                             np.int64)
            if not np.array_equal(new, sizes):
                return new
        return None

    def _try(self, stats, sizes, direction, lo, hi, done_reason, scale=1, **changes):
        """Moves to the neighbour of `sizes` in `direction`, or holds `sizes` when none."""
        nxt = self._neighbour(sizes, direction, lo, hi, scale)
        if self.phase == self.RECHECK and nxt is not None and np.array_equal(nxt, self.probe):
            nxt = None  # the single step rounds to the double step just tried
        if nxt is None:
            return sizes, self._stats(stats, phase=self.DONE, **changes), done_reason
        stats = self._stats(stats, phase=self.PROBE, probe=nxt, direction=direction,
                            scale=scale, **changes)
        return nxt, stats, None

    def step(self, ctrl, state, target, hi, stats, reason, sizes, step_time, changed):
        """(sizes, stats, reason) after one window, given the rule's `target`; `changed`:
        the rule proved a change of conditions in this window."""
        lo, current = state.min_sizes, state.sizes
        if self.phase == self.IDLE:
            if not np.array_equal(target, current):
                return target, self._stats(stats, anchor=target, base=target), reason
            self.anchor = current.copy()
        elif changed:  # the step times measured so far are not comparable any more
            stats = self._stats(stats, phase=self.IDLE, anchor=target, base=target)
            return target, stats, f"{reason}; step-time search starts over"
        elif not np.array_equal(target, self.anchor) or np.any(self.base > hi):
            stats = self._stats(stats, phase=self.IDLE, anchor=target, base=target)
            return target, stats, f"{reason}; step-time search starts over"
        elif np.any(current > hi):  # the rule lowered a bound below the split being tried
            stats = self._stats(stats, phase=self.DONE, drift=0)
            return self.base, stats, (f"step-time search done: {self.base.tolist()} "
                                      f"({current.tolist()} is out of bounds); {reason}")
        if not np.allclose(sizes, current, rtol=0, atol=1e-6):
            return current, self._stats(stats), reason  # a window not at the split in force
        now, was = _fmt_ms(1e3 * step_time), _fmt_ms(1e3 * self.base_time)
        if self.phase in (self.IDLE, self.BASE):
            if self.phase == self.IDLE:  # the first of the base's two windows
                stats = self._stats(stats, phase=self.BASE, base=current, base_time=step_time,
                                    accepted=0, direction=1, drift=0)
                return current, stats, f"{reason}; step-time search: {now} at {current.tolist()}"
            base_time = 0.5 * (self.base_time + step_time)
            noise = abs(step_time - self.base_time) / (step_time + self.base_time)
            for direction in (1, -1):  # towards even if the bounds leave nothing the other way
                nxt, stats, done = self._try(stats, current, direction, lo, hi, "", 2,
                                             base_time=base_time, noise=noise)
                if done is None:
                    break
            if done is not None:
                return nxt, stats, f"{reason}; step-time search: no neighbouring split"
            return nxt, stats, (f"step-time search: trying {nxt.tolist()} against "
                                f"{current.tolist()} at {_fmt_ms(1e3 * base_time)}")
        if self.phase == self.DONE:
            # The held split's step time moved for good (a worker slowed or recovered): the
            # rule judges again with its own dead-band, and a new search follows.
            change = step_time / self.base_time - 1.0
            limit = max(self.RULE_DEAD_BAND_FACTOR * ctrl.dead_band, 3.0 * self.noise)
            drift = int(np.sign(change)) if abs(change) > limit else 0
            drift = self.drift + drift if drift and np.sign(self.drift) in (0, drift) else drift
            if abs(drift) >= self.DRIFT_WINDOWS:
                stats = self._stats(stats, phase=self.IDLE, anchor=current, base=current)
                return current, stats, (f"{reason}; step-time search starts over: "
                                        f"{current.tolist()} now takes {now} ({was} before)")
            return self.base, self._stats(stats, drift=drift), reason
        margin = max(ctrl.dead_band, self.noise)
        if self.phase == self.PROBE:
            if step_time < self.base_time * (1.0 - margin):
                kept = f"step-time search: {current.tolist()} faster ({now} < {was})"
                nxt, stats, done = self._try(stats, current, self.direction, lo, hi,
                                             f"{kept}, kept", base=current,
                                             base_time=step_time, accepted=self.accepted + 1)
                return nxt, stats, done or f"{kept}; trying {nxt.tolist()}"
            # Not faster than the base as measured before: measure the base again.
            stats = self._stats(stats, phase=self.RECHECK, probe_time=step_time)
            return self.base, stats, (f"step-time search: {current.tolist()} not faster "
                                      f"({now} vs {was}); measuring {self.base.tolist()} again")
        # RECHECK: this window measured the base again, after a try that was not faster.
        tried = _fmt_ms(1e3 * self.probe_time)
        if self.probe_time < step_time * (1.0 - margin):
            kept = (f"step-time search: {self.probe.tolist()} faster than {current.tolist()} "
                    f"measured again ({tried} < {now})")
            nxt, stats, done = self._try(stats, self.probe, self.direction, lo, hi,
                                         f"{kept}, kept", base=self.probe,
                                         base_time=self.probe_time,
                                         accepted=self.accepted + 1)
            return (self.probe, stats, done) if done else (nxt, stats, f"{kept}; trying "
                                                                       f"{nxt.tolist()}")
        base_time = 0.5 * (self.base_time + step_time)
        # A double first step that was not faster may have gone past the fastest split: the
        # single step the same way; then, if nothing was kept, the other way.
        for direction, wanted in ((self.direction, self.scale > 1),
                                  (-1, self.accepted == 0 and self.direction == 1)):
            if wanted:
                nxt, stats, done = self._try(stats, current, direction, lo, hi, "",
                                             base_time=base_time)
                if done is None:
                    return nxt, stats, (f"step-time search: {current.tolist()} at {now} "
                                        f"again; trying {nxt.tolist()}")
        stats = self._stats(stats, phase=self.DONE, base_time=base_time)
        return current, stats, (f"step-time search done: {current.tolist()} at "
                                f"{_fmt_ms(1e3 * base_time)} ({self.probe.tolist()}: {tried})")


def _fmt_ms(ms: float) -> str:
    return f"{ms:.3g} ms"
