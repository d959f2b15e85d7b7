"""The step-time search's state (`ControllerState.search`), as typed records.

The search itself is `tf_hetbatch.core.step_search`. Step times are kept as their logs (a
move changes the step time by a factor). Pure numpy.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import List, NamedTuple, Optional

import numpy as np

from tf_hetbatch.core._stats import WindowSums

__all__ = ["Phase", "Held", "MeasuredSplit", "Race", "SearchState"]


class Phase(enum.Enum):
    """Where the search is."""

    IDLE = "idle"        # no race; the windows at the split in force gather (`base`)
    RACING = "racing"    # a race runs (`race`)
    HOLDING = "holding"  # a race's winner or a verdict's split is held, watched (`held`)


class Held(NamedTuple):
    """The held split's windows (log step times) and the noise they are judged with."""

    windows: WindowSums
    noise: float  # variance of a window's log step time
    dof: float    # its degrees of freedom


class MeasuredSplit(NamedTuple):
    """A split and its windows' log step times (e.g. the fallback of a rule's move)."""

    split: np.ndarray  # int64 [K]
    windows: WindowSums


@dataclasses.dataclass(eq=False)
class Race:
    """A race of candidate splits ("arms") on the step time. Arm j assumes `arms[j]` steps of
    unseen work per replica (its tilt); lists are per arm, arrays per replica (first axis)."""

    incumbent: int             # the tilt of the split the race started from
    arms: List[int]            # each arm's tilt
    windows: List[WindowSums]  # each arm's windows (log step times)
    alive: List[bool]          # still in the race
    at: int                    # the arm in force (-1: none of them)
    spent: int                 # windows the race spent
    settled: int               # the arm the race would keep now
    alpha: np.ndarray          # [K] the time models the race started on
    beta: np.ndarray           # [K]
    splits: np.ndarray         # int64 [K, arms]
    levels: WindowSums         # each replica's windows at each arm (compute times) [K, arms]

    def copy(self) -> "Race":
        """A copy to change (the lists and the levels, which change in place)."""
        return dataclasses.replace(
            self, arms=list(self.arms), windows=list(self.windows), alive=list(self.alive),
            levels=WindowSums(*(np.array(v, np.float64) for v in self.levels)))


@dataclasses.dataclass(frozen=True, eq=False)
class SearchState:
    """The step-time search's state between updates (explicit, not changed once made).

    Attributes:
        phase: where the search is (`Phase`); `race` is set exactly when racing.
        tilt: the tilt the last race kept (the rule's targets keep it).
        held_sign: the step time's detector: side (+1 / -1) of a window held back; 0: none.
        noise_ss, noise_dof: the step time's noise pooled over the races since its last
            change: squared deviations of windows at a repeated split from their mean, and
            their degrees of freedom.
        base: idle: the windows at the split in force (a race's incumbent starts with them).
        race: the race, when racing.
        held: the held split's windows and noise.
        fallback: the fastest split measured since the last change that a rule's move left.
        vetoed: the step time undid a rule's move; the rule holds off until a change.
    """

    phase: Phase = Phase.IDLE
    tilt: int = 0
    held_sign: float = 0.0
    noise_ss: float = 0.0
    noise_dof: float = 0.0
    base: Optional[WindowSums] = None
    race: Optional[Race] = None
    held: Optional[Held] = None
    fallback: Optional[MeasuredSplit] = None
    vetoed: bool = False

    def __post_init__(self):
        if (self.race is not None) != (self.phase is Phase.RACING):
            raise ValueError(f"A search state has a race exactly when racing. Received: "
                             f"phase={self.phase}, race={self.race!r}")

    def settled_split(self) -> Optional[np.ndarray]:
        """The split a race would keep now (None when no race runs)."""
        if self.race is None:
            return None
        return self.race.splits[:, self.race.settled].copy()
