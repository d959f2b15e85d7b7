"""A picture of the balance: per-replica batch sizes and compute times from a log dir.

Reads the event files that `BalanceWriter` (and so `DynamicBatching(log_dir=...)`) writes
under `<log_dir>/hetbatch` and draws a two-panel PNG with matplotlib (an optional dependency:
`pip install tf_hetbatch[plot]`):

- top: batch size per replica over the steps,
- bottom: compute time per replica (ms/step),
- dashed vertical lines at every change of the split, one legend entry per replica,
- the title gives the mean balance efficiency mean(t)/max(t).

Command line: `python -m tf_hetbatch.plot LOG_DIR [--out file.png]`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from tf_hetbatch.dashboards import summaries

logger = logging.getLogger(__name__)

_PLOT_INSTALL_HINT = "pip install matplotlib (the plot extra: pip install 'tf_hetbatch[plot]')"


@dataclasses.dataclass(frozen=True)
class Series:
    """One scalar series: steps and values in step order."""

    steps: Tuple[int, ...]
    values: Tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class BalanceRun:
    """The balance data of one log dir, as read back from the event files.

    Attributes:
      batch_sizes: Replica index -> batch size series (samples/step).
      compute_times_ms: Replica index -> compute time series (ms/step).
      balance_efficiency: Cluster balance efficiency series (None if absent).
      adjustments: (step, text) of every change of the split, in step order.
    """

    batch_sizes: Dict[int, Series]
    compute_times_ms: Dict[int, Series]
    balance_efficiency: Optional[Series]
    adjustments: Tuple[Tuple[int, str], ...]

    @property
    def num_replicas(self) -> int:
        """Number of replica runs found."""
        return len(self.batch_sizes)

    @property
    def mean_balance_efficiency(self) -> Optional[float]:
        """Mean of the balance efficiency over all windows, or None if there is none."""
        if not self.balance_efficiency or not self.balance_efficiency.values:
            return None
        values = self.balance_efficiency.values
        return sum(values) / len(values)


def _read_tensor_series(run_dir: str) -> Dict[str, List[Tuple[int, object]]]:
    """Reads every tensor summary of a run folder: tag -> [(step, numpy value)], step-sorted."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    accumulator = event_accumulator.EventAccumulator(
        run_dir, size_guidance={event_accumulator.TENSORS: 0, event_accumulator.SCALARS: 0}
    )
    accumulator.Reload()
    out: Dict[str, List[Tuple[int, object]]] = {}
    for tag in accumulator.Tags().get(event_accumulator.TENSORS, []):
        points = [
            (int(e.step), tensor_util.make_ndarray(e.tensor_proto))
            for e in accumulator.Tensors(tag)
        ]
        out[tag] = sorted(points, key=lambda p: p[0])
    return out


def _scalar_series(points: Sequence[Tuple[int, object]]) -> Series:
    return Series(tuple(s for s, _ in points), tuple(float(v) for _, v in points))


def read_balance(log_dir: str) -> BalanceRun:
    """Reads the balance data that `BalanceWriter` wrote under `<log_dir>/hetbatch`.

    Args:
      log_dir: The `log_dir` given to `BalanceWriter` / `DynamicBatching`.

    Returns:
      A `BalanceRun`.

    Raises:
      FileNotFoundError: if `<log_dir>/hetbatch/replica_<k>` folders are missing.
    """
    root = os.path.join(os.fspath(log_dir), summaries.SUBDIR)
    pattern = re.compile(rf"^{summaries.REPLICA_RUN_PREFIX}(\d+)$")
    replicas = []
    if os.path.isdir(root):
        replicas = sorted(
            int(m.group(1)) for m in map(pattern.match, os.listdir(root)) if m is not None
        )
    if not replicas:
        raise FileNotFoundError(
            f"No balance logs in log_dir={os.fspath(log_dir)!r}: expected folders "
            f"{root}/{summaries.REPLICA_RUN_PREFIX}<k>. Pass the `log_dir` given to "
            f"DynamicBatching(log_dir=...) or BalanceWriter."
        )
    batch_sizes: Dict[int, Series] = {}
    compute_times: Dict[int, Series] = {}
    for k in replicas:
        tags = _read_tensor_series(os.path.join(root, f"{summaries.REPLICA_RUN_PREFIX}{k}"))
        batch_sizes[k] = _scalar_series(tags.get(summaries.TAG_BATCH_SIZE, []))
        compute_times[k] = _scalar_series(tags.get(summaries.TAG_COMPUTE_TIME_MS, []))
    efficiency = None
    adjustments: Tuple[Tuple[int, str], ...] = ()
    cluster_dir = os.path.join(root, summaries.CLUSTER_RUN)
    if os.path.isdir(cluster_dir):
        tags = _read_tensor_series(cluster_dir)
        if summaries.TAG_BALANCE_EFFICIENCY in tags:
            efficiency = _scalar_series(tags[summaries.TAG_BALANCE_EFFICIENCY])
        adjustments = tuple(
            (step, _text(value)) for step, value in tags.get(summaries.TAG_ADJUSTMENT, [])
        )
    return BalanceRun(batch_sizes, compute_times, efficiency, adjustments)


