"""HeteroMirroredStrategy: MirroredStrategy with uneven, exactly weighted per-replica batches."""

import logging
import weakref
from typing import Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

from tf_hetbatch.core import _validate
from tf_hetbatch.core import split
from tf_hetbatch.core import split_state
from tf_hetbatch.core.gradient_noise import GradientNoise
from tf_hetbatch.core.measurements import ReplicaTimes
from tf_hetbatch.distribute import device_peaks
from tf_hetbatch.distribute import gradient_noise
from tf_hetbatch.distribute import input_split
from tf_hetbatch.distribute import input_work
from tf_hetbatch.distribute import iterator_release
from tf_hetbatch.distribute import micro_batches
from tf_hetbatch.distribute import step_run
from tf_hetbatch.distribute import timing
from tf_hetbatch.distribute import topology
from tf_hetbatch.distribute import weighting
from tf_hetbatch.distribute._upstream import (autograph, collectives, iterators, keras_callers,
                                              keras_trainer, tf_data)

logger = logging.getLogger(__name__)


@autograph.methods_as_is  # `run`, `reduce` in a user's tf.function: as a stock strategy's
class HeteroMixin(micro_batches.LimitsMixin):
    """What both synchronous tf_hetbatch strategies add to their stock base class.

    They implement `tf_hetbatch.core.protocols.SynchronousSplitStrategy`. The host class calls
    `_init_hetero(topology)` after its stock constructor, with the `topology` object of where
    its replicas live (`topology.OneHost`, `topology.Workers`).
    """

    def _init_hetero(self, where):
        self._topology = where
        self._allocation = where.allocation
        self._split = split_state.SplitState(self.num_replicas_in_sync)
        self._micro_batches = micro_batches.Limits(self.num_replicas_in_sync,
                                                   topology.HOST_DEVICE)
        # Set once a model with plain BatchNormalization trains: no replica may get 0 samples.
        self._needs_nonempty_replicas = False
        # False once the training data's per-sample work runs after the split: its sample
        # weights are then known per worker only (see the multi-worker `_step_total`).
        self._weights_in_pipeline = True
        self._said_unsplit = weakref.WeakSet()  # datasets whose unsplit input was logged
        self._training_data = None  # a weak reference to the last training data distributed
        self._said_unweighted_mean = False
        self._said_untimed = False  # a step XLA compiles takes no stamps (`timing`)
        self._unweighted_values = step_run.UnweightedValues()  # see `reduce`
        self._split_input_work = True
        self._user_batched_data = False  # data batched per replica by a user's function
        self._timing = timing.TimingAccumulators(
            self, self.num_local_replicas, from_release=where.time_from_release
        )
        self._noise = None  # `measure_gradient_noise`
        self._steps = step_run.StepRunner(self)

    # ----------------------------------------------------------------- the split ---------------
    @property
    def asynchronous(self) -> bool:
        """False: every replica runs every step (`protocols.SynchronousSplitStrategy`)."""
        return False

    @property
    def num_local_replicas(self) -> int:
        """Replicas of this process: all replicas in sync on one host, this worker's across
        workers."""
        return len(self.extended.worker_devices)

    @property
    def batch_sizes(self) -> Optional[Tuple[int, ...]]:
        """The current per-replica batch sizes, in replica order.

        Until `set_batch_sizes` is called, the even split of the data's global batch size
        (the first `B % K` replicas get one sample more), or None while that size is unknown.
        A partial last batch is split in proportion to these sizes, and so is every batch of
        evaluation data (Keras `evaluate`, `predict`, `fit`'s validation), whatever its size.
        """
        return self._split.sizes

    @property
    def num_parts(self) -> int:
        """Number of parts each global batch is split into: the replicas in sync."""
        return self.num_replicas_in_sync

    @property
    def global_batch_size(self) -> Optional[int]:
        """The global batch size: sum of the sizes set, else the data's (None while unknown)."""
        return self._split.global_batch

    def set_batch_sizes(self, sizes: Sequence[int]) -> None:
        """Sets the per-replica batch sizes: how each global batch is split from now on.

        Callable at any time, also during `fit` (e.g. from a callback). No retrace, no restart:
        the input pipeline reads the sizes once per global batch, so the change reaches the
        replicas with the global batches produced after the call, at most
        `topology.PIPELINE_LEAD_STEPS` (3) steps later (the distributed iterator prefetches).
        Gradient weights and timing always follow the actual batch shapes of each step, so that
        lag never costs exactness.

        Sizes that do not sum to the global batch of the training data in use are kept for
        the next training data (e.g. the next `fit`), which must then be batched by their sum;
        the data in use goes on with the split it has (logged at INFO). A split from before
        (an earlier `fit`'s, a controller's) meets training data batched by another size
        re-made in its proportions.

        Several workers: call it on every worker at the same point with the same sizes; the
        split switches on all of them `switch_margin` steps later, with no collective once a
        step was trained (see `HeteroMultiWorkerMirroredStrategy`).

        Args:
            sizes: one non-negative int per replica, in replica order.

        Raises:
            ValueError: wrong length, negative or non-integer sizes; a replica with 0 samples
                when the model has plain BatchNormalization.
        """
        sizes = split.validate_sizes(sizes, self.num_replicas_in_sync)
        if self._needs_nonempty_replicas:
            step_run.check_nonempty_sizes(sizes)
        if self._split.set(sizes):
            self._topology.install(sizes)

    @property
    def split_input_work(self) -> bool:
        """Whether each worker does the per-sample input work of its own samples only.

        True by default: for the pipelines `input_work` recognises (per-sample
        maps right before `batch`, Keras's array input, `split_here()`), every worker reads the
        same global batches but decodes and augments only its own replicas' samples. False
        runs every pipeline as written on every worker (each then keeps its slices), e.g. to
        measure the difference. Set it before the data is distributed (before `fit`).
        """
        return self._split_input_work

    @split_input_work.setter
    def split_input_work(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(
                f"`split_input_work` must be True or False. Received: {value!r}. Fix: "
                "strategy.split_input_work = False to run every pipeline unsplit."
            )
        self._split_input_work = value

    # ----------------------------------------------------------------- resuming ----------------
    @property
    def steps_trained(self) -> int:
        """Training steps run under this strategy (all fits), or as set by `resume_at`."""
        return int(self._allocation.trained.numpy())

    def resume_at(self, steps_trained: int, skip_batches: int = 0) -> None:
        """Prepares to resume an interrupted run (used by `tf_hetbatch.ResumableCheckpoint`).

        Args:
            steps_trained: the global step the checkpoint was written at; multi-worker split
                switches are keyed to it, so every worker must pass the same value.
            skip_batches: global batches the next data iterator drops first: the batches of
                the interrupted epoch that were already trained. Cleared by the next train step.

        Raises:
            ValueError: negative values.
        """
        fix = "pass the step and the batches of the epoch recorded in the checkpoint."
        steps_trained = _validate.check_int("steps_trained", steps_trained, 0, fix)
        skip_batches = _validate.check_int("skip_batches", skip_batches, 0, fix)
        self._allocation.trained.assign(steps_trained)
        self._allocation.first_step = steps_trained
        self._allocation.skip.assign(skip_batches)

    # ----------------------------------------------------------------- timing ------------------
    def read_replica_times(self, reset: bool = False) -> ReplicaTimes:
        """Per-replica compute time, samples, steps and step cycles accumulated by training
        steps.

        Compute time runs from a replica's step start to its local gradients being ready,
        before the all-reduce: its own work per step, without waiting for others. The step
        starts when the replica's inputs are there on one host, and when the previous
        all-reduce released the replica across workers. A step cycle runs from one release to
        the next: the step as the cluster lives it (`ReplicaTimes.step_time`). See
        `tf_hetbatch.distribute.timing`. Read between steps (e.g. from a callback).

        The measurements travel in each step's all-reduce, so every process holds every
        replica's: a read is local (no collective), and workers that read after the same
        step read the same values.

        Args:
            reset: if True, subtract what was read, so the next read covers only later steps
                and only the step cycles wholly after this read (the first two steps after it
                carry none: the host's work between reads is no split's step time).

        Returns:
            `ReplicaTimes` over all replicas in sync, in replica order.
        """
        times = self._timing.read()
        if reset:
            self._timing.start_measurement(times)
        return times

    def measure_gradient_noise(self, smoothing: float = 0.95) -> None:
        """Measures the gradient noise scale in every training step traced from now on.

        Each step's uneven (or even) split gives gradients at several batch sizes: from the
        squared norms of the replicas' mean gradients and of the global one, the step estimates
        |G|^2 (the true gradient's squared norm) and tr(S) (one sample's gradient noise), for
        K * 2 floats more in the step's one all-reduce and no collective of its own
        (`tf_hetbatch.distribute.gradient_noise`). Read them with `gradient_noise_scale`.
        Off by default: a step traced before this call measures nothing (call it before `fit`,
        or compile the model again).

        Args:
            smoothing: the exponential moving average's factor per measured step, in [0, 1):
                0.95 averages over about the last 20 steps.

        Raises:
            ValueError: `smoothing` outside [0, 1).
        """
        if not 0.0 <= float(smoothing) < 1.0:
            raise ValueError(
                f"measure_gradient_noise(smoothing={smoothing!r}): the moving average's factor "
                "must be in [0, 1). Fix: pass e.g. smoothing=0.95 (about the last 20 steps).")
        if self._noise is None:
            self._noise = gradient_noise.NoiseAccumulators(self, float(smoothing))
        else:
            self._noise.smoothing = float(smoothing)

    @property
    def gradient_noise_scale(self) -> Optional[GradientNoise]:
        """The smoothed estimates of |G|^2 and tr(S) and the noise scale
        `GradientNoise.scale` = tr(S) / |G|^2, as of the last step (None unless
        `measure_gradient_noise` was called). Read between steps; local: no collective."""
        return None if self._noise is None else self._noise.read()

    def restart_step_clock(self) -> None:
        """Times the next step of each replica from its inputs being ready, not from its release.

        Call it after a pause between training steps (an epoch boundary with validation, a
        checkpoint), so the pause is not counted as a replica's work. Local: no collective.
        `DynamicBatching` calls it at every epoch start; each new input pipeline does too.
        """
        self._timing.reset_clock()

    # ----------------------------------------------------------------- input -------------------
    def experimental_distribute_dataset(self, dataset, options=None):
        """Distributes a dataset of GLOBAL batches, splitting each by `batch_sizes`.

        Training data must be batched by sum(batch_sizes) (a partial last batch is split in
        proportion). Evaluation data, i.e. data Keras distributes for `evaluate`, `predict` or
        `fit`'s `validation_data`, may be batched by any size, as under the stock strategy:
        each batch of n samples is split in proportion to `batch_sizes` (each replica's share
        rounded down or up; evenly while none are set). Evaluation results are sums over
        samples, so they do not depend on the split. Which one a dataset is comes from the
        Keras call that distributes it (`keras_callers.keras_loop_distributing_data`), the same on
        every worker; data a custom loop distributes is training data.

        Its iterators are destroyed off the caller's thread once nothing refers to them (a
        used tf.data iterator's destruction can wait seconds for tf.data's autotuning thread;
        see `iterator_release`).

        Args:
            dataset: a `tf.data.Dataset` batched by the global batch size.
            options: `tf.distribute.InputOptions`, as for the stock strategy.

        Returns:
            A distributed dataset; replica k receives slice k of each global batch.

        Raises:
            ValueError: already distributed data, unbatched data, or training data whose batch
                size does not match the batch sizes set.
            TypeError: anything but a `tf.data.Dataset`.
        """
        evaluation = keras_callers.keras_loop_distributing_data() in keras_callers.EVALUATION_LOOPS
        model = keras_callers.keras_model_distributing_data()
        if model is not None:
            keras_trainer.inline_multi_step(model)  # steps_per_execution > 1 (keras#19246)
            self._micro_batches.guard_steps(self, model)  # a step out of memory runs again
        self._check_dataset(dataset, evaluation)
        if not evaluation:
            self._training_data = weakref.ref(dataset)
        mode = getattr(options, "experimental_replication_mode", None)
        if mode == tf.distribute.InputReplicationMode.PER_REPLICA:
            raise ValueError(
                "`options.experimental_replication_mode` must be PER_WORKER: a tf_hetbatch "
                "strategy splits each worker's stream of global batches itself. Received: "
                f"{mode}. Fix: tf.distribute.InputOptions() with the default replication mode."
            )
        self.restart_step_clock()
        num_replicas = self.num_replicas_in_sync
        replica_range = self._topology.replica_range
        several_workers = self.num_local_replicas < num_replicas
        owns_every_replica = not several_workers or not self._split_input_work
        seed = None
        if several_workers and not evaluation and input_work.has_unseeded_shuffle(dataset):
            seed = self._topology.agree_on_seed()  # every worker distributes the same data
        plans = []

        def dataset_fn(input_context):
            del input_context  # every worker reads every global batch; see topology.Workers
            plan = input_work.plan(dataset, owns_every_replica, seed, evaluation)
            plans.append(plan)
            return input_split.split_global_batches(
                dataset, self._allocation, num_replicas, replica_range, evaluation=evaluation,
                plan=plan,
            )

        distributed = super().distribute_datasets_from_function(dataset_fn, options)
        # Every global batch gives every replica a slice (maybe empty), and every worker reads
        # every global batch, so all replicas' data ends at the same step: TensorFlow's
        # per-step check for the opposite is not needed (across workers it is an all-reduce).
        iterators.disable_partial_batch_handling(distributed)
        if options is None and _one_cpu_replica(self.extended.worker_devices):
            iterators.plain_iterators(distributed)
        iterators.adapt_iterators(distributed, iterator_release.hold)
        if plans and not evaluation:
            self._weights_in_pipeline = plans[0].weights_in_raw
        if (plans and plans[0].reason and several_workers and self.is_chief
                and dataset not in self._said_unsplit):  # one host: nothing to gain
            self._said_unsplit.add(dataset)
            logger.warning(
                "The input pipeline runs unsplit: every worker does all of its per-sample work "
                "for every global batch, not only for its own samples, because %s.",
                plans[0].reason,
            )
        return distributed

    def training_data_reshuffles(self) -> bool:
        """Whether the training data last distributed draws a new order for each iterator (a
        `shuffle` that reshuffles each iteration): its epochs' orders depend on how many
        iterators the process made before, so a resumed run's differ (`ResumableCheckpoint`)."""
        data = self._training_data() if self._training_data is not None else None
        return data is not None and tf_data.reshuffles_each_iteration(data)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """As the stock method: `dataset_fn(input_context)` batches each replica's data itself.

        Such data does not follow the split: `set_batch_sizes` (and a `DynamicBatching` or
        `Balancer`) cannot reach the batch sizes its pipelines chose, and each worker reads
        what its pipeline gives (the strategy does not check that workers agree). Said once,
        in a warning. Training on it stays exact: the loss weights follow each step's actual
        batches (across workers the step's totals then take a small all-reduce). To balance,
        distribute a dataset of global batches with `experimental_distribute_dataset`.
        """
        if not self._user_batched_data and self.is_chief:
            logger.warning(
                "distribute_datasets_from_function: the dataset function batches each "
                "replica's data itself, so the split (set_batch_sizes, DynamicBatching, "
                "Balancer) does not reach it. Fix, to balance: batch the data by the global "
                "batch size and pass it to strategy.experimental_distribute_dataset.")
        self._user_batched_data = True
        return super().distribute_datasets_from_function(dataset_fn, options)

    def check_input_agreement(self) -> None:
        """Checks that every worker has trained the same global batches so far.

        Several workers: one small collective (call it on every worker at the same point);
        every `gather_replica_values` (and a `set_batch_sizes` before the first trained step)
        checks the same on the way. One host: nothing to check.

        Raises:
            RuntimeError: the workers' input pipelines produced different global batches
                (naming the likely causes and the fix).
        """
        self._topology.gather(np.zeros(self.num_local_replicas))

    def _check_dataset(self, dataset, evaluation=False):
        if isinstance(dataset, tf.distribute.DistributedDataset):
            raise ValueError(
                "`dataset` is already distributed. A tf_hetbatch strategy splits global batches "
                f"itself. Received: {type(dataset).__name__}. Fix: pass the tf.data.Dataset of "
                "global batches, before any experimental_distribute_dataset()."
            )
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                "`dataset` must be a tf.data.Dataset of global batches. Received: "
                f"{type(dataset).__name__}. Fix: build one with tf.data, or pass numpy arrays "
                "with batch_size= to model.fit."
            )
        specs = tf.nest.flatten(dataset.element_spec)
        ranks = [getattr(getattr(s, "shape", None), "rank", None) for s in specs]
        if any(rank == 0 for rank in ranks):
            raise ValueError(
                "`dataset` must be batched: every component needs a leading batch dimension. "
                f"Received: element_spec={dataset.element_spec}. Fix: "
                "dataset.batch(global_batch_size)."
            )
        batch = tf_data.static_batch_size(dataset)
        if batch is None:  # Keras's array input batches index ranges: tf.data cannot tell
            batch = keras_callers.keras_batch_size_distributing_data()
        leading = [
            s.shape[0] for s in specs if getattr(getattr(s, "shape", None), "rank", None)
        ]
        if batch is None and None not in leading and len(set(leading)) > 1:
            raise ValueError(
                "`dataset` must be batched: its components' leading dimensions differ, so they "
                f"cannot be a batch dimension. Received: element_spec={dataset.element_spec}. "
                "Fix: dataset.batch(global_batch_size)."
            )
        if batch is not None and not evaluation:  # evaluation batches may have any size
            sizes = self._split.data_arrived(batch)
            if sizes is not None:
                if self._needs_nonempty_replicas:
                    step_run.check_nonempty_sizes(sizes)
                self._topology.install_for_new_data(sizes)

    # ----------------------------------------------------------------- the step ----------------
    def run(self, fn, args=(), kwargs=None, options=None):
        """As `tf.distribute.Strategy.run`, with exact weights, timing and global logs.

        Every replica's loss is weighted where Keras scales it for distribution (the model's
        `compute_loss`, the `keras.losses.Loss` objects the step's model holds), so the update
        equals one device's on the whole global batch, for Keras's own `train_step`, a custom
        `train_step` written as Keras's guide teaches (with any number of optimizers the model
        holds) and custom training loops (see `weighting`); loss scalings that divide by the
        replica count and cannot be weighted are refused when the step is traced. The
        replica's compute time is recorded for `read_replica_times`, and every log that is a
        metric's `result()` is replaced by its true global value (see `step_run`).
        """
        return self._steps.run(fn, args, kwargs, options, super().run)

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas in sync (as stock). Read while a step is traced, it tells the
        strategy that the step divides a loss by it (see `weighting.check_replica_count_read`).
        """
        weighting.check_replica_count_read(weighting.current_step())
        return super().num_replicas_in_sync

    def _step_totals(self, data, kind):
        """Cross-replica context: the step's total samples and sample weight, as a pair of
        tensors or a replica-context function that returns them (see the topology's
        `step_totals`). They are recorded by the split pipeline for training data of global
        batches whose sample weights exist before the split."""
        recorded = kind != "test_step" and not self._user_batched_data and (
            self._weights_in_pipeline or not step_run.has_sample_weight(
                self.experimental_local_results(data)[0]))
        return self._topology.step_totals(data, recorded)

    def _note_local_batch_norm(self):
        """A model with plain BatchNormalization trains: no replica may get 0 samples."""
        self._needs_nonempty_replicas = True
        if self.batch_sizes is not None:
            step_run.check_nonempty_sizes(self.batch_sizes)

    def _note_untimed_step(self):
        """A step compiled by XLA was traced: it takes no replica timing stamps (`timing`).
        Once a strategy, the chief says why and what follows."""
        if self.is_chief and not self._said_untimed:
            logger.warning(
                "The training step is compiled by XLA (model.compile(jit_compile=True), or a "
                "tf.function(jit_compile=True) around strategy.run): no replica's clock can be "
                "read inside it (tf.timestamp has no XLA kernel), so its steps record no "
                "replica times (read_replica_times counts no steps for them), and the batch "
                "split stays where it is: the static split, or the one set_batch_sizes sets; "
                "DynamicBatching and Balancer keep it. Fix, to balance the split from measured "
                "times: compile with jit_compile=False.")
        self._said_untimed = True

    def global_logs(self, model, outputs):
        """Cross-replica context: `outputs` of a Keras train/test step with each of `model`'s
        metric results replaced by its true global running mean (all replicas' metric variables
        summed in one batch all-reduce; the stock strategy averages the replicas' local means,
        which is biased under uneven batches). Other entries and non-dict outputs are returned
        as they are."""
        return self._steps.global_logs(model, outputs)

    def reduce(self, reduce_op, value, axis):
        """As `tf.distribute.Strategy.reduce`; see `keras_callers.is_uneven_batch_reduce`.

        A MEAN over replicas (`axis=None`) of a custom step's per-replica values that the
        strategy did not weight gives every replica equal weight, whatever its samples: once a
        strategy, the chief's warning names the fix."""
        if axis is not None or not is_mean(reduce_op):
            return super().reduce(reduce_op, value, axis)
        leaves = tf.nest.flatten(value)
        if any(v in self._unweighted_values for v in leaves):
            self._say_unweighted_mean()
        if not any(keras_callers.is_uneven_batch_reduce(self, v) for v in leaves):
            return super().reduce(reduce_op, value, axis)
        def each(v):
            if keras_callers.is_uneven_batch_reduce(self, v):
                return keras_callers.largest_local_batch(self, v)
            return super(HeteroMixin, self).reduce(reduce_op, v, axis)
        return tf.nest.map_structure(each, value)

    def _say_unweighted_mean(self):
        if self.is_chief and not self._said_unweighted_mean:
            logger.warning(
                "strategy.reduce(MEAN, value, axis=None) averages the replicas' values with "
                "equal weights, but tf_hetbatch gives replicas different numbers of samples: "
                "a value each replica computed over its own samples (tf.reduce_mean of a "
                "loss or an accuracy) is not the global mean once averaged so. Fix: return "
                "per-example values and reduce them with axis=0, or sums reduced with SUM and "
                "divided by the global batch (tf.nn.compute_average_loss(..., "
                "global_batch_size=B) and ReduceOp.SUM), or update a keras.metrics.Mean in "
                "the step and read its result().")
        self._said_unweighted_mean = True

    @property
    def switch_lag_steps(self) -> int:
        """An upper bound on the training steps after `set_batch_sizes` until the new split is
        in force on every replica (one host: the split pipeline runs at most a few global
        batches ahead; several workers: exactly the strategy's `switch_margin`). Measurements
        that start earlier may mix the two splits."""
        return self._topology.switch_lag_steps

    @property
    def is_chief(self) -> bool:
        """Whether this process is the chief (writes logs and checkpoints). True on one host."""
        return self._topology.is_chief

    def gather_replica_values(self, local_values) -> "np.ndarray":
        """All replicas' values, in replica order, from this process's replicas' values.

        In multi-worker training this is a collective: every worker must call it at the same
        point (e.g. from the same callback hook at the same step).

        Args:
            local_values: float array [num local replicas] (or [num local replicas, n]).

        Returns:
            float64 array [num_replicas_in_sync] (or [num_replicas_in_sync, n]).

        Raises:
            ValueError: `local_values` has not one row per local replica.
        """
        return self._topology.gather(self._local_rows(local_values))

    def _local_rows(self, local_values):
        local_values = np.asarray(local_values, dtype=np.float64)
        if local_values.ndim not in (1, 2) or local_values.shape[0] != self.num_local_replicas:
            raise ValueError(
                f"`local_values` must have one row per local replica ({self.num_local_replicas})."
                f" Received: shape {local_values.shape}. Fix: one value (or one row of values) "
                "for each of this process's replicas, in `strategy.extended.worker_devices` "
                "order."
            )
        return local_values

    def part_capacities(self) -> np.ndarray:
        """Nominal peak FLOP/s of every replica's device, in replica order.

        Each local replica device is looked up (`device_peaks`); the values are
        then gathered from every worker: in multi-worker training a collective, called at the
        same point on every worker.

        Returns:
            float64 array [num_replicas_in_sync] of FLOP/s.

        Raises:
            ValueError: a replica on a GPU that TensorFlow does not list.
        """
        local = [device_peaks.device_peak_flops(d) for d in self.extended.worker_devices]
        return self.gather_replica_values(np.asarray(local, np.float64))


