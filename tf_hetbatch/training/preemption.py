"""Preemption notices: every worker saves at one agreed step, then exits to be restarted.

Transient servers (spot / preemptible VMs, evicted pods) are taken away with a notice: SIGTERM,
then SIGKILL some seconds later (Kubernetes, GCE, EC2). A `PreemptionNotice` turns the
SIGTERM of any worker, or `request()` from code, into one step at which every worker of the
job saves and exits with `RESTART_EXIT_CODE`, so a relaunch redoes no step.

The agreement is TensorFlow's own (the protocol of
`tf.distribute.experimental.PreemptionCheckpointHandler`, on the coordination service that
`MultiWorkerMirroredStrategy` runs): the worker that got the notice, at its next step
boundary S, inserts "save at step S + 1" into the coordination service's key-value store and
waits until every worker has acknowledged it; every worker watches that key in a thread and
acknowledges it. Synchronous workers are never more than one step apart (every step has an
all-reduce), and the announcing worker starts step S + 1 only after all acknowledged, so no
worker can have passed S + 1: all save at the first step boundary at or after it (with
`steps_per_execution > 1`, the end of the execution that contains it). The cost in steady
state is nothing per step (a blocking read of the key, in a thread); the notice costs at most
the step in flight, one more step and a round trip to the coordination service. In one
process (one host, or the chief of asynchronous training) no agreement is needed: the save
happens at the next step boundary.

This module does not import TensorFlow (only when a multi-worker notice is watched), so the
launcher can read `RESTART_EXIT_CODE` from it.
"""

import logging
import signal
import threading
import time
from typing import Any, Callable, List, Optional

logger = logging.getLogger(__name__)

__all__ = ["RESTART_EXIT_CODE", "PreemptionNotice"]

# The exit code of a process that saved on a preemption notice and wants to be started again
# (TensorFlow's PreemptionCheckpointHandler exits with 42 by default, too). The launcher
# restarts the cluster on it without counting a failure; a cluster tool can do the same
# (e.g. a Kubernetes Job's podFailurePolicy rule `onExitCodes: {operator: In, values: [42]}`
# with `action: Ignore`).
RESTART_EXIT_CODE = 42

# How long the worker that got the notice waits for every worker to acknowledge the agreed
# step. A worker that does not answer in time is dead or hung: the others save anyway.
ACK_TIMEOUT_S = 30.0
# The watcher thread's read of the notice key returns this often to check whether it should
# stop (the end of `fit`); a read costs one request to the coordination service.
WATCH_POLL_S = 0.5

_COORDINATED_JOBS = ("chief", "worker")  # the jobs MultiWorkerMirroredStrategy coordinates


