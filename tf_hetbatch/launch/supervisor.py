"""One attempt of a local cluster: start the tasks, relay their output, watch, stop.

Without parameter servers every task is a worker and any worker failure ends the attempt.
With parameter servers the chief's exit decides the attempt, a ps exit is fatal, and a
worker exit is only logged (the ParameterServerStrategy coordinator moves its work to the
other workers). Preemption events SIGKILL a worker, or give it a notice (SIGTERM, SIGKILL
after the grace period), and may start it again later. A task that exits with
``RESTART_EXIT_CODE`` (it saved on a preemption notice) ends the attempt as "restart": once
the other tasks exited too (or ``RESTART_EXIT_WAIT_S`` passed), the cluster starts again.

Each task runs in its own session and process group, so that stopping it stops whatever
it started too. Exits are observed with ``waitid(..., WNOWAIT)`` and the processes are
reaped only at the end of the attempt, after their whole process groups are gone (also those
of preempted workers), so a process-group id is never reused while the launcher may still
signal it. Every wait has a timeout.

Pure Python stdlib: no TensorFlow.
"""

import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from typing import IO, List, Mapping, Optional, Sequence, Tuple

from tf_hetbatch.training.preemption import RESTART_EXIT_CODE
from tf_hetbatch.launch import cluster
from tf_hetbatch.launch.cpu_caps import CpuCaps
from tf_hetbatch.launch.schedule import Cap, CapChange, Preemption

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_KILL_WAIT_S = 5.0
# The default grace period: seconds from a SIGTERM (a preemption notice, or stopping the
# tasks) to the SIGKILL. A tf_hetbatch worker given a notice saves at a step agreed with the
# others and exits: its last worker exited 2.2-7.5 s after the SIGTERM (2 and 3 workers,
# measured on 2 shared CPUs), so the former 3 s could end a rehearsed notice in a SIGKILL,
# counted as a failure. 30 s leaves 4x that, and is Kubernetes' default
# terminationGracePeriodSeconds: a rehearsal here gives a worker the time a pod gets. Tasks
# that exit on the SIGTERM are not waited for: the wait ends once their process groups are gone.
DEFAULT_GRACE_S = 30.0
# After a task exited with RESTART_EXIT_CODE, how long the other tasks (which saved at the
# same step, or are saving) get to exit by themselves before the attempt ends anyway.
RESTART_EXIT_WAIT_S = 60.0


def signal_name(signum: int) -> str:
    """``9 -> "SIGKILL"``; unknown numbers as ``"signal 42"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclasses.dataclass(frozen=True)
class WorkerExit:
    """How one task (a worker, or with parameter servers also the chief or a ps) ended.

    Attributes:
        index: task index (worker index for workers).
        returncode: exit code, or minus the signal number if a signal killed it
            (as ``subprocess.Popen.returncode``); None if it could not be reaped.
        stopped_by_launcher: the task was still running when the launcher stopped the
            cluster (because a task failed, the chief finished, a timeout, or an interrupt).
        role: "worker", "chief" or "ps".
        preempted: the task's last process was killed by a ``preempt`` event.
        restarts: how often the launcher started this worker again after a preemption
            (within the attempt); the other fields describe its last process.
    """

    index: int
    returncode: Optional[int]
    stopped_by_launcher: bool = False
    role: str = "worker"
    preempted: bool = False
    restarts: int = 0

    @property
    def name(self) -> str:
        """E.g. ``"worker 1"``, ``"ps 0"``, ``"chief"``."""
        return cluster.task_name(self.role, self.index)

    @property
    def ok(self) -> bool:
        """True if the task exited with code 0 by itself."""
        return self.returncode == 0 and not self.stopped_by_launcher

    def describe(self) -> str:
        """E.g. ``"exit code 3"`` or ``"killed by signal SIGKILL (preempted)"``."""
        if self.returncode is None:
            how = "unknown exit status"
        elif self.returncode < 0:
            how = f"killed by signal {signal_name(-self.returncode)}"
        else:
            how = f"exit code {self.returncode}"
            if self.returncode == RESTART_EXIT_CODE:
                how += " (saved on a preemption notice: restart me)"
        return (how + (" (preempted)" if self.preempted else "")
                + (" (stopped by the launcher)" if self.stopped_by_launcher else ""))


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What one task of an attempt runs.

    Attributes:
        role: "worker", "chief" or "ps".
        index: task index within its role.
        command: the command line.
        env: its complete environment.
        cap_index: index of its CPU cap, or None for an uncapped task.
    """

    role: str
    index: int
    command: Tuple[str, ...]
    env: Mapping[str, str]
    cap_index: Optional[int] = None

    @property
    def name(self) -> str:
        return cluster.task_name(self.role, self.index)


