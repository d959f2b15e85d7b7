"""Local cluster launcher: run a training script as a TF_CONFIG cluster on 127.0.0.1.

Each process gets ``TF_CONFIG`` for a loopback cluster, exactly as a cluster tool would set
it, so the same script runs unchanged on a real cluster. Two kinds of cluster:

* synchronous (default): N worker processes all run the script
  (MultiWorkerMirroredStrategy). If a worker fails, the others are stopped.
* asynchronous (``num_ps >= 1``): a chief runs the script, ``num_ps`` parameter servers and
  N workers run ``python -m tf_hetbatch.launch.server`` (ParameterServerStrategy). The chief's exit
  decides the outcome; a ps failure is fatal; a worker that dies is only logged, since the
  coordinator moves its work to the other workers.

Each worker task sees its own GPUs (``CUDA_VISIBLE_DEVICES``): by default one GPU each when
the machine has GPUs, or groups chosen with ``gpus="0,1|2,3"``; see
:mod:`tf_hetbatch.launch.gpus`. The launcher logs one line per worker, e.g.
``worker 1: GPUs 2,3``.

Optionally each worker is held to a CPU cap (cgroup quota or SIGSTOP/SIGCONT duty cycle) to
emulate slower machines, the caps can change on a schedule, and workers can be preempted
(SIGKILL, or a notice: SIGTERM, then SIGKILL after ``grace`` seconds; with parameter servers
started again later) to emulate transient servers. With ``max_restarts`` the whole cluster
is started again on new ports after a failure (scripts resume from their own checkpoints;
``TF_HETBATCH_RESTART`` tells them the attempt number). A task that exits with
``tf_hetbatch.RESTART_EXIT_CODE`` (42: it saved on a preemption notice) restarts the cluster
without counting as a failure.

Pure Python stdlib: importing this package does not import TensorFlow.

Example:

    from tf_hetbatch.launch import launch
    result = launch(["train.py", "--steps", "10"], num_workers=2, cpus=[0.8, 0.2])
    assert result.ok, result.message
    # Asynchronous: chief + 1 ps + 3 workers; worker 2 is preempted at 30 s, back at 40 s.
    result = launch(["train_ps.py"], num_workers=3, num_ps=1, preempt="30:2+10")
    # A notice to worker 1 at 20 s (SIGTERM; SIGKILL `grace` = 30 s later if it still runs):
    # the workers save and exit with RESTART_EXIT_CODE, and the cluster starts again.
    result = launch(["train.py"], num_workers=2, preempt="20:1/term")
    # Worker 0 on GPUs 0 and 1, worker 1 on GPU 2, worker 2 CPU-only:
    result = launch(["train.py"], num_workers=3, gpus="0,1|2|")
"""

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import IO, List, Mapping, Optional, Sequence, Tuple, Union

from tf_hetbatch.core._validate import check_int
from tf_hetbatch.training.preemption import RESTART_EXIT_CODE
from tf_hetbatch.launch import cluster
from tf_hetbatch.launch.cpu_caps import CAP_METHODS, make_caps
from tf_hetbatch.launch.gpus import GpuPlan, GpuSetting, assign_gpus, visible_gpus
from tf_hetbatch.launch.schedule import (Cap, CapChange, Preemption, parse_cpus,
                                         parse_preemptions, parse_schedule, validate_cpus,
                                         validate_preemptions, validate_schedule)
from tf_hetbatch.launch.supervisor import (DEFAULT_GRACE_S, PreemptionPlan, TaskSpec,
                                           WorkerExit, run_attempt, signal_name)

logger = logging.getLogger(__name__)

__all__ = ["launch", "LaunchResult", "WorkerExit", "CapChange", "Preemption", "parse_cpus",
           "parse_schedule", "parse_preemptions", "RESTART_EXIT_CODE"]

