"""Nominal peak FP32 throughput of CPUs and GPUs, for the static split (pure Python).

The static split gives each replica a share of the global batch proportional to its
nominal peak FLOP/s. These are *nominal* numbers: they ignore memory bandwidth, fixed
per-step costs and interference, which the dynamic controllers correct from measurements.

Assumptions (documented, all overridable by building a `DeviceCapability` yourself):
- CPU peak = usable cores x clock (GHz) x FP32 FLOPs per cycle per core, where FLOPs per
  cycle follow from the ISA flags: AVX-512 (with two FMA units assumed) 64, AVX2 + FMA 32,
  AVX 16, SSE 8. The clock is the "cpu MHz" line of /proc/cpuinfo (the current clock), else
  the "@ x.xxGHz" of the model name, else 2.0 GHz. Usable cores are the logical CPUs,
  capped by a cgroup CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`),
  both at the cgroup root and in the process's own cgroup (/proc/self/cgroup).
  Hyper-threads count as cores, as the OS and TensorFlow see them.
- GPU peak = the vendor's dense FP32 number, or the dense TF32 tensor-core number on Ampere
  and newer when TF32 is enabled (TensorFlow's default), from the table below; unknown GPUs
  fall back to a per-compute-capability estimate. A MIG slice gets its share of the whole
  GPU's peak: its compute slices over the GPU's (7 on A100/H100/H200/B200, 4 on A30).

No TensorFlow import here: pass `tf.config.experimental.get_device_details(device)` values in.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Callable, Mapping, NamedTuple, Optional, Tuple

logger = logging.getLogger(__name__)

__all__ = ["DeviceCapability", "cpu_capability", "gpu_capability"]

_KINDS = ("CPU", "GPU")


@dataclasses.dataclass(frozen=True)
class DeviceCapability:
    """Nominal capability of one device.

    Args:
        name: human-readable device name (e.g. "NVIDIA A100-SXM4-40GB" or "/CPU:0").
        kind: "CPU" or "GPU" (case-insensitive, stored upper-case).
        peak_flops: nominal peak FP32 FLOP/s, > 0. Set it yourself to override the tables.
        details: free-form facts the estimate came from (cores, GHz, flags, table row...).

    Raises:
        ValueError: on an unknown kind or a non-positive / non-finite peak.

    Example:
        >>> DeviceCapability("my-gpu", "gpu", peak_flops=10e12).kind
        'GPU'
    """

    name: str
    kind: str
    peak_flops: float
    details: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        kind = str(self.kind).upper()
        if kind not in _KINDS:
            raise ValueError(f"`kind` must be one of {_KINDS}. Received: kind={self.kind!r}")
        object.__setattr__(self, "kind", kind)
        try:
            peak = float(self.peak_flops)
        except (TypeError, ValueError):
            peak = float("nan")
        if not peak > 0 or peak == float("inf"):
            raise ValueError(f"`peak_flops` must be a finite number > 0 (FLOP/s). "
                             f"Received: peak_flops={self.peak_flops!r}")
        object.__setattr__(self, "peak_flops", peak)
        object.__setattr__(self, "details", dict(self.details))


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "r") as f:
            return f.read()
    except OSError:
        return None


def _flops_per_cycle(flags: set) -> Tuple[int, str]:
    if "avx512f" in flags:
        return 64, "AVX-512 (2 FMA units assumed)"
    if "avx2" in flags and "fma" in flags:
        return 32, "AVX2+FMA"
    if "avx" in flags:
        return 16, "AVX"
    return 8, "SSE"


def _parse_cpuinfo(text: str) -> Tuple[int, set, Optional[float], str]:
    """Returns (logical CPUs, flags of the first CPU, clock GHz or None, model name)."""
    processors = len(re.findall(r"^processor\s*:", text, flags=re.M))
    flags_m = re.search(r"^flags\s*:\s*(.*)$", text, flags=re.M)
    flags = set(flags_m.group(1).split()) if flags_m else set()
    model_m = re.search(r"^model name\s*:\s*(.*)$", text, flags=re.M)
    model = model_m.group(1).strip() if model_m else "unknown CPU"
    mhz = [float(v) for v in re.findall(r"^cpu MHz\s*:\s*([0-9.]+)", text, flags=re.M)]
    ghz = max(mhz) / 1000.0 if mhz else None
    if not ghz:
        named = re.search(r"@\s*([0-9.]+)\s*GHz", model)
        ghz = float(named.group(1)) if named else None
    return processors, flags, ghz, model


def _quota_from_files(read: Callable[[str], Optional[str]], root: str,
                      group: str) -> Optional[float]:
    """CPU quota in cores for one cgroup path (v2 then v1), or None if unlimited/unknown."""
    group = group.strip("/")
    v2 = read(os.path.join(root, group, "cpu.max"))
    if v2:
        parts = v2.split()
        if len(parts) >= 2 and parts[0] != "max":
            try:
                return float(parts[0]) / float(parts[1])
            except (ValueError, ZeroDivisionError):
                return None
        return None
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        quota = read(os.path.join(root, controller, group, "cpu.cfs_quota_us"))
        period = read(os.path.join(root, controller, group, "cpu.cfs_period_us"))
        if quota is not None and period is not None:
            try:
                q, p = float(quota.strip()), float(period.strip())
            except ValueError:
                return None
            return q / p if q > 0 and p > 0 else None
    return None


def _cgroup_quota(read: Callable[[str], Optional[str]], root: str,
                  self_cgroup: Optional[str]) -> Optional[float]:
    """Smallest CPU quota (in cores) among the root cgroup and this process's own groups."""
    groups = {""}
    for line in (self_cgroup or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) == 3 and (fields[1] == "" or "cpu" in fields[1].split(",")):
            groups.add(fields[2])
    quotas = [q for g in sorted(groups) for q in [_quota_from_files(read, root, g)] if q]
    return min(quotas) if quotas else None


