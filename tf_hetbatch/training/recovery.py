"""ResumableCheckpoint: multi-worker-safe checkpoints, mid-epoch resume and preemption notices
for Keras `fit`.

Stock `keras.callbacks.BackupAndRestore` is not multi-worker aware (every worker writes the same
files) and resumes at epoch granularity. This callback writes from the chief only, as ordinary
TensorFlow checkpoints (`tf_hetbatch.training.run_checkpoint`: `tf.train.Checkpoint` +
`tf.train.CheckpointManager`, through `tf.io.gfile`), and resumes at the global step of the
checkpoint: the interrupted epoch's already-trained global batches are dropped by the
strategy's input pipeline (`strategy.resume_at`), so only the work since the last checkpoint is
redone, and nothing after a preemption notice (`tf_hetbatch.training.preemption`).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import zlib
from typing import Any, Dict, Optional, Tuple, Union

import keras
import numpy as np

from tf_hetbatch.core import micro_batches as _micro_batches
from tf_hetbatch.core._validate import check_int
from tf_hetbatch.distribute import keras_fit
from tf_hetbatch.distribute.strategy import StepCounter, hetero_strategy_of
from tf_hetbatch.training import checkpoint_choice as _choice
from tf_hetbatch.training import run_checkpoint as _run
from tf_hetbatch.training.preemption import RESTART_EXIT_CODE, PreemptionNotice

logger = logging.getLogger(__name__)

__all__ = ["ResumableCheckpoint"]

_TRAINER = "fit"
_ON_NOTICE = ("exit", "stop")


class ResumableCheckpoint(keras.callbacks.Callback):
    """Checkpoints a multi-worker (or one-host) tf_hetbatch run; resumes it mid-epoch.

    Use it with a model created under a tf_hetbatch strategy. Call `restore(model)` on every
    worker before `fit` and pass what it returns as `fit(initial_epoch=...)`:

        ckpt = hb.ResumableCheckpoint("/shared/run1/ckpt", save_every_steps=100)
        initial_epoch = ckpt.restore(model)      # 0 if there is no checkpoint yet
        model.fit(ds, epochs=10, initial_epoch=initial_epoch, callbacks=[ckpt])

    Saving (chief only; `strategy.is_chief`): every `save_every_steps` global steps
    (`strategy.steps_trained`), at the end of each epoch, and on a preemption notice. A
    checkpoint is one TensorFlow checkpoint `<directory>/ckpt-<step>` holding the model, its
    optimizer and the run's position (global step, epoch, batches done in it, the split
    `strategy.batch_sizes`, the replica count, `dynamic_batching.get_state()`, the memory
    bounds `strategy.micro_batch_limits`: a resumed run keeps a bound a step out of memory
    lowered, where it is below the bound it sets), written
    atomically by `tf.train.CheckpointManager`, which keeps the newest `keep`. Any
    `tf.io.gfile` path works: a shared file system, `gs://`, `s3://` (tensorflow-io),
    `ram://`. The decision to save depends only on the step count, so every worker takes it at
    the same step; saving needs no collective beyond one check that all workers trained the
    same batches. The weights load without tf_hetbatch:
    `tf.train.Checkpoint(model=model).restore(path).expect_partial()`.

    Preemption notices: while `fit` runs, a SIGTERM to any worker (or `request_preemption()`
    on one of them) makes every worker save at one agreed step and exit with
    `tf_hetbatch.RESTART_EXIT_CODE` (42), which the launcher (`tf_hetbatch.launch`) restarts
    on; the relaunch redoes no step. The save comes at the next step boundary on one host, and
    one step after the next boundary across workers (`preemption`); at an epoch's
    last step the checkpoint is that epoch's end, without its validation. A SIGKILL still
    loses the steps since the last save (at most `save_every_steps - 1`).

    Resuming (`restore`, on every worker, before `fit`): every worker lists the checkpoints
    and checks with one collective that all workers found the same ones; takes the newest
    that every worker can read whole (one collective per checkpoint tried; one that cannot be
    read, e.g. a data file cut short or an index file lost, is skipped with one WARNING, and
    if none can be read the error names them and what to do: the run never starts afresh
    over them); restores weights and optimizer variables (building the optimizer first); calls
    `strategy.resume_at(step, skip_batches=batches done in the epoch)` so the first epoch of
    the next `fit` skips the global batches already trained; and restores the split. With the
    same replica count as when saved, the saved split and the `dynamic_batching` state; with
    another count (e.g. relaunched on fewer workers), the global batch split evenly over the
    new replicas, `dynamic_batching` afresh, and one INFO line. A directory of the earlier
    tf_hetbatch format (`checkpoint.json`, `variables.npz`) resumes too; the new checkpoints
    are written beside its files, which stay untouched.

    Requirements, all checked where possible:
    - `directory` is on storage all workers see (a shared file system or bucket).
    - The data gives the same global batches in the same order in every run: no shuffle, or a
      seeded one that keeps its order (`shuffle(..., seed=s, reshuffle_each_iteration=False)`).
      Only then does skipping the trained batches resume the exact sequence. A seeded shuffle
      that reshuffles each epoch (tf.data's default) draws each epoch's order from a sequence
      a new process starts again: resuming at a later epoch then warns once.
    - The data's number of batches is known (`dataset.cardinality()`), so Keras keeps the
      epoch length after a shortened first epoch; otherwise add
      `dataset.apply(tf.data.experimental.assert_cardinality(n))`. Keras warns "Your input ran
      out of data" at the end of the resumed (shortened) epoch; that is expected.
    - `fit(initial_epoch=restore(model))`: a fit that starts at another epoch is an error.
    - A `fit` whose directory already holds a checkpoint must be preceded by `restore`
      (use a new directory to start afresh): an error otherwise, so nothing is overwritten.
    - A SIGTERM is caught only if `fit` runs in the main thread; `request_preemption()` works
      from any thread.

    Not restored: metric state (the epoch's metrics after a resume cover the resumed steps
    only) and other callbacks' state.

    Args:
        directory: str or path-like, where checkpoints go (any `tf.io.gfile` path).
        save_every_steps: int >= 1, save every this many global steps. Default 50.
        keep: int >= 1, how many of the newest checkpoints to keep. Default 2.
        dynamic_batching: optional `tf_hetbatch.DynamicBatching` of the same `fit`, whose
            state is saved and restored with the checkpoint.
        on_notice: "exit" (default): after the save on a preemption notice, raise
            `SystemExit(RESTART_EXIT_CODE)` out of `fit`. "stop": end `fit` normally instead
            (`model.stop_training`); `ckpt.preempted_at` says the step, and the script exits
            (with `RESTART_EXIT_CODE` to be restarted) when it is done.

    Raises:
        ValueError, TypeError: invalid arguments (the message names the value and the fix).

    Example:
        >>> import tf_hetbatch as hb, keras, numpy as np, tempfile
        >>> strategy = hb.HeteroMirroredStrategy(["/cpu:0"])
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile("sgd", "mse")
        >>> ckpt = hb.ResumableCheckpoint(tempfile.mkdtemp(), save_every_steps=2)
        >>> x = np.ones((32, 4), "float32")
        >>> _ = model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0,
        ...               initial_epoch=ckpt.restore(model), callbacks=[ckpt])
        >>> ckpt.latest()["step"]
        4
    """

    def __init__(
        self,
        directory: Union[str, os.PathLike],
        save_every_steps: int = 50,
        keep: int = 2,
        dynamic_batching: Any = None,
        on_notice: str = "exit",
    ) -> None:
        super().__init__()
        if isinstance(directory, bool) or not isinstance(directory, (str, os.PathLike)) \
                or not os.fspath(directory):
            raise ValueError(
                "`directory` must be a non-empty path on storage every worker sees, e.g. "
                f"'/shared/run1/ckpt' or 'gs://bucket/run1'. Received: directory={directory!r}")
        self.directory = os.fspath(directory)
        self.save_every_steps = check_int(
            "save_every_steps", save_every_steps, 1, "e.g. save_every_steps=50.")
        self.keep = check_int("keep", keep, 1, "e.g. keep=2.")
        if dynamic_batching is not None:
            from tf_hetbatch.training.callback import DynamicBatching

            if not isinstance(dynamic_batching, DynamicBatching):
                raise TypeError(
                    "`dynamic_batching` must be the tf_hetbatch.DynamicBatching callback of "
                    f"the same fit, or None. Received: {type(dynamic_batching).__name__}. Fix: "
                    "pass the DynamicBatching instance you give to fit(callbacks=[...]).")
        if on_notice not in _ON_NOTICE:
            raise ValueError(f"`on_notice` must be one of {_ON_NOTICE}. Received: "
                             f"on_notice={on_notice!r}. Fix: on_notice='exit' (the default).")
        self.dynamic_batching = dynamic_batching
        self.on_notice = on_notice
        # Set by restore(): the position resumed from, or {} (restored, none found); None
        # until restore() ran.
        self.restored: Optional[Dict[str, Any]] = None
        # The step saved at on a preemption notice, or None.
        self.preempted_at: Optional[int] = None
        self._resume_epoch: Optional[int] = None
        self._resume_batch = 0
        self._wrote = False
        self._store: Optional[_run.RunCheckpoint] = None
        self._store_model = None
        self._notice: Optional[PreemptionNotice] = None
        self._pending_request = False
        self._fits = 0
        # Per-fit state.
        self._strategy = None
        self._step = 0
        self._epoch = 0
        self._batches = 0
        self._first_epoch = True
        self._shortened_epoch = False
        self._resume_skipped = 0
        self._iterations_at_begin: Optional[int] = None

    # ------------------------------------------------------------------ public ------------
    def latest(self) -> Optional[Dict[str, Any]]:
        """The position saved in the checkpoint `restore` would resume from, or None.

        That is the newest checkpoint that can be read; one that cannot is skipped with a
        WARNING (see `restore`). It reads the checkpoint whole.

        Returns:
            A dict with "step", "epoch", "batch" (batches of that epoch done), "batch_sizes",
            "num_parts" (replicas), "dynamic_batching" and "path" (the checkpoint, a
            `tf.train.Checkpoint` path; for the earlier format, its directory).

        Raises:
            ValueError: no checkpoint can be read, or the newest readable one is foreign.
        """
        chosen = _choice.newest(self.directory, _TRAINER)
        if chosen is None:
            return None
        checkpoint, position = chosen
        return dict(position.to_dict(), path=checkpoint.path)

    def request_preemption(self) -> None:
        """Asks for what a SIGTERM does: every worker saves at a step soon and exits.

        Call it on any one worker, from any thread, while (or before) `fit` runs. The save
        and exit happen as described in the class docs (`on_notice`).
        """
        if self._notice is not None:
            self._notice.request()
        else:
            self._pending_request = True

    def restore(self, model: keras.Model) -> int:
        """Restores the newest readable checkpoint into `model` and its strategy; before `fit`.

        Call it on every worker, at the same point (it runs collectives). With no checkpoint
        in `directory`, it changes nothing and returns 0. A checkpoint that cannot be read
        (a data file cut short, an index file lost, a checksum that does not match) is
        skipped with one WARNING naming it and why, and the newest one that every worker can
        read is restored; the model is restored only from a checkpoint read whole first.

        Args:
            model: the compiled model, created under a tf_hetbatch strategy, and built (an
                `Input` layer, or `model.build(shape)`), as when the checkpoint was written.

        Returns:
            The epoch to resume at: pass it as `model.fit(..., initial_epoch=...)`.

        Raises:
            ValueError: the model is not under a synchronous tf_hetbatch strategy; it is not
                built; the checkpoint does not match the model; the workers found different
                checkpoints (`directory` not shared); none of the checkpoints can be read
                (the message names the directory, each checkpoint tried and why, and what to
                do); a foreign checkpoint.
        """
        strategy = hetero_strategy_of(model, "ResumableCheckpoint", synchronous=True)
        # None until this restore succeeds: a fit after a failed one refuses to start afresh.
        self.restored, self._resume_epoch, self._resume_batch = None, None, 0
        self._wrote = False
        found = _choice.find(self.directory)
        _check_same_on_all_workers(strategy, found, self.directory)
        if not found:
            self.restored = {}
            return 0
        if not model.built:
            raise ValueError(
                f"`model` must be built before restore() can load its weights. Received an "
                f"unbuilt {type(model).__name__}. Fix: start the model with keras.Input(...), "
                "or call model.build(input_shape) before restore().")
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            with strategy.scope():
                optimizer.build(model.trainable_variables)
        checkpoint, position = _choice.choose(found, self.directory, _TRAINER,
                                              agree=_agreement(strategy))
        checkpoint.restore(self._store_for(model), log=strategy.is_chief)
        strategy.resume_at(position.step, skip_batches=position.batch)
        self._restore_split(strategy, position, checkpoint.name)
        self.restored = position.to_dict()
        self._resume_epoch, self._resume_batch = position.epoch, position.batch
        if strategy.is_chief:
            logger.info("Resumed from %s: step %d, epoch %d after %d of its batches.",
                        checkpoint.path, position.step, position.epoch, position.batch)
        return position.epoch

    # ------------------------------------------------------------------ Keras hooks -------
    def on_train_begin(self, logs=None):
        strategy = hetero_strategy_of(self.model, "ResumableCheckpoint", synchronous=True)
        self._strategy = strategy
        self._steps = StepCounter(strategy)
        if self.restored is None and not self._wrote and _choice.find(self.directory):
            raise ValueError(
                f"`directory` {self.directory!r} already holds a checkpoint, but restore() was "
                "not called before fit, so training would start afresh and overwrite it. Fix: "
                "`initial_epoch = ckpt.restore(model)` then `model.fit(..., "
                "initial_epoch=initial_epoch)`, or use a new directory to start afresh.")
        if self._resume_batch and self.params.get("steps") is None:
            raise ValueError(
                "Resuming mid-epoch needs data whose number of batches is known, else Keras "
                "would shorten every later epoch to the resumed one. Received data of unknown "
                "cardinality. Fix: dataset = dataset.apply("
                "tf.data.experimental.assert_cardinality(num_batches)).")
        if self._resume_epoch and strategy.training_data_reshuffles() and strategy.is_chief:
            logger.warning(
                "Resuming at epoch %d on data that reshuffles each epoch "
                "(`shuffle(..., reshuffle_each_iteration=True)`, tf.data's default): a new "
                "process draws the orders from the start of the shuffle's sequence, so the "
                "resumed epochs train in other orders than the interrupted run would have (each "
                "is still one pass over the data), and the result differs from an uninterrupted "
                "run's. Fix: for an exact resume, shuffle with reshuffle_each_iteration=False "
                "(the same order every epoch).",
                self._resume_epoch)
        self._store_for(self.model)
        self._step = strategy.steps_trained
        self._first_epoch = True
        self._shortened_epoch = False
        self._iterations_at_begin = _iterations(self.model)
        self.preempted_at = None
        self._start_notice(strategy)

    def on_train_end(self, logs=None):
        if self._notice is not None:
            if self._notice.requested and self.preempted_at is None and \
                    self._strategy.is_chief:
                logger.info("Training ended before the preemption notice's step; the "
                            "checkpoint of its end is complete.")
            self._close_notice()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._batches = 0
        if self._first_epoch and self._resume_epoch is not None:
            if epoch != self._resume_epoch:
                self._close_notice()
                raise ValueError(
                    f"fit started at epoch {epoch} but the checkpoint resumes epoch "
                    f"{self._resume_epoch}. Fix: pass initial_epoch=ckpt.restore(model) to "
                    "fit.")
            self._batches = self._resume_skipped = self._resume_batch
            self._shortened_epoch = self._resume_batch > 0
        self._first_epoch = False
        self._resume_epoch, self._resume_batch = None, 0

    def on_train_batch_end(self, batch, logs=None):
        steps = self._steps()  # > 1 with steps_per_execution
        previous, self._step = self._step, self._step + steps
        self._batches += steps
        if self._notice is not None and self._notice.due(self._step):
            self._save_on_notice()
            return
        # Every `save_every_steps` steps, at the first execution boundary at or after them.
        due = self._step // self.save_every_steps > previous // self.save_every_steps
        if due and not self._epoch_complete():
            self._save(self._epoch, self._batches)

    def on_epoch_end(self, epoch, logs=None):
        if self._shortened_epoch:
            self._shortened_epoch = False
            keras_fit.undo_iteration_of_exhausted_step(
                self.model, self._iterations_at_begin, self._batches - self._resume_skipped)
        if self._epoch_complete():
            self._save(epoch + 1, 0)
        else:  # stopped early (stop_training): resume inside this epoch
            self._save(epoch, self._batches)

    # ------------------------------------------------------------------ internals ---------
    def _store_for(self, model) -> _run.RunCheckpoint:
        if self._store is None or self._store_model is not model:
            self._store = _run.RunCheckpoint(self.directory, model, model.optimizer, self.keep)
            self._store_model = model
        return self._store

    def _start_notice(self, strategy):
        self._close_notice()
        self._fits += 1
        self._notice = PreemptionNotice(
            strategy.cluster_resolver,
            key=f"tf_hetbatch/preemption/{self.directory}/{self._fits}")
        # Keras calls `on_train_end` only when `fit` returns: a `fit` that raised leaves the
        # notice started, so the handler asks whether that `fit` is still on the stack.
        self._notice.start(alive=_running(_fit_code(self.model)))
        if self._pending_request:
            self._pending_request = False
            self._notice.request()

    def _close_notice(self):
        if self._notice is not None:
            self._notice.close()
            self._notice = None

    def _save_on_notice(self):
        if self._epoch_complete():  # the epoch's last step: the checkpoint of its end
            self._save(self._epoch + 1, 0)
        else:
            self._save(self._epoch, self._batches)
        self.preempted_at = int(self._step)
        seconds = self._notice.seconds_since_notice
        if self._strategy.is_chief:
            logger.info("Saved step %d on the preemption notice%s; %s.", self._step,
                        "" if seconds is None else f" ({seconds:.2f} s after it here)",
                        f"exiting with code {RESTART_EXIT_CODE} (restart me)"
                        if self.on_notice == "exit" else "stopping training")
        if self.on_notice == "exit":
            self._close_notice()
            raise SystemExit(RESTART_EXIT_CODE)
        self.model.stop_training = True

    def _epoch_complete(self) -> bool:
        steps = self.params.get("steps") if self.params else None
        return steps is None or self._batches >= steps

    def _restore_split(self, strategy, position: _run.RunPosition, where):
        sizes, keep_state = _run.resume_split(
            position.batch_sizes, position.num_parts, strategy.num_parts, None, where,
            log=strategy.is_chief)
        if sizes is not None:
            strategy.set_batch_sizes(sizes)  # a collective in multi-worker training
        state = position.dynamic_batching
        if keep_state and self.dynamic_batching is not None and state is not None:
            self.dynamic_batching.set_state(state)
        if keep_state:
            self._restore_limits(strategy, position.micro_batch_limits, where)

    @staticmethod
    def _restore_limits(strategy, saved, where):
        """Memory bounds a step out of memory lowered before the checkpoint stay lowered."""
        current = strategy.micro_batch_limits
        limits = _micro_batches.resumed_limits(current, saved)
        if limits != current:
            strategy.set_micro_batch_limits(limits)  # the same on every worker
            if strategy.is_chief:
                logger.info("Resumed from %s with the micro-batch bounds it saved: %s (set: "
                            "%s).", where, list(limits), list(current))

    def _save(self, epoch: int, batch: int) -> None:
        strategy = self._strategy
        strategy.check_input_agreement()  # never a checkpoint of steps on different batches
        if not strategy.is_chief:
            return
        sizes = strategy.batch_sizes
        position = _run.RunPosition(
            trainer=_TRAINER, step=int(self._step), epoch=int(epoch), batch=int(batch),
            num_parts=int(strategy.num_parts),
            batch_sizes=None if sizes is None else tuple(int(s) for s in sizes),
            dynamic_batching=None if self.dynamic_batching is None
            else self.dynamic_batching.get_state(),
            micro_batch_limits=strategy.micro_batch_limits)
        path = self._store_for(self.model).save(position)
        self._wrote = True
        logger.debug("Checkpoint %s written.", path)


# ---------------------------------------------------------------------- helpers ----------
def _iterations(model) -> Optional[int]:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return None
    return int(optimizer.iterations.numpy())


def _check_same_on_all_workers(strategy, found, directory: str) -> None:
    """One collective: every worker must have found the same checkpoints."""
    newest = found[0].step if found else -1
    names = zlib.crc32("\n".join(f.name for f in found).encode("utf-8"))
    local = np.tile([float(newest), float(names)], (strategy.num_local_replicas, 1))
    rows = np.asarray(strategy.gather_replica_values(local))
    if not np.all(rows == rows[0]):
        steps = sorted({int(s) for s in rows[:, 0]})
        raise ValueError(
            f"The workers found different checkpoints in {directory!r} (newest steps {steps}; "
            "-1: none). Fix: put `directory` on storage every worker sees (a shared file "
            "system), and call restore() on every worker before fit.")


def _agreement(strategy):
    """How the workers agree on the checkpoint to resume from: one collective a candidate.

    Every worker reads each candidate itself (it restores its own copy of the model from
    it), and every worker must take the same one. A shared directory shows every worker the
    same files, but not necessarily the same reads: a network file system or a bucket can
    fail one worker's read and not another's (a timeout, a stale cache). So no worker decides
    alone: for each candidate, newest first, all workers gather their statuses, and the
    candidate is taken only if every worker read it whole (`checkpoint_choice.choose`); the
    worst status of any worker is everyone's. The skip is logged once: by the chief if it
    could not read the checkpoint either, else by each worker that could not.
    """
    def agree(status: int) -> Tuple[int, bool]:
        local = np.tile([float(status), float(strategy.is_chief)],
                        (strategy.num_local_replicas, 1))
        rows = np.asarray(strategy.gather_replica_values(local))
        chief_status = int(rows[rows[:, 1] == 1, 0].max(initial=_choice.OK))
        log = status != _choice.OK and (strategy.is_chief or chief_status == _choice.OK)
        return int(rows[:, 0].max()), log

    return agree


def _fit_code(model):
    """The code object of `model.fit` (under its decorators), if a call of it is on this
    thread's stack now (the callback runs inside it); else None."""
    fit = getattr(type(model), "fit", None)
    if fit is None:
        return None
    code = inspect.unwrap(fit).__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return None if frame is None else code


def _running(code):
    """A test of a signal handler's frame: whether a call of `code` is on the stack (None:
    nothing to test)."""
    if code is None:
        return None

    def alive(frame) -> bool:
        while frame is not None:
            if frame.f_code is code:
                return True
            frame = frame.f_back
        return False
    return alive

