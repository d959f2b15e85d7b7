"""The batch-size controllers' state (`ControllerState`) and its JSON form.

The state is explicit and immutable (Optax style): typed records with numpy arrays where
per replica (`time_models.ReplicaStats`, `search_state.SearchState`). `to_dict` /
`from_dict` are its one JSON edge (`DynamicBatching` keeps it in checkpoints): a versioned
dict of lists, ints, floats, bools and strings; `from_dict` also reads the unversioned dicts
written before the state was typed (their string-keyed arrays and search dict). Pure numpy.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from tf_hetbatch.core._stats import WindowSums
from tf_hetbatch.core._validate import format_value
from tf_hetbatch.core.search_state import Held, MeasuredSplit, Phase, Race, SearchState
from tf_hetbatch.core.time_models import Levels, ReplicaStats, TimeSums

__all__ = ["ControllerState", "STATE_FORMAT"]

STATE_FORMAT = "tf_hetbatch.ControllerState/2"


@dataclasses.dataclass(frozen=True, eq=False)
class ControllerState:
    """Explicit, immutable state of a controller (JSON through `to_dict` / `from_dict`).

    Attributes:
        global_batch: the global batch size B, fixed at `init`.
        sizes: int64 array, the current allocation (sums to B).
        min_sizes, max_sizes: int64 arrays, the current bounds.
        updates: number of `update` calls so far.
        adjustments: number of updates that changed the allocation.
        reason: why the last update changed or kept the allocation (for dashboards).
        replica_stats: the time models' and the detector's state per replica (None: none
            yet; the controller then starts them afresh).
        search: the step-time search's state (`search_state.SearchState`).
    """

    global_batch: int
    sizes: np.ndarray
    min_sizes: np.ndarray
    max_sizes: np.ndarray
    updates: int = 0
    adjustments: int = 0
    reason: str = "initial split"
    replica_stats: Optional[ReplicaStats] = None
    search: SearchState = SearchState()

    def __post_init__(self):
        for name in ("sizes", "min_sizes", "max_sizes"):
            arr = np.array(getattr(self, name), dtype=np.int64)
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        for arr in _arrays((self.replica_stats, self.search)):
            arr.setflags(write=False)  # (a search copies what it changes: `Race.copy`)

    @property
    def num_replicas(self) -> int:
        return int(self.sizes.size)

    @property
    def settled_sizes(self) -> np.ndarray:
        """The split held, leaving out a step-time search's candidate in flight: while the
        search races candidates, the one it would keep now; `sizes` otherwise."""
        settled = self.search.settled_split()
        return self.sizes.copy() if settled is None else settled

    def replace(self, **changes) -> "ControllerState":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable dict (lists, ints, floats, bools, str); see `from_dict`."""
        return {"format": STATE_FORMAT, **_plain({
            "global_batch": self.global_batch, "sizes": self.sizes, "min_sizes": self.min_sizes,
            "max_sizes": self.max_sizes, "updates": self.updates,
            "adjustments": self.adjustments, "reason": str(self.reason),
            "replica_stats": self.replica_stats, "search": self.search})}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ControllerState":
        """The state of a `to_dict` dict (also one written before the state was typed).

        Raises:
            ValueError: a dict of an unknown format.
        """
        if not isinstance(d, Mapping) or d.get("format", STATE_FORMAT) != STATE_FORMAT:
            raise ValueError(f"`d` must be a dict from ControllerState.to_dict() (format "
                             f"{STATE_FORMAT!r}). Received: {format_value(d)}")
        common = dict(global_batch=int(d["global_batch"]), sizes=d["sizes"],
                      min_sizes=d["min_sizes"], max_sizes=d["max_sizes"],
                      updates=int(d["updates"]), adjustments=int(d["adjustments"]),
                      reason=str(d["reason"]))
        if "format" not in d:
            return cls(**common, **_from_unversioned(d, len(d["sizes"])))
        stats = d.get("replica_stats")
        return cls(**common, replica_stats=None if stats is None else _replica_stats(stats),
                   search=_search_state(d["search"]))


# ---------------------------------------------------------------------------- to JSON -----
def _plain(value: Any) -> Any:
    """A JSON-compatible deep copy of a state's values (records to dicts by field)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
        return {k: _plain(v) for k, v in zip(value._fields, value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    return value


def _arrays(value: Any):
    """The numpy arrays of a record (and of the records in it). Every update makes a state, so
    the walk is iterative and reads each record type's fields once (`_FIELDS`)."""
    pending = [value]
    while pending:
        value = pending.pop()
        if isinstance(value, np.ndarray):
            yield value
        elif isinstance(value, (tuple, list)):  # NamedTuples too
            pending.extend(value)
        elif value is not None and not isinstance(value, (int, float, str, enum.Enum)):
            names = _FIELDS.get(type(value))
            if names is None:
                names = _FIELDS[type(value)] = tuple(
                    f.name for f in dataclasses.fields(value)) if dataclasses.is_dataclass(
                    value) else ()
            pending.extend(getattr(value, name) for name in names)


_FIELDS: Dict[type, Tuple[str, ...]] = {}  # a record type's field names


# ---------------------------------------------------------------------------- from JSON ---
def _floats(d: Mapping[str, Any], record):
    return record(*(np.asarray(d[f], np.float64) for f in record._fields))


