"""Memory bounds measured up front: a device's peak memory at two batch sizes, fitted linearly.

A training step's memory is a fixed part (weights, optimizer slots, workspaces) plus a part
per sample (activations and their gradients). `probe_micro_batch_limits` trains a throwaway
copy of the model on each device alone at two batch sizes: at each size one warm-up step
(it builds the model and its optimizer, traces the step and lets cuDNN autotune for the new
shape, whose workspaces can reach GBs and are not the step's steady need), then the
allocator's statistics are reset and the peak of the following steps is read
(`tf.config.experimental.get_memory_info`; the model's weights and slots, allocated before,
stay in it). The line through the two peaks is solved for the memory the device has, less
headroom for the all-reduce: the most samples one step fits, the bound to give
`set_micro_batch_limits`. The bound is an estimate: a step that still does not fit lowers it
when training (`out_of_memory`).

The memory a device has (`MemoryProbe.memory_bytes`, its origin in `memory_source`):
`memory_bytes` if given; else, on a GPU, the limit TensorFlow's allocator will use for it
(`tf_hetbatch.core.gpu_memory`, where the rules and their source are): a logical device's
configured `memory_limit` (every virtual GPU has one); else the GPU's total memory by
nvidia-smi, matched to TensorFlow's physical GPU through `CUDA_VISIBLE_DEVICES` and
`CUDA_DEVICE_ORDER`, less TensorFlow's per-process reserve, with memory growth on or off
(never nvidia-smi's free memory: without memory growth TensorFlow holds nearly all of a GPU
once it starts, so free memory reads near 0). Where that match could be wrong (MIG, a count
mismatch, indices without `CUDA_DEVICE_ORDER=PCI_BUS_ID`, no nvidia-smi) there is no bound
and one warning names the device, the reason and the fix: pass `memory_bytes`. CPUs report
the host's allocator, shared by every CPU device and the input pipeline: give
`memory_bytes` to bound a CPU replica (the probe runs one device at a time).

All-reduce headroom, on GPUs: the probe runs one device, so no all-reduce; in training the
step's all-reduce packs the gradients (a concatenated copy, the reduced output, its split
pieces: up to `ALL_REDUCE_HEADROOM` = 3 times the gradient bytes) on the GPU beside the rest.
So a GPU's bound is solved for `memory_bytes - 3 x` the model's trainable bytes
(`MemoryProbe.headroom_bytes`), whatever the budget's source. CPU budgets get no headroom.

Run on logical CPUs only: no GPU can run TensorFlow where this was built; the GPU path (the
device's own allocator, the budget from TensorFlow's configuration and nvidia-smi's total
memory, cuDNN's warm-up) has not run.
"""

import dataclasses
import gc
import logging
import math
import numbers
import os
import subprocess
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_hetbatch.core import gpu_memory
from tf_hetbatch.core.gpu_memory import ALL_REDUCE_HEADROOM, BudgetSource

logger = logging.getLogger(__name__)

PROBE_SIZES = (32, 128)
NVIDIA_SMI_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class MemoryProbe:
    """What the probe of one device found.

    Attributes:
        device: the device probed.
        sizes: the two batch sizes.
        peak_bytes: the peak memory of the measured steps at each size (above what was in use
            before the model was built; after a warm-up step at that size).
        memory_bytes: the memory the device has for a step (None: unknown).
        bound: the most samples a training step fits in `memory_bytes - headroom_bytes` (at
            least 1), or None (memory unknown, or the peaks do not grow with the batch).
        memory_source: where `memory_bytes` came from: "memory_bytes" (given),
            "memory_limit" (the logical device's), "total - reserve" (nvidia-smi's total less
            TensorFlow's reserve) or "unknown".
        memory_detail: the figures behind `memory_bytes`, or why there is none.
        headroom_bytes: what the bound leaves free for the all-reduce (GPUs: 3 x
            `trainable_bytes`; CPUs: 0).
        trainable_bytes: the model's trainable variables' bytes.
    """

    device: str
    sizes: Tuple[int, int]
    peak_bytes: Tuple[int, int]
    memory_bytes: Optional[int]
    bound: Optional[int]
    memory_source: str = BudgetSource.UNKNOWN.value
    memory_detail: str = ""
    headroom_bytes: int = 0
    trainable_bytes: int = 0


