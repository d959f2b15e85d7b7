"""DynamicBatching: the Keras callback that keeps the split of the global batch balanced.

A thin adapter: `fit`'s callback hooks drive a `tf_hetbatch.Balancer` (`balancer`), which
does the work (the static split, the measurement windows, the controller, the dashboards,
its state). Custom training loops and `AsyncTrainer` drive a `Balancer` themselves.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import keras

from tf_hetbatch.core.bounds import Bounds
from tf_hetbatch.distribute.strategy import hetero_strategy_of
from tf_hetbatch.training.balancer import Balancer, config_with_controller
from tf_hetbatch.training.static_split import device_capacities

__all__ = ["DynamicBatching", "device_capacities"]


class DynamicBatching(keras.callbacks.Callback):
    """Sets and keeps adjusting the per-replica split of the global batch during `fit`.

    The Keras face of `tf_hetbatch.Balancer` (its `balancer`), which does the work. Use it
    with a model created under a tf_hetbatch strategy (`HeteroMirroredStrategy` or
    `HeteroMultiWorkerMirroredStrategy` in `fit`; `HeteroParameterServerStrategy` in
    `AsyncTrainer.fit`, with workers in place of replicas). The data stays batched by the
    global batch size B; only its split b_1..b_K (sum B) changes, and each replica's gradient
    is weighted by b_k / B, so every update is the one a single device would make on the
    whole global batch.

    `on_train_begin` begins the balancer (the static split, or the split of an earlier
    `fit` or of `set_state`, re-made in its proportions for data batched by another size);
    the balancer hears of the steps only where it acts: `on_train_batch_begin` compares the
    step Keras is at with the next step the balancer is due at (`Balancer.steps_until_due`:
    a window's start or end) and reports the steps trained only there (with
    `steps_per_execution=n`, at the first execution boundary at or after it), and the epoch's
    last steps are reported when it ends (before validation); `on_epoch_begin` restarts the
    replicas' step clocks, `on_train_end` closes the dashboards. The order of events and the
    windows are the `Balancer`'s; the same measurements always give the same split, on every
    worker, and a window's end issues no collective.

    Cost per step: none beyond comparing two integers. It has no `on_train_batch_end`, so
    it leaves Keras's callback dispatch as it is without it: on a backend Keras dispatches
    batch ends asynchronously, it still does (Keras 3 turns that off for a callback with a
    batch-end hook; on TensorFlow, Keras 3.15 dispatches every callback list synchronously,
    tensorflow/tensorflow#78338). One process measures its step time as the wall time from a
    window's start to its end, validation and the pauses at epoch boundaries excluded.

    Its arguments (`initial`, `controller`, `min_sizes`, `max_sizes`, `warmup_steps`,
    `interval`, `probe_steps`, `log_dir`, `verbose`) are the balancer's options, as for
    `tf_hetbatch.Balancer` (the strategy is the model's). `warmup_steps` are the first steps of
    every `fit`; the PNG is written at the end of training. Where the strategy measures the
    gradient noise (`measure_gradient_noise`), each epoch's logs (so `History`) carry
    `gradient_noise_scale`, and each window its scale and the statistical efficiency of the
    global batch (`GradientNoise.efficiency`).

    Attributes:
        balancer: the `Balancer` it drives.
        history, windows, controller_state, batch_sizes, settled_batch_sizes: the
            balancer's (see `Balancer`).

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
        self.balancer = Balancer(
            initial=initial, controller=controller, min_sizes=min_sizes, max_sizes=max_sizes,
            warmup_steps=warmup_steps, interval=interval, probe_steps=probe_steps,
            log_dir=log_dir, verbose=verbose)
        self._in_fit = False
        self._due_at = 0  # the fit step at which the balancer next acts
        self._epoch_base = 0  # the fit steps before this epoch's first

    # ------------------------------------------------------------------ the balancer's ----
    def __getattr__(self, name):
        # Its options (`initial`, `interval`, `controller`, ...) and records (`history`,
        # `windows`, `controller_state`) are the balancer's.
        if name in _DELEGATED:
            return getattr(self.__dict__["balancer"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def batch_sizes(self) -> Optional[Tuple[int, ...]]:
        """The split applied last, in replica order (None before the first split)."""
        return self.balancer.batch_sizes

    @property
    def settled_batch_sizes(self) -> Optional[Tuple[int, ...]]:
        """The split the controller settled on (see `Balancer.settled_batch_sizes`)."""
        return self.balancer.settled_batch_sizes

    @property
    def history(self) -> List[Dict[str, Any]]:
        """Every split applied (`Balancer.history`)."""
        return self.balancer.history

    @property
    def windows(self) -> List[Dict[str, Any]]:
        """Every measured window of the last fit (`Balancer.windows`)."""
        return self.balancer.windows

    def get_state(self) -> Dict[str, Any]:
        """The balancer's state as a JSON-serialisable dict (`Balancer.get_state`), with
        every step trained so far reported to it (in `fit`, e.g. a checkpoint's)."""
        self._report_steps()
        return self.balancer.get_state()

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores a state from `get_state` before the next `fit` (`Balancer.set_state`)."""
        self.balancer.set_state(state)

    def get_config(self) -> Dict[str, Any]:
        """Constructor arguments as a JSON-serialisable dict (see `from_config`)."""
        return self.balancer.get_config()

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
        return cls(**config_with_controller(config, custom_objects))

    # ------------------------------------------------------------------ Keras hooks -------
    # No batch-end hook: Keras would dispatch batch ends synchronously for it (see above).
    def on_train_begin(self, logs=None):
        self.balancer.begin(hetero_strategy_of(self.model, "DynamicBatching"))
        self._in_fit = True
        self._epoch_base = 0
        self._due_at = self.balancer.steps_until_due()

    def on_epoch_begin(self, epoch, logs=None):
        # Validation and the epoch boundary are not a replica's work: restart the step clock
        # (and the window's wall time). Every earlier step was reported at the epoch's end.
        self._report_steps()
        self._epoch_base = self.balancer.steps_since_begin
        self.balancer.epoch_begin()

    def on_train_batch_begin(self, batch, logs=None):
        # Keras's `batch` is the execution's first step in the epoch: the steps of the epoch
        # trained so far (only an epoch's last execution can be short).
        if self._epoch_base + batch >= self._due_at:
            self._report_steps()

    def on_test_begin(self, logs=None):
        # Validation inside `fit`: the epoch's steps end here, before the pause.
        self._report_steps()

    def on_epoch_end(self, epoch, logs=None):
        self._report_steps()
        noise = getattr(self.balancer.strategy, "gradient_noise_scale", None)
        if logs is not None and noise is not None and noise.steps:  # into History
            logs["gradient_noise_scale"] = noise.scale

    def on_train_end(self, logs=None):
        self._report_steps()
        self._in_fit = False
        self.balancer.end()

    def _report_steps(self):
        """Reports the steps trained since the last report (counted by the strategy), where
        the balancer may start or end a window; then when it is due next."""
        if not self._in_fit:
            return
        balancer = self.balancer
        balancer.step_end()  # none trained since the last report: nothing happens
        self._due_at = balancer.steps_since_begin + balancer.steps_until_due()


_DELEGATED = frozenset({"initial", "controller", "min_sizes", "max_sizes", "warmup_steps",
                        "interval", "probe_steps", "log_dir", "verbose", "controller_state"})
