"""Launch timelines as validated values: `--cpus`, the `--schedule` of cap changes and the
`--preempt` events.

A cap is a number of CPUs (a float > 0, at most the number of CPUs of the machine), or
``None`` for "no cap". A schedule is a list of :class:`CapChange` values, each saying
"``seconds`` after the cluster started, set worker ``worker``'s cap to ``cap``". A
preemption plan is a list of :class:`Preemption` values, each saying "``at`` seconds after
the cluster first started, SIGKILL worker ``worker`` (or, as a notice, SIGTERM it and SIGKILL
it only if it still runs after the grace period), and start it again ``restart_after`` seconds
later".

Readable text forms, used by the command line:

* caps: ``"0.2,0.3,0.9"`` (one value per worker; ``none`` for an uncapped worker);
* schedule: ``"30:1=0.1;60:1=0.3,0=none"``: entries separated by ``;``, each
  ``SECONDS:WORKER=CAP[,WORKER=CAP...]``;
* preemptions: ``"30:1+10;60:0/term"``: entries separated by ``;``, each
  ``SECONDS:WORKER[/term][+DOWN_SECONDS][,...]``; ``/term`` makes it a notice (SIGTERM, then
  SIGKILL after the grace period), ``/kill`` (the default) a SIGKILL at once.

Pure Python: no TensorFlow.
"""

import dataclasses
import math
import os
from typing import List, Optional, Sequence, Union

Cap = Optional[float]

_SCHEDULE_FORM = "SECONDS:WORKER=CAP[,WORKER=CAP];... e.g. '30:1=0.1;60:1=0.3'"
_PREEMPT_FORM = "SECONDS:WORKER[/term][+DOWN_SECONDS][,...];... e.g. '30:1+10;60:0/term'"
_PREEMPT_SIGNALS = {"kill": False, "sigkill": False, "term": True, "sigterm": True}


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


