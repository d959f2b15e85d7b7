"""The public protocols between tf_hetbatch's strategies, controllers and their users.

`DynamicBatching`, `ResumableCheckpoint` and `AsyncTrainer` use a strategy through these
protocols only, never through its private methods; the strategies implement them:

- `SplitStrategy`: what every tf_hetbatch strategy offers: the split of each global batch into
  parts (replicas, or workers in asynchronous training), its measurements and who the chief
  is. Its `asynchronous` property tells the two kinds apart;
- `SynchronousSplitStrategy` (`asynchronous` False): `HeteroMirroredStrategy`,
  `HeteroMultiWorkerMirroredStrategy`; every replica runs every step, the parts are the
  replicas in sync, and the methods marked "collective" must be called at the same point on
  every worker;
- `AsynchronousSplitStrategy` (`asynchronous` True): `HeteroParameterServerStrategy`; the parts
  are the workers, which update the weights on the parameter servers without waiting for each
  other; everything is called on the chief (the coordinator).

`Controller` is what `DynamicBatching` asks of a batch-size controller (the built-in
`ModelBasedController` and `ProportionalController` implement it).

Nothing here imports TensorFlow: these are plain `typing.Protocol` classes (structural types,
for type checkers and readers). Only `Controller` is checkable at run time, which
`DynamicBatching` does on construction.

Example:
    >>> import tf_hetbatch as hb
    >>> from tf_hetbatch.core.protocols import Controller
    >>> isinstance(hb.ModelBasedController(), Controller)
    True
"""

from __future__ import annotations

from typing import (TYPE_CHECKING, Any, Dict, Optional, Protocol, Sequence, Tuple,
                    runtime_checkable)

if TYPE_CHECKING:  # annotations only: importing this module imports no TensorFlow
    import numpy as np
    import tensorflow as tf

    from tf_hetbatch.core.measurements import ReplicaTimes, Staleness

__all__ = ["SplitStrategy", "SynchronousSplitStrategy", "AsynchronousSplitStrategy",
           "ControllerStateLike", "Controller"]


class SplitStrategy(Protocol):
    """What every tf_hetbatch strategy offers its callbacks and trainers."""

    @property
    def asynchronous(self) -> bool:
        """True for asynchronous training (`AsynchronousSplitStrategy`), else False
        (`SynchronousSplitStrategy`)."""

    @property
    def num_parts(self) -> int:
        """Number of parts each global batch is split into (replicas, or workers)."""

    @property
    def batch_sizes(self) -> Optional[Tuple[int, ...]]:
        """The current split, one size per part (even until set; None while unknown)."""

    @property
    def global_batch_size(self) -> Optional[int]:
        """The sum of the split (None while unknown)."""

    @property
    def switch_lag_steps(self) -> int:
        """An upper bound on the training steps after `set_batch_sizes` until the new split
        is in force on every part; measurements started earlier may mix two splits."""

    @property
    def is_chief(self) -> bool:
        """Whether this process writes logs, dashboards and checkpoints."""

    def set_batch_sizes(self, sizes: Sequence[int]) -> None:
        """Sets the split from now on. Synchronous multi-worker training: call it at the same
        point on every worker with the same sizes; no collective once a step was trained
        (the switch step is the steps trained plus a margin), one before."""

    def read_replica_times(self, reset: bool = False) -> "ReplicaTimes":
        """Per-part compute seconds, samples and steps so far, and in synchronous training
        the step cycles (`reset`: the next read covers later steps only). Local: every
        worker of synchronous training reads every replica's values."""

    def restart_step_clock(self) -> None:
        """Times each part's next step from its inputs, not from the end of a pause."""

    def part_capacities(self) -> "np.ndarray":
        """Nominal peak FLOP/s of each part's device, float64 [num_parts] (collective in
        synchronous multi-worker training)."""