def cpu_capability(cpuinfo: Optional[str] = None, cgroup_root: str = "/sys/fs/cgroup",
                   cores: Optional[float] = None, *, self_cgroup: Optional[str] = None,
                   read_file: Optional[Callable[[str], Optional[str]]] = None,
                   name: str = "/CPU:0") -> DeviceCapability:
    """Estimates the nominal FP32 peak of this machine's CPU (as seen by this process).

    Args:
        cpuinfo: text of /proc/cpuinfo; read from the file when None.
        cgroup_root: where cgroup files are read from (default "/sys/fs/cgroup").
        cores: usable cores; when None, min(logical CPUs, cgroup quota, CPU affinity).
        self_cgroup: text of /proc/self/cgroup; read from the file when None.
        read_file: function path -> text or None, used for every cgroup/proc read (tests
            inject a fake file system); defaults to reading the real files.
        name: the device name to record.

    Returns:
        A `DeviceCapability` with kind "CPU" and `details` holding cores, GHz, FLOPs/cycle.

    Raises:
        ValueError: if `cores` is given and not > 0.

    Example:
        >>> info = "processor : 0\\nflags : avx avx2 fma\\ncpu MHz : 2000.0\\n"
        >>> cpu_capability(info, cgroup_root="/nonexistent", cores=4).peak_flops
        256000000000.0
    """
    read = read_file or _read_text
    if cpuinfo is None:
        cpuinfo = read("/proc/cpuinfo") or ""
    processors, flags, ghz, model = _parse_cpuinfo(cpuinfo)
    details = {"model": model}
    if cores is not None:
        if not float(cores) > 0:
            raise ValueError(f"`cores` must be > 0. Received: cores={cores!r}")
        usable = float(cores)
        details["cores_source"] = "argument"
    else:
        usable = float(processors or os.cpu_count() or 1)
        details["logical_cpus"] = usable
        if read_file is None and hasattr(os, "sched_getaffinity"):
            usable = min(usable, float(len(os.sched_getaffinity(0))))
        if self_cgroup is None:
            self_cgroup = read("/proc/self/cgroup")
        quota = _cgroup_quota(read, cgroup_root, self_cgroup)
        if quota is not None:
            details["cgroup_quota_cores"] = quota
            usable = min(usable, quota)
    if ghz is None:
        ghz = 2.0
        details["ghz_source"] = "default 2.0 GHz (no clock found)"
        logger.debug("No CPU clock found in cpuinfo; assuming 2.0 GHz.")
    per_cycle, isa = _flops_per_cycle(flags)
    details.update(cores=usable, ghz=ghz, flops_per_cycle=per_cycle, isa=isa)
    return DeviceCapability(name, "CPU", usable * ghz * 1e9 * per_cycle, details)


