"""Which GPUs each task of a local launch sees: the ``gpus`` setting, checked and assigned.

A launch sets ``CUDA_VISIBLE_DEVICES`` per task, so that local workers do not all use all
GPUs. The GPUs the launcher can hand out (its *visible list*) are, in order:

* the entries of the launcher's own ``CUDA_VISIBLE_DEVICES`` when it is set (indices or
  UUIDs, up to the first negative entry, as CUDA reads it; ``""`` means none); else
* the GPUs of ``nvidia-smi -L``, in its order, each named by its UUID (so that the choice does
  not depend on ``CUDA_DEVICE_ORDER``); a GPU in MIG mode contributes its MIG devices instead.

The launcher counts GPUs without importing TensorFlow. ``gpus`` takes these forms (the
command line's ``--gpus`` takes the text forms):

* ``None`` or ``"auto"`` (default): one GPU per worker, worker ``i`` gets visible GPU ``i``.
  With fewer GPUs than workers the workers beyond the count run CPU-only (a warning names
  them; two TensorFlow processes on one GPU each try to take most of its memory, so sharing
  is only done when asked for, e.g. ``"0|0"``). With no visible GPU, or when ``env`` sets
  ``CUDA_VISIBLE_DEVICES``, no task's variable is touched.
* ``"0,1|2,3"`` (or ``[[0, 1], [2, 3]]``): one group per worker, separated by ``|``; a group
  lists positions in the visible list (worker 0 sees GPUs 0 and 1, worker 1 sees 2 and 3); an
  empty group or ``none`` makes that worker CPU-only, e.g. ``"0|1|"`` for three workers.
* ``"none"``: every task CPU-only (``CUDA_VISIBLE_DEVICES=""``).
* ``"all"``: no task's variable is touched; every task sees what the launcher sees.

With parameter servers the groups are the worker tasks'; the chief (which only coordinates)
and the parameter servers (which hold variables) get ``CUDA_VISIBLE_DEVICES=""`` whenever GPUs
are assigned; pass ``"all"`` (and assign devices in the script) to give them GPUs.

Pure Python stdlib: no TensorFlow.
"""

import dataclasses
import logging
import re
import subprocess
from typing import Callable, List, Optional, Sequence, Tuple, Union

from tf_hetbatch.launch.cluster import CUDA_ENV

logger = logging.getLogger(__name__)

# `nvidia-smi -L` answers in well under a second; a hung driver must not hold the launch.
NVIDIA_SMI_TIMEOUT_S = 10.0

Groups = Sequence[Optional[Sequence[int]]]
GpuSetting = Union[None, str, Groups]

_FORM = ("'auto', 'all', 'none', or one group per worker separated by '|', each group GPU "
         "indices separated by ',' (empty or 'none': CPU-only), e.g. '0,1|2,3' or '0|1|'")
_GPU_LINE = re.compile(r"^GPU\s+(\d+):.*?(?:\(UUID:\s*([^)\s]+)\))?\s*$")
_MIG_LINE = re.compile(r"^\s+MIG\s.*\(UUID:\s*([^)\s]+)\)")


@dataclasses.dataclass(frozen=True)
class VisibleGpus:
    """The GPUs the launcher can hand out.

    Attributes:
        entries: what a task's ``CUDA_VISIBLE_DEVICES`` lists for each, by position.
        source: where they come from, for messages, e.g. ``"nvidia-smi -L"``.
    """

    entries: Tuple[str, ...]
    source: str


