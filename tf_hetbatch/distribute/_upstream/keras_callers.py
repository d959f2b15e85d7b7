"""Which Keras call is driving the strategy: its loop, its model, its step, its reduce.

Keras 3 gives a strategy no sign of what it is calling for; these read it from the bound step
passed to `strategy.run` and from the call stack (the Keras trainer's frames): which loop and
model distribute a dataset, the symbolic build's reduce of a data batch, the scalar logs'
reduce with an axis, and every layer of a model. Canaries: `tests/test_upstream_keras_callers.py`.
"""

import keras
import tensorflow as tf


# --- How Keras 3 drives Strategy.run ------------------------------------------------------------
# Keras's TensorFlow trainer calls `strategy.run(model.train_step, args=(data,))` (likewise
# `test_step`), with `data` from `strategy.experimental_distribute_dataset`. Its predict function
# passes a tf.function instead. The bound method is how the strategy finds the model whose
# optimizer it weights; if Keras changes this,
# `test_upstream_keras_callers.py` fails.
_KERAS_STEP_NAMES = ("train_step", "test_step")


def keras_model_of_step(fn):
    """Returns (model, kind) when `fn` is a Keras model's bound train/test step, else (None, None)."""
    model = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", None)
    if isinstance(model, keras.Model) and name in _KERAS_STEP_NAMES:
        return model, name
    return None, None


# --- Which Keras loop distributes a dataset: evaluation data may have any batch size -----------
# A tf_hetbatch strategy needs TRAINING data batched by sum(batch_sizes) (anything else is a
# user error it reports), but Keras users batch evaluation data freely: `evaluate(batch_size=
# 512)`, `predict(x, batch_size=1000)`, `fit(validation_data=val.batch(256))`, as the stock
# strategy allows. Keras 3 gives a strategy no sign of what a dataset is for: `fit`,
# `evaluate` and `predict` each build a `TFEpochIterator`, whose constructor calls
# `strategy.experimental_distribute_dataset` (keras/src/backend/tensorflow/trainer.py). So the
# strategy asks who built that iterator:
# - `Trainer.evaluate` or `Trainer.predict`: evaluation data;
# - `Trainer.fit`: its training iterator is built first, before fit's local `epoch_iterator`
#   exists; the one it builds later, inside the epoch loop, is for `validation_data`.
# Anything else (a custom loop distributing its own data) is training data, checked as before.
# The answer depends only on the Keras call, so every worker of a cluster gets the same one.
# Canary: test_upstream_keras_callers.test_keras_distributes_data_from_fit_evaluate_and_predict_
# iterators.
_KERAS_TF_TRAINER = ("keras", "src", "backend", "tensorflow", "trainer.py")


def _is_keras_tf_trainer_code(code):
    import os

    parts = os.path.normpath(code.co_filename).split(os.sep)
    return tuple(parts[-len(_KERAS_TF_TRAINER):]) == _KERAS_TF_TRAINER


EVALUATION_LOOPS = ("validation", "evaluate", "predict")


def keras_loop_distributing_data(max_depth=8):
    """Which Keras loop is distributing a dataset: "train", "validation", "evaluate",
    "predict", or None when it is not Keras's `TFEpochIterator` (e.g. a custom loop).

    Call it from within the strategy's `experimental_distribute_dataset`; `max_depth` bounds
    the frames searched for the `TFEpochIterator` constructor (strategy subclasses add some).
    """
    caller = _keras_loop_frame(max_depth + 1)
    if caller is None:
        return None
    name = caller.f_code.co_name
    if name == "fit":
        # Read only: whether fit has already bound its training iterator.
        return "validation" if "epoch_iterator" in caller.f_locals else "train"
    if name in ("evaluate", "predict"):
        return name
    return None


