"""
# Memory-bounded replicas

Give a replica with little memory its fair share of the global batch anyway: bound how many
samples it computes at once, and it computes its share in micro-batches inside the same
training step. At the end you will have bounded replicas that train exactly as one device,
a run that survives a step running out of memory, and bounds measured up front.

## Setup

The replicas here are three logical CPUs made from this machine's CPU. On a real machine you
would list your devices, e.g. `hb.HeteroMirroredStrategy(["/gpu:0", "/gpu:1", "/cpu:0"])`,
and the memory that runs out would be a GPU's; nothing in this guide has run on a GPU. The
logical CPUs must be made before anything else touches TensorFlow.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # no C++ INFO or WARNING lines
# TensorFlow's own CPU allocator (not the system one): the probe at the end reads its statistics.
os.environ["TF_ONEDNN_USE_SYSTEM_ALLOCATOR"] = "false"

import collections
import logging
import time

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)

import keras  # noqa: E402
import tf_hetbatch as hb  # noqa: E402

# tf_hetbatch speaks through `logging`: show its warnings, once each.
log = logging.getLogger("tf_hetbatch")
log.addHandler(logging.StreamHandler())
log.handlers[-1].setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
log.propagate = False

DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2"]


def regression_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def max_weight_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


"""
## Bounds, not shares

`strategy.set_micro_batch_limits([m_0, m_1, ...])` takes one entry per replica, in replica
order: an int, the most samples that replica computes at once, or `None` for no bound.
`strategy.micro_batch_limits` reads them back. A bound limits what a replica computes at
once, not its share of the global batch: a share b_k above m_k is computed in
ceil(b_k / m_k) near-equal micro-batches inside the same training step, one after the other,
their weighted gradients summed, and then the step's one all-reduce runs as usual.

To see the micro-batches, the model below starts with a layer that records, from inside the
step, how many samples each replica computed at a time.
"""

SEEN = []  # (replica, samples) of every call in training


class RecordBatchSizes(keras.layers.Layer):
    def call(self, inputs, training=None):
        if not training:
            return inputs
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group

        def record(replica, samples):
            SEEN.append((int(replica), int(samples)))
            return np.int32(0)

        token = tf.py_function(record, [replica, tf.shape(inputs)[0]], tf.int32)
        with tf.control_dependencies([token]):
            return tf.identity(inputs)


def make_model(first_layer=None):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((8,)), first_layer or RecordBatchSizes(),
        keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2)),
        keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


def calls_per_replica(steps):
    """Each replica's calls of one step, from the calls recorded over `steps` steps."""
    calls = collections.defaultdict(list)
    for replica, samples in SEEN:
        calls[replica].append(samples)
    return {replica: sizes[:len(sizes) // steps] for replica, sizes in sorted(calls.items())}


"""
Replica 1 gets 18 of the 32 samples of each step but may compute only 6 at once. Set the
bounds before `fit`: they take effect in steps traced after the first call.
"""

x, y = regression_data(320)  # 10 steps of 32

strategy = hb.HeteroMirroredStrategy(DEVICES)
strategy.set_batch_sizes([8, 18, 6])
strategy.set_micro_batch_limits([None, 6, None])
print("micro_batch_limits:", strategy.micro_batch_limits)
with strategy.scope():
    model = make_model()
history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0).history
print("calls in one step, per replica:", calls_per_replica(steps=10))

"""
Replica 1 computed its 18 samples as 3 micro-batches of 6. The update is still one device's on
the whole global batch, and the logs are the true global means:
"""

reference = make_model(keras.layers.Identity())
ref_history = reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0).history
print("weights vs one device:", max_weight_diff(reference, model))
print("loss, mae:", round(history["loss"][0], 6), round(history["mae"][0], 6),
      "one device:", round(ref_history["loss"][0], 6), round(ref_history["mae"][0], 6))
assert max_weight_diff(reference, model) <= 1e-5

