"""Balancer: keeps a tf_hetbatch strategy's split of the global batch balanced, in any loop.

At the start of training it sets a static split of the global batch B (from the devices'
nominal FLOP/s, a short measured probe, evenly, or as given); then, every `interval` steps
after a warm-up, it reads the per-replica compute times the strategy measured over the window,
feeds them to a controller (`tf_hetbatch.core.controllers`) and applies the controller's new
split with `strategy.set_batch_sizes`. The global batch never changes, so neither does the
maths.

A training loop tells it where it is: `begin()` (optional: the first `step_end` begins),
`step_end()` after each step (or after each block of steps, with their count),
`epoch_begin()` after a pause that is no replica's work (an epoch boundary with validation),
`end()`. `DynamicBatching` is the Keras callback that calls these from `fit`; `AsyncTrainer`
calls them itself; a custom training loop calls them directly:

    balancer = hb.Balancer(strategy)
    for batch in dist_dataset:
        train_step(batch)         # strategy.run(...) of one global batch
        balancer.step_end()

A loop may also call `step_end` only when `steps_until_due()` steps have passed since its
last call (with their count, or None to count them from the strategy): windows then start
and end at the same steps, with no host work in the steps between (`DynamicBatching` does so).

Multi-worker: a window's end issues no collective. Every step's all-reduce brought every
replica's measurements to every worker (`read_replica_times` is local), so every worker reads
the same sums at the same step, runs the same deterministic controller on them and calls
`set_batch_sizes` with the same split at the same step, which switches every worker at the
same later step with no communication. Collectives remain only where the workers' values
differ: the static split's `part_capacities` (each worker's devices) and a split set before
the first trained step (whether a worker's pipeline has started). Only writing (dashboards,
the PNG) and cluster-wide log lines are chief-only.

It coordinates collaborators with one job each: the window clock (`window_clock`), the static
split (`static_split`), the controller (`controller_setup`, `protocols.Controller`) and the
dashboards (`balance_board`). It uses the strategy through `protocols.SplitStrategy` only.
Its state (`get_state`) is JSON; the balancer is also a `tf.train.experimental.PythonState`,
so `tf.train.Checkpoint(..., balancer=balancer)` saves and restores it with a run.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from tf_hetbatch.core import controllers as _controllers
from tf_hetbatch.core import split as _split
from tf_hetbatch.core._validate import check_int, format_value
from tf_hetbatch.core.bounds import (Bounds, check_bound, check_bounds_order, plain_bounds,
                                     resolve_bounds)
from tf_hetbatch.core.measurements import straddles_switch
from tf_hetbatch.core.protocols import SplitStrategy
from tf_hetbatch.dashboards.balance_board import BalanceBoard
from tf_hetbatch.distribute.strategy import StepCounter
from tf_hetbatch.training.controller_setup import (controller_config, controller_from_config,
                                                   make_controller)
from tf_hetbatch.training.static_split import StaticSplitPolicy, check_initial
from tf_hetbatch.training.window_clock import WindowClock, WindowMeasurement

logger = logging.getLogger(__name__)

# The format of `get_state()`; states of the earlier `DynamicBatching` carry its own tag.
STATE_FORMAT = "tf_hetbatch.DynamicBatching/1"
_MAX_WINDOWS_KEPT = 10_000


class Balancer(tf.train.experimental.PythonState):
    """Sets and keeps adjusting a tf_hetbatch strategy's split of the global batch.

    Works with the synchronous strategies (`HeteroMirroredStrategy`,
    `HeteroMultiWorkerMirroredStrategy`: replicas) and the asynchronous one
    (`HeteroParameterServerStrategy`: workers), in `fit` (through `DynamicBatching`), in
    `AsyncTrainer`, and in custom training loops. The data stays batched by the global batch
    size B; only its split b_1..b_K (sum B) changes, and each replica's gradient is weighted
    by b_k / B, so every update is the one a single device would make on the whole batch.

    Order of events, identical on every worker:
    1. `begin`: the static split (see `initial`) is applied, unless an earlier `begin` or
       `set_state` already gave a split, which is then re-applied instead (re-made in its
       proportions, with one INFO line, when the data's global batch is another). When B
       is not known yet, the static split waits for the first window, which gives B as the
       measured samples per step.
    2. The first `warmup_steps` steps after every `begin` (tracing) are not measured.
    3. Then every `interval` steps (`probe_steps` for the probe) one window ends: the
       strategy's per-replica means of samples/step and compute seconds/step over the window
       go to `controller.update`, and a changed split is applied. A change reaches the
       replicas a few steps later (the input pipeline prefetches), so a window that started
       before the new split was surely in force is used only if every replica's samples/step
       equals the new split (`tf_hetbatch.core.measurements.straddles_switch`). `update`
       also gets `step_time=`: in synchronous training the window's mean step time (one
       process: its wall clock; several workers: the step cycle, `ReplicaTimes.step_time`, the
       same on every worker), else None. The
       built-in controllers then refine the split their model settled on by trying
       neighbouring splits and keeping a measurably faster one (`step_time_search`), and go
       back from a move of their model that the step time shows slower, since compute
       times alone miss costs such as a CPU quota spent in periods or a collective's wait.

    The same measurements always give the same split (controllers are pure functions of their
    state and inputs), so runs are reproducible up to timing noise.

    Windows count steps: `step_end(steps)` after a block of `steps` steps (Keras's
    `steps_per_execution`) ends a window at the first call `interval` or more steps after the
    last. Where a step's fixed cost is large against its compute (small per-replica batches,
    throttled or slow hosts), blocks of 4 to 16 steps save host work per step and pay (see
    BUILD_NOTES, "Current results", fixed cost).

    Args:
        strategy: the tf_hetbatch strategy, or None to give it to `begin` (as
            `DynamicBatching` does).
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
        max_sizes: largest batch per replica, int, one int (or None: no cap) per replica, or
            None (B). A max of 0 (with a min of 0) keeps a replica out of the split: it gets
            empty batches.
        warmup_steps: steps after every `begin` left unmeasured (tracing). Default 5.
            Asynchronous training also waits until every worker finished 2 updates.
        interval: steps per measurement window (>= 1). Default 10. Across workers a window's
            step time counts the step cycles wholly inside it (its first 2 steps carry none),
            so there the step-time search needs windows of 3 or more steps.
        probe_steps: steps measured by `initial="probe"` (>= 1). Default 10.
        log_dir: when set, the chief writes the balance dashboards there (`BalanceWriter`:
            runs `<log_dir>/hetbatch/replica_<k>` and `<log_dir>/hetbatch/cluster`, next to
            `keras.callbacks.TensorBoard(log_dir)`), and at `end()`, if matplotlib is
            installed, the PNG `<log_dir>/hetbatch_balance.png`.
        verbose: 0 logs changes at DEBUG, 1 at INFO (through `logging`, never printed).

    Attributes:
        history: list of dicts `{"step", "old", "new", "reason"}`, one per split applied
            (the first is the initial split).
        windows: list of dicts `{"step", "samples_per_step", "time_per_step", "step_time",
            "used"}`, one per measured window (in memory only, the last 10000); where the
            strategy measures the gradient noise (`measure_gradient_noise`), also
            `"gradient_noise_scale"` and `"statistical_efficiency"` (of the global batch).
        controller_state: the controller's current state (None before the first split).

    Raises:
        ValueError, TypeError: on invalid arguments (when constructed; also `min_sizes` above
            `max_sizes`, or a controller whose `update` does not take `step_time`), and in
            `begin` when the strategy is not a tf_hetbatch strategy, or the bounds do not fit
            the replicas or admit no split of B (at `begin`, or when the first window gives
            an unknown B).

    Example:
        >>> import tf_hetbatch as hb
        >>> strategy = hb.HeteroMirroredStrategy(["/cpu:0"])
        >>> balancer = hb.Balancer(strategy, interval=2)
        >>> balancer.get_config()["interval"]
        2
    """

    def __init__(
        self,
        strategy: Optional[SplitStrategy] = None,
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
        self._strategy = _check_strategy(strategy) if strategy is not None else None

        # Persistent state (get_state / set_state).
        self.history: List[Dict[str, Any]] = []
        self.controller_state = None
        self._sizes: Optional[Tuple[int, ...]] = None
        self._global_step = 0
        self._num_windows = 0
        # Per-run state and collaborators (made in begin).
        self.windows: List[Dict[str, Any]] = []
        self._begun = False
        self._steps = None
        self._clock: Optional[WindowClock] = None
        self._static: Optional[StaticSplitPolicy] = None
        self._board: Optional[BalanceBoard] = None
        self._switch_lag = 0
        self._change_step: Optional[int] = None

    # ------------------------------------------------------------------ public state ------
    @property
    def strategy(self) -> Optional[SplitStrategy]:
        """The strategy it balances (None until given)."""
        return self._strategy

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
        """The balancer's state as a JSON-serialisable dict, for checkpoints (see `set_state`).

        Returns:
            A dict with the format tag, the current split, the controller state, the history
            of changes and the step counters.
        """
        return {
            "format": STATE_FORMAT,
            "batch_sizes": None if self._sizes is None else list(self._sizes),
            "controller_state": None if self.controller_state is None
            else self.controller_state.to_dict(),
            "history": [_plain_entry(e) for e in self.history],
            "global_step": int(self._global_step),
            "windows": int(self._num_windows),
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores a state from `get_state`, e.g. when resuming from a checkpoint.

        The next `begin` re-applies the saved split (no new static split) and continues the
        controller from the saved state. Call it before training, on every worker.

        Args:
            state: a dict from `get_state()` (possibly through JSON).

        Raises:
            ValueError: if `state` is not such a dict.
        """
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"`state` must be a dict from Balancer.get_state() (format {STATE_FORMAT!r}). "
                f"Received: {format_value(state)}")
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
        fix = "pass a state from Balancer.get_state()."
        global_step = check_int("global_step", state.get("global_step", 0), 0, fix)
        num_windows = check_int("windows", state.get("windows", 0), 0, fix)
        self._sizes = sizes
        self.controller_state = ctrl
        self.history = [dict(e) for e in state.get("history", [])]
        self._global_step = global_step
        self._num_windows = num_windows
        self._begun = False  # the next step re-applies the restored split

    def serialize(self) -> str:
        """`tf.train.experimental.PythonState`: the state (`get_state`) as JSON."""
        return json.dumps(self.get_state())

    def deserialize(self, string_value) -> None:
        """`tf.train.experimental.PythonState`: restores a state `serialize` wrote."""
        if isinstance(string_value, bytes):
            string_value = string_value.decode("utf-8")
        self.set_state(json.loads(string_value))

    def get_config(self) -> Dict[str, Any]:
        """Constructor arguments (but the strategy) as a JSON-serialisable dict."""
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
    def from_config(cls, config: Mapping[str, Any], strategy: Optional[SplitStrategy] = None,
                    custom_objects: Optional[Mapping[str, type]] = None) -> "Balancer":
        """Rebuilds a balancer from `get_config()` (and the strategy, if known).

        Raises:
            ValueError: if the controller class is unknown.
        """
        return cls(strategy, **config_with_controller(config, custom_objects))

    # ------------------------------------------------------------------ the loop ----------
    def begin(self, strategy: Optional[SplitStrategy] = None) -> None:
        """The start of training (a `fit`, a loop): the static split, or the split restored.

        Args:
            strategy: the strategy, if not given to the constructor (or another one, e.g. a
                new strategy after a restart).

        Raises:
            ValueError: no strategy, or bounds or a saved split that do not fit it.
        """
        if strategy is not None:
            self._strategy = _check_strategy(strategy)
        strategy = self._strategy
        if strategy is None:
            raise ValueError("The Balancer has no strategy. Fix: hb.Balancer(strategy, ...), "
                             "or balancer.begin(strategy).")
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
        if strategy.is_chief and self.log_dir is not None and self._board is None:
            self._board = BalanceBoard(self.log_dir, num)
        if self.controller_state is not None:
            self._resume(strategy)
        else:
            self._start(strategy)
        self._begun = True
        self._clock.begin()
        self._clock.batch_begin()

    def epoch_begin(self) -> None:
        """After a pause that is no replica's work (an epoch boundary, validation, a
        checkpoint): the next step of each replica is timed from its inputs, and the window's
        wall time restarts here. Report the steps before the pause first (`step_end`)."""
        if self._strategy is not None:
            self._strategy.restart_step_clock()
        if self._clock is not None:
            self._clock.batch_begin()

    @property
    def steps_since_begin(self) -> int:
        """Training steps reported by `step_end` since the last `begin` (0 before it)."""
        return 0 if self._clock is None else self._clock.fit_step

    def steps_until_due(self) -> int:
        """Steps (>= 1) after the last `step_end` until the next one that can start or end a
        window: a loop may skip the calls in between and report their steps at once (then
        windows start and end at the same steps, and no host work runs between them).
        Before `begin`: 1."""
        if not self._begun or self._clock is None:
            return 1
        return self._clock.steps_due(self._window_length())

    def step_begin(self) -> None:
        """Optional: stamps a step's (or block's) start for the window's step time; without
        it, a step runs from the previous `step_end`."""
        if self._clock is not None:
            self._clock.batch_begin()

    def step_end(self, steps: Optional[int] = None) -> None:
        """After each training step (or block of steps), on every worker.

        Args:
            steps: the steps the call covers; None counts them from the strategy (the steps
                it trained since the last call; one update in asynchronous training).

        Raises:
            ValueError: `steps` is not an int >= 0.
        """
        if not self._begun:
            self.begin()
        if steps is None:
            steps = self._steps()
        else:
            steps = check_int("steps", steps, 0, "the steps the call covers, e.g. steps=1.")
            self._steps()  # keep the strategy's count in step
        if steps == 0:
            return  # nothing trained since the last call (a pause is no step's time)
        self._global_step += steps
        measured = self._clock.batch_end(steps, self._window_length())
        if measured is not None:
            self._use_window(measured)
        self._clock.batch_begin()

    def end(self) -> None:
        """The end of training: closes the dashboards (and writes the PNG)."""
        board, self._board = self._board, None
        if board is not None:
            board.close()
        self._begun = False

    def _window_length(self) -> int:
        return self.interval if self._static_done \
            else self._static.first_window_length(self.interval)

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
        """Re-applies the split of an earlier `begin` or of `set_state`; re-made in its
        proportions for data batched by another global batch size."""
        num = strategy.num_parts
        sizes = self._sizes
        if len(sizes) != num:
            raise ValueError(
                f"The saved split has {len(sizes)} replicas but the strategy has {num}. "
                f"Received: batch_sizes={list(sizes)}. Fix: use a new Balancer (or "
                "set_state from a run with the same replicas).")
        total = strategy.global_batch_size
        if total is not None and total != sum(sizes):
            settled = self.settled_batch_sizes
            resplit = _split.split_proportionally(total, settled, *self._bounds())
            # The strategy said at INFO that the data's global batch changed.
            logger.debug("Global batch %d (the split was for %d): the settled split %s "
                         "re-made in its proportions, %s.", total, sum(sizes), list(settled),
                         list(resplit))
            self._apply_static(strategy, resplit, "global batch changed")
            return
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
        if len(idle) == len(sizes) and self._static_done:
            # Nothing measured: synchronous steps compiled by XLA take no timing stamps (the
            # strategy warned once), or no asynchronous worker finished an update.
            logger.debug("Window ending at step %d: no replica recorded a timed step; split "
                         "kept.", self._global_step)
        elif len(idle) and self._static_done:
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
        step_time = measured.cluster_step_time
        self._log_window(sizes, secs, measured.step_time if step_time is None else step_time,
                         used)
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
        # On every worker at the same step with the same sizes: no collective once a step
        # was trained (see HeteroMultiWorkerMirroredStrategy).
        strategy.set_batch_sizes(list(sizes))
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
        noise = getattr(self._strategy, "gradient_noise_scale", None)
        if noise is not None and noise.steps:  # `measure_gradient_noise`
            window["gradient_noise_scale"] = noise.scale
            window["statistical_efficiency"] = noise.efficiency(float(np.sum(sizes)))
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


def config_with_controller(config: Mapping[str, Any],
                           custom_objects: Optional[Mapping[str, type]] = None) -> Dict[str, Any]:
    """A `get_config()` dict with its controller entry rebuilt (see `controller_from_config`)."""
    config = dict(config)
    config["controller"] = controller_from_config(config.get("controller"), custom_objects)
    return config


def _check_strategy(strategy):
    from tf_hetbatch.distribute.parameter_server import HeteroParameterServerStrategy
    from tf_hetbatch.distribute.strategy import HeteroMixin

    if not isinstance(strategy, (HeteroMixin, HeteroParameterServerStrategy)):
        raise ValueError(
            "A Balancer needs a tf_hetbatch strategy. Received: "
            f"{type(strategy).__module__}.{type(strategy).__name__}. Fix: "
            "hb.HeteroMirroredStrategy(), hb.HeteroMultiWorkerMirroredStrategy() or "
            "hb.HeteroParameterServerStrategy().")
    return strategy


def _plain_entry(entry):
    return {"step": int(entry["step"]), "old": [int(v) for v in entry["old"]],
            "new": [int(v) for v in entry["new"]], "reason": str(entry["reason"])}

