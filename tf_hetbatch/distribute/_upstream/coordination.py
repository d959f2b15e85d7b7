"""The coordination service of a multi-worker cluster: its barrier and key-value store.

TensorFlow runs the service for MultiWorkerMirroredStrategy but offers no public API to it.
The training layer reaches it through `tf_hetbatch.distribute.coordination`.
Canaries: `tests/test_upstream_coordination.py`.
"""

import tensorflow as tf


# --- A barrier of all tasks of a multi-worker cluster (tensorflow: no public API) -------------
# tensorflow/tensorflow#58434: the tasks of a MultiWorkerMirroredStrategy cluster that exit one
# at a time can end a successful run with "StartAbort UNAVAILABLE" error lines (a task outliving
# the coordination service's leader, or the leader outliving a task's heartbeats). The
# coordination service has a barrier of all tasks, `Context.wait_at_barrier`
# (tensorflow/python/eager/context.py), with no public API; `clean_exit` waits at it
# when a process exits. Canary:
# test_upstream_coordination.test_coordination_barrier_is_the_context_method.
def wait_at_coordination_barrier(barrier_id, timeout_s):
    """Blocks until every task of the cluster reached the barrier `barrier_id`.

    Raises:
        tf.errors.OpError: on a timeout, a failed task, or without a coordination service
            (FailedPreconditionError).
    """
    from tensorflow.python.eager import context

    context.context().wait_at_barrier(barrier_id, int(timeout_s * 1000))


# --- The coordination service's key-value store (tensorflow: no public API in 2.21) ---------
# `tf.distribute.MultiWorkerMirroredStrategy` runs TensorFlow's coordination service; its
# key-value store (insert-if-absent, blocking get with a timeout) is what
# `tf.distribute.experimental.PreemptionCheckpointHandler` agrees on a step with, and what
# `tf_hetbatch.training.preemption` uses: `context.Context.set_config_key_value` /
# `get_config_key_value(key, timeout_in_ms)`. Canary:
# `test_coordination_key_value_store_is_the_context_api`.
def insert_coordination_key(key, value):
    """Inserts `key` = `value` into the cluster's store; False if the key already exists.

    Raises:
        tf.errors.OpError: no coordination service, or it is unreachable.
    """
    from tensorflow.python.eager import context

    try:
        context.context().set_config_key_value(key, value)
    except tf.errors.AlreadyExistsError:
        return False
    return True


def get_coordination_key(key, timeout_s):
    """The value of `key`, waiting for it at most `timeout_s` seconds; None on timeout.

    Raises:
        tf.errors.OpError: no coordination service, or it is unreachable.
    """
    from tensorflow.python.eager import context

    try:
        return context.context().get_config_key_value(key, max(1, int(timeout_s * 1000)))
    except tf.errors.DeadlineExceededError:
        return None