"""
The step reads the bounds from a host variable and takes each replica's share from the shape
of its batch, so the micro-batch count follows each step's actual batch: a new split, or new
bounds, need no retrace. Here the next epoch runs at another split with other bounds
(replica 0 now bounded at 7 with a share of 20, replica 1 within its bound):
"""

strategy.set_batch_sizes([20, 4, 8])
strategy.set_micro_batch_limits([7, 6, None])
SEEN.clear()
model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
print("calls in one step, per replica:", calls_per_replica(steps=10))
print("after two epochs, weights vs one device:", max_weight_diff(reference, model))
assert max_weight_diff(reference, model) <= 1e-5

"""
This holds with `steps_per_execution` > 1, with a split switched during `fit`, when a run
resumes from a checkpoint, and across several workers. It holds for custom `train_step`s as
Keras's guide writes them and for custom training loops too (see
[Custom steps and loops](custom_steps.md)); only training steps are cut into micro-batches:
`evaluate` and `predict` compute each replica's share at once.

What differs from one device, and what is refused:

- Layers whose forward pass depends on the batch see each micro-batch as a batch of its own,
  as in any gradient accumulation: BatchNormalization's batch statistics are per micro-batch.
  (Plain BatchNormalization is per replica under any strategy anyway.)
- A model with SyncBatchNormalization is refused while bounds are set, even all `None`: its
  statistics all-reduce in every forward pass, which replicas with different micro-batch
  counts would not meet. Give the replicas shares within their bounds, use plain
  BatchNormalization, or lift the bounds (`strategy.set_micro_batch_limits(None)`).
- A step that applies gradients more than once (a GAN's generator step after its
  discriminator's reads the first update, but micro-batches accumulate every gradient before
  any update) is refused while bounds are set, when the step is traced.
- A loss with a Keras mask (`Embedding(mask_zero=True)`, `Masking`) divides by the valid
  entries of the whole step, which micro-batches cannot know: refused while bounds are set;
  pass padding as `sample_weight` instead, or lift the bounds.
- In a custom loop, `tf.nn.scale_regularization_loss` would add the regularization once per
  micro-batch: refused while bounds are set, naming `model.compute_loss` (which adds the
  regularization losses weighted by each micro-batch's share) as the fix. A step that returns
  per-sample values (a shape that depends on the micro-batch) is refused too; return metric
  results or scalars.

Every refusal says why and names the fix.

## Balancing bounded replicas

`DynamicBatching` (and `hb.Balancer`) balance on measured time, not on memory: a fast replica
with little memory keeps its fair share and computes it in several micro-batches, whose fixed
cost per micro-batch its time model learns like any other cost. To cap a replica's share
itself, use `DynamicBatching(max_sizes=...)`, a hard bound on the share: one int for every
replica, a list of one int per replica, or `None` (the default: no cap).
"""

dynamic = hb.DynamicBatching(initial="uniform", max_sizes=[32, 8, 32],
                             warmup_steps=2, interval=3)
strategy = hb.HeteroMirroredStrategy(DEVICES)
strategy.set_micro_batch_limits([None, 6, None])
with strategy.scope():
    capped = make_model()
capped.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[dynamic])
print("splits DynamicBatching applied:", [entry["new"] for entry in dynamic.history])
assert all(entry["new"][1] <= 8 for entry in dynamic.history)

