"""The checkpoint of a training run: model, optimizer and the run's position, in ONE TensorFlow
checkpoint. The one mechanism under `ResumableCheckpoint` (Keras `fit`) and `AsyncTrainer`.

Built on `tf.train.Checkpoint` and `tf.train.CheckpointManager`, so every file goes through
`tf.io.gfile`: any TensorFlow file system works (a local or shared path, `gs://`, `s3://` with
tensorflow-io, `ram://`), and the files are ordinary TensorFlow checkpoints:

    checkpoint                       CheckpointManager's state file: the newest checkpoints,
                                     replaced atomically after a checkpoint's files are written
    ckpt-<step>.index                one checkpoint per saved global step
    ckpt-<step>.data-00000-of-00001

The checkpoint's root has three children: `model` (the Keras model), `optimizer` and
`tf_hetbatch`, a `tf.train.experimental.PythonState` holding the run's position as JSON
(format, global step, epoch, batches done in it, the split, its replica count, controller
state). So the position is written in the same files as the weights, and a reader that goes
through the state file (`tf.train.latest_checkpoint`) sees either the whole checkpoint or the
previous one. A plain Keras process restores the weights with
`tf.train.Checkpoint(model=model).restore(path).expect_partial()`.
"""

import json
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_hetbatch.core import split as _split

logger = logging.getLogger(__name__)

STATE_FORMAT = "tf_hetbatch.run/2"
STATE_CHILD = "tf_hetbatch"
CHECKPOINT_NAME = "ckpt"


class _RunState(tf.train.experimental.PythonState):
    """The run's position as JSON, saved and restored with the checkpoint it belongs to."""

    def __init__(self):
        self.value: Optional[Dict[str, Any]] = None

    def serialize(self):
        return json.dumps(self.value or {}, sort_keys=True)

    def deserialize(self, string_value):
        if isinstance(string_value, bytes):
            string_value = string_value.decode("utf-8")
        self.value = json.loads(string_value) if string_value else {}


def latest(directory: str) -> Optional[Tuple[str, Dict[str, Any]]]:
    """(path, position) of the newest complete checkpoint in `directory`, or None.

    Raises:
        ValueError: the newest checkpoint is unreadable or not a tf_hetbatch run checkpoint.
    """
    state = tf.train.get_checkpoint_state(directory)
    if state is None or not state.model_checkpoint_path:
        return None
    path = state.model_checkpoint_path
    if not os.path.isabs(path) and "://" not in path:
        path = os.path.join(directory, path)
    if not tf.io.gfile.exists(path + ".index"):
        present = [p for p in state.all_model_checkpoint_paths
                   if tf.io.gfile.exists(os.path.join(directory, os.path.basename(p)) + ".index")]
        raise ValueError(
            f"The newest checkpoint that {os.path.join(directory, 'checkpoint')} names, {path}, "
            "is missing, so the run cannot resume from it (and starting afresh would overwrite "
            "the directory). Fix: restore its files, or name an older complete checkpoint in "
            f"that file (present: {present or 'none'}), or start in a new directory.")
    return path, read_state(path)


def read_state(path: str) -> Dict[str, Any]:
    """The position saved in the checkpoint at `path` (a prefix such as `.../ckpt-120`).

    Raises:
        ValueError: the checkpoint is unreadable or holds no tf_hetbatch position.
    """
    state = _RunState()
    try:
        tf.train.Checkpoint(**{STATE_CHILD: state}).restore(path).expect_partial()
    except (tf.errors.OpError, ValueError) as error:
        raise ValueError(
            f"The checkpoint {path} is unreadable ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200]}). Fix: restore its files, or point the "
            "directory's `checkpoint` file at an older complete checkpoint, or start in a new "
            "directory.") from error
    return _checked(state.value, path)


def _checked(value, path):
    if not isinstance(value, dict) or value.get("format") != STATE_FORMAT:
        raise ValueError(
            f"The checkpoint {path} holds no tf_hetbatch run position (format "
            f"{STATE_FORMAT!r}): it was not written by ResumableCheckpoint or AsyncTrainer of "
            "this version. Received: "
            f"{None if not isinstance(value, dict) else value.get('format')!r}. Fix: use a new "
            "directory for this run, and restore that checkpoint with "
            "tf.train.Checkpoint(model=model).restore(path) if you need its weights.")
    return value


