"""Discrete-event simulator of a synchronous (BSP) heterogeneous data-parallel cluster.

Each step, replica k computes its b_k samples in `(alpha_k + beta_k * b_k) * slowdown * noise`
seconds; the step ends when the slowest replica is done, plus an all-reduce. Every
`adjust_every` steps the controller receives the window means of samples and compute
seconds per replica, exactly like `DynamicBatching` feeds it in real training, and its new
sizes apply from the next step. Pure numpy, vectorised over replicas (1,024 replicas x
1,000 steps take well under a second plus the controller's own time).

Example:
    >>> from tf_hetbatch.controllers import ModelBasedController
    >>> cluster = ClusterModel(alpha=[0.0, 0.0, 0.0], beta=[1e-3, 2e-3, 4e-3])
    >>> result = simulate(ModelBasedController(), cluster, steps=50, initial_sizes=[64, 64, 64])
    >>> result.sizes[-1].tolist()
    [110, 55, 27]
"""

from __future__ import annotations

import dataclasses
import logging
from typing import List, Mapping, Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike

from tf_hetbatch import split as _split

logger = logging.getLogger(__name__)

__all__ = ["Slowdown", "ClusterModel", "SimResult", "simulate", "ideal_split"]


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


@dataclasses.dataclass(frozen=True, eq=False)
class ClusterModel:
    """True per-replica time model of a simulated cluster.

    Args:
        alpha: per-replica fixed seconds per step (>= 0), length K.
        beta: per-replica seconds per sample (> 0), length K.
        noise: multiplicative noise: each replica-step time is scaled by a uniform draw in
            [1 - noise, 1 + noise]; in [0, 1).
        slowdowns: `Slowdown`s (interference, throttling, single outliers).
        losses: {replica: step}; the replica is gone from that step on and the global batch
            is re-split over the survivors.
        allreduce: seconds added to every step for the gradient all-reduce.
    """

    alpha: np.ndarray
    beta: np.ndarray
    noise: float = 0.0
    slowdowns: Tuple[Slowdown, ...] = ()
    losses: Mapping[int, int] = dataclasses.field(default_factory=dict)
    allreduce: float = 0.0

    def __post_init__(self):
        alpha = np.array(self.alpha, dtype=np.float64, ndmin=1)
        beta = np.array(self.beta, dtype=np.float64, ndmin=1)
        if alpha.shape != beta.shape or alpha.ndim != 1:
            raise ValueError(f"`alpha` and `beta` must be 1-D with one entry per replica. "
                             f"Received shapes {alpha.shape} and {beta.shape}.")
        if np.any(alpha < 0) or not np.all(np.isfinite(alpha)):
            raise ValueError(f"`alpha` must be finite and >= 0. "
                             f"Received: alpha={_split._fmt(alpha)}")
        if np.any(beta <= 0) or not np.all(np.isfinite(beta)):
            raise ValueError(f"`beta` must be finite and > 0. Received: beta={_split._fmt(beta)}")
        if not 0 <= self.noise < 1:
            raise ValueError(f"`noise` must be in [0, 1). Received: noise={self.noise!r}")
        for s in self.slowdowns:
            if not 0 <= s.replica < alpha.size:
                raise ValueError(f"`Slowdown.replica` must be in [0, {alpha.size}). "
                                 f"Received: replica={s.replica}")
        if set(self.losses) and (min(self.losses) < 0 or max(self.losses) >= alpha.size):
            raise ValueError(f"`losses` keys must be replica indices in [0, {alpha.size}). "
                             f"Received: losses={dict(self.losses)!r}")
        if len(self.losses) >= alpha.size:
            raise ValueError("`losses` must leave at least one replica alive.")
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "beta", beta)
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


def ideal_split(total: float, alpha: np.ndarray, beta: np.ndarray) -> Tuple[np.ndarray, float]:
    """Real-valued equal-finish split of `total` and its step time (no bounds, no all-reduce)."""
    x = _split.water_fill(float(total), -alpha / beta, 1.0 / beta, np.zeros_like(alpha),
                          np.full_like(alpha, float(total)))
    # Every replica takes part in every step, so a replica given nothing still pays alpha.
    return x, float(np.max(alpha + beta * x))


@dataclasses.dataclass(frozen=True, eq=False)
class SimResult:
    """Per-step record of a simulation (arrays indexed by step).

    Attributes:
        step_times: simulated step time (slowest noisy replica + all-reduce).
        model_step_times: the same without noise (the quality of the split itself).
        ideal_step_times: real-valued equal-finish split of the true model + all-reduce.
        flow_step_times: B / sum X_k + all-reduce with X_k = 1 / beta_k (ignores fixed costs).
        sizes: int array (steps, K) of the sizes used; 0 for lost replicas.
        adjust_steps: first step at which each change of sizes was in effect.
        reasons: the controller's `reason` after each update.
        final_state: the controller's last state (None without a controller).
    """

    step_times: np.ndarray
    model_step_times: np.ndarray
    ideal_step_times: np.ndarray
    flow_step_times: np.ndarray
    sizes: np.ndarray
    adjust_steps: List[int]
    reasons: List[str]
    final_state: object = None

    @property
    def adjustments(self) -> int:
        return len(self.adjust_steps)

    def adjustments_to_converge(self, tol: float = 0.05, after: int = 0) -> Optional[int]:
        """Adjustments made from step `after` until the noise-free step time stays within
        `(1 + tol) x ideal` to the end; None if it never settles."""
        ratio = self.model_step_times[after:] / self.ideal_step_times[after:]
        bad = np.flatnonzero(ratio > 1.0 + tol)
        if bad.size == 0:
            return 0
        last_bad = after + int(bad[-1])
        if last_bad == len(self.step_times) - 1:
            return None
        return sum(1 for s in self.adjust_steps if after <= s <= last_bad + 1)

    def steady_ratio(self, fraction: float = 0.2, noisy: bool = False) -> float:
        """Mean step time over the last `fraction` of steps divided by the ideal's."""
        n = max(1, int(len(self.step_times) * fraction))
        times = self.step_times if noisy else self.model_step_times
        return float(times[-n:].mean() / self.ideal_step_times[-n:].mean())


