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
`tf_hetbatch`, a `tf.train.experimental.PythonState` holding the run's position
(`RunPosition`) as JSON. So the position is written in the same files as the weights, and a
reader that goes through the state file sees either the whole checkpoint or the previous one.
A plain Keras process restores the weights with
`tf.train.Checkpoint(model=model).restore(path).expect_partial()`.

Which checkpoint a run resumes from (the newest that can be read) is chosen in
`tf_hetbatch.training.checkpoint_choice`.
"""

import dataclasses
import json
import logging
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

import tf_hetbatch.distribute  # noqa: F401  (checks the TensorFlow/Keras versions first)
from tf_hetbatch.core import split as _split

logger = logging.getLogger(__name__)

STATE_FORMAT = "tf_hetbatch.run/2"
STATE_CHILD = "tf_hetbatch"
CHECKPOINT_NAME = "ckpt"
STATE_FILE = "checkpoint"  # CheckpointManager's state file
TRAINERS = {"fit": "ResumableCheckpoint in Keras fit", "async": "AsyncTrainer"}

_NUMBERED = re.compile(re.escape(CHECKPOINT_NAME) + r"-(\d+)$")


@dataclasses.dataclass(frozen=True)
class RunPosition:
    """Where a training run stands at a checkpoint: saved in it, and read back to resume.

    One record for both trainers; saved as the JSON of `to_dict` (format `STATE_FORMAT`), and
    the earlier formats' positions are read into it too (`legacy_checkpoint`).

    Attributes:
        trainer: "fit" (`ResumableCheckpoint` in Keras `fit`) or "async" (`AsyncTrainer`):
            their steps and epochs mean different things, so one never resumes the other's.
        step: global steps trained (fit), or updates applied (async).
        epoch: the epoch to resume in.
        batch: its batches (fit) or updates (async) already done.
        num_parts: replicas (fit) or workers (async) when saved; None where an earlier
            format did not say (then the split's length, else the count now).
        batch_sizes: the split when saved, or None (the even split).
        micro_batch_limits: synchronous training: the replicas' memory bounds when saved
            (including those lowered by a step out of memory), or None (none set).
        dynamic_batching: `DynamicBatching` state: fit one `get_state()` dict or None; async a
            list, one per `DynamicBatching` callback.
    """

    trainer: str
    step: int
    epoch: int
    batch: int
    num_parts: Optional[int]
    batch_sizes: Optional[Tuple[int, ...]] = None
    dynamic_batching: Any = None
    micro_batch_limits: Optional[Tuple[Optional[int], ...]] = None

    def to_dict(self) -> Dict[str, Any]:
        """The JSON-ready dict saved in the checkpoint (with "format": `STATE_FORMAT`)."""
        value = {"format": STATE_FORMAT, "trainer": self.trainer, "step": self.step,
                 "epoch": self.epoch, "batch": self.batch,
                 "batch_sizes": None if self.batch_sizes is None else list(self.batch_sizes),
                 "num_parts": self.num_parts, "dynamic_batching": self.dynamic_batching}
        if self.micro_batch_limits is not None:  # optional: absent, no bounds were set
            value["micro_batch_limits"] = list(self.micro_batch_limits)
        return value

    @classmethod
    def from_dict(cls, value: Dict[str, Any], where: str) -> "RunPosition":
        """The position of a dict of `to_dict`'s form ("format" is not checked here).

        An empty split (`[]`, as AsyncTrainer wrote when none was set) is None.

        Raises:
            ValueError: a field is missing or not a number where one is needed.
        """
        try:
            sizes = value.get("batch_sizes") or None
            sizes = None if sizes is None else tuple(int(s) for s in sizes)
            parts = value.get("num_parts") or (len(sizes) if sizes else None)
            limits = value.get("micro_batch_limits")
            limits = None if limits is None else tuple(
                None if m is None else int(m) for m in limits)
            return cls(trainer=str(value["trainer"]), step=int(value["step"]),
                       epoch=int(value["epoch"]), batch=int(value["batch"]),
                       num_parts=None if parts is None else int(parts), batch_sizes=sizes,
                       dynamic_batching=value.get("dynamic_batching"),
                       micro_batch_limits=limits)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(
                f"The checkpoint {where} holds a malformed run position ({type(error).__name__}:"
                f" {error}). Received: {str(value)[:300]}. Fix: resume from another checkpoint "
                "(delete this one), or start in a new directory.") from error


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


def listed(directory: str) -> List[Tuple[int, str]]:
    """(step, path) of the run's checkpoints in `directory`, newest first; [] if none.

    The checkpoints the state file lists (`CheckpointManager` adds one only after its files
    are written). If the state file is missing or unreadable, the `ckpt-<step>.index` files
    present instead, so a lost state file never makes a run start afresh over them. Nothing
    is read but the state file and the directory listing.
    """
    state = tf.train.get_checkpoint_state(directory)  # None if missing or unparsable
    if state is not None and state.all_model_checkpoint_paths:
        names = [os.path.basename(p) for p in state.all_model_checkpoint_paths]
    else:
        pattern = os.path.join(directory, f"{CHECKPOINT_NAME}-*.index")
        names = [os.path.basename(p)[:-len(".index")] for p in tf.io.gfile.glob(pattern)]
    numbered = []
    for name in names:
        match = _NUMBERED.match(name)
        if match:
            numbered.append((int(match.group(1)), os.path.join(directory, name)))
    return sorted(set(numbered), reverse=True)


def read_every_tensor(path: str) -> None:
    """Reads every tensor of the checkpoint at `path`, checking each one's checksum.

    Raises whatever reading raises: `tf.errors.OpError` (a missing or corrupt file, a checksum
    that does not match), `IndexError` (a data file cut short: "Read less bytes than
    requested"), ...
    """
    # NewCheckpointReader takes the prefix itself; tf.train.load_checkpoint first asks whether
    # it is a directory, which the ram:// file system answers yes for any prefix.
    reader = tf.compat.v1.train.NewCheckpointReader(path)
    for key in sorted(reader.get_variable_to_dtype_map()):
        reader.get_tensor(key)


def read_position_value(path: str) -> Dict[str, Any]:
    """The position JSON saved in the checkpoint at `path`, as a dict ({} if it holds none).

    Raises whatever reading raises (see `read_every_tensor`; `ValueError` for bad JSON).
    """
    state = _RunState()
    tf.train.Checkpoint(**{STATE_CHILD: state}).restore(path).expect_partial()
    return state.value if isinstance(state.value, dict) else {}


def check_format(value: Dict[str, Any], path: str) -> None:
    """Raises ValueError unless `value` is a position of `STATE_FORMAT`."""
    if value.get("format") != STATE_FORMAT:
        raise ValueError(
            f"The checkpoint {path} holds no tf_hetbatch run position (format "
            f"{STATE_FORMAT!r}): it was not written by ResumableCheckpoint or AsyncTrainer of "
            f"this version. Received: {value.get('format')!r}. Fix: use a new directory for "
            "this run, and restore that checkpoint with "
            "tf.train.Checkpoint(model=model).restore(path) if you need its weights.")


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
        self.model = model
        self.optimizer = optimizer
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

    def save(self, position: RunPosition) -> str:
        """Writes one checkpoint at `position.step` with `position`; returns its path.

        Call it on the chief only (it reads its local copies of the variables; no collective).
        A second save at the step this object last saved or restored writes nothing (the
        files of that step may be the ones the state file names) and returns that path.
        """
        step = int(position.step)
        if step == self._last_step and self._last_path is not None:
            logger.debug("Step %d is already in %s; not saved again.", step, self._last_path)
            return self._last_path
        if self._manager is None:
            self._manager = tf.train.CheckpointManager(
                self._checkpoint, self.directory, max_to_keep=self._keep,
                checkpoint_name=CHECKPOINT_NAME)
        self._state.value = position.to_dict()
        path = self._manager.save(checkpoint_number=step)
        self._last_step, self._last_path = step, path
        return path

    def restore(self, path: str) -> None:
        """Restores the model, the optimizer and the position saved at `path`.

        Build the model and its optimizer first (their variables must exist).

        Raises:
            ValueError: the checkpoint does not match the model or the optimizer.
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
        self._last_step, self._last_path = int(self._state.value["step"]), path


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
