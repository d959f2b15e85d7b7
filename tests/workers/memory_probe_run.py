"""Runs `probe_micro_batch_limits` on logical CPUs with TensorFlow's own CPU allocator (whose
statistics the probe reads; the test process uses the system allocator, which keeps none) and
prints what it found as JSON: "PROBES [probe, ...]", one list per request.

Argument: a JSON list of requests, run in order in this process, each
{"filters": 16 | 64, "devices": [...], "memory_bytes": int or None, "sizes": [a, b] or None}.
A probe's peaks depend on what the allocator held before it (a chunk it reuses unsplit counts
whole), so the test starts a process for each probe whose peaks it compares with a budget, as a
run calls the probe once, before training."""

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
    found = []
    for request in json.loads(sys.argv[1]):
        kwargs = {"memory_bytes": request.get("memory_bytes")}
        if request.get("sizes"):
            kwargs["sizes"] = tuple(request["sizes"])
        probes = hb.probe_micro_batch_limits(conv_model(request["filters"]), data,
                                             request["devices"], **kwargs)
        found.append([dataclasses.asdict(p) for p in probes])
    sys.stdout.write("PROBES " + json.dumps(found) + "\n")


if __name__ == "__main__":
    main()
