"""
# Quickstart

In ten minutes you will train a Keras model on three replicas with tf_hetbatch, read how the
global batch was split between them, and check that the trained weights equal those of one
device trained on the same global batches.
"""

"""
## What tf_hetbatch does

tf_hetbatch is data-parallel TensorFlow/Keras training on heterogeneous resources: CPU and
GPU replicas mixed, VMs of different sizes, transient servers, machines slowed by noisy
neighbours.

In synchronous data-parallel training every replica waits for the slowest one at each step.
tf_hetbatch gives replica k a mini-batch b_k in proportion to its throughput, keeps the
global batch B = sum b_k constant, and weights each replica's gradient by b_k / B. So every
update is exactly the one a single device would make on the whole global batch. The test
suite checks this to 1e-5 against one device, with masked sequence losses,
SyncBatchNormalization, LossScaleOptimizer and several workers among the cases.

With the `DynamicBatching` callback, the split starts from the devices' nominal peak FLOP/s
and is then adjusted from the measured time of each replica, between steps, with no restart
and no retrace.

## Devices

This machine has no GPU, so the guide splits its one CPU into three logical CPUs and uses
each as a replica. That must happen before anything else touches TensorFlow's devices. On a
machine with GPUs you would skip this and name the devices instead, e.g.
`hb.HeteroMirroredStrategy(["/gpu:0", "/gpu:1", "/cpu:0"])`.
"""
import keras
import numpy as np
import tensorflow as tf

import tf_hetbatch as hb

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)

"""
## A strategy, a model, the data

`HeteroMirroredStrategy` and `HeteroMultiWorkerMirroredStrategy` subclass the stock
`tf.distribute.MirroredStrategy` and `tf.distribute.MultiWorkerMirroredStrategy`, with the
same constructors: a drop-in replacement. With no argument, `HeteroMirroredStrategy()` takes
all GPUs of the host, else its CPU, as the stock strategy does. Here it gets the three
logical CPUs. On several hosts, `hb.HeteroMultiWorkerMirroredStrategy()` is configured by
`TF_CONFIG`, as the stock one ([Several workers](multi_worker.md)).

Create and compile the model inside `strategy.scope()`, as with any `tf.distribute`
strategy.
"""
strategy = hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
print("replicas in sync:", strategy.num_replicas_in_sync)


def make_model():
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(4, activation="softmax"),
    ])


keras.utils.set_random_seed(0)  # the same initial weights on every run
with strategy.scope():
    model = make_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
initial_weights = model.get_weights()  # kept for the one-device check below

"""
Batch the data by the GLOBAL batch size, as with the stock strategy: the strategy splits
each global batch between the replicas. Here B = 64, which does not divide by 3 replicas.
The stock strategy crashes on that; tf_hetbatch splits it unevenly.

The samples are shuffled once, with numpy, so that the one-device run below trains on the
same global batches. (A seeded `Dataset.shuffle` trains just as well, but does not suit this
comparison: under any `tf.distribute` strategy, the stock one too, Keras's `fit` trains the
first epoch on the second order the shuffle draws, where one device trains on the first.)
"""
GLOBAL_BATCH = 64
rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 16)).astype("float32")
y = (x[:, :4].argmax(axis=1) + (x[:, 4] > 1.0)).astype("int32") % 4
order = rng.permutation(len(x))
x, y = x[order], y[order]


def make_dataset():
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


"""
## Train with `DynamicBatching`

`hb.DynamicBatching()` is a Keras callback. At the start of `fit` it sets the static split
(by default in proportion to each replica device's nominal peak FLOP/s); then, after 5
warm-up steps, it reads the replicas' measured compute times every 10 steps and moves
samples from slow replicas to fast ones when that pays. With `log_dir` it also writes
TensorBoard balance dashboards and, at the end, a PNG; they go next to Keras's own
TensorBoard logs (see [Reading the dashboards](dashboards.md)).
"""
dyn = hb.DynamicBatching(log_dir="quickstart_logs")
history = model.fit(make_dataset(), epochs=3, verbose=2,
                    callbacks=[dyn, keras.callbacks.TensorBoard("quickstart_logs")])