def probe_micro_batch_limits(
        make_model: Callable, data, devices: Sequence[str],
        memory_bytes: Union[None, int, Sequence[Optional[int]]] = None,
        sizes: Tuple[int, int] = PROBE_SIZES, steps: int = 1) -> List[MemoryProbe]:
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
        memory_bytes: the memory a training step may use, one int (>= 1) for all devices or
            one per device (None: on a GPU, the limit TensorFlow's allocator uses; see the
            module docs). GPUs still leave the all-reduce headroom free of it.
        sizes: the two batch sizes, smaller first.
        steps: measured training steps at each size, after one warm-up step (default 1).

    Returns:
        One `MemoryProbe` per device, in the order of `devices`.

    Raises:
        ValueError: sizes that are not two increasing ints >= 1, steps < 1, a `memory_bytes`
            that is not an int >= 1 (or None), or a `memory_bytes` list of another length
            than `devices`.
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
    for device, (budget, source, detail) in zip(devices, budgets):
        measured = [_step_peak(make_model, data, device, size, steps) for size in sizes]
        peaks = tuple(peak for peak, _ in measured)
        trainable = measured[0][1]
        headroom = ALL_REDUCE_HEADROOM * trainable if _is_gpu(device) else 0
        bound = linear_bound(sizes, peaks, None if budget is None else budget - headroom)
        if budget is not None and bound is None:
            logger.warning(
                "The probe of %s read peak bytes %s at batch sizes %s: no memory per sample to "
                "fit, so no bound (an allocator that keeps no statistics reads 0, e.g. the "
                "system allocator of TF_ONEDNN_USE_SYSTEM_ALLOCATOR on CPUs).", device, peaks,
                sizes)
        probes.append(MemoryProbe(device, sizes, peaks, budget, bound, source.value, detail,
                                  headroom, trainable))
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


def _budgets(memory_bytes, devices, facts: Optional[Callable] = None
             ) -> List[Tuple[Optional[int], BudgetSource, str]]:
    """Each device's (bytes, source, detail). `facts` (default: `_gpu_facts`) returns what
    `gpu_memory.gpu_budgets` takes; it is asked once, and only for GPUs without a given
    budget. Logs one warning per GPU left without a budget."""
    if np.ndim(memory_bytes) == 0:  # None, an int, or a wrong scalar (refused below)
        given = [memory_bytes] * len(devices)
    else:
        given = list(memory_bytes)
        if len(given) != len(devices):
            raise ValueError(f"memory_bytes has {len(given)} entries for {len(devices)} "
                             "devices. Fix: one per device, or one int for all.")
    for value in given:
        if value is not None and (not isinstance(value, numbers.Integral)
                                  or isinstance(value, bool) or value < 1):
            raise ValueError(f"memory_bytes must be an int >= 1 (bytes) or None, one for all "
                             f"devices or one per device. Received: memory_bytes="
                             f"{memory_bytes!r}. Fix: e.g. memory_bytes=8 * 2**30.")
    gpus = None
    out = []
    for device, budget in zip(devices, given):
        if budget is not None:
            out.append((int(budget), BudgetSource.GIVEN, "memory_bytes given"))
            continue
        if not _is_gpu(device):
            out.append((None, BudgetSource.UNKNOWN, "a CPU shares the host's memory: give "
                        "memory_bytes to bound it"))
            continue
        if gpus is None:
            gpus = gpu_memory.gpu_budgets(*(facts or _gpu_facts)())
        index = tf.DeviceSpec.from_string(device).device_index or 0
        found = gpus[index] if index < len(gpus) else gpu_memory.GpuBudget(
            index, "", None, BudgetSource.UNKNOWN,
            f"TensorFlow has {len(gpus)} logical GPU(s), none with index {index}")
        if found.memory_bytes is None:
            logger.warning(
                "No memory bound for %s: %s. Fix: pass memory_bytes to "
                "probe_micro_batch_limits (for a GPU, TensorFlow's log line 'Created device "
                "... GPU:%d with N MB memory' gives its allocator's limit, N * 2**20 bytes).",
                device, found.detail, index)
        out.append((found.memory_bytes, found.source, found.detail))
    return out