class RunCheckpoint:
    """Saves and restores one run's checkpoints in `directory`.

    Args:
        directory: where the checkpoints go (any `tf.io.gfile` path); created on first save.
        model: the Keras model, saved as the root's `model` child.
        optimizer: its optimizer (the root's `optimizer` child), or None.
        keep: how many of the newest checkpoints to keep (`max_to_keep`).
    """

    def __init__(self, directory: str, model, optimizer=None, keep: int = 2):
        self.directory = directory
        self._state = _RunState()
        children = {"model": model, STATE_CHILD: self._state}
        if optimizer is not None:
            children["optimizer"] = optimizer
        self._checkpoint = tf.train.Checkpoint(**children)
        self._keep = keep
        self._manager: Optional[tf.train.CheckpointManager] = None
        self._last_step: Optional[int] = None
        self._last_path: Optional[str] = None

    @property
    def latest_path(self) -> Optional[str]:
        """The newest complete checkpoint's path (as the directory's state file names it)."""
        return tf.train.latest_checkpoint(self.directory)

    def save(self, position: Dict[str, Any]) -> str:
        """Writes one checkpoint with `position` (it must hold "step"); returns its path.

        Call it on the chief only (it reads its local copies of the variables; no collective).
        A second save at the step this object last saved or restored writes nothing (the
        files of that step may be the ones the state file names) and returns that path.
        """
        step = int(position["step"])
        if step == self._last_step and self._last_path is not None:
            logger.debug("Step %d is already in %s; not saved again.", step, self._last_path)
            return self._last_path
        if self._manager is None:
            self._manager = tf.train.CheckpointManager(
                self._checkpoint, self.directory, max_to_keep=self._keep,
                checkpoint_name=CHECKPOINT_NAME)
        self._state.value = dict(position, format=STATE_FORMAT)
        path = self._manager.save(checkpoint_number=step)
        self._last_step, self._last_path = step, path
        return path

    def restore(self, path: str) -> Dict[str, Any]:
        """Restores the model, the optimizer and the position saved at `path`; returns it.

        Build the model and its optimizer first (their variables must exist).

        Raises:
            ValueError: the checkpoint does not match the model or the optimizer, or holds no
                tf_hetbatch position.
        """
        try:
            status = self._checkpoint.restore(path)
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as error:
            raise ValueError(
                f"The checkpoint {path} does not match this model and optimizer "
                f"({type(error).__name__}: {str(error).splitlines()[0][:300]}). Fix: build and "
                "compile the model as when the checkpoint was written (same layers, shapes "
                "and optimizer), or start in a new directory.") from error
        position = _checked(self._state.value, path)
        self._last_step, self._last_path = int(position["step"]), path
        return position


def resume_split(saved: Optional[Sequence[int]], saved_parts: int, num_parts: int,
                 total: Optional[int], where: str, log: bool) -> Tuple[Optional[List[int]], bool]:
    """The split to resume with: the one rule for a replica (or worker) count that changed.

    With the same number of parts and the same total as when saved, the saved split, and the
    saved controller state applies. Otherwise the total is split evenly over the new parts and
    the controller starts afresh; one INFO line says so (if `log`, i.e. on the chief).

    Args:
        saved: the split saved with the checkpoint, or None (none was set: even split).
        saved_parts: the replica (synchronous) or worker (asynchronous) count when saved.
        num_parts: the count now.
        total: what a step splits now (the global batch; asynchronous: batch size x workers),
            or None for the saved split's sum (a synchronous global batch never changes).
        where: the checkpoint's name, for the log line.
        log: whether to write the log line.

    Returns:
        (the split, or None for the even default; whether the saved controller state applies)
    """
    if saved is None:
        return None, saved_parts == num_parts
    saved = [int(s) for s in saved]
    total = sum(saved) if total is None else int(total)
    if saved_parts == num_parts and len(saved) == num_parts and sum(saved) == total:
        return saved, True
    sizes = [int(s) for s in _split.split_evenly(total, num_parts)]
    if log:
        logger.info("Checkpoint %s was written with %d parts (split %s); resuming with %d: %d "
                    "samples per step split evenly as %s, the controller starts afresh.",
                    os.path.basename(where), saved_parts, saved, num_parts, total, sizes)
    return sizes, False
