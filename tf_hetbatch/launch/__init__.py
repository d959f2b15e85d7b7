"""Local cluster launcher: run a training script as N worker processes on 127.0.0.1.

Each worker gets ``TF_CONFIG`` for a loopback cluster, exactly as a cluster tool would set
it, so the same script runs unchanged on a real cluster. Optionally each worker is held to
a CPU cap (cgroup quota or SIGSTOP/SIGCONT duty cycle) to emulate slower machines, and the
caps can change on a schedule. If a worker fails, the others are stopped; with
``max_restarts`` the whole cluster is started again on new ports (scripts resume from their
own checkpoints; ``TF_HETBATCH_RESTART`` tells them the attempt number).

Pure Python stdlib: importing this package does not import TensorFlow.

Example:

    from tf_hetbatch.launch import launch
    result = launch(["train.py", "--steps", "10"], num_workers=2, cpus=[0.8, 0.2])
    assert result.ok, result.message
"""

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import IO, Mapping, Optional, Sequence, Tuple, Union

from tf_hetbatch.launch import cluster
from tf_hetbatch.launch.cpu_caps import CAP_METHODS, make_caps
from tf_hetbatch.launch.schedule import (Cap, CapChange, parse_cpus, parse_schedule,
                                         validate_cpus, validate_schedule)
from tf_hetbatch.launch.supervisor import WorkerExit, run_attempt, signal_name

logger = logging.getLogger(__name__)

__all__ = ["launch", "LaunchResult", "WorkerExit", "CapChange", "parse_cpus",
           "parse_schedule"]

TIMEOUT_EXIT_CODE = 124


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """Outcome of :func:`launch`.

    Attributes:
        returncode: 0 if every worker exited 0; else the failed worker's exit code,
            ``128 + signal`` if it died by a signal, 124 on timeout, ``128 + signal`` of the
            launcher's own SIGINT/SIGTERM when interrupted.
        message: one line saying what happened, naming the worker and why.
        attempts: how many times the cluster was started (1 + restarts used).
        workers: how each worker of the last attempt ended.
        failed_worker: index of the worker whose failure ended the last attempt, or None.
        cap_method: CPU-cap method in force: "none", "cgroup-v1", "cgroup-v2", "duty-cycle".
    """

    returncode: int
    message: str
    attempts: int
    workers: Tuple[WorkerExit, ...]
    failed_worker: Optional[int]
    cap_method: str

    @property
    def ok(self) -> bool:
        """True if every worker of the last attempt exited 0."""
        return self.returncode == 0


def _check_int(value, name: str, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}. "
                         f"Fix: {fix}")
    return value


def _check_seconds(value, name: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"`{name}` must be a number of seconds > 0 (or None). "
                         f"Received: {name}={value!r}")
    return float(value)


