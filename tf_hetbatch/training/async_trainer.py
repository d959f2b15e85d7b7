"""AsyncTrainer: asynchronous (ASP) Keras training on a parameter-server cluster.

Keras 3 `fit` does not support `ParameterServerStrategy`; this trainer gives the familiar
parts of it on `HeteroParameterServerStrategy` + `ClusterCoordinator`: epochs of
`steps_per_epoch` updates, a progress bar, a `History`, validation and `evaluate` on the chief,
Keras callbacks (including `DynamicBatching` and its dashboards), checkpoints and resuming.

Each scheduled step runs on whichever worker is free: it takes that worker's mini-batch size
b_k from the current split, reads b_k examples from the worker's own input pipeline, computes
the gradient of its mean loss scaled by b_k / mean(b) (linear gradient scaling: every sample
carries the same weight whatever the split) and applies it on the parameter servers. It also
records, on the parameter servers, the worker's step time, samples and the staleness of its
update: the number of updates other workers applied between its reading of the step counter
(just before its forward pass) and its own update.
"""

import logging
import os
import time
from typing import Callable, Dict, List, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_hetbatch.core._validate import check_int
from tf_hetbatch.core.measurements import Staleness
from tf_hetbatch.distribute import parameter_server
from tf_hetbatch.distribute import timing
from tf_hetbatch.distribute.parameter_server import HeteroParameterServerStrategy
from tf_hetbatch.training import checkpoint_choice as _choice
from tf_hetbatch.training import run_checkpoint as _run
from tf_hetbatch.training.preemption import RESTART_EXIT_CODE, PreemptionNotice

logger = logging.getLogger(__name__)

_LOG_READ_INTERVAL_S = 0.25
_TRAINER = "async"


class ParameterServerLostError(RuntimeError):
    """A parameter server became unreachable: training stopped (resume from the checkpoint)."""