class _GpuRow(NamedTuple):
    """One row of the GPU table; the peaks are the vendor's, in TFLOP/s."""

    key: str  # Whole words of the device name, upper case, "-" read as a space.
    fp32: float  # Dense FP32 (CUDA cores).
    tf32: float  # TF32 tensor cores, dense (no sparsity); = fp32 where TF32 is no faster.
    mig_slices: int = 7  # Compute slices of the whole GPU under MIG (A30: 4).


# A row matches when its key occurs as whole words in the normalized device name; the first
# match wins, so a longer key ("H100 PCIE", "RTX 5070 TI") comes before the key it contains
# ("H100", "RTX 5070"); tests/test_devices.py checks that no key is shadowed by an earlier one.
# Sparsity-doubled vendor figures are halved to the dense rate.
_GPU_TABLE = (
    # NVIDIA HGX B200 datasheet, per GPU: FP32 75 TFLOPS, TF32 Tensor Core 2.2 PFLOPS (sparse).
    _GpuRow("B200", 75.0, 1100.0),
    # NVIDIA H200 datasheet: SXM FP32 67, TF32 989 (sparse); NVL FP32 60, TF32 835 (sparse).
    _GpuRow("H200 NVL", 60.0, 417.5), _GpuRow("H200", 67.0, 494.7),
    _GpuRow("GH200", 67.0, 494.7),
    # NVIDIA H100 datasheet: SXM FP32 67, TF32 989; PCIe 51, 756; NVL 60, 835 (TF32 sparse).
    _GpuRow("H100 PCIE", 51.2, 378.0), _GpuRow("H100 NVL", 60.0, 417.5),
    _GpuRow("H100", 66.9, 494.7),
    # NVIDIA H800 datasheet: the H100's compute (SXM FP32 67, TF32 989; PCIe 51, 756 sparse).
    _GpuRow("H800 PCIE", 51.2, 378.0), _GpuRow("H800", 66.9, 494.7),
    # NVIDIA HGX H20 product brief: FP32 44 TFLOPS, TF32 Tensor Core 74 TFLOPS (dense).
    _GpuRow("H20", 44.0, 74.0),
    # NVIDIA L40S / L40 / L4 datasheets: FP32 91.6 / 90.5 / 30.3; TF32 366 / 181 / 120 (sparse).
    _GpuRow("L40S", 91.6, 183.0), _GpuRow("L40", 90.5, 90.5), _GpuRow("L4", 30.3, 60.0),
    _GpuRow("A100", 19.5, 156.0), _GpuRow("A800", 19.5, 156.0), _GpuRow("A10G", 31.2, 35.0),
    _GpuRow("A10", 31.2, 62.5), _GpuRow("A30", 10.3, 82.0, mig_slices=4),
    _GpuRow("A40", 37.4, 74.8), _GpuRow("A16", 4.5, 18.0), _GpuRow("A2", 4.5, 9.0),
    _GpuRow("RTX 6000 ADA", 91.1, 91.1), _GpuRow("RTX A6000", 38.7, 38.7),
    _GpuRow("RTX A5000", 27.8, 27.8),
    # NVIDIA RTX Blackwell GPU Architecture whitepaper, appendix: peak FP32 (non-tensor) TFLOPS
    # 104.8 / 56.3 / 43.9 / 30.9; GeForce TF32 tensor (dense) runs at that same rate.
    _GpuRow("RTX 5090", 104.8, 104.8), _GpuRow("RTX 5080", 56.3, 56.3),
    _GpuRow("RTX 5070 TI", 43.9, 43.9), _GpuRow("RTX 5070", 30.9, 30.9),
    _GpuRow("RTX 4090", 82.6, 82.6), _GpuRow("RTX 4080", 48.7, 48.7),
    _GpuRow("RTX 4070 TI", 40.1, 40.1), _GpuRow("RTX 4070", 29.1, 29.1),
    _GpuRow("RTX 4060 TI", 22.1, 22.1), _GpuRow("RTX 4060", 15.1, 15.1),
    _GpuRow("RTX 3090 TI", 40.0, 40.0), _GpuRow("RTX 3090", 35.6, 35.6),
    _GpuRow("RTX 3080 TI", 34.1, 34.1), _GpuRow("RTX 3080", 29.8, 29.8),
    _GpuRow("RTX 3070", 20.3, 20.3), _GpuRow("RTX 3060 TI", 16.2, 16.2),
    _GpuRow("RTX 3060", 12.7, 12.7), _GpuRow("RTX 2080 TI", 13.4, 13.4),
    _GpuRow("RTX 2080", 10.1, 10.1), _GpuRow("RTX 2070", 7.5, 7.5), _GpuRow("RTX 2060", 6.5, 6.5),
    _GpuRow("TITAN RTX", 16.3, 16.3), _GpuRow("TITAN V", 14.9, 14.9),
    _GpuRow("V100S", 16.4, 16.4), _GpuRow("V100", 15.7, 15.7), _GpuRow("T4", 8.1, 8.1),
    _GpuRow("P100", 9.3, 9.3), _GpuRow("P40", 11.8, 11.8), _GpuRow("P4", 5.5, 5.5),
    _GpuRow("K80", 4.1, 4.1), _GpuRow("GTX 1080 TI", 11.3, 11.3), _GpuRow("GTX 1080", 8.9, 8.9),
    _GpuRow("GTX 1070", 6.5, 6.5),
)

