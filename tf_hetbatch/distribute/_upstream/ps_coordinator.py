"""The parameter-server `ClusterCoordinator`: per-worker iterators, step status.

The training layer reaches these through `tf_hetbatch.distribute.parameter_server`.
Canaries: `tests/test_upstream_ps_coordinator.py`.
"""

import tensorflow as tf


# --- Per-worker input pipelines of a ClusterCoordinator, each knowing its worker -------------
# `ClusterCoordinator.create_per_worker_dataset` traces ONE dataset function for all workers,
# so a pipeline cannot know which worker it runs on (and its InputContext is the same for all).
# The asynchronous trainer needs the worker index in the data (to take that worker's batch
# size) and gives each worker a proper InputContext. This builds the per-worker iterators the
# way `create_per_worker_dataset` does (tensorflow/python/distribute/coordinator/values.py,
# `PerWorkerDatasetFromDatasetFunction.__iter__`), with one function per worker. Like the
# stock ones they are resource closures: re-created when a failed worker comes back.
def per_worker_iterator(coordinator, make_dataset):
    """A `PerWorkerValues` of iterators over `make_dataset(worker_index)`, and its element spec.

    Raises:
        ValueError: the workers' datasets have different element specs.
    """
    from tensorflow.python.distribute.coordinator import values as coordinator_values

    def no_variables(next_creator, **kwargs):
        raise ValueError("Creating variables in `dataset_fn` is not allowed.")

    remote_values, element_spec = [], None
    for worker in coordinator._cluster.workers:
        with tf.variable_creator_scope(no_variables):
            dataset = make_dataset(worker.worker_index)  # eager: validates and gives the spec
            spec = dataset.element_spec
            if element_spec is None:
                element_spec = spec
            elif spec != element_spec:
                raise ValueError(f"`dataset_fn` gave worker {worker.worker_index} elements "
                                 f"{spec}, but worker 0 {element_spec}. Fix: the same "
                                 "structure, dtypes and shapes on every worker.")
            function = tf.function(
                lambda index=worker.worker_index: iter(make_dataset(index))
            ).get_concrete_function()
        value = worker.create_resource(function)
        value._type_spec = tf.data.IteratorSpec(element_spec)
        remote_values.append(value)
    return coordinator_values.PerWorkerDistributedIterator(tuple(remote_values)), element_spec


# --- Has a scheduled step finished? (no public non-blocking check) ----------------------------
# `RemoteValue` offers only blocking `fetch`/`get`. The trainer bounds how many steps are
# queued without blocking on one slow worker's step, so it looks at the status and the event
# that `RemoteValueImpl` (coordinator/values.py) keeps.
def remote_value_done(value) -> bool:
    """True once the scheduled function behind `value` finished (or failed)."""
    from tensorflow.python.distribute.coordinator import remote_value as rv

    return value._status is not rv.RemoteValueStatus.NOT_READY


def wait_remote_value(value, timeout: float) -> None:
    """Waits up to `timeout` seconds for `value`'s function to finish."""
    value._status_available_event.wait(timeout)