class AsyncTrainer:
    """Trains a Keras model asynchronously on a `HeteroParameterServerStrategy` cluster.

    Args:
        model: a Keras model built under `strategy.scope()` (its variables live on the
            parameter servers).
        optimizer: a Keras optimizer, or its name ("sgd", "adam", ...). Created and built
            under the strategy's scope.
        loss: a Keras loss, its name, or a function `(y_true, y_pred) -> per-sample losses`.
            The update of worker k minimises its batch mean scaled by b_k / mean(b).
        metrics: Keras metric names ("accuracy" picks the variant matching the loss) or
            metric objects created under `strategy.scope()`, accumulated over all workers'
            updates on the parameter servers. Validation uses copies of them on the chief.
        strategy: default `model.distribute_strategy`.
        checkpoint_dir: if set, the model, optimizer, split and `DynamicBatching` state are
            saved there (at each epoch end, every `checkpoint_interval` updates and on a
            preemption notice), and `fit` resumes from the newest checkpoint there that can be
            read (a damaged one is skipped with a WARNING; if none can be read, a ValueError
            names them). The checkpoints are TensorFlow checkpoints, the same as
            `ResumableCheckpoint`'s (`tf_hetbatch.training.run_checkpoint`), on any
            `tf.io.gfile` path. If the worker count changed, the split is even and
            `DynamicBatching` starts afresh.
        checkpoint_interval: updates between mid-epoch checkpoints (None: epoch ends only).
            Each waits for the scheduled steps to finish.
        max_outstanding: scheduled steps allowed to be queued or running at once; default
            2 per worker (each worker has one running and one waiting, and the measurements
            `DynamicBatching` reads stay current).

    Preemption notices: while `fit` runs, a SIGTERM to the chief (or `request_preemption()`)
    makes it wait for the scheduled steps, save (with `checkpoint_dir`) and exit with
    `tf_hetbatch.RESTART_EXIT_CODE` (42), which the launcher restarts the cluster on; the
    relaunch redoes no update. The notice is acted on after the step being scheduled. A lost
    worker is tolerated as before; a SIGKILLed chief loses the updates since the last save.

    Raises:
        ValueError: the model is not under a `HeteroParameterServerStrategy`, or a bad argument.

    Example:

        strategy = hb.HeteroParameterServerStrategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(10)])
        trainer = hb.AsyncTrainer(model, keras.optimizers.SGD(0.05),
                                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                  metrics=["accuracy"])
        history = trainer.fit(lambda ctx: examples.shuffle(10_000).repeat(), batch_size=32,
                              epochs=3, steps_per_epoch=500, validation_data=test.batch(256),
                              callbacks=[hb.DynamicBatching(log_dir="logs")])
    """

    def __init__(self, model, optimizer, loss, metrics: Optional[Sequence] = None, *,
                 strategy: Optional[HeteroParameterServerStrategy] = None,
                 checkpoint_dir: Optional[str] = None,
                 checkpoint_interval: Optional[int] = None,
                 max_outstanding: Optional[int] = None):
        strategy = strategy if strategy is not None else getattr(model, "distribute_strategy",
                                                                 None)
        if not isinstance(strategy, HeteroParameterServerStrategy):
            raise ValueError(
                "AsyncTrainer needs a model created under a HeteroParameterServerStrategy. "
                f"Received: strategy {type(strategy).__name__}. Fix: create the model inside "
                "`with hb.HeteroParameterServerStrategy().scope():` on the chief.")
        if checkpoint_interval is not None:
            check_int("checkpoint_interval", checkpoint_interval, 1,
                      "e.g. checkpoint_interval=500, or None for epoch ends only.")
        if max_outstanding is not None:
            check_int("max_outstanding", max_outstanding, 1,
                      "e.g. 2 per worker (the default, None).")
        self.model = model
        self.strategy = strategy
        self.checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_interval = checkpoint_interval
        self.max_outstanding = max_outstanding or 2 * strategy.num_workers
        self.loss = keras.losses.get(loss) if isinstance(loss, str) else loss
        if not callable(self.loss):
            raise ValueError(f"`loss` must be a Keras loss, its name or a function. Received: "
                             f"loss={loss!r}")
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        with strategy.scope():
            self.optimizer = keras.optimizers.get(optimizer)
            self.optimizer.build(model.trainable_variables)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.metrics = [_resolve_metric(m, self.loss) for m in (metrics or [])]
            # Keras callbacks read `model.optimizer` (TensorBoard logs its learning rate,
            # ModelCheckpoint saves it): compile records it; training never uses Keras's loop.
            model.compile(optimizer=self.optimizer, loss=self.loss)
        # Validation runs on the chief, into metrics of its own (not on the parameter servers).
        self._val_loss = keras.metrics.Mean(name="loss")
        self._val_metrics = [_resolve_metric(m, self.loss) if isinstance(m, str)
                             else m.__class__.from_config(m.get_config())
                             for m in (metrics or [])]
        self._train_step = None
        self._eval_step = None
        self._element_spec = None
        self._global_step = 0
        self._balancers: List = []  # of the DynamicBatching callbacks of the fit
        self._store = (None if self.checkpoint_dir is None else
                       _run.RunCheckpoint(self.checkpoint_dir, model, self.optimizer, keep=2))
        self._notice: Optional[PreemptionNotice] = None
        self._pending_request = False
        self.staleness: Optional[Staleness] = None
        # The position `fit` resumed from ({} if none), and the update saved at on a
        # preemption notice (None if none).
        self.restored: Optional[Dict] = None
        self.preempted_at: Optional[int] = None

    def request_preemption(self) -> None:
        """Asks for what a SIGTERM does: save after the scheduled steps, then exit (42).

        Call it from any thread while (or before) `fit` runs.
        """
        if self._notice is not None:
            self._notice.request()
        else:
            self._pending_request = True

    # ------------------------------------------------------------------ fit ---------------
    def fit(self, dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset],
            batch_size: int, epochs: int = 1, steps_per_epoch: int = None,
            validation_data=None, validation_steps: Optional[int] = None,
            callbacks: Optional[Sequence[keras.callbacks.Callback]] = None,
            verbose="auto", initial_epoch: int = 0) -> keras.callbacks.History:
        """Trains asynchronously: `epochs` x `steps_per_epoch` updates spread over the workers.

        Args:
            dataset_fn: `input_context -> tf.data.Dataset` of single (unbatched) examples
                `(x, y)` or `(x, y, sample_weight)`, called once per worker with
                `input_context.input_pipeline_id` = the worker index (shard with it if you
                like). Repeated indefinitely: an epoch is a number of updates, not a pass.
            batch_size: the batch of an update at the even split; the split over the K
                workers sums to `batch_size * K` and each update is scaled by
                b_k / batch_size. It is the mean per update only when workers make equal
                numbers of updates: with an uneven split, an epoch of `steps_per_epoch`
                updates holds more or fewer samples than `steps_per_epoch * batch_size`
                (a fast worker with a big batch makes fewer updates than it would at the even
                split); compare runs by time to accuracy, or by samples.
            epochs: as in Keras.
            steps_per_epoch: updates per epoch (all workers together). Required.
            validation_data: a dataset of batches, evaluated on the chief after each epoch.
            validation_steps: batches of it per evaluation (default: all).
            callbacks: Keras callbacks. Batch hooks run as steps are scheduled; their logs
                are the running means read from the parameter servers.
            verbose: 0 silent, 1 progress bar, 2 one line per epoch, "auto" = 1.
            initial_epoch: as in Keras.

        Returns:
            A `keras.callbacks.History`; epoch logs hold loss, metrics, `staleness` (mean over
            the epoch's updates) and `val_*`.

        Raises:
            ValueError: bad arguments, or a dataset of batches instead of examples.
            ParameterServerLostError: a parameter server was lost (resume from the checkpoint).
        """
        _check_fit_arguments(dataset_fn, batch_size, epochs, steps_per_epoch,
                             validation_data, validation_steps, initial_epoch)
        verbose = 1 if verbose == "auto" else verbose
        self.strategy.set_global_batch_size(batch_size * self.strategy.num_workers)
        iterator = self._per_worker_iterator(dataset_fn)
        step_fn = self._make_train_step(float(batch_size))
        # DynamicBatching's work is its Balancer's: driven here directly, not as a callback.
        self._balancers = [cb.balancer for cb in callbacks or [] if _is_dynamic_batching(cb)]
        callback_list = keras.callbacks.CallbackList(
            [cb for cb in callbacks or [] if not _is_dynamic_batching(cb)], add_history=True,
            add_progbar=verbose != 0, model=self.model, verbose=verbose, epochs=epochs,
            steps=steps_per_epoch)
        resume_epoch, resume_batch = self._restore(steps_per_epoch, batch_size)
        initial_epoch = max(initial_epoch, resume_epoch)
        self.model.stop_training = False
        self.preempted_at = None
        fit_start = self._staleness_total()
        logs = None
        self._notice = PreemptionNotice(None)
        self._notice.start()
        if self._pending_request:
            self._pending_request = False
            self._notice.request()
        try:
            for balancer in self._balancers:
                balancer.begin(self.strategy)
            callback_list.on_train_begin()
            for epoch in range(initial_epoch, epochs):
                first = resume_batch if epoch == resume_epoch else 0
                logs = self._run_epoch(epoch, first, steps_per_epoch, step_fn, iterator,
                                       callback_list, validation_data, validation_steps)
                if self.model.stop_training:
                    break
        except tf.errors.UnavailableError as e:
            raise self._lost(e) from e
        finally:
            self._notice.close()
            self._notice = None
        self.staleness = self._staleness_total() - fit_start
        for balancer in self._balancers:
            balancer.end()
        callback_list.on_train_end(logs)
        return next(cb for cb in callback_list.callbacks
                    if isinstance(cb, keras.callbacks.History))

    def _run_epoch(self, epoch, first, steps, step_fn, iterator, callback_list,
                   validation_data, validation_steps) -> Dict[str, float]:
        for metric in [self.loss_tracker, *self.metrics]:
            metric.reset_state()
        epoch_start = self._staleness_total()
        for balancer in self._balancers:
            balancer.epoch_begin()
        callback_list.on_epoch_begin(epoch)
        pending: List = []
        logs, logs_read = {}, 0.0
        for batch in range(first, steps):
            for balancer in self._balancers:
                balancer.step_begin()
            callback_list.on_train_batch_begin(batch)
            pending.append(self.coordinator.schedule(
                step_fn, args=(iterator, self.strategy.batch_sizes_tensor())))
            self._global_step += 1
            pending = _wait_outstanding(pending, self.max_outstanding)
            if time.monotonic() - logs_read > _LOG_READ_INTERVAL_S:
                logs, logs_read = self._train_logs(), time.monotonic()
            for balancer in self._balancers:
                balancer.step_end(1)  # one update scheduled
            callback_list.on_train_batch_end(batch, logs)
            if self._notice.due(self._global_step):
                self._save_on_notice(epoch, batch + 1)
            if (self.checkpoint_interval and self._global_step % self.checkpoint_interval == 0
                    and batch + 1 < steps):
                self.coordinator.join()
                self._save(epoch, batch + 1)
            if self.model.stop_training:
                break
        self.coordinator.join()
        logs = self._train_logs()
        stale = self._staleness_total() - epoch_start
        logs["staleness"] = float(np.nansum(stale.mean * stale.updates) /
                                  max(1, int(stale.updates.sum())))
        if validation_data is not None:
            callback_list.on_test_begin()
            val = self.evaluate(validation_data, steps=validation_steps, verbose=0,
                                return_dict=True)
            callback_list.on_test_end(val)
            logs.update({f"val_{k}": v for k, v in val.items()})
        self._save(epoch + 1, 0)  # first: callbacks may stop the process
        callback_list.on_epoch_end(epoch, logs)
        return logs

    def _train_logs(self) -> Dict[str, float]:
        return {m.name: float(m.result()) for m in [self.loss_tracker, *self.metrics]}

    def _staleness_total(self) -> Staleness:
        return self.strategy.staleness_totals()

    # ------------------------------------------------------------------ evaluate ----------
    def evaluate(self, data, steps: Optional[int] = None, verbose="auto",
                 return_dict: bool = False):
        """Evaluates the current weights on the chief over a dataset of batches.

        Args:
            data: a `tf.data.Dataset` of batches `(x, y)` or `(x, y, sample_weight)`.
            steps: batches to evaluate (default: all).
            verbose: 0 silent, else one line with the results.
            return_dict: return {name: value} instead of [loss, *metrics].

        Returns:
            The loss and metrics (sample-weighted means over the data).
        """
        if not isinstance(data, tf.data.Dataset):
            raise ValueError("`data` must be a tf.data.Dataset of batches. Received: "
                             f"{type(data).__name__}. Fix: tf.data.Dataset.from_tensor_slices("
                             "(x, y)).batch(256).")
        if steps is not None:
            check_int("steps", steps, 1, "e.g. steps=10, or None for all batches.")
            data = data.take(steps)
        metrics = [self._val_loss, *self._val_metrics]
        for metric in metrics:
            metric.reset_state()
        if self._eval_step is None:
            self._eval_step = tf.function(self._eval_batch)
        for batch in data:
            self._eval_step(batch)
        results = {m.name: float(m.result()) for m in metrics}
        if verbose not in (0, False):
            logger.info("evaluate: %s", ", ".join(f"{k}={v:.4f}" for k, v in results.items()))
        return results if return_dict else [results[m.name] for m in metrics]

    def _eval_batch(self, batch):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
        pred = self.model(x, training=False)
        loss = _mean_loss(self.loss, y, pred, sample_weight)
        size = tf.shape(tf.nest.flatten(x)[0])[0]
        self._val_loss.update_state(loss, sample_weight=tf.cast(size, tf.float32))
        for metric in self._val_metrics:
            metric.update_state(y, pred, sample_weight=sample_weight)

    # ------------------------------------------------------------------ the train step ----
    def _per_worker_iterator(self, dataset_fn):
        num = self.strategy.num_workers

        def make_dataset(index):
            context = tf.distribute.InputContext(num_input_pipelines=num,
                                                 input_pipeline_id=index,
                                                 num_replicas_in_sync=num)
            examples = dataset_fn(context)
            if not isinstance(examples, tf.data.Dataset):
                raise ValueError("`dataset_fn` must return a tf.data.Dataset. Received: "
                                 f"{type(examples).__name__}.")
            _check_unbatched(examples.element_spec)
            tags = tf.data.Dataset.from_tensors(tf.constant(index, tf.int32)).repeat()
            return tf.data.Dataset.zip((tags, examples.repeat())).prefetch(tf.data.AUTOTUNE)

        iterator, self._element_spec = parameter_server.per_worker_iterator(
            self.coordinator, make_dataset)
        return iterator

    def _make_train_step(self, mean_batch: float):
        strategy, model, optimizer = self.strategy, self.model, self.optimizer
        specs = tf.nest.flatten(self._element_spec[1])
        structure = self._element_spec[1]

        def replica_step(batch, worker, read_at, started):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
            size = tf.shape(tf.nest.flatten(x)[0])[0]
            scale = tf.cast(size, tf.float32) / mean_batch
            with tf.GradientTape() as tape:
                pred = model(x, training=True)
                loss = _mean_loss(self.loss, y, pred, sample_weight)
                objective = loss * scale
                if model.losses:
                    objective += tf.add_n(model.losses)
            grads = tape.gradient(objective, model.trainable_variables)
            with tf.control_dependencies(grads):
                before = strategy.read_update_count()
            with tf.control_dependencies([before]):
                optimizer.apply(grads, model.trainable_variables)
            # Keras increments `iterations` last in `apply`: reading it orders what follows.
            with tf.control_dependencies([tf.identity(optimizer.iterations.value)]):
                seconds = timing.now() - started
                record = strategy.record_update(worker, size, seconds, before - read_at)
            updates = _add_metric_update(self.loss_tracker, loss,
                                         sample_weight=tf.cast(size, tf.float32))
            for metric in self.metrics:
                updates += _add_metric_update(metric, y, pred, sample_weight=sample_weight)
            with tf.control_dependencies([record, *updates]):
                return tf.identity(loss)

        @tf.function
        def train_step(iterator, sizes):
            started = timing.now()
            with tf.control_dependencies([started]):
                worker, first = next(iterator)
            count = sizes[worker]
            arrays = [tf.TensorArray(s.dtype, size=count, element_shape=s.shape).write(0, t)
                      for s, t in zip(specs, tf.nest.flatten(first))]

            def body(j, arrays):
                _, example = next(iterator)
                return j + 1, [a.write(j, t) for a, t in zip(arrays, tf.nest.flatten(example))]

            _, arrays = tf.while_loop(lambda j, _: j < count, body, (tf.constant(1), arrays))
            batch = tf.nest.pack_sequence_as(structure, [a.stack() for a in arrays])
            with tf.control_dependencies(tf.nest.flatten(batch)):
                read_at = strategy.read_update_count()
            return strategy.run(replica_step, args=(batch, worker, read_at, started))

        return train_step

    # ------------------------------------------------------------------ checkpoints -------
    def _restore(self, steps_per_epoch, batch_size):
        """Restores the newest readable checkpoint of `checkpoint_dir`; returns (epoch, batch).

        Only the chief reads checkpoints (the variables live on the parameter servers), so
        its choice needs no agreement: a checkpoint that cannot be read is skipped with one
        WARNING, and if none can be read the error names them (`checkpoint_choice`).
        """
        self.restored = {}
        if self._store is None:
            return 0, 0
        chosen = _choice.newest(self.checkpoint_dir, _TRAINER)
        if chosen is None:
            return 0, 0
        checkpoint, position = chosen
        checkpoint.restore(self._store, log=True)
        self._global_step = position.step
        sizes, keep_state = _run.resume_split(
            position.batch_sizes, position.num_parts or self.strategy.num_workers,
            self.strategy.num_workers, batch_size * self.strategy.num_workers,
            checkpoint.path, log=True)
        if sizes is not None:
            self.strategy.set_batch_sizes(sizes)
        if keep_state:
            for balancer, state in zip(self._balancers, position.dynamic_batching or []):
                balancer.set_state(state)
        logger.info("Resumed from %s: update %d (epoch %d, batch %d), split %s.",
                    checkpoint.path, self._global_step, position.epoch, position.batch,
                    self.strategy.batch_sizes)
        self.restored = position.to_dict()
        if position.batch >= steps_per_epoch:
            return position.epoch + 1, 0
        return position.epoch, position.batch

    def _save(self, epoch, batch):
        if self._store is None:
            return None
        sizes = self.strategy.batch_sizes
        position = _run.RunPosition(
            trainer=_TRAINER, step=self._global_step, epoch=epoch, batch=batch,
            num_parts=self.strategy.num_workers,
            batch_sizes=tuple(int(s) for s in sizes) if sizes else None,
            dynamic_batching=[balancer.get_state() for balancer in self._balancers])
        path = self._store.save(position)
        logger.debug("Checkpoint %s at update %d.", path, self._global_step)
        return path

    def _save_on_notice(self, epoch, batch):
        self.coordinator.join()  # every scheduled update is applied, and saved
        path = self._save(epoch, batch)
        self.preempted_at = self._global_step
        seconds = self._notice.seconds_since_notice
        logger.info("Preemption notice: %s at update %d%s; exiting with code %d (restart me).",
                    "saved" if path else "nothing saved (no checkpoint_dir)", self._global_step,
                    "" if seconds is None else f", {seconds:.2f} s after the notice",
                    RESTART_EXIT_CODE)
        self._notice.close()
        raise SystemExit(RESTART_EXIT_CODE)

    def _lost(self, error) -> ParameterServerLostError:
        where = "no checkpoint_dir was set, so nothing was saved (pass checkpoint_dir=...)"
        latest = self._store.latest_path if self._store is not None else None
        if latest:
            where = (f"the latest checkpoint is {latest}: run the same command again to "
                     "resume from it")
        message = (f"Lost contact with a parameter server after {self._global_step} scheduled "
                   f"updates ({type(error).__name__}: {str(error).splitlines()[0][:200]}). "
                   f"Training stopped; {where}.")
        logger.error(message)
        return ParameterServerLostError(message)


