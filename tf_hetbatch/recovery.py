"""ResumableCheckpoint: multi-worker-safe checkpoints and mid-epoch resume for Keras `fit`.

Stock `keras.callbacks.BackupAndRestore` is not multi-worker aware (every worker writes the same
files) and resumes at epoch granularity. This callback writes from the chief only, atomically,
and resumes at the global step of the checkpoint: the interrupted epoch's already-trained global
batches are dropped by the strategy's input pipeline (`strategy.resume_at`), so only the work
since the last checkpoint is redone.

Layout of `directory` (shared by all workers: every worker reads it when resuming):

    checkpoint.json                      the pointer: names the newest complete checkpoint;
                                         written last, atomically (temp file + os.replace)
    step-000000120.epoch-0003.batch-00020/
        variables.npz                    model.weights then model.optimizer.variables
        meta.json                        step, epoch, batches done in it, the split, ...
    .tmp-*                               a write in progress (or interrupted): ignored

A checkpoint directory is written under a temporary name and renamed when complete; the pointer
is updated after that, so a reader that goes through the pointer never sees a partial
checkpoint, and a directory the pointer does not name is never loaded.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional, Union

import keras
import numpy as np

from tf_hetbatch import _compat
from tf_hetbatch.strategy import StepCounter, hetero_strategy_of
from tf_hetbatch import split as _split

logger = logging.getLogger(__name__)

__all__ = ["ResumableCheckpoint"]

POINTER = "checkpoint.json"
META = "meta.json"
VARIABLES = "variables.npz"
_FORMAT = "tf_hetbatch.ResumableCheckpoint/1"
_PREFIX = "step-"
_TMP_PREFIX = ".tmp-"


class ResumableCheckpoint(keras.callbacks.Callback):
    """Checkpoints a multi-worker (or one-host) tf_hetbatch run and resumes it mid-epoch.

    Use it with a model created under a tf_hetbatch strategy. Call `restore(model)` on every
    worker before `fit` and pass what it returns as `fit(initial_epoch=...)`:

        ckpt = hb.ResumableCheckpoint("/shared/run1/ckpt", save_every_steps=100)
        initial_epoch = ckpt.restore(model)      # 0 if there is no checkpoint yet
        model.fit(ds, epochs=10, initial_epoch=initial_epoch, callbacks=[ckpt])

    Saving (chief only; `strategy.is_chief`): every `save_every_steps` global steps
    (`strategy.steps_trained`) and at the end of each epoch, the values of `model.weights` and
    `model.optimizer.variables` (metric variables are not saved) go to `variables.npz`; the
    global step, the epoch, the batches done in it, the split last set (`strategy.batch_sizes`),
    the replica count and `dynamic_batching.get_state()` go to `meta.json`. The decision to save
    depends only on the step count, so every worker takes it at the same step; saving needs no
    collective (the chief reads its local copies of the mirrored variables). The newest `keep`
    checkpoints are kept.

    Resuming (`restore`, on every worker, before `fit`): every worker loads the checkpoint
    named by the pointer file and checks with one collective that all workers loaded the same
    one; restores weights and optimizer variables (building the optimizer first); calls
    `strategy.resume_at(step, skip_batches=batches done in the epoch)` so the first epoch of the
    next `fit` skips the global batches already trained; and restores the split. With the same
    replica count as when saved, the saved split (`strategy.set_batch_sizes`) and the
    `dynamic_batching` state (`set_state`); with another count (e.g. relaunched on fewer
    workers after a preemption), the global batch is split evenly over the new replicas and
    `dynamic_batching` starts afresh.

    Requirements, all checked where possible:
    - `directory` is on storage all workers see (a shared file system or bucket mount).
    - The data gives the same global batches in the same order in every run: no shuffle, or a
      seeded one (`shuffle(..., seed=s)`), as for the stock DATA auto-shard policy. Only then
      does skipping the trained batches resume the exact sequence.
    - The data's number of batches is known (`dataset.cardinality()`, as for
      `tf.data.Dataset.from_tensor_slices(...).batch(B)`), so Keras keeps the epoch length
      after a shortened first epoch; otherwise add
      `dataset.apply(tf.data.experimental.assert_cardinality(n))`. Keras warns "Your input ran
      out of data" at the end of the resumed (shortened) epoch; that is expected.
    - `fit(initial_epoch=restore(model))`: a fit that starts at another epoch is an error.
    - A `fit` whose directory already holds a checkpoint must be preceded by `restore`
      (use a new directory to start afresh): an error otherwise, so nothing is overwritten.

    Not restored: metric state (the epoch's metrics after a resume cover the resumed steps
    only) and other callbacks' state. Resuming redoes at most `save_every_steps - 1` steps.

    Args:
        directory: str or path-like, where checkpoints go; created if missing.
        save_every_steps: int >= 1, save every this many global steps. Default 50.
        keep: int >= 1, how many of the newest checkpoints to keep. Default 2.
        dynamic_batching: optional `tf_hetbatch.DynamicBatching` of the same `fit`, whose
            state is saved and restored with the checkpoint.

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
    ) -> None:
        super().__init__()
        if isinstance(directory, bool) or not isinstance(directory, (str, os.PathLike)) \
                or not os.fspath(directory):
            raise ValueError(
                "`directory` must be a non-empty path on storage every worker sees, e.g. "
                f"'/shared/run1/ckpt'. Received: directory={directory!r}")
        self.directory = os.fspath(directory)
        self.save_every_steps = _check_int(
            "save_every_steps", save_every_steps, "e.g. save_every_steps=50")
        self.keep = _check_int("keep", keep, "e.g. keep=2")
        if dynamic_batching is not None:
            from tf_hetbatch.callback import DynamicBatching

            if not isinstance(dynamic_batching, DynamicBatching):
                raise TypeError(
                    "`dynamic_batching` must be the tf_hetbatch.DynamicBatching callback of "
                    f"the same fit, or None. Received: {type(dynamic_batching).__name__}. Fix: "
                    "pass the DynamicBatching instance you give to fit(callbacks=[...]).")
        self.dynamic_batching = dynamic_batching
        # Set by restore(): the meta of the checkpoint resumed from, or {} (restored, none
        # found); None until restore() ran.
        self.restored: Optional[Dict[str, Any]] = None
        self._resume_epoch: Optional[int] = None
        self._resume_batch = 0
        self._wrote = False
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
        """The meta dict of the newest complete checkpoint (the pointer's), or None.

        Raises:
            ValueError: the pointer names a checkpoint that is missing or unreadable.
        """
        return _read_latest(self.directory)[1]

    def restore(self, model: keras.Model) -> int:
        """Restores the newest checkpoint into `model` and its strategy; call before `fit`.

        Call it on every worker, at the same point (it runs collectives). With no checkpoint
        in `directory`, it changes nothing and returns 0.

        Args:
            model: the compiled model, created under a tf_hetbatch strategy, and built (an
                `Input` layer, or `model.build(shape)`), as when the checkpoint was written.

        Returns:
            The epoch to resume at: pass it as `model.fit(..., initial_epoch=...)`.

        Raises:
            TypeError: the model is not under a tf_hetbatch strategy.
            ValueError: the model is not built; the checkpoint does not match the model; the
                workers found different checkpoints (`directory` not shared); a broken pointer.
        """
        strategy = hetero_strategy_of(model, "ResumableCheckpoint")
        name, meta = _read_latest(self.directory)
        _check_same_on_all_workers(strategy, -1 if meta is None else int(meta["step"]),
                                   self.directory)
        self._wrote = False
        if meta is None:
            self.restored = {}
            self._resume_epoch = None
            self._resume_batch = 0
            return 0
        if not model.built:
            raise ValueError(
                f"`model` must be built before restore() can load its weights. Received an "
                f"unbuilt {type(model).__name__}. Fix: start the model with keras.Input(...), "
                "or call model.build(input_shape) before restore().")
        with np.load(os.path.join(self.directory, name, VARIABLES)) as data:
            weights = [data[f"w{i}"] for i in range(meta["num_weights"])]
            opt_values = [data[f"o{i}"] for i in range(meta["num_optimizer_variables"])]
        _assign(_model_variables(model), weights, "model.weights", name)
        if opt_values:
            optimizer = model.optimizer
            if optimizer is None:
                raise ValueError(
                    f"The checkpoint {name} holds optimizer variables but the model has no "
                    "optimizer. Fix: compile the model as when the checkpoint was written, "
                    "before restore().")
            if not optimizer.built:
                with strategy.scope():
                    optimizer.build(model.trainable_variables)
            _assign(_optimizer_variables(model), opt_values, "model.optimizer.variables", name)
        step, epoch, batch = int(meta["step"]), int(meta["epoch"]), int(meta["batch"])
        strategy.resume_at(step, skip_batches=batch)
        self._restore_split(strategy, meta, name)
        self.restored = meta
        self._resume_epoch, self._resume_batch = epoch, batch
        if strategy.is_chief:
            logger.info("Resumed from %s: step %d, epoch %d after %d of its batches.",
                        os.path.join(self.directory, name), step, epoch, batch)
        return epoch

    # ------------------------------------------------------------------ Keras hooks -------
    def on_train_begin(self, logs=None):
        strategy = hetero_strategy_of(self.model, "ResumableCheckpoint")
        self._strategy = strategy
        self._steps = StepCounter(strategy)
        if self.restored is None and not self._wrote and os.path.exists(
                os.path.join(self.directory, POINTER)):
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
        self._step = strategy.steps_trained
        self._first_epoch = True
        self._shortened_epoch = False
        self._iterations_at_begin = _iterations(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._batches = 0
        if self._first_epoch and self._resume_epoch is not None:
            if epoch != self._resume_epoch:
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
        # Every `save_every_steps` steps, at the first execution boundary at or after them.
        due = self._step // self.save_every_steps > previous // self.save_every_steps
        if due and not self._epoch_complete():
            self._save(self._epoch, self._batches)

    def on_epoch_end(self, epoch, logs=None):
        if self._shortened_epoch:
            self._shortened_epoch = False
            _compat.undo_iteration_of_exhausted_step(
                self.model, self._iterations_at_begin, self._batches - self._resume_skipped)
        if self._epoch_complete():
            self._save(epoch + 1, 0)
        else:  # stopped early (stop_training): resume inside this epoch
            self._save(epoch, self._batches)

    # ------------------------------------------------------------------ internals ---------
    def _epoch_complete(self) -> bool:
        steps = self.params.get("steps") if self.params else None
        return steps is None or self._batches >= steps

    def _restore_split(self, strategy, meta, name):
        saved = meta.get("batch_sizes")
        num = strategy.num_replicas_in_sync
        state = meta.get("dynamic_batching")
        if int(meta["num_replicas"]) == num:
            if saved is not None:
                strategy.set_batch_sizes(saved)  # a collective in multi-worker training
            if self.dynamic_batching is not None and state is not None:
                self.dynamic_batching.set_state(state)
            return
        if saved is None:
            return  # the even split of the data's global batch, as for a fresh start
        sizes = _split.split_evenly(sum(saved), num)
        strategy.set_batch_sizes(sizes)  # a collective in multi-worker training
        if strategy.is_chief:
            logger.warning(
                "Checkpoint %s was written with %d replicas (split %s); resuming with %d: the "
                "global batch %d is split evenly as %s%s.", name, meta["num_replicas"],
                saved, num, sum(saved), list(sizes),
                " and DynamicBatching starts afresh" if self.dynamic_batching else "")

    def _save(self, epoch: int, batch: int) -> None:
        strategy = self._strategy
        strategy.check_input_agreement()  # never a checkpoint of steps on different batches
        if not strategy.is_chief:
            return
        sizes = strategy.batch_sizes
        opt_values = [np.asarray(v.numpy()) for v in _optimizer_variables(self.model)]
        meta = {
            "format": _FORMAT,
            "step": int(self._step),
            "epoch": int(epoch),
            "batch": int(batch),
            "batch_sizes": None if sizes is None else [int(s) for s in sizes],
            "num_replicas": int(strategy.num_replicas_in_sync),
            "num_weights": 0,
            "num_optimizer_variables": len(opt_values),
            "dynamic_batching": None if self.dynamic_batching is None
            else self.dynamic_batching.get_state(),
        }
        weights = [np.asarray(v.numpy()) for v in _model_variables(self.model)]
        meta["num_weights"] = len(weights)
        arrays = {f"w{i}": w for i, w in enumerate(weights)}
        arrays.update({f"o{i}": o for i, o in enumerate(opt_values)})
        name = write_checkpoint(self.directory, meta, arrays)
        self._wrote = True
        prune(self.directory, self.keep, protect=name)
        logger.debug("Checkpoint %s written.", name)


# ---------------------------------------------------------------------- files ------------
def checkpoint_name(step: int, epoch: int, batch: int) -> str:
    """The directory name of a checkpoint: sorts by step, then epoch (zero padded)."""
    return f"{_PREFIX}{step:09d}.epoch-{epoch:04d}.batch-{batch:05d}"


def write_checkpoint(directory: str, meta: Dict[str, Any], arrays: Dict[str, np.ndarray]) -> str:
    """Writes one checkpoint atomically and points the pointer file at it; returns its name.

    The files go into a temporary directory, which is renamed to its final name once complete
    (an older directory of that name, from a run that was interrupted before its pointer
    update, is replaced); then the pointer is replaced atomically.
    """
    os.makedirs(directory, exist_ok=True)
    name = checkpoint_name(meta["step"], meta["epoch"], meta["batch"])
    tmp = tempfile.mkdtemp(prefix=_TMP_PREFIX + name + ".", dir=directory)
    try:
        with open(os.path.join(tmp, VARIABLES), "wb") as f:
            np.savez(f, **arrays)
            _flush(f)
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f, indent=1)
            _flush(f)
        _fsync_dir(tmp)
        final = os.path.join(directory, name)
        if os.path.exists(final):  # left by an interrupted run; never the pointer's target
            trash = tempfile.mkdtemp(prefix=_TMP_PREFIX + "old.", dir=directory)
            os.rename(final, os.path.join(trash, name))
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_pointer(directory, {"format": _FORMAT, "latest": name, "step": meta["step"]})
    return name