class SynchronousSplitStrategy(SplitStrategy, Protocol):
    """A synchronous strategy: every replica runs every step; the parts are the replicas.

    Methods marked collective talk to every worker: call them at the same point on each.
    """

    @property
    def num_local_replicas(self) -> int:
        """Replicas of this process (all of them on one host)."""

    @property
    def steps_trained(self) -> int:
        """Training steps run under the strategy (all fits), or as set by `resume_at`."""

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver (None on one host), as for the stock strategy."""

    def gather_replica_values(self, local_values: Any) -> "np.ndarray":
        """All replicas' values in replica order from this process's (collective)."""

    def check_input_agreement(self) -> None:
        """Raises RuntimeError unless every worker trained the same global batches
        (collective)."""

    def resume_at(self, steps_trained: int, skip_batches: int = 0) -> None:
        """Prepares to resume an interrupted run at `steps_trained`, skipping batches."""


class AsynchronousSplitStrategy(SplitStrategy, Protocol):
    """An asynchronous (parameter-server) strategy: the parts are the workers.

    The split is each worker's mini-batch; `global_batch_size` is a round of one update per
    worker. The in-graph methods (`read_update_count`, `record_update`) build ops for the
    training step that the trainer schedules on the workers.
    """

    @property
    def num_workers(self) -> int:
        """Number of worker tasks."""

    @property
    def updates(self) -> int:
        """Updates applied by all workers so far."""

    def set_global_batch_size(self, total: int) -> None:
        """Fixes the round's total batch (a changed total resets the split to even)."""

    def batch_sizes_tensor(self) -> "tf.Tensor":
        """The current split as an int32 tensor [num_workers], for scheduled steps."""

    def read_totals(self) -> "ReplicaTimes":
        """Per-worker measurements since the strategy was created (unaffected by resets)."""

    def read_staleness(self, reset: bool = False) -> "Staleness":
        """Staleness of each worker's updates so far (`reset`: the next read covers later
        updates only)."""

    def staleness_totals(self) -> "Staleness":
        """Staleness of each worker's updates since the strategy was created."""

    def read_update_count(self) -> "tf.Tensor":
        """In-graph: the global update count now."""

    def record_update(self, worker: "tf.Tensor", samples: "tf.Tensor", seconds: "tf.Tensor",
                      staleness: "tf.Tensor") -> "tf.Operation":
        """In-graph: counts one applied update of `worker` with its measurements."""


class ControllerStateLike(Protocol):
    """What `DynamicBatching` reads of a controller's state (`ControllerState` has it)."""

    @property
    def sizes(self) -> Any:
        """The split the controller holds, one int per part."""

    @property
    def settled_sizes(self) -> Any:
        """The split it settled on (leaving out a trial split in flight)."""

    @property
    def reason(self) -> str:
        """Why the last update changed or kept the split (for logs and dashboards)."""

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-serialisable form, for checkpoints."""


@runtime_checkable
class Controller(Protocol):
    """A batch-size controller, as `DynamicBatching(controller=...)` takes it.

    Deterministic and clock-free: the same state and measurements give the same split on
    every worker. `DynamicBatching` calls `init` once with the static split, then `update`
    once per measurement window, with keyword `step_time` always passed: the window's mean
    step time of the slowest worker in synchronous training, None in asynchronous training
    (a controller may ignore it). Optional: `min_sizes` / `max_sizes` attributes (the
    controller's own bounds, which the static split then uses too), `state_from_dict(d)`
    (else `ControllerState.from_dict` restores a saved state) and
    `get_config()` / `from_config(config)` (for `DynamicBatching.get_config`).
    """

    def init(self, sizes: Sequence[int]) -> ControllerStateLike:
        """The state for the split `sizes` (which it may re-split to fit its bounds)."""

    def update(self, state: Any, sizes: Any, times: Any,
               step_time: Optional[float] = None) -> Tuple[Sequence[int], ControllerStateLike]:
        """`(new sizes, new state)` from the window's per-part samples per step `sizes` and
        compute seconds per step `times`, and the window's step time (or None)."""