# ---------------------------------------------------------------------- helpers ----------
def _wait_outstanding(pending, limit):
    """Drops finished steps from `pending`; waits while more than `limit` are unfinished."""
    pending = [rv for rv in pending if not parameter_server.remote_value_done(rv)]
    while len(pending) > limit:
        parameter_server.wait_remote_value(pending[0], timeout=0.05)
        pending = [rv for rv in pending if not parameter_server.remote_value_done(rv)]
    return pending



def _check_fit_arguments(dataset_fn, batch_size, epochs, steps_per_epoch, validation_data,
                         validation_steps, initial_epoch) -> None:
    """`AsyncTrainer.fit`'s arguments, checked before anything starts (see its Raises)."""
    check_int("batch_size", batch_size, 1, "e.g. batch_size=32.")
    check_int("epochs", epochs, 1, "e.g. epochs=10.")
    check_int("initial_epoch", initial_epoch, 0, "e.g. initial_epoch=0.")
    if steps_per_epoch is None:
        raise ValueError("`steps_per_epoch` is required: asynchronous workers read "
                         "endless streams, so an epoch is a number of updates. Fix: pass "
                         "e.g. steps_per_epoch=len(train_examples) // batch_size.")
    check_int("steps_per_epoch", steps_per_epoch, 1,
              "e.g. steps_per_epoch=len(train_examples) // batch_size.")
    if not callable(dataset_fn):
        raise ValueError("`dataset_fn` must be a function input_context -> tf.data.Dataset "
                         f"of examples. Received: dataset_fn={dataset_fn!r}")
    if validation_data is not None and not isinstance(validation_data, tf.data.Dataset):
        raise ValueError("`validation_data` must be a tf.data.Dataset of batches (checked "
                         "now, before an epoch of training is spent). Received: "
                         f"{type(validation_data).__name__}. Fix: tf.data.Dataset."
                         "from_tensor_slices((x, y)).batch(256).")
    if validation_steps is not None:
        check_int("validation_steps", validation_steps, 1,
                  "e.g. validation_steps=10, or None for all.")


