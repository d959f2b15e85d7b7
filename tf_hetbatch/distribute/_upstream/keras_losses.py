"""Where Keras and TensorFlow scale a loss for distribution, and a loss's Keras mask.

Private: the code objects of `keras.src.losses.loss.scale_loss_for_distribution` /
`unscale_loss_for_distribution` and TensorFlow's `nn_impl_distribute` loss helpers (matched
on the stack), and Keras's mask accessors (`keras.src.backend.common.masking`). Canaries in
tests/test_upstream_keras_losses.py.
"""

# --- Where Keras and TensorFlow scale a loss by the replica count (keras, tensorflow) ----------
# Under a strategy, Keras divides a reduced loss by `num_replicas_in_sync`
# (`keras.src.losses.loss.scale_loss_for_distribution`, in `Loss.__call__` and
# `Model.compute_loss`) and its own train/test steps multiply the loss tracker's value back
# (`unscale_loss_for_distribution`); `tf.nn.compute_average_loss` without `global_batch_size`
# divides by the local batch size times it, `tf.nn.scale_regularization_loss` by it. All of
# them read the strategy's `num_replicas_in_sync` in replica context, which is how a
# tf_hetbatch strategy learns, while a step is traced, that a loss was divided by the replica
# count (`weighting.check_replica_count_read`): the reader is the function whose frame is on
# the stack just above the property (matched by code object, not by name).
# Canary: tests/test_upstream_keras_losses.py.
TF_AVERAGE_LOSS = "tf.nn.compute_average_loss"
TF_REGULARIZATION = "tf.nn.scale_regularization_loss"
KERAS_SCALE = "keras scale_loss_for_distribution"
KERAS_UNSCALE = "keras unscale_loss_for_distribution"


def _replica_count_readers():
    import inspect

    from keras.src.losses import loss as keras_loss
    from tensorflow.python.ops import nn_impl_distribute

    return {
        inspect.unwrap(nn_impl_distribute.compute_average_loss).__code__: TF_AVERAGE_LOSS,
        inspect.unwrap(nn_impl_distribute.scale_regularization_loss).__code__:
            TF_REGULARIZATION,
        keras_loss.scale_loss_for_distribution.__code__: KERAS_SCALE,
        keras_loss.unscale_loss_for_distribution.__code__: KERAS_UNSCALE,
    }


_READERS = None


def replica_count_reader(max_depth=4):
    """Which loss scaling reads `num_replicas_in_sync` (call it from the property): one of the
    constants above, or None for any other reader."""
    import sys

    global _READERS
    if _READERS is None:
        _READERS = _replica_count_readers()
    frame = sys._getframe(2)  # the property's caller
    for _ in range(max_depth):
        if frame is None:
            return None
        reader = _READERS.get(frame.f_code)
        if reader is not None:
            return reader
        frame = frame.f_back
    return None


# --- A loss's Keras mask (keras: backend/common/masking.py) ------------------------------------
# `Loss.__call__` reads the mask Keras attached to the per-sample values `call` returned
# (`get_keras_mask`); a weighted copy must carry it on. Canary:
# tests/test_upstream_keras_losses.py.
def keep_keras_mask(weighted, original):
    """`weighted` with `original`'s Keras mask, if it has one."""
    from keras.src.backend.common import masking

    mask = masking.get_keras_mask(original)
    if mask is not None:
        masking.set_keras_mask(weighted, mask)
    return weighted