# Fallback by compute capability major version: a modest mid-range card of that generation.
_CC_FALLBACK = {3: 4.0, 5: 5.0, 6: 8.0, 7: 12.0, 8: 25.0, 9: 60.0, 10: 80.0, 12: 80.0}

# Compute slices of a whole GPU when the device name names a MIG slice but no GPU in the table
# (A100, A800, H100, H800, H20, H200, GH200 and B200 have 7; the A30 has 4).
DEFAULT_MIG_SLICES = 7

# A MIG device as CUDA (and so TensorFlow's `device_name`) and NVML name it: the GPU's name,
# then "MIG", then the profile: "<g>g.<mem>gb" for a GPU instance with one compute instance,
# "<c>c.<g>g.<mem>gb" for a compute instance of c of the g slices, optionally "+me" etc.
# (NVIDIA MIG User Guide, "MIG Device Names"). E.g. "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
# "A100-SXM4-40GB MIG 4c.7g.40gb", "NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", "MIG 3g.20gb".
_MIG_PROFILE = re.compile(r"(?:^|\s)MIG\s+(?:(\d+)c\.)?(\d+)g\.(\d+)gb(\+[\w.]+)?(?=\s|$)",
                          re.IGNORECASE)
_MIG_WORD = re.compile(r"(?:^|\s)MIG(?:\s|$)", re.IGNORECASE)


def _normalized(name: str) -> str:
    return " ".join(str(name).upper().replace("-", " ").split())


def _table_row(device_name: str) -> Optional[_GpuRow]:
    """The first table row whose key occurs as whole words in the device name, or None."""
    upper = _normalized(device_name)
    for row in _GPU_TABLE:
        if re.search(r"(^|\s)" + re.escape(row.key) + r"($|\s)", upper):
            return row
    return None


