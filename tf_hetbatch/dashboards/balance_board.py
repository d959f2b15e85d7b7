"""The balance dashboards of one `fit`: what `DynamicBatching(log_dir=...)` writes.

While training, the chief writes every measured window, every change of split and (in
asynchronous training) the workers' staleness to TensorBoard (`summaries.BalanceWriter`:
runs `<log_dir>/hetbatch/replica_<k>` and `<log_dir>/hetbatch/cluster`); at the end, if
matplotlib is installed, the PNG `<log_dir>/hetbatch_balance.png` (`dashboards.plot`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

__all__ = ["BalanceBoard"]


class BalanceBoard:
    """Writes the balance dashboards of one fit under `log_dir` (create it on the chief only).

    Args:
        log_dir: the directory, as for `keras.callbacks.TensorBoard(log_dir)`.
        num_parts: the number of parts the global batch is split into.
    """

    def __init__(self, log_dir: str, num_parts: int):
        from tf_hetbatch.dashboards.summaries import BalanceWriter  # TensorBoard: only when writing

        self.log_dir = os.fspath(log_dir)
        self._writer = BalanceWriter(self.log_dir, num_parts)

    def log_window(self, window: Mapping[str, Any]) -> None:
        """One measured window: a `DynamicBatching.windows` entry. A window without a step
        time (nothing timed) is not drawn."""
        if not window["step_time"] > 0:
            return
        self._writer.log_window(window["step"], window["samples_per_step"],
                                window["time_per_step"], window["step_time"])
        if "gradient_noise_scale" in window:  # `measure_gradient_noise`
            self._writer.log_gradient_noise(window["step"], window["gradient_noise_scale"],
                                            window["statistical_efficiency"])

    def log_adjustment(self, entry: Mapping[str, Any]) -> None:
        """One change of split: a `DynamicBatching.history` entry."""
        self._writer.log_adjustment(entry["step"], entry["old"], entry["new"], entry["reason"])

    def log_staleness(self, step: int, mean: Sequence[float], maximum: Sequence[int]) -> None:
        """Asynchronous training: the window's mean and largest staleness per worker."""
        self._writer.log_staleness(step, mean, maximum)

    def close(self) -> Optional[str]:
        """Flushes the TensorBoard runs and draws the PNG; returns its path, or None when
        matplotlib is missing or no window was measured (both logged at INFO)."""
        self._writer.close()
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            logger.info("Balance dashboards written under %s (install matplotlib for the PNG).",
                        self.log_dir)
            return None
        from tf_hetbatch.dashboards import plot

        try:
            png = plot.plot_balance(self.log_dir)
        except FileNotFoundError:  # no window was measured: nothing to draw
            logger.info("No balance window measured; no picture written for %s.", self.log_dir)
            return None
        logger.info("Balance picture of this run: %s", png)
        return png