def _text(value) -> str:
    item = value.item() if hasattr(value, "item") else value
    return item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)


def _import_pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            f"plot_balance needs matplotlib, which is not installed. Install it with: "
            f"{_PLOT_INSTALL_HINT}"
        ) from e
    matplotlib.use("Agg")  # Headless: no display needed, only files.
    import matplotlib.pyplot as plt

    return plt


def make_balance_figure(run: BalanceRun):
    """Draws the balance picture of `run`.

    Args:
      run: Data from `read_balance`.

    Returns:
      A `matplotlib.figure.Figure` with two axes (batch size, compute time); each axis has one
      line labelled `replica <k>` per replica and dashed vertical lines at the adjustments.

    Raises:
      ImportError: if matplotlib is missing (`pip install tf_hetbatch[plot]`).
    """
    plt = _import_pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6.5))
    colours = plt.get_cmap("tab10")
    for k in sorted(run.batch_sizes):
        # Thicker lines for lower replica indices, so equal series (an even split) stay visible.
        style = dict(color=colours(k % 10), label=f"replica {k}",
                     linewidth=max(1.2, 3.2 - 0.7 * k))
        series = run.batch_sizes[k]
        # A value is the mean over the window that ends at its step: draw it over that window.
        top.plot(series.steps, series.values, drawstyle="steps-pre", **style)
        series = run.compute_times_ms[k]
        bottom.plot(series.steps, series.values, **style)
    for i, (step, _) in enumerate(run.adjustments):
        for ax in (top, bottom):
            ax.axvline(step, color="0.4", linestyle="--", linewidth=1,
                       label="adjustment" if i == 0 and ax is top else None)
    top.set_ylabel("batch size (samples/step)")
    bottom.set_ylabel("compute time (ms/step)")
    bottom.set_xlabel("step")
    top.legend(loc="best", fontsize="small")
    bottom.legend(loc="best", fontsize="small")
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    efficiency = run.mean_balance_efficiency
    title = f"tf_hetbatch balance: {run.num_replicas} replicas"
    if efficiency is not None:
        title += f", mean balance efficiency {100 * efficiency:.1f}%"
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_balance(log_dir: str, out_png: Optional[str] = None) -> str:
    """Reads the balance logs of `log_dir` and saves the picture as a PNG.

    Args:
      log_dir: The `log_dir` given to `DynamicBatching(log_dir=...)` or `BalanceWriter`.
      out_png: Where to save the PNG. Default `<log_dir>/hetbatch_balance.png`.

    Returns:
      The path of the PNG written.

    Raises:
      FileNotFoundError: if `log_dir` has no balance logs.
      ImportError: if matplotlib is missing (`pip install tf_hetbatch[plot]`).

    Example:
    ```python
    png = plot_balance("logs")  # logs/hetbatch_balance.png
    ```
    """
    plt = _import_pyplot()
    run = read_balance(log_dir)
    if out_png is None:
        out_png = os.path.join(os.fspath(log_dir), "hetbatch_balance.png")
    out_dir = os.path.dirname(os.path.abspath(out_png))
    os.makedirs(out_dir, exist_ok=True)
    fig = make_balance_figure(run)
    try:
        fig.savefig(out_png, dpi=100)
    finally:
        plt.close(fig)
    logger.info("Wrote the balance picture of %s to %s", log_dir, out_png)
    return out_png
