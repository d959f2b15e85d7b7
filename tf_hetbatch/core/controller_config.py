"""The batch-size controllers' tunables (`ControllerConfig`), validated on construction.

Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict

import numpy as np

from tf_hetbatch.core.bounds import Bounds, check_bound, check_bounds_order, plain_bounds
from tf_hetbatch.core.move import SWITCH_WINDOWS

__all__ = ["ControllerConfig"]


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
        max_sizes: [samples] largest batch per replica: an int, one per replica (None: no
            cap), or None (B); 0 keeps a replica out of the split.
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