def _one_cpu_replica(devices):
    """Whether a process holds one replica, on a CPU (its data needs no per-device iterator)."""
    return len(devices) == 1 and tf.DeviceSpec.from_string(devices[0]).device_type == "CPU"


class HeteroMirroredStrategy(HeteroMixin, tf.distribute.MirroredStrategy):
    """`tf.distribute.MirroredStrategy` with uneven per-replica batches and exact weighting.

    A drop-in replacement: same constructor, same use. Batch the data by the GLOBAL batch size
    B as usual; each global batch is split into per-replica batches `batch_sizes` (even until
    `set_batch_sizes` is called, also when B does not divide by the replica count), and each
    replica's gradient is weighted by b_k / B, so every update equals the one a single device
    makes on the whole global batch: with SyncBatchNormalization, regularisers, any Keras
    optimizer and LossScaleOptimizer. Per-batch logs and History hold true global means.
    Evaluation data (`evaluate`, `predict`, `fit`'s `validation_data`) may be batched by any
    size, as with the stock strategy; each of its batches is split in proportion to the sizes.

    What changes relative to the stock strategy, and only under this strategy:
    - the optimizer instance of a model trained under it gets instance-level `scale_loss` and
      `apply` hooks (weights and timing; no-ops outside its steps);
    - with `steps_per_execution > 1` (which fails for the stock strategy,
      keras-team/keras#19246), the model gets an instance-level `_make_function` that inlines
      its one-step function into the multi-step loop (`keras_trainer.inline_multi_step`); it needs
      Keras's fit/evaluate/predict to distribute the data, and no `jit_compile`;
    - plain (unsynchronised) BatchNormalization computes local statistics, as with the stock
      strategy, so it is not exact; and a replica may not get an empty batch with it;
    - with `jit_compile=True` XLA compiles the whole step, where no replica's clock can be read:
      its steps are exact but not timed (`read_replica_times` counts none), so the split stays
      where it is (the static one, or `set_batch_sizes`); with `steps_per_execution > 1` it
      is refused.

    Args:
        devices: as for `tf.distribute.MirroredStrategy`.
        cross_device_ops: as for `tf.distribute.MirroredStrategy`.

    Example:
        >>> import tf_hetbatch as hb
        >>> strategy = hb.HeteroMirroredStrategy(["/cpu:0"])
        >>> strategy.set_batch_sizes([32])
        >>> strategy.batch_sizes
        (32,)
    """

    def __init__(self, devices=None, cross_device_ops=None):
        collectives.assign_collective_key_base(self)
        super().__init__(devices=devices, cross_device_ops=cross_device_ops)
        self._init_hetero(topology.OneHost(self))