def _windows(d: Mapping[str, Any]) -> WindowSums:
    """Scalar windows (log step times): an int count, float sums."""
    return WindowSums(int(d["count"]), float(d["sum"]), float(d["sum_sq"]))


def _replica_stats(d: Mapping[str, Any]) -> ReplicaStats:
    return ReplicaStats(_floats(d["sums"], TimeSums), _floats(d["levels"], Levels),
                        np.asarray(d["held_sign"], np.float64),
                        np.asarray(d["shape"], np.float64), np.asarray(d["shape_known"], bool))


def _search_state(d: Mapping[str, Any]) -> SearchState:
    race, held, fallback = d.get("race"), d.get("held"), d.get("fallback")
    return SearchState(
        phase=Phase(d["phase"]), tilt=int(d["tilt"]), held_sign=float(d["held_sign"]),
        noise_ss=float(d["noise_ss"]), noise_dof=float(d["noise_dof"]),
        base=None if d.get("base") is None else _windows(d["base"]),
        race=None if race is None else Race(
            int(race["incumbent"]), [int(v) for v in race["arms"]],
            [_windows(w) for w in race["windows"]], [bool(v) for v in race["alive"]],
            int(race["at"]), int(race["spent"]), int(race["settled"]),
            np.asarray(race["alpha"], np.float64), np.asarray(race["beta"], np.float64),
            np.asarray(race["splits"], np.int64), _floats(race["levels"], WindowSums)),
        held=None if held is None else Held(_windows(held["windows"]), float(held["noise"]),
                                            float(held["dof"])),
        fallback=None if fallback is None else MeasuredSplit(
            np.asarray(fallback["split"], np.int64), _windows(fallback["windows"])),
        vetoed=bool(d["vetoed"]))


# ----------------------------------------------------------------- before the typed state -
# The unversioned dicts: per-replica arrays under string keys in "stats" (the sums, the
# levels, the detector's sign and the shapes; a race's arrays and the fallback's split under
# "search_*") and the search's scalars in a dict "search" (its windows as {"n", "s1", "s2"}).
_OLD_SUMS = ("s0", "sb", "sbb", "st", "sbt", "stt")
_OLD_LEVELS = ("level_n", "level_t", "level_tt", "level_size", "past_ss", "past_dof")
_OLD_RACE = ("search_alpha", "search_beta", "search_splits", "search_level_n",
             "search_level_t", "search_level_tt")


def _from_unversioned(d: Mapping[str, Any], num: int) -> Dict[str, Any]:
    """`replica_stats` and `search` of an unversioned dict, as that code read them."""
    stats = {k: np.asarray(v, np.float64) for k, v in dict(d.get("stats") or {}).items()}
    replica_stats = None  # (models of another version: the controller starts them afresh)
    if all(k in stats and stats[k].shape == (num,)
           for k in _OLD_SUMS + _OLD_LEVELS + ("held_sign", "shape", "shape_known")):
        replica_stats = ReplicaStats(
            TimeSums(*(stats[k] for k in _OLD_SUMS)), Levels(*(stats[k] for k in _OLD_LEVELS)),
            stats["held_sign"], stats["shape"], stats["shape_known"] > 0)
    return {"replica_stats": replica_stats, "search": _old_search(d.get("search") or {}, stats)}


def _old_windows(cell: Mapping[str, Any]) -> WindowSums:
    return WindowSums(int(cell["n"]), float(cell["s1"]), float(cell["s2"]))


def _old_search(s: Mapping[str, Any], stats: Mapping[str, np.ndarray]) -> SearchState:
    phase, race = Phase(s.get("phase", "idle")), s.get("race")
    if race and phase is Phase.RACING and all(k in stats for k in _OLD_RACE):
        race = Race(int(race["incumbent"]), [int(v) for v in race["arms"]],
                    [_old_windows({"n": n, "s1": s1, "s2": s2})
                     for n, s1, s2 in zip(race["n"], race["s1"], race["s2"])],
                    [bool(v) for v in race["alive"]], int(race["at"]), int(race["spent"]),
                    int(race["settled"]), stats["search_alpha"], stats["search_beta"],
                    np.rint(stats["search_splits"]).astype(np.int64),
                    WindowSums(*(stats[k] for k in _OLD_RACE[3:])))
    else:
        if race or phase is Phase.RACING:
            # A race without its arrays (also what a race of a single arm left): that code
            # went idle on reading it.
            phase = Phase.IDLE
        race = None
    held = s.get("held")
    fallback = MeasuredSplit(np.rint(stats["search_fallback"]).astype(np.int64),
                             _old_windows(s["fallback"])) \
        if s.get("fallback") and "search_fallback" in stats else None
    return SearchState(
        phase=phase, tilt=int(s.get("tilt", 0)), held_sign=float(s.get("held_sign", 0.0)),
        noise_ss=float(s.get("noise_ss", 0.0)), noise_dof=float(s.get("noise_dof", 0.0)),
        base=_old_windows(s["base"]) if s.get("base") else None, race=race,
        held=Held(_old_windows(held), float(held["noise"]), float(held["dof"])) if held else None,
        fallback=fallback, vetoed=bool(s.get("vetoed", False)))