def _is_dynamic_batching(callback) -> bool:
    from tf_hetbatch.training.callback import DynamicBatching

    return isinstance(callback, DynamicBatching)


def _add_metric_update(metric, *args, **kwargs):
    """Adds one batch to `metric`'s state on the parameter servers, atomically.

    Keras's `update_state` does `variable.assign(variable + delta)` (keras-team/keras#18668),
    which loses increments when workers update concurrently (measured: the loss metric counted
    79-85% of an epoch's samples). Here the batch's delta is computed statelessly from zero
    state and added with one `AssignAddVariableOp` per variable. So a metric's state must be
    additive over batches (sums, counts, confusion matrices: Keras's built-in metrics are).
    """
    variables = metric.variables
    zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
    deltas = metric.stateless_update_state(zeros, *args, **kwargs)
    return [v.value.assign_add(d) for v, d in zip(variables, deltas)]


def _mean_loss(loss, y, pred, sample_weight):
    """The batch mean of the (sample-weighted) per-example losses, as Keras reduces them."""
    if isinstance(loss, keras.losses.Loss):
        return loss(y, pred, sample_weight=sample_weight)
    losses = loss(y, pred)
    if sample_weight is not None:
        losses = losses * tf.cast(sample_weight, losses.dtype)
    return tf.reduce_mean(losses)


def _check_unbatched(element_spec):
    for spec in tf.nest.flatten(element_spec):
        shape = getattr(spec, "shape", None)
        if shape is None or not shape.is_fully_defined():
            raise ValueError(
                "`dataset_fn` must give single examples with fixed shapes (the trainer batches "
                f"them per worker). Received an element of shape {shape}. Fix: remove "
                "`.batch(...)` from the dataset and pad variable-length features.")


def _resolve_metric(metric, loss):
    if not isinstance(metric, str) or metric not in ("accuracy", "acc"):
        return keras.metrics.get(metric) if isinstance(metric, str) else metric
    name = getattr(loss, "name", None) or getattr(loss, "__name__", "")
    if "sparse_categorical" in name:
        return keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    if "categorical" in name:
        return keras.metrics.CategoricalAccuracy(name="accuracy")
    if "binary" in name:
        return keras.metrics.BinaryAccuracy(name="accuracy")
    return keras.metrics.Accuracy(name="accuracy")


