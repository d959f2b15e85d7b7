"""Canaries of `_upstream.ps_coordinator` and of the parameter-server update counter.

When one fails after an upgrade, read the matching section of
`tf_hetbatch/distribute/_upstream/ps_coordinator.py`: the workaround may be obsolete
(lift it) or broken (fix it), but it must not go on silently.
"""

import keras
import tensorflow as tf

from tf_hetbatch.distribute._upstream import ps_coordinator


def test_coordinator_internals_used_for_per_worker_iterators_exist():
    """`ps_coordinator.per_worker_iterator` and the step-status checks use these internals."""
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc
    from tensorflow.python.distribute.coordinator import remote_value as rv
    from tensorflow.python.distribute.coordinator import values as cv

    assert callable(getattr(cc.Worker, "create_resource", None))
    assert hasattr(cv, "PerWorkerDistributedIterator")
    assert {"NOT_READY", "READY", "ABORTED"} <= set(rv.RemoteValueStatus.__members__)
    value = cv.RemoteValueImpl(None, None)
    assert value._status is rv.RemoteValueStatus.NOT_READY
    assert not ps_coordinator.remote_value_done(value)
    ps_coordinator.wait_remote_value(value, timeout=0.01)  # an event with a timeout: returns
    value._set_values(tf.constant(1))
    assert ps_coordinator.remote_value_done(value)


def test_keras_variable_assign_add_is_read_modify_write_upstream():
    """keras-team/keras#18668: Keras 3 `Variable.assign_add` is `assign(self + value)`, so
    concurrent asynchronous updates can lose increments of `optimizer.iterations`. The
    parameter-server strategy therefore counts updates in a tf.Variable of its own
    (`HeteroParameterServerStrategy.updates`, one atomic AssignAddVariableOp per update)."""
    import inspect

    source = inspect.getsource(keras.Variable.assign_add)
    assert "self.assign(self + value)" in source, source
