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
  way. An arm is raced only if the gain its own hypothesis predicts over the incumbent (the
  models at each size plus d * theta) is one a race of the whole horizon could confirm on
  the step time's noise so far (the earlier races' windows and the held split's; unknown
  noise decides nothing): replicas within noise of each other predict gains no race could
  tell from noise, so they are not raced and make no moves. The rule still judges during a
  race, from the incumbent, and ends it when its own split is surely faster.
- Visits go round robin in the order of d, so a drifting machine hits every arm alike. Each
  visit costs two windows: the one straddling the switch and the one measured.
- After each window, arm j leaves the race unless what it might still save over the rest of
  the horizon pays for another visit: (r_jb - d_j - c) * H_rest > d_j * VISIT_WINDOWS, with
  d_j how much slower it is than the best arm b (difference of mean log step times), r_jb
  the confidence bound of that difference (pooled Student-t noise, Bonferroni over the arms)
  and c what a switch costs (`dead_band`). Clearly slower arms go at once; as the horizon is
  spent, so does any doubt. An arm no faster than the incumbent so far, whose hypothesis
  predicts a gain the rest of the race could not confirm, has nothing left to find: it goes.
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

State: `search_state.SearchState` (`ControllerState.search`), typed records.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import numpy as np

from tf_hetbatch.core import split as _split
from tf_hetbatch.core._stats import WindowSums, alarm_quantile, detect, t_quantile
from tf_hetbatch.core.move import SWITCH_WINDOWS, rounded_equal_finish
from tf_hetbatch.core.search_state import Held, MeasuredSplit, Phase, Race, SearchState

__all__ = ["Search"]

# Windows one visit of a candidate costs: the one straddling the switch, the one measured.
VISIT_WINDOWS = SWITCH_WINDOWS + 1
# Windows after a rule's move before the step time may judge it: two in a row, as the
# change detector (one window may be an outlier).
_JUDGED_AFTER = 2
_NONE = WindowSums(0, 0.0, 0.0)


