"""HeteroParameterServerStrategy: ParameterServerStrategy with a per-worker batch split.

Asynchronous (ASP) training on TensorFlow's parameter-server runtime: every worker pulls the
weights, computes a gradient on its own mini-batch and pushes its update, without waiting for
the others. A slow worker does not stall the fast ones, but its updates are stale. Giving
worker k a batch b_k in proportion to its speed (sum b_k = B constant) evens out the workers'
iteration times and so the staleness; scaling each update by b_k / mean(b) (linear gradient
scaling) keeps every sample's weight the same.

The strategy holds the split and, in variables on the parameter servers, what the training
steps measure per worker: compute seconds, samples, updates and the staleness of each update.
It implements `tf_hetbatch.core.protocols.AsynchronousSplitStrategy`: the protocol every
tf_hetbatch strategy speaks (`batch_sizes`, `set_batch_sizes`, `read_replica_times`, ...), with
workers in place of replicas, so `DynamicBatching` drives it unchanged, plus what the
asynchronous trainer needs. Training runs through :class:`tf_hetbatch.AsyncTrainer` (Keras 3
`fit` does not support ParameterServerStrategy).
"""

import logging
from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from tf_hetbatch.core import _validate
from tf_hetbatch.core import devices as _devices
from tf_hetbatch.core import split
from tf_hetbatch.core import split_state
from tf_hetbatch.core.measurements import ReplicaTimes, Staleness
from tf_hetbatch.distribute._upstream import ps_coordinator

logger = logging.getLogger(__name__)

DEFAULT_STALENESS_BINS = 64


