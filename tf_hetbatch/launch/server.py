"""A parameter-server or worker task of an asynchronous (ParameterServerStrategy) cluster.

Run ``python -m tf_hetbatch.launch.server`` (also installed as ``tf-hetbatch-server``) on every
``ps`` and ``worker`` host with the standard ``TF_CONFIG``; the training script runs on the
``chief`` with :class:`tf_hetbatch.AsyncTrainer`. The task serves until it is stopped
(SIGTERM/SIGINT), which is what the coordinator of a ParameterServerStrategy expects: it sends
the work, the tasks only run it. ``python -m tf_hetbatch.launch --ps 1 ...`` starts these
tasks for a cluster on 127.0.0.1.

Example (a real cluster, one line per host)::

    TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' tf-hetbatch-server
    TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' tf-hetbatch-server
    TF_CONFIG='{"cluster": {...}, "task": {"type": "chief", "index": 0}}' python train.py
"""

import argparse
import gc
import json
import logging
import os
import signal
import sys
import threading
from typing import List, Mapping, Optional, Tuple

logger = logging.getLogger(__name__)

SERVING_TASKS = ("ps", "worker")


def task_of(tf_config: Optional[str]) -> Tuple[Mapping, str, int]:
    """The cluster, task type and index of a TF_CONFIG text, validated for a served task.

    Raises:
        ValueError: TF_CONFIG is missing or not valid JSON, or does not name a ps/worker task
            of its own cluster; the message says what is wrong and how to fix it.
    """
    if not tf_config:
        raise ValueError("TF_CONFIG is not set. Fix: set it as for any TensorFlow cluster, "
                         'e.g. {"cluster": {"chief": [...], "ps": [...], "worker": [...]}, '
                         '"task": {"type": "worker", "index": 0}}.')
    try:
        config = json.loads(tf_config)
        cluster, task = config["cluster"], config["task"]
        kind, index = task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"TF_CONFIG must be JSON with 'cluster' and 'task' "
                         f"{{'type', 'index'}}. Received: TF_CONFIG={tf_config!r} ({e}).") from e
    if kind not in SERVING_TASKS:
        raise ValueError(f"This task is a {kind!r}; `tf_hetbatch.launch.server` serves "
                         f"{SERVING_TASKS} tasks. Fix: run the training script on the chief "
                         "and this server on parameter servers and workers.")
    if not isinstance(cluster.get(kind), list) or not 0 <= index < len(cluster[kind]):
        raise ValueError(f"TF_CONFIG names task {kind}:{index} but its cluster has "
                         f"{kind}={cluster.get(kind)!r}. Fix: the task index must address "
                         "one of the cluster's addresses of that type.")
    return cluster, kind, index


def serve(tf_config: Optional[str] = None, stop: Optional[threading.Event] = None) -> int:
    """Starts this host's task from TF_CONFIG and serves until SIGTERM/SIGINT (or ``stop``).

    Args:
        tf_config: the TF_CONFIG text; default the environment variable.
        stop: an event that ends serving when set (for embedding); signals also end it.

    Returns:
        0 after a requested stop.
    """
    cluster, kind, index = task_of(tf_config if tf_config is not None
                                   else os.environ.get("TF_CONFIG"))
    import tensorflow as tf

    import tf_hetbatch.distribute  # noqa: F401  (checks the TensorFlow/Keras versions first)

    config = tf.compat.v1.ConfigProto()
    threads = int(os.environ.get("TF_NUM_INTEROP_THREADS", "0") or 0)
    if kind == "worker" and threads == 1:
        # A ParameterServerStrategy worker with one inter-op thread hangs on its first
        # scheduled function (seen with TensorFlow 2.21); two are enough.
        logger.info("TF_NUM_INTEROP_THREADS=1 would hang this worker; using 2.")
        threads = 2
    config.inter_op_parallelism_threads = threads
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=kind,
                                  task_index=index, protocol="grpc", config=config,
                                  start=True)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    logger.info("Serving %s:%d at %s", kind, index, server.target)
    while not stop.wait(1.0):
        pass
    logger.info("Stopping %s:%d", kind, index)
    return 0


def import_tensorflow_lean() -> None:
    """Imports TensorFlow (and Keras, tf_hetbatch's strategies) for a process that draws
    nothing, at the least CPU: about 1 s of the 3-4 s a start costs on a CPU core. Call it
    first, in a process of its own (a served task; the test suite's worker scripts).

    - matplotlib is made unimportable (None in ``sys.modules``). Keras imports
      ``matplotlib.pyplot`` at start-up whenever it is installed (0.5 s), in a
      ``try``/``except ImportError``.
    - The cyclic garbage collector is paused during the imports and what they built (about
      400,000 objects that live as long as the process) is then frozen (``gc.freeze``), so no
      later collection walks it again; new objects are collected as usual.
    """
    sys.modules.setdefault("matplotlib", None)
    gc.disable()
    try:
        import tensorflow  # noqa: F401

        import tf_hetbatch.distribute  # noqa: F401
    finally:
        gc.freeze()
        gc.enable()


def main(argv: Optional[List[str]] = None) -> int:
    """Command-line entry point: serve the TF_CONFIG task (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="tf-hetbatch-server",
        description="Serve a ps or worker task of a ParameterServerStrategy cluster from "
                    "TF_CONFIG until stopped (the chief runs the training script).")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="[server] %(message)s", stream=sys.stderr)
    try:
        task_of(os.environ.get("TF_CONFIG"))  # a bad TF_CONFIG fails before the imports
        import_tensorflow_lean()
        code = serve()
    except ValueError as e:
        parser.error(str(e))  # exits with status 2
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skips TensorFlow/gRPC teardown (1.5-3 s); nothing is left to serve


if __name__ == "__main__":
    sys.exit(main())