# --- A loss term's denominator (keras: losses/loss.py) -----------------------------------------
# `Loss.__call__` reads the Keras mask of `y_pred` (`in_mask`), calls `self.call`, combines that
# mask with the mask of the values `call` returned, and reduces with `reduce_weighted_values`:
# under "sum_over_batch_size"/"mean" a masked loss is divided by its valid entries (`apply_mask`
# gives them weight total / valid), under "mean_with_sample_weight" by the sum of the sample
# weights with the mask folded in, else by the number of elements. The seam on `call`
# (`weighting.adapt_loss`) needs the mask and the sample weight `__call__` holds: they are read
# from its frame (matched by code object). Canaries: tests/test_upstream_keras_losses.py.
def loss_call_inputs(max_depth=3):
    """(in_mask, sample_weight) of the `Loss.__call__` that called the caller (a loss's `call`),
    or (None, None) when `call` was not called from there."""
    import sys

    from keras.src.losses import loss as keras_loss

    code = keras_loss.Loss.__call__.__code__
    frame = sys._getframe(2)  # the caller's caller
    for _ in range(max_depth):
        if frame is None:
            break
        if frame.f_code is code:
            return frame.f_locals.get("in_mask"), frame.f_locals.get("sample_weight")
        frame = frame.f_back
    return None, None


def loss_mask(in_mask, values):
    """The mask `Loss.__call__` reduces with: `in_mask` and the values' own, combined."""
    from keras.src.backend.common import masking

    out_mask = masking.get_keras_mask(values)
    if in_mask is not None and out_mask is not None:
        return in_mask & out_mask
    return in_mask if in_mask is not None else out_mask


def loss_denominator(values, sample_weight, mask, reduction):
    """What Keras divides the sum of a loss term's weighted values by (before the replica
    count), as a scalar of the values' dtype: valid entries under a mask ("sum_over_batch_size",
    "mean"), the masked sample weights' sum ("mean_with_sample_weight"), else the element count.
    """
    import tensorflow as tf
    from keras.src.losses import loss as keras_loss

    dtype = values.dtype
    if mask is not None:
        mask = tf.cast(mask, dtype)
        if reduction in ("mean", "sum_over_batch_size"):
            return tf.reduce_sum(mask)
    if sample_weight is not None:
        sample_weight = tf.cast(sample_weight, dtype)
    weights = keras_loss.apply_mask(sample_weight, mask, dtype=dtype, reduction=reduction)
    if weights is None:
        return tf.cast(tf.size(values), dtype)
    values, weights = keras_loss.squeeze_or_expand_to_same_rank(values, weights)
    if reduction == "mean_with_sample_weight":
        return tf.reduce_sum(weights)
    return tf.cast(tf.size(values * weights), dtype)


# --- The compiled loss and Keras's own trackers (keras: trainers/compile_utils.py, trainer) ----
# `model.compile(loss=...)` keeps a `CompileLoss` (`model._compile_loss`), itself a Loss, that
# calls one Loss object per output term (`_flat_losses`, built at the model's first build) and
# updates one loss tracker per output; `Model.compute_loss` adds `_aggregate_additional_loss`
# of every `model.losses` entry (regularizers, `add_loss`), and Keras's own steps update
# `model._loss_tracker` with the total. Canaries: tests/test_upstream_keras_losses.py.
def is_compile_loss(loss_object) -> bool:
    """Whether `loss_object` is a model's compiled loss (a container of loss terms)."""
    from keras.src.trainers.compile_utils import CompileLoss

    return isinstance(loss_object, CompileLoss)


def compiled_loss_terms(compile_loss):
    """The Loss objects of a built `CompileLoss`, one per output term (empty before build)."""
    if not getattr(compile_loss, "built", False):
        return []
    return [entry.loss for entry in getattr(compile_loss, "_flat_losses", None) or ()]


def total_loss_tracker(model):
    """The `Mean` Keras's own train/test steps update with the step's total loss, or None."""
    return getattr(model, "_loss_tracker", None)


ADDITIONAL_LOSS_METHOD = "_aggregate_additional_loss"  # model method: one `model.losses` entry


def is_keras_compute_loss(model) -> bool:
    """Whether `model.compute_loss` is Keras's own (it adds the compiled loss and the additional
    losses, nothing else)."""
    from keras.src.trainers.trainer import Trainer

    method = getattr(type(model), "compute_loss", None)
    return getattr(method, "__code__", None) is Trainer.compute_loss.__code__
