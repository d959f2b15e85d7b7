"""Private TensorFlow API of preemption notices: the coordination service's key-value store.

Belongs in `tf_hetbatch/_compat.py` with the other private API uses (it sits apart only while
that module is being changed elsewhere). `tf.distribute.MultiWorkerMirroredStrategy` runs
TensorFlow's coordination service; its key-value store (insert-if-absent, blocking get with a
timeout) is what `tf.distribute.experimental.PreemptionCheckpointHandler` agrees on a step
with. TensorFlow 2.21 has no public API for it: `tensorflow.python.eager.context.Context`
`set_config_key_value` / `get_config_key_value(key, timeout_in_ms)`. Canary:
test_recovery.test_coordination_key_value_store_is_the_context_api.
"""

from typing import Optional

import tensorflow as tf
from tensorflow.python.eager import context


def insert_key(key: str, value: str) -> bool:
    """Inserts `key` = `value` into the cluster's store; False if the key already exists.

    Raises:
        tf.errors.OpError: no coordination service, or it is unreachable.
    """
    try:
        context.context().set_config_key_value(key, value)
    except tf.errors.AlreadyExistsError:
        return False
    return True


def get_key(key: str, timeout_s: float) -> Optional[str]:
    """The value of `key`, waiting for it at most `timeout_s` seconds; None on timeout.

    Raises:
        tf.errors.OpError: no coordination service, or it is unreachable.
    """
    try:
        return context.context().get_config_key_value(key, max(1, int(timeout_s * 1000)))
    except tf.errors.DeadlineExceededError:
        return None
