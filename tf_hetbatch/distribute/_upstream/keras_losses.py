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
