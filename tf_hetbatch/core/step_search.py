"""The controllers' step-time search: successive elimination over candidate splits.

A model of compute times cannot see every cost of a step (a CPU quota spent in periods, a
collective that waits for a throttled process), so once the controller's rule holds a split,
this races candidate splits around it on the measured step time (window means, the same
value on every worker) and keeps the winner:

- Candidates ("arms") assume d steps of unseen work on every replica, each step its own
  time for theta = `search_step * B / K` samples: models alpha_k + d * theta * beta_k. What
  compute times miss is work on the replica stretched like its compute (a collective's part
  on a throttled worker, a quota's lost period), so d > 0 moves samples from the slow
  replicas to the fast, d < 0 back. Arm d is the held split (the incumbent, at the tilt the
  last race kept) moved as the models' unrounded equal-finish split moves from the
  incumbent's tilt to d (equal replicas: no move, no race). The race starts with the
  incumbent, d + 1, the direction unseen costs of slow replicas call for, and the tilt the
  held split's step time implies if further (the most unseen work the step leaves room for:
  a throttled worker's fixed cost can be many steps); d - 1 if no arm is worth a visit that
  way. The rule still judges during a race, from the incumbent, and ends it when its own
  split is surely faster.
- Visits go round robin in the order of d, so a drifting machine hits every arm alike. Each
  visit costs two windows: the one straddling the switch and the one measured.
- After each window, arm j leaves the race unless what it might still save over the rest of
  the horizon pays for another visit: (r_jb - d_j - c) * H_rest > d_j * VISIT_WINDOWS, with
  d_j how much slower it is than the best arm b (difference of mean log step times), r_jb
  the confidence bound of that difference (pooled Student-t noise, Bonferroni over the arms)
  and c what a switch costs (`dead_band`). Clearly slower arms go at once; as the horizon is
  spent, so does any doubt.
- A best arm at the edge whose inner neighbour is out gets the next arm beyond it (so an
  incumbent that beat d + 1 is tried against d - 1).
- An arm is not visited at all when its compute alone, as the time models predict it (a
  lower bound of its step time: the step waits for every replica's compute), already takes
  as long as the best step time measured.
- Each replica's windows at each arm (the arms' levels, the incumbent's seeded with the
  replica's level there) are what the shared detector compares a replica's window with, so
  a change of one replica shows during a race too; their spread joins the window noise.
- The noise of the step time is pooled over the arms and the earlier races since the last
  change of the step time (a rule's move, or a change only the time models see, keeps it):
  the bounds' degrees of freedom grow race after race.
- The race ends with one arm left (at the latest when the horizon is spent): the incumbent
  stays unless the winner is surely faster, and the winner's tilt is kept for the rule's
  later targets. The held split's step time is then watched by the shared change detector;
  a change there (or one the time models see) forgets the step times and, once the rule
  holds again, starts a new race.
- The step time judges the rule's moves as it judges arms: a move keeps the fastest split
  measured since the last change, with its windows, as the fallback. Once the split(s)
  measured after the move (two windows at least; in a race, its best arm) are surely slower
  than the fallback, the controller goes back to it and holds it, the rule's moves off, until
  a change (the time models were wrong about what the step time sees, e.g. a quota's
  staircase read as a slope).

State: a small JSON-compatible dict in `ControllerState.search`; the per-replica arrays (the
race's models and its arms' splits, the fallback's split) in `ControllerState.stats` under
`search_*`.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from tf_hetbatch.core import split as _split
from tf_hetbatch.core._stats import alarm_quantile, detect, t_quantile

__all__ = ["Search", "plain", "settled", "ARRAYS"]

# Windows one visit of a candidate costs: the one straddling the switch, the one measured.
VISIT_WINDOWS = 2
# Windows a switch leaves unmeasured (see controllers.SWITCH_WINDOWS).
_SWITCH_WINDOWS = VISIT_WINDOWS - 1
# Windows after a rule's move before the step time may judge it: two in a row, as the
# change detector (one window may be an outlier).
_JUDGED_AFTER = 2
IDLE, RACING, HOLDING = "idle", "racing", "holding"
# Per-replica arrays of a race, kept in `ControllerState.stats` (first axis = replica).
# (The levels: each replica's windows at each arm, count / time / time squared, so the
# shared detector compares a replica's window with its windows at the same size in a race.)
_RACE_ARRAYS = ("search_alpha", "search_beta", "search_splits", "search_level_n",
                "search_level_t", "search_level_tt")
_LEVELS = _RACE_ARRAYS[3:]
ARRAYS = _RACE_ARRAYS + ("search_fallback",)


def plain(value: Any) -> Any:
    """A JSON-compatible deep copy (numpy arrays and scalars to lists, ints, floats)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [plain(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return value


def settled(state: Mapping[str, Any], stats: Mapping[str, np.ndarray]) -> Optional[np.ndarray]:
    """The split a race would keep now (None when no race runs)."""
    race = state.get("race")
    if state.get("phase") != RACING or not race or "search_splits" not in stats:
        return None
    return np.rint(stats["search_splits"][:, race["settled"]]).astype(np.int64)


def _cell():
    return {"n": 0, "s1": 0.0, "s2": 0.0}


def _add(cell, y: float) -> None:
    cell["n"] += 1
    cell["s1"] += y
    cell["s2"] += y * y


class Search:
    """One update's view of the search (mutable here; `to_state` gives the new state).

    Args:
        state: `ControllerState.search` (a dict; empty for a fresh search).
        arrays: `ControllerState.stats`, where the per-replica arrays of a race live.
        config: the controller's `ControllerConfig`.
        total, lo, hi: the global batch and the bounds.
        solve: `solve(alpha, beta)`, the controller's equal-finish split within the bounds.
        fill: `fill(alpha, beta)`, the same before rounding (floats).
    """

    def __init__(self, state, arrays, config, total, lo, hi, solve, fill):
        state = dict(state or {})
        self.phase = state.get("phase", IDLE)
        self.tilt = int(state.get("tilt", 0))
        self.held_sign = float(state.get("held_sign", 0.0))
        # The step time's noise pooled over the races since its last change: squared
        # deviations of windows at a repeated split from their mean, and their count.
        self.noise_ss = float(state.get("noise_ss", 0.0))
        self.noise_dof = float(state.get("noise_dof", 0.0))
        self.base = dict(state["base"]) if state.get("base") else None
        self.held = dict(state["held"]) if state.get("held") else None
        # The fastest split measured since the last change that a rule's move left (its
        # windows; its split in `arrays`), and whether the controller went back to it (`judge`).
        self.fallback = dict(state["fallback"], split=np.rint(
            arrays["search_fallback"]).astype(np.int64)) if state.get("fallback") and \
            "search_fallback" in arrays else None
        self.vetoed = bool(state.get("vetoed", False))
        race = state.get("race")
        self.race = {k: (list(v) if isinstance(v, list) else v) for k, v in race.items()} \
            if race else None
        if self.race is not None and all(k in arrays for k in _RACE_ARRAYS):
            self.alpha = np.asarray(arrays["search_alpha"], np.float64)
            self.beta = np.asarray(arrays["search_beta"], np.float64)
            self.splits = np.rint(arrays["search_splits"]).astype(np.int64)
            self.levels = [np.array(arrays[k], np.float64) for k in _LEVELS]
        elif self.race is not None:  # a race without its arrays: start afresh
            self.phase, self.race = IDLE, None
        self.cfg, self.total, self.solve, self.fill = config, int(total), solve, fill
        self.lo, self.hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        self.changed = False
        self._fills: Dict[int, np.ndarray] = {}

    @property
    def racing(self) -> bool:
        return self.phase == RACING

    def to_state(self) -> Tuple[Dict[str, Any], Dict[str, np.ndarray]]:
        """(the new `ControllerState.search`, its per-replica arrays for `stats`)."""
        fallback = self.fallback
        state = plain({"phase": self.phase, "tilt": self.tilt, "held_sign": self.held_sign,
                       "noise_ss": self.noise_ss, "noise_dof": self.noise_dof,
                       "base": self.base, "race": self.race, "held": self.held,
                       "fallback": None if fallback is None else
                       _counts(fallback), "vetoed": self.vetoed})
        arrays = {} if fallback is None else {
            "search_fallback": fallback["split"].astype(np.float64)}
        if not self.racing:
            return state, arrays
        return state, {"search_alpha": self.alpha, "search_beta": self.beta,
                       "search_splits": self.splits.astype(np.float64),
                       **dict(zip(_LEVELS, self.levels)), **arrays}

    # ----- splits -----------------------------------------------------------------------
    def _theta(self, num: int) -> float:
        """Samples' worth of unseen work per tilt step."""
        return self.cfg.search_step * self.total / num

    def tilted(self, alpha, beta) -> np.ndarray:
        """The models' equal-finish split at the tilt the last race kept."""
        alpha, beta = np.asarray(alpha, np.float64), np.asarray(beta, np.float64)
        shifted = alpha + self.tilt * self._theta(alpha.size) * beta
        self._rule = (alpha, beta, self.fill(shifted, beta))  # reused by `start`
        return self.solve(shifted, beta)

    def _fill(self, d: int) -> np.ndarray:
        """The race models' unrounded equal-finish split at tilt d (each computed once)."""
        if d not in self._fills:
            theta = self._theta(self.alpha.size)
            self._fills[d] = self.fill(self.alpha + d * theta * self.beta, self.beta)
        return self._fills[d]

    def _arm_split(self, d: int) -> np.ndarray:
        """The incumbent moved as the models' unrounded split moves from the incumbent's
        tilt to d steps of unseen work: on equal replicas that is no move at all."""
        shift = self._fill(d) - self._fill(self.race["incumbent"])
        x = self.incumbent_split().astype(np.float64) + shift
        return _split.round_preserving_sum(x, self.total, self.lo, self.hi)

    def incumbent_split(self) -> np.ndarray:
        """The split a race started from (and goes back to unless beaten)."""
        return self.splits[:, self.race["arms"].index(self.race["incumbent"])]

    def _in_bounds(self, split) -> bool:
        return bool(np.all(split >= self.lo) and np.all(split <= self.hi))

    def _worth(self, split, fastest: float) -> bool:
        """A new arm is worth a visit if it is a new split within the bounds whose compute
        alone (the models' slowest replica: a lower bound of its step time) does not already
        take as long as `fastest`, the best step time measured so far."""
        if self._known(split) or not self._in_bounds(split):
            return False
        return float(np.max(self.alpha + self.beta * split)) < fastest

    def _known(self, split) -> bool:
        return bool(np.any(np.all(self.splits == split[:, None], axis=0)))

    # ----- measurements -----------------------------------------------------------------
    def arm_level(self):
        """Each replica's (count, time, time squared) of its windows at the arm in force, or
        None outside a race."""
        if not self.racing or self.race["at"] < 0:
            return None
        return tuple(level[:, self.race["at"]] for level in self.levels)

    def arm_levels(self):
        """(count, time, time squared) of every replica's windows at every arm (arrays K x
        arms), or None outside a race."""
        return tuple(self.levels) if self.racing else None

    def add_times(self, times, accepted) -> None:
        """A window's per-replica times at the arm in force (those `accepted` by the
        detector) into that arm's levels."""
        if self.arm_level() is None:
            return
        j, accepted = self.race["at"], np.asarray(accepted, bool)
        for level, value in zip(self.levels, (1.0, times, np.square(times))):
            level[:, j] += np.where(accepted, value, 0.0)

    def observe(self, step_time: float) -> None:
        """One window's mean step time, measured at the split in force."""
        y = math.log(step_time)
        if self.phase == IDLE:  # windows at the split in force, for the next race's incumbent
            self.base = self.base or _cell()
            _add(self.base, y)
            return
        race = self.race
        if self.phase == RACING:
            j = race["at"]
            if j < 0:
                return
            cell = self._arm_cell(j)
            noise, dof = self._pooled()
        else:
            cell = self.held
            noise, dof = self.held["noise"], self.held["dof"]
        q = alarm_quantile(self.cfg.false_move_rate, 1, dof)
        if cell["n"] >= 1 and math.isfinite(q):
            mean = cell["s1"] / cell["n"]
            sd = math.sqrt(noise * (1.0 + 1.0 / cell["n"]))
            z, outlier, change = detect(y, mean, mean, sd, q, self.held_sign)
            if bool(change):
                self.changed = True
                return
            if bool(outlier):
                self.held_sign = float(np.sign(z))
                return
        self.held_sign = 0.0
        if self.phase == RACING:
            for key, value in (("n", 1), ("s1", y), ("s2", y * y)):
                race[key][j] += value
        else:
            _add(self.held, y)

    # ----- transitions ------------------------------------------------------------------
    def restart(self, changed: bool = True, leaving: Optional[np.ndarray] = None,
                step_time_changed: bool = True) -> None:
        """The rule moved away from `leaving` (`changed` False) or conditions changed: forget
        the step times measured, and after a change the fallback; keep the tilt, and the step
        time's noise unless the step time itself changed (a change only the time models see,
        `step_time_changed` False, says nothing of its spread). A rule's move keeps the
        fastest split measured so far as the fallback."""
        if changed:
            self.fallback = None
        else:
            left = self._measured(leaving)
            if left is not None and (self.fallback is None or _mean(left) < _mean(self.fallback)):
                self.fallback = left
        if changed and step_time_changed:
            self.noise_ss = self.noise_dof = 0.0
        elif self.racing:  # the race's noise joins the pool, as a finished race's does
            noise, dof = self._pooled()
            self.noise_ss, self.noise_dof = noise * dof, dof
        self.phase, self.base, self.race, self.held, self.held_sign = IDLE, None, None, None, 0.0
        self.vetoed = False

    def _measured(self, current: Optional[np.ndarray]) -> Optional[Dict[str, Any]]:
        """The split the step time has measured now (`current` outside a race; in a race its
        best arm) with its windows, or None."""
        if self.racing:
            b = self._best()
            if b is None:
                return None
            return {"split": self.splits[:, b].copy(), **self._arm_cell(b)}
        cell = self.held if self.phase == HOLDING else self.base
        if current is None or not cell or cell["n"] < 1:
            return None
        return {"split": np.asarray(current, np.int64).copy(), **_counts(cell)}

    def held_ms(self) -> str:
        """The held split's step time, for reasons."""
        return _ms(self.held) if self.held else "unmeasured"

    def judge(self, current: np.ndarray) -> Optional[np.ndarray]:
        """After a window at the split in force `current`: the fallback's split if the
        step time shows what was measured since the rule's move surely slower than it (the
        controller then holds it, the rule's moves off until a change), else None."""
        fallback = self.fallback
        mine = None if fallback is None else self._measured(current)
        if mine is None or np.array_equal(mine["split"], fallback["split"]):
            return None
        if (sum(self.race["n"]) if self.racing else mine["n"]) < _JUDGED_AFTER:
            return None
        # The noise: the race's pooled, the held split's, or the pool and these windows';
        # and the fallback's own windows around their mean.
        if self.racing:
            noise, dof = self._pooled()
            ss = noise * dof
        elif self.phase == HOLDING:
            ss, dof = self.held["noise"] * self.held["dof"], self.held["dof"]
        else:
            ss, dof = self.noise_ss + _ss(mine), self.noise_dof + mine["n"] - 1
        ss, dof = ss + _ss(fallback), dof + fallback["n"] - 1
        noise = max(ss, 0.0) / dof if dof > 0 else 0.0
        q = t_quantile(1.0 - self.cfg.false_move_rate, dof)
        slower = _mean(mine) - _mean(fallback)
        bound = q * math.sqrt(noise * (1.0 / mine["n"] + 1.0 / fallback["n"]))
        if not (math.isfinite(bound) and slower > bound + math.log1p(self.cfg.dead_band)):
            return None
        self.noise_ss, self.noise_dof = noise * dof, dof
        self.phase, self.race, self.base, self.held_sign = HOLDING, None, None, 0.0
        self.held = {**_counts(fallback), "noise": noise, "dof": dof}
        self.fallback, self.vetoed = None, True
        return fallback["split"]

    def switched(self, target) -> None:
        """The controller moved to `target`."""
        if self.phase == RACING:
            match = np.flatnonzero(np.all(self.splits == np.asarray(target)[:, None], axis=0))
            self.race["at"] = int(match[0]) if match.size else -1
            self.race["spent"] += _SWITCH_WINDOWS
        self.base = None

    def start(self, current, alpha, beta, level=None):
        """The rule holds `current` on its models `alpha`, `beta`: starts a race around it
        if there is one to run (`level`: each replica's (count, time, time squared) of its
        windows at `current`, the incumbent's levels). Returns (split, reason)."""
        if self.phase != IDLE:
            return current, ""
        current = np.asarray(current, np.int64)
        self.alpha = np.asarray(alpha, np.float64).copy()
        self.beta = np.asarray(beta, np.float64).copy()
        self.splits, self._fills = current[:, None].copy(), {}
        rule = getattr(self, "_rule", None)
        if rule is not None and rule[0] is alpha and rule[1] is beta:
            self._fills[self.tilt] = rule[2]
        self.race = {"incumbent": self.tilt, "arms": [self.tilt]}
        base = self.base or _cell()
        fastest = math.exp(base["s1"] / base["n"]) if base["n"] else math.inf
        implied = self._implied_tilt(current, fastest)
        for d in (self.tilt + 1, implied, self.tilt - 1):  # down only if nothing up
            if d is None or (d < self.tilt and len(self.race["arms"]) > 1):
                continue
            split = self._arm_split(d)
            if self._worth(split, fastest):
                self.splits = np.concatenate([self.splits, split[:, None]], axis=1)
                self.race["arms"].append(d)
        if len(self.race["arms"]) == 1:
            # No neighbouring split (e.g. the even split of equal replicas): nothing to race.
            self.phase = HOLDING
            pooled = self.noise_ss / self.noise_dof if self.noise_dof > 0 else 0.0
            self.held = {**base, "noise": pooled, "dof": self.noise_dof}
            return current, ""
        order = np.argsort(self.race["arms"], kind="stable")
        arms = [self.race["arms"][i] for i in order]
        self.splits = self.splits[:, order]
        self.levels = [np.zeros(self.splits.shape) for _ in _LEVELS]
        inc = arms.index(self.tilt)
        if level is not None:
            for mine, theirs in zip(self.levels, level):
                mine[:, inc] = theirs
        self.race = {"incumbent": self.tilt, "arms": arms,
                     "n": [base["n"] if i == inc else 0 for i in range(len(arms))],
                     "s1": [base["s1"] if i == inc else 0.0 for i in range(len(arms))],
                     "s2": [base["s2"] if i == inc else 0.0 for i in range(len(arms))],
                     "alive": [True] * len(arms), "at": inc, "spent": 0, "settled": inc}
        self.phase, self.base = RACING, None
        nxt = self._next()
        return self.splits[:, nxt].copy(), (
            f"step-time search: racing {len(arms)} candidates around {current.tolist()}")

    def _implied_tilt(self, current, step_time: float) -> Optional[int]:
        """The tilt the held split's step time implies, if beyond the next one up (else None):
        the largest d at which no replica's model with d steps of unseen work,
        alpha_k + beta_k b_k + d theta beta_k, exceeds the step time. (All of the step beyond
        the compute counts as unseen work stretched like the compute, so this is the most
        the step time allows; a throttled worker's fixed cost is often many tilt steps.)"""
        if not math.isfinite(step_time):
            return None
        room = step_time - (self.alpha + self.beta * np.asarray(current, np.float64))
        d = math.floor(float(np.min(room / (self._theta(self.alpha.size) * self.beta))))
        return d if d > self.tilt + 1 else None

    def step(self):
        """One racing window done (at the split in force): (next split, reason)."""
        race = self.race
        race["spent"] += 1
        for j in range(len(race["arms"])):
            if race["alive"][j] and not self._in_bounds(self.splits[:, j]):
                race["alive"][j] = False
        self._eliminate()
        self._extend()
        alive = [j for j, a in enumerate(race["alive"]) if a]
        if len(alive) <= 1 or race["spent"] >= self.cfg.horizon:
            win = self._choice()
            noise, dof = self._pooled()
            self.noise_ss, self.noise_dof = noise * dof, dof
            self.tilt = race["arms"][win]
            split = self.splits[:, win].copy()
            self.held = {**self._arm_cell(win), "noise": noise, "dof": dof}
            self.phase, self.race = HOLDING, None
            return split, (f"step-time search done: kept {split.tolist()} (tilt "
                           f"{self.tilt:+d}, {_ms(self.held)})")
        race["settled"] = self._choice()
        nxt = self._next()
        return self.splits[:, nxt].copy(), (
            f"step-time search: {len(alive)} candidates left, measuring "
            f"{self.splits[:, nxt].tolist()}")

    # ----- the race ---------------------------------------------------------------------
    def _pooled(self) -> Tuple[float, float]:
        """Variance of a window's log step time (pooled: the arms' windows around their means
        and the earlier races' since the step time's last change), and its degrees of freedom."""
        race = self.race
        ss = sum(_ss(self._arm_cell(j)) for j, n in enumerate(race["n"]) if n > 0)
        dof = sum(max(n - 1, 0) for n in race["n"]) + self.noise_dof
        if dof <= 0:
            return 0.0, 0.0
        return (max(ss, 0.0) + self.noise_ss) / dof, float(dof)

    def _arm_cell(self, j: int) -> Dict[str, Any]:
        """Arm j's windows: count, sum and sum of squares of their log step times."""
        return {k: self.race[k][j] for k in ("n", "s1", "s2")}

    def _bound(self, j: int, b: int, q: float, noise: float) -> float:
        race = self.race
        if noise <= 0:
            return 0.0 if math.isfinite(q) else math.inf
        return q * math.sqrt(noise * (1.0 / race["n"][j] + 1.0 / race["n"][b]))

    def _best(self) -> Optional[int]:
        race = self.race
        measured = [j for j, a in enumerate(race["alive"]) if a and race["n"][j] > 0]
        if not measured:
            return None
        return min(measured, key=lambda j: (race["s1"][j] / race["n"][j], j))

    def _quantile(self, dof: float) -> float:
        arms = max(sum(self.race["alive"]) - 1, 1)
        return t_quantile(1.0 - self.cfg.false_move_rate / arms, dof)

    def _eliminate(self) -> None:
        race = self.race
        b = self._best()
        if b is None:
            return
        noise, dof = self._pooled()
        q = self._quantile(dof)
        rest = max(self.cfg.horizon - race["spent"], 0)
        mean_b = race["s1"][b] / race["n"][b]
        switch_cost = math.log1p(self.cfg.dead_band)  # in the log step times' units
        for j, alive in enumerate(race["alive"]):
            if not alive or j == b:
                continue
            if rest == 0:
                race["alive"][j] = False
            elif race["n"][j] > 0:
                # Another visit costs `slower` for VISIT_WINDOWS; j might still save up to
                # `bound - slower`, less what its switch costs, over the rest of the horizon.
                slower = race["s1"][j] / race["n"][j] - mean_b
                bound = self._bound(j, b, q, noise)
                worth = (bound - slower - switch_cost) * rest
                if math.isfinite(bound) and worth <= slower * VISIT_WINDOWS:
                    race["alive"][j] = False

    def _extend(self) -> None:
        """A best arm at the edge of the race, its inner neighbour out: add the next one."""
        race = self.race
        b = self._best()
        if b is None:
            return
        d = race["arms"][b]
        alive_d = [race["arms"][j] for j, a in enumerate(race["alive"]) if a]
        for step in (1, -1):
            if d != (max(alive_d) if step > 0 else min(alive_d)):
                continue
            inner, outer = d - step, d + step
            if outer in race["arms"] or inner not in race["arms"] or \
                    race["alive"][race["arms"].index(inner)]:
                continue
            split = self._arm_split(outer)
            if not self._worth(split, math.exp(race["s1"][b] / race["n"][b])):
                continue
            self.splits = np.concatenate([self.splits, split[:, None]], axis=1)
            self.levels = [np.concatenate([level, np.zeros((level.shape[0], 1))], axis=1)
                           for level in self.levels]
            for key, value in (("arms", outer), ("n", 0), ("s1", 0.0), ("s2", 0.0),
                               ("alive", True)):
                race[key].append(value)

    def _choice(self) -> int:
        """The arm to keep now: the incumbent unless the best arm is surely faster."""
        race = self.race
        inc = race["arms"].index(race["incumbent"])
        b = self._best()
        if b is None or b == inc or race["n"][inc] == 0:
            return inc
        noise, dof = self._pooled()
        slower = race["s1"][inc] / race["n"][inc] - race["s1"][b] / race["n"][b]
        return b if slower > self._bound(inc, b, self._quantile(dof), noise) else inc

    def _next(self) -> int:
        """Round robin over the arms in the race, in the order of their tilt."""
        race = self.race
        order = sorted((d, j) for j, d in enumerate(race["arms"]) if race["alive"][j])
        at = race["arms"][race["at"]] if race["at"] >= 0 else min(race["arms"]) - 1
        later = [j for d, j in order if d > at]
        return later[0] if later else order[0][1]


def _counts(cell) -> Dict[str, Any]:
    """A copy of a cell's count, sum and sum of squares (of log step times)."""
    return {k: cell[k] for k in ("n", "s1", "s2")}


def _mean(cell) -> float:
    return cell["s1"] / cell["n"]


def _ss(cell) -> float:
    """Squared deviations of a cell's windows from their mean."""
    return cell["s2"] - cell["s1"] * cell["s1"] / cell["n"]


def _ms(cell) -> str:
    n = cell["n"]
    return f"{1e3 * math.exp(cell['s1'] / n):.3g} ms over {n} window(s)" if n else "unmeasured"
