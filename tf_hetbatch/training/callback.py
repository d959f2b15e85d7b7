"""DynamicBatching: the Keras callback that splits the global batch and keeps it balanced.

At the start of `fit` it sets a static split of the global batch B (from the devices' nominal
FLOP/s, a short measured probe, evenly, or as given); then, every `interval` steps after a
warm-up, it reads the per-replica compute times the strategy measured over the window, feeds
them to a controller (`tf_hetbatch.core.controllers`) and applies the controller's new split with
`strategy.set_batch_sizes`. The global batch never changes, so neither does the maths.

Multi-worker: `read_replica_times`, `gather_replica_values` and `set_batch_sizes` are
collectives there. This callback calls them at the same steps on every worker, with no
chief-only branch around them; the controllers are deterministic, so every worker computes
the same split from the same gathered measurements. Only writing (dashboards, the PNG) and
cluster-wide log lines are chief-only.

The callback coordinates collaborators with one job each: the window clock
(`window_clock`), the static split (`static_split`), the controller
(`controller_setup`, `protocols.Controller`) and the dashboards (`balance_board`). It uses
the strategy through `protocols.SplitStrategy` only.
"""

from __future__ import annotations

import logging
import numbers
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import keras
import numpy as np

from tf_hetbatch.core import controllers as _controllers
from tf_hetbatch.core import split as _split
from tf_hetbatch.core._validate import check_int, format_value
from tf_hetbatch.core.bounds import (Bounds, check_bound, check_bounds_order, plain_bounds,
                                     resolve_bounds)
from tf_hetbatch.core.measurements import straddles_switch
from tf_hetbatch.distribute.strategy import StepCounter, hetero_strategy_of
from tf_hetbatch.dashboards.balance_board import BalanceBoard
from tf_hetbatch.training.controller_setup import (controller_config, controller_from_config,
                                                   make_controller)
from tf_hetbatch.training.window_clock import WindowClock, WindowMeasurement
from tf_hetbatch.training.static_split import StaticSplitPolicy, check_initial, device_capacities

logger = logging.getLogger(__name__)

__all__ = ["DynamicBatching", "device_capacities"]

_STATE_FORMAT = "tf_hetbatch.DynamicBatching/1"
_MAX_WINDOWS_KEPT = 10_000