def launch(script_argv: Sequence[str], num_workers: int,
           cpus: Union[str, Sequence[Cap], None] = None,
           schedule: Union[str, Sequence[CapChange], None] = None,
           max_restarts: int = 0, cap_method: str = "auto",
           period_ms: Optional[float] = None, timeout: Optional[float] = None,
           threads: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
           python: Optional[str] = None, grace: float = 3.0,
           stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None,
           handle_signals: bool = True) -> LaunchResult:
    """Runs ``script_argv`` as ``num_workers`` worker processes on 127.0.0.1.

    Args:
        script_argv: ``[script, *args]``; a ``.py`` script runs under ``python``, any other
            executable directly.
        num_workers: number of worker processes, >= 1.
        cpus: CPU cap per worker (floats, None = uncapped), or text ``"0.2,none,0.9"``.
        schedule: cap changes mid-run: text ``"30:1=0.1;60:1=0.3"`` (seconds since the
            workers started: worker=cap) or a list of :class:`CapChange`. Restarts start
            the clock again.
        max_restarts: how often the whole cluster is started again (new ports) after a
            worker failed. Default 0.
        cap_method: "auto" (cgroup v1, v2, then duty cycle), "cgroup", "duty-cycle", "none".
        period_ms: cap period; default 10 ms for cgroups, 100 ms for the duty cycle.
        timeout: seconds for the whole launch, restarts included; then everything is
            stopped and the return code is 124. Default: none.
        threads: if set, TF_NUM_INTEROP_THREADS, TF_NUM_INTRAOP_THREADS, OMP_NUM_THREADS.
        env: extra environment variables for the workers (applied last).
        python: interpreter for ``.py`` scripts; default ``sys.executable``.
        grace: seconds between SIGTERM and SIGKILL when stopping workers. Default 3.
        stdout, stderr: where the ``[worker i] ``-prefixed lines go; default sys.stdout /
            sys.stderr at call time.
        handle_signals: in the main thread, turn SIGINT/SIGTERM of this process into a
            clean stop of the cluster (restored afterwards). Default True.

    Returns:
        A :class:`LaunchResult`; ``result.ok`` only if every worker exited 0.

    Raises:
        ValueError: bad argument (the message names the value and the fix).
        RuntimeError: ``cap_method="cgroup"`` but no writable cgroup hierarchy.
    """
    num_workers = _check_int(num_workers, "num_workers", 1, "pass e.g. num_workers=2.")
    command = cluster.resolve_command(script_argv, python)
    caps_list = validate_cpus(cpus, num_workers) or [None] * num_workers
    changes = validate_schedule(schedule, num_workers)
    max_restarts = _check_int(max_restarts, "max_restarts", 0, "pass 0 for no restarts.")
    if threads is not None:
        _check_int(threads, "threads", 1, "pass e.g. threads=1, or None for TF's default.")
    timeout = _check_seconds(timeout, "timeout")
    grace = _check_seconds(grace, "grace")
    if cap_method not in CAP_METHODS:
        raise ValueError(f"`cap_method` must be one of {CAP_METHODS}. "
                         f"Received: cap_method={cap_method!r}")
    wants_caps = any(c is not None for c in caps_list) or bool(changes)
    if cap_method == "none" and wants_caps:
        raise ValueError(f"cap_method='none' but CPU caps were given (cpus={caps_list}, "
                         f"{len(changes)} schedule changes). Fix: drop the caps or use "
                         f"cap_method='auto'.")
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr

    stop = threading.Event()
    received = []

    def on_signal(signum, _frame):
        received.append(signum)
        stop.set()

    old_handlers = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, on_signal)
    deadline = None if timeout is None else time.monotonic() + timeout
    base_env = dict(os.environ)
    try:
        with make_caps(cap_method, num_workers, period_ms, needed=wants_caps) as caps:
            if wants_caps:
                logger.info("CPU caps: %s; caps %s", caps.description, caps_list)
            attempt = 0
            while True:
                outcome = run_attempt(command, num_workers, attempt, caps, caps_list,
                                      changes, base_env, threads, env, stdout, stderr,
                                      grace, deadline, stop)
                if outcome.reason != "failed" or attempt >= max_restarts:
                    break
                attempt += 1
                logger.warning("Worker %d failed (%s); restarting the cluster "
                               "(restart %d of %d).", outcome.failed.index,
                               outcome.failed.describe(), attempt, max_restarts)
            return _result(outcome, attempt + 1, max_restarts, timeout, received,
                           caps.method)
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)


def _result(outcome, attempts: int, max_restarts: int, timeout: Optional[float],
            received, method: str) -> LaunchResult:
    """Builds the :class:`LaunchResult` of the last attempt."""
    of = f"attempt {attempts} of {max_restarts + 1}"
    failed = outcome.failed
    if outcome.reason == "ok":
        code, message = 0, f"all {len(outcome.workers)} workers exited 0 ({of})"
    elif outcome.reason == "failed":
        code = failed.returncode if failed.returncode > 0 else 128 - failed.returncode
        message = (f"worker {failed.index} failed: {failed.describe()}; stopped the other "
                   f"workers ({of}" + (", no restarts left)" if max_restarts else ")"))
    elif outcome.reason == "timeout":
        code = TIMEOUT_EXIT_CODE
        message = f"timed out after {timeout:g} s; stopped all workers ({of})"
    else:
        signum = received[0] if received else signal.SIGINT
        code = 128 + signum
        message = f"interrupted by {signal_name(signum)}; stopped all workers ({of})"
    return LaunchResult(code, message, attempts, tuple(outcome.workers),
                        failed.index if failed else None, method)