"""
## Read the split

`strategy.batch_sizes` is the split in force, one size per replica, summing to the global
batch. `dyn.history` lists every split `DynamicBatching` applied, with the step and the
reason; the first entry is the static split.

The three logical CPUs share one processor, so each counts a third of its peak FLOP/s and
the static split is the even one, [22, 21, 21]. That is also the split you get with no
callback and no `set_batch_sizes`: the first `B % K` replicas get one sample more. Later
entries, if any, are the controller at work: a move to the split at which the replicas'
modelled compute times finish together, or a candidate split its step-time search measures,
kept only if the measured step time shows it faster. Logical CPUs share one processor's
cores, so what it finds here says nothing about real devices; on a mixed machine it moves samples
to the faster devices ([Mixed devices on one host](mixed_devices.md)).
"""
print("split in force:", strategy.batch_sizes, "sum", sum(strategy.batch_sizes))
for change in dyn.history:
    print(f"  step {change['step']:3d}: {change['old']} -> {change['new']}  ({change['reason']})")

"""
## Check: the same weights as one device

Train the same model from the same initial weights on one device, with no strategy, on the
same global batches. Whatever the split was at each step, the weights agree up to float
rounding: the sums are taken in another order. (Adam divides each update by the running
size of the gradient, so a weight whose gradient stays near zero can carry such a rounding
difference further; seeding the initial weights keeps this guide's check the same on every
run.) The logs agree too: `history.history` and the per-batch logs are true global means,
the values one device reports.
"""
reference = make_model()
reference.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
reference.set_weights(initial_weights)
reference_history = reference.fit(make_dataset(), epochs=3, verbose=0)

difference = max(float(np.max(np.abs(a - b)))
                 for a, b in zip(model.get_weights(), reference.get_weights()))
print(f"largest weight difference from one device: {difference:.2e}")
print("loss per epoch, 3 replicas:", np.round(history.history["loss"], 6))
print("loss per epoch, one device:", np.round(reference_history.history["loss"], 6))
assert difference <= 1e-5, difference

"""
## Where to go next

- [Mixed devices on one host](mixed_devices.md): naming CPUs and GPUs, the static split,
  `set_batch_sizes`, `DynamicBatching`'s options, input pipelines, `steps_per_execution`,
  per-replica times.
- [Several workers](multi_worker.md): `HeteroMultiWorkerMirroredStrategy`, workers with
  different devices, the local launcher, TF_CONFIG.
- [Custom steps and loops](custom_steps.md): a custom `train_step`, a custom training loop
  with `hb.Balancer`.
- [Memory-bounded replicas](memory.md): a replica that cannot hold its share computes it in
  micro-batches.
- [Checkpoints and restarts](checkpoints.md): surviving a lost worker and a preemption notice.
- [Asynchronous training](async_training.md): parameter servers and `AsyncTrainer`.
- [Reading the dashboards](dashboards.md): what `DynamicBatching(log_dir=...)` writes.
- [How exactness works](exactness.md): where each replica's loss is weighted.
- [Troubleshooting](../troubleshooting.md) and the [API reference](../reference.md).

From a checkout of the repository, `bash .ci/setup && .venv/bin/python examples/demo.py`
sets up a `.venv` and runs the heterogeneous-cluster demo (4-6 minutes): three capped worker
processes, trained once with the stock even split and once with `DynamicBatching()`.
`bash .ci/setup && .venv/bin/python -m pytest tests` runs the test suite. It runs in three
processes (pytest-xdist, set in `setup.cfg`) and takes 14-17 minutes on a 2-core machine;
`pytest -m "not cluster" tests` is the fast inner loop, which leaves out the tests that start
worker processes (launched clusters, examples, benchmarks), and `-n 0` runs it in one process.
"""