class HeteroParameterServerStrategy(tf.distribute.ParameterServerStrategy):
    """`tf.distribute.ParameterServerStrategy` whose workers get mini-batches of their own size.

    Create it on the chief (the coordinator) exactly like the stock strategy, build the model
    under `strategy.scope()` and train with :class:`tf_hetbatch.AsyncTrainer`. The batch split
    is over workers: `batch_sizes[k]` is worker k's mini-batch, and their sum is the batch a
    round of K updates consumes. Until `set_batch_sizes` (or `DynamicBatching`) sets it, the
    trainer splits evenly. Only one replica per worker is supported (a CPU or one GPU).

    Args:
        cluster_resolver: as for the stock strategy; default
            `tf.distribute.cluster_resolver.TFConfigClusterResolver()` (TF_CONFIG with
            "chief", "ps" and "worker" tasks).
        variable_partitioner: as for the stock strategy. Default None.
        staleness_bins: size of the per-worker staleness histogram; the last bin counts
            updates `staleness_bins - 1` or more stale. Default 64.

    Raises:
        ValueError: no worker in the cluster, more than one replica per worker, or a bad
            `staleness_bins`.

    Example:

        strategy = hb.HeteroParameterServerStrategy()   # on the chief, TF_CONFIG set
        with strategy.scope():
            model = make_model()
        trainer = hb.AsyncTrainer(model, "sgd", "sparse_categorical_crossentropy")
        trainer.fit(dataset_fn, batch_size=32, epochs=3, steps_per_epoch=200,
                    callbacks=[hb.DynamicBatching()])
    """

    def __init__(self, cluster_resolver=None, variable_partitioner=None,
                 staleness_bins: int = DEFAULT_STALENESS_BINS):
        staleness_bins = _validate.check_int("staleness_bins", staleness_bins, 2,
                                             f"e.g. {DEFAULT_STALENESS_BINS}.")
        if cluster_resolver is None:
            cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        num_workers = len(cluster_resolver.cluster_spec().as_dict().get("worker", []))
        if num_workers < 1:
            raise ValueError("The cluster has no 'worker' task. Received cluster: "
                             f"{cluster_resolver.cluster_spec().as_dict()}. Fix: TF_CONFIG "
                             "needs 'chief', 'ps' and 'worker' addresses.")
        super().__init__(cluster_resolver, variable_partitioner)
        if self.num_replicas_in_sync != 1:
            raise ValueError(f"HeteroParameterServerStrategy supports one replica per worker; "
                             f"this cluster has {self.num_replicas_in_sync}. Fix: give each "
                             "worker task one GPU (CUDA_VISIBLE_DEVICES) or none.")
        self._num_workers = num_workers
        self._split = split_state.SplitState(num_workers, part_name="worker")
        self._staleness_bins = staleness_bins
        with self.scope():
            # Per worker: compute seconds, samples, updates. One table, added to once per
            # update and read once: three variables read one after another while workers add
            # to them gave windows whose samples and steps were from different updates.
            self._totals = tf.Variable(tf.zeros([num_workers, 3], tf.float64), trainable=False,
                                       name="hetbatch_worker_totals")
            self._updates = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                        name="hetbatch_updates")
            self._stale = tf.Variable(tf.zeros([num_workers, staleness_bins], tf.int64),
                                      trainable=False, name="hetbatch_staleness")
        self._times_read = ReplicaTimes(np.zeros(num_workers), np.zeros(num_workers),
                                        np.zeros(num_workers))
        self._staleness_read = Staleness(np.zeros([num_workers, staleness_bins], np.int64))

    # ----------------------------------------------------------------- the split ---------------
    @property
    def asynchronous(self) -> bool:
        """True: workers update without waiting (`protocols.AsynchronousSplitStrategy`)."""
        return True

    @property
    def num_workers(self) -> int:
        """Number of worker tasks."""
        return self._num_workers

    @property
    def num_parts(self) -> int:
        """Number of parts each batch round is split into: the workers."""
        return self._num_workers

    @property
    def batch_sizes(self) -> Optional[Tuple[int, ...]]:
        """Per-worker mini-batch sizes, in worker order (even split until set; None while the
        total is unknown, i.e. before the trainer's first `fit`)."""
        return self._split.sizes

    @property
    def global_batch_size(self) -> Optional[int]:
        """Sum of the per-worker batch sizes: the samples of one round of K updates."""
        return self._split.global_batch

    @property
    def switch_lag_steps(self) -> int:
        """Steps after `set_batch_sizes` until the new split is in force: the next scheduled
        update takes it (at most 2 steps per worker are queued with the old one, whose
        measurements the windows' per-worker samples show)."""
        return 1

    def set_batch_sizes(self, sizes: Sequence[int]) -> None:
        """Sets each worker's mini-batch size, effective for the steps scheduled from now on.

        Sizes that do not sum to the round's total in use wait for the next `fit` whose
        total is their sum (logged), as for the synchronous strategies.

        Args:
            sizes: one int >= 1 per worker.

        Raises:
            ValueError: wrong length, a size below 1 (a worker with nothing to do would spin),
                non-integers.
        """
        sizes = split.validate_sizes(sizes, self._num_workers)
        if min(sizes) < 1:
            raise ValueError(f"Every worker needs a batch of at least 1 sample in asynchronous "
                             f"training. Received: batch_sizes={list(sizes)}. Fix: give each "
                             "worker >= 1 (e.g. DynamicBatching(min_sizes=1)), or stop the "
                             "worker's task to leave it out.")
        self._split.set(sizes)
        logger.debug("worker batch sizes set to %s", list(sizes))

    def set_global_batch_size(self, total: int) -> None:
        """Fixes the round's total batch: the sum of the per-worker batch sizes.

        `AsyncTrainer.fit` sets it from `batch_size` x workers. A split of another total
        (an earlier fit's) is re-made for this one in its proportions (logged); a split set
        for this fit must sum to it.

        Args:
            total: int >= `num_workers` (every worker needs a batch of at least 1).

        Raises:
            ValueError: `total` is not such an int, or a split set for this fit does not sum
                to it.
        """
        total = _validate.check_int(
            "global_batch_size", total, self._num_workers,
            f"give each of the {self._num_workers} workers at least 1 sample, e.g. "
            f"global_batch_size={32 * self._num_workers}.")
        self._split.data_arrived(total)

    def batch_sizes_tensor(self) -> tf.Tensor:
        """The current split as an int32 tensor [num_workers], an argument of scheduled steps.

        Raises:
            ValueError: no split yet (neither `set_batch_sizes` nor `set_global_batch_size`).
        """
        if self.batch_sizes is None:
            raise ValueError("The strategy has no batch split yet. Fix: call "
                             "set_global_batch_size(total) or set_batch_sizes(sizes) first "
                             "(AsyncTrainer.fit does).")
        return tf.constant(self.batch_sizes, tf.int32)

    # ----------------------------------------------------------------- measurements ------------
    def read_replica_times(self, reset: bool = False) -> ReplicaTimes:
        """Per-worker compute seconds, samples and updates of the steps finished so far.

        A worker's time runs from its step starting on the worker to its update applied on
        the parameter servers: input, weight reads, gradient and update. Steps still running
        when this is called count when they finish.

        Args:
            reset: if True, the next read covers only later steps.
        """
        return self._since_last_reset(self.read_totals(), "_times_read", reset)

    def read_totals(self) -> ReplicaTimes:
        """Per-worker compute seconds, samples and updates since the strategy was created
        (unaffected by `reset` reads)."""
        seconds, samples, steps = self._totals.numpy().T
        return ReplicaTimes(seconds, samples, steps)

    def read_staleness(self, reset: bool = False) -> Staleness:
        """Staleness histogram of each worker's updates finished so far (see `Staleness`).

        Args:
            reset: if True, the next read covers only later updates.
        """
        return self._since_last_reset(self.staleness_totals(), "_staleness_read", reset)

    def staleness_totals(self) -> Staleness:
        """Staleness histogram of each worker's updates since the strategy was created
        (unaffected by `reset` reads)."""
        return Staleness(self._stale.numpy())

    def _since_last_reset(self, now, last: str, reset: bool):
        """`now` less the totals of the last resetting read (attribute `last`); `reset`
        makes `now` that read."""
        out = now - getattr(self, last)
        if reset:
            setattr(self, last, now)
        return out

    def restart_step_clock(self) -> None:
        """Nothing to do: asynchronous steps are timed one by one on their worker."""

    @property
    def is_chief(self) -> bool:
        """True: this process is the coordinator, which writes logs and checkpoints."""
        return True

    def part_capacities(self) -> np.ndarray:
        """Nominal peak FLOP/s of each worker's CPU, read on the worker itself.

        Each worker's /proc/cpuinfo and its process's cgroup CPU quota are read by file-read
        ops placed on that worker (so a capped worker reports its cap), then evaluated with
        `tf_hetbatch.core.devices.cpu_capability`.
        """
        peaks = []
        for k in range(self._num_workers):
            device = f"/job:worker/replica:0/task:{k}/device:CPU:0"
            peaks.append(_devices.cpu_capability(
                read_file=lambda path, device=device: _read_remote_text(device, path)
            ).peak_flops)
        return np.asarray(peaks, np.float64)

    @property
    def updates(self) -> int:
        """Updates applied by all workers so far (an exact count, kept on the parameter
        servers; Keras's `optimizer.iterations` can miss concurrent increments)."""
        return int(self._updates.numpy())

    # ----------------------------------------------------------------- in the train step -------
    def read_update_count(self) -> tf.Tensor:
        """In-graph (in a step scheduled on a worker): the global update count now, int64.

        A step reads it before its forward pass and again before its own update: the
        difference is its update's staleness (see `record_update`).
        """
        return tf.identity(self._updates.read_value())

    def record_update(self, worker, samples, seconds, staleness) -> tf.Operation:
        """In-graph: counts one applied update of `worker` with its measurements.

        The accumulators live on the parameter servers; each accumulation is one atomic op,
        so workers recording at once lose nothing. `read_replica_times`, `read_totals`,
        `read_staleness` and `updates` read them.

        Args:
            worker: int32 scalar tensor, the worker's index.
            samples: the update's batch size (scalar tensor).
            seconds: the step's compute seconds (scalar tensor).
            staleness: updates applied by others between the step's read of
                `read_update_count()` and its own update (scalar tensor; the histogram's
                last bin takes `staleness_bins - 1` and more).

        Returns:
            The op that records it.
        """
        one_hot = tf.one_hot(worker, self._num_workers, dtype=tf.float64)
        row = tf.stack([tf.cast(seconds, tf.float64), tf.cast(samples, tf.float64),
                        tf.constant(1.0, tf.float64)])
        stale_bin = tf.minimum(tf.cast(staleness, tf.int32), self._staleness_bins - 1)
        return tf.group(
            self._updates.assign_add(tf.constant(1, tf.int64)),
            self._totals.assign_add(one_hot[:, None] * row[None, :]),
            self._stale.scatter_nd_add([[worker, tf.maximum(stale_bin, 0)]],
                                       tf.ones([1], tf.int64)),
        )


