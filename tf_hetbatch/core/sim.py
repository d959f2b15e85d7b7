"""Simulator of a synchronous (BSP) heterogeneous data-parallel cluster, driven by a controller.

Each step, replica k does CPU work `(alpha_k + beta_k * b_k) * slowdown * noise` (its compute)
and then its part of the step's collective, `collective_k * slowdown * noise`; the step ends
when the slowest replica's collective part is done, plus `allreduce` seconds of network. It
models the effects a model of compute times misses (BUILD_NOTES, "The batch-size
controller"):

- a CPU quota spent in periods: a replica with quota q runs at full speed until it has
  used q * period of CPU in the current period, then waits for the next one (cgroup CFS);
  its wall time is a staircase in its work, phase-locked to the step (a throttled process
  that waited for the others starts each step alike);
- a collective that waits for the slowest worker: the collective's CPU work of a throttled
  replica is stretched (and quantised) too, and it shows in the step time only, not in the
  measured compute times (from a replica's release to its gradients being ready);
- the lag of a switch and the windows straddling it: new sizes apply `switch_lag` steps after
  the decision, and, as `DynamicBatching` does, a window that started before then is not fed
  to the controller unless its samples per step already equal the new split
  (`measurements.straddles_switch`);
- per-step noise: every replica-step's work is scaled by a uniform draw in
  [1 - noise, 1 + noise].

Every `adjust_every` steps the controller receives what `DynamicBatching` gives it: the window
means of samples and compute seconds per replica and, as `step_time=`, the window's mean step
time (every controller takes it: `protocols.Controller`). Pure numpy, vectorised over replicas.

Example:
    >>> from tf_hetbatch.core.controllers import ModelBasedController
    >>> cluster = ClusterModel(alpha=[0.0, 0.0, 0.0], beta=[1e-3, 2e-3, 4e-3])
    >>> result = simulate(ModelBasedController(), cluster, steps=60, initial_sizes=[64, 64, 64])
    >>> result.sizes[-1].tolist()
    [110, 55, 27]
"""

from __future__ import annotations

import dataclasses
import logging
from typing import List, Mapping, Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike

from tf_hetbatch.core import split as _split
from tf_hetbatch.core._validate import check_int, format_value
from tf_hetbatch.core.measurements import straddles_switch

logger = logging.getLogger(__name__)

__all__ = ["Slowdown", "ClusterModel", "SimResult", "simulate", "ideal_split", "best_split",
           "Scenario", "SCENARIOS", "scenario"]

# Bisection steps of `best_split` on the step time: 2**-60 of the bracket is below double
# precision.
_BISECTION_STEPS = 60


@dataclasses.dataclass(frozen=True)
class Slowdown:
    """Replica `replica` runs `factor` times slower for steps in [start, end) (end None: forever).

    A one-step `Slowdown(k, s, s + 1, 10.0)` is a single outlier.
    """

    replica: int
    start: int
    end: Optional[int] = None
    factor: float = 2.0

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"`factor` must be > 0. Received: factor={self.factor!r}")
        if self.start < 0 or (self.end is not None and self.end <= self.start):
            raise ValueError(f"`Slowdown` needs 0 <= start < end. Received: start={self.start}, "
                             f"end={self.end}")


def _per_replica(name, value, num, default, low, low_open, high=None):
    arr = np.broadcast_to(np.asarray(default if value is None else value, np.float64),
                          (num,)).copy() if np.ndim(value) == 0 else np.asarray(value, np.float64)
    bad = arr.shape != (num,) or not np.all(np.isfinite(arr)) or np.any(
        arr <= low if low_open else arr < low) or (high is not None and np.any(arr > high))
    if bad:
        rule = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high else "")
        raise ValueError(f"`{name}` must be one finite number {rule} per replica ({num}), or "
                         f"one for all. Received: {name}={format_value(value)}")
    return arr