def simulate(controller, cluster: ClusterModel, steps: int, adjust_every: int = 10,
             initial_sizes: Optional[ArrayLike] = None, seed: int = 0,
             global_batch: Optional[int] = None) -> SimResult:
    """Runs `steps` synchronous steps of `cluster` driven by `controller`.

    Args:
        controller: a `ProportionalController`/`ModelBasedController` (anything with
            `init`, `update`, `remove_replicas`), or None to keep the initial split (the
            uniform or static baselines).
        cluster: the true time model.
        steps: number of steps, >= 1.
        adjust_every: steps per measurement window, >= 1.
        initial_sizes: the starting split; default the even split of `global_batch`.
        seed: seed of the noise generator (`np.random.default_rng(seed)`).
        global_batch: needed only when `initial_sizes` is None.

    Returns:
        A `SimResult`.

    Raises:
        ValueError: on invalid arguments.
    """
    num = cluster.num_replicas
    steps = _split._check_count("steps", steps, 1)
    adjust_every = _split._check_count("adjust_every", adjust_every, 1)
    if initial_sizes is None:
        if global_batch is None:
            raise ValueError("`simulate` needs `initial_sizes` or `global_batch`. Received "
                             "neither; pass e.g. global_batch=64 for an even start.")
        initial_sizes = _split.split_evenly(global_batch, num)
    sizes = np.array(_split.validate_sizes(initial_sizes, num, global_batch), np.int64)
    total = int(sizes.sum())
    rng = np.random.default_rng(seed)
    noise = (rng.uniform(1 - cluster.noise, 1 + cluster.noise, size=(steps, num))
             if cluster.noise > 0 else None)
    state = controller.init(sizes) if controller is not None else None
    if state is not None:
        sizes = state.sizes.copy()
    alive = np.ones(num, bool)
    events = {0} | {s.start for s in cluster.slowdowns} | {
        s.end for s in cluster.slowdowns if s.end is not None} | set(cluster.losses.values())
    out_t, out_m = np.empty(steps), np.empty(steps)
    out_i, out_f = np.empty(steps), np.empty(steps)
    out_sizes = np.zeros((steps, num), np.int64)
    adjust_steps: List[int] = []
    reasons: List[str] = []
    win_b, win_t, win_n = np.zeros(num), np.zeros(num), 0
    ideal = flow = 0.0
    for step in range(steps):
        lost = [k for k, s in cluster.losses.items() if s == step and alive[k]]
        if lost:
            keep = alive.copy()
            keep[lost] = False
            if state is not None:
                new, state = controller.remove_replicas(state, keep[alive])
            else:
                new = _split.split_proportionally(total, np.maximum(sizes[keep], 1))
            alive = keep
            sizes = np.zeros(num, np.int64)
            sizes[alive] = new
            win_b[:], win_t[:], win_n = 0.0, 0.0, 0
            adjust_steps.append(step)
            logger.debug("step %d: lost replicas %s", step, lost)
        factor = cluster.factors(step)
        a, b = cluster.alpha * factor, cluster.beta * factor
        if step in events:
            _, ideal = ideal_split(total, a[alive], b[alive])
            flow = total / float(np.sum(1.0 / b[alive]))
        true = np.where(alive, a + b * sizes, 0.0)
        times = true * noise[step] if noise is not None else true
        out_t[step] = times.max() + cluster.allreduce
        out_m[step] = true.max() + cluster.allreduce
        out_i[step] = ideal + cluster.allreduce
        out_f[step] = flow + cluster.allreduce
        out_sizes[step] = sizes
        win_b += sizes
        win_t += times
        win_n += 1
        if state is not None and win_n == adjust_every:
            new, state = controller.update(state, win_b[alive] / win_n, win_t[alive] / win_n)
            reasons.append(state.reason)
            new = np.asarray(new, np.int64)
            if not np.array_equal(new, sizes[alive]):
                sizes = np.zeros(num, np.int64)
                sizes[alive] = new
                if step + 1 < steps:
                    adjust_steps.append(step + 1)
            win_b[:], win_t[:], win_n = 0.0, 0.0, 0
    return SimResult(out_t, out_m, out_i, out_f, out_sizes, adjust_steps, reasons, state)
