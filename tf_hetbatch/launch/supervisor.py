"""One attempt of a local cluster: start the workers, relay their output, watch, stop.

Each worker runs in its own session and process group, so that stopping it stops whatever
it started too. Exits are observed with ``waitid(..., WNOWAIT)`` and the workers are reaped
only after their whole process groups are gone, so a process-group id is never reused while
the launcher may still signal it. Every wait has a timeout.

Pure Python stdlib: no TensorFlow.
"""

import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from typing import IO, Dict, List, Mapping, Optional, Sequence

from tf_hetbatch.launch import cluster
from tf_hetbatch.launch.cpu_caps import CpuCaps
from tf_hetbatch.launch.schedule import Cap, CapChange

logger = logging.getLogger(__name__)

_POLL_S = 0.05
_KILL_WAIT_S = 5.0


def signal_name(signum: int) -> str:
    """``9 -> "SIGKILL"``; unknown numbers as ``"signal 42"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclasses.dataclass(frozen=True)
class WorkerExit:
    """How one worker ended.

    Attributes:
        index: worker index.
        returncode: exit code, or minus the signal number if a signal killed it
            (as ``subprocess.Popen.returncode``); None if it could not be reaped.
        stopped_by_launcher: the worker was still running when the launcher stopped the
            cluster (because another worker failed, a timeout, or an interrupt).
    """

    index: int
    returncode: Optional[int]
    stopped_by_launcher: bool = False

    @property
    def ok(self) -> bool:
        """True if the worker exited with code 0 by itself."""
        return self.returncode == 0 and not self.stopped_by_launcher

    def describe(self) -> str:
        """E.g. ``"exit code 3"`` or ``"killed by signal SIGKILL"``."""
        if self.returncode is None:
            how = "unknown exit status"
        elif self.returncode < 0:
            how = f"killed by signal {signal_name(-self.returncode)}"
        else:
            how = f"exit code {self.returncode}"
        return how + (" (stopped by the launcher)" if self.stopped_by_launcher else "")


@dataclasses.dataclass(frozen=True)
class AttemptOutcome:
    """Result of one attempt: ``reason`` is "ok", "failed", "timeout" or "interrupted"."""

    reason: str
    workers: List[WorkerExit]
    failed: Optional[WorkerExit] = None


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
            logger.warning("Worker pid %d could not be reaped.", p.pid)


def run_attempt(command: Sequence[str], num_workers: int, attempt: int, caps: CpuCaps,
                initial_caps: Sequence[Cap], schedule: Sequence[CapChange],
                base_env: Mapping[str, str], threads: Optional[int],
                extra_env: Optional[Mapping[str, str]], stdout: IO[str], stderr: IO[str],
                grace: float, deadline: Optional[float],
                stop: threading.Event) -> AttemptOutcome:
    """Runs the cluster once; returns when all workers exited, one failed, the
    ``deadline`` (``time.monotonic()`` value) passed, or ``stop`` was set.

    Arguments are assumed valid (see :func:`tf_hetbatch.launch.launch`).
    """
    reservation = cluster.PortReservation(num_workers)
    ports = reservation.ports
    logger.info("Attempt %d: %d workers on %s", attempt, num_workers,
                ", ".join(f"{cluster.HOST}:{p}" for p in ports))
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    exits: Dict[int, int] = {}
    lock = threading.Lock()
    outcome = "ok"
    failed: Optional[WorkerExit] = None
    running_at_stop: set = set()
    try:
        for i, cap in enumerate(initial_caps):
            caps.set_cap(i, cap)
        reservation.release()  # Just before spawning, so that the workers can bind them.
        for i in range(num_workers):
            env = cluster.worker_env(base_env, ports, i, attempt, threads, extra_env)
            proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
            procs.append(proc)
            caps.attach(i, proc.pid)
            for pipe, stream in ((proc.stdout, stdout), (proc.stderr, stderr)):
                t = threading.Thread(target=_pump, args=(pipe, f"[worker {i}] ", stream, lock),
                                     name=f"tf_hetbatch-worker{i}-output", daemon=True)
                t.start()
                pumps.append(t)
        start = time.monotonic()
        pending = list(schedule)
        while True:
            for i, proc in enumerate(procs):
                if i not in exits:
                    code = _exit_status(proc.pid)
                    if code is not None:
                        exits[i] = code
                        logger.info("Worker %d exited: %s", i, WorkerExit(i, code).describe())
                        if code != 0 and failed is None:
                            failed = WorkerExit(i, code)
            if failed is not None:
                outcome = "failed"
                break
            if len(exits) == num_workers:
                break
            if stop.is_set():
                outcome = "interrupted"
                break
            if deadline is not None and time.monotonic() >= deadline:
                outcome = "timeout"
                break
            elapsed = time.monotonic() - start
            while pending and pending[0].seconds <= elapsed:
                change = pending.pop(0)
                caps.set_cap(change.worker, change.cap)
                logger.info("t=%.1f s: worker %d cap -> %s", elapsed, change.worker,
                            "none" if change.cap is None else f"{change.cap:g} CPUs")
            stop.wait(_POLL_S)
    finally:
        reservation.release()
        running_at_stop = {i for i in range(len(procs)) if i not in exits}
        caps.release()
        stop_groups(procs, grace)
        for t in pumps:
            t.join(timeout=2.0)
            if t.is_alive():
                logger.warning("Output of %s still open (a process outside the worker's "
                               "process group holds it).", t.name)
    workers = [WorkerExit(i, p.returncode if i not in exits else exits[i],
                          i in running_at_stop) for i, p in enumerate(procs)]
    return AttemptOutcome(outcome, workers, failed)