def keras_batch_size_distributing_data(max_depth=8):
    """The batch size Keras batches the data it is distributing by (its data adapter's
    `batch_size`: `fit(x, y, batch_size=B)`'s B, whose batches tf.data cannot infer), or None
    (call it from within the strategy's `experimental_distribute_dataset`)."""
    frame = _epoch_iterator_frame(max_depth + 1)
    adapter = getattr(frame.f_locals.get("self"), "data_adapter", None) if frame else None
    size = getattr(adapter, "batch_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _keras_loop_frame(max_depth):
    """The frame of the Keras trainer method that constructs the `TFEpochIterator` on the
    current stack (within `max_depth` frames of the caller's caller), or None."""
    frame = _epoch_iterator_frame(max_depth + 1)
    caller = None if frame is None else frame.f_back
    if caller is None or not _is_keras_tf_trainer_code(caller.f_code):
        return None
    return caller


def _epoch_iterator_frame(max_depth):
    """The frame of `TFEpochIterator.__init__` on the current stack (within `max_depth` frames
    of the caller's caller), or None."""
    import sys

    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return None
        code = frame.f_code
        if (
            code.co_name == "__init__"
            and getattr(code, "co_qualname", "TFEpochIterator.__init__")
            == "TFEpochIterator.__init__"
            and _is_keras_tf_trainer_code(code)
        ):
            return frame
    return None


def keras_model_distributing_data(max_depth=8):
    """The Keras model whose `fit`/`evaluate`/`predict` is distributing a dataset, or None
    (call it from within the strategy's `experimental_distribute_dataset`)."""
    frame = _keras_loop_frame(max_depth + 1)
    return None if frame is None else frame.f_locals.get("self")


# --- Keras's symbolic build reduces a data batch across replicas --------------------------------
# `TensorFlowTrainer._maybe_symbolic_build` calls `strategy.reduce("MEAN", data_batch, axis=None)`
# on the first distributed batch, only to build the model from its shapes. With uneven
# per-replica batches the element-wise mean fails in AddN (the stock strategy crashes the same way
# when the global batch does not divide by the replica count). `reduce` of tf_hetbatch strategies
# recognises that call (axis=None over per-replica values of different batch sizes) and returns
# the largest replica's batch, which has the shapes the build needs.
def is_uneven_batch_reduce(strategy, value):
    """Whether a MEAN over replicas (axis None, the caller checks) of `value` is that call."""
    if not isinstance(value, tf.distribute.DistributedValues):
        return False
    local = strategy.experimental_local_results(value)
    if not all(isinstance(t, tf.Tensor) for t in local) or not tf.executing_eagerly():
        return False
    shapes = {tuple(t.shape) for t in local}
    return len(shapes) > 1 and len({s[1:] for s in shapes}) == 1


def largest_local_batch(strategy, value):
    local = strategy.experimental_local_results(value)
    return max(local, key=lambda t: int(t.shape[0]))


# --- Keras 3 fit under MultiWorkerMirroredStrategy ----------------------------------------------
# Keras 3.15 `fit` crashes under any MultiWorkerMirroredStrategy before the first step:
# (a) `_maybe_symbolic_build` calls `strategy.reduce("MEAN", <data batch>, axis=None)` eagerly,
#     only to build the model from the batch's shapes;
# (b) `reduce_per_replica`, in its multi-worker branch, calls `strategy.reduce("MEAN", v, axis=0)`
#     on every log value, scalars included ("Invalid reduction dimension 0 for input with 0
#     dimensions").
# Both pass through the strategy's own `reduce`; HeteroMultiWorkerMirroredStrategy answers (a)
# with this worker's largest local batch (the shapes are what matter; no collective) and (b) as
# a reduce with axis=None. (a) is recognised by its caller, so a user's own reduce with
# axis=None keeps its meaning.
def called_from_keras_symbolic_build(max_depth=4):
    import sys

    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code.co_name == "_maybe_symbolic_build" and "keras" in frame.f_code.co_filename:
            return True
    return False


def is_scalar_reduce_with_axis(strategy, value, axis):
    if axis != 0:
        return False
    leaves = (
        strategy.experimental_local_results(value)
        if isinstance(value, tf.distribute.DistributedValues)
        else [value]
    )
    return all(getattr(getattr(t, "shape", None), "rank", None) == 0 for t in leaves)


def is_data_batch_reduce(strategy, reduce_op, value):
    flat = tf.nest.flatten(value)
    return (
        bool(flat)
        and all(isinstance(v, tf.distribute.DistributedValues) for v in flat)
        and called_from_keras_symbolic_build()
    )


# --- Every layer of a model, nested ones included (Keras has no public walk) -------------------
def all_layers(model):
    return list(model._flatten_layers(include_self=False, recursive=True))


# --- Which code reads a loss in a Keras step (keras: trainers/..., backend/tensorflow) ---------
# Keras's own `train_step` and `test_step` (TensorFlowTrainer, keras/src/backend/tensorflow/
# trainer.py) multiply the loss `compute_loss` returns by the replica count for the loss
# tracker and weight it by the batch size; any other step reads the loss as it is. The seams
# in `weighting` ask whether Keras's own step called them (also through a subclass's
# `super().train_step(data)`), by code object. Canary:
# tests/test_upstream_keras_callers.py.
def called_from_keras_own_step(max_depth=6):
    """Whether Keras's own TensorFlowTrainer.train_step/test_step is on the stack (within
    `max_depth` frames above the caller)."""
    import sys

    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    own = {TensorFlowTrainer.train_step.__code__, TensorFlowTrainer.test_step.__code__}
    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code in own:
            return True
    return False
