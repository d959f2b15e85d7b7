"""HeteroMultiWorkerMirroredStrategy: uneven, exactly weighted batches across workers."""

import logging

import numpy as np
import tensorflow as tf

from tf_hetbatch.core import _validate
from tf_hetbatch.distribute import clean_exit
from tf_hetbatch.distribute import step_run
from tf_hetbatch.distribute import updates
from tf_hetbatch.distribute.strategy import PIPELINE_LEAD_STEPS, HeteroMixin
from tf_hetbatch.distribute._upstream import collectives, keras_callers

logger = logging.getLogger(__name__)

# The default `switch_margin`: a new split starts this many steps after the current one, so
# no worker's input pipeline has produced that step's batch yet (it runs at most
# PIPELINE_LEAD_STEPS batches ahead of training). Checked after every switch.
DEFAULT_SWITCH_MARGIN = 8


class HeteroMultiWorkerMirroredStrategy(HeteroMixin, tf.distribute.MultiWorkerMirroredStrategy):
    """`tf.distribute.MultiWorkerMirroredStrategy` with uneven, exactly weighted batches.

    Everything `HeteroMirroredStrategy` promises, across workers: configured by TF_CONFIG as
    stock (or a cluster resolver), one split of each global batch over ALL replicas of all
    workers, gradients weighted by b_k / B so the model equals one device on the global batch
    and is identical on every worker.

    Input: every worker reads the same sequence of global batches (use a seeded shuffle, as
    with the stock DATA auto-shard policy; an unseeded `Dataset.shuffle` right under the
    per-sample maps gets a seed all workers agree on) and keeps its own replicas' slices, so
    every sample of an epoch is used exactly once, whatever the split. The per-sample work
    (maps before `batch`, Keras's array gather, maps after `split_here()`) runs after the
    split, on the worker's own samples only (`input_work`). Every gather of this
    strategy also checks that all workers trained the same global batches.

    It implements `tf_hetbatch.core.protocols.SynchronousSplitStrategy`. Collectives:
    `set_batch_sizes`, `read_replica_times`, `read_replica_times_and_gather`,
    `gather_replica_values`, `part_capacities` and `check_input_agreement` talk to all
    workers, so every worker must call them at the same point (a callback does). A new split
    takes effect on every worker at the same training step, `switch_margin` steps after the
    call (at once if no worker has read any data yet).

    Keras 3 `fit` works without patching Keras: its two multi-worker crashes (a reduce of the
    data batch in its symbolic build, and axis=0 reduces of scalar logs) pass through this
    strategy's `reduce`, which handles them (see `_compat`).

    Args:
        cluster_resolver: as for `tf.distribute.MultiWorkerMirroredStrategy`.
        communication_options: as for `tf.distribute.MultiWorkerMirroredStrategy`.
        switch_margin: int, training steps from `set_batch_sizes` to the step the new split
            starts at on every worker. It must exceed how far the input pipeline runs ahead
            of training (at most 3 global batches: a larger margin is needed only if a
            switch fails saying so). Default 8 (`DEFAULT_SWITCH_MARGIN`). The same on every
            worker.

    Raises:
        ValueError: `switch_margin` is not an integer >= 4.
    """

    def __init__(self, cluster_resolver=None, communication_options=None,
                 switch_margin: int = DEFAULT_SWITCH_MARGIN):
        self._switch_margin = _validate.check_int(
            "switch_margin", switch_margin, PIPELINE_LEAD_STEPS + 1,
            f"the input pipeline runs up to {PIPELINE_LEAD_STEPS} global batches ahead of "
            f"training; pass e.g. switch_margin={DEFAULT_SWITCH_MARGIN} (the default).")
        # Every worker creates its strategies in the same order, so the bases agree.
        collectives.assign_collective_key_base(self)
        super().__init__(
            cluster_resolver=cluster_resolver, communication_options=communication_options
        )
        self._sum_tables = None
        tasks = self.cluster_resolver.cluster_spec().as_dict() if self.cluster_resolver else {}
        collectives.warn_if_second_multi_worker_strategy(
            sum(len(tasks.get(role, [])) for role in ("chief", "worker")))
        self._init_hetero()
        # At exit, the tasks wait for each other, so a successful run ends quietly.
        clean_exit.register_exit_together(self.cluster_resolver)

    @property
    def switch_margin(self) -> int:
        """Training steps from `set_batch_sizes` to the step the new split starts at."""
        return self._switch_margin

    # ----------------------------------------------------------------- topology hooks ----------
    def _worker_index(self):
        resolver = self.cluster_resolver
        return int(resolver.task_id or 0) if resolver is not None else 0

    def _replica_range(self):
        count = self.num_local_replicas
        return (self._worker_index() * count, count)

    def _is_chief(self):
        return bool(self.extended.should_checkpoint)

    def _step_totals(self, data, kind):
        # Training: every worker's pipeline saw the whole global batch and kept its totals for
        # the step it is trained in, so no collective runs before the step's compute (a worker
        # waiting in one for a slower worker would count that wait as its own work, see
        # timing.py). Sample weights made by per-sample maps that run after the split are
        # known per worker only, and evaluation batches and data a user's dataset function
        # batched are not recorded: there each replica's amounts are summed in a small
        # all-reduce at the step's start.
        if kind == "test_step" or self._user_batched_data or (
                not self._weights_in_pipeline and step_run.has_sample_weight(
                    self.experimental_local_results(data)[0])):
            return lambda samples, weight: tuple(
                updates.sum_across_replicas([samples, weight]))
        inputs = [t for local in self.experimental_local_results(data)
                  for t in tf.nest.flatten(local) if isinstance(t, tf.Tensor)]
        with tf.control_dependencies(inputs):  # the pipeline wrote them when producing these
            totals = self._allocation.step_totals()
        return totals[0], totals[1]

    def _gather_local_rows(self, local_values):
        # An all-reduce SUM of a [K, n] table where each replica fills its own row: one small
        # collective, traced once per n (the stock eager `gather` retraces on every call).
        # Every gather also compares the workers' fingerprints of the global batches trained
        # so far (`_check_same_global_batches`): a last column, the same on all local replicas.
        rows = local_values.reshape(local_values.shape[0], -1)
        fingerprint = float(int(self._allocation.fingerprint.numpy()) % 2**52)  # exact in f64
        rows = np.concatenate([rows, np.full((rows.shape[0], 1), fingerprint)], axis=1)
        first, count = self._replica_range()
        width = rows.shape[1]
        tables = []
        for i in range(count):
            table = np.zeros((self.num_replicas_in_sync, width), np.float64)
            table[first + i] = rows[i]
            tables.append(tf.constant(table))
        per_replica = self.experimental_distribute_values_from_function(
            lambda ctx: tables[ctx.replica_id_in_sync_group - first]
        )
        if self._sum_tables is None:
            self._sum_tables = tf.function(
                lambda v: self.reduce(tf.distribute.ReduceOp.SUM, v, axis=None)
            )
        gathered = self._sum_tables(per_replica).numpy()
        self._check_same_global_batches(gathered[:, -1])
        return gathered[:, :-1].reshape((self.num_replicas_in_sync,) + local_values.shape[1:])

    def _check_same_global_batches(self, fingerprints):
        if np.all(fingerprints == fingerprints[0]):
            return
        differ = [int(k) for k in np.flatnonzero(fingerprints != fingerprints[0])]
        raise RuntimeError(
            "The workers trained different global batches in the last "
            f"{int(self._allocation.trained.numpy())} steps: their input pipelines do not "
            f"produce the same sequence (replicas {differ} disagree with replica 0), so some "
            "samples were trained twice and others never. Likely causes: a shuffle or "
            "tf.random op with no seed (e.g. fit(x, y, shuffle=True) with no "
            "keras.utils.set_random_seed), a map or interleave with deterministic=False, or "
            "different files or file order per worker. Fix: seed every shuffle (the same seed "
            "on every worker, e.g. keras.utils.set_random_seed(0) before building the data), "
            "keep the maps before batch() deterministic, and give every worker the same files "
            "in the same order."
        )

    def _keyed_by_step(self):
        return True

    def _switch_lag_steps(self):
        return self._switch_margin

    def _agree_on_seed(self):
        # Worker 0's draw, sent to every worker in one small collective.
        draw = float(np.random.default_rng().integers(2**31 - 1))
        return int(self._gather_local_rows(np.full(self.num_local_replicas, draw))[0])

    def _time_from_release(self):
        return True  # each worker's own work between steps is its cost (see timing.py)

    def _partial_batch_handling(self):
        # Every worker reads every global batch, so all workers' data ends at the same step;
        # TensorFlow's check would add a cross-worker all-reduce before each step's compute.
        return False

    def _switch_start(self):
        produced = int(self._allocation.produced.numpy())
        if self._gather_local_rows(np.full(self.num_local_replicas, produced)).max() == 0:
            return 0  # no worker has produced a batch yet: the split applies from the first
        return int(self._allocation.trained.numpy()) + self._switch_margin

    def _install_for_new_data(self, sizes):
        # Every worker distributes its new training data at the same step, and the same
        # sizes (a split set for it, or re-made in proportion): keyed from that step on.
        self._allocation.install(sizes, int(self._allocation.trained.numpy()))

    def _apply_batch_sizes(self, sizes):
        start = self._switch_start()
        self._allocation.install(sizes, start)
        last_key = int(self._allocation.last_key.numpy())
        if last_key >= start:
            raise RuntimeError(
                f"This worker's input pipeline produced the global batch for step {last_key} "
                f"before the split switching at step {start} was installed, so workers could "
                "split a batch differently. Its pipeline runs further ahead of training than "
                f"switch_margin={self._switch_margin} steps. Fix: pass a larger margin on every "
                "worker, e.g. HeteroMultiWorkerMirroredStrategy(switch_margin="
                f"{2 * self._switch_margin})."
            )
        logger.debug("batch sizes %s from step %d", list(sizes), start)

    # ----------------------------------------------------------------- Keras crashes -----------
    def reduce(self, reduce_op, value, axis):
        """As the stock `reduce`, handling what Keras 3 `fit` asks of a multi-worker strategy."""
        if axis is not None and keras_callers.is_scalar_reduce_with_axis(self, value, axis):
            if _is_mean(reduce_op) and not isinstance(value, tf.distribute.DistributedValues):
                # Keras's logs: this strategy's `run` made them global already (the same
                # tensor on every worker), and their mean is themselves: no collective.
                return value
            return super().reduce(reduce_op, value, None)
        if axis is None and keras_callers.is_data_batch_reduce(self, reduce_op, value):
            return tf.nest.map_structure(lambda v: keras_callers.largest_local_batch(self, v), value)
        return super().reduce(reduce_op, value, axis)


def _is_mean(reduce_op):
    return reduce_op == tf.distribute.ReduceOp.MEAN or str(reduce_op).upper() == "MEAN"
