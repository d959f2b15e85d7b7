"""Device layouts: which replicas each worker of a cluster hosts, and how they all-reduce.

A replica is a device, not a worker. Workers may host different numbers and kinds of devices
(a 4-GPU box, a 2-GPU box, a CPU-only box; on one machine, logical CPUs stand in for GPUs).
Each worker names its own devices; at start-up the workers exchange what they named (the
coordination service's key-value store, `_upstream.device_layout`) and every worker checks the
same entries with the same code (`layout_from_entries`), so a bad layout is refused with the
same error on every worker, before any collective or step. Replica ids run in worker order
(the chief first, then the workers by index, TensorFlow's "id in cluster"): worker w hosts
replicas offset(w) .. offset(w) + count(w) - 1, offset(w) the counts of the workers before it.

The all-reduce is decided once, from the exchanged layout, the same on every worker. A
TensorFlow collective group has ONE device type (a member of another type fails with "... but
that group has type GPU"), so:
- "device": every replica everywhere has the same kind: one group of all replicas (as stock;
  NCCL allowed when they are all GPUs);
- "host": the kinds differ anywhere (GPUs on one worker, CPUs on another; or a worker with
  GPU and CPU replicas): each worker sums its replicas onto its host CPU, the workers' CPUs
  all-reduce (RING), and the result is copied back to each local replica.
`all_reduce="host"` forces the second (it works for any layout); `"device"` with mixed kinds,
and NCCL with any replica that is not a GPU or with the host path, are refused.
"""

import dataclasses
import json
import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import tensorflow as tf

__all__ = ["DeviceLayout", "ALL_REDUCE_CHOICES", "EXCHANGE_TIMEOUT_S", "local_entry",
           "layout_from_entries", "check_all_reduce_argument", "check_devices_argument"]

ALL_REDUCE_CHOICES = (None, "device", "host")
# The longest wait for another worker's entry, unless `communication_options.timeout_seconds`
# says otherwise. Every worker has started its collective runtime before it publishes (the
# strategy's creation waits for all tasks to connect), so a worker missing here runs other
# code: another strategy class, or an older tf_hetbatch.
EXCHANGE_TIMEOUT_S = 120.0
_FULL_NAME = re.compile(r"device:([A-Za-z_]+):(\d+)$")


@dataclasses.dataclass(frozen=True)
class DeviceLayout:
    """The replicas of every worker, in worker order, and the all-reduce they agreed on.

    Attributes:
        devices: per worker, its replica devices (full names, e.g.
            "/job:worker/task:1/device:CPU:0"; one process: "/device:CPU:0").
        worker: this process's position in `devices` (TensorFlow's id in cluster).
        all_reduce: "device" (one collective group of all replicas) or "host" (each worker's
            replicas summed on its CPU, the CPUs all-reduced).
        implementation: the collective implementation every worker uses ("AUTO", "RING",
            "NCCL"): the user's `communication_options.implementation` on the device path,
            "RING" on the host path (the only one between CPUs).
    """

    devices: Tuple[Tuple[str, ...], ...]
    worker: int
    all_reduce: str
    implementation: str = "AUTO"

    @property
    def num_workers(self) -> int:
        return len(self.devices)

    @property
    def counts(self) -> Tuple[int, ...]:
        """Replicas per worker, in worker order."""
        return tuple(len(d) for d in self.devices)

    @property
    def total(self) -> int:
        """All replicas of all workers: the replicas in sync."""
        return sum(self.counts)

    @property
    def offset(self) -> int:
        """The replica id of this worker's first replica."""
        return sum(self.counts[:self.worker])

    @property
    def local_devices(self) -> Tuple[str, ...]:
        return self.devices[self.worker]

    @property
    def kinds(self) -> Tuple[Tuple[str, ...], ...]:
        """Per worker, its replicas' device kinds ("CPU", "GPU", ...)."""
        return tuple(tuple(device_kind(d) for d in worker) for worker in self.devices)

    @property
    def replica_kinds(self) -> Tuple[str, ...]:
        """Every replica's kind, in replica order."""
        return tuple(kind for worker in self.kinds for kind in worker)

    def describe(self) -> str:
        """One line, e.g. `2 workers: [1 CPU] [2 CPU]; 3 replicas; all-reduce device (AUTO)`."""
        parts = []
        for kinds in self.kinds:
            counted = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
            parts.append("[" + ", ".join(f"{n} {k}" for k, n in counted.items()) + "]")
        return (f"{self.num_workers} worker{'s' if self.num_workers > 1 else ''}: "
                f"{' '.join(parts)}; {self.total} replicas; all-reduce {self.all_reduce} "
                f"({self.implementation})")


def device_kind(name: str) -> str:
    """The kind ("CPU", "GPU", ...) of a full device name."""
    match = _FULL_NAME.search(name)
    return match.group(1).upper() if match else "CPU"


def check_all_reduce_argument(all_reduce: Any) -> Optional[str]:
    """Validates the strategy's `all_reduce` argument (None, "device" or "host")."""
    if all_reduce not in ALL_REDUCE_CHOICES or isinstance(all_reduce, bool):
        raise ValueError(
            "`all_reduce` must be None (decided from the layout), 'device' or 'host'. "
            f"Received: all_reduce={all_reduce!r}. Fix: leave it None unless you want to force "
            "the host path ('host': each worker's replicas summed on its CPU).")
    return all_reduce


def check_devices_argument(devices: Any) -> Optional[Tuple[str, ...]]:
    """Validates the type of the strategy's `devices` argument (None or a list of names)."""
    if devices is None:
        return None
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)) or not all(
            isinstance(d, str) for d in devices):
        raise TypeError(
            "`devices` must be this worker's list of device names, e.g. ['/gpu:0', '/gpu:1'] "
            f"or ['/cpu:0']. Received: devices={devices!r}. Fix: pass a list of strings (a "
            "cluster resolver goes to cluster_resolver=...), or None for TensorFlow's choice.")
    return tuple(devices)