@dataclasses.dataclass(frozen=True)
class AttemptOutcome:
    """Result of one attempt: ``reason`` is "ok", "failed", "restart" (a task exited with
    ``RESTART_EXIT_CODE`` and none failed), "timeout" or "interrupted".

    ``workers`` are the worker tasks by index; with parameter servers ``chief`` and ``ps``
    are set too and ``lost`` counts worker exits that were tolerated.
    """

    reason: str
    workers: List[WorkerExit]
    failed: Optional[WorkerExit] = None
    chief: Optional[WorkerExit] = None
    ps: List[WorkerExit] = dataclasses.field(default_factory=list)
    lost: int = 0


class PreemptionPlan:
    """The preemption events of one launch; each happens once, timed from the first start.

    Args:
        events: the events (any order).
    """

    def __init__(self, events: Sequence[Preemption]):
        self._pending = sorted(events, key=lambda e: e.at)
        self.origin: Optional[float] = None

    def start(self, now: float) -> None:
        """Starts the clock (only the first call counts)."""
        if self.origin is None:
            self.origin = now

    def elapsed(self, now: float) -> float:
        """Seconds on the launch clock at ``time.monotonic()`` value ``now``."""
        return now - (self.origin if self.origin is not None else now)

    def due(self, now: float) -> List[Preemption]:
        """Removes and returns the events whose time has come."""
        elapsed = self.elapsed(now)
        due = []
        while self._pending and self._pending[0].at <= elapsed:
            due.append(self._pending.pop(0))
        return due


def _pump(pipe: IO[bytes], prefix: str, stream: IO[str], lock: threading.Lock) -> None:
    """Copies lines from ``pipe`` to ``stream`` with ``prefix``, until EOF."""
    try:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            try:
                with lock:
                    stream.write(f"{prefix}{line}\n")
                    stream.flush()
            except Exception:  # A closed stream must not block the worker on a full pipe.
                pass
    finally:
        pipe.close()


def _exit_status(pid: int) -> Optional[int]:
    """Popen-style return code if ``pid`` has exited (without reaping it), else None."""
    try:
        res = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if res is None or res.si_pid == 0:
        return None
    if res.si_code == os.CLD_EXITED:
        return res.si_status
    return -res.si_status


