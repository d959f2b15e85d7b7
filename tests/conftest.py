"""Test set-up: four logical CPU devices, so real strategies run with real replicas here."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The out-of-memory tests allocate beyond the machine's memory. TensorFlow's default oneDNN CPU
# allocator waits 10 s for memory to be freed before it reports such an allocation (the same
# ResourceExhaustedError, "OOM when allocating tensor ... on <device>"); the system allocator
# reports it at once. Read when TensorFlow creates its CPU allocator, so set before any test
# runs (the worker processes a test starts inherit it).
os.environ.setdefault("TF_ONEDNN_USE_SYSTEM_ALLOCATOR", "true")

import pytest  # noqa: E402

NUM_LOGICAL_CPUS = 4
INTER_OP_THREADS = 2 * NUM_LOGICAL_CPUS


def _configure_logical_cpus():
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
        )
        # Logical CPUs share one inter-op pool (one thread per core by default): a replica
        # whose op blocks a thread (the tests' sleeping costs) would hold up the others' ops,
        # their timing stamps too. Enough threads let replicas run side by side, as devices do.
        tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
    except RuntimeError:  # already initialised by an earlier import: keep what is there
        pass


try:
    import tensorflow  # noqa: F401
except ImportError:  # the pure-core tests still run
    pass
else:
    _configure_logical_cpus()


@pytest.fixture
def cpus():
    """Device names of the logical CPUs, e.g. cpus[:3] for a three-replica strategy."""
    return [f"/cpu:{i}" for i in range(NUM_LOGICAL_CPUS)]
