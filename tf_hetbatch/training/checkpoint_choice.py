"""Which checkpoint a run resumes from: the newest one that can be read.

A checkpoint can be damaged behind the run's back: a data file cut short by a failing disk or
an interrupted copy from a bucket, an index file lost. Restoring it fails deep inside
TensorFlow ("IndexError: Read less bytes than requested") while older intact checkpoints lie
beside it. So every checkpoint of the directory is a candidate (`find`: today's TensorFlow
checkpoints and the earlier formats), newest first, and `choose` takes the newest that can be
read: each candidate is read whole first (`Found.read`: every tensor, its checksum checked,
and the position parsed). One that cannot be read is skipped with one WARNING naming it and
why; if none is left, the error names the directory, every checkpoint tried and why, and what
to do. A run never starts afresh over checkpoints it could not read.

The model is restored only from a checkpoint that was read whole, so a damaged one never
leaves a model with part of its values. (TensorFlow's restore reads the object graph first
and then every variable in one op per device; damaged files were seen to fail before any
assignment, but nothing promises that.) The price: a resumed checkpoint is read twice.

Across workers the choice is agreed (`choose(..., agree=...)`): see `ResumableCheckpoint`.
"""

import contextlib
import logging
import os
import zipfile
from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

import tf_hetbatch.distribute  # noqa: F401  (checks the TensorFlow/Keras versions first)
from tf_hetbatch.training import legacy_checkpoint as _legacy
from tf_hetbatch.training import run_checkpoint as _run
from tf_hetbatch.training.run_checkpoint import RunPosition

logger = logging.getLogger(__name__)

# A candidate's status, as `choose` and its `agree` function exchange it (ordered: the worst
# status of any worker is the cluster's).
OK, UNREADABLE, REFUSED = 0, 1, 2

# What reading a checkpoint's files raises when they are missing or damaged: TensorFlow's
# errors (a missing file, a checksum that does not match), IndexError ("Read less bytes than
# requested" for a data file cut short), and the parsers' (JSON, npz).
_READ_ERRORS = (tf.errors.OpError, OSError, IndexError, KeyError, ValueError, EOFError,
                zipfile.BadZipFile)

Agree = Callable[[int], Tuple[int, bool]]


class UnreadableCheckpoint(Exception):
    """A checkpoint's files cannot be read (missing, cut short, checksums differ, bad JSON)."""


class Found:
    """A checkpoint found in a run's directory, not read yet.

    Attributes:
        name: how messages name it (e.g. "ckpt-120").
        step: its step, for the order (newest first); -1 if unknown.
        path: what `ResumableCheckpoint.latest()` reports as "path".
    """

    rank = 0  # between checkpoints of one step, the higher rank is taken first

    def __init__(self, name: str, step: int, path: str):
        self.name, self.step, self.path = name, step, path

    def read(self) -> RunPosition:
        """Reads the whole checkpoint; returns its position. Call it before `restore`.

        Raises:
            UnreadableCheckpoint: its files cannot be read (the message says why).
            ValueError: it is readable but foreign (no tf_hetbatch position, another format).
        """
        raise NotImplementedError

    def restore(self, store: _run.RunCheckpoint, log: bool) -> None:
        """Restores what `read` proved readable into `store`'s model and optimizer.

        Raises:
            ValueError: the checkpoint does not match the model or the optimizer.
        """
        raise NotImplementedError


class _TensorFlowCheckpoint(Found):
    """`ckpt-<step>`: today's format, or AsyncTrainer's earlier one (position beside it)."""

    rank = 1

    def __init__(self, directory: str, step: int, path: str):
        super().__init__(os.path.basename(path), step, path)
        self._directory = directory
        self._earlier = False

    def read(self) -> RunPosition:
        if not tf.io.gfile.exists(self.path + ".index"):
            raise UnreadableCheckpoint(f"its index file {self.name}.index is missing")
        with _reading():
            _run.read_every_tensor(self.path)
            value = _run.read_position_value(self.path)
        if "format" not in value:  # no position inside: AsyncTrainer's earlier format?
            with _reading(f"{_legacy.ASYNC_POSITION} beside it: "):
                meta = _legacy.read_async_meta(self._directory)
            if meta is not None:
                earlier = _legacy.async_position(meta, self.path)
                if earlier is None:
                    raise UnreadableCheckpoint(
                        f"its position is unknown: {_legacy.ASYNC_POSITION} of the earlier "
                        "AsyncTrainer format describes only the newest checkpoint")
                self._earlier = True
                return RunPosition.from_dict(earlier, self.path)
        _run.check_format(value, self.path)
        return RunPosition.from_dict(value, self.path)

    def restore(self, store: _run.RunCheckpoint, log: bool) -> None:
        if not self._earlier:
            store.restore(self.path)
            return
        _legacy.restore_async(self.path, store.model, store.optimizer)
        if log:
            logger.info("Resuming from %s, a checkpoint of the earlier AsyncTrainer format "
                        "(%s beside it); new checkpoints hold their position themselves.",
                        self.path, _legacy.ASYNC_POSITION)