class PreemptionNotice:
    """A notice to stop soon, agreed on a step by every worker; for callbacks and trainers.

    Use: `start()` when training starts (installs a SIGTERM handler in the main thread, and in
    multi-worker training starts the watcher thread); at every step boundary, with the global
    step (the same on every worker), `due(step)` says whether this is the step to save at;
    after saving, exit with `RESTART_EXIT_CODE`; `close()` when training ends (restores the
    previous SIGTERM handler, stops the thread). `request()` gives the notice from code.

    While started, a SIGTERM does not end the process: it only asks for the save (unless the
    training it was started for is over: `start(alive=...)`). Before
    `start` the process's own handler is in force; note that in a multi-worker process
    TensorFlow's coordination service installs a C++ SIGTERM handler that does not end the
    process either, while Python still reports the default handler. `close` puts back the
    handler Python reported, so after it a SIGTERM ends the process (the default) unless the
    program had installed a handler of its own.

    Args:
        cluster_resolver: the strategy's `cluster_resolver`, or None. With a cluster of two or
            more chief/worker tasks and no parameter servers, the step is agreed through the
            coordination service; otherwise the notice is local to this process.
        key: a name of this notice, the same on every worker and unique in the job (e.g. per
            `fit`), for the coordination service's key-value store.
    """

    def __init__(self, cluster_resolver=None, key: str = "tf_hetbatch/preemption"):
        self._tasks: List[str] = []
        self._me: Optional[str] = None
        task = _task_name(cluster_resolver)
        if task is not None:
            spec = cluster_resolver.cluster_spec()
            tasks = [f"{job}:{i}" for job in _COORDINATED_JOBS if job in spec.jobs
                     for i in spec.task_indices(job)]
            if len(tasks) > 1 and "ps" not in spec.jobs and task in tasks:
                self._tasks, self._me = tasks, task
        self._key = key
        self._requested = threading.Event()
        self._how = "request()"
        self._noticed_at: Optional[float] = None
        self._target: Optional[int] = None
        self._lock = threading.Lock()
        self._announced = False
        self._warned = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._old_handler = None
        self._installed = False
        self._alive: Optional[Callable[[Any], bool]] = None

    # ------------------------------------------------------------------ public ------------
    @property
    def multi_worker(self) -> bool:
        """Whether the step is agreed with other workers (else the notice is local)."""
        return bool(self._tasks)

    @property
    def requested(self) -> bool:
        """Whether this process got a notice (SIGTERM or `request()`)."""
        return self._requested.is_set()

    @property
    def agreed_step(self) -> Optional[int]:
        """The step every worker saves at, once agreed (here or by another worker); or None."""
        with self._lock:
            return self._target

    @property
    def seconds_since_notice(self) -> Optional[float]:
        """Seconds since this process got its notice, or None."""
        return None if self._noticed_at is None else time.monotonic() - self._noticed_at

    def request(self) -> None:
        """Gives the notice: every worker saves at a step soon and exits (as on SIGTERM).

        Safe from any thread and from a signal handler.
        """
        if self._noticed_at is None:
            self._noticed_at = time.monotonic()
        self._requested.set()

    def start(self, alive: Optional[Callable[[Any], bool]] = None) -> None:
        """Installs the SIGTERM handler (main thread only) and starts watching for notices.

        Args:
            alive: given the main thread's frame when a SIGTERM arrives, whether the training
                that started the notice still runs. If not (it raised, so nothing closed the
                notice), the notice closes and the signal goes to the previous handler: a
                process that caught the error still ends on SIGTERM.
        """
        self._alive = alive
        self._stop.clear()
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        else:
            logger.info("Not in the main thread: a SIGTERM cannot be caught here; request() "
                        "still gives a preemption notice.")
        if self._tasks and self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="tf_hetbatch-preemption-watcher")
            self._thread.start()

    def close(self) -> None:
        """Restores the previous SIGTERM handler and stops the watcher thread."""
        self._restore_handler()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=WATCH_POLL_S + 5.0)
            self._thread = None

    def due(self, step: int) -> bool:
        """Whether to save now: call at every step boundary with the global step trained.

        At the first boundary after this process's notice it agrees the step with the other
        workers (blocking for at most `ACK_TIMEOUT_S` while they acknowledge).
        """
        if self._requested.is_set() and not self._announced:
            self._announced = True
            self._announce(int(step))
        with self._lock:
            target = self._target
        if target is None:
            return False
        if step > target and not self._warned:  # the protocol rules it out; say so if seen
            self._warned = True
            logger.warning("Step %d is past the agreed preemption step %d; saving now.",
                           step, target)
        return step >= target

    # ------------------------------------------------------------------ internals ---------
    def _restore_handler(self) -> None:
        if self._installed:
            # None: the previous handler was not installed from Python; the default then.
            old = signal.SIG_DFL if self._old_handler is None else self._old_handler
            signal.signal(signal.SIGTERM, old)
            self._installed = False

    def _on_sigterm(self, signum, frame):
        if self._alive is not None and not self._alive(frame):
            self._restore_handler()
            self._stop.set()
            signal.raise_signal(signum)  # to the handler before ours (the default: exit)
            return
        self._how = "SIGTERM"
        self.request()

    def _announce(self, step: int) -> None:
        if not self._tasks:
            with self._lock:
                self._target = step if self._target is None else self._target
            logger.info("Preemption notice (%s): saving at step %d.", self._how, step)
            return
        import tensorflow as tf

        from tf_hetbatch.distribute import coordination

        target = step + 1
        try:
            inserted = coordination.insert_key(self._key, str(target))
        except tf.errors.OpError as error:  # the cluster is failing: no step can be agreed
            logger.warning("Preemption notice (%s) on %s at step %d, but the coordination "
                           "service is unreachable (%s); not saving.", self._how, self._me,
                           step, str(error).splitlines()[0][:200])
            return
        if not inserted:
            logger.info("Preemption notice (%s) on %s at step %d: another worker's notice "
                        "decides the step.", self._how, self._me, step)
            return
        with self._lock:
            self._target = target
        logger.info("Preemption notice (%s) on %s at step %d: every worker saves at step %d.",
                    self._how, self._me, step, target)
        deadline = time.monotonic() + ACK_TIMEOUT_S
        for task in self._tasks:
            if task == self._me:
                continue
            left = deadline - time.monotonic()
            try:
                acked = left > 0 and coordination.get_key(f"{self._key}/ack/{task}",
                                                       left) is not None
            except tf.errors.OpError:
                acked = False
            if not acked:
                logger.warning("%s did not acknowledge the preemption step %d within %.0f s; "
                               "saving without it.", task, target, ACK_TIMEOUT_S)
                return

    def _watch(self) -> None:
        import tensorflow as tf

        from tf_hetbatch.distribute import coordination

        while not self._stop.is_set():
            try:
                value = coordination.get_key(self._key, WATCH_POLL_S)
            except tf.errors.OpError as error:  # the service is gone: the job is ending
                logger.debug("Preemption watcher stops: %s", str(error).splitlines()[0])
                return
            if value is None:
                continue
            with self._lock:
                if self._target is None:
                    self._target = int(value)
            try:
                coordination.insert_key(f"{self._key}/ack/{self._me}", "1")
            except tf.errors.OpError as error:
                logger.debug("Could not acknowledge the preemption step: %s", error)
            return


def _task_name(resolver) -> Optional[str]:
    if resolver is None or not getattr(resolver, "task_type", None):
        return None
    try:
        if not resolver.cluster_spec().as_dict():
            return None
    except (AttributeError, ValueError):
        return None
    return f"{resolver.task_type}:{int(resolver.task_id or 0)}"
