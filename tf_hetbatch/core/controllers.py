"""Batch-size controllers: measured per-replica times in, per-replica batch sizes out.

Pure Python + numpy, explicit state (Optax style), no clocks, no module globals. The same
`(state, sizes, times, step_time)` always gives the same new sizes, on every worker. Returned
sizes are python ints that sum to the global batch (fixed at `init`) and respect the bounds.

One mechanism (BUILD_NOTES.md, "The batch-size controller"), in four parts:

1. A time model per replica, t_k = alpha_k + beta_k * b_k, fitted by least squares over the
   windows with exponential forgetting (`memory`), with its uncertainty: the residual noise
   (pooled over replicas, relative to the time) and its degrees of freedom. Until the sizes
   seen identify a slope, a replica's alpha / beta is taken from its own last identified
   model, else from the other replicas' (same model up to speed), else 0: the proportional
   rule. `ProportionalController` is the alpha = 0 case throughout: the source paper's rule.
2. One change detector on standardised residuals, shared by everything that reacts to change
   (the time models and the step-time search): a window off its level (the replica's windows
   at the same size; in a race, at the same arm) by more than the bound is held back (an
   outlier); the second in a row on the same side is a change, whose confirming window then
   replaces that replica's data (its last identified alpha / beta stands in: a change of
   speed). A change of the step time makes any replica off its level at once a change. The
   noise is the windows' relative spread around their levels, pooled over the replicas and
   the levels they left (not those ending in a change), so it survives moves. Bounds hold
   with probability `false_move_rate` on noise alone (Student-t, Bonferroni).
3. The equal-finish split of the models (exact water-filling, rounded to the smallest
   slowest finish), moved to only when the saving it surely brings (its lower confidence
   bound) over `horizon` windows, less the window a switch leaves unmeasured, pays for what
   a switch costs (`dead_band`, 0 by default). So no move on noise. A saving that would pay
   and that the bound could still prove once the models' memory fills is waited for at the
   split in force (no search meanwhile: moving sizes would blur the models).
4. For what compute times miss (a CPU quota spent in periods, a collective that waits for a
   throttled process): successive elimination on the measured step time over candidate
   splits around the held one, each assuming d steps of unseen work on every replica (its
   own time for `search_step * B / K` samples); see `tf_hetbatch.core.step_search`. An arm stays
   in the race while what it might still save over the rest of the horizon pays for another
   visit; the winner's d is kept for the rule's later targets. The step time judges the
   rule's moves too: a move that it shows surely slower than the fastest split measured
   since the last change goes back there, and the rule holds off until a change.

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
import logging
import math
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike

from tf_hetbatch.core import split as _split
from tf_hetbatch.core import step_search as _search
from tf_hetbatch.core._stats import alarm_quantile, detect, t_quantile
from tf_hetbatch.core._validate import format_value
from tf_hetbatch.core.bounds import Bounds, check_bound, check_bounds_order, plain_bounds, \
    resolve_bounds
from tf_hetbatch.core.measurements import at_split

logger = logging.getLogger(__name__)

__all__ = ["ControllerConfig", "ControllerState", "ProportionalController",
           "ModelBasedController"]

# Windows a switch leaves unmeasured: the one straddling it (DynamicBatching and the
# simulator do not feed it to the controller; the lag steps fall in it).
SWITCH_WINDOWS = 1
# Below sqrt(machine epsilon) of its scale a spread of sizes, or a predicted saving, is
# rounding error of the sums.
_ROUNDING = math.sqrt(np.finfo(np.float64).eps)

_SUMS = ("s0", "sb", "sbb", "st", "sbt", "stt")
# The level: forgotten sums of the windows at the replica's current size (count, time,
# time squared) and that size, the detector's reference; and the forgotten relative squared
# deviations (and their dof) of the levels it left, so the noise survives a move.
_LEVEL = ("level_n", "level_t", "level_tt", "level_size", "past_ss", "past_dof")
_STATS = _SUMS + _LEVEL + ("held_sign", "shape", "shape_known")


# ---------------------------------------------------------------------------- config ------
def _number(name, value, low, high, low_open=False, high_open=False, hint=""):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
        value) and (value > low if low_open else value >= low) and (
        high is None or (value < high if high_open else value <= high))
    if not ok:
        lo_s, hi_s = ("(" if low_open else "["), (")" if high_open else "]")
        span = f"in {lo_s}{low}, {high}{hi_s}" if high is not None else \
            f"{'>' if low_open else '>='} {low}"
        raise ValueError(f"`{name}` must be a number {span}{hint}. Received: {name}={value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """The controller's tunables, validated on construction (all of them; units in brackets).

    Attributes:
        min_sizes: [samples] smallest batch per replica: an int for all, or one per replica
            (integers >= 0, `tf_hetbatch.core.bounds`).
        max_sizes: [samples] largest batch per replica: an int, one per replica, or None (B);
            0 keeps a replica out of the split.
        memory: [windows] how long the time models remember: each window's weight decays by
            1 - 1 / memory per window (1: the last window only). Changes are caught by the
            detector, not by forgetting, so a long memory costs little. Default 10.
        false_move_rate: [probability] of a move, a change alarm or a search verdict made on
            noise alone, per decision. Sets every confidence bound (Student-t, Bonferroni over
            the replicas or candidates compared). Default 1e-3.
        horizon: [windows] how long a split is expected to stay right: a move must pay back
            over it, and a step-time search spends at most it. Default 50.
        dead_band: [fraction of the step time] what a switch costs beyond the window it leaves
            unmeasured (e.g. a platform where changing the split is expensive); a move must
            surely save more per step. Default 0 (nothing beyond the statistics); the source
            paper used 0.05.
        step_time_search: search on the measured step time when `update` gets it. Default True.
        search_step: [fraction of B / K] spacing of the search's candidates: candidate d
            assumes d * search_step * B / K samples' worth of unseen work on every replica
            (d > 0 moves samples to the fast replicas). Default 0.1.
    """

    min_sizes: Bounds = 1
    max_sizes: Bounds = None
    memory: float = 10.0
    false_move_rate: float = 1e-3
    horizon: int = 50
    dead_band: float = 0.0
    step_time_search: bool = True
    search_step: float = 0.1

    def __post_init__(self):
        object.__setattr__(self, "min_sizes", check_bound("min_sizes", self.min_sizes, False))
        object.__setattr__(self, "max_sizes", check_bound("max_sizes", self.max_sizes, True))
        check_bounds_order(self.min_sizes, self.max_sizes)
        _number("memory", self.memory, 1.0, None, hint=" (windows), e.g. 10")
        _number("false_move_rate", self.false_move_rate, 0.0, 0.5, True, True, ", e.g. 1e-3")
        if isinstance(self.horizon, bool) or not isinstance(self.horizon, (int, np.integer)) \
                or self.horizon <= SWITCH_WINDOWS:
            raise ValueError(f"`horizon` must be an integer > {SWITCH_WINDOWS} (windows), e.g. "
                             f"50. Received: horizon={self.horizon!r}")
        _number("dead_band", self.dead_band, 0.0, 1.0, high_open=True, hint=", e.g. 0")
        if not isinstance(self.step_time_search, bool):
            raise ValueError(f"`step_time_search` must be True or False. "
                             f"Received: step_time_search={self.step_time_search!r}")
        _number("search_step", self.search_step, 0.0, 1.0, True, hint=", e.g. 0.1")

    @property
    def forgetting(self) -> float:
        """Weight a window keeps per later window: 1 - 1 / memory."""
        return 1.0 - 1.0 / float(self.memory)

    def to_dict(self) -> Dict[str, Any]:
        """The tunables as a JSON-serialisable dict (the controllers' constructor arguments)."""
        out = dataclasses.asdict(self)
        for key in ("min_sizes", "max_sizes"):
            out[key] = plain_bounds(out[key])
        return out


# ---------------------------------------------------------------------------- state -------
@dataclasses.dataclass(frozen=True, eq=False)
class ControllerState:
    """Explicit, immutable state of a controller (JSON through `to_dict` / `from_dict`).

    Attributes:
        global_batch: the global batch size B, fixed at `init`.
        sizes: int64 array, the current allocation (sums to B).
        min_sizes, max_sizes: int64 arrays, the current bounds (max may be lowered).
        updates: number of `update` calls so far.
        adjustments: number of updates that changed the allocation.
        reason: why the last update changed or kept the allocation (for dashboards).
        stats: per-replica float arrays (first axis = replica): the time models' sums.
        search: the step-time search's state (JSON-compatible values), see `step_search`.
    """

    global_batch: int
    sizes: np.ndarray
    min_sizes: np.ndarray
    max_sizes: np.ndarray
    updates: int = 0
    adjustments: int = 0
    reason: str = "initial split"
    stats: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    search: Mapping[str, Any] = dataclasses.field(default_factory=dict)

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
        object.__setattr__(self, "search", _search.plain(self.search))

    @property
    def num_replicas(self) -> int:
        return int(self.sizes.size)

    @property
    def settled_sizes(self) -> np.ndarray:
        """The split held, leaving out a step-time search's candidate in flight: while the
        search races candidates, the one it would keep now; `sizes` otherwise."""
        settled = _search.settled(self.search, self.stats)
        return self.sizes.copy() if settled is None else settled

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
            "search": _search.plain(self.search),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ControllerState":
        return cls(global_batch=int(d["global_batch"]), sizes=d["sizes"],
                   min_sizes=d["min_sizes"], max_sizes=d["max_sizes"],
                   updates=int(d["updates"]), adjustments=int(d["adjustments"]),
                   reason=str(d["reason"]), stats=d.get("stats", {}),
                   search=d.get("search", {}))


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


# ---------------------------------------------------------------------------- models ------
class Fit(NamedTuple):
    """Per-replica time models with their uncertainty (arrays of length K)."""

    alpha: np.ndarray       # seconds per step at 0 samples
    beta: np.ndarray        # seconds per sample
    identified: np.ndarray  # the replica's own sizes identify its slope
    mean_size: np.ndarray   # forgotten means of the windows' sizes and times
    mean_time: np.ndarray
    weight: np.ndarray      # forgotten number of windows
    size_var: np.ndarray    # forgotten variance of the sizes (0: one size seen)
    noise: np.ndarray       # variance of one window's time [s^2]
    dof: float              # degrees of freedom of the noise estimate (pooled)

    def predict(self, sizes) -> Tuple[np.ndarray, np.ndarray]:
        """(time, variance of that mean time) at `sizes`."""
        sizes = np.asarray(sizes, np.float64)
        t = self.alpha + self.beta * sizes
        safe_w = np.where(self.weight > 0, self.weight, 1.0)
        spread = np.where(self.size_var > 0, self.size_var, 1.0)
        ident = self.noise / safe_w * (1.0 + (sizes - self.mean_size) ** 2 / spread)
        ratio = t / np.where(self.mean_time > 0, self.mean_time, 1.0)
        var = np.where(self.identified, ident, self.noise / safe_w * ratio ** 2)
        return t, np.where(self.weight > 0, var, np.inf)


def fit_models(stats: Mapping[str, np.ndarray], affine: bool, false_move_rate: float) -> Fit:
    """Least-squares models from the forgotten sums (see the module docstring, part 1)."""
    s0, sb, sbb, s_t, sbt, stt = (np.asarray(stats[k], np.float64) for k in _SUMS)
    has = s0 > 0
    safe = np.where(has, s0, 1.0)
    mb, mt = sb / safe, s_t / safe
    vb = np.maximum(sbb / safe - mb * mb, 0.0)
    vb = np.where(vb > _ROUNDING * np.maximum(mb * mb, 1.0), vb, 0.0)
    cov = sbt / safe - mb * mt
    vt = np.maximum(stt / safe - mt * mt, 0.0)
    spread = has & (vb > 0) & affine
    beta_ls = np.where(spread, cov / np.where(spread, vb, 1.0), 0.0)
    alpha_ls = mt - beta_ls * mb
    rss_ls = np.maximum(vt - beta_ls * cov, 0.0) * s0
    # One-parameter model t = beta * (b + shape) through the mean point, for the replicas
    # whose slope is not identified: its own last identified shape alpha / beta, else the
    # identified replicas' median (set below), else 0.
    shape = np.where(stats["shape_known"] > 0, stats["shape"], 0.0) if affine else np.zeros_like(s0)

    def one_parameter(shape):
        beta = np.where(mb + shape > 0, mt / np.where(mb + shape > 0, mb + shape, 1.0), 0.0)
        rss = stt - 2 * beta * (sbt + shape * s_t) + beta ** 2 * (
            sbb + 2 * shape * sb + shape ** 2 * s0)
        return beta, np.maximum(rss, 0.0)

    def noise_of(rss, dof):
        ok = has & (dof > 0) & (mt > 0)
        total_dof = float(dof[ok].sum())
        pooled = float((rss[ok] / mt[ok] ** 2).sum()) / total_dof if total_dof > 0 else math.inf
        own = np.where(ok, rss / np.where(ok, dof, 1.0), 0.0)
        return np.maximum(own, pooled * mt * mt if math.isfinite(pooled) else np.inf), total_dof

    beta_1, rss_1 = one_parameter(shape)
    rss = np.where(spread, rss_ls, rss_1)
    noise, dof = noise_of(rss, np.where(spread, s0 - 2.0, s0 - 1.0))
    # Identified: the slope is positive at the confidence of `false_move_rate`.
    se_beta = np.sqrt(noise / np.maximum(s0 * vb, np.finfo(np.float64).tiny))
    q = t_quantile(1.0 - false_move_rate, dof)
    margin = np.where(se_beta > 0, q * se_beta, 0.0) if math.isfinite(q) else np.where(
        se_beta > 0, np.inf, 0.0)
    identified = spread & (beta_ls - margin > 0)
    # Times cannot be negative at 0 samples: a negative intercept is fitted through 0.
    origin = identified & (alpha_ls < 0)
    beta_ls = np.where(origin, sbt / np.where(sbb > 0, sbb, 1.0), beta_ls)
    alpha_ls = np.where(origin, 0.0, alpha_ls)
    if affine and identified.any():
        borrowed = _median(alpha_ls[identified] / beta_ls[identified])
        shape = np.where(stats["shape_known"] > 0, shape, borrowed)
        beta_1, rss_1 = one_parameter(shape)
        rss = np.where(identified, rss_ls, np.where(spread, rss_ls, rss_1))
        noise, dof = noise_of(rss, np.where(spread, s0 - 2.0, s0 - 1.0))
    alpha = np.where(identified, alpha_ls, np.where(mb + shape > 0, shape * beta_1, mt))
    beta = np.where(identified, beta_ls, beta_1)
    known = has & (beta > 0)
    if not known.all():  # no data yet, or only at 0 samples: the others' median model
        fill = _median(beta[known]) if known.any() else 1.0 / max(1.0, float(sb.sum()))
        beta = np.where(known, beta, fill)
        alpha = np.where(has, alpha, _median(alpha[has]) if has.any() else 0.0)
    return Fit(alpha, beta, identified, mb, mt, s0, np.where(identified, vb, 0.0), noise, dof)


def _median(values: np.ndarray) -> float:
    """`np.median` of finite values, without its NaN check (a third of its time)."""
    half = values.size // 2
    part = np.partition(values, [half - 1, half] if values.size > 1 else [0])
    return float(part[half] if values.size % 2 else 0.5 * (part[half - 1] + part[half]))


def _level_noise(st, arms=None) -> Tuple[float, float]:
    """Relative variance of a window's time around its level (pooled over the replicas, the
    levels they left, forgotten, and a race's levels at its arms, `arms`: the noise, free of
    any model's misfit) and its degrees of freedom."""
    ss, dof = _level_ss(st["level_n"], st["level_t"], st["level_tt"])
    ss, dof = float(ss.sum() + st["past_ss"].sum()), float(dof.sum() + st["past_dof"].sum())
    if arms is not None:
        arm_ss, arm_dof = _level_ss(*arms)
        ss, dof = ss + float(arm_ss.sum()), dof + float(arm_dof.sum())
    return (ss / dof, dof) if dof > 0 else (0.0, 0.0)


def _level_ss(n, s1, s2) -> Tuple[np.ndarray, np.ndarray]:
    """Relative squared deviations of the windows at levels (sums n, s1, s2), their dof."""
    ok = n > 1
    safe_n = np.where(ok, n, 1.0)
    mean = np.where(ok, s1 / safe_n, 1.0)
    ss = np.where(ok, np.maximum(s2 - s1 * mean, 0.0) / (mean * mean), 0.0)
    return ss, np.where(ok, n - 1.0, 0.0)


def equal_finish(total: int, alpha, beta, lo, hi) -> np.ndarray:
    """Equal-finish split of t_k = alpha_k + beta_k * b_k under bounds, rounded to minimise
    the slowest finish time (int64 array summing to `total`)."""
    alpha, beta = np.asarray(alpha, np.float64), np.asarray(beta, np.float64)
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    x = _split.equal_finish_fill(float(total), alpha, beta, lo, hi)
    sizes = _split.round_preserving_sum(
        x, total, lo, hi, priority=lambda base: -(alpha + beta * (base + 1)))
    # Rounding gave each replica at most one sample above its floor; one with a small beta
    # may finish sooner with two. While the batches finishing strictly before the slowest
    # finish still hold the global batch, take those (less the excess, from the latest
    # finishing): the slowest finish drops each time, so this ends (within K rounds).
    for _ in range(sizes.size):
        worst = float(np.max(alpha + beta * sizes))
        below = np.clip(np.ceil((worst - alpha) / beta) - 1.0, lo, hi).astype(np.int64)
        excess = int(below.sum()) - total
        if excess < 0:
            break
        order = np.argsort(-(alpha + beta * below), kind="stable")
        order = order[below[order] > lo[order]][:excess]
        if order.size < excess:
            break
        below[order] -= 1
        if not np.max(alpha + beta * below) < worst:
            break
        sizes = below
    return sizes


class Gain(NamedTuple):
    predicted: float  # seconds per step saved, as predicted
    sure: float       # its lower confidence bound
    current: float    # predicted step time at the current split


def predicted_gain(fit: Fit, current, target, false_move_rate: float) -> Gain:
    """Predicted saving per step of `target` over `current` and its lower confidence bound
    (Student-t with the models' degrees of freedom, Bonferroni over the K replicas that may
    be the slowest)."""
    t_cur, v_cur = fit.predict(current)
    t_new, v_new = fit.predict(target)
    k_cur, k_new = int(np.argmax(t_cur)), int(np.argmax(t_new))
    gain = float(t_cur[k_cur] - t_new[k_new])
    se = math.sqrt(float(v_cur[k_cur] + v_new[k_new]))
    q = t_quantile(1.0 - false_move_rate / t_cur.size, fit.dof)
    sure = gain - (q * se if se > 0 else 0.0)
    return Gain(gain, sure if not math.isnan(sure) else -math.inf, float(t_cur[k_cur]))


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
        if np.any(sizes < lo) or np.any(sizes > hi):
            fixed = _split.split_proportionally(total, np.maximum(sizes, 1), lo, hi)
            logger.info("Initial sizes %s violate the bounds; using %s.", sizes.tolist(), fixed)
            sizes = np.array(fixed, np.int64)
        return ControllerState(total, sizes, lo, hi, stats=self._fresh_stats(num))

    @staticmethod
    def _fresh_stats(num: int) -> Dict[str, np.ndarray]:
        zeros = np.zeros(num)
        return {k: zeros for k in _STATS}

    def fit(self, state: ControllerState) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Current per-replica model: `(alpha, beta, has_slope)` arrays; `has_slope` is False
        where no identified model (own data or an earlier one) stands behind the slope."""
        fit = fit_models(self._stats_of(state), self.affine, self.config.false_move_rate)
        return fit.alpha, fit.beta, fit.identified | (state.stats.get("shape_known", 0) > 0)

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
        num, cfg = state.num_replicas, self.config
        sizes = _measurement("sizes", sizes, num)
        times = _measurement("times", times, num)
        searching = cfg.step_time_search and step_time is not None
        step_time = _step_time(step_time) if step_time is not None else None
        hi = state.max_sizes
        current = state.sizes
        here = at_split(sizes, current)
        race = self._search(state, state.stats, hi)
        if searching and here:
            race.observe(step_time)
        # A change the step time shows: the replicas it came from (during a race no replica
        # stays at one size for its level to show it) start again from this window.
        stats, fit, changed, accepted, notes = self._learn(
            state, sizes, times, race.arm_level() if here else None, race.arm_levels(),
            race.changed)
        if here:
            race.add_times(times, accepted)
        if changed.any() or race.changed:
            race.restart(step_time_changed=race.changed)
            if searching and here:  # the step times start again from the confirming window
                race.observe(step_time)
            notes.append("change on " + (f"replica(s) {np.flatnonzero(changed).tolist()}"
                                         if changed.any() else "the step time"))
        target = current
        out_of_bounds = bool(np.any(current > hi) or np.any(current < state.min_sizes))
        if not np.any(stats["s0"] > 0):
            reason = "kept: no valid measurement yet"
        elif out_of_bounds:
            target, reason, _ = self._decide(state, fit, hi, race, forced=True)
        elif not here:
            reason = "kept: the window straddles a switch"
        elif searching and (back := race.judge(current)) is not None:
            target = back
            reason = (f"back to {back.tolist()}: the step time shows the rule's move surely "
                      f"slower ({race.held_ms()})")
        elif np.any(stats["held_sign"] != 0):
            reason = "kept: a window held back is checked at the same split"
        elif race.vetoed:
            reason = "kept: the step time chose this split over the rule's move"
        elif race.racing:
            # The rule still judges, from the split the race would go back to: a sure gain
            # of its own (new data identified a slope, say) ends the race.
            incumbent = race.incumbent_split()
            target, reason, _ = self._decide(state, fit, hi, race, False, incumbent)
            if np.array_equal(target, incumbent):
                target, reason = race.step()
        else:
            target, reason, waiting = self._decide(state, fit, hi, race, forced=False)
            if searching and not waiting and np.array_equal(target, current) and math.isfinite(
                    t_quantile(1.0 - cfg.false_move_rate, fit.dof)):
                at = np.abs(stats["level_size"] - current) <= _ROUNDING * (1.0 + current)
                level = tuple(np.where(at, stats[k], 0.0) for k in _LEVEL[:3])
                target, started = race.start(current, fit.alpha, fit.beta, level)
                reason = f"{reason}; {started}" if started else reason
        target = np.asarray(target, np.int64)
        moved = not np.array_equal(target, current)
        if moved:
            race.switched(target)
        reason = "; ".join([reason] + notes)
        search, arrays = race.to_state()
        stats = {**{k: v for k, v in stats.items() if k not in _search.ARRAYS}, **arrays}
        new_state = ControllerState(state.global_batch, target, state.min_sizes, hi,
                                    updates=state.updates + 1,
                                    adjustments=state.adjustments + int(moved),
                                    reason=reason, stats=stats, search=search)
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
            search starts over.

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
        stats = {k: v[keep] for k, v in self._stats_of(state).items()
                 if k not in _search.ARRAYS}
        search = _search.Search(state.search, {}, self.config, state.global_batch, lo, hi,
                                None, None)
        search.restart()
        new = state.replace(sizes=sizes, min_sizes=lo, max_sizes=hi, stats=stats,
                            search=search.to_state()[0],
                            reason=f"removed {int((~keep).sum())} replica(s); re-split")
        return sizes, new

    # ----- the parts --------------------------------------------------------------------
    def _search(self, state: ControllerState, stats, hi) -> _search.Search:
        total, lo = state.global_batch, state.min_sizes
        return _search.Search(
            state.search, stats, self.config, total, lo, hi,
            solve=lambda alpha, beta: equal_finish(total, alpha, beta, lo, hi),
            fill=lambda alpha, beta: _split.equal_finish_fill(float(total), alpha, beta, lo,
                                                              hi))

    def _stats_of(self, state: ControllerState) -> Dict[str, np.ndarray]:
        if all(k in state.stats and state.stats[k].shape == (state.num_replicas,)
               for k in _STATS):
            return dict(state.stats)  # (with a race's arrays, if one runs)
        logger.info("Controller state without this version's time models (an older "
                    "checkpoint?): the models start afresh from the saved split.")
        return self._fresh_stats(state.num_replicas)

    def _learn(self, state, sizes, times, arm=None, arms=None, everyone: bool = False):
        """Parts 1 and 2: the detector, then the window into the sums (`arm`: a race's
        levels at the arm in force, `Search.arm_level`; `arms`: at all its arms, for the
        noise; `everyone`: the step time changed).
        Returns (stats, the models fitted to them, changed mask, accepted mask, notes)."""
        cfg = self.config
        st = self._stats_of(state)
        valid = times > 0
        t = np.where(valid, times, 1.0)
        lam = cfg.forgetting
        # The detector compares a window with the replica's level: its windows at the same
        # size. (A time model's prediction at a size not seen, or its misfit of a curve that
        # is not affine, e.g. a CPU quota's staircase, is no evidence of a change.) In a
        # race, whose arms move the sizes, a replica's level there is its windows at the arm.
        same = valid & (st["level_n"] > 0) & (np.abs(sizes - st["level_size"]) <= _ROUNDING * (
            1.0 + np.abs(sizes)))
        ref, n, s1 = same, st["level_n"], st["level_t"]
        if arm is not None:
            at_arm = valid & ~same & (arm[0] > 0)
            ref, n, s1 = same | at_arm, np.where(at_arm, arm[0], n), np.where(at_arm, arm[1], s1)
        noise, dof = _level_noise(st, arms)
        n = np.where(ref, n, 1.0)
        level = s1 / n
        sd = np.sqrt(noise * level * level * (1.0 + 1.0 / n))
        q = np.full(state.num_replicas, alarm_quantile(cfg.false_move_rate, state.num_replicas,
                                                       dof))
        low = high = level
        outlier = change = np.zeros(state.num_replicas, bool)
        watched = ref & np.isfinite(q)
        if watched.any():
            z, outlier, change = detect(t, low, high, np.where(watched, sd, 1.0),
                                        np.where(watched, q, np.inf), st["held_sign"])
            outlier, change = outlier & watched, change & watched
            if everyone:  # the step time saw the change already: off the bound is a change
                off = watched & (np.abs(z) > q)
                outlier, change = outlier & ~off, change | off
        accept = valid & ~outlier & ~change
        point = {"s0": np.ones_like(t), "sb": sizes, "sbb": sizes * sizes, "st": t,
                 "sbt": sizes * t, "stt": t * t}
        # A change's data starts from the window that confirmed it: the one held back before
        # may straddle the change.
        new = dict(st)
        for k in _SUMS:
            new[k] = np.where(accept, lam * st[k] + point[k], np.where(change, point[k], st[k]))
        new["held_sign"] = np.where(outlier, np.sign(t - np.clip(t, low, high)),
                                    np.where(valid, 0.0, st["held_sign"]))
        # The level: on at the same size, afresh at a new one and after a change.
        # (A level that ends in a change leaves no noise: its last windows may straddle it.)
        left = accept & ~same
        level_ss, level_dof = _level_ss(st["level_n"], st["level_t"], st["level_tt"])
        new["past_ss"] = lam * st["past_ss"] + np.where(left, level_ss, 0.0)
        new["past_dof"] = lam * st["past_dof"] + np.where(left, level_dof, 0.0)
        keep = np.where(accept & same, lam, 0.0)
        for key, value in (("level_n", 1.0), ("level_t", t), ("level_tt", t * t)):
            new[key] = np.where(accept | change, keep * st[key] + value, st[key])
        new["level_size"] = np.where(accept | change, sizes, st["level_size"])
        notes = [f"{int(outlier.sum())} window(s) held back as outliers"] if outlier.any() else []
        after = fit_models(new, self.affine, cfg.false_move_rate)
        if self.affine:  # remember each identified shape: it stands in after a change
            with np.errstate(divide="ignore", invalid="ignore"):
                shape = np.where(after.identified, after.alpha / after.beta, new["shape"])
            new["shape"] = np.where(np.isfinite(shape), shape, 0.0)
            new["shape_known"] = np.where(after.identified, 1.0, new["shape_known"])
        return new, after, change, accept, notes

    def _decide(self, state, fit: Fit, hi, race, forced: bool, current=None):
        """Part 3: the equal-finish split (with the search's kept tilt) if it pays against
        `current` (default the split in force). Returns (split, reason, waiting): waiting
        when a saving that would pay is predicted but not yet sure (no search then)."""
        cfg = self.config
        current = state.sizes if current is None else np.asarray(current, np.int64)
        target = race.tilted(fit.alpha, fit.beta)
        if np.array_equal(target, current):
            return current, "kept: at the models' split", False
        gain = predicted_gain(fit, current, target, cfg.false_move_rate)
        # The sure saving over the horizon, less the window the switch leaves unmeasured,
        # against what a switch costs beyond it.
        # (A saving within rounding error of the step time is none: ties of the models.)
        pays = gain.sure > _ROUNDING * gain.current and gain.sure * (
            cfg.horizon - SWITCH_WINDOWS) > cfg.dead_band * gain.current * cfg.horizon
        pct = 100.0 * gain.predicted / gain.current if gain.current > 0 else 0.0
        sure = 100.0 * gain.sure / gain.current if gain.current > 0 else 0.0
        kind = "affine models" if self.affine else "throughput-proportional"
        if forced:
            race.restart(changed=False)
            return target, f"rebalanced: current split out of bounds ({kind})", False
        if not pays:
            # Waiting: the predicted saving would pay, and the data a full memory at this
            # split brings (weight `memory`, its degrees of freedom) could prove it: the split
            # stays put for that data (no search: moving sizes would blur the models).
            k = state.num_replicas
            q_now = t_quantile(1.0 - cfg.false_move_rate / k, fit.dof)
            q_full = t_quantile(1.0 - cfg.false_move_rate / k,
                                max(fit.dof, k * (cfg.memory - (2 if self.affine else 1))))
            full = q_full / q_now * math.sqrt(min(float(np.min(fit.weight)), cfg.memory)
                                              / cfg.memory) if math.isfinite(q_now) else 0.0
            waiting = gain.predicted > max((gain.predicted - gain.sure) * full,
                                           _ROUNDING * gain.current) and gain.predicted * (
                cfg.horizon - SWITCH_WINDOWS) > cfg.dead_band * gain.current * cfg.horizon
            return current, f"kept: predicted gain {pct:.1f}%, surely {sure:.1f}%" + (
                ", waiting for data" if waiting else ""), waiting
        race.restart(changed=False, leaving=current)
        return target, f"rebalanced: predicted gain {pct:.1f}%, surely {sure:.1f}% ({kind})", \
            False


class ProportionalController(_Controller):
    """The source paper's rule as the alpha = 0 case: b_k proportional to throughput.

    Throughput is b_k / t_k over the forgotten windows (`memory`: the paper's EWMA), and the
    split moves when the saving it surely brings pays for the switch (the paper's 5%
    dead-band on top: `dead_band=0.05`). Everything else (detector, search) is shared with
    `ModelBasedController`. (The paper's lowering of b_max after a throughput drop is not
    kept: the detector takes such a drop as a change and the models follow it.)

    Args: see `ControllerConfig` (min_sizes, max_sizes, memory, false_move_rate, horizon,
        dead_band, step_time_search, search_step).

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