@dataclasses.dataclass(frozen=True, eq=False)
class ClusterModel:
    """True per-replica time model of a simulated cluster.

    Args:
        alpha: per-replica fixed CPU seconds of compute per step (>= 0), length K.
        beta: per-replica CPU seconds per sample (> 0), length K.
        noise: multiplicative per-step noise: each replica-step's work is scaled by a uniform
            draw in [1 - noise, 1 + noise]; in [0, 1).
        slowdowns: `Slowdown`s (interference, throttling, single outliers).
        losses: {replica: step}; the replica is gone from that step on and the global batch
            is re-split over the survivors.
        allreduce: seconds of network added to every step.
        collective: CPU seconds of each replica's part of the step's collective (done after
            its compute, not in its measured compute time), one per replica or one for all.
        quota: CPU share of each replica in (0, 1] (1: no quota), one per replica or one for
            all; None for none.
        quota_period: seconds of a quota period (cgroup `cpu.cfs_period_us`), > 0.
    """

    alpha: np.ndarray
    beta: np.ndarray
    noise: float = 0.0
    slowdowns: Tuple[Slowdown, ...] = ()
    losses: Mapping[int, int] = dataclasses.field(default_factory=dict)
    allreduce: float = 0.0
    collective: ArrayLike = 0.0
    quota: Optional[ArrayLike] = None
    quota_period: float = 0.01

    def __post_init__(self):
        alpha = np.array(self.alpha, dtype=np.float64, ndmin=1)
        beta = np.array(self.beta, dtype=np.float64, ndmin=1)
        if alpha.shape != beta.shape or alpha.ndim != 1:
            raise ValueError(f"`alpha` and `beta` must be 1-D with one entry per replica. "
                             f"Received shapes {alpha.shape} and {beta.shape}.")
        if np.any(alpha < 0) or not np.all(np.isfinite(alpha)):
            raise ValueError(f"`alpha` must be finite and >= 0. "
                             f"Received: alpha={format_value(alpha)}")
        if np.any(beta <= 0) or not np.all(np.isfinite(beta)):
            raise ValueError(f"`beta` must be finite and > 0. Received: beta={format_value(beta)}")
        if not 0 <= self.noise < 1:
            raise ValueError(f"`noise` must be in [0, 1). Received: noise={self.noise!r}")
        num = alpha.size
        for s in self.slowdowns:
            if not 0 <= s.replica < num:
                raise ValueError(f"`Slowdown.replica` must be in [0, {num}). "
                                 f"Received: replica={s.replica}")
        if set(self.losses) and (min(self.losses) < 0 or max(self.losses) >= num):
            raise ValueError(f"`losses` keys must be replica indices in [0, {num}). "
                             f"Received: losses={dict(self.losses)!r}")
        if len(self.losses) >= num:
            raise ValueError("`losses` must leave at least one replica alive.")
        if not (isinstance(self.allreduce, (int, float)) and self.allreduce >= 0):
            raise ValueError(f"`allreduce` must be a number of seconds >= 0. "
                             f"Received: allreduce={self.allreduce!r}")
        if not (isinstance(self.quota_period, (int, float)) and self.quota_period > 0):
            raise ValueError(f"`quota_period` must be a number of seconds > 0, e.g. 0.01. "
                             f"Received: quota_period={self.quota_period!r}")
        collective = _per_replica("collective", self.collective, num, 0.0, 0.0, False)
        quota = _per_replica("quota", self.quota, num, 1.0, 0.0, True, 1.0)
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "beta", beta)
        object.__setattr__(self, "collective", collective)
        object.__setattr__(self, "quota", quota)
        object.__setattr__(self, "slowdowns", tuple(self.slowdowns))
        object.__setattr__(self, "losses", dict(self.losses))

    @property
    def num_replicas(self) -> int:
        return int(self.alpha.size)

    def factors(self, step: int) -> np.ndarray:
        """Slowdown factor of every replica at `step`."""
        f = np.ones(self.num_replicas)
        for s in self.slowdowns:
            if s.start <= step and (s.end is None or step < s.end):
                f[s.replica] *= s.factor
        return f

    def wall(self, work: np.ndarray) -> np.ndarray:
        """Wall seconds of `work` CPU seconds per replica under the quotas (phase-locked)."""
        per = self.quota * self.quota_period  # CPU seconds available per period
        work = np.asarray(work, np.float64)
        full = np.maximum(np.ceil(work / per) - 1.0, 0.0)  # periods waited to their end
        return np.where(self.quota < 1.0, full * self.quota_period + (work - full * per), work)

    def _work_within(self, seconds: float) -> np.ndarray:
        """Largest CPU work per replica whose wall time under the quotas is <= `seconds`."""
        per = self.quota * self.quota_period
        full = np.floor(seconds / self.quota_period)
        rest = seconds - full * self.quota_period
        return np.where(self.quota < 1.0, full * per + np.minimum(rest, per), seconds)

    def times(self, sizes: np.ndarray, factor: np.ndarray, noise=1.0, alive=None):
        """(measured compute seconds, step seconds) of one step at `sizes`; replicas not
        `alive` (default all alive) take no part (compute 0)."""
        compute = (self.alpha + self.beta * sizes) * factor * noise
        finish = self.wall(compute + self.collective * factor * noise)
        if alive is not None:
            compute, finish = np.where(alive, compute, 0.0), np.where(alive, finish, 0.0)
        return self.wall(compute), float(finish.max()) + self.allreduce


