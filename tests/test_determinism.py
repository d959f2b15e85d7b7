"""Op determinism (`tf.config.experimental.enable_op_determinism()`, common for reproducible
GPU runs): a tf_hetbatch strategy trains under it exactly, reproducibly, with every replica
timed. In a process of its own: determinism, once on, stays on for the process."""

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np, tensorflow as tf, keras
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.config.experimental.enable_op_determinism()
import tf_hetbatch as hb

rng = np.random.default_rng(0)
x = rng.normal(size=(96, 6)).astype("float32")
y = rng.normal(size=(96, 1)).astype("float32")

def train(strategy):
    keras.utils.set_random_seed(1)
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(1e-2), "mse")
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()

def ours():
    strategy = hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1"])
    strategy.set_batch_sizes([10, 22])
    weights = train(strategy)
    return weights, strategy.read_replica_times()

reference = train(None)
first, times = ours()
second, _ = ours()
print(json.dumps({
    "diff": max(float(np.max(np.abs(a - b))) for a, b in zip(reference, first)),
    "reproduced": all(np.array_equal(a, b) for a, b in zip(first, second)),
    "seconds": times.compute_seconds.tolist(), "samples": times.samples.tolist(),
}))
"""


def test_op_determinism_trains_exactly_reproducibly_and_timed():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["diff"] <= 1e-5
    assert result["reproduced"]
    assert result["samples"] == [10 * 6, 22 * 6]
    assert all(s > 0 for s in result["seconds"])
