"""Reads directories of the earlier `ResumableCheckpoint` format, so such a run resumes.

That format (`tf_hetbatch.ResumableCheckpoint/1`) was written through `open`/`os.replace`:

    checkpoint.json                          the pointer: {"format", "latest": <name>, "step"}
    step-000000120.epoch-0003.batch-00020/
        variables.npz                        w0..w{n-1}: model.weights (no ON_READ variables),
                                             o0..o{m-1}: model.optimizer.variables
        meta.json                            step, epoch, batch, batch_sizes, num_replicas, ...

Nothing here writes: `ResumableCheckpoint` resumes from such a checkpoint and writes its new
checkpoints (TensorFlow checkpoints, other file names) beside it, so the old files stay as they
were. Reads go through `tf.io.gfile`.
"""

import io
import json
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import tensorflow as tf

POINTER = "checkpoint.json"
META = "meta.json"
VARIABLES = "variables.npz"
FORMAT = "tf_hetbatch.ResumableCheckpoint/1"


def find(directory: str) -> Optional[Tuple[str, Dict[str, Any]]]:
    """(checkpoint name, meta) of the pointer's checkpoint, or None without a pointer.

    Raises:
        ValueError: a pointer that is unreadable or names a missing or foreign checkpoint.
    """
    path = os.path.join(directory, POINTER)
    if not tf.io.gfile.exists(path):
        return None
    fix = (" Fix: repair or delete it (ResumableCheckpoint then starts afresh, or resumes from "
           "the TensorFlow checkpoints of the directory), or start in a new directory.")
    try:
        pointer = json.loads(_read(path))
        name = str(pointer["latest"])
    except (tf.errors.OpError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"The checkpoint pointer {path} of the earlier tf_hetbatch format is "
                         f"unreadable ({error}).{fix}") from error
    meta_path = os.path.join(directory, name, META)
    try:
        meta = json.loads(_read(meta_path))
    except (tf.errors.OpError, ValueError) as error:
        raise ValueError(f"The checkpoint pointer {path} of the earlier tf_hetbatch format "
                         f"names {name!r}, whose {META} is missing or unreadable "
                         f"({type(error).__name__}).{fix}") from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path} is not a {FORMAT} checkpoint. Received: "
                         f"format={meta.get('format') if isinstance(meta, dict) else meta!r}."
                         f"{fix}")
    return name, meta


def load(directory: str, name: str, meta: Dict[str, Any]) -> Tuple[List[np.ndarray],
                                                                     List[np.ndarray]]:
    """The saved model weights and optimizer variable values of checkpoint `name`."""
    path = os.path.join(directory, name, VARIABLES)
    with tf.io.gfile.GFile(path, "rb") as f:
        data = np.load(io.BytesIO(f.read()))
    weights = [data[f"w{i}"] for i in range(int(meta["num_weights"]))]
    opt_values = [data[f"o{i}"] for i in range(int(meta["num_optimizer_variables"]))]
    return weights, opt_values


def model_variables(model) -> list:
    """The variables the format saved for the model, in its order."""
    return [v for v in model.weights if getattr(v, "synchronization", None) != "on_read"]


def optimizer_variables(model) -> list:
    """The variables the format saved for the optimizer, in its order."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not optimizer.built:
        return []
    return [v for v in optimizer.variables if getattr(v, "synchronization", None) != "on_read"]


def assign(variables, values, what: str, name: str) -> None:
    """Assigns `values` to `variables` after checking count and shapes (no collective)."""
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
        v.assign(value)  # cross-replica context: every local copy


def _read(path: str) -> str:
    with tf.io.gfile.GFile(path, "r") as f:
        return f.read()
