"""The controllers' move (part 3 of the mechanism): the models' equal-finish split, and
whether moving there pays.

The equal-finish split of the time models (exact water-filling, `split.equal_finish_fill`,
rounded to the smallest slowest finish) is moved to only when the saving it surely brings
(its lower confidence bound) over `horizon` windows, less the window a switch leaves
unmeasured, pays for what a switch costs (`dead_band`, 0 by default): no move on noise. A
saving that would pay and that the bound could still prove once the models' memory fills is
waited for at the split in force (no search meanwhile: moving sizes would blur the models).
Pure numpy.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from tf_hetbatch.core import split as _split
from tf_hetbatch.core._stats import ROUNDING, t_quantile
from tf_hetbatch.core.time_models import TimeModels

__all__ = ["SWITCH_WINDOWS", "equal_finish", "Gain", "predicted_gain", "pays", "worth_waiting"]

# Windows a switch leaves unmeasured: the one straddling it (`measurements.straddles_switch`:
# DynamicBatching and the simulator do not feed it to the controller; the lag steps fall in it).
SWITCH_WINDOWS = 1


def equal_finish(total: int, alpha, beta, lo, hi) -> np.ndarray:
    """Equal-finish split of t_k = alpha_k + beta_k * b_k under bounds, rounded to minimise
    the slowest finish time (int64 array summing to `total`)."""
    alpha, beta = np.asarray(alpha, np.float64), np.asarray(beta, np.float64)
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    x = _split.equal_finish_fill(float(total), alpha, beta, lo, hi)
    return rounded_equal_finish(x, total, alpha, beta, lo, hi)


def rounded_equal_finish(x, total: int, alpha, beta, lo, hi) -> np.ndarray:
    """`x`, the real-valued equal-finish split, rounded to minimise the slowest finish."""
    sizes = _split.round_preserving_sum(
        x, total, lo, hi, priority=lambda base: -(alpha + beta * (base + 1)))
    # Rounding gave each replica at most one sample above its floor; one with a small beta
    # may finish sooner with two. While the batches finishing strictly before the slowest
    # finish still hold the global batch, take those (less the excess, from the latest
    # finishing): the slowest finish drops each time, so this ends (within K rounds).
    for _ in range(sizes.size):
        worst = float(np.max(alpha + beta * sizes))
        below = np.minimum(np.maximum(np.ceil((worst - alpha) / beta) - 1.0, lo), hi).astype(
            np.int64)
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

    def percent(self, value: float) -> float:
        """`value` (seconds per step) in percent of the current step."""
        return 100.0 * value / self.current if self.current > 0 else 0.0


def predicted_gain(models: TimeModels, current, target, false_move_rate: float) -> Gain:
    """Predicted saving per step of `target` over `current` and its lower confidence bound
    (Student-t with the models' degrees of freedom, Bonferroni over the K replicas that may
    be the slowest)."""
    t_cur, v_cur = models.predict(current)
    t_new, v_new = models.predict(target)
    k_cur, k_new = int(np.argmax(t_cur)), int(np.argmax(t_new))
    gain = float(t_cur[k_cur] - t_new[k_new])
    se = math.sqrt(float(v_cur[k_cur] + v_new[k_new]))
    q = t_quantile(1.0 - false_move_rate / t_cur.size, models.dof)
    sure = gain - (q * se if se > 0 else 0.0)
    return Gain(gain, sure if not math.isnan(sure) else -math.inf, float(t_cur[k_cur]))


def pays(saving: float, gain: Gain, config) -> bool:
    """Whether `saving` per step over the horizon, less the window the switch leaves
    unmeasured, pays for what a switch costs beyond it (`config`: a `ControllerConfig`)."""
    return saving * (config.horizon - SWITCH_WINDOWS) > \
        config.dead_band * gain.current * config.horizon


def worth_waiting(models: TimeModels, gain: Gain, config, affine: bool) -> bool:
    """Whether a saving that does not surely pay yet is worth waiting for at this split: it
    would pay, and the data a full memory of windows here brings (weight `memory`, its
    degrees of freedom) could prove it (no search meanwhile: moving sizes would blur the
    models)."""
    k = models.alpha.size
    q_now = t_quantile(1.0 - config.false_move_rate / k, models.dof)
    q_full = t_quantile(1.0 - config.false_move_rate / k,
                        max(models.dof, k * (config.memory - (2 if affine else 1))))
    full = q_full / q_now * math.sqrt(min(float(np.min(models.weight)), config.memory)
                                      / config.memory) if math.isfinite(q_now) else 0.0
    return gain.predicted > max((gain.predicted - gain.sure) * full,
                                ROUNDING * gain.current) and pays(gain.predicted, gain, config)
