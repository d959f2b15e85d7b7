"""The tasks of a multi-worker job end together, so that a successful run ends quietly.

`tf.distribute.MultiWorkerMirroredStrategy` enables TensorFlow's coordination service. It runs
in the process of its leader task (the chief, else worker 0), and every task sends it
heartbeats. When the processes simply exit, one at a time, a run in which every task exited
0 can still end with an error line (tensorflow/tensorflow#58434):

- a task that outlives the leader by a heartbeat logs
  `E... base_collective_executor.cc:252] BaseCollectiveExecutor::StartAbort UNAVAILABLE:
  Failed to send RPC to coordination service ... Connection refused`;
- a leader that outlives another task by the heartbeat timeout logs `StartAbort
  UNAVAILABLE: ... The following tasks are unhealthy (stopped sending heartbeats)`.

So at the exit of a process that created a `HeteroMultiWorkerMirroredStrategy` (an `atexit`
hook, registered once per process, run after the hooks registered later, e.g. the script's):

1. every task waits at a barrier of the coordination service until all tasks have reached
   their exit (at most `EXIT_BARRIER_TIMEOUT_S`);
2. the leader then waits until the other tasks' processes are gone (their servers refuse
   connections; at most `PEER_EXIT_TIMEOUT_S`), so the service outlives every heartbeat. This
   is what TensorFlow's own exit does for TPU workers: the coordinator stays until the workers
   are down (`failure_handling_util.default_tpu_exit_fn`).

A process ending on an uncaught exception skips both, so a failure is never delayed. Neither
step raises: if a step fails (a task died, a timeout), the process exits as it would have
without this module (and the line may appear). A process ending with `sys.exit(code)` looks
like a clean exit here, so it waits at the barrier like one.
"""

import atexit
import logging
import socket
import sys
import time
from typing import List, Sequence, Tuple

logger = logging.getLogger(__name__)

# How long a task waits at exit for the others to reach theirs (e.g. while the chief saves a
# model). Past it, the task exits anyway.
EXIT_BARRIER_TIMEOUT_S = 120.0
# How long the leader waits at exit for the other tasks' processes to be gone (TensorFlow's
# and gRPC's teardown takes 1.5-3 s, see tf_hetbatch/server.py).
PEER_EXIT_TIMEOUT_S = 30.0
_BARRIER_ID = "tf_hetbatch/exit"
_POLL_S = 0.05
_CONNECT_TIMEOUT_S = 1.0
_COORDINATED_JOBS = ("chief", "worker")  # the jobs MultiWorkerMirroredStrategy coordinates

_registered = []  # the one registration of this process, if any (a process has one cluster)


def register_exit_together(cluster_resolver) -> bool:
    """Makes this process, at its exit, end together with the other tasks of its cluster.

    Call it once the strategy enabled the cluster's collectives (the end of its `__init__`).
    Later calls in the same process do nothing.

    Args:
        cluster_resolver: the strategy's `cluster_resolver`.

    Returns:
        True if the exit hook is registered (now or before); False when there is nothing to
        coordinate (no cluster, a single task, or a cluster with parameter servers).
    """
    if _registered:
        return True
    task = _task_of(cluster_resolver)
    if task is None:
        return False
    tasks = _coordinated_tasks(cluster_resolver.cluster_spec())
    if task not in tasks or len(tasks) < 2 or "ps" in cluster_resolver.cluster_spec().jobs:
        return False
    leader = ("chief", 0) if any(job == "chief" for job, _, _ in tasks) else ("worker", 0)
    peers = [address for job, index, address in tasks
             if (job, index) != task[:2]] if task[:2] == leader else []
    atexit.register(_exit_together, peers)
    _registered.append(task[:2])
    logger.debug("%s:%d ends together with the other %d tasks at exit.", task[0], task[1],
                 len(tasks) - 1)
    return True


def _task_of(resolver):
    if resolver is None or not getattr(resolver, "task_type", None):
        return None
    spec = resolver.cluster_spec()
    if not spec.as_dict():
        return None
    index = int(resolver.task_id or 0)
    try:
        return (resolver.task_type, index, spec.task_address(resolver.task_type, index))
    except (KeyError, ValueError):
        return None


def _coordinated_tasks(spec) -> List[Tuple[str, int, str]]:
    return [(job, index, spec.task_address(job, index))
            for job in _COORDINATED_JOBS if job in spec.jobs
            for index in spec.task_indices(job)]


def _ending_on_an_exception() -> bool:
    return (getattr(sys, "last_exc", None) is not None
            or getattr(sys, "last_value", None) is not None)


def _exit_together(peers: Sequence[str]) -> None:
    """The atexit hook: the barrier, then (on the leader, `peers` not empty) the wait."""
    if _ending_on_an_exception():
        logger.debug("Exiting on an exception: not waiting for the other tasks.")
        return
    from tf_hetbatch.distribute._upstream import coordination

    start = time.monotonic()
    try:
        coordination.wait_at_coordination_barrier(_BARRIER_ID, EXIT_BARRIER_TIMEOUT_S)
    except Exception as error:  # a task died, or did not reach its exit in time
        first_line = (str(error).splitlines() or [""])[0]
        logger.info("The exit barrier failed (%s: %s); exiting without waiting for the other "
                    "tasks (timeout %.0f s).", type(error).__name__, first_line,
                    EXIT_BARRIER_TIMEOUT_S)
        return
    alive = wait_until_gone(peers, PEER_EXIT_TIMEOUT_S)
    if alive:
        logger.info("Tasks at %s still running %.0f s after the exit barrier; exiting before "
                    "them.", ", ".join(alive), PEER_EXIT_TIMEOUT_S)
    logger.debug("Exit barrier and wait took %.2f s.", time.monotonic() - start)


def wait_until_gone(addresses: Sequence[str], timeout_s: float) -> List[str]:
    """Waits until no process listens at any of `addresses` ("host:port"), for `timeout_s`.

    An address that refuses a connection, or does not answer within a second, is gone.

    Returns:
        The addresses still listening when the time ran out (empty if all are gone).
    """
    alive = list(addresses)
    deadline = time.monotonic() + timeout_s
    while alive:
        alive = [a for a in alive if _listening(a)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    return alive


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), _CONNECT_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False
