"""CPU caps as validated values: the `--cpus` list and the `--schedule` of changes.

A cap is a number of CPUs (a float > 0, at most the number of CPUs of the machine), or
``None`` for "no cap". A schedule is a list of :class:`CapChange` values, each saying
"``seconds`` after the cluster started, set worker ``worker``'s cap to ``cap``".

Readable text forms, used by the command line:

* caps: ``"0.2,0.3,0.9"`` (one value per worker; ``none`` for an uncapped worker);
* schedule: ``"30:1=0.1;60:1=0.3,0=none"``: entries separated by ``;``, each
  ``SECONDS:WORKER=CAP[,WORKER=CAP...]``.

Pure Python: no TensorFlow.
"""

import dataclasses
import math
import os
from typing import List, Optional, Sequence, Union

Cap = Optional[float]

_SCHEDULE_FORM = "SECONDS:WORKER=CAP[,WORKER=CAP];... e.g. '30:1=0.1;60:1=0.3'"


def available_cpus() -> int:
    """Returns the number of CPUs this process may run on (affinity mask aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def validate_cap(cap: Cap, what: str) -> Cap:
    """Checks one cap and returns it as a float (or ``None``).

    Args:
        cap: number of CPUs, or ``None`` for no cap.
        what: how to name the value in an error message, e.g. ``"--cpus[1]"``.

    Returns:
        The cap as a float, or ``None``.

    Raises:
        ValueError: the cap is not a finite number in (0, number of CPUs].
    """
    if cap is None:
        return None
    ncpu = available_cpus()
    try:
        value = float(cap)
    except (TypeError, ValueError):
        raise ValueError(
            f"{what} must be a number of CPUs in (0, {ncpu}] or 'none'. Received: {cap!r}"
        ) from None
    if not math.isfinite(value) or value <= 0 or value > ncpu:
        raise ValueError(
            f"{what} must be a number of CPUs in (0, {ncpu}] (this machine has {ncpu} "
            f"CPUs available), or 'none' for no cap. Received: {cap!r}. "
            f"Fix: use e.g. 0.5 for half a CPU."
        )
    return value


def _parse_cap_text(text: str, what: str) -> Cap:
    text = text.strip()
    if text.lower() in ("none", "-", "max"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"{what} must be a number of CPUs (e.g. 0.25) or 'none'. Received: {text!r}"
        ) from None
    return validate_cap(value, what)


def parse_cpus(text: str, num_workers: int) -> List[Cap]:
    """Parses ``"0.2,0.3,0.9"`` into one cap per worker.

    Args:
        text: comma-separated caps, one per worker; ``none`` for an uncapped worker.
        num_workers: the number of workers; the list must have exactly this length.

    Returns:
        A list of ``num_workers`` caps (floats or ``None``).

    Raises:
        ValueError: wrong number of values, or a value that is not a valid cap.
    """
    parts = [p for p in text.split(",")]
    if len(parts) != num_workers:
        raise ValueError(
            f"--cpus must give one cap per worker ({num_workers} workers). "
            f"Received: --cpus {text!r} ({len(parts)} values). "
            f"Fix: pass {num_workers} comma-separated values or change --workers."
        )
    return [_parse_cap_text(p, f"--cpus[{i}]") for i, p in enumerate(parts)]


def validate_cpus(cpus: Optional[Sequence[Cap]], num_workers: int) -> Optional[List[Cap]]:
    """Checks a list of caps given through the Python API (see :func:`parse_cpus`)."""
    if cpus is None:
        return None
    if isinstance(cpus, str):
        return parse_cpus(cpus, num_workers)
    cpus = list(cpus)
    if len(cpus) != num_workers:
        raise ValueError(
            f"`cpus` must give one cap per worker ({num_workers} workers). "
            f"Received: cpus={cpus!r} ({len(cpus)} values). "
            f"Fix: pass {num_workers} values (None for no cap) or change num_workers."
        )
    return [validate_cap(c, f"cpus[{i}]") for i, c in enumerate(cpus)]


@dataclasses.dataclass(frozen=True)
class CapChange:
    """At ``seconds`` after the cluster started, set worker ``worker``'s cap to ``cap``.

    Args:
        seconds: time since the workers were started (each restart starts the clock again).
        worker: worker index, 0-based.
        cap: CPUs for that worker from then on, or ``None`` to lift the cap.
    """

    seconds: float
    worker: int
    cap: Cap

    def __post_init__(self):
        if not (isinstance(self.seconds, (int, float)) and math.isfinite(self.seconds)
                and self.seconds >= 0):
            raise ValueError(
                f"A schedule time must be a number of seconds >= 0. "
                f"Received: seconds={self.seconds!r}"
            )
        if not isinstance(self.worker, int) or self.worker < 0:
            raise ValueError(
                f"A schedule worker must be an index >= 0. Received: worker={self.worker!r}"
            )
        object.__setattr__(self, "cap", validate_cap(self.cap, f"schedule cap for worker "
                                                                f"{self.worker}"))


def parse_schedule(text: str) -> List[CapChange]:
    """Parses ``"30:1=0.1;60:1=0.3,0=none"`` into a time-sorted list of changes.

    Raises:
        ValueError: the text does not have the form ``SECONDS:WORKER=CAP[,...];...``.
    """
    changes: List[CapChange] = []
    for entry in text.split(";"):
        entry = entry.strip()
        if not entry:
            continue
        when, sep, assignments = entry.partition(":")
        if not sep or not assignments.strip():
            raise ValueError(
                f"--schedule entry {entry!r} has no ':'. Expected {_SCHEDULE_FORM}. "
                f"Received: --schedule {text!r}"
            )
        try:
            seconds = float(when)
        except ValueError:
            raise ValueError(
                f"--schedule time {when.strip()!r} in entry {entry!r} is not a number of "
                f"seconds. Expected {_SCHEDULE_FORM}."
            ) from None
        for item in assignments.split(","):
            worker_text, eq, cap_text = item.partition("=")
            try:
                worker = int(worker_text)
            except ValueError:
                worker = None
            if not eq or worker is None:
                raise ValueError(
                    f"--schedule assignment {item.strip()!r} in entry {entry!r} is not "
                    f"WORKER=CAP. Expected {_SCHEDULE_FORM}."
                )
            cap = _parse_cap_text(cap_text, f"--schedule cap for worker {worker} at "
                                            f"{seconds:g} s")
            changes.append(CapChange(seconds, worker, cap))
    if not changes:
        raise ValueError(f"--schedule is empty. Expected {_SCHEDULE_FORM}. Received: {text!r}")
    return sorted(changes, key=lambda c: c.seconds)


def validate_schedule(schedule: Union[str, Sequence[CapChange], None],
                      num_workers: int) -> List[CapChange]:
    """Checks a schedule (text or list of :class:`CapChange`) against the worker count.

    Returns:
        The changes sorted by time (stable for equal times); empty if ``schedule`` is None.

    Raises:
        ValueError: bad syntax, or a worker index out of range.
        TypeError: an element is not a :class:`CapChange`.
    """
    if schedule is None:
        return []
    if isinstance(schedule, str):
        changes = parse_schedule(schedule)
    else:
        changes = list(schedule)
        for change in changes:
            if not isinstance(change, CapChange):
                raise TypeError(
                    f"`schedule` must be a string or a list of CapChange. "
                    f"Received an element {change!r}"
                )
        changes.sort(key=lambda c: c.seconds)
    for change in changes:
        if change.worker >= num_workers:
            raise ValueError(
                f"The schedule names worker {change.worker}, but there are only "
                f"{num_workers} workers (0..{num_workers - 1}). Received: {change}. "
                f"Fix: use a worker index below {num_workers}."
            )
    return changes