class StepCounter:
    """Training steps each Keras `on_train_batch_end` call covers, for a callback.

    Keras calls it once per execution of `steps_per_execution` steps, and the `batch` it
    passes is the execution's nominal last step, also past the end of the data; the steps
    the synchronous strategies count are exact. Asynchronous training: one update per call.
    """

    def __init__(self, strategy):
        self._strategy = strategy
        self._last = self._read()

    def _read(self):
        if self._strategy.asynchronous:
            return None
        return self._strategy.steps_trained

    def __call__(self) -> int:
        """The steps trained since the previous call (or the counter's creation)."""
        now = self._read()
        if now is None:
            return 1
        steps, self._last = max(now - self._last, 0), now
        return steps


def hetero_strategy_of(model, user: str, synchronous: bool = False):
    """The tf_hetbatch strategy `model` was created under.

    Args:
        model: a Keras model.
        user: who asks (for the error message), e.g. "DynamicBatching".
        synchronous: if True, only a synchronous strategy will do.

    Returns:
        The strategy: a `protocols.SplitStrategy` (a `protocols.SynchronousSplitStrategy`
        with `synchronous=True`).

    Raises:
        ValueError: the model is not under a tf_hetbatch strategy, or (`synchronous`) under
            the asynchronous one (naming `user`, the caller).
    """
    from tf_hetbatch.distribute.parameter_server import HeteroParameterServerStrategy

    strategy = getattr(model, "distribute_strategy", None)
    if not isinstance(strategy, (HeteroMixin, HeteroParameterServerStrategy)):
        raise ValueError(
            f"{user} needs a model created under a tf_hetbatch strategy. Received: a model "
            f"under {type(strategy).__module__}.{type(strategy).__name__}. Fix: create and "
            "compile the model inside `with strategy.scope():` of a HeteroMirroredStrategy, "
            "HeteroMultiWorkerMirroredStrategy or HeteroParameterServerStrategy."
        )
    if synchronous and strategy.asynchronous:
        raise ValueError(
            f"{user} needs a synchronous tf_hetbatch strategy (Keras fit). Received: a model "
            f"under {type(strategy).__name__}. Fix: use HeteroMirroredStrategy or "
            "HeteroMultiWorkerMirroredStrategy; AsyncTrainer(checkpoint_dir=...) checkpoints "
            "asynchronous training itself."
        )
    return strategy


def is_mean(reduce_op) -> bool:
    """Whether `reduce_op` (a ReduceOp or its name) is MEAN."""
    return str(getattr(reduce_op, "value", reduce_op)).upper() == "MEAN"
