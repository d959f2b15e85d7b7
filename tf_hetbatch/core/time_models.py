"""The controllers' time models and change detector (parts 1 and 2 of the mechanism).

Part 1, the time models: per replica t_k = alpha_k + beta_k * b_k, least squares over the
windows with exponential forgetting (`memory`), with its uncertainty: the residual noise
(pooled over replicas, relative to the time) and its degrees of freedom. Until the sizes seen
identify a slope, a replica's alpha / beta is its own last identified shape, else the other
replicas' (same model up to speed), else 0: the proportional rule (`affine=False` always).

Part 2, the change detector on standardised residuals, shared with the step-time search: a
window off its level (the replica's windows at the same size; in a race, at the same arm) by
more than the bound is held back (an outlier); the second in a row on the same side is a
change, whose confirming window then replaces that replica's data. The noise is the windows'
relative spread around their levels, pooled over the replicas and the levels they left (not
those ending in a change), so it survives moves.

State: `ReplicaStats` (per-replica numpy arrays). Pure numpy.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

import numpy as np

from tf_hetbatch.core._stats import ROUNDING, WindowSums, alarm_quantile, detect, t_quantile

__all__ = ["TimeSums", "Levels", "ReplicaStats", "TimeModels", "least_squares_models",
           "Learned", "learn"]


class TimeSums(NamedTuple):
    """Per replica, the least-squares sums of its windows (each window's weight decays by the
    forgetting factor per later window): weight, size, size^2, time, size * time, time^2."""

    weight: np.ndarray
    size: np.ndarray
    size_sq: np.ndarray
    time: np.ndarray
    size_time: np.ndarray
    time_sq: np.ndarray


class Levels(NamedTuple):
    """Per replica, the detector's reference: its windows at its current size (forgotten
    count, sum and sum of squares of their times) and that size; and the forgotten relative
    squared deviations, with their degrees of freedom, of the levels it left (so the noise
    survives a move)."""

    count: np.ndarray
    time: np.ndarray
    time_sq: np.ndarray
    size: np.ndarray
    past_ss: np.ndarray
    past_dof: np.ndarray

    @property
    def windows(self) -> WindowSums:
        return WindowSums(self.count, self.time, self.time_sq)


class ReplicaStats(NamedTuple):
    """Everything the time models and the detector keep per replica (arrays of length K)."""

    sums: TimeSums
    levels: Levels
    held_sign: np.ndarray    # side (+1 / -1) of a window held back as an outlier; 0: none
    shape: np.ndarray        # the last identified alpha / beta: it stands in after a change
    shape_known: np.ndarray  # bool: `shape` was identified

    @classmethod
    def fresh(cls, num: int) -> "ReplicaStats":
        zeros = np.zeros(num)
        return cls(TimeSums(*[zeros] * 6), Levels(*[zeros] * 6), zeros, zeros,
                   np.zeros(num, bool))

    @property
    def num_replicas(self) -> int:
        return int(self.held_sign.size)

    def select(self, keep: np.ndarray) -> "ReplicaStats":
        """The replicas of the boolean mask `keep`."""
        return ReplicaStats(TimeSums(*(v[keep] for v in self.sums)),
                            Levels(*(v[keep] for v in self.levels)), self.held_sign[keep],
                            self.shape[keep], self.shape_known[keep])


class TimeModels(NamedTuple):
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
        with np.errstate(invalid="ignore"):  # no noise estimate yet (inf) x 0 s at 0 samples
            var = np.where(self.identified, ident, self.noise / safe_w * ratio ** 2)
        return t, np.where(self.weight > 0, var, np.inf)


def least_squares_models(stats: ReplicaStats, affine: bool,
                         false_move_rate: float) -> TimeModels:
    """The time models of the forgotten sums (see the module docstring, part 1)."""
    s0, sb, sbb, s_t, sbt, stt = (np.asarray(v, np.float64) for v in stats.sums)
    has = s0 > 0
    safe = np.where(has, s0, 1.0)
    mb, mt = sb / safe, s_t / safe
    vb = np.maximum(sbb / safe - mb * mb, 0.0)
    vb = np.where(vb > ROUNDING * np.maximum(mb * mb, 1.0), vb, 0.0)
    cov = sbt / safe - mb * mt
    vt = np.maximum(stt / safe - mt * mt, 0.0)
    spread = has & (vb > 0) & affine
    beta_ls = np.where(spread, cov / np.where(spread, vb, 1.0), 0.0)
    alpha_ls = mt - beta_ls * mb
    rss_ls = np.maximum(vt - beta_ls * cov, 0.0) * s0
    # One-parameter model t = beta * (b + shape) through the mean point, for the replicas
    # whose slope is not identified: its own last identified shape alpha / beta, else the
    # identified replicas' median (set below), else 0.
    shape = np.where(stats.shape_known, stats.shape, 0.0) if affine else np.zeros_like(s0)

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
        shape = np.where(stats.shape_known, shape, borrowed)
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
    return TimeModels(alpha, beta, identified, mb, mt, s0, np.where(identified, vb, 0.0), noise,
                      dof)


def _median(values: np.ndarray) -> float:
    """`np.median` of finite values, without its NaN check (a third of its time)."""
    half = values.size // 2
    part = np.partition(values, [half - 1, half] if values.size > 1 else [0])
    return float(part[half] if values.size % 2 else 0.5 * (part[half - 1] + part[half]))


def level_noise(levels: Levels, arm_levels: Optional[WindowSums] = None) -> Tuple[float, float]:
    """Relative variance of a window's time around its level (pooled over the replicas, the
    levels they left, forgotten, and a race's levels at its arms, `arm_levels`: the noise,
    free of any model's misfit) and its degrees of freedom."""
    ss, dof = _level_ss(levels.windows)
    ss, dof = float(ss.sum() + levels.past_ss.sum()), float(dof.sum() + levels.past_dof.sum())
    if arm_levels is not None:
        arm_ss, arm_dof = _level_ss(arm_levels)
        ss, dof = ss + float(arm_ss.sum()), dof + float(arm_dof.sum())
    return (ss / dof, dof) if dof > 0 else (0.0, 0.0)


