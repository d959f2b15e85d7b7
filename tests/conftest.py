"""Test set-up: four logical CPU devices, so real strategies run with real replicas here."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

NUM_LOGICAL_CPUS = 4


def _configure_logical_cpus():
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
        )
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
