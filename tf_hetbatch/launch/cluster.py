"""Cluster description for a local launch: free ports, TF_CONFIG, task commands and env.

The training script sees exactly what a cluster tool (Kubernetes operator, Slurm script,
managed service) would give it: a ``TF_CONFIG`` environment variable of the form
``{"cluster": {"worker": ["127.0.0.1:p0", ...]}, "task": {"type": "worker", "index": i}}``
(MultiWorkerMirroredStrategy), or with parameter servers
``{"cluster": {"chief": [...], "ps": [...], "worker": [...]}, "task": {"type": "ps",
"index": 0}}`` (ParameterServerStrategy: the chief runs the script, ps and worker tasks run
``python -m tf_hetbatch.launch.server``).

Pure Python stdlib: no TensorFlow.
"""

import json
import os
import socket
import sys
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set

HOST = "127.0.0.1"
RESTART_ENV = "TF_HETBATCH_RESTART"
THREAD_ENVS = ("TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS", "OMP_NUM_THREADS")
ROLES = ("chief", "ps", "worker")
SERVER_MODULE = "tf_hetbatch.launch.server"
CUDA_ENV = "CUDA_VISIBLE_DEVICES"


class PortReservation:
    """Holds ``n`` distinct free TCP ports on 127.0.0.1 until :meth:`release`.

    The sockets stay bound (not listening) so that no other process of ours picks the same
    port; release them just before the workers start so that the workers can bind them.

    Args:
        n: number of ports, >= 1.
    """

    def __init__(self, n: int):
        self._sockets: List[socket.socket] = []
        try:
            for _ in range(n):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                self._sockets.append(sock)
                sock.bind((HOST, 0))
        except OSError:
            self.release()
            raise
        self.ports: List[int] = [s.getsockname()[1] for s in self._sockets]

    def release(self) -> None:
        """Closes the held sockets (idempotent)."""
        for sock in self._sockets:
            sock.close()
        self._sockets = []


def task_name(role: str, index: int) -> str:
    """How logs and messages name a task: ``"chief"`` (there is one), ``"ps 0"``,
    ``"worker 1"``."""
    return role if role == "chief" else f"{role} {index}"


def tf_config(ports: Sequence[int], index: int) -> str:
    """Returns the TF_CONFIG JSON for worker ``index`` of a loopback cluster on ``ports``."""
    return task_tf_config({"worker": addresses(ports)}, "worker", index)


def addresses(ports: Sequence[int]) -> List[str]:
    """``[p0, p1]`` -> ``["127.0.0.1:p0", "127.0.0.1:p1"]``."""
    return [f"{HOST}:{p}" for p in ports]


def ps_cluster(ports: Sequence[int], num_ps: int) -> Dict[str, List[str]]:
    """The cluster of a ParameterServerStrategy launch on ``1 + num_ps + num_workers`` ports:
    ``{"chief": [ports[0]], "ps": [the next num_ps], "worker": [the rest]}`` on 127.0.0.1."""
    hosts = addresses(ports)
    return {"chief": hosts[:1], "ps": hosts[1:1 + num_ps], "worker": hosts[1 + num_ps:]}


def task_tf_config(spec: Mapping[str, Sequence[str]], role: str, index: int) -> str:
    """Returns the TF_CONFIG JSON of task ``role:index`` of the cluster ``spec``."""
    return json.dumps({
        "cluster": {r: list(spec[r]) for r in spec},
        "task": {"type": role, "index": index},
    })


def server_command(python: Optional[str] = None) -> List[str]:
    """Command of a ps or worker task: ``[python, "-m", "tf_hetbatch.launch.server"]``."""
    return [python or sys.executable, "-m", SERVER_MODULE]


def resolve_command(script_argv: Sequence[str], python: Optional[str] = None) -> List[str]:
    """Turns ``[script, *args]`` into the command a worker runs.

    A ``.py`` file runs under ``python`` (default: this interpreter); any other existing
    executable file runs directly.

    Raises:
        ValueError: empty argv, or the script does not exist / is not runnable.
    """
    if not script_argv:
        raise ValueError("No training script given. Fix: pass the script and its "
                         "arguments, e.g. ['train.py', '--epochs', '3'].")
    script = str(script_argv[0])
    args = [str(a) for a in script_argv[1:]]
    if not os.path.isfile(script):
        raise ValueError(
            f"Training script not found: {script!r} (working directory {os.getcwd()!r}). "
            f"Fix: give an existing file path."
        )
    if script.endswith(".py"):
        return [python or sys.executable, script, *args]
    if not os.access(script, os.X_OK):
        raise ValueError(
            f"Training script {script!r} is neither a .py file nor executable. "
            f"Fix: name a .py file, or chmod +x the script."
        )
    return [os.path.abspath(script), *args]


def worker_env(base: Mapping[str, str], ports: Sequence[int], index: int, attempt: int,
               threads: Optional[int] = None,
               extra: Optional[Mapping[str, str]] = None,
               cuda_visible_devices: Optional[str] = None) -> Dict[str, str]:
    """Returns the environment of worker ``index`` of a MultiWorkerMirrored cluster on
    ``ports`` (see :func:`task_env`)."""
    return task_env(base, tf_config(ports, index), attempt, threads, extra,
                    cuda_visible_devices=cuda_visible_devices)


def task_env(base: Mapping[str, str], config: str, attempt: int,
             threads: Optional[int] = None,
             extra: Optional[Mapping[str, str]] = None,
             min_interop: int = 1,
             cuda_visible_devices: Optional[str] = None) -> Dict[str, str]:
    """Returns the environment of a task whose TF_CONFIG is ``config``.

    Sets ``TF_CONFIG``, ``TF_HETBATCH_RESTART=<attempt>`` (0 on the first launch),
    ``PYTHONUNBUFFERED=1`` (so that output lines arrive as they are printed), when
    ``threads`` is given the TensorFlow/OpenMP thread counts (the inter-op count at least
    ``min_interop``), and when ``cuda_visible_devices`` is given (``""``: no GPU) the task's
    ``CUDA_VISIBLE_DEVICES`` (see :mod:`tf_hetbatch.launch.gpus`). ``extra`` is applied last.
    """
    env = dict(base)
    env["TF_CONFIG"] = config
    env[RESTART_ENV] = str(attempt)
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        for name in THREAD_ENVS:
            env[name] = str(threads)
        env["TF_NUM_INTEROP_THREADS"] = str(max(threads, min_interop))
    if cuda_visible_devices is not None:
        env[CUDA_ENV] = cuda_visible_devices
    if extra:
        env.update({str(k): str(v) for k, v in extra.items()})
    return env


def live_groups(pgids: Iterable[int]) -> Set[int]:
    """Returns the process groups among ``pgids`` that still have a non-zombie member.

    Reads Linux ``/proc`` once; where /proc is unreadable, a group counts as live while
    ``killpg(pgid, 0)`` succeeds (which also counts zombie leaders).
    """
    wanted = set(pgids)
    found: Set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        for pgid in wanted:
            try:
                os.killpg(pgid, 0)
                found.add(pgid)
            except OSError:
                pass
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        # Fields after the ")" that closes the command name: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) >= 3 and fields[0] not in ("Z", "X") and int(fields[2]) in wanted:
            found.add(int(fields[2]))
    return found
