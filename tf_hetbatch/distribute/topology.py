"""Where a synchronous strategy's replicas live: on one host, or on several workers.

Both synchronous strategies share every mechanism (the split, the weights, the timing, the
input split, the logs); what depends on where the replicas are is here, in one object the
strategy holds:
- `OneHost` (`HeteroMirroredStrategy`): one process holds every replica. A split applies to
  the global batches produced after it is set; gathers are the local values; a step's totals
  are the sum over the local replicas' data; a replica's step starts when its inputs are there.
- `Workers` (`HeteroMultiWorkerMirroredStrategy`): each worker holds the replicas of its
  `DeviceLayout` entry, replicas offset .. offset + count - 1. Every global batch is keyed by
  the step it is trained in, and a new split starts `switch_margin` steps ahead on every
  worker (computed locally once a step was trained: no collective at a switch); gathers are
  one collective (which also compares the workers' fingerprints of the global batches they
  trained); a shuffle seed is agreed; a step's totals come from each
  worker's pipeline (it sees every global batch); a replica's step starts at its release by
  the previous all-reduce, so each worker's own work between steps counts (see `timing`).
"""

import logging
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from tf_hetbatch.distribute import input_split
from tf_hetbatch.distribute import step_run
from tf_hetbatch.distribute import updates
from tf_hetbatch.distribute.layout import DeviceLayout

logger = logging.getLogger(__name__)

# Where the split's host variables live (on each worker).
HOST_DEVICE = "/cpu:0"
# How far the split input pipeline runs ahead of training: its own one-global-batch prefetch
# (`input_split.split_global_batches`), the distributed iterator's one-element buffer, the
# batch in flight. One host: a split set now applies to the global batches produced after
# it, so this is its switch lag; several workers: `switch_margin` must exceed it.
PIPELINE_LEAD_STEPS = 3


class OneHost:
    """One process holds every replica."""

    keyed_by_step = False
    time_from_release = False
    is_chief = True
    replica_range: Optional[Tuple[int, int]] = None  # every replica is local
    switch_lag_steps = PIPELINE_LEAD_STEPS

    def __init__(self, strategy):
        self._strategy = strategy
        self.allocation = input_split.Allocation(strategy.num_replicas_in_sync, HOST_DEVICE)

    @property
    def tells_shared_values(self) -> bool:
        """Whether a value that is one object on every replica (a tensor made outside the
        step) is told apart from per-replica values and reduced as the stock strategy reduces
        it (`updates`): with more than one replica (with one, every value is one object)."""
        return self._strategy.num_local_replicas > 1

    def gather(self, local_values: np.ndarray) -> np.ndarray:
        """All replicas' rows from this process's: they are all here."""
        return local_values

    def agree_on_seed(self) -> Optional[int]:
        """A shuffle seed the replicas' pipelines agree on: one pipeline needs none."""
        return None

    def step_totals(self, data, recorded: bool):
        """Cross-replica context: the step's (samples, sample weight), summed over the local
        replicas' data at no communication cost."""
        del recorded
        amounts = [step_run.amounts(d) for d in self._strategy.experimental_local_results(data)]
        return tuple(tf.add_n(list(column)) for column in zip(*amounts))

    def install(self, sizes) -> None:
        """Installs `sizes` for the global batches produced from now on."""
        self.allocation.install(sizes)
        logger.debug("batch sizes set to %s", list(sizes))

    def install_for_new_data(self, sizes) -> None:
        """Installs `sizes` for training data distributed now, before its first batch."""
        self.allocation.install(sizes)


