"""CPU caps for worker processes: cgroup CPU quotas, or a SIGSTOP/SIGCONT duty cycle.

A cap of ``c`` CPUs lets a worker use at most ``c`` CPU-seconds per second of wall time,
which emulates a slower machine. Only hard caps do that: ``nice`` and ``cpu.shares`` are
work-conserving and give a synchronous worker the whole CPU while others wait.

Methods, in the order ``auto`` tries them:

* ``cgroup-v1``: ``<cpu mount>/<own group>/tf_hetbatch-<pid>-<hex>/worker<i>`` with
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (default period 10 ms; a short period
  avoids throttling in bursts longer than a training step).
* ``cgroup-v2``: the same tree with ``cpu.max`` = ``"<quota> <period>"``. Needs the
  ``cpu`` controller in the launcher's own cgroup2 group and the right to delegate it.
* ``duty-cycle``: a thread that sends SIGCONT to each capped worker's process group at the
  start of every period (default 100 ms) and SIGSTOP after an on-time, adjusted each
  period from the worker's measured CPU time so that it averages ``c`` CPUs (see
  :class:`DutyCycleCaps`). Coarser than a quota: CPU arrives in bursts of one period.

Every object has the same shape: ``attach(i, pid)``, ``detach(i)`` (forget worker ``i``'s
process, keep its cap for the next ``attach``: a preempted worker that is started again is
capped as before), ``set_cap(i, cap)``, ``release()`` (lift all caps and forget the
processes; call it before stopping them) and ``close()`` (remove the groups). ``method``
and ``description`` say what is in force.

Pure Python stdlib: no TensorFlow.
"""

import logging
import math
import os
import secrets
import signal
import threading
import time
from typing import Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)

Cap = Optional[float]
CAP_METHODS = ("auto", "cgroup", "duty-cycle", "none")
_MIN_QUOTA_US = 1000
_MAX_PERIOD_US = 1_000_000


def quota_and_period(cap: float, period_us: int) -> Tuple[int, int]:
    """Returns ``(quota_us, period_us)`` for a cap, lengthening the period if the quota
    would fall below the kernel's 1 ms minimum (e.g. cap 0.05 with a 10 ms period)."""
    period = max(int(period_us), math.ceil(_MIN_QUOTA_US / cap))
    period = min(period, _MAX_PERIOD_US)
    return max(_MIN_QUOTA_US, round(cap * period)), period


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _own_cgroup(version: int) -> Optional[Tuple[str, str]]:
    """Returns ``(mount point, own group path)`` of the cpu hierarchy, or None."""
    mount = None
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 4:
                continue
            if version == 1 and parts[2] == "cgroup" and "cpu" in parts[3].split(","):
                mount = parts[1]
                break
            if version == 2 and parts[2] == "cgroup2":
                mount = parts[1]
                break
    if mount is None:
        return None
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if version == 1 and "cpu" in controllers.split(","):
                return mount, path
            if version == 2 and controllers == "":
                return mount, path
    return None