def cuda_visible_entries(value: str) -> Tuple[str, ...]:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value names, as CUDA reads it: entries up to
    the first negative one (``"-1"`` hides every GPU), blanks dropped."""
    entries = []
    for entry in (e.strip() for e in value.split(",")):
        if re.fullmatch(r"-\d+", entry):
            break
        if entry:
            entries.append(entry)
    return tuple(entries)


def parse_nvidia_smi_list(text: str) -> Tuple[str, ...]:
    """The GPUs in ``nvidia-smi -L`` output, each by UUID (by index if it has none); a GPU
    with MIG devices listed under it is replaced by their UUIDs (drivers before 470 print
    ``MIG-GPU-<uuid>/<gi>/<ci>``, later ones ``MIG-<uuid>``; both are valid entries)."""
    gpus: List[List[str]] = []  # Per GPU: [its own entry, its MIG devices...]
    for line in text.splitlines():
        gpu = _GPU_LINE.match(line)
        if gpu:
            gpus.append([gpu.group(2) or gpu.group(1)])
            continue
        mig = _MIG_LINE.match(line)
        if mig and gpus:
            gpus[-1].append(mig.group(1))
    return tuple(e for gpu in gpus for e in (gpu[1:] or gpu[:1]))


def run_nvidia_smi(timeout: float = NVIDIA_SMI_TIMEOUT_S) -> Tuple[Optional[str], str]:
    """Runs ``nvidia-smi -L``: (its output, or None if it is missing or failed; a note)."""
    try:
        proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return None, "no nvidia-smi on PATH"
    except subprocess.TimeoutExpired:
        logger.warning("nvidia-smi -L did not answer in %g s; assigning no GPUs.", timeout)
        return None, f"nvidia-smi -L timed out after {timeout:g} s"
    except OSError as e:
        return None, f"nvidia-smi -L could not run ({e})"
    if proc.returncode != 0:
        return None, f"nvidia-smi -L exited {proc.returncode}"
    return proc.stdout, "nvidia-smi -L"


def visible_gpus(environ, run: Callable[[], Tuple[Optional[str], str]] = run_nvidia_smi
                 ) -> VisibleGpus:
    """The launcher's visible list (see the module docstring).

    Args:
        environ: the launcher's environment (``os.environ``).
        run: returns ``nvidia-smi -L``'s output (or None) and a note; tests inject one.
    """
    if CUDA_ENV in environ:
        return VisibleGpus(cuda_visible_entries(environ[CUDA_ENV]),
                           f"the launcher's {CUDA_ENV}={environ[CUDA_ENV]!r}")
    text, note = run()
    return VisibleGpus(parse_nvidia_smi_list(text) if text is not None else (), note)


@dataclasses.dataclass(frozen=True)
class GpuPlan:
    """Which GPUs each task sees.

    Attributes:
        visible: the launcher's visible list.
        groups: per worker, positions in ``visible.entries`` (empty: CPU-only); None: no
            task's ``CUDA_VISIBLE_DEVICES`` is set (they inherit the launcher's).
        reason: why ``groups`` is None, for the log line.
    """

    visible: VisibleGpus
    groups: Optional[Tuple[Tuple[int, ...], ...]]
    reason: str = ""

    def env_value(self, role: str, index: int) -> Optional[str]:
        """``CUDA_VISIBLE_DEVICES`` of task ``role:index``, or None to leave it alone."""
        if self.groups is None:
            return None
        if role != "worker":
            return ""
        return ",".join(self.visible.entries[k] for k in self.groups[index])

    def lines(self, ps_mode: bool) -> List[str]:
        """One line per worker, e.g. ``"worker 1: GPUs 2,3"`` (and one for chief and ps)."""
        if self.groups is None:
            return [f"GPUs not assigned ({self.reason}): every task inherits the launcher's "
                    f"{CUDA_ENV}"]
        out = []
        for i, group in enumerate(self.groups):
            value = self.env_value("worker", i)
            if not group:
                out.append(f"worker {i}: no GPU ({CUDA_ENV}='')")
                continue
            names = ",".join(str(k) for k in group)
            line = f"worker {i}: GPU{'s' if len(group) > 1 else ''} {names}"
            out.append(line if value == names else f"{line} ({CUDA_ENV}={value})")
        if ps_mode:
            out.append(f"chief and ps: no GPU ({CUDA_ENV}='')")
        return out


def _check_index(value, i: int, setting, visible: VisibleGpus) -> int:
    """One index (text or int) of group ``i``, checked against the visible list."""
    n = len(visible.entries)
    valid = f"0-{n - 1}" if n > 1 else "0" if n else "none"
    try:
        if isinstance(value, bool):
            raise ValueError
        index = int(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"`gpus` (--gpus) group {i} has {value!r}, not a GPU index. Received: "
            f"gpus={setting!r}. Fix: use {_FORM}.") from None
    if not 0 <= index < n:
        sees = (f"{n} GPU{'s' if n > 1 else ''} (from {visible.source}), numbered {valid}"
                if n else f"no GPU ({visible.source})")
        fix = (f"use indices {valid}, positions in that list" if n else
               "leave gpus unset (tasks keep the launcher's environment) or pass 'none'")
        raise ValueError(
            f"`gpus` (--gpus) group {i} names GPU {value!r}, but the launcher sees {sees}. "
            f"Received: gpus={setting!r}. Fix: {fix}.")
    return index


def _groups(setting, num_workers: int) -> List[Sequence]:
    """The raw groups of an explicit setting, one per worker (syntax only)."""
    if isinstance(setting, str):
        raw = [g.strip() for g in setting.split("|")]
        groups = [[] if g.lower() in ("", "none") else [v.strip() for v in g.split(",")]
                  for g in raw]
    elif isinstance(setting, (list, tuple)):
        groups = []
        for i, g in enumerate(setting):
            if g is None:
                g = []
            if isinstance(g, (str, bytes)) or not isinstance(g, (list, tuple)):
                raise TypeError(f"`gpus` group {i} must be a list of GPU indices (or None "
                                f"for CPU-only). Received: gpus={setting!r}")
            groups.append(list(g))
    else:
        raise TypeError(f"`gpus` must be None, a string ({_FORM}) or a list of index lists. "
                        f"Received: gpus={setting!r}")
    if len(groups) != num_workers:
        raise ValueError(
            f"`gpus` (--gpus) gives {len(groups)} group{'s' if len(groups) != 1 else ''} "
            f"for {num_workers} worker{'s' if num_workers != 1 else ''}: it needs one group "
            f"per worker, separated by '|'. Received: gpus={setting!r}. Fix: e.g. "
            f"{'|'.join(str(i) for i in range(num_workers))!r}, '' for a CPU-only worker.")
    return groups


def assign_gpus(setting: GpuSetting, num_workers: int,
                detect: Callable[[], VisibleGpus], env_sets_cuda: bool = False) -> GpuPlan:
    """Checks ``gpus`` (see the module docstring) and decides each worker's GPUs.

    Args:
        setting: the ``gpus`` argument of :func:`tf_hetbatch.launch.launch`.
        num_workers: worker tasks, >= 1.
        detect: returns the launcher's visible list; called only if the setting needs it.
        env_sets_cuda: the ``env`` argument of the launch sets ``CUDA_VISIBLE_DEVICES`` for
            every task; then ``gpus`` must be left unset (or ``"all"``).

    Returns:
        A :class:`GpuPlan`. The same inputs always give the same plan.

    Raises:
        ValueError: a malformed group, a wrong number of groups, an index outside the
            visible list, an index twice in one group, or ``gpus`` given along with an
            ``env`` that sets ``CUDA_VISIBLE_DEVICES``.
        TypeError: ``gpus`` of the wrong type.
    """
    mode = setting.strip().lower() if isinstance(setting, str) else setting
    none_seen = VisibleGpus((), "not looked up")
    if mode in (None, "auto") and env_sets_cuda:
        return GpuPlan(none_seen, None, f"env sets {CUDA_ENV}")
    if env_sets_cuda and mode != "all":
        raise ValueError(f"`gpus` and an `env` that sets {CUDA_ENV} both choose the tasks' "
                         f"GPUs. Received: gpus={setting!r}. Fix: drop one of them.")
    if mode == "all":
        return GpuPlan(none_seen, None, "gpus='all'")
    if mode == "none":
        return GpuPlan(none_seen, ((),) * num_workers)
    visible = detect()
    n = len(visible.entries)
    if mode in (None, "auto"):
        if not n:
            return GpuPlan(visible, None, f"no GPU found: {visible.source}")
        if n < num_workers:
            extra = ", ".join(str(i) for i in range(n, num_workers))
            logger.warning("%d GPU%s for %d workers (from %s): worker%s %s run%s CPU-only. To "
                           "share GPUs instead, pass gpus explicitly, e.g. '0|0'.", n,
                           "" if n == 1 else "s", num_workers, visible.source,
                           "s" if num_workers - n > 1 else "", extra,
                           "" if num_workers - n > 1 else "s")
        return GpuPlan(visible, tuple((i,) if i < n else () for i in range(num_workers)))
    groups = []
    for i, raw in enumerate(_groups(setting, num_workers)):
        group = tuple(_check_index(v, i, setting, visible) for v in raw)
        if len(set(group)) != len(group):
            raise ValueError(f"`gpus` (--gpus) group {i} names a GPU twice: {list(group)}. "
                             f"Received: gpus={setting!r}. Fix: list each GPU once.")
        groups.append(group)
    return GpuPlan(visible, tuple(groups))