def _is_gpu(device: str) -> bool:
    return (tf.DeviceSpec.from_string(device).device_type or "").upper() == "GPU"


def _gpu_facts():
    """What `gpu_memory.gpu_budgets` decides from: TensorFlow's physical GPUs with their
    configuration (public `tf.config` only), nvidia-smi's rows, the environment."""
    visible = tf.config.get_visible_devices("GPU")
    physical = []
    for device in tf.config.list_physical_devices("GPU"):
        logical = tf.config.get_logical_device_configuration(device)
        details = tf.config.experimental.get_device_details(device)
        physical.append(gpu_memory.PhysicalGpu(
            name=device.name, visible=device in visible,
            memory_growth=bool(tf.config.experimental.get_memory_growth(device)),
            virtual_limits_mib=None if not logical else tuple(c.memory_limit for c in logical),
            virtual_ordinals=None if not logical else tuple(
                c.experimental_device_ordinal for c in logical),
            device_name=details.get("device_name"),
            compute_capability=details.get("compute_capability")))
    return physical, _smi_rows(), dict(os.environ)


def _smi_rows() -> Optional[List[gpu_memory.SmiRow]]:
    """nvidia-smi's rows (None where it does not answer)."""
    for fields, with_mig in ((gpu_memory.SMI_FIELDS, True),
                             (gpu_memory.SMI_FIELDS_NO_MIG, False)):
        try:
            text = subprocess.run(
                ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True).stdout
        except FileNotFoundError:
            return None
        except (OSError, subprocess.SubprocessError):
            continue  # e.g. a driver that predates mig.mode.current: ask without it
        return gpu_memory.parse_smi_rows(text, with_mig)
    return None


def _memory_name(device: str) -> str:
    """"GPU:0" for "/gpu:0": the form `tf.config.experimental.get_memory_info` takes."""
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type}:{spec.device_index or 0}"


def _step_peak(make_model, data, device, size, steps) -> Tuple[int, int]:
    """(peak memory, trainable bytes) of `steps` training steps of `size` samples on `device`
    alone, after one warm-up step at that size; the peak is above what was in use before the
    model was built, so the model's weights and slots count."""
    from tf_hetbatch.distribute.strategy import HeteroMirroredStrategy

    name = _memory_name(device)
    # One copy of the data for both fits, made before `before`: each new copy (a dataset
    # made per fit) stayed alive until Python's collector ran, so the peaks counted 0, 1 or
    # 2 extra copies of the data from run to run (+-20% on a small model).
    batches = tf.data.Dataset.from_tensor_slices(data).repeat().batch(size)
    gc.collect()  # an earlier probe's model, freed during this one, would hide its peak
    before = tf.config.experimental.get_memory_info(name)["current"]
    strategy = HeteroMirroredStrategy([device])
    with strategy.scope():
        model = make_model()
    model.fit(batches.take(1), epochs=1, verbose=0)  # builds, traces, autotunes at this shape
    gc.collect()  # the warm-up's iterator and its prefetched batches
    tf.config.experimental.reset_memory_stats(name)  # the peak restarts at what is in use
    model.fit(batches.take(steps), epochs=1, verbose=0)
    peak = int(tf.config.experimental.get_memory_info(name)["peak"] - before)
    trainable = sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size
                    for v in model.trainable_variables)
    return peak, trainable