class CpuCaps:
    """No caps: every method is a no-op. Base class of the real methods."""

    method = "none"

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.caps: Dict[int, Cap] = {}

    @property
    def description(self) -> str:
        """One line saying which method is in force and where."""
        return "no CPU caps"

    def attach(self, index: int, pid: int) -> None:
        """Puts the (just started) worker ``index`` with process id ``pid`` under its cap."""

    def detach(self, index: int) -> None:
        """Forgets worker ``index``'s process (about to be killed); its cap stays set and
        applies to the next process attached as ``index``."""

    def set_cap(self, index: int, cap: Cap) -> None:
        """Sets worker ``index``'s cap in CPUs (``None`` lifts it); effective at once."""
        self.caps[index] = cap

    def release(self) -> None:
        """Lifts all caps and forgets the attached processes (call before stopping them)."""
        self.caps.clear()

    def close(self) -> None:
        """Releases and removes everything this object created (idempotent)."""
        self.release()

    def __enter__(self) -> "CpuCaps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CgroupCaps(CpuCaps):
    """CPU quotas in one cgroup per worker under a unique parent (v1 or v2).

    Args:
        num_workers: number of worker groups to create.
        version: 1 (``cpu.cfs_quota_us``) or 2 (``cpu.max``).
        period_ms: quota period in milliseconds.

    Raises:
        OSError: the hierarchy is missing or not writable (nothing is left behind).
    """

    def __init__(self, num_workers: int, version: int, period_ms: float = 10.0):
        super().__init__(num_workers)
        self.version = version
        self.method = f"cgroup-v{version}"
        self.period_us = int(round(period_ms * 1000))
        found = _own_cgroup(version)
        if found is None:
            raise OSError(f"no cgroup v{version} cpu hierarchy mounted")
        mount, own = found
        self.base = os.path.normpath(mount + "/" + own.lstrip("/"))
        if version == 2:
            with open(os.path.join(self.base, "cgroup.controllers")) as f:
                if "cpu" not in f.read().split():
                    raise OSError(f"cpu controller not available in {self.base}")
        self.parent = os.path.join(self.base,
                                   f"tf_hetbatch-{os.getpid()}-{secrets.token_hex(3)}")
        self.groups: List[str] = []
        self._closed = False
        try:
            if version == 2:
                _write(os.path.join(self.base, "cgroup.subtree_control"), "+cpu")
            os.mkdir(self.parent)
            if version == 2:
                _write(os.path.join(self.parent, "cgroup.subtree_control"), "+cpu")
            for i in range(num_workers):
                group = os.path.join(self.parent, f"worker{i}")
                os.mkdir(group)
                self.groups.append(group)
            for i in range(num_workers):
                self._apply(i, None)
        except OSError:
            self.close()
            raise

    @property
    def description(self) -> str:
        return (f"cgroup v{self.version} CPU quotas in {self.parent}, "
                f"period {self.period_us / 1000:g} ms")

    def _apply(self, index: int, cap: Cap) -> None:
        group = self.groups[index]
        if self.version == 1:
            quota_file = os.path.join(group, "cpu.cfs_quota_us")
            _write(quota_file, "-1")
            if cap is None:
                return
            quota, period = quota_and_period(cap, self.period_us)
            _write(os.path.join(group, "cpu.cfs_period_us"), str(period))
            _write(quota_file, str(quota))
        else:
            if cap is None:
                _write(os.path.join(group, "cpu.max"), f"max {self.period_us}")
                return
            quota, period = quota_and_period(cap, self.period_us)
            _write(os.path.join(group, "cpu.max"), f"{quota} {period}")

    def attach(self, index: int, pid: int) -> None:
        try:
            _write(os.path.join(self.groups[index], "cgroup.procs"), str(pid))
        except ProcessLookupError:
            pass  # Already exited: the supervisor sees that.

    def set_cap(self, index: int, cap: Cap) -> None:
        super().set_cap(index, cap)
        self._apply(index, cap)

    def release(self) -> None:
        super().release()
        for i in range(len(self.groups)):
            try:
                self._apply(i, None)
            except OSError as e:
                logger.warning("Could not lift the CPU cap of %s: %s", self.groups[i], e)

    def _empty(self, group: str) -> None:
        """Moves any process still in ``group`` back to the launcher's own group."""
        try:
            with open(os.path.join(group, "cgroup.procs")) as f:
                pids = f.read().split()
        except OSError:
            return
        for pid in pids:
            try:
                _write(os.path.join(self.base, "cgroup.procs"), pid)
            except OSError:
                pass

    def _rmdir(self, path: str, timeout: float = 3.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.rmdir(path)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if time.monotonic() >= deadline:
                    logger.warning("Could not remove cgroup %s: %s. Fix: move its processes "
                                   "out and rmdir it by hand.", path, e)
                    return
                self._empty(path)
                time.sleep(0.05)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.release()
        for group in self.groups:
            self._empty(group)
            self._rmdir(group)
        if os.path.isdir(self.parent):
            self._rmdir(self.parent)


def process_cpu_seconds(pid: int) -> Optional[float]:
    """CPU seconds (user + system, all threads) used so far by ``pid``, from /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    # utime and stime are fields 14 and 15 of stat(5), i.e. 11 and 12 after the name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class DutyCycleCaps(CpuCaps):
    """Caps by SIGSTOP/SIGCONT of each worker's process group in a background thread.

    Each period, a capped worker runs for an on-time and is stopped for the rest. The
    on-time is closed-loop: the worker's measured CPU time (``/proc/<pid>/stat``, all its
    threads) is compared with ``cap * elapsed`` and the difference (bounded by
    ``cap * period`` either way) is made up in the next period, with the on-time scaled by
    the CPU the worker burns per second running (so multi-threaded workers and CPUs busy
    with other work are handled). Without /proc it is open-loop, ``min(cap, 1) * period``.
    Children of the worker are stopped with it but not counted.

    Args:
        num_workers: number of workers.
        period_ms: duty-cycle period in milliseconds (default 100).
    """

    method = "duty-cycle"

    def __init__(self, num_workers: int, period_ms: float = 100.0):
        super().__init__(num_workers)
        self.period = period_ms / 1000.0
        self._groups: Dict[int, int] = {}
        self._loop: Dict[int, List[float]] = {}  # index -> [debt, rate, last cpu, last on]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def description(self) -> str:
        return f"SIGSTOP/SIGCONT duty cycle (closed-loop), period {self.period * 1000:g} ms"

    def _signal(self, pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def attach(self, index: int, pid: int) -> None:
        with self._lock:
            self._groups[index] = pid  # Workers are started as process group leaders.
            self._loop.pop(index, None)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tf_hetbatch-duty-cycle",
                                            daemon=True)
            self._thread.start()

    def detach(self, index: int) -> None:
        with self._lock:
            self._groups.pop(index, None)
            self._loop.pop(index, None)

    def set_cap(self, index: int, cap: Cap) -> None:
        with self._lock:
            self.caps[index] = cap
            self._loop.pop(index, None)
            if cap is None and index in self._groups:
                self._signal(self._groups[index], signal.SIGCONT)

    def _on_time(self, index: int, cap: float) -> float:
        """Seconds worker ``index`` may run in the coming period (lock held)."""
        used = process_cpu_seconds(self._groups[index])
        state = self._loop.get(index)
        if used is None:
            return min(cap, 1.0) * self.period
        if state is None:
            self._loop[index] = [0.0, 1.0, used, 0.0]
            return min(cap * self.period, self.period)
        debt, rate, last_used, last_on = state
        got = used - last_used
        if last_on >= 0.005:
            rate = 0.5 * rate + 0.5 * max(0.05, got / last_on)
        bound = cap * self.period
        debt = min(bound, max(-bound, debt + cap * self.period - got))
        on = min(self.period, max(0.0, (cap * self.period + debt) / rate))
        self._loop[index] = [debt, rate, used, on]
        return on

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            plan = []
            with self._lock:
                for i, pgid in self._groups.items():
                    cap = self.caps.get(i)
                    if cap is not None:
                        on = self._on_time(i, cap)
                        if on > 0:
                            self._signal(pgid, signal.SIGCONT)
                        if on < self.period:
                            plan.append((on, i, pgid))
            for on, i, pgid in sorted(plan):
                if self._stop.wait(max(0.0, start + on - time.monotonic())):
                    return
                with self._lock:
                    if self._groups.get(i) == pgid and self.caps.get(i) is not None:
                        self._signal(pgid, signal.SIGSTOP)
            self._stop.wait(max(0.0, start + self.period - time.monotonic()))

    def release(self) -> None:
        with self._lock:
            self.caps.clear()
            self._loop.clear()
            for pgid in self._groups.values():
                self._signal(pgid, signal.SIGCONT)
            self._groups.clear()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        self.release()


def make_caps(method: str, num_workers: int, period_ms: Optional[float] = None,
              needed: bool = True) -> CpuCaps:
    """Creates the CPU-cap mechanism for ``method``.

    Args:
        method: ``"auto"`` (cgroup v1, then v2, then duty cycle), ``"cgroup"`` (v1 or v2,
            else an error), ``"duty-cycle"`` or ``"none"``.
        num_workers: number of workers.
        period_ms: period in ms; default 10 for cgroups, 100 for the duty cycle (also when
            ``auto`` falls back to the duty cycle and ``period_ms`` is below 20).
        needed: whether any cap will be set; with ``auto`` and no caps, nothing is created.

    Returns:
        A :class:`CpuCaps`; its ``description`` says what is in force.

    Raises:
        ValueError: unknown method, or a bad period.
        RuntimeError: ``"cgroup"`` asked for but no writable cgroup cpu hierarchy.
    """
    if method not in CAP_METHODS:
        raise ValueError(f"`cap_method` must be one of {CAP_METHODS}. Received: {method!r}")
    if period_ms is not None and not (1 <= period_ms <= 1000):
        raise ValueError(f"`period_ms` must be in [1, 1000] milliseconds. "
                         f"Received: {period_ms!r}")
    if method == "none" or (method == "auto" and not needed):
        return CpuCaps(num_workers)
    if method == "duty-cycle":
        return DutyCycleCaps(num_workers, period_ms or 100.0)
    reasons = []
    for version in (1, 2):
        try:
            return CgroupCaps(num_workers, version, period_ms or 10.0)
        except OSError as e:
            reasons.append(f"cgroup v{version}: {e}")
    if method == "cgroup":
        raise RuntimeError(
            "`cap_method='cgroup'` needs a writable cgroup cpu hierarchy, but "
            + "; ".join(reasons)
            + ". Fix: run as root (or with a delegated cgroup), or use "
              "cap_method='duty-cycle' (--cap-method duty-cycle)."
        )
    logger.warning("cgroups not usable (%s); falling back to a SIGSTOP/SIGCONT duty cycle.",
                   "; ".join(reasons))
    return DutyCycleCaps(num_workers, period_ms if period_ms and period_ms >= 20 else 100.0)
