"""The key-value store of a multi-worker cluster's coordination service.

`tf.distribute.MultiWorkerMirroredStrategy` runs TensorFlow's coordination service; its
key-value store (insert if absent, a blocking get with a timeout) is what
`tf.distribute.experimental.PreemptionCheckpointHandler` agrees on a step with, and what
`tf_hetbatch.training.preemption` uses. TensorFlow 2.21 has no public API to it: the private
use, and its canary, are in `_upstream.coordination`.
"""

from typing import Optional

from tf_hetbatch.distribute._upstream import coordination as _coordination


def insert_key(key: str, value: str) -> bool:
    """Inserts `key` = `value` into the cluster's store, unless `key` is there already.

    Args:
        key: the key, e.g. "tf_hetbatch/preemption".
        value: its value.

    Returns:
        True if inserted, False if the key already exists.

    Raises:
        tf.errors.OpError: no coordination service, or it is unreachable.
    """
    return _coordination.insert_coordination_key(key, value)


def get_key(key: str, timeout_s: float) -> Optional[str]:
    """The value of `key`, waiting for it to be inserted at most `timeout_s` seconds.

    Args:
        key: the key.
        timeout_s: the longest wait, in seconds (at least 1 ms is waited).

    Returns:
        The value, or None if the key was not inserted within `timeout_s`.

    Raises:
        tf.errors.OpError: no coordination service, or it is unreachable.
    """
    return _coordination.get_coordination_key(key, timeout_s)
