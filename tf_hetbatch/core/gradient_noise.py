"""The gradient noise scale as a plain value (no TensorFlow import): what
`measure_gradient_noise` makes a synchronous strategy measure (`gradient_noise_scale`); how it
is measured is in `tf_hetbatch.distribute.gradient_noise`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["GradientNoise"]


@dataclasses.dataclass(frozen=True)
class GradientNoise:
    """Smoothed estimates of the true gradient's squared norm and of the gradient noise.

    Attributes:
        gradient_sq: the estimate of |G|^2, the squared norm of the expected gradient.
        trace: the estimate of tr(S), the trace of one sample's gradient covariance.
        steps: the steps measured (a step with one replica holding every sample measures
            nothing).
    """

    gradient_sq: float
    trace: float
    steps: int

    @classmethod
    def from_points(cls, norms, inverse_batches, present, steps) -> "GradientNoise":
        """The least-squares line |G|^2 + tr(S) x through averaged points: per point (each
        replica's, then the global gradient's) the averages of its squared norm and of
        1 / its batch size, each summed where it had samples, and the average of that count
        (`present`; a point with 0 is no point). Fewer than two batch sizes: NaN estimates."""
        norms, inverse_batches, present = (np.asarray(v, np.float64) for v in (
            norms, inverse_batches, present))
        valid = present > 0
        if steps <= 0 or valid.sum() < 2:
            return cls(math.nan, math.nan, max(int(steps), 0))
        y = norms[valid] / present[valid]
        x = inverse_batches[valid] / present[valid]
        spread = np.sum(np.square(x - x.mean()))
        if not spread > 1e-12 * x.mean() ** 2:  # every point at one batch size
            return cls(math.nan, math.nan, int(steps))
        trace = float(np.sum((x - x.mean()) * (y - y.mean())) / spread)
        return cls(float(y.mean() - trace * x.mean()), trace, int(steps))

    @property
    def scale(self) -> float:
        """B_noise = tr(S) / |G|^2 (McCandlish et al.'s simple noise scale), in samples: about
        the batch size beyond which a larger batch stops cutting the steps needed in
        proportion. NaN before any step was measured; inf while |G|^2 is not positive (noise
        dominates)."""
        if self.steps <= 0 or math.isnan(self.gradient_sq):
            return math.nan
        if self.gradient_sq <= 0:
            return math.inf
        return max(self.trace, 0.0) / self.gradient_sq

    def efficiency(self, batch: float, base_batch: float = 0.0) -> float:
        """The statistical efficiency of `batch` relative to `base_batch` (Pollux:
        (B_noise + base) / (B_noise + batch)): the progress one sample makes at `batch`, as a
        fraction of its progress at `base_batch`; by default relative to the smallest batches
        (McCandlish et al.: B_noise / (B_noise + batch), the fraction of the ideal progress
        per sample that a batch of `batch` keeps)."""
        scale = self.scale
        if math.isnan(scale):
            return math.nan
        if math.isinf(scale):
            return 1.0
        return (scale + base_batch) / (scale + batch)