def _finite(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclasses.dataclass(frozen=True)
class Preemption:
    """At ``at`` seconds, preempt worker ``worker``'s process group (a preempted server).

    Args:
        at: seconds since the cluster first started. Each event happens once per launch:
            a restart of the whole cluster (``max_restarts``) does not replay past events.
        worker: worker index, 0-based.
        restart_after: if set, start the worker again this many seconds later, with the
            same TF_CONFIG (same address) and CPU cap. Only with parameter servers
            (``num_ps >= 1``), where a returning worker rejoins the running job.
        notice: False (default): SIGKILL at once. True: a preemption with notice, as cloud
            providers and Kubernetes give: SIGTERM, then SIGKILL if the process group still
            runs after the launcher's ``grace`` seconds. A tf_hetbatch worker saves on the
            notice and exits with ``tf_hetbatch.RESTART_EXIT_CODE``, which restarts the
            cluster without counting as a failure.
    """

    at: float
    worker: int
    restart_after: Optional[float] = None
    notice: bool = False

    def __post_init__(self):
        if not (_finite(self.at) and self.at >= 0):
            raise ValueError(f"A preemption time must be a number of seconds >= 0. "
                             f"Received: at={self.at!r}. Fix: use a time >= 0, e.g. 30.")
        if isinstance(self.worker, bool) or not isinstance(self.worker, int) \
                or self.worker < 0:
            raise ValueError(f"A preempted worker must be an index >= 0. "
                             f"Received: worker={self.worker!r}. Fix: e.g. 1 for worker 1.")
        if self.restart_after is not None and not (_finite(self.restart_after)
                                                   and self.restart_after >= 0):
            raise ValueError(f"`restart_after` must be a number of seconds >= 0, or None for "
                             f"a worker that does not come back. "
                             f"Received: restart_after={self.restart_after!r}")
        object.__setattr__(self, "at", float(self.at))
        if self.restart_after is not None:
            object.__setattr__(self, "restart_after", float(self.restart_after))
        if not isinstance(self.notice, bool):
            raise ValueError(f"`notice` must be True (SIGTERM, then SIGKILL after the grace "
                             f"period) or False (SIGKILL). Received: notice={self.notice!r}")

    def __str__(self) -> str:
        back = "" if self.restart_after is None else f"+{self.restart_after:g}"
        return f"{self.at:g}:{self.worker}{'/term' if self.notice else ''}{back}"


def parse_preemptions(text: str) -> List[Preemption]:
    """Parses ``"30:1+10;60:0/term"`` into a time-sorted list of :class:`Preemption`.

    ``30:1+10`` kills worker 1 at 30 s and starts it again at 40 s; ``60:0/term`` gives
    worker 0 a notice at 60 s (SIGTERM; SIGKILL after the grace period if it still runs).
    ``/kill`` (the default) and ``/term`` are case-insensitive (``/SIGTERM`` too).

    Raises:
        ValueError: the text does not have the form ``SECONDS:WORKER[/term][+DOWN];...``.
    """
    events: List[Preemption] = []
    for entry in text.split(";"):
        entry = entry.strip()
        if not entry:
            continue
        when, sep, items = entry.partition(":")
        if not sep or not items.strip():
            raise ValueError(f"--preempt entry {entry!r} has no ':'. Expected {_PREEMPT_FORM}. "
                             f"Received: --preempt {text!r}")
        try:
            seconds = float(when)
        except ValueError:
            raise ValueError(f"--preempt time {when.strip()!r} in entry {entry!r} is not a "
                             f"number of seconds. Expected {_PREEMPT_FORM}.") from None
        for item in items.split(","):
            head, plus, down_text = item.partition("+")
            worker_text, slash, how = head.partition("/")
            notice = _PREEMPT_SIGNALS.get(how.strip().lower()) if slash else False
            try:
                worker = int(worker_text)
                down = float(down_text) if plus else None
                if notice is None:
                    raise ValueError
            except ValueError:
                raise ValueError(f"--preempt item {item.strip()!r} in entry {entry!r} is not "
                                 f"WORKER, WORKER+DOWN_SECONDS, WORKER/term or "
                                 f"WORKER/term+DOWN_SECONDS. Expected {_PREEMPT_FORM}."
                                 ) from None
            try:
                events.append(Preemption(seconds, worker, down, notice))
            except ValueError as e:
                raise ValueError(f"--preempt entry {entry!r}: {e}") from None
    if not events:
        raise ValueError(f"--preempt is empty. Expected {_PREEMPT_FORM}. Received: {text!r}")
    return sorted(events, key=lambda e: e.at)


def validate_preemptions(preempt: Union[str, Sequence[Preemption], None], num_workers: int,
                         num_ps: int) -> List[Preemption]:
    """Checks preemption events (text or list of :class:`Preemption`) against the cluster.

    Returns:
        The events sorted by time (stable for equal times); empty if ``preempt`` is None.

    Raises:
        ValueError: bad syntax, a worker index out of range, or ``restart_after`` without
            parameter servers.
        TypeError: an element is not a :class:`Preemption`.
    """
    if preempt is None:
        return []
    if isinstance(preempt, str):
        events = parse_preemptions(preempt)
    else:
        events = list(preempt)
        for event in events:
            if not isinstance(event, Preemption):
                raise TypeError(f"`preempt` must be a string or a list of Preemption. "
                                f"Received an element {event!r}")
        events.sort(key=lambda e: e.at)
    for event in events:
        if event.worker >= num_workers:
            raise ValueError(
                f"The preemption {str(event)!r} names worker {event.worker}, but there are "
                f"only {num_workers} workers (0..{num_workers - 1}). "
                f"Fix: use a worker index below {num_workers}."
            )
        if event.restart_after is not None and num_ps == 0:
            raise ValueError(
                f"The preemption {str(event)!r} restarts worker {event.worker} after "
                f"{event.restart_after:g} s, but restarting a single worker needs parameter "
                f"servers: a MultiWorkerMirroredStrategy cluster cannot take a worker back. "
                f"Fix: launch with --ps 1 (num_ps=1), or drop '+{event.restart_after:g}' "
                f"and use --max-restarts to restart the whole cluster."
            )
    return events