class Workers:
    """Several worker processes, each holding its replicas of the `DeviceLayout`."""

    keyed_by_step = True
    time_from_release = True  # each worker's own work between steps is its cost
    # Every worker must reduce the same values the same way, and on a one-replica worker every
    # value is one object: a plain value counts as the same value on every local replica
    # (`_upstream.device_layout`), batched with the others.
    tells_shared_values = False

    def __init__(self, strategy, layout: DeviceLayout, switch_margin: int):
        self._strategy = strategy
        self.layout = layout
        self.switch_lag_steps = switch_margin
        self.allocation = input_split.Allocation(layout.total, HOST_DEVICE, keyed_by_step=True)
        self._sum_tables = None

    @property
    def is_chief(self) -> bool:
        return bool(self._strategy.extended.should_checkpoint)

    @property
    def replica_range(self) -> Tuple[int, int]:
        """(this worker's first replica id, its replica count)."""
        return self.layout.offset, len(self.layout.local_devices)

    def gather(self, local_values: np.ndarray) -> np.ndarray:
        """All replicas' rows, in replica order, from this worker's: one collective.

        An all-reduce SUM of a [K, n] table where each replica fills its own row: one small
        collective, traced once per n (the stock eager `gather` retraces on every call).
        Every gather also compares the workers' fingerprints of the global batches trained so
        far (`_check_same_global_batches`): a last column, the same on all local replicas.
        """
        strategy = self._strategy
        rows = local_values.reshape(local_values.shape[0], -1)
        fingerprint = float(int(self.allocation.fingerprint.numpy()) % 2**52)  # exact in f64
        rows = np.concatenate([rows, np.full((rows.shape[0], 1), fingerprint)], axis=1)
        first, count = self.replica_range
        tables = []
        for i in range(count):
            table = np.zeros((self.layout.total, rows.shape[1]), np.float64)
            table[first + i] = rows[i]
            tables.append(tf.constant(table))
        per_replica = strategy.experimental_distribute_values_from_function(
            lambda ctx: tables[ctx.replica_id_in_sync_group - first])
        if self._sum_tables is None:
            self._sum_tables = tf.function(  # straight-line: no AutoGraph pass to pay
                lambda v: strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None),
                autograph=False)
        gathered = self._sum_tables(per_replica).numpy()
        self._check_same_global_batches(gathered[:, -1])
        return gathered[:, :-1].reshape((self.layout.total,) + local_values.shape[1:])

    def _check_same_global_batches(self, fingerprints):
        if np.all(fingerprints == fingerprints[0]):
            return
        differ = [int(k) for k in np.flatnonzero(fingerprints != fingerprints[0])]
        raise RuntimeError(
            "The workers trained different global batches in the last "
            f"{int(self.allocation.trained.numpy())} steps: their input pipelines do not "
            f"produce the same sequence (replicas {differ} disagree with replica 0), so some "
            "samples were trained twice and others never. Likely causes: a shuffle or "
            "tf.random op with no seed (e.g. fit(x, y, shuffle=True) with no "
            "keras.utils.set_random_seed), a map or interleave with deterministic=False, or "
            "different files or file order per worker. Fix: seed every shuffle (the same seed "
            "on every worker, e.g. keras.utils.set_random_seed(0) before building the data), "
            "keep the maps before batch() deterministic, and give every worker the same files "
            "in the same order."
        )

    def _every_local_replica(self, value):
        return np.full(len(self.layout.local_devices), value)

    def agree_on_seed(self) -> int:
        """Worker 0's draw, sent to every worker in one small collective."""
        draw = float(np.random.default_rng().integers(2**31 - 1))
        return int(self.gather(self._every_local_replica(draw))[0])

    def step_totals(self, data, recorded: bool):
        """Cross-replica context: the step's (samples, sample weight).

        Recorded (training data of global batches, its sample weights known before the split):
        every worker's pipeline saw the whole global batch and kept its totals for the step
        it is trained in, so no collective runs before the step's compute (a worker waiting
        in one for a slower worker would count that wait as its own work, see timing.py).
        Otherwise (evaluation batches, data a user's dataset function batched, sample weights
        made after the split) each replica's amounts are summed in a small all-reduce at the
        step's start: a replica-context function of them.
        """
        if not recorded:
            return lambda samples, weight: tuple(updates.sum_across_replicas([samples, weight]))
        inputs = [t for local in self._strategy.experimental_local_results(data)
                  for t in tf.nest.flatten(local) if isinstance(t, tf.Tensor)]
        with tf.control_dependencies(inputs):  # the pipeline wrote them when producing these
            totals = self.allocation.step_totals()
        return totals[0], totals[1]

    def _switch_start(self) -> int:
        """The step a split installed now starts at, the same on every worker.

        Once this process has trained a step under the strategy, every worker has (a step's
        all-reduce runs on all of them), so every worker has produced a global batch: the
        split starts `switch_margin` steps after the steps trained, computed locally. The
        steps trained are the same on every worker at a call made at the same point, so the
        workers agree by construction and no collective runs: a controller's switch at a
        window end costs no communication. Before this process's first trained step (a split
        set before training, e.g. the static split at the start of `fit`), whether a worker
        has produced a batch yet differs per worker (its pipeline may have started), so the
        workers ask each other in one small collective: if none has, the split applies from
        the first batch.
        """
        trained = int(self.allocation.trained.numpy())
        if trained > self.allocation.first_step:
            return trained + self.switch_lag_steps
        produced = int(self.allocation.produced.numpy())
        if self.gather(self._every_local_replica(produced)).max() == 0:
            return 0  # no worker has produced a batch yet: the split applies from the first
        return trained + self.switch_lag_steps

    def install(self, sizes) -> None:
        """Installs `sizes` from the step `switch_margin` ahead, on every worker.

        Every worker calls it at the same point with the same sizes (a callback, a balancer
        at a window end: the same measurements give the same split on every worker). After
        this process's first trained step it is local (no collective, see `_switch_start`);
        before it, one small collective.
        """
        start = self._switch_start()
        self.allocation.install(sizes, start)
        last_key = int(self.allocation.last_key.numpy())
        if last_key >= start:
            margin = self.switch_lag_steps
            raise RuntimeError(
                f"This worker's input pipeline produced the global batch for step {last_key} "
                f"before the split switching at step {start} was installed, so workers could "
                "split a batch differently. Its pipeline runs further ahead of training than "
                f"switch_margin={margin} steps. Fix: pass a larger margin on every worker, e.g. "
                f"HeteroMultiWorkerMirroredStrategy(switch_margin={2 * margin}).")
        logger.debug("batch sizes %s from step %d", list(sizes), start)

    def install_for_new_data(self, sizes) -> None:
        """Every worker distributes its new training data at the same step, with the same
        sizes (a split set for it, or re-made in proportion): keyed from that step on."""
        self.allocation.install(sizes, int(self.allocation.trained.numpy()))