class Search:
    """One update's view of the search (mutable here; `to_state` gives the new state).

    Args:
        state: the `SearchState` before the update (not changed: a race is copied).
        config: the controller's `ControllerConfig`.
        total, lo, hi: the global batch and the bounds.
    """

    def __init__(self, state: SearchState, config, total: int, lo, hi):
        self.phase, self.tilt, self.held_sign = state.phase, state.tilt, state.held_sign
        self.noise_ss, self.noise_dof = state.noise_ss, state.noise_dof
        self.base, self.held, self.vetoed = state.base, state.held, state.vetoed
        # The fastest split measured since the last change that a rule's move left (its
        # windows), and whether the controller went back to it (`judge`).
        self.fallback = state.fallback
        self.race: Optional[Race] = None if state.race is None else state.race.copy()
        self.cfg, self.total = config, int(total)
        self.lo, self.hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
        self.changed = False  # the step time's detector saw a change (`observe`)
        self._fills: Dict[int, np.ndarray] = {}

    @property
    def racing(self) -> bool:
        return self.phase is Phase.RACING

    def to_state(self) -> SearchState:
        """The new `ControllerState.search`."""
        return SearchState(self.phase, self.tilt, self.held_sign, self.noise_ss, self.noise_dof,
                           self.base, self.race if self.racing else None, self.held,
                           self.fallback, self.vetoed)

    # ----- splits -----------------------------------------------------------------------
    def _theta(self, num: int) -> float:
        """Samples' worth of unseen work per tilt step."""
        return self.cfg.search_step * self.total / num

    def tilted(self, alpha, beta) -> Tuple[np.ndarray, np.ndarray]:
        """The models' equal-finish split at the tilt the last race kept, and that split
        before rounding (`start` takes it)."""
        alpha, beta = np.asarray(alpha, np.float64), np.asarray(beta, np.float64)
        shifted = alpha + self.tilt * self._theta(alpha.size) * beta
        fill = _split.equal_finish_fill(float(self.total), shifted, beta, self.lo, self.hi)
        return rounded_equal_finish(fill, self.total, shifted, beta, self.lo, self.hi), fill

    def _fill(self, d: int) -> np.ndarray:
        """The race models' unrounded equal-finish split at tilt d (each computed once)."""
        if d not in self._fills:
            race = self.race
            theta = self._theta(race.alpha.size)
            self._fills[d] = _split.equal_finish_fill(
                float(self.total), race.alpha + d * theta * race.beta, race.beta, self.lo,
                self.hi)
        return self._fills[d]

    def _arm_split(self, d: int) -> np.ndarray:
        """The incumbent moved as the models' unrounded split moves from the incumbent's
        tilt to d steps of unseen work: on equal replicas that is no move at all."""
        shift = self._fill(d) - self._fill(self.race.incumbent)
        x = self.incumbent_split().astype(np.float64) + shift
        return _split.round_preserving_sum(x, self.total, self.lo, self.hi)

    def incumbent_split(self) -> np.ndarray:
        """The split a race started from (and goes back to unless beaten)."""
        return self.race.splits[:, self.race.arms.index(self.race.incumbent)]

    def _in_bounds(self, split) -> bool:
        return bool((split >= self.lo).all() and (split <= self.hi).all())

    def _worth(self, split, fastest: float) -> bool:
        """A new arm is worth a visit if it is a new split within the bounds whose compute
        alone (the models' slowest replica: a lower bound of its step time) does not already
        take as long as `fastest`, the best step time measured so far."""
        if self._known(split) or not self._in_bounds(split):
            return False
        return float(np.max(self.race.alpha + self.race.beta * split)) < fastest

    def _resolvable(self, d: int, current, split, base: WindowSums) -> bool:
        """At a race's start: whether arm d could be confirmed faster than `current` if its
        own hypothesis holds (`_confirmable`), on the step time's noise so far (the earlier
        races' and the windows at `current`, `base`; unknown noise decides nothing)."""
        ss = self.noise_ss + (base.squared_deviations if base.count > 1 else 0.0)
        dof = self.noise_dof + max(base.count - 1, 0)
        if dof <= 0 or base.count < 1:
            return True
        gain = _gain_under(self.race.alpha, self.race.beta, d * self._theta(current.size),
                           current, split)
        visits = max(self.cfg.horizon // (2 * VISIT_WINDOWS), 1)  # two arms share the horizon
        # The noise as known now: a noise estimate from few windows is itself uncertain.
        q = t_quantile(1.0 - self.cfg.false_move_rate, dof)
        return _confirmable(gain, math.exp(base.mean), max(ss, 0.0) / dof, q, visits,
                            visits + base.count)

    def _known(self, split) -> bool:
        return bool((self.race.splits == split[:, None]).all(axis=0).any())

    # ----- measurements -----------------------------------------------------------------
    def current_arm_levels(self) -> Optional[WindowSums]:
        """Each replica's windows (compute times) at the arm in force, or None outside a
        race."""
        if not self.racing or self.race.at < 0:
            return None
        return WindowSums(*(level[:, self.race.at] for level in self.race.levels))

    def all_arm_levels(self) -> Optional[WindowSums]:
        """Each replica's windows at every arm (arrays K x arms), or None outside a race."""
        return self.race.levels if self.racing else None

    def add_times(self, times, accepted) -> None:
        """A window's per-replica times at the arm in force (those `accepted` by the
        detector) into that arm's levels."""
        if self.current_arm_levels() is None:
            return
        j, accepted = self.race.at, np.asarray(accepted, bool)
        for level, value in zip(self.race.levels, (1.0, times, np.square(times))):
            level[:, j] += np.where(accepted, value, 0.0)

    def observe(self, step_time: float) -> None:
        """One window's mean step time, measured at the split in force."""
        y = math.log(step_time)
        if self.phase is Phase.IDLE:  # windows at the split in force, the next incumbent's
            self.base = (_NONE if self.base is None else self.base).add(y)
            return
        if self.racing:
            j = self.race.at
            if j < 0:
                return
            windows = self.race.windows[j]
            noise, dof = self._pooled()
        else:
            windows, noise, dof = self.held
        q = alarm_quantile(self.cfg.false_move_rate, 1, dof)
        if windows.count >= 1 and math.isfinite(q):
            mean = windows.mean
            sd = math.sqrt(noise * (1.0 + 1.0 / windows.count))
            z, outlier, change = detect(y, mean, mean, sd, q, self.held_sign)
            if bool(change):
                self.changed = True
                return
            if bool(outlier):
                self.held_sign = float(np.sign(z))
                return
        self.held_sign = 0.0
        if self.racing:
            self.race.windows[j] = windows.add(y)
        else:
            self.held = self.held._replace(windows=windows.add(y))

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
            if left is not None and (self.fallback is None
                                     or left.windows.mean < self.fallback.windows.mean):
                self.fallback = left
        if changed and step_time_changed:
            self.noise_ss = self.noise_dof = 0.0
        elif self.racing:  # the race's noise joins the pool, as a finished race's does
            noise, dof = self._pooled()
            self.noise_ss, self.noise_dof = noise * dof, dof
        self.phase, self.base, self.race, self.held, self.held_sign = \
            Phase.IDLE, None, None, None, 0.0
        self.vetoed = False

    def _measured(self, current: Optional[np.ndarray]) -> Optional[MeasuredSplit]:
        """The split the step time has measured now (`current` outside a race; in a race its
        best arm) with its windows, or None."""
        if self.racing:
            b = self._best()
            if b is None:
                return None
            return MeasuredSplit(self.race.splits[:, b].copy(), self.race.windows[b])
        windows = self.held.windows if self.phase is Phase.HOLDING else self.base
        if current is None or windows is None or windows.count < 1:
            return None
        return MeasuredSplit(np.asarray(current, np.int64).copy(), windows)

    def held_ms(self) -> str:
        """The held split's step time, for reasons."""
        return _ms(self.held.windows) if self.held is not None else "unmeasured"

    def judge(self, current: np.ndarray) -> Optional[np.ndarray]:
        """After a window at the split in force `current`: the fallback's split if the
        step time shows what was measured since the rule's move surely slower than it (the
        controller then holds it, the rule's moves off until a change), else None."""
        fallback = self.fallback
        mine = None if fallback is None else self._measured(current)
        if mine is None or np.array_equal(mine.split, fallback.split):
            return None
        if (sum(w.count for w in self.race.windows) if self.racing
                else mine.windows.count) < _JUDGED_AFTER:
            return None
        # The noise: the race's pooled, the held split's, or the pool and these windows';
        # and the fallback's own windows around their mean.
        if self.racing:
            noise, dof = self._pooled()
            ss = noise * dof
        elif self.phase is Phase.HOLDING:
            ss, dof = self.held.noise * self.held.dof, self.held.dof
        else:
            ss = self.noise_ss + mine.windows.squared_deviations
            dof = self.noise_dof + mine.windows.count - 1
        ss = ss + fallback.windows.squared_deviations
        dof = dof + fallback.windows.count - 1
        noise = max(ss, 0.0) / dof if dof > 0 else 0.0
        q = t_quantile(1.0 - self.cfg.false_move_rate, dof)
        slower = mine.windows.mean - fallback.windows.mean
        bound = _difference_bound(q, noise, mine.windows.count, fallback.windows.count)
        if not (math.isfinite(bound) and slower > bound + math.log1p(self.cfg.dead_band)):
            return None
        self.noise_ss, self.noise_dof = noise * dof, dof
        self.phase, self.race, self.base, self.held_sign = Phase.HOLDING, None, None, 0.0
        self.held = Held(fallback.windows, noise, dof)
        self.fallback, self.vetoed = None, True
        return fallback.split

    def switched(self, target) -> None:
        """The controller moved to `target`."""
        if self.racing:
            race = self.race
            match = np.flatnonzero(np.all(race.splits == np.asarray(target)[:, None], axis=0))
            race.at = int(match[0]) if match.size else -1
            race.spent += SWITCH_WINDOWS
        self.base = None

    def start(self, current, alpha, beta, fill, level: Optional[WindowSums] = None):
        """The rule holds `current` on its models `alpha`, `beta` (`fill`: their unrounded
        split at the kept tilt, from `tilted`): starts a race around it if there is one to
        run (`level`: each replica's windows at `current`, the incumbent's levels). Returns
        (split, reason)."""
        if self.phase is not Phase.IDLE:
            return current, ""
        current = np.asarray(current, np.int64)
        base = _NONE if self.base is None else self.base
        race = self.race = Race(self.tilt, [self.tilt], [], [], 0, 0, 0,
                                np.asarray(alpha, np.float64).copy(),
                                np.asarray(beta, np.float64).copy(), current[:, None].copy(),
                                _NONE)
        self._fills = {self.tilt: fill}
        fastest = math.exp(base.sum / base.count) if base.count else math.inf
        implied = self._implied_tilt(current, fastest)
        for d in (self.tilt + 1, implied, self.tilt - 1):  # down only if nothing up
            if d is None or (d < self.tilt and len(race.arms) > 1):
                continue
            split = self._arm_split(d)
            if self._worth(split, fastest) and self._resolvable(d, current, split, base):
                race.splits = np.concatenate([race.splits, split[:, None]], axis=1)
                race.arms.append(d)
        if len(race.arms) == 1:
            # No neighbouring split (e.g. the even split of equal replicas): nothing to race.
            # The split's windows so far are kept as held; the next window starts over.
            pooled = self.noise_ss / self.noise_dof if self.noise_dof > 0 else 0.0
            self.held, self.race = Held(base, pooled, self.noise_dof), None
            return current, ""
        order = np.argsort(race.arms, kind="stable")
        arms = [race.arms[i] for i in order]
        splits = race.splits[:, order]
        levels = WindowSums(*(np.zeros(splits.shape) for _ in WindowSums._fields))
        inc = arms.index(self.tilt)
        if level is not None:
            for mine, theirs in zip(levels, level):
                mine[:, inc] = theirs
        self.race = Race(self.tilt, arms, [base if i == inc else _NONE for i in range(len(arms))],
                         [True] * len(arms), inc, 0, inc, race.alpha, race.beta, splits, levels)
        self.phase, self.base = Phase.RACING, None
        nxt = self._next()
        return splits[:, nxt].copy(), (
            f"step-time search: racing {len(arms)} candidates around {current.tolist()}")

    def _implied_tilt(self, current, step_time: float) -> Optional[int]:
        """The tilt the held split's step time implies, if beyond the next one up (else None):
        the largest d at which no replica's model with d steps of unseen work,
        alpha_k + beta_k b_k + d theta beta_k, exceeds the step time. (All of the step beyond
        the compute counts as unseen work stretched like the compute, so this is the most
        the step time allows; a throttled worker's fixed cost is often many tilt steps.)"""
        if not math.isfinite(step_time):
            return None
        race = self.race
        room = step_time - (race.alpha + race.beta * np.asarray(current, np.float64))
        d = math.floor(float(np.min(room / (self._theta(race.alpha.size) * race.beta))))
        return d if d > self.tilt + 1 else None

    def step(self):
        """One racing window done (at the split in force): (next split, reason)."""
        race = self.race
        race.spent += 1
        for j in range(len(race.arms)):
            if race.alive[j] and not self._in_bounds(race.splits[:, j]):
                race.alive[j] = False
        self._eliminate()
        self._extend()
        alive = [j for j, a in enumerate(race.alive) if a]
        if len(alive) <= 1 or race.spent >= self.cfg.horizon:
            win = self._choice()
            noise, dof = self._pooled()
            self.noise_ss, self.noise_dof = noise * dof, dof
            self.tilt = race.arms[win]
            split = race.splits[:, win].copy()
            self.held = Held(race.windows[win], noise, dof)
            self.phase, self.race = Phase.HOLDING, None
            return split, (f"step-time search done: kept {split.tolist()} (tilt "
                           f"{self.tilt:+d}, {_ms(self.held.windows)})")
        race.settled = self._choice()
        nxt = self._next()
        return race.splits[:, nxt].copy(), (
            f"step-time search: {len(alive)} candidates left, measuring "
            f"{race.splits[:, nxt].tolist()}")

    # ----- the race ---------------------------------------------------------------------
    def _pooled(self) -> Tuple[float, float]:
        """Variance of a window's log step time (pooled: the arms' windows around their means
        and the earlier races' since the step time's last change), and its degrees of freedom."""
        windows = self.race.windows
        ss = sum(w.squared_deviations for w in windows if w.count > 0)
        dof = sum(max(w.count - 1, 0) for w in windows) + self.noise_dof
        if dof <= 0:
            return 0.0, 0.0
        return (max(ss, 0.0) + self.noise_ss) / dof, float(dof)

    def _bound(self, j: int, b: int, q: float, noise: float) -> float:
        windows = self.race.windows
        if noise <= 0:
            return 0.0 if math.isfinite(q) else math.inf
        return _difference_bound(q, noise, windows[j].count, windows[b].count)

    def _best(self) -> Optional[int]:
        race = self.race
        measured = [j for j, a in enumerate(race.alive) if a and race.windows[j].count > 0]
        if not measured:
            return None
        return min(measured, key=lambda j: (race.windows[j].mean, j))

    def _quantile(self, dof: float) -> float:
        arms = max(sum(self.race.alive) - 1, 1)
        return t_quantile(1.0 - self.cfg.false_move_rate / arms, dof)

    def _eliminate(self) -> None:
        race = self.race
        b = self._best()
        if b is None:
            return
        noise, dof = self._pooled()
        q = self._quantile(dof)
        rest = max(self.cfg.horizon - race.spent, 0)
        mean_b = race.windows[b].mean
        switch_cost = math.log1p(self.cfg.dead_band)  # in the log step times' units
        for j, alive in enumerate(race.alive):
            if not alive or j == b:
                continue
            if rest == 0:
                race.alive[j] = False
            elif race.windows[j].count > 0:
                # Another visit costs `slower` for VISIT_WINDOWS; j might still save up to
                # `bound - slower`, less what its switch costs, over the rest of the horizon.
                slower = race.windows[j].mean - mean_b
                bound = self._bound(j, b, q, noise)
                worth = (bound - slower - switch_cost) * rest
                if math.isfinite(bound) and worth <= slower * VISIT_WINDOWS:
                    race.alive[j] = False
        # An arm no faster than the incumbent so far, whose own hypothesis predicts a gain
        # the rest of the race could not confirm, has nothing left to find.
        inc = race.arms.index(race.incumbent)
        visits = rest // (VISIT_WINDOWS * sum(race.alive))  # each arm's share of the rest
        for j, alive_j in enumerate(race.alive):
            windows, mine = race.windows[j], race.windows[inc]
            if not alive_j or j == inc or windows.count == 0 or mine.count == 0 or \
                    windows.mean < mine.mean:
                continue
            gain = _gain_under(race.alpha, race.beta,
                               race.arms[j] * self._theta(race.alpha.size),
                               race.splits[:, inc], race.splits[:, j])
            if not _confirmable(gain, math.exp(mine.mean), noise, q,
                                windows.count + visits, mine.count + visits):
                race.alive[j] = False

    def _extend(self) -> None:
        """A best arm at the edge of the race, its inner neighbour out: add the next one."""
        race = self.race
        b = self._best()
        if b is None:
            return
        d = race.arms[b]
        alive_d = [race.arms[j] for j, a in enumerate(race.alive) if a]
        for step in (1, -1):
            if d != (max(alive_d) if step > 0 else min(alive_d)):
                continue
            inner, outer = d - step, d + step
            if outer in race.arms or inner not in race.arms or \
                    race.alive[race.arms.index(inner)]:
                continue
            split = self._arm_split(outer)
            if not self._worth(split, math.exp(race.windows[b].mean)):
                continue
            race.splits = np.concatenate([race.splits, split[:, None]], axis=1)
            race.levels = WindowSums(*(np.concatenate(
                [level, np.zeros((level.shape[0], 1))], axis=1) for level in race.levels))
            race.arms.append(outer)
            race.windows.append(_NONE)
            race.alive.append(True)

    def _choice(self) -> int:
        """The arm to keep now: the incumbent unless the best arm is surely faster."""
        race = self.race
        inc = race.arms.index(race.incumbent)
        b = self._best()
        if b is None or b == inc or race.windows[inc].count == 0:
            return inc
        noise, dof = self._pooled()
        slower = race.windows[inc].mean - race.windows[b].mean
        return b if slower > self._bound(inc, b, self._quantile(dof), noise) else inc

    def _next(self) -> int:
        """Round robin over the arms in the race, in the order of their tilt."""
        race = self.race
        order = sorted((d, j) for j, d in enumerate(race.arms) if race.alive[j])
        at = race.arms[race.at] if race.at >= 0 else min(race.arms) - 1
        later = [j for d, j in order if d > at]
        return later[0] if later else order[0][1]


def _difference_bound(q: float, noise: float, n_1: float, n_2: float) -> float:
    """The confidence bound (quantile `q`) of the difference of two means of `n_1` and `n_2`
    windows of variance `noise`."""
    return q * math.sqrt(noise * (1.0 / n_1 + 1.0 / n_2))


def _gain_under(alpha, beta, shift: float, incumbent, arm) -> float:
    """Seconds per step `arm` saves over `incumbent` if its hypothesis holds: `shift` samples'
    worth of unseen work on every replica (the models at each size plus `shift`)."""
    slowest = [float(np.max(alpha + beta * (np.asarray(split, np.float64) + shift)))
               for split in (incumbent, arm)]
    return slowest[0] - slowest[1]


def _confirmable(gain: float, step_time: float, noise: float, q: float, n_arm: float,
                 n_ref: float) -> bool:
    """Whether a step-time gain of `gain` seconds on `step_time` exceeds the smallest
    difference of mean log step times a race could confirm with `n_arm` and `n_ref` windows
    (window noise `noise`, quantile `q`)."""
    if not gain > 0 or not step_time > gain:
        return False
    smallest = _difference_bound(q, noise, max(n_arm, 1), max(n_ref, 1))
    return math.log(step_time / (step_time - gain)) > smallest


def _ms(windows: WindowSums) -> str:
    n = windows.count
    return f"{1e3 * math.exp(windows.sum / n):.3g} ms over {n} window(s)" if n else "unmeasured"