def local_entry(requested: Sequence[str], worker_device: str,
                settings: Mapping[str, Any]) -> Dict[str, Any]:
    """This worker's entry for the exchange: its devices, its problem if any, its settings.

    A problem (a device that does not exist, one named twice, none) is published, not raised,
    so that every worker raises the same error after the exchange.

    Args:
        requested: the device names this worker was given (or TensorFlow's default).
        worker_device: "/job:worker/task:1" in a cluster, "" in one process.
        settings: what every worker must agree on (JSON values).

    Returns:
        {"devices": full names, "error": None or a sentence, "settings": settings}.
    """
    devices, error = [], None
    try:
        devices = _full_names(requested, worker_device)
    except ValueError as e:
        error = str(e)
    return {"devices": devices, "error": error, "settings": dict(settings)}


def _full_names(requested, worker_device):
    if not requested:
        raise ValueError("it names no device")
    present = _local_device_names()
    out = []
    for name in requested:
        try:
            spec = tf.DeviceSpec.from_string(name)
        except (ValueError, TypeError):
            raise ValueError(f"{name!r} is not a device name") from None
        if spec.device_type is None or spec.device_index is None:
            raise ValueError(f"{name!r} names no device type and index (e.g. '/gpu:0')")
        mine = tf.DeviceSpec.from_string(worker_device or "/job:localhost/task:0")
        if (spec.job not in (None, mine.job)) or (spec.task not in (None, mine.task)):
            raise ValueError(f"{name!r} is another task's device (this worker is "
                             f"{worker_device or 'the only process'})")
        short = f"{spec.device_type.upper()}:{spec.device_index}"
        if short not in present:
            raise ValueError(f"{name!r} does not exist here (this worker has "
                             f"{', '.join(sorted(present))})")
        out.append(f"{worker_device}/device:{short}")
    if len(set(out)) != len(out):
        raise ValueError(f"{list(requested)} names a device twice")
    return out


def _local_device_names():
    """"TYPE:index" of this process's own logical devices."""
    names = set()
    for device in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(device.name)
        if spec.device_type and spec.device_index is not None:
            names.add(f"{spec.device_type.upper()}:{spec.device_index}")
    return names


def layout_from_entries(entries: Sequence[Mapping[str, Any]], worker: int,
                        all_reduce: Optional[str], implementation: str) -> DeviceLayout:
    """The cluster's layout from every worker's entry, or the error every worker raises.

    Args:
        entries: each worker's `local_entry`, in worker order.
        worker: this process's position.
        all_reduce: the `all_reduce` argument (None, "device", "host"); the same on every
            worker (it is one of the settings compared).
        implementation: the `CommunicationImplementation` name ("AUTO", "RING", "NCCL").

    Returns:
        The `DeviceLayout`: its `all_reduce` is the argument if given, else "device" when every
        replica is of one kind and "host" when kinds differ; its `implementation` is RING on
        the host path, else `implementation`.

    Raises:
        ValueError: a worker's devices are wrong, the workers' settings differ, mixed kinds
            with all_reduce="device", NCCL where a replica is not a GPU or on the host path.
    """
    problems = [f"worker {i}: {e['error']}" for i, e in enumerate(entries) if e["error"]]
    if problems:
        raise ValueError(
            "`devices` must name existing devices of each worker, each once. Received: "
            + "; ".join(problems) + ". Fix: pass every worker its own devices, e.g. "
            "HeteroMultiWorkerMirroredStrategy(devices=['/gpu:0', '/gpu:1']) on a 2-GPU worker "
            "(None: all its GPUs, else its CPU).")
    _check_same_settings(entries)
    devices = tuple(tuple(e["devices"]) for e in entries)
    kinds = sorted({device_kind(d) for worker_devices in devices for d in worker_devices})
    per_worker = {i: sorted({device_kind(d) for d in ds}) for i, ds in enumerate(devices)}
    if all_reduce == "device" and len(kinds) > 1:
        raise ValueError(
            "`all_reduce='device'` needs every replica of every worker on devices of one kind: "
            "a TensorFlow collective group has one device type. Received: kinds per worker "
            f"{per_worker}. Fix: all_reduce=None or 'host' (each worker's replicas summed on "
            "its CPU), or give every worker devices of one kind.")
    chosen = all_reduce or ("device" if len(kinds) == 1 else "host")
    if implementation == "NCCL" and (kinds != ["GPU"] or chosen == "host"):
        where = ("the host all-reduce runs between the workers' CPUs" if kinds == ["GPU"]
                 else f"kinds per worker {per_worker}")
        raise ValueError(
            "`communication_options.implementation` NCCL needs every replica on a GPU and the "
            f"device all-reduce. Received: NCCL, all-reduce '{chosen}', {where}. Fix: "
            "CommunicationImplementation.RING or AUTO.")
    return DeviceLayout(devices, worker, chosen, "RING" if chosen == "host" else implementation)


def _check_same_settings(entries):
    first = entries[0]["settings"]
    for name in first:
        values = [e["settings"].get(name) for e in entries]
        if any(v != values[0] for v in values):
            shown = "; ".join(f"worker {i}: {json.dumps(v)}" for i, v in enumerate(values))
            raise ValueError(
                f"Every worker must create the strategy with the same `{name}`, and see the "
                f"same cluster. Received: {shown}. Fix: run the same script with the same "
                "arguments (and the same TF_CONFIG cluster) on every worker.")