def _write_pointer(directory: str, pointer: Dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX + "pointer.", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(pointer, f)
            _flush(f)
        os.replace(tmp, os.path.join(directory, POINTER))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


def list_checkpoints(directory: str) -> List[str]:
    """Names of the complete checkpoint directories (renamed into place), oldest first."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        n for n in os.listdir(directory)
        if n.startswith(_PREFIX) and os.path.isfile(os.path.join(directory, n, META))
    )


def prune(directory: str, keep: int, protect: Optional[str] = None) -> None:
    """Deletes all but the newest `keep` checkpoints (never `protect`) and stale temp dirs."""
    names = [n for n in list_checkpoints(directory) if n != protect]
    budget = keep - (1 if protect else 0)
    doomed = names[: max(len(names) - budget, 0)]
    for n in doomed:
        shutil.rmtree(os.path.join(directory, n), ignore_errors=True)
    for n in os.listdir(directory):  # writes of this process finished; others are leftovers
        if n.startswith(_TMP_PREFIX):
            path = os.path.join(directory, n)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.remove(path)
                except OSError:
                    pass


def _read_latest(directory: str):
    """(name, meta) of the pointer's checkpoint, or (None, None) if there is no pointer."""
    path = os.path.join(directory, POINTER)
    try:
        with open(path) as f:
            pointer = json.load(f)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        raise ValueError(f"The checkpoint pointer {path} is unreadable ({e}). Fix: delete it "
                         "to use the newest complete checkpoint directory's files by hand, or "
                         "start in a new directory.") from e
    name = pointer.get("latest") if isinstance(pointer, dict) else None
    meta_path = os.path.join(directory, str(name), META)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"The checkpoint pointer {path} names {name!r}, whose {META} is "
                         f"missing or unreadable ({e}). Fix: restore that checkpoint "
                         "directory, or start in a new directory.") from e
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{meta_path} is not a {_FORMAT} checkpoint. Received: "
                         f"format={meta.get('format')!r}.")
    return name, meta