def _mig_share(device_name: str, total: int) -> Tuple[Optional[str], float]:
    """(MIG profile or None, the slice's share of the whole GPU's compute)."""
    found = _MIG_PROFILE.search(device_name)
    if found is None:
        if _MIG_WORD.search(device_name):
            raise ValueError(
                f"`device_name` {device_name!r} names a MIG device but no profile such as "
                "'1g.5gb' or '1c.3g.20gb' was found in it. Pass the name TensorFlow reports "
                "(get_device_details(gpu)['device_name']), or build DeviceCapability(name, "
                "'GPU', peak_flops=...) yourself.")
        return None, 1.0
    compute, instance = int(found.group(1) or found.group(2)), int(found.group(2))
    if not 1 <= compute <= instance <= total:
        raise ValueError(
            f"`device_name` {device_name!r}: MIG profile {found.group(0).strip()!r} uses "
            f"{compute} compute slice(s) of a {instance}-slice GPU instance, but the whole GPU "
            f"has {total} compute slices. Fix: check the device name, or build "
            "DeviceCapability(name, 'GPU', peak_flops=...) yourself.")
    return found.group(0).strip(), compute / total


def gpu_capability(device_name: str, compute_capability: Optional[Tuple[int, int]] = None,
                   tf32: bool = True) -> DeviceCapability:
    """Nominal FP32 peak of a GPU or MIG slice, from its name, or its compute capability.

    A MIG slice ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "... MIG 1c.3g.20gb") gets its share
    of the whole GPU's peak: its compute slices (the ``c`` of ``c.g``, else the ``g``) over the
    whole GPU's compute slices (7; the A30 has 4; 7 when the GPU is not in the table).

    Args:
        device_name: e.g. `get_device_details(gpu)["device_name"]`, "Tesla T4".
        compute_capability: e.g. (8, 0); used for the TF32 decision and the fallback.
        tf32: whether TensorFlow runs float32 matmuls in TF32
            (`tf.config.experimental.tensor_float_32_execution_enabled()`, on by default); on
            Ampere and newer (cc >= 8.0) the float32 matmul peak is then the TF32 tensor-core
            rate (dense). Default True.

    Returns:
        A `DeviceCapability` with kind "GPU"; `details` names the table row, the MIG
        profile and share (None and 1.0 for a whole GPU) and whether TF32 was used.

    Raises:
        ValueError: the GPU is unknown by name and no compute capability is given, or the
            name has a MIG profile that cannot be a slice of that GPU.

    Example:
        >>> gpu_capability("Tesla T4", (7, 5)).peak_flops
        8100000000000.0
        >>> gpu_capability("NVIDIA A100-SXM4-40GB MIG 1g.5gb", (8, 0), tf32=False).peak_flops
        2785714285714.2856
    """
    cc = tuple(int(v) for v in compute_capability) if compute_capability else None
    whole_name = _MIG_PROFILE.sub(" ", str(device_name))
    row = _table_row(whole_name)
    profile, share = _mig_share(str(device_name), row.mig_slices if row else DEFAULT_MIG_SLICES)
    if row is not None:
        ampere_plus = cc[0] >= 8 if cc else row.tf32 != row.fp32
        use_tf32 = bool(tf32 and ampere_plus)
        tflops = row.tf32 if use_tf32 else row.fp32
        return DeviceCapability(device_name, "GPU", tflops * share * 1e12, {
            "table": row.key, "compute_capability": cc, "tf32": use_tf32, "mig": profile,
            "mig_share": share})
    if cc is None:
        raise ValueError(
            f"`device_name` {device_name!r} is not in the GPU table and no "
            "`compute_capability` was given. Pass compute_capability=(major, minor), or build "
            "DeviceCapability(name, 'GPU', peak_flops=...) yourself.")
    major = max([m for m in _CC_FALLBACK if m <= cc[0]] or [min(_CC_FALLBACK)])
    tflops = _CC_FALLBACK[major] * (2.0 if tf32 and cc[0] >= 8 else 1.0) * share
    logger.info("GPU %r not in the table; estimating %.1f TFLOP/s from compute capability %s%s.",
                device_name, tflops, cc,
                f" and its MIG share {share:.3g} (of {DEFAULT_MIG_SLICES} slices)" if profile
                else "")
    return DeviceCapability(device_name, "GPU", tflops * 1e12, {
        "table": None, "compute_capability": cc, "tf32": bool(tf32 and cc[0] >= 8),
        "mig": profile, "mig_share": share})
