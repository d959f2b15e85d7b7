"""TensorBoard balance dashboards: per-replica batch sizes, compute times and waits.

`BalanceWriter` turns the per-replica measurements of a heterogeneous data-parallel run into
TensorBoard event files laid out so that the replicas overlay each other:

```
<log_dir>/hetbatch/replica_0   hetbatch/batch_size, hetbatch/compute_time_ms,
<log_dir>/hetbatch/replica_1   hetbatch/replica_throughput, hetbatch/wait_time_ms
...
<log_dir>/hetbatch/cluster     hetbatch/balance_efficiency, hetbatch/step_time_ms,
                               hetbatch/throughput, hetbatch/global_batch,
                               hetbatch/ideal_step_time_ms, hetbatch/adjustment (text),
                               hetbatch/gradient_noise_scale and
                               hetbatch/statistical_efficiency (where measured),
                               and the custom-scalars layout (step 0)
```

One run (folder) per replica with the same tags gives each replica its own colour in the
Scalars tab; the custom-scalars layout adds a "tf_hetbatch balance" category whose charts
overlay the replicas, and a "tf_hetbatch cluster" category with the aggregates. Everything
lives under `<log_dir>/hetbatch`, so it coexists with `keras.callbacks.TensorBoard(log_dir)`
(which writes `<log_dir>/train` and `<log_dir>/validation`); TensorBoard merges the
custom-scalars layouts of all runs by category title.

The per-replica throughput tag is `hetbatch/replica_throughput`, not `hetbatch/throughput`:
custom-scalars charts select series by tag regex over all runs, so a shared tag would put the
cluster's aggregate throughput into the per-replica chart.

Writing is cheap for the training loop: `log_window` only validates and buffers Python floats;
every `flush_every` windows (and on `flush`/`close`) the buffer is written in one batch by
`tf.summary` file writers that are created lazily on the host CPU. Call it eagerly, e.g. from a
Keras callback on the chief, never inside a `tf.function`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

from tf_hetbatch.core.balance import BalanceWindow

logger = logging.getLogger(__name__)

SUBDIR = "hetbatch"
CLUSTER_RUN = "cluster"
REPLICA_RUN_PREFIX = "replica_"

# Per-replica tags (one run per replica).
TAG_BATCH_SIZE = "hetbatch/batch_size"
TAG_COMPUTE_TIME_MS = "hetbatch/compute_time_ms"
TAG_REPLICA_THROUGHPUT = "hetbatch/replica_throughput"
TAG_WAIT_TIME_MS = "hetbatch/wait_time_ms"
REPLICA_TAGS = (TAG_BATCH_SIZE, TAG_COMPUTE_TIME_MS, TAG_REPLICA_THROUGHPUT, TAG_WAIT_TIME_MS)
# Asynchronous training only: staleness of each worker's updates (per replica run).
TAG_STALENESS_MEAN = "hetbatch/staleness_mean"
TAG_STALENESS_MAX = "hetbatch/staleness_max"

# Cluster tags (the aggregate run).
TAG_BALANCE_EFFICIENCY = "hetbatch/balance_efficiency"
TAG_STEP_TIME_MS = "hetbatch/step_time_ms"
TAG_THROUGHPUT = "hetbatch/throughput"
TAG_GLOBAL_BATCH = "hetbatch/global_batch"
TAG_IDEAL_STEP_TIME_MS = "hetbatch/ideal_step_time_ms"
TAG_ADJUSTMENT = "hetbatch/adjustment"
# Where the strategy measures the gradient noise (`measure_gradient_noise`).
TAG_NOISE_SCALE = "hetbatch/gradient_noise_scale"
TAG_STATISTICAL_EFFICIENCY = "hetbatch/statistical_efficiency"
CLUSTER_TAGS = (
    TAG_BALANCE_EFFICIENCY,
    TAG_STEP_TIME_MS,
    TAG_THROUGHPUT,
    TAG_GLOBAL_BATCH,
    TAG_IDEAL_STEP_TIME_MS,
)

LAYOUT_CATEGORY = "tf_hetbatch balance"
LAYOUT_CLUSTER_CATEGORY = "tf_hetbatch cluster"
LAYOUT_STALENESS_CATEGORY = "tf_hetbatch staleness"
LAYOUT_NOISE_CATEGORY = "tf_hetbatch gradient noise"

# (chart title, tag regexes) per category of the custom-scalars layout.
REPLICA_CHARTS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("Batch size per replica (samples/step)", (rf"^{TAG_BATCH_SIZE}$",)),
    ("Compute time per replica (ms/step)", (rf"^{TAG_COMPUTE_TIME_MS}$",)),
    ("Throughput per replica (samples/s)", (rf"^{TAG_REPLICA_THROUGHPUT}$",)),
    ("Wait time per replica (ms/step)", (rf"^{TAG_WAIT_TIME_MS}$",)),
)
CLUSTER_CHARTS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("Balance efficiency mean(t)/max(t)", (rf"^{TAG_BALANCE_EFFICIENCY}$",)),
    ("Step time vs ideal (ms)", (rf"^{TAG_STEP_TIME_MS}$", rf"^{TAG_IDEAL_STEP_TIME_MS}$")),
    ("Aggregate throughput (samples/s)", (rf"^{TAG_THROUGHPUT}$",)),
    ("Global batch (samples/step)", (rf"^{TAG_GLOBAL_BATCH}$",)),
)
NOISE_CHARTS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("Gradient noise scale B_noise (samples)", (rf"^{TAG_NOISE_SCALE}$",)),
    ("Statistical efficiency of the global batch", (rf"^{TAG_STATISTICAL_EFFICIENCY}$",)),
)

STALENESS_CHARTS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("Mean staleness per worker (updates)", (rf"^{TAG_STALENESS_MEAN}$",)),
    ("Max staleness per worker (updates)", (rf"^{TAG_STALENESS_MAX}$",)),
)


def replica_run(k: int) -> str:
    """Returns the run name (relative to the log dir) of replica `k`, e.g. `hetbatch/replica_0`."""
    return f"{SUBDIR}/{REPLICA_RUN_PREFIX}{k}"


def cluster_run() -> str:
    """Returns the run name (relative to the log dir) of the aggregates: `hetbatch/cluster`."""
    return f"{SUBDIR}/{CLUSTER_RUN}"


@dataclasses.dataclass(frozen=True)
class _Adjustment:
    step: int
    old_sizes: Tuple[float, ...]
    new_sizes: Tuple[float, ...]
    reason: str

    def markdown(self) -> str:
        def fmt(sizes: Tuple[float, ...]) -> str:
            return "[" + ", ".join(_fmt_number(s) for s in sizes) + "]"

        return (
            f"**step {self.step}**: batch split {fmt(self.old_sizes)} -> {fmt(self.new_sizes)} "
            f"(global batch {_fmt_number(sum(self.old_sizes))} -> "
            f"{_fmt_number(sum(self.new_sizes))}); reason: {self.reason}"
        )


def _fmt_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3g}"


def _as_floats(name: str, values: Sequence[float], length: int) -> Tuple[float, ...]:
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"`{name}` must be a sequence of {length} numbers, one per replica. "
            f"Received: {name}={values!r}"
        ) from e
    if len(out) != length:
        raise ValueError(
            f"`{name}` must have one value per replica (num_replicas={length}). "
            f"Received: {name}={list(out)} (length {len(out)})"
        )
    if not all(math.isfinite(v) and v >= 0 for v in out):
        raise ValueError(
            f"`{name}` must hold finite values >= 0. Received: {name}={list(out)}"
        )
    return out


def _check_step(step: int) -> int:
    if isinstance(step, bool):
        raise TypeError(f"`step` must be an integer >= 0. Received: step={step!r}")
    try:
        step = operator.index(step)
    except TypeError as e:
        raise TypeError(f"`step` must be an integer >= 0. Received: step={step!r}") from e
    if step < 0:
        raise ValueError(f"`step` must be an integer >= 0. Received: step={step}")
    return step


def _check_positive_time(name: str, value: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"`{name}` must be a number of seconds > 0. Received: {name}={value!r}") from e
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"`{name}` must be a finite number of seconds > 0. Received: {name}={value}"
        )
    return value


def _scalars_pb(values) -> bytes:
    """Serializes (tag, value) pairs as one `Summary` of scalar-plugin float32 tensors.

    This is exactly what `tf.summary.scalar` writes, one value per tag.
    """
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.plugins.scalar import metadata as scalar_metadata

    plugin_metadata = scalar_metadata.create_summary_metadata(display_name=None, description=None)
    scalar_shape = tensor_shape_pb2.TensorShapeProto()
    return summary_pb2.Summary(
        value=[
            summary_pb2.Summary.Value(
                tag=tag,
                metadata=plugin_metadata,
                tensor=tensor_pb2.TensorProto(
                    dtype=types_pb2.DT_FLOAT, tensor_shape=scalar_shape, float_val=[value]
                ),
            )
            for tag, value in values
        ]
    ).SerializeToString()


def make_layout(staleness: bool = False, noise: bool = False):
    """Builds the custom-scalars layout of the balance dashboards.

    Args:
      staleness: also the `LAYOUT_STALENESS_CATEGORY` charts (asynchronous training).
      noise: also the `LAYOUT_NOISE_CATEGORY` charts (the gradient noise is measured).

    Returns:
      A `tensorboard.plugins.custom_scalar.layout_pb2.Layout` with the categories
      `LAYOUT_CATEGORY` (charts overlaying the replicas) and `LAYOUT_CLUSTER_CATEGORY`.
    """
    from tensorboard.plugins.custom_scalar import layout_pb2

    def category(title: str, charts) -> "layout_pb2.Category":
        return layout_pb2.Category(
            title=title,
            chart=[
                layout_pb2.Chart(
                    title=chart_title,
                    multiline=layout_pb2.MultilineChartContent(tag=list(regexes)),
                )
                for chart_title, regexes in charts
            ],
        )

    categories = [
        category(LAYOUT_CATEGORY, REPLICA_CHARTS),
        category(LAYOUT_CLUSTER_CATEGORY, CLUSTER_CHARTS),
    ]
    if staleness:
        categories.append(category(LAYOUT_STALENESS_CATEGORY, STALENESS_CHARTS))
    if noise:
        categories.append(category(LAYOUT_NOISE_CATEGORY, NOISE_CHARTS))
    return layout_pb2.Layout(category=categories)


class BalanceWriter:
    """Writes the TensorBoard balance dashboards of a heterogeneous data-parallel run.

    Call it from the chief only. `log_window` and `log_adjustment` buffer in Python; the buffer
    is written every `flush_every` windows, on `flush()` and on `close()`, by `tf.summary` file
    writers created lazily on the host CPU. Windows are written in the order they were logged.

    Args:
      log_dir: Directory shared with `keras.callbacks.TensorBoard`; the runs go to
        `<log_dir>/hetbatch/replica_<k>` and `<log_dir>/hetbatch/cluster`.
      num_replicas: Number of replicas K >= 1.
      flush_every: Write the buffer after this many windows (>= 1). Default 50.
      ideal: If True, windows logged without `ideal_step_time` get the balanced step time
        estimated by `BalanceWindow.balanced_step_time()`. Default False (the ideal step
        time is written only when given).

    Raises:
      ValueError: for an empty `log_dir`, `num_replicas` < 1 or `flush_every` < 1.

    Example:
    ```python
    with BalanceWriter("logs", num_replicas=2) as writer:
        writer.log_window(step=10, batch_sizes=[40, 24], compute_times=[0.05, 0.04],
                          step_time=0.06)
        writer.log_adjustment(10, [32, 32], [40, 24], reason="replica 1 slower")
    ```
    """

    def __init__(
        self,
        log_dir: str,
        num_replicas: int,
        *,
        flush_every: int = 50,
        ideal: bool = False,
    ) -> None:
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            raise ValueError(
                f"`log_dir` must be a non-empty path, e.g. 'logs'. Received: log_dir={log_dir!r}"
            )
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(
                f"`num_replicas` must be an integer >= 1. Received: num_replicas={num_replicas!r}"
            )
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(
                f"`flush_every` must be an integer >= 1 (windows between writes). "
                f"Received: flush_every={flush_every!r}"
            )
        self._log_dir = os.fspath(log_dir)
        self._num_replicas = num_replicas
        self._flush_every = flush_every
        self._ideal = bool(ideal)
        self._windows: List[BalanceWindow] = []
        self._adjustments: List[_Adjustment] = []
        self._writers: Optional[Dict[str, object]] = None
        self._staleness: List[Tuple[int, Tuple[float, ...], Tuple[float, ...]]] = []
        self._noise: List[Tuple[int, float, float]] = []
        self._layout_written = False
        self._layout_staleness = False
        self._layout_noise = False
        self._closed = False

    @property
    def log_dir(self) -> str:
        """The log directory given at construction."""
        return self._log_dir

    @property
    def num_replicas(self) -> int:
        """Number of replicas K."""
        return self._num_replicas

    def log_window(
        self,
        step: int,
        batch_sizes: Sequence[float],
        compute_times: Sequence[float],
        step_time: float,
        ideal_step_time: Optional[float] = None,
    ) -> BalanceWindow:
        """Buffers the measurements of one window; writes the buffer every `flush_every` windows.

        Args:
          step: Global step at the end of the window (int >= 0).
          batch_sizes: Mean samples/step per replica over the window (K values >= 0).
          compute_times: Mean seconds/step per replica, start of step to local gradients
            ready (K values >= 0). 0 for a replica with samples means not measured (below
            the clock's resolution): its batch size is drawn, its time, throughput and wait
            are not, nor the window's balance efficiency and ideal step time.
          step_time: Mean wall seconds/step of the whole synchronous step (> 0).
          ideal_step_time: Seconds/step of a perfectly balanced split, if known (> 0).

        Returns:
          The `BalanceWindow` with the derived quantities (throughputs, waits, efficiency).

        Raises:
          TypeError, ValueError: for values of the wrong type, length or range.
          RuntimeError: if the writer is closed or called inside a `tf.function`.
        """
        self._check_open("log_window")
        step = _check_step(step)
        sizes = _as_floats("batch_sizes", batch_sizes, self._num_replicas)
        times = _as_floats("compute_times", compute_times, self._num_replicas)
        step_time = _check_positive_time("step_time", step_time)
        if ideal_step_time is not None:
            ideal_step_time = _check_positive_time("ideal_step_time", ideal_step_time)
        window = BalanceWindow(step, sizes, times, step_time, ideal_step_time)
        if ideal_step_time is None and self._ideal:
            window = dataclasses.replace(window, ideal_step_time=window.balanced_step_time())
        self._windows.append(window)
        if len(self._windows) >= self._flush_every:
            self.flush()
        return window

    def log_adjustment(
        self,
        step: int,
        old_sizes: Sequence[float],
        new_sizes: Sequence[float],
        reason: str,
    ) -> None:
        """Buffers a change of the batch split, written as text under `hetbatch/adjustment`.

        Args:
          step: Global step from which the new split applies (int >= 0).
          old_sizes: Per-replica batch sizes before (K values).
          new_sizes: Per-replica batch sizes after (K values).
          reason: Why the split changed, e.g. "compute times differ by 35%".

        Raises:
          TypeError, ValueError: for values of the wrong type, length or range.
          RuntimeError: if the writer is closed.
        """
        self._check_open("log_adjustment")
        step = _check_step(step)
        old = _as_floats("old_sizes", old_sizes, self._num_replicas)
        new = _as_floats("new_sizes", new_sizes, self._num_replicas)
        if not isinstance(reason, str):
            raise TypeError(f"`reason` must be a string. Received: reason={reason!r}")
        self._adjustments.append(_Adjustment(step, old, new, reason))

    def log_staleness(self, step: int, mean: Sequence[float], maximum: Sequence[float]) -> None:
        """Buffers the staleness of each worker's updates over a window (asynchronous training).

        Written to each replica run as `hetbatch/staleness_mean` and `hetbatch/staleness_max`;
        the layout gains a "tf_hetbatch staleness" category. A worker without updates in the
        window (NaN mean, max < 0) gets no point.

        Args:
          step: Global step at the end of the window (int >= 0).
          mean: Mean staleness per worker (K values, NaN allowed), in updates.
          maximum: Largest staleness per worker (K values), in updates.

        Raises:
          TypeError, ValueError: for values of the wrong type or length.
          RuntimeError: if the writer is closed.
        """
        self._check_open("log_staleness")
        step = _check_step(step)
        if len(mean) != self._num_replicas or len(maximum) != self._num_replicas:
            raise ValueError(f"`mean` and `maximum` need one value per worker "
                             f"({self._num_replicas}). Received: mean={list(mean)}, "
                             f"maximum={list(maximum)}")
        self._staleness.append((step, tuple(float(v) for v in mean),
                                tuple(float(v) for v in maximum)))

    def log_gradient_noise(self, step: int, scale: float, efficiency: float) -> None:
        """Buffers the gradient noise scale and the statistical efficiency of the global batch
        (`GradientNoise.scale`, `GradientNoise.efficiency`), written to the cluster run as
        `hetbatch/gradient_noise_scale` and `hetbatch/statistical_efficiency`, with a "tf_hetbatch
        gradient noise" category in the layout. A value that is not finite (nothing measured
        yet; noise dominating) gets no point. Written with the windows.

        Raises:
          TypeError, ValueError: for a step that is not an int >= 0.
          RuntimeError: if the writer is closed.
        """
        self._check_open("log_gradient_noise")
        self._noise.append((_check_step(step), float(scale), float(efficiency)))

    def flush(self) -> None:
        """Writes everything buffered and flushes the event files.

        Raises:
          RuntimeError: if called inside a `tf.function` (call it eagerly).
        """
        if not (self._windows or self._adjustments or self._staleness or self._noise) \
                and self._writers is None:
            return
        import tensorflow as tf

        import tf_hetbatch.distribute  # noqa: F401  (checks the TensorFlow/Keras versions first)

        if tf.inside_function():
            raise RuntimeError(
                "BalanceWriter must write eagerly, e.g. from a Keras callback; it was called "
                "inside a tf.function. Move the call out of the traced function."
            )
        started = time.perf_counter()
        windows, self._windows = self._windows, []
        adjustments, self._adjustments = self._adjustments, []
        staleness, self._staleness = self._staleness, []
        noise, self._noise = self._noise, []
        with tf.device("/cpu:0"), tf.summary.record_if(True):
            writers = self._get_writers(tf)
            self._write_layout(tf, writers[cluster_run()], bool(staleness), bool(noise))
            self._write_windows(tf, writers, windows)
            self._write_staleness(tf, writers, staleness)
            self._write_noise(tf, writers[cluster_run()], noise)
            self._write_adjustments(tf, writers[cluster_run()], adjustments)
            for writer in writers.values():
                writer.flush()
        logger.debug(
            "BalanceWriter wrote %d windows and %d adjustments in %.1f ms",
            len(windows), len(adjustments), 1e3 * (time.perf_counter() - started),
        )

    def close(self) -> None:
        """Writes what is buffered and closes the event files. Safe to call twice."""
        if self._closed:
            return
        self.flush()
        if self._writers is not None:
            for writer in self._writers.values():
                writer.close()
            self._writers = None
        self._closed = True

    def __enter__(self) -> "BalanceWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"BalanceWriter.{method} called after close(); create a new BalanceWriter "
                f"for log_dir={self._log_dir!r}."
            )

    def _get_writers(self, tf) -> Dict[str, object]:
        if self._writers is None:
            runs = [replica_run(k) for k in range(self._num_replicas)] + [cluster_run()]
            # A queue longer than one flush batch: writes happen only when we flush.
            queue = 8 * self._flush_every + 16
            self._writers = {
                run: tf.summary.create_file_writer(
                    os.path.join(self._log_dir, *run.split("/")),
                    max_queue=queue,
                    flush_millis=10**9,
                )
                for run in runs
            }
            logger.info(
                "BalanceWriter writes %d replica runs and the cluster run under %s",
                self._num_replicas, os.path.join(self._log_dir, SUBDIR),
            )
        return self._writers

    def _write_layout(self, tf, writer, staleness: bool, noise: bool) -> None:
        staleness = staleness or self._layout_staleness
        noise = noise or self._layout_noise
        if self._layout_written and (staleness, noise) == (self._layout_staleness,
                                                           self._layout_noise):
            return
        from tensorboard.plugins.custom_scalar import metadata

        with writer.as_default():
            tf.summary.write(
                tag=metadata.CONFIG_SUMMARY_TAG,
                tensor=tf.constant(make_layout(staleness, noise).SerializeToString()),
                metadata=metadata.create_summary_metadata(),
                step=0,
            )
        self._layout_written = True
        self._layout_staleness = staleness
        self._layout_noise = noise

    def _write_windows(self, tf, writers, windows: List[BalanceWindow]) -> None:
        # One raw Summary proto per (run, window) holding all of its scalars: a single eager
        # op instead of one per tag (about 4x cheaper than tf.summary.scalar per tag).
        for k in range(self._num_replicas):
            with writers[replica_run(k)].as_default():
                for w in windows:
                    values = [(TAG_BATCH_SIZE, w.batch_sizes[k])]
                    if w.measured[k]:
                        values += [
                            (TAG_COMPUTE_TIME_MS, 1e3 * w.compute_times[k]),
                            (TAG_REPLICA_THROUGHPUT, w.throughputs[k]),
                            (TAG_WAIT_TIME_MS, 1e3 * w.wait_times[k]),
                        ]
                    tf.summary.experimental.write_raw_pb(_scalars_pb(values), step=w.step)
        with writers[cluster_run()].as_default():
            for w in windows:
                values = [
                    (TAG_STEP_TIME_MS, 1e3 * w.step_time),
                    (TAG_THROUGHPUT, w.throughput),
                    (TAG_GLOBAL_BATCH, w.global_batch),
                ]
                if all(w.measured):
                    values.append((TAG_BALANCE_EFFICIENCY, w.balance_efficiency))
                if w.ideal_step_time is not None:
                    values.append((TAG_IDEAL_STEP_TIME_MS, 1e3 * w.ideal_step_time))
                tf.summary.experimental.write_raw_pb(_scalars_pb(values), step=w.step)

    def _write_staleness(self, tf, writers, staleness) -> None:
        for k in range(self._num_replicas):
            with writers[replica_run(k)].as_default():
                for step, mean, maximum in staleness:
                    if maximum[k] >= 0 and mean[k] == mean[k]:  # the worker had updates
                        values = ((TAG_STALENESS_MEAN, mean[k]), (TAG_STALENESS_MAX, maximum[k]))
                        tf.summary.experimental.write_raw_pb(_scalars_pb(values), step=step)

    def _write_noise(self, tf, writer, noise) -> None:
        with writer.as_default():
            for step, scale, efficiency in noise:
                values = [(tag, v) for tag, v in ((TAG_NOISE_SCALE, scale),
                                                  (TAG_STATISTICAL_EFFICIENCY, efficiency))
                          if math.isfinite(v)]
                if values:
                    tf.summary.experimental.write_raw_pb(_scalars_pb(values), step=step)

    def _write_adjustments(self, tf, writer, adjustments: List[_Adjustment]) -> None:
        with writer.as_default():
            for a in adjustments:
                tf.summary.text(TAG_ADJUSTMENT, a.markdown(), step=a.step)