def _read_remote_text(device: str, path: str) -> Optional[str]:
    """The text of `path` read on `device` (a worker), or None if it cannot be read there."""
    try:
        with tf.device(device):
            return tf.io.read_file(path).numpy().decode("utf-8", "replace")
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError,
            tf.errors.PermissionDeniedError, tf.errors.FailedPreconditionError):
        return None


# ---------------------------------------------- the coordinator, for the asynchronous trainer --
# What `tf_hetbatch.training.AsyncTrainer` needs of the `ClusterCoordinator` that has no public
# API; the private use, and its canaries, are in `_upstream.ps_coordinator`.
def per_worker_iterator(coordinator: "tf.distribute.experimental.coordinator.ClusterCoordinator",
                        make_dataset: Callable[[int], tf.data.Dataset]) -> Tuple[Any, Any]:
    """Iterators over `make_dataset(worker_index)`, one on each worker of `coordinator`.

    As `coordinator.create_per_worker_dataset(...)` + `iter`, except that each worker's
    pipeline knows its worker index (the stock one traces one dataset function for all).
    Like the stock iterators they are re-created when a failed worker comes back.

    Args:
        coordinator: the cluster coordinator.
        make_dataset: worker index -> its `tf.data.Dataset` (no variables created in it).

    Returns:
        (a per-worker iterator to pass to `coordinator.schedule`, the datasets' element spec).

    Raises:
        ValueError: the workers' datasets have different element specs.
    """
    return ps_coordinator.per_worker_iterator(coordinator, make_dataset)


def remote_value_done(value: Any) -> bool:
    """Whether the scheduled function behind the `RemoteValue` `value` finished (or failed),
    without blocking."""
    return ps_coordinator.remote_value_done(value)


def wait_remote_value(value: Any, timeout: float) -> None:
    """Waits at most `timeout` seconds for the function behind the `RemoteValue` `value`."""
    ps_coordinator.wait_remote_value(value, timeout)