def _flush(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- variables --------
def _model_variables(model) -> list:
    return [v for v in model.weights if getattr(v, "synchronization", None) != "on_read"]


def _optimizer_variables(model) -> list:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return []
    return [v for v in optimizer.variables if getattr(v, "synchronization", None) != "on_read"]


def _assign(variables, values, what, name) -> None:
    if len(variables) != len(values):
        raise ValueError(
            f"The checkpoint {name} holds {len(values)} values for {what} but the model has "
            f"{len(variables)}. Fix: build and compile the model as when the checkpoint was "
            "written.")
    for v, value in zip(variables, values):
        if tuple(v.shape) != tuple(value.shape):
            raise ValueError(
                f"The checkpoint {name} holds shape {tuple(value.shape)} for {what} variable "
                f"{v.path!r} of shape {tuple(v.shape)}. Fix: build the model as when the "
                "checkpoint was written.")
    for v, value in zip(variables, values):
        v.assign(value)  # cross-replica context: every local copy; no collective


def _iterations(model) -> Optional[int]:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return None
    return int(optimizer.iterations.numpy())


# ---------------------------------------------------------------------- helpers ----------
def _check_int(name: str, value, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}. "
                         f"Fix: {example}.")
    return int(value)


def _check_same_on_all_workers(strategy, step: int, directory: str) -> None:
    """One collective: every worker must have found the same checkpoint step."""
    local = np.full(strategy._num_local_replicas(), float(step))
    steps = np.asarray(strategy.gather_replica_values(local))
    if not np.all(steps == steps[0]):
        found = sorted({int(s) for s in steps})
        raise ValueError(
            f"The workers found different checkpoints in {directory!r} (steps {found}; -1: "
            "none). Fix: put `directory` on storage every worker sees (a shared file system), "
            "and call restore() on every worker before fit.")
