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
- GPU peak = the vendor's dense FP32 number, or the TF32 tensor-core number on Ampere and
  newer when TF32 is enabled (TensorFlow's default), from the table below; unknown GPUs
  fall back to a per-compute-capability estimate.

No TensorFlow import here: pass `tf.config.experimental.get_device_details(device)` values in.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Callable, Mapping, Optional, Tuple

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


# Dense FP32 peak and TF32 tensor peak (dense, no sparsity) in TFLOP/s, vendor numbers.
# Matched by the first key contained in the upper-cased device name (order matters).
_GPU_TABLE = (
    ("H200", 67.0, 494.7), ("H100 PCIE", 51.2, 378.0), ("H100", 66.9, 494.7),
    ("GH200", 67.0, 494.7), ("L40S", 91.6, 183.0), ("L40", 90.5, 90.5), ("L4", 30.3, 60.0),
    ("A100", 19.5, 156.0), ("A800", 19.5, 156.0), ("A10G", 31.2, 35.0), ("A10", 31.2, 62.5),
    ("A30", 10.3, 82.0), ("A40", 37.4, 74.8), ("A16", 4.5, 18.0), ("A2", 4.5, 9.0),
    ("RTX 6000 ADA", 91.1, 91.1), ("RTX A6000", 38.7, 38.7), ("RTX A5000", 27.8, 27.8),
    ("RTX 4090", 82.6, 82.6), ("RTX 4080", 48.7, 48.7), ("RTX 4070 TI", 40.1, 40.1),
    ("RTX 4070", 29.1, 29.1), ("RTX 4060 TI", 22.1, 22.1), ("RTX 4060", 15.1, 15.1),
    ("RTX 3090 TI", 40.0, 40.0), ("RTX 3090", 35.6, 35.6), ("RTX 3080 TI", 34.1, 34.1),
    ("RTX 3080", 29.8, 29.8), ("RTX 3070", 20.3, 20.3), ("RTX 3060 TI", 16.2, 16.2),
    ("RTX 3060", 12.7, 12.7), ("RTX 2080 TI", 13.4, 13.4), ("RTX 2080", 10.1, 10.1),
    ("RTX 2070", 7.5, 7.5), ("RTX 2060", 6.5, 6.5), ("TITAN RTX", 16.3, 16.3),
    ("TITAN V", 14.9, 14.9), ("V100S", 16.4, 16.4), ("V100", 15.7, 15.7), ("T4", 8.1, 8.1),
    ("P100", 9.3, 9.3), ("P40", 11.8, 11.8), ("P4", 5.5, 5.5), ("K80", 4.1, 4.1),
    ("GTX 1080 TI", 11.3, 11.3), ("GTX 1080", 8.9, 8.9), ("GTX 1070", 6.5, 6.5),
)

# Fallback by compute capability major version: a modest mid-range card of that generation.
_CC_FALLBACK = {3: 4.0, 5: 5.0, 6: 8.0, 7: 12.0, 8: 25.0, 9: 60.0, 10: 80.0, 12: 80.0}


def gpu_capability(device_name: str, compute_capability: Optional[Tuple[int, int]] = None,
                   tf32: bool = True) -> DeviceCapability:
    """Nominal FP32 peak of a GPU, from its name, or its compute capability as a fallback.

    Args:
        device_name: e.g. `get_device_details(gpu)["device_name"]`, "Tesla T4".
        compute_capability: e.g. (8, 0); used for the TF32 decision and the fallback.
        tf32: whether TF32 is enabled (TensorFlow's default); on Ampere+ (cc >= 8.0) the
            float32 matmul peak is then the TF32 tensor-core rate.

    Returns:
        A `DeviceCapability` with kind "GPU".

    Raises:
        ValueError: if the GPU is unknown by name and no compute capability is given.

    Example:
        >>> gpu_capability("Tesla T4", (7, 5)).peak_flops
        8100000000000.0
    """
    upper = " ".join(str(device_name).upper().replace("-", " ").split())
    cc = tuple(int(v) for v in compute_capability) if compute_capability else None
    for key, fp32, tensor32 in _GPU_TABLE:
        if re.search(r"(^|\s)" + re.escape(key) + r"($|\s)", upper):
            ampere_plus = cc[0] >= 8 if cc else tensor32 != fp32
            use_tf32 = tf32 and ampere_plus
            tflops = tensor32 if use_tf32 else fp32
            return DeviceCapability(device_name, "GPU", tflops * 1e12, {
                "table": key, "compute_capability": cc, "tf32": use_tf32})
    if cc is None:
        raise ValueError(
            f"`device_name` {device_name!r} is not in the GPU table and no "
            "`compute_capability` was given. Pass compute_capability=(major, minor), or build "
            "DeviceCapability(name, 'GPU', peak_flops=...) yourself.")
    major = max([m for m in _CC_FALLBACK if m <= cc[0]] or [min(_CC_FALLBACK)])
    tflops = _CC_FALLBACK[major] * (2.0 if tf32 and cc[0] >= 8 else 1.0)
    logger.info("GPU %r not in the table; estimating %.1f TFLOP/s from compute capability %s.",
                device_name, tflops, cc)
    return DeviceCapability(device_name, "GPU", tflops * 1e12, {
        "table": None, "compute_capability": cc, "tf32": bool(tf32 and cc[0] >= 8)})