"""
The even split of 32 over 3 replicas would give replica 1 eleven samples; the cap made the
static split give it 8 (which it computes as 2 micro-batches of at most 6), and no later split
gave it more. (These logical CPUs share 2 cores, so the times it balanced on say little.)

## Surviving a step that runs out of memory

Once bounds are set, even all `None`, Keras's `fit` runs each training step so that it can be
run again: it takes the batch from the iterator first, and keeps a copy of what the step
changes besides the weights. If the step fails with `tf.errors.ResourceExhaustedError`
before its update gate, the strategy

- reads the failing replica from the error (the device in TensorFlow's
  "OOM when allocating tensor ... on <device>" message),
- sets that replica's bound to half the micro-batch that failed (rounded down),
- logs one WARNING naming the replica and its new bound,
- restores the metrics, BatchNormalization's moving statistics and the dropout seeds, and
- runs the step again on the same batch,

until it fits. The update gate is the point where every local replica's micro-batches are
done and the step's one all-reduce may start: before it the step has applied nothing, so the
run is the one that never failed.

This machine has no small device, so the model below stands one in: on replica 1, a batch of
more than 5 samples asks for a 4 TiB tensor. That is a real allocation, which fails as a full
device does. TensorFlow's own CPU allocator (which this guide selects at the top, with
`TF_ONEDNN_USE_SYSTEM_ALLOCATOR=false`), like its GPU allocator, waits up to 10 s for memory
to be freed before it reports the failure, so this part takes about 10 s longer. The system
allocator (`TF_ONEDNN_USE_SYSTEM_ALLOCATOR=true`, set before TensorFlow starts) fails at
once, but keeps no statistics for the probe at the end of this guide.
"""


class OutOfMemoryAbove(keras.layers.Layer):
    """Identity; in training, replica `replica` runs out of memory above `samples` samples."""

    def __init__(self, replica, samples, **kwargs):
        super().__init__(**kwargs)
        self.replica, self.samples = replica, samples

    def call(self, inputs, training=None):
        if not training:
            return inputs
        context = tf.distribute.get_replica_context()
        too_big = tf.logical_and(tf.equal(context.replica_id_in_sync_group, self.replica),
                                 tf.shape(inputs)[0] > self.samples)
        length = tf.where(too_big, tf.constant(2**40, tf.int64), tf.constant(1, tf.int64))
        waste = tf.zeros(tf.reshape(length, [1]), inputs.dtype)  # 4 TiB when too big
        return inputs + 0.0 * waste[0]


strategy = hb.HeteroMirroredStrategy(DEVICES)
strategy.set_batch_sizes([8, 18, 6])
strategy.set_micro_batch_limits([None, 12, None])  # replica 1: 2 micro-batches of 9
with strategy.scope():
    fragile = make_model(OutOfMemoryAbove(replica=1, samples=5))
start = time.perf_counter()
fragile.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
print(f"fit took {time.perf_counter() - start:.1f} s; micro_batch_limits now:",
      strategy.micro_batch_limits)
print("steps trained:", strategy.steps_trained,
      "optimizer steps:", int(fragile.optimizer.iterations.numpy()))

one_device = make_model(keras.layers.Identity())
one_device.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
print("weights vs one device:", max_weight_diff(one_device, fragile))
assert max_weight_diff(one_device, fragile) <= 1e-5