def stop_groups(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every process group with live members, SIGKILL after ``grace`` s, then reap.

    Waits at most ``grace + 2 * 5`` seconds in total.
    """
    pgids = [p.pid for p in procs]
    live = cluster.live_groups(pgids)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, _KILL_WAIT_S)):
        for pgid in live:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            live = cluster.live_groups(live)
        if not live:
            break
    if live:
        logger.warning("Process groups %s survived SIGKILL for %.0f s.", sorted(live),
                       _KILL_WAIT_S)
    for p in procs:
        try:
            p.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("Task pid %d could not be reaped.", p.pid)


class _Task:
    """A task during an attempt: its processes (one per start, the last is current)."""

    def __init__(self, spec: TaskSpec):
        self.spec = spec
        self.procs: List[subprocess.Popen] = []
        self.code: Optional[int] = None  # Exit status of the current process, once seen.
        self.preempted = False  # The current process was (or is being) killed by a preemption.
        self.kill_at: Optional[float] = None  # After a notice: when to SIGKILL it (monotonic).
        self.noticed_at: Optional[float] = None  # When its notice (SIGTERM) was sent.

    @property
    def running(self) -> bool:
        """Started, not preempted, and not seen to exit."""
        return bool(self.procs) and self.code is None and not self.preempted

    def exit(self, stopped: bool = False) -> WorkerExit:
        code = self.code if self.code is not None else self.procs[-1].returncode
        return WorkerExit(self.spec.index, code, stopped, self.spec.role, self.preempted,
                          len(self.procs) - 1)


class _Attempt:
    """Runs one attempt; see :func:`run_attempt`."""

    def __init__(self, tasks, ps_mode, attempt, caps, stdout, stderr, plan, grace):
        self.tasks = [_Task(spec) for spec in tasks]
        self.grace = grace
        self.workers = {t.spec.index: t for t in self.tasks if t.spec.role == "worker"}
        self.ps_mode = ps_mode
        self.attempt = attempt
        self.caps = caps
        self.stdout, self.stderr = stdout, stderr
        self.plan = plan
        self.lock = threading.Lock()
        self.pumps: List[threading.Thread] = []
        self.restarts: List[Tuple[float, int]] = []  # (launch-clock time, worker index)
        self.lost = 0
        self.events: List[str] = []
        self.restart_since: Optional[float] = None  # When a task first exited "restart me".
        self.notice: Optional[Tuple[float, str]] = None  # (when, to whom) of the first notice

    def note(self, text: str, level: int = logging.INFO) -> None:
        """Logs ``text`` with the launch-clock time and keeps it as an event."""
        elapsed = self.plan.elapsed(time.monotonic())
        event = f"attempt {self.attempt + 1}, t={elapsed:.1f} s: {text}"
        self.events.append(event)
        logger.log(level, "%s", event)

    def spawn(self, task: _Task) -> None:
        spec = task.spec
        proc = subprocess.Popen(list(spec.command), env=dict(spec.env),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        task.procs.append(proc)
        task.code, task.preempted = None, False
        task.kill_at = task.noticed_at = None
        if spec.cap_index is not None:
            self.caps.attach(spec.cap_index, proc.pid)
        for pipe, stream in ((proc.stdout, self.stdout), (proc.stderr, self.stderr)):
            t = threading.Thread(target=_pump, args=(pipe, f"[{spec.name}] ", stream, self.lock),
                                 name=f"tf_hetbatch-{spec.role}{spec.index}-output",
                                 daemon=True)
            t.start()
            self.pumps.append(t)

    def poll_exits(self) -> List[_Task]:
        """Records the exit status of tasks whose process has ended; returns them."""
        ended = []
        for task in self.tasks:
            if task.procs and task.code is None:
                code = _exit_status(task.procs[-1].pid)
                if code is not None:
                    task.code = code
                    ended.append(task)
                    if self.notice is not None:
                        since, which = self.notice[0], f"the notice to {self.notice[1]}"
                        if task.noticed_at is not None:
                            since, which = task.noticed_at, "its notice"
                        self.note(f"{task.spec.name} exited {time.monotonic() - since:.2f} s "
                                  f"after {which}: {task.exit().describe()}")
        return ended

    def preempt(self, now: float) -> None:
        """Fires the preemption events that are due."""
        for event in self.plan.due(now):
            task = self.workers[event.worker]
            back = ("" if event.restart_after is None
                    else f"; starting it again at t={event.at + event.restart_after:g} s")
            if task.running and event.notice:
                task.preempted = True
                task.noticed_at, task.kill_at = now, now + self.grace
                if self.notice is None:
                    self.notice = (now, task.spec.name)
                try:
                    os.killpg(task.procs[-1].pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    pass
                self.note(f"notice to {task.spec.name} (SIGTERM to its process group, pid "
                          f"{task.procs[-1].pid}; SIGKILL in {self.grace:g} s if it still "
                          f"runs){back}")
            elif task.running:
                self._kill(task)
                self.note(f"preempted {task.spec.name} (SIGKILL to its process group, "
                          f"pid {task.procs[-1].pid}){back}")
            else:
                self.note(f"preemption of {task.spec.name}: not running, nothing to kill{back}")
            if event.restart_after is not None:
                self.restarts.append((event.at + event.restart_after, event.worker))
                self.restarts.sort()

    def _kill(self, task: _Task) -> None:
        if task.spec.cap_index is not None:
            self.caps.detach(task.spec.cap_index)
        task.preempted = True
        task.kill_at = None
        try:
            os.killpg(task.procs[-1].pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def enforce_grace(self, now: float) -> None:
        """SIGKILLs the process groups whose notice's grace period ran out."""
        for task in self.tasks:
            if task.kill_at is not None and now >= task.kill_at:
                task.kill_at = None
                if task.procs and cluster.live_groups([task.procs[-1].pid]):
                    self._kill(task)
                    self.note(f"{task.spec.name} still ran {self.grace:g} s after its "
                              f"notice: SIGKILL to its process group")

    def restart(self, now: float) -> None:
        """Starts preempted workers whose time to come back has come (once they are gone)."""
        elapsed = self.plan.elapsed(now)
        keep = []
        for when, index in self.restarts:
            task = self.workers[index]
            if when > elapsed:
                keep.append((when, index))
            elif task.running:
                logger.info("%s is running at its restart time t=%g s; nothing to do.",
                            task.spec.name, when)
            elif task.code is None or cluster.live_groups([task.procs[-1].pid]):
                keep.append((when, index))  # Still dying: its address is not free yet.
            else:
                self.spawn(task)
                self.note(f"started {task.spec.name} again (pid {task.procs[-1].pid}, same "
                          f"TF_CONFIG and address, restart {len(task.procs) - 1})")
        self.restarts = keep

    def check(self, ended: List[_Task]) -> Tuple[Optional[str], Optional[_Task]]:
        """Returns ("ok"|"failed", task) if the attempt is decided by the ``ended`` tasks."""
        failed = None
        for task in ended:
            how = task.exit().describe()
            if task.code == RESTART_EXIT_CODE and task.spec.role != "ps":
                logger.info("%s exited: %s", task.spec.name, how)
                if self.restart_since is None:
                    self.restart_since = time.monotonic()
                if self.ps_mode and task.spec.role == "chief":
                    return "restart", None
                continue
            if not self.ps_mode:
                logger.info("%s exited: %s", task.spec.name, how)
                if task.code != 0 and failed is None:
                    failed = task
            elif task.spec.role == "chief":
                logger.info("chief exited: %s", how)
                if task.code == 0:
                    return "ok", None
                return "failed", task
            elif task.spec.role == "ps":
                logger.error("%s ended before the chief finished: %s. This is fatal.",
                             task.spec.name, how)
                failed = failed or task
            else:
                self.lost += 1
                self.note(f"{task.spec.name} ended: {how}; not fatal with parameter servers "
                          f"(the coordinator moves its work to the other workers)",
                          logging.WARNING)
        if failed is not None:
            return "failed", failed
        if not self.ps_mode and all(t.code is not None for t in self.tasks):
            return ("ok" if self.restart_since is None else "restart"), None
        if self.restart_since is not None and \
                time.monotonic() - self.restart_since > RESTART_EXIT_WAIT_S:
            logger.warning("Tasks still running %.0f s after a task exited to be restarted; "
                           "stopping them.", RESTART_EXIT_WAIT_S)
            return "restart", None
        return None, None


def run_attempt(tasks: Sequence[TaskSpec], reservation: cluster.PortReservation,
                ps_mode: bool, attempt: int, caps: CpuCaps, initial_caps: Sequence[Cap],
                schedule: Sequence[CapChange], plan: PreemptionPlan, stdout: IO[str],
                stderr: IO[str], grace: float, deadline: Optional[float],
                stop: threading.Event, events: Optional[List[str]] = None) -> AttemptOutcome:
    """Runs the cluster once.

    Without parameter servers (``ps_mode`` False) it returns when all workers exited, one
    failed, the ``deadline`` (``time.monotonic()`` value) passed, or ``stop`` was set. With
    parameter servers it returns when the chief exited (its status decides), a ps exited
    (fatal), the deadline passed or ``stop`` was set; worker exits are logged and tolerated.

    Args:
        tasks: what to run, in start order; worker tasks have role "worker".
        reservation: the held ports of the tasks' addresses; released just before the tasks
            start (so that they can bind them) and in any case on return.
        events: if given, preemptions, worker restarts and tolerated worker exits are
            appended to it as text lines.

    Other arguments are assumed valid (see :func:`tf_hetbatch.launch.launch`).
    """
    run = _Attempt(tasks, ps_mode, attempt, caps, stdout, stderr, plan, grace)
    outcome = "ok"
    failed: Optional[_Task] = None
    stopped: set = set()
    try:
        for i, cap in enumerate(initial_caps):
            caps.set_cap(i, cap)
        reservation.release()  # Just before spawning, so that the tasks can bind them.
        for task in run.tasks:
            run.spawn(task)
        start = time.monotonic()
        plan.start(start)
        pending = list(schedule)
        while True:
            decided, task = run.check(run.poll_exits())
            if decided is not None:
                outcome, failed = decided, task
                break
            if stop.is_set():
                outcome = "interrupted"
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                outcome = "timeout"
                break
            elapsed = now - start
            while pending and pending[0].seconds <= elapsed:
                change = pending.pop(0)
                caps.set_cap(change.worker, change.cap)
                logger.info("t=%.1f s: worker %d cap -> %s", elapsed, change.worker,
                            "none" if change.cap is None else f"{change.cap:g} CPUs")
            run.preempt(now)
            run.enforce_grace(now)
            run.restart(now)
            stop.wait(_POLL_S)
    finally:
        reservation.release()
        stopped = {id(t) for t in run.tasks if t.running}
        caps.release()
        stop_groups([p for t in run.tasks for p in t.procs], grace)
        for t in run.pumps:
            t.join(timeout=2.0)
            if t.is_alive():
                logger.warning("Output of %s still open (a process outside the task's "
                               "process group holds it).", t.name)
        if events is not None:
            events.extend(run.events)
    exits = {id(t): t.exit(id(t) in stopped) for t in run.tasks if t.procs}

    def of(role):
        return [exits[id(t)] for t in run.tasks if t.spec.role == role and id(t) in exits]

    chief = of("chief")
    return AttemptOutcome(outcome, of("worker"), exits[id(failed)] if failed else None,
                          chief[0] if chief else None, of("ps"), run.lost)