TIMEOUT_EXIT_CODE = 124
# With parameter servers, worker tasks get at least this many inter-op threads: with one,
# the first function the coordinator schedules on a worker deadlocks (TF 2.21, measured).
WORKER_MIN_INTEROP_THREADS = 2


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """Outcome of :func:`launch`.

    Attributes:
        returncode: 0 on success (every worker exited 0; with parameter servers: the chief
            exited 0); else the failed task's exit code (1 for a ps that exited 0 before the
            chief), ``128 + signal`` if it died by a signal, 124 on timeout, ``128 + signal``
            of the launcher's own SIGINT/SIGTERM when interrupted.
        message: one line saying what happened, naming the task and why.
        attempts: how many times the cluster was started (1 + restarts after failures +
            restarts after a task exited with ``RESTART_EXIT_CODE``).
        workers: how each worker of the last attempt ended (by worker index).
        failed_worker: index of the worker whose failure ended the last attempt, or None
            (always None with parameter servers, where worker failures are not fatal; see
            ``failed_task``).
        cap_method: CPU-cap method in force: "none", "cgroup-v1", "cgroup-v2", "duty-cycle".
        chief: how the chief ended (parameter-server mode only, else None).
        ps: how each parameter server ended (parameter-server mode only, else empty).
        failed_task: the task (any role; see :attr:`WorkerExit.role`) whose failure ended
            the last attempt, or None.
        events: preemptions, worker restarts and tolerated worker exits of all attempts, in
            order, e.g. ``"attempt 1, t=30.0 s: preempted worker 1 (...)"``.
    """

    returncode: int
    message: str
    attempts: int
    workers: Tuple[WorkerExit, ...]
    failed_worker: Optional[int]
    cap_method: str
    chief: Optional[WorkerExit] = None
    ps: Tuple[WorkerExit, ...] = ()
    failed_task: Optional[WorkerExit] = None
    events: Tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True if the job succeeded: every worker exited 0 (with parameter servers: the
        chief exited 0)."""
        return self.returncode == 0

    @property
    def tasks(self) -> Tuple[WorkerExit, ...]:
        """All tasks of the last attempt: chief, ps, then workers."""
        return ((self.chief,) if self.chief else ()) + self.ps + self.workers


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
           python: Optional[str] = None, grace: float = DEFAULT_GRACE_S,
           stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None,
           handle_signals: bool = True, num_ps: int = 0,
           preempt: Union[str, Sequence[Preemption], None] = None,
           server_command: Optional[Sequence[str]] = None,
           gpus: GpuSetting = None) -> LaunchResult:
    """Runs ``script_argv`` as a TF_CONFIG cluster on 127.0.0.1.

    With ``num_ps=0`` the script runs as ``num_workers`` worker processes (a
    MultiWorkerMirroredStrategy cluster); with ``num_ps >= 1`` the cluster is one chief (the
    script), ``num_ps`` parameter servers and ``num_workers`` workers (``server_command``).

    Args:
        script_argv: ``[script, *args]``; a ``.py`` script runs under ``python``.
        num_workers: worker processes, >= 1.
        cpus: CPU cap per worker (floats, None = uncapped), or text ``"0.2,none,0.9"``; the
            chief and parameter servers are never capped.
        schedule: cap changes mid-run, ``"30:1=0.1;60:1=0.3"`` (seconds since the workers
            started: worker=cap) or :class:`CapChange` s; restarts start the clock again.
        max_restarts: restarts of the whole cluster (new ports) after a fatal failure.
            Default 0. An attempt ended by a task exiting with ``RESTART_EXIT_CODE`` (a save
            on a preemption notice) always restarts and is not counted (as a Kubernetes
            podFailurePolicy ``Ignore`` rule); the others get
            ``supervisor.RESTART_EXIT_WAIT_S`` seconds to exit first.
        cap_method: "auto" (cgroup v1, v2, then duty cycle), "cgroup", "duty-cycle", "none".
        period_ms: cap period; default 10 ms for cgroups, 100 ms for the duty cycle.
        timeout: seconds for the whole launch, restarts included; then everything stops
            and the return code is 124. Default: none.
        threads: TF_NUM_INTEROP_THREADS, TF_NUM_INTRAOP_THREADS, OMP_NUM_THREADS of every
            task (parameter-server workers get at least 2 inter-op threads: with 1 they
            deadlock).
        env: extra environment variables for every task (applied last).
        python: interpreter for ``.py`` scripts and the default server (``sys.executable``).
        grace: seconds from SIGTERM to SIGKILL when stopping tasks and after a notice
            (``/term``). Default 30 (``supervisor.DEFAULT_GRACE_S``): a worker's save and exit
            on a notice took up to 7.5 s here; 30 s is Kubernetes' default
            ``terminationGracePeriodSeconds``. Tasks that exit sooner are not waited for.
        stdout, stderr: where the ``[worker i] ``-prefixed lines go (default the
            current ``sys.stdout`` / ``sys.stderr``).
        handle_signals: in the main thread, SIGINT/SIGTERM of this process stop the cluster
            cleanly (handlers restored afterwards). Default True.
        num_ps: parameter servers; 0 (default) for a worker-only cluster.
        preempt: preemptions, ``"30:1+10;60:0/term"`` (at 30 s SIGKILL worker 1 and start
            it again 10 s later; at 60 s a notice to worker 0: SIGTERM, then SIGKILL after
            ``grace``) or :class:`Preemption` s; times from the first start, each once per
            launch. Without parameter servers a preemption is a worker failure
            (``max_restarts`` applies; no ``+D``). A restarted worker keeps its cap.
        server_command: the ps and worker tasks' command (default
            ``[python, "-m", "tf_hetbatch.launch.server"]``); only with ``num_ps >= 1``.
        gpus: each worker's GPUs, as ``CUDA_VISIBLE_DEVICES`` of its process. Default None
            ("auto"): one GPU per worker when the launcher sees GPUs (its own
            ``CUDA_VISIBLE_DEVICES`` list, else ``nvidia-smi -L``), workers beyond the GPU
            count CPU-only (with a warning); no GPU seen: the environment is left alone.
            ``"0,1|2,3"`` or ``[[0, 1], [2, 3]]``: one group per worker of positions in that
            list, an empty group (``"0|1|"``) or ``none`` for a CPU-only worker; ``"none"``:
            all CPU-only; ``"all"``: the environment is left alone. With parameter servers
            the groups are the worker tasks'; chief and ps get ``CUDA_VISIBLE_DEVICES=""``
            whenever GPUs are assigned. Checked before any process starts; see
            :mod:`tf_hetbatch.launch.gpus`.

    Returns:
        A :class:`LaunchResult`; ``result.ok`` only if every worker exited 0 (with
        parameter servers: the chief exited 0).

    Raises:
        ValueError: bad argument (the message names the value and the fix).
        RuntimeError: ``cap_method="cgroup"`` but no writable cgroup hierarchy.
        TypeError: ``gpus`` of the wrong type.
    """
    run = _LaunchRun.validated(
        script_argv, num_workers, num_ps, cpus, schedule, preempt, server_command, python,
        max_restarts, cap_method, period_ms, timeout, threads, env, grace, stdout, stderr,
        gpus)
    stop, received = threading.Event(), []
    with _stopped_by_signals(handle_signals, stop, received):
        return run.attempts(stop, received)


@contextlib.contextmanager
def _stopped_by_signals(handle_signals, stop, received):
    """In the main thread (if `handle_signals`): SIGINT/SIGTERM set `stop` (recorded in
    `received`) instead of ending the process; the old handlers come back afterwards."""

    def on_signal(signum, _frame):
        received.append(signum)
        stop.set()

    old_handlers = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old_handlers[sig] = signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)


@dataclasses.dataclass
class _LaunchRun:
    """One launch's validated settings (see `launch`), and its attempts."""

    command: List[str]
    num_workers: int
    num_ps: int
    caps_list: List[Optional[Cap]]
    changes: List[CapChange]
    plan: PreemptionPlan
    servers: List[str]
    max_restarts: int
    cap_method: str
    period_ms: Optional[float]
    timeout: Optional[float]
    threads: Optional[int]
    env: Optional[Mapping[str, str]]
    grace: float
    stdout: IO[str]
    stderr: IO[str]
    gpu_plan: GpuPlan

    @classmethod
    def validated(cls, script_argv, num_workers, num_ps, cpus, schedule, preempt,
                  server_command, python, max_restarts, cap_method, period_ms, timeout,
                  threads, env, grace, stdout, stderr, gpus=None) -> "_LaunchRun":
        """`launch`'s arguments checked (the messages name the value and the fix)."""
        num_workers = check_int("num_workers", num_workers, 1, "pass e.g. num_workers=2.")
        num_ps = check_int("num_ps", num_ps, 0, "pass 0 for a worker-only "
                           "(MultiWorkerMirroredStrategy) cluster, or e.g. num_ps=1 for a "
                           "chief + parameter server + workers (ParameterServerStrategy).")
        if threads is not None:
            check_int("threads", threads, 1, "pass e.g. threads=1, or None for TF's default.")
        if cap_method not in CAP_METHODS:
            raise ValueError(f"`cap_method` must be one of {CAP_METHODS}. "
                             f"Received: cap_method={cap_method!r}")
        run = cls(
            command=cluster.resolve_command(script_argv, python), num_workers=num_workers,
            num_ps=num_ps, caps_list=validate_cpus(cpus, num_workers) or [None] * num_workers,
            changes=validate_schedule(schedule, num_workers),
            plan=PreemptionPlan(validate_preemptions(preempt, num_workers, num_ps)),
            servers=_server_command(server_command, num_ps, python),
            max_restarts=check_int("max_restarts", max_restarts, 0, "pass 0 for no restarts."),
            cap_method=cap_method, period_ms=period_ms,
            timeout=_check_seconds(timeout, "timeout"), threads=threads, env=env,
            grace=_check_seconds(grace, "grace"), stdout=stdout or sys.stdout,
            stderr=stderr or sys.stderr,
            gpu_plan=assign_gpus(gpus, num_workers, lambda: visible_gpus(os.environ),
                                 env_sets_cuda=bool(env) and cluster.CUDA_ENV in env))
        if cap_method == "none" and run.wants_caps:
            raise ValueError(f"cap_method='none' but CPU caps were given (cpus="
                             f"{run.caps_list}, {len(run.changes)} schedule changes). Fix: "
                             "drop the caps or use cap_method='auto'.")
        return run

    @property
    def wants_caps(self) -> bool:
        return any(c is not None for c in self.caps_list) or bool(self.changes)

    def attempts(self, stop, received) -> LaunchResult:
        """Starts the cluster until an attempt ends other than by a failure to restart."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        base_env = dict(os.environ)
        events: List[str] = []
        num_tasks = self.num_workers if not self.num_ps else 1 + self.num_ps + self.num_workers
        if self.num_ps and self.threads is not None \
                and self.threads < WORKER_MIN_INTEROP_THREADS:
            logger.info("threads=%d, but worker tasks of a parameter-server cluster get "
                        "TF_NUM_INTEROP_THREADS=%d (with 1 they deadlock).", self.threads,
                        WORKER_MIN_INTEROP_THREADS)
        with make_caps(self.cap_method, self.num_workers, self.period_ms,
                       needed=self.wants_caps) as caps:
            if self.wants_caps:
                logger.info("CPU caps: %s; caps %s", caps.description, self.caps_list)
            for line in self.gpu_plan.lines(self.num_ps > 0):
                logger.info("%s", line)
            attempt = failures = 0
            while True:
                reservation = cluster.PortReservation(num_tasks)
                try:
                    tasks = _tasks(reservation.ports, self.num_ps, self.num_workers, attempt,
                                   self.command, self.servers, base_env, self.threads,
                                   self.env, self.gpu_plan)
                    logger.info("Attempt %d: %s", attempt, ", ".join(
                        f"{t.name} at {cluster.HOST}:{p}"
                        for t, p in zip(tasks, reservation.ports)))
                    outcome = run_attempt(tasks, reservation, self.num_ps > 0, attempt, caps,
                                          self.caps_list, self.changes, self.plan,
                                          self.stdout, self.stderr, self.grace, deadline,
                                          stop, events)
                finally:
                    reservation.release()
                if outcome.reason == "restart":
                    attempt += 1
                    logger.info("A task saved on a preemption notice and exited with %d; "
                                "restarting the cluster (not counted in max_restarts).",
                                RESTART_EXIT_CODE)
                    continue
                if outcome.reason != "failed" or failures >= self.max_restarts:
                    break
                attempt += 1
                failures += 1
                logger.warning("%s failed (%s); restarting the cluster (restart %d of %d).",
                               outcome.failed.name, outcome.failed.describe(), failures,
                               self.max_restarts)
            return _result(outcome, attempt + 1, self.max_restarts, self.timeout, received,
                           caps.method, events, failures)


def _server_command(command: Optional[Sequence[str]], num_ps: int,
                    python: Optional[str]) -> List[str]:
    """Validates ``server_command`` (see :func:`launch`) and returns the one to run."""
    if command is None:
        return cluster.server_command(python)
    if not num_ps:
        raise ValueError(f"`server_command` runs the ps and worker tasks of a parameter-server "
                         f"cluster, but num_ps=0. Received: server_command={command!r}. "
                         f"Fix: pass num_ps >= 1, or drop server_command.")
    if isinstance(command, str) or not command or not all(
            isinstance(a, str) for a in command):
        raise ValueError(f"`server_command` must be a non-empty list of strings, e.g. "
                         f"[sys.executable, '-m', 'tf_hetbatch.launch.server']. "
                         f"Received: server_command={command!r}")
    return list(command)


def _tasks(ports: Sequence[int], num_ps: int, num_workers: int, attempt: int,
           command: Sequence[str], servers: Sequence[str], base_env: Mapping[str, str],
           threads: Optional[int], extra: Optional[Mapping[str, str]],
           gpu_plan: GpuPlan) -> List[TaskSpec]:
    """The tasks of one attempt, in start order; task ``k`` listens on ``ports[k]``."""
    if not num_ps:
        return [TaskSpec("worker", i, tuple(command),
                         cluster.worker_env(base_env, ports, i, attempt, threads, extra,
                                            gpu_plan.env_value("worker", i)), i)
                for i in range(num_workers)]
    spec = cluster.ps_cluster(ports, num_ps)
    tasks = []
    for role, count, argv in (("chief", 1, command), ("ps", num_ps, servers),
                              ("worker", num_workers, servers)):
        # A ParameterServerStrategy worker with one inter-op thread deadlocks in the first
        # scheduled function (it blocks that thread on reads from the ps).
        min_interop = WORKER_MIN_INTEROP_THREADS if role == "worker" else 1
        for i in range(count):
            config = cluster.task_tf_config(spec, role, i)
            env = cluster.task_env(base_env, config, attempt, threads, extra, min_interop,
                                   gpu_plan.env_value(role, i))
            tasks.append(TaskSpec(role, i, tuple(argv), env, i if role == "worker" else None))
    return tasks


def _result(outcome, attempts: int, max_restarts: int, timeout: Optional[float],
            received, method: str, events: Sequence[str] = (),
            failures: Optional[int] = None) -> LaunchResult:
    """Builds the :class:`LaunchResult` of the last attempt."""
    failures = attempts - 1 if failures is None else failures
    notices = attempts - 1 - failures
    of = f"attempt {attempts} of {max_restarts + 1 + notices}"
    if notices:
        of += f"; {notices} restart{'s' if notices > 1 else ''} after preemption notices"
    failed = outcome.failed
    ps_mode = outcome.chief is not None
    everyone = "all tasks" if ps_mode else "all workers"
    if outcome.reason == "ok":
        code = 0
        if ps_mode:
            lost = (f"; tolerated {outcome.lost} worker exit"
                    f"{'' if outcome.lost == 1 else 's'} on the way" if outcome.lost else "")
            message = (f"chief exited 0; stopped {len(outcome.ps)} ps and "
                       f"{len(outcome.workers)} worker tasks{lost} ({of})")
        else:
            message = f"all {len(outcome.workers)} workers exited 0 ({of})"
    elif outcome.reason == "failed":
        if failed.returncode == 0:  # A ps that exited 0 while the chief was running.
            code = 1
        else:
            code = failed.returncode if failed.returncode > 0 else 128 - failed.returncode
        others = ("the other tasks" if ps_mode and failed.role != "chief"
                  else "the ps and worker tasks" if ps_mode else "the other workers")
        early = " before the chief finished" if failed.role == "ps" else ""
        message = (f"{failed.name} failed{early}: {failed.describe()}; stopped {others} "
                   f"({of}" + (", no restarts left)" if max_restarts else ")"))
    elif outcome.reason == "timeout":
        code = TIMEOUT_EXIT_CODE
        message = f"timed out after {timeout:g} s; stopped {everyone} ({of})"
    else:
        signum = received[0] if received else signal.SIGINT
        code = 128 + signum
        message = f"interrupted by {signal_name(signum)}; stopped {everyone} ({of})"
    return LaunchResult(code, message, attempts, tuple(outcome.workers),
                        failed.index if failed and failed.role == "worker" else None, method,
                        outcome.chief, tuple(outcome.ps), failed, tuple(events))