"""
The first step failed on micro-batches of 9 samples; the bound became 4 and the same batch ran
again in 5 micro-batches of at most 4. Each of the 10 steps was applied once, and the run
equals one device's. `ResumableCheckpoint` saves the bounds with each checkpoint, so a bound
lowered this way stays lowered when the run resumes (per replica, the lower of the bound the
run sets and the one saved; see [Checkpoints and restarts](checkpoints.md)).

What is not run again:

- A step that ran out of memory after its update gate: in the all-reduce (on a GPU it packs
  the gradients, 2-3 times their bytes) or in the optimizer's update, which updates the
  variables one by one, so part of the update may be applied. Running it again would apply
  that part twice, so its error is raised, naming the replica and the fix: free that memory
  on the device (no other process on it, a smaller model or optimizer state, or bounds from
  `hb.probe_micro_batch_limits`, which leave room for the all-reduce), then resume from the
  last checkpoint. A lower micro-batch bound would not help: that memory does not grow with
  the batch.
- A micro-batch of one sample that does not fit: the error is raised (every worker stops with
  it), as without bounds.
- A step whose batch is not cut (a strategy of one replica): it never closes its gate, so it
  cannot tell where it failed, and its error is raised.
- With `steps_per_execution` > 1 no step is guarded: a failed execution has already applied
  its earlier steps.

Across workers, the others are waiting in the step's all-reduce when one worker's replica
fails before its gate. The failing worker joins that all-reduce with a stand-in that tells
them which bound to lower; no worker applies that step, every worker lowers the same bound,
and they all run the same batch again. This covers Keras's own `train_step`, whose one
all-reduce carries the gradients and the metrics. A custom `train_step` has a second
collective (its logs) that cannot be stood in for: its out-of-memory error ends the run.

The cost of the guard is about 0.6-0.8 ms a step (one host, 3 logical CPUs, a small dense
model: the batch taken eagerly, the metric and state variables copied), plus, across workers,
one read of the failure flags after each step. On a GPU each failure costs at least 10 s
before the step can run again: TensorFlow's GPU allocator waits that long for memory to be
freed, and logs its memory map.

## Measuring bounds up front

`hb.probe_micro_batch_limits(make_model, data, devices)` measures a bound per device before
training. For each device alone it trains throwaway copies of the model at two batch sizes
(32 and 128 by default; `make_model` is called in a one-device strategy's scope, once per
device and size). Each size is warmed by one step (which builds the model, traces the step
and, on a GPU, lets cuDNN autotune), then the peak memory of the next `steps` steps (1 by
default) is read. The line through the two peaks is solved for the memory the device has:
the most samples one step fits.

The memory a device has is `memory_bytes=` if you give it (one int for all devices, or one per
device). Otherwise, on a GPU, it is the limit TensorFlow's allocator uses: a logical device's
`memory_limit`, else the GPU's total memory less TensorFlow's per-process reserve. Where
nvidia-smi's GPUs cannot be matched to TensorFlow's with certainty (MIG, a count mismatch, no
nvidia-smi), that GPU gets no bound and one warning naming `memory_bytes`. A GPU's bound also
leaves room for the all-reduce: 3 times the model's trainable bytes. CPUs share the host's
memory, so a CPU gets a bound only from `memory_bytes`, with no all-reduce room; the probe
reads TensorFlow's own CPU allocator, and under the system allocator
(`TF_ONEDNN_USE_SYSTEM_ALLOCATOR=true`), which keeps no statistics, it finds no bound and
says so in a warning. This has run on CPUs only.
"""


def make_conv_model():
    model = keras.Sequential([
        keras.Input((48, 48, 3)), keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(), keras.layers.Dense(32), keras.layers.Dense(4)])
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


rng = np.random.default_rng(0)
images = (rng.random((128, 48, 48, 3), dtype=np.float32), rng.integers(0, 4, 128))
probes = hb.probe_micro_batch_limits(make_conv_model, images, ["/cpu:0", "/cpu:1"],
                                     memory_bytes=[64 * 2**20, 48 * 2**20])
for probe in probes:
    print(f"{probe.device}: peak MiB {[round(p / 2**20, 1) for p in probe.peak_bytes]} "
          f"at batch sizes {list(probe.sizes)}, memory {probe.memory_bytes / 2**20:.0f} MiB "
          f"({probe.memory_source}) -> bound {probe.bound}")

strategy = hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1"])
strategy.set_micro_batch_limits([probe.bound for probe in probes])
print("micro_batch_limits:", strategy.micro_batch_limits)

"""
Each `MemoryProbe` also holds `memory_detail` (the figures behind `memory_bytes`, or why there
are none), `headroom_bytes` and `trainable_bytes`. A bound is an estimate from two points
(here the CPU allocator's peaks, and so the bounds, vary from run to run); a step that still
does not fit lowers it while training, as above. The warnings printed while the probe runs
(Keras: `shuffle=True` is ignored for a dataset; TensorFlow: functions retraced) come from
its throwaway models and are harmless.

## Where to go next

- [Checkpoints and restarts](checkpoints.md): lowered bounds survive a restart.
- [Mixed devices](mixed_devices.md): `DynamicBatching` on devices of different speeds.
- [Troubleshooting](../troubleshooting.md): errors and what they mean.
"""
