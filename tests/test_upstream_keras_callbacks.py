"""Canaries of `_upstream.keras_callbacks`: how Keras 3 decides its callback dispatch.

When one fails after an upgrade, read `tf_hetbatch/distribute/_upstream/keras_callbacks.py`:
`DynamicBatching` relies on Keras counting only batch-END hooks against asynchronous
dispatch; if that changes, its hooks may have to change too.
"""

import keras
import pytest

from tf_hetbatch.distribute._upstream import keras_callbacks


class BatchBegin(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        pass


class BatchEnd(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pass


class SafeBatchEnd(BatchEnd):
    async_safe = True


def test_tensorflow_backend_dispatches_every_callback_list_synchronously():
    """tensorflow/tensorflow#78338: Keras 3 turns asynchronous dispatch off on TensorFlow.
    Once this fails, Keras dispatches batch ends on a thread pool here too: check that what
    `test_callback.test_fit_with_dynamic_batching_dispatches_steps_as_without_it` covers
    with the flag set still holds."""
    assert not keras_callbacks.backend_allows_async_dispatch()
    assert not keras_callbacks.async_train_dispatch(keras.callbacks.CallbackList([]))


@pytest.mark.parametrize("callback, dispatch", [
    (keras.callbacks.Callback(), True),
    (BatchBegin(), True),       # a batch-begin hook keeps asynchronous dispatch
    (BatchEnd(), False),        # a batch-end hook turns it off
    (SafeBatchEnd(), True),     # unless the callback says it is safe
])
def test_only_a_batch_end_hook_turns_asynchronous_dispatch_off(monkeypatch, callback,
                                                               dispatch):
    monkeypatch.setattr(keras_callbacks.BACKEND_THREAD_SAFE_FLAG, True)
    assert keras_callbacks.backend_allows_async_dispatch()
    callbacks = keras.callbacks.CallbackList([callback], add_history=True)
    assert keras_callbacks.async_train_dispatch(callbacks) is dispatch
