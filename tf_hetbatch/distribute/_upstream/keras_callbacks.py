"""Keras 3's callback dispatch: whether a CallbackList dispatches batch ends asynchronously.

Keras 3 (`keras/src/callbacks/callback_list.py`, `CallbackList._configure_async_dispatch`)
runs `on_train_batch_end` on a thread pool, so `fit` dispatches the next step without waiting
for the step's logs, unless a callback of the list has its own `on_batch_end` or
`on_train_batch_end` and does not set `async_safe = True`; batch-begin hooks do not count. It
keeps the decision in the private `_async_train`. On the TensorFlow backend it decides
synchronous dispatch for every list (`keras.src.backend.IS_THREAD_SAFE` is False there,
tensorflow/tensorflow#78338). `DynamicBatching` has no batch-end hook, so it leaves the
decision as it is without it. Canaries: `tests/test_upstream_keras_callbacks.py`.
"""

import keras

# Where Keras reads whether its backend allows asynchronous dispatch (a module attribute).
BACKEND_THREAD_SAFE_FLAG = "keras.src.backend.IS_THREAD_SAFE"


def async_train_dispatch(callbacks: keras.callbacks.CallbackList) -> bool:
    """Whether `callbacks` dispatches `on_train_batch_end` asynchronously in `fit`."""
    return bool(callbacks._async_train)


def backend_allows_async_dispatch() -> bool:
    """Whether Keras's backend lets any callback list dispatch asynchronously."""
    from keras.src import backend

    return bool(backend.IS_THREAD_SAFE)
