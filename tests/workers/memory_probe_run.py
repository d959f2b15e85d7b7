"""Runs `probe_micro_batch_limits` on logical CPUs with TensorFlow's own CPU allocator (whose
statistics the probe reads; the test process uses the system allocator, which keeps none) and
prints what it found as JSON: {"first": probe, "at_64": [probes], "check": probe at the
bound and twice it, "large": probe}."""

import dataclasses
import json
import os
import sys

os.environ["TF_ONEDNN_USE_SYSTEM_ALLOCATOR"] = "false"

import worker_start  # noqa: E402,F401  (first: before TensorFlow)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_hetbatch as hb  # noqa: E402


def conv_model(filters):
    def make():
        model = keras.Sequential([
            keras.Input((48, 48, 3)), keras.layers.Conv2D(filters, 3, activation="relu"),
            keras.layers.Flatten(), keras.layers.Dense(32), keras.layers.Dense(4)])
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    return make


def main():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    rng = np.random.default_rng(0)
    data = (rng.random((128, 48, 48, 3), dtype=np.float32), rng.integers(0, 4, 128))
    small, large = conv_model(16), conv_model(64)
    (first,) = hb.probe_micro_batch_limits(small, data, ["/cpu:0"])
    slope = (first.peak_bytes[1] - first.peak_bytes[0]) / (first.sizes[1] - first.sizes[0])
    at_64 = hb.probe_micro_batch_limits(small, data, ["/cpu:0", "/cpu:1"],
                                        memory_bytes=int(first.peak_bytes[0] + 32 * slope))
    # What steps at the bound found for /cpu:0, and at twice it, really peak at.
    bound = at_64[0].bound
    (check,) = hb.probe_micro_batch_limits(small, data, ["/cpu:0"], sizes=(bound, 2 * bound))
    # Room for about 512 samples of the small model.
    (big,) = hb.probe_micro_batch_limits(large, data, ["/cpu:0"],
                                         memory_bytes=int(first.peak_bytes[0] + 480 * slope))
    out = {"first": dataclasses.asdict(first), "at_64": [dataclasses.asdict(p) for p in at_64],
           "large": dataclasses.asdict(big), "check": dataclasses.asdict(check)}
    sys.stdout.write("PROBES " + json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
