"""The memory TensorFlow's allocator will let a GPU's training step use: the decision alone.

`gpu_budgets` takes the facts (TensorFlow's physical GPUs with their logical configurations
and memory growth flags, nvidia-smi's rows, the environment) and returns, per logical GPU in
TensorFlow's order, the bytes its allocator may hand out and where the figure came from, or
no figure and why. `tf_hetbatch.distribute.memory_probe` gathers the facts; this module only
decides, so it runs on fake device lists in tests. Pure Python.

Where TensorFlow 2.21 sets a GPU's limit (`gpu_device.cc`, read in its source):
- A logical device configured with `memory_limit` (MB; required for a virtual GPU) gets exactly
  that (`memory_limit_mb * 2**20`): the BFC allocator's limit for that device.
- Otherwise (`SingleVirtualDeviceMemoryLimit`): the GPU's memory free when TensorFlow starts it,
  less `MinSystemMemory`, a per-process reserve kept back for the CUDA context, cuBLAS/cuDNN
  handles and other memory outside the allocator (see `RESERVE_MIB_BY_COMPUTE_MAJOR`); or
  `per_process_gpu_memory_fraction` x total where a TF1 session config sets one (not read
  here); `TF_DEVICE_MIN_SYS_MEMORY_IN_MB` replaces the reserve. That limit is the same with
  memory growth on or off (`GPUBFCAllocator`: growth, or `TF_FORCE_GPU_ALLOW_GROWTH=true`,
  only makes the pool grow to it on demand instead of taking it all at start).
So the budget is total - reserve in both growth modes, never nvidia-smi's free memory: with
growth off TensorFlow holds nearly all of a GPU once it starts it, so free memory reads near 0.
Total rather than free-at-start: the process that probes has the GPU to itself, or the user
says otherwise with `memory_bytes` (another process's memory is not seen here).

Which nvidia-smi row is which TensorFlow GPU: TensorFlow names physical GPUs by CUDA ordinal
(`/physical_device:GPU:<ordinal>`, `ListPhysicalDevices`) and `get_device_details` gives only
`device_name` and `compute_capability`: no PCI bus id or UUID. So the row is found through
CUDA's own rule: `CUDA_VISIBLE_DEVICES` (indices or `GPU-` UUID prefixes, in its order)
picks the CUDA devices; an index counts in nvidia-smi's order (PCI bus order) only under
`CUDA_DEVICE_ORDER=PCI_BUS_ID`. The match is refused (no budget, the reason says to pass
`memory_bytes`) where it could be wrong: nvidia-smi did not answer, an index without
`PCI_BUS_ID` on a machine of several GPUs, an entry that matches no row or several, a count
of CUDA devices other than TensorFlow's physical GPUs, a device name other than the row's, or
MIG (nvidia-smi's rows are whole GPUs; a MIG instance has a slice of one).

Logical GPUs: `set_visible_devices` keeps a subset of the physical GPUs; each kept one makes
one logical GPU, or one per configured virtual device, in physical order, then ordered by
`experimental_device_ordinal` (TensorFlow sorts by (ordinal, creation index)).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

__all__ = ["BudgetSource", "GpuBudget", "PhysicalGpu", "SmiRow", "gpu_budgets",
           "tf_reserve_bytes", "RESERVE_MIB_BY_COMPUTE_MAJOR", "RESERVE_MIB_SMALL_GPU",
           "RESERVE_MIB_UNKNOWN", "ALL_REDUCE_HEADROOM", "parse_smi_rows", "SMI_FIELDS",
           "SMI_FIELDS_NO_MIG"]

MIB = 2**20

# `MinSystemMemory` in TensorFlow 2.21's gpu_device.cc: the bytes a process keeps back from
# the allocator's pool for the CUDA context, library handles and kernels' own buffers, by the
# GPU's compute capability major (<= 6: 500 MiB, 7: 1050, 8: 1536, newer: 1800); a GPU with
# under 2 GiB keeps 225 MiB. An unknown capability takes the largest (a smaller budget).
RESERVE_MIB_BY_COMPUTE_MAJOR = ((6, 500), (7, 1050), (8, 1536))
RESERVE_MIB_NEWER = 1800
RESERVE_MIB_SMALL_GPU = 225
RESERVE_MIB_UNKNOWN = RESERVE_MIB_NEWER
SMALL_GPU_BYTES = 2 * 2**30

# The all-reduce of a step holds up to about this many copies of the gradients on a GPU beside
# what one device alone peaks at: the packed (concatenated) gradients, the reduced output and
# its split pieces. The probe measures one device with no all-reduce, so its budget leaves this
# many times the model's trainable bytes free (`memory_probe`).
ALL_REDUCE_HEADROOM = 3


class BudgetSource(enum.Enum):
    """Where a budget came from."""

    GIVEN = "memory_bytes"  # the caller's figure
    VIRTUAL_DEVICE = "memory_limit"  # the logical device's configured memory_limit
    TOTAL_LESS_RESERVE = "total - reserve"  # nvidia-smi's memory.total less TensorFlow's reserve
    UNKNOWN = "unknown"  # no figure: the reason says why


@dataclasses.dataclass(frozen=True)
class PhysicalGpu:
    """What TensorFlow says of one physical GPU (`tf.config.list_physical_devices("GPU")`).

    Attributes:
        name: e.g. "/physical_device:GPU:0".
        visible: whether `tf.config.get_visible_devices("GPU")` keeps it.
        memory_growth: `tf.config.experimental.get_memory_growth`.
        virtual_limits_mib: each configured logical device's `memory_limit` (MB), or None
            where `get_logical_device_configuration` gives none (one logical device).
        virtual_ordinals: each configured logical device's `experimental_device_ordinal`
            (None: all 0).
        device_name: `get_device_details(...)["device_name"]`, or None.
        compute_capability: `get_device_details(...)["compute_capability"]`, e.g. "8.0", or None.
    """

    name: str
    visible: bool = True
    memory_growth: bool = False
    virtual_limits_mib: Optional[Tuple[int, ...]] = None
    virtual_ordinals: Optional[Tuple[Optional[int], ...]] = None
    device_name: Optional[str] = None
    compute_capability: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class SmiRow:
    """One row of `nvidia-smi --query-gpu=index,uuid,pci.bus_id,name,memory.total,
    mig.mode.current --format=csv,noheader,nounits`."""

    index: int
    uuid: str
    pci_bus_id: str
    name: str
    total_mib: int
    mig: bool = False


@dataclasses.dataclass(frozen=True)
class GpuBudget:
    """One logical GPU's budget.

    Attributes:
        logical_index: i of "GPU:i".
        physical: the physical GPU it runs on.
        memory_bytes: the bytes its allocator may hand out, or None (see `detail`).
        source: where `memory_bytes` came from.
        detail: a sentence a log or a table can show: the figures, or why there is none.
    """

    logical_index: int
    physical: str
    memory_bytes: Optional[int]
    source: BudgetSource
    detail: str


class _Logical(NamedTuple):
    """A logical GPU as TensorFlow creates it, before it sorts them by (ordinal, created)."""

    ordinal: int  # experimental_device_ordinal (0 by default)
    created: int  # creation index: physical order, then the virtual devices' order
    gpu: PhysicalGpu
    limit_mib: Optional[int]  # the configured memory_limit, or None


def tf_reserve_bytes(total_bytes: int, compute_capability: Optional[str],
                     env: Mapping[str, str]) -> int:
    """TensorFlow's per-process reserve on a GPU (`RESERVE_MIB_BY_COMPUTE_MAJOR`), or
    `TF_DEVICE_MIN_SYS_MEMORY_IN_MB` where set to an int >= 0 (TensorFlow ignores other values)."""
    forced = env.get("TF_DEVICE_MIN_SYS_MEMORY_IN_MB", "")
    if forced.strip().isdigit():
        return int(forced) * MIB
    if total_bytes < SMALL_GPU_BYTES:
        return RESERVE_MIB_SMALL_GPU * MIB
    major = _major(compute_capability)
    if major is None:
        return RESERVE_MIB_UNKNOWN * MIB
    for up_to, mib in RESERVE_MIB_BY_COMPUTE_MAJOR:
        if major <= up_to:
            return mib * MIB
    return RESERVE_MIB_NEWER * MIB


def gpu_budgets(physical: Sequence[PhysicalGpu], smi_rows: Optional[Sequence[SmiRow]],
                env: Mapping[str, str]) -> List[GpuBudget]:
    """Each logical GPU's budget, in TensorFlow's logical order (see the module docs).

    Args:
        physical: TensorFlow's physical GPUs, in its order.
        smi_rows: nvidia-smi's rows, or None where it did not answer.
        env: the environment (`CUDA_VISIBLE_DEVICES`, `CUDA_DEVICE_ORDER`,
            `TF_DEVICE_MIN_SYS_MEMORY_IN_MB`, `TF_FORCE_GPU_ALLOW_GROWTH`).

    Returns:
        One `GpuBudget` per logical GPU; `memory_bytes` None where the figure would be a guess.
    """
    rows = _rows_by_physical(physical, smi_rows, env)
    growth_forced = env.get("TF_FORCE_GPU_ALLOW_GROWTH", "").strip().lower()
    created: List[_Logical] = []
    for gpu in physical:
        if not gpu.visible:
            continue
        if gpu.virtual_limits_mib is None:
            created.append(_Logical(0, len(created), gpu, None))
            continue
        ordinals = gpu.virtual_ordinals or (None,) * len(gpu.virtual_limits_mib)
        for limit, ordinal in zip(gpu.virtual_limits_mib, ordinals):
            created.append(_Logical(ordinal or 0, len(created), gpu, limit))
    created.sort(key=lambda c: (c.ordinal, c.created))
    budgets = []
    for index, (_, _, gpu, limit) in enumerate(created):
        if limit is not None:
            budgets.append(GpuBudget(index, gpu.name, int(limit) * MIB,
                                     BudgetSource.VIRTUAL_DEVICE,
                                     f"the logical device's memory_limit={limit} MB"))
            continue
        row = rows if isinstance(rows, str) else rows[gpu.name]
        if isinstance(row, str):
            budgets.append(GpuBudget(index, gpu.name, None, BudgetSource.UNKNOWN, row))
            continue
        total = row.total_mib * MIB
        reserve = tf_reserve_bytes(total, gpu.compute_capability, env)
        growth = {"true": True, "false": False}.get(growth_forced, gpu.memory_growth)
        mode = ("memory growth on: the pool grows up to it" if growth else
                "memory growth off: TensorFlow takes it all at start")
        budgets.append(GpuBudget(
            index, gpu.name, max(total - reserve, 0), BudgetSource.TOTAL_LESS_RESERVE,
            f"nvidia-smi row {row.index} ({row.pci_bus_id}) total {row.total_mib} MiB less "
            f"TensorFlow's reserve {reserve // MIB} MiB ({mode})"))
    return budgets


def _rows_by_physical(physical, smi_rows, env) -> Union[str, Dict[str, Union[SmiRow, str]]]:
    """The nvidia-smi row of each physical GPU by name (or the reason that one is refused),
    or one reason that refuses them all."""
    if smi_rows is None:
        return "nvidia-smi did not answer, so the GPU's total memory is unknown"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ordered = env.get("CUDA_DEVICE_ORDER", "").strip() == "PCI_BUS_ID" or len(smi_rows) == 1
    if visible is None:
        if not ordered:
            return ("CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA's GPU order may not be "
                    "nvidia-smi's")
        cuda = list(smi_rows)
    else:
        cuda = []
        for entry in (e.strip() for e in visible.split(",")):
            if not entry:
                continue
            if entry.startswith("MIG-"):
                return (f"CUDA_VISIBLE_DEVICES names the MIG instance {entry}; nvidia-smi's "
                        "rows are whole GPUs")
            if entry.lstrip("-").isdigit():
                if int(entry) < 0:
                    break  # CUDA stops at a negative index
                if not ordered:
                    return (f"CUDA_VISIBLE_DEVICES index {entry} counts in CUDA's order, which "
                            "is nvidia-smi's only with CUDA_DEVICE_ORDER=PCI_BUS_ID")
                match = [r for r in smi_rows if r.index == int(entry)]
            else:
                match = [r for r in smi_rows if r.uuid.startswith(entry)]
            if len(match) != 1:
                return (f"CUDA_VISIBLE_DEVICES entry {entry!r} matches {len(match)} nvidia-smi "
                        "rows")
            if match[0] in cuda:
                return f"CUDA_VISIBLE_DEVICES names {entry!r} twice"
            cuda.append(match[0])
    if any(row.mig for row in cuda):
        return "MIG is on: nvidia-smi's rows are whole GPUs, not the MIG instances CUDA sees"
    if len(cuda) != len(physical):
        return (f"CUDA sees {len(cuda)} GPU(s) by nvidia-smi and CUDA_VISIBLE_DEVICES, "
                f"TensorFlow lists {len(physical)}: no row can be matched for sure")
    rows: Dict[str, Union[SmiRow, str]] = {}
    for ordinal, (gpu, row) in enumerate(zip(physical, cuda)):
        if not gpu.name.endswith(f"GPU:{ordinal}"):
            rows[gpu.name] = (f"TensorFlow's physical GPU {ordinal} is named {gpu.name!r}, not "
                              f"by CUDA ordinal {ordinal}")
        elif gpu.device_name and row.name and gpu.device_name.strip() != row.name.strip():
            rows[gpu.name] = (f"TensorFlow names it {gpu.device_name!r}, its nvidia-smi row "
                              f"{row.index} {row.name!r}")
        else:
            rows[gpu.name] = row
    return rows


def _major(compute_capability: Optional[str]) -> Optional[int]:
    head = (compute_capability or "").split(".")[0].strip()
    return int(head) if head.isdigit() else None


def parse_smi_rows(text: str, with_mig: bool = True) -> Optional[List[SmiRow]]:
    """`SmiRow`s from nvidia-smi's csv (`SMI_FIELDS`, noheader, nounits; `SMI_FIELDS_NO_MIG`
    where `with_mig` is False), or None where a line does not parse."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != (6 if with_mig else 5) or not cells[0].isdigit() \
                or not cells[4].isdigit():
            return None
        mig = with_mig and cells[5].lower() == "enabled"
        rows.append(SmiRow(int(cells[0]), cells[1], cells[2], cells[3], int(cells[4]), mig))
    return rows


SMI_FIELDS = "index,uuid,pci.bus_id,name,memory.total,mig.mode.current"
SMI_FIELDS_NO_MIG = "index,uuid,pci.bus_id,name,memory.total"  # drivers that predate MIG