def _level_ss(windows: WindowSums) -> Tuple[np.ndarray, np.ndarray]:
    """Relative squared deviations of the windows at levels, and their dof."""
    n, s1, s2 = windows
    ok = n > 1
    safe_n = np.where(ok, n, 1.0)
    mean = np.where(ok, s1 / safe_n, 1.0)
    ss = np.where(ok, np.maximum(s2 - s1 * mean, 0.0) / (mean * mean), 0.0)
    return ss, np.where(ok, n - 1.0, 0.0)


class Learned(NamedTuple):
    """A window taken into the time models (`learn`)."""

    stats: ReplicaStats
    models: TimeModels   # the models of `stats`
    changed: np.ndarray  # bool per replica: the window confirmed a change
    accepted: np.ndarray  # bool per replica: the window went into the sums
    notes: List[str]     # for the update's reason


def learn(stats: ReplicaStats, sizes: np.ndarray, times: np.ndarray, affine: bool,
          forgetting: float, false_move_rate: float, arm: Optional[WindowSums] = None,
          arm_levels: Optional[WindowSums] = None, everyone: bool = False) -> Learned:
    """Parts 1 and 2: the detector, then the window into the sums.

    Args:
        stats: the replicas' state before the window.
        sizes, times: the window's mean samples and compute seconds per step (0: none).
        affine: the affine models (False: alpha = 0, the proportional rule).
        forgetting: the weight a window keeps per later window.
        false_move_rate: sets the detector's bound.
        arm: in a race, each replica's windows at the arm in force (the detector's reference
            where the replica is off its own level).
        arm_levels: in a race, each replica's windows at every arm (they join the noise).
        everyone: the step time changed, so a replica off its level is a change at once.
    """
    lv, num = stats.levels, stats.num_replicas
    valid = times > 0
    t = np.where(valid, times, 1.0)
    lam = forgetting
    # The detector compares a window with the replica's level: its windows at the same
    # size. (A time model's prediction at a size not seen, or its misfit of a curve that
    # is not affine, e.g. a CPU quota's staircase, is no evidence of a change.) In a
    # race, whose arms move the sizes, a replica's level there is its windows at the arm.
    same = valid & (lv.count > 0) & (np.abs(sizes - lv.size) <= ROUNDING * (
        1.0 + np.abs(sizes)))
    ref, n, s1 = same, lv.count, lv.time
    if arm is not None:
        at_arm = valid & ~same & (arm.count > 0)
        ref, n = same | at_arm, np.where(at_arm, arm.count, n)
        s1 = np.where(at_arm, arm.sum, s1)
    noise, dof = level_noise(lv, arm_levels)
    n = np.where(ref, n, 1.0)
    level = s1 / n
    sd = np.sqrt(noise * level * level * (1.0 + 1.0 / n))
    q = np.full(num, alarm_quantile(false_move_rate, num, dof))
    outlier = change = np.zeros(num, bool)
    watched = ref & np.isfinite(q)
    if watched.any():
        z, outlier, change = detect(t, level, level, np.where(watched, sd, 1.0),
                                    np.where(watched, q, np.inf), stats.held_sign)
        outlier, change = outlier & watched, change & watched
        if everyone:  # the step time saw the change already: off the bound is a change
            off = watched & (np.abs(z) > q)
            outlier, change = outlier & ~off, change | off
    accept = valid & ~outlier & ~change
    # A change's data starts from the window that confirmed it: the one held back before
    # may straddle the change.
    point = TimeSums(np.ones_like(t), sizes, sizes * sizes, t, sizes * t, t * t)
    sums = TimeSums(*(np.where(accept, lam * old + new, np.where(change, new, old))
                      for old, new in zip(stats.sums, point)))
    held_sign = np.where(outlier, np.sign(t - level),
                         np.where(valid, 0.0, stats.held_sign))
    new = ReplicaStats(sums, _next_levels(lv, sizes, t, lam, same, accept, change), held_sign,
                       stats.shape, stats.shape_known)
    notes = [f"{int(outlier.sum())} window(s) held back as outliers"] if outlier.any() else []
    models = least_squares_models(new, affine, false_move_rate)
    if affine:  # remember each identified shape: it stands in after a change
        with np.errstate(divide="ignore", invalid="ignore"):
            shape = np.where(models.identified, models.alpha / models.beta, new.shape)
        new = new._replace(shape=np.where(np.isfinite(shape), shape, 0.0),
                           shape_known=models.identified | new.shape_known)
    return Learned(new, models, change, accept, notes)


def _next_levels(lv: Levels, sizes, t, lam, same, accept, change) -> Levels:
    """The levels after a window: on at the same size, afresh at a new one and after a
    change. (A level that ends in a change leaves no noise: its last windows may straddle it.)"""
    left = accept & ~same
    level_ss, level_dof = _level_ss(lv.windows)
    keep = np.where(accept & same, lam, 0.0)
    on = accept | change
    return Levels(count=np.where(on, keep * lv.count + 1.0, lv.count),
                  time=np.where(on, keep * lv.time + t, lv.time),
                  time_sq=np.where(on, keep * lv.time_sq + t * t, lv.time_sq),
                  size=np.where(on, sizes, lv.size),
                  past_ss=lam * lv.past_ss + np.where(left, level_ss, 0.0),
                  past_dof=lam * lv.past_dof + np.where(left, level_dof, 0.0))
