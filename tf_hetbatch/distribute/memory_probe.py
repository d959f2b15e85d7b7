"""Memory bounds measured up front: a device's peak memory at two batch sizes, fitted linearly.

A training step's memory is a fixed part (weights, optimizer slots, workspaces) plus a part
per sample (activations and their gradients). `probe_micro_batch_limits` trains a throwaway
copy of the model for a few steps on each device alone at two batch sizes, reads the peak the
device's allocator saw (`tf.config.experimental.get_memory_info`), and solves the line through
the two peaks for the memory the device has: the most samples one step fits, the bound to give
`set_micro_batch_limits`. The bound is an estimate: a step that still does not fit lowers it
when training (`out_of_memory`).

The memory a device has: `memory_bytes` if given; else, on a GPU, its free memory by
`nvidia-smi` (only with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, so TensorFlow's GPU order is
nvidia-smi's, and with memory growth on, so TensorFlow has not reserved it all); else unknown
(no bound). CPUs report the host's allocator, shared by every CPU device and the input
pipeline: give `memory_bytes` to bound a CPU replica (the probe runs one device at a time).

Run on logical CPUs only: no GPU can run TensorFlow where this was built; the GPU path (the
device's own allocator, nvidia-smi's free memory) has not run.
"""

import dataclasses
import gc
import logging
import os
import subprocess
from typing import Callable, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

logger = logging.getLogger(__name__)

PROBE_SIZES = (32, 128)


@dataclasses.dataclass(frozen=True)
class MemoryProbe:
    """What the probe of one device found.

    Attributes:
        device: the device probed.
        sizes: the two batch sizes.
        peak_bytes: the step's peak memory at each size (above what was in use before).
        memory_bytes: the memory the bound is solved for (None: unknown).
        bound: the most samples a training step fits in `memory_bytes` (at least 1), or None
            (memory unknown, or the peaks do not grow with the batch).
    """

    device: str
    sizes: Tuple[int, int]
    peak_bytes: Tuple[int, int]
    memory_bytes: Optional[int]
    bound: Optional[int]


def probe_micro_batch_limits(
        make_model: Callable, data, devices: Sequence[str],
        memory_bytes: Union[None, int, Sequence[Optional[int]]] = None,
        sizes: Tuple[int, int] = PROBE_SIZES, steps: int = 2) -> List[MemoryProbe]:
    """Measures each device's memory bound in samples (see the module docs).

    Example:
        >>> probes = hb.probe_micro_batch_limits(build_model, (x[:256], y[:256]),
        ...                                      ["/gpu:0", "/gpu:1"])
        >>> strategy.set_micro_batch_limits([p.bound for p in probes])

    Args:
        make_model: builds and compiles the model (called in a one-device strategy's scope,
            once per device and size: the probe trains throwaway copies).
        data: training samples, as `fit` takes them in a `tf.data.Dataset.from_tensor_slices`
            (e.g. `(x, y)`); repeated as needed.
        devices: the devices to probe, e.g. the replicas' devices in replica order.
        memory_bytes: the memory a training step may use, one for all devices or one per
            device (None: the device's free memory where known).
        sizes: the two batch sizes, smaller first.
        steps: training steps at each size (the first builds the model and its optimizer).

    Returns:
        One `MemoryProbe` per device, in the order of `devices`.

    Raises:
        ValueError: sizes that are not two increasing ints >= 1, steps < 1, or a
            `memory_bytes` list of another length than `devices`.
    """
    sizes = tuple(sizes)
    if len(sizes) != 2 or not all(isinstance(s, int) and s >= 1 for s in sizes) \
            or sizes[0] >= sizes[1]:
        raise ValueError(f"sizes must be two increasing ints >= 1, e.g. (32, 128); received "
                         f"{sizes!r}.")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1; received {steps!r}.")
    budgets = _budgets(memory_bytes, devices)
    probes = []
    for device, budget in zip(devices, budgets):
        peaks = tuple(_step_peak(make_model, data, device, size, steps) for size in sizes)
        bound = linear_bound(sizes, peaks, budget)
        if budget is not None and bound is None:
            logger.warning(
                "The probe of %s read peak bytes %s at batch sizes %s: no memory per sample to "
                "fit, so no bound (an allocator that keeps no statistics reads 0, e.g. the "
                "system allocator of TF_ONEDNN_USE_SYSTEM_ALLOCATOR on CPUs).", device, peaks,
                sizes)
        probes.append(MemoryProbe(device, sizes, peaks, budget, bound))
    return probes


def linear_bound(sizes, peaks, memory: Optional[int]) -> Optional[int]:
    """The most samples (>= 1) a step fits in `memory` bytes by the line through (size, peak);
    None if `memory` is unknown or the peaks do not grow with the batch."""
    slope = (peaks[1] - peaks[0]) / (sizes[1] - sizes[0])
    if memory is None or slope <= 0:
        return None
    fits = int((memory - (peaks[0] - slope * sizes[0])) // slope)
    if fits < 1:
        logger.warning("By the probe's line even one sample needs more than %d bytes: the bound "
                       "is 1.", memory)
    return max(fits, 1)


def _budgets(memory_bytes, devices) -> List[Optional[int]]:
    if memory_bytes is None or isinstance(memory_bytes, int):
        given = [memory_bytes] * len(devices)
    else:
        given = list(memory_bytes)
        if len(given) != len(devices):
            raise ValueError(f"memory_bytes has {len(given)} entries for {len(devices)} "
                             "devices. Fix: one per device, or one int for all.")
    free = None
    budgets = []
    for device, budget in zip(devices, given):
        spec = tf.DeviceSpec.from_string(device)
        if budget is None and spec.device_type == "GPU":
            free = free_gpu_memory() if free is None else free
            budget = free.get(spec.device_index or 0)
        budgets.append(budget)
    return budgets


def _memory_name(device: str) -> str:
    """"GPU:0" for "/gpu:0": the form `tf.config.experimental.get_memory_info` takes."""
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type}:{spec.device_index or 0}"


def _step_peak(make_model, data, device, size, steps) -> int:
    """Peak memory (bytes above what was in use before) of `steps` training steps of `size`
    samples on `device` alone."""
    from tf_hetbatch.distribute.strategy import HeteroMirroredStrategy

    name = _memory_name(device)
    batches = tf.data.Dataset.from_tensor_slices(data).repeat().take(size * steps).batch(size)
    gc.collect()  # an earlier probe's model, freed during this one, would hide its peak
    before = tf.config.experimental.get_memory_info(name)["current"]
    tf.config.experimental.reset_memory_stats(name)
    strategy = HeteroMirroredStrategy([device])
    with strategy.scope():
        model = make_model()
    model.fit(batches, epochs=1, verbose=0)
    return int(tf.config.experimental.get_memory_info(name)["peak"] - before)


def free_gpu_memory() -> dict:
    """Free bytes per TensorFlow GPU index, by nvidia-smi ({} where it cannot say)."""
    if os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        return {}  # TensorFlow's GPU order may not be nvidia-smi's
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,memory.free", "--format=csv,noheader,"
             "nounits"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # an index or a UUID (prefix) per visible GPU, in TF's order
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        rows = [row for e in entries for row in rows if e == row[0] or row[1].startswith(e)]
    try:
        return {i: int(row[2]) * 2**20 for i, row in enumerate(rows)}
    except (IndexError, ValueError):
        return {}