class DynamicBatching(keras.callbacks.Callback):
    """Sets and keeps adjusting the per-replica split of the global batch during `fit`.

    Use it with a model created under a tf_hetbatch strategy (`HeteroMirroredStrategy` or
    `HeteroMultiWorkerMirroredStrategy` in `fit`; `HeteroParameterServerStrategy` in
    `AsyncTrainer.fit`, with workers in place of replicas). The data stays batched by the
    global batch size B; only its split b_1..b_K (sum B) changes, and each replica's gradient
    is weighted by b_k / B, so every update is the one a single device would make on the
    whole global batch.

    Order of events, identical on every worker:
    1. `on_train_begin`: the static split (see `initial`) is applied, unless a previous `fit`
       or `set_state` already gave a split, which is then re-applied instead. When B is not
       known yet (data of unknown batch size), the static split waits for the first window,
       which gives B as the measured samples per step.
    2. The first `warmup_steps` steps of every `fit` (tracing) are not measured.
    3. Then every `interval` steps (`probe_steps` for the probe) one window ends: the
       strategy's per-replica means of samples/step and compute seconds/step over the window
       go to `controller.update`, and a changed split is applied. A change reaches the
       replicas 2 to 4 steps later (the input pipeline prefetches), so a window that started
       before the new split was surely in force is used only if every replica's samples/step
       equals the new split (`tf_hetbatch.core.measurements.straddles_switch`).
       `update` also gets `step_time=`: in synchronous training the window's mean step
       time (the slowest worker's, gathered with the times in one collective), else None.
       The built-in controllers then refine the split their model settled on by trying
       neighbouring splits and keeping a measurably faster one (`step_time_search`), and go
       back from a move of their model that the step time shows slower, since compute
       times alone miss costs such as a CPU quota spent in periods or a collective's wait.

    The same measurements always give the same split (controllers are pure functions of their
    state and inputs), so runs are reproducible up to timing noise.

    With `model.compile(steps_per_execution=n)`, Keras calls callbacks once per n steps:
    windows count steps, so a window ends at the first call `interval` or more steps after
    the last (an `interval` that is a multiple of n keeps windows equal). Where a step's fixed
    cost is large against its compute (small per-replica batches, throttled or slow hosts),
    n of 4 to 16 saves Keras's and TensorFlow's host work per step and pays (see BUILD_NOTES,
    "The fixed cost of a step").

    Args:
        initial: the static split. `"flops"` (default): proportional to each replica device's
            nominal peak FLOP/s (`tf_hetbatch.core.devices`; identical devices give the even
            split). `"probe"`: `probe_steps` measured steps on the even split, then
            proportional to the measured throughputs. `"uniform"`: the even split. Or a list
            of K ints summing to B.
        controller: `"model"` (default, `ModelBasedController`), `"proportional"`
            (`ProportionalController`), or an object implementing
            `tf_hetbatch.core.protocols.Controller`: `init(sizes)` and
            `update(state, sizes, times, step_time=None) -> (sizes, state)` (it keeps its
            own bounds).
        min_sizes: smallest batch per replica, int or one int per replica (>= 0). Default 1.
        max_sizes: largest batch per replica, int, one int per replica, or None (B). A max of
            0 (with a min of 0) keeps a replica out of the split: it gets empty batches.
        warmup_steps: steps at the start of every `fit` left unmeasured (tracing). Default 5.
            Asynchronous training also waits until every worker finished 2 updates.
        interval: steps per measurement window (>= 1). Default 10.
        probe_steps: steps measured by `initial="probe"` (>= 1). Default 10.
        log_dir: when set, the chief writes the balance dashboards there (`BalanceWriter`:
            runs `<log_dir>/hetbatch/replica_<k>` and `<log_dir>/hetbatch/cluster`, next to
            `keras.callbacks.TensorBoard(log_dir)`), and at the end of training, if matplotlib
            is installed, the PNG `<log_dir>/hetbatch_balance.png`.
        verbose: 0 logs changes at DEBUG, 1 at INFO (through `logging`, never printed).

    Attributes:
        history: list of dicts `{"step", "old", "new", "reason"}`, one per split applied
            (the first is the initial split).
        windows: list of dicts `{"step", "samples_per_step", "time_per_step", "step_time",
            "used"}`, one per measured window (in memory only, the last 10000).
        controller_state: the controller's current state (None before the first split).
        batch_sizes: the split applied last (None before the first split).

    Raises:
        ValueError, TypeError: on invalid arguments (when constructed; also `min_sizes` above
            `max_sizes`, or a controller whose `update` does not take `step_time`), and in
            `fit` when the model is not under a tf_hetbatch strategy, the split does not fit
            the data, or the bounds do not fit the replicas or admit no split of B (at the
            start of `fit`, or when the first window gives an unknown B).

    Example:
        >>> import keras, numpy as np, tf_hetbatch as hb
        >>> strategy = hb.HeteroMirroredStrategy(["/cpu:0"])
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> x = np.zeros((64, 4), "float32")
        >>> cb = hb.DynamicBatching(warmup_steps=1, interval=2)
        >>> _ = model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0, callbacks=[cb])
        >>> cb.batch_sizes
        (16,)
    """

    def __init__(
        self,
        *,
        initial: Union[str, Sequence[int]] = "flops",
        controller: Any = None,
        min_sizes: Bounds = 1,
        max_sizes: Bounds = None,
        warmup_steps: int = 5,
        interval: int = 10,
        probe_steps: int = 10,
        log_dir: Optional[Union[str, os.PathLike]] = None,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        self.initial = check_initial(initial)
        self.min_sizes = check_bound("min_sizes", min_sizes, allow_none=False)
        self.max_sizes = check_bound("max_sizes", max_sizes, allow_none=True)
        check_bounds_order(self.min_sizes, self.max_sizes)
        self.controller = make_controller(controller, self.min_sizes, self.max_sizes)
        self._controller_arg = controller if isinstance(controller, str) or controller is None \
            else None
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0, "e.g. warmup_steps=5.")
        self.interval = check_int("interval", interval, 1, "e.g. interval=10.")
        self.probe_steps = check_int("probe_steps", probe_steps, 1, "e.g. probe_steps=10.")
        if log_dir is not None and (not isinstance(log_dir, (str, os.PathLike))
                                    or not os.fspath(log_dir)):
            raise ValueError("`log_dir` must be a non-empty path such as 'logs', or None for no "
                             f"dashboards. Received: log_dir={log_dir!r}")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        if isinstance(verbose, bool) or not isinstance(verbose, numbers.Integral) or verbose < 0:
            raise ValueError(f"`verbose` must be 0 or 1. Received: verbose={verbose!r}")
        self.verbose = int(verbose)

        # Persistent state (get_state / set_state).
        self.history: List[Dict[str, Any]] = []
        self.controller_state = None
        self._sizes: Optional[Tuple[int, ...]] = None
        self._global_step = 0
        self._num_windows = 0
        # Per-fit state and collaborators (made in on_train_begin).
        self.windows: List[Dict[str, Any]] = []
        self._strategy = None
        self._steps = None
        self._clock: Optional[WindowClock] = None
        self._static: Optional[StaticSplitPolicy] = None
        self._board: Optional[BalanceBoard] = None
        self._switch_lag = 0
        self._change_step: Optional[int] = None

    # ------------------------------------------------------------------ public state ------
    @property
    def batch_sizes(self) -> Optional[Tuple[int, ...]]:
        """The split applied last, in replica order (None before the first split)."""
        return self._sizes

    @property
    def settled_batch_sizes(self) -> Optional[Tuple[int, ...]]:
        """The split the controller settled on: `batch_sizes`, except while its step-time
        search tries a neighbouring split (then the split the search goes back to unless the
        try proves faster). To train later runs at a fixed split, pass it to the strategy's
        `set_batch_sizes`."""
        if self.controller_state is None or self._sizes is None:
            return self._sizes
        return tuple(int(v) for v in self.controller_state.settled_sizes)

    def get_state(self) -> Dict[str, Any]:
        """The callback's state as a JSON-serialisable dict, for checkpoints (see `set_state`).

        Returns:
            A dict with the format tag, the current split, the controller state, the history
            of changes and the step counters.
        """
        return {
            "format": _STATE_FORMAT,
            "batch_sizes": None if self._sizes is None else list(self._sizes),
            "controller_state": None if self.controller_state is None
            else self.controller_state.to_dict(),
            "history": [_plain_entry(e) for e in self.history],
            "global_step": int(self._global_step),
            "windows": int(self._num_windows),
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores a state from `get_state`, e.g. when resuming from a checkpoint.

        The next `fit` re-applies the saved split (no new static split) and continues the
        controller from the saved state. Call it before `fit`, on every worker.

        Args:
            state: a dict from `get_state()` (possibly through JSON).

        Raises:
            ValueError: if `state` is not such a dict.
        """
        if not isinstance(state, Mapping) or state.get("format") != _STATE_FORMAT:
            raise ValueError(
                f"`state` must be a dict from DynamicBatching.get_state() (format "
                f"{_STATE_FORMAT!r}). Received: {format_value(state)}")
        sizes, ctrl = state.get("batch_sizes"), state.get("controller_state")
        if (sizes is None) != (ctrl is None):
            raise ValueError("`state` must have both `batch_sizes` and `controller_state`, or "
                             f"neither. Received: batch_sizes={format_value(sizes)}, "
                             f"controller_state={format_value(ctrl)}")
        if sizes is not None:
            sizes = _split.validate_sizes(sizes, len(sizes))
            restore = getattr(self.controller, "state_from_dict",  # optional, see Controller
                              _controllers.ControllerState.from_dict)
            ctrl = restore(ctrl)
            if tuple(int(v) for v in ctrl.sizes) != sizes:
                raise ValueError(
                    "`state` is inconsistent: batch_sizes must equal the controller state's "
                    f"sizes. Received: batch_sizes={list(sizes)}, controller sizes="
                    f"{list(ctrl.sizes)}")
        fix = "pass a state from DynamicBatching.get_state()."
        global_step = check_int("global_step", state.get("global_step", 0), 0, fix)
        num_windows = check_int("windows", state.get("windows", 0), 0, fix)
        self._sizes = sizes
        self.controller_state = ctrl
        self.history = [dict(e) for e in state.get("history", [])]
        self._global_step = global_step
        self._num_windows = num_windows

    def get_config(self) -> Dict[str, Any]:
        """Constructor arguments as a JSON-serialisable dict (see `from_config`)."""
        return {
            "initial": self.initial if isinstance(self.initial, str) else list(self.initial),
            "controller": controller_config(self.controller, self._controller_arg),
            "min_sizes": plain_bounds(self.min_sizes),
            "max_sizes": plain_bounds(self.max_sizes),
            "warmup_steps": self.warmup_steps,
            "interval": self.interval,
            "probe_steps": self.probe_steps,
            "log_dir": self.log_dir,
            "verbose": self.verbose,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any],
                    custom_objects: Optional[Mapping[str, type]] = None) -> "DynamicBatching":
        """Rebuilds a callback from `get_config()`.

        Args:
            config: the dict from `get_config()`.
            custom_objects: class name -> class, for controllers other than the built-in ones.

        Raises:
            ValueError: if the controller class is unknown.
        """
        config = dict(config)
        config["controller"] = controller_from_config(config.get("controller"), custom_objects)
        return cls(**config)

    # ------------------------------------------------------------------ Keras hooks -------
    def on_train_begin(self, logs=None):
        strategy = hetero_strategy_of(self.model, "DynamicBatching")
        self._strategy = strategy
        self._steps = StepCounter(strategy)
        self._switch_lag = int(strategy.switch_lag_steps)
        num = strategy.num_parts
        # On every worker alike, before any collective; B may still be unknown (then the
        # first window gives it, see `_finish_static`).
        resolve_bounds(strategy.global_batch_size, num, *self._bounds())
        self._clock = WindowClock(strategy, self.warmup_steps)
        self._static = StaticSplitPolicy(self.initial, self.probe_steps, self._bounds())
        self._change_step = None  # the step of the last change of split, until it shows
        self.windows = []
        if strategy.is_chief and self.log_dir is not None:
            self._board = BalanceBoard(self.log_dir, num)
        if self.controller_state is not None:
            self._resume(strategy)
        else:
            self._start(strategy)
        self._clock.begin()

    def on_epoch_begin(self, epoch, logs=None):
        # Validation and the epoch boundary are not a replica's work: restart the step clock.
        self._strategy.restart_step_clock()

    def on_train_batch_begin(self, batch, logs=None):
        self._clock.batch_begin()

    def on_train_batch_end(self, batch, logs=None):
        steps = self._steps()  # > 1 with steps_per_execution
        self._global_step += steps
        length = self.interval if self._static_done \
            else self._static.first_window_length(self.interval)
        measured = self._clock.batch_end(steps, length)
        if measured is not None:
            self._use_window(measured)

    def on_train_end(self, logs=None):
        board, self._board = self._board, None
        if board is not None:
            board.close()

    # ------------------------------------------------------------------ the static split --
    @property
    def _static_done(self) -> bool:
        return self.controller_state is not None

    def _bounds(self):
        # A controller's own bounds (optional, see protocols.Controller) win.
        return (getattr(self.controller, "min_sizes", self.min_sizes),
                getattr(self.controller, "max_sizes", self.max_sizes))

    def _start(self, strategy):
        """Applies the static split, or prepares it for the first window when B is unknown."""
        start = self._static.at_start(strategy)
        if start is None:
            logger.debug("Global batch size unknown; the static split waits for the first window.")
        elif start[1] is None:  # the probe measures on this split first
            self._set_sizes(strategy, start[0])
        else:
            self._apply_static(strategy, *start)

    def _finish_static(self, strategy, sizes, times):
        """The static split from the first window: B (if unknown) and, for a probe, throughput."""
        num = strategy.num_parts
        total = strategy.global_batch_size
        if total is None:
            total = int(round(float(np.sum(sizes))))
            resolve_bounds(total, num, *self._bounds())
        self._apply_static(strategy, *self._static.from_window(total, num, times.throughput))

    def _apply_static(self, strategy, sizes, reason):
        old = strategy.batch_sizes
        state = self.controller.init(list(sizes))
        sizes = tuple(int(v) for v in state.sizes)  # init re-splits sizes outside the bounds
        self.controller_state = state
        self._set_sizes(strategy, sizes)
        self._record(old if old is not None else sizes, sizes, reason)

    def _resume(self, strategy):
        """Re-applies the split of a previous fit or of `set_state`."""
        num = strategy.num_parts
        sizes = self._sizes
        if len(sizes) != num:
            raise ValueError(
                f"The saved split has {len(sizes)} replicas but the strategy has {num}. "
                f"Received: batch_sizes={list(sizes)}. Fix: use a new DynamicBatching (or "
                "set_state from a run with the same replicas).")
        total = strategy.global_batch_size
        if total is not None and total != sum(sizes):
            raise ValueError(
                f"The saved split sums to {sum(sizes)} but the data's global batch size is "
                f"{total}. Received: batch_sizes={list(sizes)}. Fix: batch the data with "
                f"{sum(sizes)}, or use a new DynamicBatching.")
        self._set_sizes(strategy, sizes)
        logger.debug("Resumed with batch sizes %s", list(sizes))

    # ------------------------------------------------------------------ windows -----------
    def _use_window(self, measured: WindowMeasurement):
        """A window ended: the static split, a controller update, or nothing; then its record."""
        strategy = self._strategy
        self._num_windows += 1
        times = measured.times
        sizes = np.nan_to_num(times.samples_per_step, nan=0.0)
        # A replica whose compute is shorter than the clock's resolution can read 0 (or, its
        # start stamp run late, slightly below): "not measured" for the controller and dashboards.
        secs = np.maximum(np.nan_to_num(times.time_per_step, nan=0.0), 0.0)
        straddles = straddles_switch(sizes, self._sizes, self._global_step - measured.steps,
                                     self._change_step, self._switch_lag)
        if not straddles:
            self._change_step = None
        used = False
        idle = np.flatnonzero(np.asarray(times.steps) <= 0)
        if len(idle) and self._static_done:
            # Asynchronous training only (synchronous replicas all run every step): a worker
            # that finished no update in the window (lost, restarting, or far slower than the
            # window) gives no measurement; keep the split until it reports again.
            logger.info("Window ending at step %d: worker(s) %s finished no update; split "
                        "kept.", self._global_step, idle.tolist())
        elif not self._static_done:
            self._finish_static(strategy, sizes, times)
        elif straddles:
            logger.debug("Window ending at step %d straddles a change of split; skipped.",
                         self._global_step)
        else:
            used = True
            self._control(strategy, sizes, secs, measured.cluster_step_time)
        self._log_window(sizes, secs, measured.step_time, used)
        if measured.staleness is not None:  # asynchronous training
            self._log_staleness(measured.staleness)

    def _control(self, strategy, sizes, secs, step_time):
        """`step_time`: the cluster's step time (synchronous training), else None."""
        old = self._sizes
        new, state = self.controller.update(self.controller_state, sizes, secs,
                                            step_time=step_time)
        self.controller_state = state
        new = tuple(int(v) for v in new)
        if new != old:
            self._set_sizes(strategy, new)
            self._record(old, new, str(state.reason))

    def _set_sizes(self, strategy, sizes):
        in_effect = strategy.batch_sizes  # the even split until sizes were set
        strategy.set_batch_sizes(list(sizes))  # a collective, on every worker
        if in_effect is None or tuple(in_effect) != tuple(sizes):
            self._change_step = self._global_step
        self._sizes = tuple(int(v) for v in sizes)

    def _record(self, old, new, reason):
        entry = {"step": int(self._global_step), "old": [int(v) for v in old],
                 "new": [int(v) for v in new], "reason": reason}
        self.history.append(entry)
        if self._strategy.is_chief:
            level = logging.INFO if self.verbose else logging.DEBUG
            logger.log(level, "step %d: batch split %s -> %s (%s)", entry["step"], entry["old"],
                       entry["new"], reason)
            if self._board is not None:
                self._board.log_adjustment(entry)

    def _log_window(self, sizes, secs, step_time, used):
        window = {"step": int(self._global_step), "samples_per_step": sizes.tolist(),
                  "time_per_step": secs.tolist(), "step_time": float(step_time), "used": used}
        self.windows.append(window)
        del self.windows[:-_MAX_WINDOWS_KEPT]
        if self._board is not None:
            self._board.log_window(window)

    def _log_staleness(self, staleness):
        mean, maximum = staleness.mean, staleness.max
        self.windows[-1]["staleness_mean"] = [None if v != v else float(v) for v in mean]
        self.windows[-1]["staleness_max"] = [int(v) for v in maximum]
        if self._board is not None:
            self._board.log_staleness(self.windows[-1]["step"], mean.tolist(), maximum.tolist())


def _plain_entry(entry):
    return {"step": int(entry["step"]), "old": [int(v) for v in entry["old"]],
            "new": [int(v) for v in entry["new"]], "reason": str(entry["reason"])}