def ideal_split(total: float, alpha: np.ndarray, beta: np.ndarray) -> Tuple[np.ndarray, float]:
    """Real-valued equal-finish split of `total` and its step time (no bounds, no all-reduce)."""
    x = _split.water_fill(float(total), -alpha / beta, 1.0 / beta, np.zeros_like(alpha),
                          np.full_like(alpha, float(total)))
    # Every replica takes part in every step, so a replica given nothing still pays alpha.
    return x, float(np.max(alpha + beta * x))


def best_split(cluster: ClusterModel, total: int, factor: Optional[ArrayLike] = None,
               alive: Optional[ArrayLike] = None, min_size: int = 1) -> Tuple[np.ndarray, float]:
    """The integer split of `total` with the smallest noise-free step time, and that time.

    Exact (every replica's finish time is nondecreasing in its batch): bisection on the step
    time T for the smallest T at which the largest batches finishing by T hold `total`.

    Args:
        cluster: the true model (quotas, collective and all-reduce included).
        total: the global batch.
        factor: slowdown factor per replica (default none).
        alive: boolean mask of the replicas taking part (default all); others get 0.
        min_size: the least samples per alive replica (the controllers' default bound is 1).
    """
    num = cluster.num_replicas
    factor = np.ones(num) if factor is None else np.asarray(factor, np.float64)
    alive = np.ones(num, bool) if alive is None else np.asarray(alive, bool)
    lo = np.where(alive, min(min_size, total // max(1, int(alive.sum()))), 0).astype(np.int64)

    def finish(sizes):
        work = (cluster.alpha + cluster.beta * sizes + cluster.collective) * factor
        return np.where(alive, cluster.wall(work), 0.0)

    def capacity(seconds):
        work = cluster._work_within(seconds) / factor - cluster.alpha - cluster.collective
        most = np.floor(np.maximum(work, 0.0) / cluster.beta).astype(np.int64)
        return np.where(alive, np.clip(most, lo, total), 0)

    t_lo, t_hi = float(finish(lo).max()), float(finish(np.where(alive, total, 0)).max())
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (t_lo + t_hi)
        if capacity(mid).sum() >= total:
            t_hi = mid
        else:
            t_lo = mid
    sizes = capacity(t_hi)
    excess = int(sizes.sum()) - total
    while excess > 0:  # take from the largest batches first: no finish time grows
        k = int(np.argmax(np.where(sizes > lo, sizes, -1)))
        take = min(excess, int(sizes[k] - lo[k]))
        sizes[k] -= take
        excess -= take
    return sizes, float(finish(sizes).max()) + cluster.allreduce


@dataclasses.dataclass(frozen=True, eq=False)
class SimResult:
    """Record of a simulation (per-step arrays indexed by step, per-window arrays by window).

    Attributes:
        step_times: simulated step time (noisy).
        model_step_times: the same without noise (the quality of the split itself).
        best_step_times: noise-free step time of the best integer split (`best_split`).
        ideal_step_times: real-valued equal-finish split of the true compute model + all-reduce
            (a lower bound that ignores quotas and the collective).
        flow_step_times: B / sum X_k + all-reduce with X_k = 1 / beta_k (ignores fixed costs).
        sizes: int array (steps, K) of the sizes in force; 0 for lost replicas.
        adjust_steps: first step at which each change of sizes was in force.
        reasons: the controller's `reason` after each update.
        window_steps: the last step of each window.
        settled_step_times: per window, the noise-free step time of the split the controller
            settled on after that window (`ControllerState.settled_sizes`), at the step after.
        window_best_times: per window, `best_step_times` at the step after it.
        fed: per window, whether the controller got it (False: it straddled a switch).
        final_state: the controller's last state (None without a controller).
    """

    step_times: np.ndarray
    model_step_times: np.ndarray
    best_step_times: np.ndarray
    ideal_step_times: np.ndarray
    flow_step_times: np.ndarray
    sizes: np.ndarray
    adjust_steps: List[int]
    reasons: List[str]
    window_steps: np.ndarray
    settled_step_times: np.ndarray
    window_best_times: np.ndarray
    fed: np.ndarray
    final_state: object = None

    @property
    def adjustments(self) -> int:
        return len(self.adjust_steps)

    def windows_to_reach(self, tol: float = 0.05, after: int = 0,
                         until: Optional[int] = None) -> Optional[int]:
        """Windows ending from step `after` on until the settled split's noise-free step time
        is within `(1 + tol) x` the best split's and stays so to step `until` (default the
        end); None if it is not so at the end."""
        end = len(self.step_times) if until is None else until
        late = (self.window_steps >= after) & (self.window_steps + 1 < end)
        ok = (self.settled_step_times <= (1.0 + tol) * self.window_best_times)[late]
        if ok.size == 0 or not ok[-1]:
            return None
        bad = np.flatnonzero(~ok)
        return 1 if bad.size == 0 else int(bad[-1]) + 2

    def adjustments_to_converge(self, tol: float = 0.05, after: int = 0) -> Optional[int]:
        """Changes of split from step `after` until the noise-free step time of the split in
        force stays within `(1 + tol) x` the best split's to the end; None if it never does."""
        ratio = self.model_step_times[after:] / self.best_step_times[after:]
        bad = np.flatnonzero(ratio > 1.0 + tol)
        if bad.size == 0:
            return 0
        last_bad = after + int(bad[-1])
        if last_bad == len(self.step_times) - 1:
            return None
        return sum(1 for s in self.adjust_steps if after <= s <= last_bad + 1)

    def steady_ratio(self, fraction: float = 0.2, noisy: bool = False) -> float:
        """Mean step time in force over the last `fraction` of steps over the best split's."""
        n = max(1, int(len(self.step_times) * fraction))
        times = self.step_times if noisy else self.model_step_times
        return float(times[-n:].mean() / self.best_step_times[-n:].mean())


def simulate(controller, cluster: ClusterModel, steps: int, adjust_every: int = 10,
             initial_sizes: Optional[ArrayLike] = None, seed: int = 0,
             global_batch: Optional[int] = None, switch_lag: int = 3,
             step_time: bool = True) -> SimResult:
    """Runs `steps` synchronous steps of `cluster` driven by `controller`.

    Args:
        controller: a `ProportionalController` / `ModelBasedController` (a
            `protocols.Controller`; with `remove_replicas` where the cluster loses replicas),
            or None to keep the initial split (the baselines).
        cluster: the true time model.
        steps: number of steps, >= 1.
        adjust_every: steps per measurement window, >= 1.
        initial_sizes: the starting split; default the even split of `global_batch`.
        seed: seed of the noise generator (`np.random.default_rng(seed)`).
        global_batch: needed only when `initial_sizes` is None.
        switch_lag: steps from a decision until its split is in force, >= 0 (a prefetching
            input pipeline: 2-4 on one host, 8 across workers).
        step_time: pass the window's mean step time as `update(..., step_time=)` (as
            `DynamicBatching` does in synchronous training); False passes `step_time=None`.

    Returns:
        A `SimResult`.

    Raises:
        ValueError: on invalid arguments.
    """
    num = cluster.num_replicas
    steps = check_int("steps", steps, 1)
    adjust_every = check_int("adjust_every", adjust_every, 1)
    switch_lag = check_int("switch_lag", switch_lag, 0)
    if initial_sizes is None:
        if global_batch is None:
            raise ValueError("`simulate` needs `initial_sizes` or `global_batch`. Received "
                             "neither; pass e.g. global_batch=64 for an even start.")
        initial_sizes = _split.split_evenly(global_batch, num)
    sizes = np.array(_split.validate_sizes(initial_sizes, num, global_batch), np.int64)
    rng = np.random.default_rng(seed)
    noise = (rng.uniform(1 - cluster.noise, 1 + cluster.noise, size=(steps, num))
             if cluster.noise > 0 else np.ones((steps, num)))
    run = _Run(controller, cluster, sizes, noise, adjust_every, switch_lag, step_time)
    for step in range(steps):
        run.step(step)
    return run.result()


class _Run:
    """One simulation under way (`simulate`): the split in force, the switch decided last,
    the window measured so far, and the record."""

    def __init__(self, controller, cluster: ClusterModel, sizes: np.ndarray, noise: np.ndarray,
                 adjust_every: int, switch_lag: int, step_time: bool):
        steps, num = noise.shape
        self.controller, self.cluster, self.noise = controller, cluster, noise
        self.adjust_every, self.switch_lag = adjust_every, switch_lag
        self.pass_step_time = step_time
        self.total = int(sizes.sum())
        self.factors = np.ones((steps, num))
        for s in cluster.slowdowns:
            self.factors[s.start:s.end, s.replica] *= s.factor
        self.state = controller.init(sizes) if controller is not None else None
        self.sizes = self.state.sizes.copy() if self.state is not None else sizes
        self.alive = np.ones(num, bool)
        self.events = {0} | {s.start for s in cluster.slowdowns} | {
            s.end for s in cluster.slowdowns if s.end is not None} | set(cluster.losses.values())
        self.out = {k: np.empty(steps) for k in (
            "step_times", "model_step_times", "best_step_times", "ideal_step_times",
            "flow_step_times")}
        self.out_sizes = np.zeros((steps, num), np.int64)
        self.adjust_steps: List[int] = []
        self.reasons: List[str] = []
        self.windows = {k: [] for k in ("step", "settled", "best", "fed")}
        self._new_window()
        # The split decided last, in force from `pending_at`; the first step after the decision.
        self.pending, self.pending_at, self.switched_at = None, 0, None
        self.best = self.ideal = self.flow = 0.0

    def _new_window(self) -> None:
        num = self.cluster.num_replicas
        self.win_b, self.win_t, self.win_s, self.win_n = np.zeros(num), np.zeros(num), 0.0, 0

    def _scatter(self, values) -> np.ndarray:
        full = np.zeros(self.cluster.num_replicas, np.int64)
        full[self.alive] = values
        return full

    def step(self, step: int) -> None:
        """Runs step `step`: losses, the split in force, the times; a window's end."""
        cluster = self.cluster
        lost = [k for k, s in cluster.losses.items() if s == step and self.alive[k]]
        if lost:
            self._lose(step, lost)
        if self.pending is not None and step >= self.pending_at:
            self.sizes, self.pending = self.pending, None
            self.adjust_steps.append(step)
        factor, alive, total = self.factors[step], self.alive, self.total
        if step in self.events:
            _, self.best = best_split(cluster, total, factor, alive)
            a, b = cluster.alpha * factor, cluster.beta * factor
            _, self.ideal = ideal_split(total, a[alive], b[alive])
            self.flow = total / float(np.sum(1.0 / b[alive]))
        measured, step_seconds = cluster.times(self.sizes, factor, self.noise[step], alive)
        self.out["step_times"][step] = step_seconds
        self.out["model_step_times"][step] = cluster.times(self.sizes, factor, alive=alive)[1]
        self.out["best_step_times"][step] = self.best
        self.out["ideal_step_times"][step] = self.ideal + cluster.allreduce
        self.out["flow_step_times"][step] = self.flow + cluster.allreduce
        self.out_sizes[step] = self.sizes
        self.win_b += self.sizes
        self.win_t += measured
        self.win_s += step_seconds
        self.win_n += 1
        if self.state is not None and self.win_n >= self.adjust_every:
            self._end_window(step)

    def _lose(self, step: int, lost: List[int]) -> None:
        keep = self.alive.copy()
        keep[lost] = False
        if self.state is not None:
            new, self.state = self.controller.remove_replicas(self.state, keep[self.alive])
        else:
            new = _split.split_proportionally(self.total, np.maximum(self.sizes[keep], 1))
        self.alive = keep
        self.sizes, self.pending = self._scatter(new), None
        self._new_window()
        self.adjust_steps.append(step)
        logger.debug("step %d: lost replicas %s", step, lost)

    def _end_window(self, step: int) -> None:
        """The window ending at `step` to the controller, unless it straddles a switch."""
        alive, n = self.alive, self.win_n
        mean_b = self.win_b[alive] / n
        split = (self.pending if self.pending is not None else self.sizes)[alive]
        straddled = straddles_switch(mean_b, split, step + 1 - n, self.switched_at,
                                     self.switch_lag)
        if not straddled:
            self.switched_at = None
            new, self.state = self.controller.update(
                self.state, mean_b, self.win_t[alive] / n,
                step_time=self.win_s / n if self.pass_step_time else None)
            self.reasons.append(self.state.reason)
            new = np.asarray(new, np.int64)
            if not np.array_equal(new, split):
                self.pending, self.switched_at = self._scatter(new), step + 1
                self.pending_at = self.switched_at + self.switch_lag
        nxt = min(step + 1, len(self.factors) - 1)
        settled = self._scatter(np.asarray(self.state.settled_sizes, np.int64))
        self.windows["step"].append(step)
        self.windows["settled"].append(
            self.cluster.times(settled, self.factors[nxt], alive=alive)[1])
        self.windows["best"].append(
            best_split(self.cluster, self.total, self.factors[nxt], alive)[1]
            if nxt in self.events else self.best)
        self.windows["fed"].append(not straddled)
        self._new_window()

    def result(self) -> SimResult:
        windows = self.windows
        return SimResult(**self.out, sizes=self.out_sizes, adjust_steps=self.adjust_steps,
                         reasons=self.reasons,
                         window_steps=np.asarray(windows["step"], np.int64),
                         settled_step_times=np.asarray(windows["settled"]),
                         window_best_times=np.asarray(windows["best"]),
                         fed=np.asarray(windows["fed"], bool), final_state=self.state)


# ---------------------------------------------------------------------------- scenarios ---
SCENARIOS = ("linear-cpu", "affine-gpu", "cpu+gpu", "quota", "interference", "noise",
             "homogeneous")


@dataclasses.dataclass(frozen=True, eq=False)
class Scenario:
    """A named cluster for tests and `bench_controllers`.

    Attributes:
        name: one of `SCENARIOS`.
        cluster: the `ClusterModel`.
        phases: steps from which the controller must reach the best split again (0, and for
            "interference" the slowdown's start and end).
    """

    name: str
    cluster: ClusterModel
    phases: Tuple[int, ...] = (0,)


def _cpus(rng, k):
    """CPU workers of 4 to 64 cores: time per sample inversely proportional, no fixed cost."""
    cores = rng.choice([4, 8, 16, 32, 64], size=k)
    return np.zeros(k), 0.064 / cores


def _gpus(rng, k):
    """GPU-like workers (P4/T4/V100/A100 speed ratios): 10-40 ms fixed per step."""
    speed = rng.choice([5.5, 8.1, 15.7, 60.0], size=k)
    return rng.uniform(0.01, 0.04, k), 0.0008 / speed


def scenario(name: str, num_replicas: int, steps: int = 600, seed: int = 0) -> Scenario:
    """The simulator scenarios (B = 64 per replica is what they are calibrated for).

    - "linear-cpu": time proportional to samples (4-64 cores), the source paper's case.
    - "affine-gpu": GPU-like, large fixed cost per step; 5 ms all-reduce.
    - "cpu+gpu": a quarter GPU-like, the rest CPUs.
    - "quota": CPU workers capped at 0.2-1.0 of a core in 10 ms periods, 8 ms fixed and
      0.5 ms per sample of CPU, 3 ms of CPU in each step's collective (the 2-worker case:
      shares 0.8 and 0.2, as `bench_hetero`): compute times miss the staircase and the
      collective, the step time shows them.
    - "interference": CPUs with 10 ms fixed cost; a tenth of them (at least one) slowed 2x
      from steps // 3 to 2 * steps // 3 (slowdown and recovery).
    - "noise": "affine-gpu" with +-10% per-step noise.
    - "homogeneous": identical replicas (20 ms + 1 ms per sample), +-10% noise: no move is
      the right answer.

    Args:
        name: one of `SCENARIOS`.
        num_replicas: K >= 1.
        steps: the run's length (places the interference).
        seed: seed of the cluster's draws (`np.random.default_rng(seed)`).
    """
    k = check_int("num_replicas", num_replicas, 1)
    rng = np.random.default_rng(seed)
    if name == "linear-cpu":
        return Scenario(name, ClusterModel(*_cpus(rng, k)))
    if name in ("affine-gpu", "noise"):
        noise = 0.1 if name == "noise" else 0.0
        return Scenario(name, ClusterModel(*_gpus(rng, k), allreduce=0.005, noise=noise))
    if name == "cpu+gpu":
        n_gpu = max(1, k // 4)
        a_g, b_g = _gpus(rng, n_gpu)
        a_c, b_c = _cpus(rng, k - n_gpu)
        return Scenario(name, ClusterModel(np.concatenate([a_g, a_c + 0.005]),
                                           np.concatenate([b_g, b_c]), allreduce=0.005))
    if name == "quota":
        shares = np.array([0.8, 0.2]) if k == 2 else rng.choice([0.2, 0.4, 0.6, 0.8, 1.0], k)
        return Scenario(name, ClusterModel(np.full(k, 0.008), np.full(k, 0.0005),
                                           collective=0.003, quota=shares, quota_period=0.01,
                                           allreduce=0.002))
    if name == "interference":
        alpha, beta = _cpus(rng, k)
        start, end = steps // 3, 2 * steps // 3
        victims = rng.choice(k, size=max(1, k // 10), replace=False)
        slow = tuple(Slowdown(int(v), start, end, 2.0) for v in victims)
        return Scenario(name, ClusterModel(alpha + 0.01, beta, slowdowns=slow,
                                           allreduce=0.005), (0, start, end))
    if name == "homogeneous":
        return Scenario(name, ClusterModel(np.full(k, 0.02), np.full(k, 0.001), noise=0.1))
    raise ValueError(f"`name` must be one of {SCENARIOS}. Received: name={name!r}")