class _EarlierFitCheckpoint(Found):
    """The checkpoint `checkpoint.json` names, of ResumableCheckpoint's earlier format."""

    def __init__(self, directory: str):
        self._directory = directory
        self._pointer_error: Optional[str] = None
        self._values = None
        try:
            name, step = _legacy.read_pointer(directory)
        except _READ_ERRORS as error:
            name, step = _legacy.POINTER, -1
            self._pointer_error = _describe(error)
        super().__init__(name, step, name)

    def read(self) -> RunPosition:
        if self._pointer_error is not None:
            raise UnreadableCheckpoint(f"its pointer {_legacy.POINTER} is unreadable "
                                       f"({self._pointer_error})")
        with _reading(f"{_legacy.META}: "):
            meta = _legacy.read_meta(self._directory, self.name)
        _legacy.check_meta(meta, self._directory, self.name)
        with _reading(f"{_legacy.VARIABLES}: "):
            self._values = _legacy.load(self._directory, self.name, meta)
        return RunPosition.from_dict(_legacy.fit_position(meta), self.name)

    def restore(self, store: _run.RunCheckpoint, log: bool) -> None:
        weights, opt_values = self._values
        _legacy.restore_fit(store.model, weights, opt_values, self.name)
        if log:
            logger.info(
                "Resuming from %s, a checkpoint of the earlier tf_hetbatch format. New "
                "checkpoints are TensorFlow checkpoints (ckpt-<step>) in the same directory; "
                "the earlier files (%s, step-*/) are left as they are: delete them once a new "
                "checkpoint is written.", os.path.join(self._directory, self.name),
                _legacy.POINTER)


def find(directory: str) -> List[Found]:
    """The checkpoints of `directory`, newest first, unread (cheap: the state file, a listing).

    Today's TensorFlow checkpoints (`run_checkpoint.listed`) and the one the earlier format's
    pointer names.
    """
    found: List[Found] = [_TensorFlowCheckpoint(directory, step, path)
                          for step, path in _run.listed(directory)]
    if _legacy.has_pointer(directory):
        found.append(_EarlierFitCheckpoint(directory))
    return sorted(found, key=lambda f: (f.step, f.rank), reverse=True)


def choose(found: Sequence[Found], directory: str, trainer: str,
           agree: Optional[Agree] = None) -> Optional[Tuple[Found, RunPosition]]:
    """The newest of `found` that can be read (by every worker, with `agree`), and its position.

    Each candidate that cannot be read is skipped with one WARNING (logged where `agree` says).

    Args:
        found: `find(directory)`, newest first (the same list on every worker).
        directory: the run's directory, for the messages.
        trainer: "fit" or "async"; a checkpoint of the other trainer is refused.
        agree: with several workers, `agree(status) -> (status, log)`: from this worker's
            status of the candidate (`OK`, `UNREADABLE`, `REFUSED`), the worst of all
            workers, and whether this worker logs the skip; a collective, called for each
            candidate tried. None: this process decides alone.

    Returns:
        (the checkpoint, its position), or None if `found` is empty.

    Raises:
        ValueError: none can be read (the message names the directory, every checkpoint
            tried and why, and the fix); or the newest readable one is refused: another
            trainer's, not a tf_hetbatch checkpoint, a malformed position.
    """
    tried = []
    for candidate in found:
        status, reason, position, refusal = _try(candidate, trainer)
        cluster, log = (status, True) if agree is None else agree(status)
        if cluster == REFUSED:
            raise refusal or ValueError(
                f"Another worker refused the checkpoint {candidate.path} in {directory!r} "
                "(see its error). Fix: put the directory on storage every worker sees.")
        if cluster == OK:
            return candidate, position
        reason = reason or "another worker cannot read it"
        tried.append(f"{candidate.name} ({reason})")
        if log:
            logger.warning(
                "Checkpoint %s in %r cannot be read (%s): skipped; the run resumes from the "
                "newest checkpoint that can be read. Its files are left as they are: delete "
                "or repair them.", candidate.name, directory, reason)
    if tried:
        raise ValueError(
            f"No checkpoint in {directory!r} can be read, so the run cannot resume; tried, "
            f"newest first: {'; '.join(tried)}. The run does not start afresh by itself, "
            "which would write over them. Fix: restore these files from a copy if there is "
            "one; else, to start afresh, delete these checkpoints (their files, and the "
            "state file `checkpoint`) or give the run a new, empty directory.")
    return None


def newest(directory: str, trainer: str) -> Optional[Tuple[Found, RunPosition]]:
    """`choose(find(directory), ...)` in one process: the checkpoint a run would resume from."""
    return choose(find(directory), directory, trainer)


def _try(candidate: Found, trainer: str):
    """(status, why unreadable, position, refusal) of reading `candidate` here."""
    try:
        position = candidate.read()
    except UnreadableCheckpoint as error:
        return UNREADABLE, str(error), None, None
    except ValueError as error:
        return REFUSED, None, None, error
    if position.trainer != trainer:
        return REFUSED, None, None, ValueError(
            f"The checkpoint {candidate.path} was written by {position.trainer!r} training "
            f"({_run.TRAINERS.get(position.trainer, 'unknown')}), not by "
            f"{_run.TRAINERS[trainer]}: its epochs and steps mean something else. Fix: use a "
            "new directory for this run.")
    return OK, None, position, None


@contextlib.contextmanager
def _reading(what: str = ""):
    """Turns what reading files raises into `UnreadableCheckpoint`."""
    try:
        yield
    except _READ_ERRORS as error:
        raise UnreadableCheckpoint(what + _describe(error)) from error


def _describe(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:200] if lines else ''}"
