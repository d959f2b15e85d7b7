"""The one reader of the earlier tf_hetbatch checkpoint formats, so such a run resumes.

Two formats came before the position went into the TensorFlow checkpoint itself
(`run_checkpoint.RunPosition`); each is read into today's position dict (`RunPosition.to_dict`
form), and restored into the model:

- `ResumableCheckpoint`'s (`tf_hetbatch.ResumableCheckpoint/1`), written through
  `open`/`os.replace`:

      checkpoint.json                          the pointer: {"format", "latest": <name>, "step"}
      step-000000120.epoch-0003.batch-00020/
          variables.npz                        w0..w{n-1}: model.weights (no ON_READ variables),
                                               o0..o{m-1}: model.optimizer.variables
          meta.json                            step, epoch, batch, batch_sizes, num_replicas, ...

- `AsyncTrainer`'s: TensorFlow checkpoints `ckpt-<update>` of the model and optimizer only
  (`CheckpointManager`), and beside them `hetbatch_async.json`, the position of the newest:
  {"checkpoint": <its path>, "step", "epoch", "batch", "batch_sizes", "dynamic_batching"}.

Nothing here writes: a run resumes from such a checkpoint and writes its new checkpoints
(TensorFlow checkpoints, other file names) beside it, so the old files stay as they were. Reads
go through `tf.io.gfile`. Reading errors propagate as raised (the caller tells a checkpoint
that cannot be read from one that is foreign, a `ValueError` here).
"""

import io
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

import tf_hetbatch.distribute  # noqa: F401  (checks the TensorFlow/Keras versions first)

POINTER = "checkpoint.json"
META = "meta.json"
VARIABLES = "variables.npz"
FORMAT = "tf_hetbatch.ResumableCheckpoint/1"
ASYNC_POSITION = "hetbatch_async.json"


# ---------------------------------------------------------------------- fit's format -------
def has_pointer(directory: str) -> bool:
    """Whether `directory` holds a checkpoint of `ResumableCheckpoint`'s earlier format."""
    return tf.io.gfile.exists(os.path.join(directory, POINTER))


def read_pointer(directory: str) -> Tuple[str, int]:
    """(checkpoint name, step) the pointer names; raises what reading or parsing raises."""
    pointer = json.loads(_read(os.path.join(directory, POINTER)))
    return str(pointer["latest"]), int(pointer["step"])


def read_meta(directory: str, name: str) -> Any:
    """The parsed meta.json of checkpoint `name`; raises what reading or parsing raises."""
    return json.loads(_read(os.path.join(directory, name, META)))


def check_meta(meta: Any, directory: str, name: str) -> None:
    """Raises ValueError unless `meta` is a meta of this format."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{os.path.join(directory, name, META)} is not a {FORMAT} checkpoint. "
                         f"Received: format="
                         f"{meta.get('format') if isinstance(meta, dict) else meta!r}. "
                         "Fix: repair or delete it, or start in a new directory.")


def fit_position(meta: Dict[str, Any]) -> Dict[str, Any]:
    """Today's position dict of an earlier-format meta."""
    return {"trainer": "fit", "step": int(meta["step"]), "epoch": int(meta["epoch"]),
            "batch": int(meta["batch"]), "batch_sizes": meta.get("batch_sizes"),
            "num_parts": int(meta["num_replicas"]),
            "dynamic_batching": meta.get("dynamic_batching")}


def load(directory: str, name: str, meta: Dict[str, Any]) -> Tuple[List[np.ndarray],
                                                                     List[np.ndarray]]:
    """The saved model weights and optimizer variable values of checkpoint `name`."""
    path = os.path.join(directory, name, VARIABLES)
    with tf.io.gfile.GFile(path, "rb") as f:
        data = np.load(io.BytesIO(f.read()))
    weights = [data[f"w{i}"] for i in range(int(meta["num_weights"]))]
    opt_values = [data[f"o{i}"] for i in range(int(meta["num_optimizer_variables"]))]
    return weights, opt_values


def restore_fit(model, weights, opt_values, name: str) -> None:
    """Assigns loaded values to `model`'s weights and optimizer variables (no collective).

    Raises:
        ValueError: counts or shapes differ from the model's, or optimizer values but no
            optimizer (nothing is assigned then).
    """
    pairs = [(model_variables(model), weights, "model.weights")]
    if opt_values:
        if model.optimizer is None:
            raise ValueError(
                f"The checkpoint {name} holds optimizer variables but the model has no "
                "optimizer. Fix: compile the model as when the checkpoint was written, "
                "before restore().")
        pairs.append((optimizer_variables(model), opt_values, "model.optimizer.variables"))
    for variables, values, what in pairs:
        _check_assignable(variables, values, what, name)
    for variables, values, _ in pairs:
        for v, value in zip(variables, values):
            v.assign(value)  # cross-replica context: every local copy


def model_variables(model) -> list:
    """The variables the format saved for the model, in its order."""
    return [v for v in model.weights if getattr(v, "synchronization", None) != "on_read"]


def optimizer_variables(model) -> list:
    """The variables the format saved for the optimizer, in its order."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return []
    return [v for v in optimizer.variables if getattr(v, "synchronization", None) != "on_read"]


def _check_assignable(variables, values, what: str, name: str) -> None:
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


# ---------------------------------------------------------------------- AsyncTrainer's -----
def read_async_meta(directory: str) -> Optional[Dict[str, Any]]:
    """The parsed `hetbatch_async.json` of `directory`, or None if there is none.

    Raises what reading or parsing raises (`ValueError` if it names no checkpoint).
    """
    meta_path = os.path.join(directory, ASYNC_POSITION)
    if not tf.io.gfile.exists(meta_path):
        return None
    meta = json.loads(_read(meta_path))
    if not isinstance(meta, dict) or not meta.get("checkpoint"):
        raise ValueError(f"{meta_path} names no checkpoint")
    return meta


def async_position(meta: Dict[str, Any], path: str) -> Optional[Dict[str, Any]]:
    """Today's position dict of the checkpoint at `path` from `read_async_meta`'s `meta`.

    None if `meta` describes another checkpoint: it described the newest only.
    """
    if os.path.basename(str(meta["checkpoint"])) != os.path.basename(path):
        return None
    sizes = meta.get("batch_sizes") or None
    return {"trainer": "async", "step": int(meta["step"]), "epoch": int(meta["epoch"]),
            "batch": int(meta["batch"]), "batch_sizes": sizes,
            "num_parts": len(sizes) if sizes else None,
            "dynamic_batching": meta.get("dynamic_batching", [])}


def restore_async(path: str, model, optimizer) -> None:
    """Restores the model and optimizer of an earlier AsyncTrainer checkpoint.

    Raises:
        ValueError: it does not match the model and optimizer.
    """
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    try:
        checkpoint.restore(path).assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as error:
        raise ValueError(
            f"The checkpoint {path} does not match this model and optimizer ({error}). "
            "Fix: build the model and optimizer as when it was written, or use another "
            "checkpoint_dir.") from error


def _read(path: str) -> str:
    with tf.io.gfile.GFile(path, "r") as f:
        return f.read()
