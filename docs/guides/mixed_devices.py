"""
# Mixed devices on one host

At the end of this guide you will have trained on two replicas of one host: with a split
you set yourself (also while `fit` runs), with a split `DynamicBatching` keeps balanced
against a slower replica, with the input pipeline forms that follow the split, and with
`steps_per_execution` > 1; and you will have read each replica's measured time.
"""

"""
## Naming the devices

`HeteroMirroredStrategy(devices)` takes the replica devices as `tf.distribute.MirroredStrategy`
does. CPUs and GPUs may be mixed: on a host with two GPUs whose CPU should train too, that is
`hb.HeteroMirroredStrategy(["/gpu:0", "/gpu:1", "/cpu:0"])`. With no argument it takes all
the host's GPUs, else its CPU. Replicas are numbered in the order of the list, and every
per-replica value (the split, the times) follows that order.

This machine has no GPU. The guide splits its CPU into two logical CPUs before anything else
touches TensorFlow, and names them as the replicas. Nothing in this guide ran on a GPU.
"""
import keras
import numpy as np
import tensorflow as tf

import tf_hetbatch as hb

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

strategy = hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1"])  # e.g. ["/gpu:0", "/cpu:0"]

"""
## The static split, from FLOPs

Before anything is measured, a split in proportion to each replica device's nominal peak
FLOP/s is the best guess. `strategy.part_capacities()` gives these peaks in replica order.
For a CPU the peak is its usable cores (capped by a cgroup CPU quota) x clock x FP32 FLOPs
per cycle from its instruction set; logical devices on one CPU share its peak equally. For a
GPU it is the vendor's dense FP32 figure, or the dense TF32 tensor-core figure on Ampere and
newer while TensorFlow's TF32 is on (its default), from a table, with an estimate by
compute capability for GPUs the table lacks.

Here the two logical CPUs have half of this CPU's peak each, so the static split is even.
The pure-Python core computes the same for devices you do not have: below, the split of a
global batch of 256 between a Tesla T4 and this machine's CPU.
"""
peaks = strategy.part_capacities()
print("replica peaks (GFLOP/s):", np.round(peaks / 1e9))
print("static split of 64 here:", hb.split_proportionally(64, peaks))

t4 = hb.gpu_capability("Tesla T4", compute_capability=(7, 5))
this_cpu = hb.cpu_capability()
mixed = hb.split_proportionally(256, [t4.peak_flops, this_cpu.peak_flops])
print(f"T4 {t4.peak_flops / 1e12:.1f} TFLOP/s, this CPU {this_cpu.peak_flops / 1e12:.2f} "
      f"TFLOP/s: static split of 256 = {mixed}")

"""
These are nominal figures: they ignore memory bandwidth, fixed costs per step and other
work on the machine. `DynamicBatching` corrects the split from measured times (below).

## Setting the split yourself

`strategy.batch_sizes` is the split in force; `strategy.set_batch_sizes([...])` sets it,
one size per replica, summing to the global batch B the data is batched by. It can be called
at any time: before `fit`, or during `fit` from a callback. There is no retrace and no
restart: the input pipeline reads the sizes once per global batch, so a change reaches the
replicas at most 3 steps later (the distributed iterator prefetches). The gradient weights
always follow the actual batch shapes of each step, so that lag never costs exactness. A
partial last batch is split in proportion to the sizes.

The callback below switches the split after step 4 and records, after each step, the
samples each replica trained (from `read_replica_times`, described at the end) and the
step's logged loss.
"""
GLOBAL_BATCH = 64
rng = np.random.default_rng(0)
x = rng.normal(size=(1000, 16)).astype("float32")  # 15 global batches of 64, then one of 40
y = (x[:, :4].argmax(axis=1) + (x[:, 4] > 1.0)).astype("int32") % 4


def make_model(steps_per_execution=1, extra_layers=()):
    model = keras.Sequential([keras.Input((16,)), *extra_layers,
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(4, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], steps_per_execution=steps_per_execution)
    return model


"""
The callback: `on_train_batch_end` reads the replicas' samples of the step just trained,
the step's logged loss, and after `after_step` steps asks for the new split.
"""


class SwitchAndRecord(keras.callbacks.Callback):
    def __init__(self, strategy, after_step, sizes):
        super().__init__()
        self.strategy, self.after_step, self.sizes = strategy, after_step, sizes
        self.samples, self.losses = [], []

    def on_train_begin(self, logs=None):
        self.before = self.strategy.read_replica_times()

    def on_train_batch_end(self, batch, logs=None):
        now = self.strategy.read_replica_times()
        self.samples.append((now - self.before).samples.astype(int).tolist())
        self.before = now
        self.losses.append(logs["loss"])
        if batch + 1 == self.after_step:
            self.strategy.set_batch_sizes(self.sizes)


"""
The split is set before `fit`, and switched from the callback. The data are numpy arrays
given with `batch_size=`: batch by the global batch size, as always.
"""
keras.utils.set_random_seed(0)
with strategy.scope():
    model = make_model()
initial_weights = model.get_weights()

strategy.set_batch_sizes([40, 24])
recorder = SwitchAndRecord(strategy, after_step=4, sizes=[16, 48])
model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0,
          callbacks=[recorder])
for step, samples in enumerate(recorder.samples, start=1):
    print(f"step {step:2d}: samples per replica {samples}")
print("split in force:", strategy.batch_sizes)

"""
The first steps train [40, 24]. After the call at step 4, at most 3 more steps train the
old split: global batches the pipeline had split already. The last global batch, of 40
samples, is split in proportion to [16, 48], as [10, 30].

Now one device, with no strategy, from the same initial weights on the same global batches.
The weights agree up to float rounding. So do the per-batch logs: with Keras's own
`train_step`, each step's gradients and every metric's sums travel in one all-reduce, so the
logs (progress bar, callbacks, History) are true global means at no extra cost.
"""
one_device = make_model()
one_device.set_weights(initial_weights)
one_device_losses = []
one_device.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0,
               callbacks=[keras.callbacks.LambdaCallback(
                   on_train_batch_end=lambda batch, logs: one_device_losses.append(logs["loss"]))])

weight_difference = max(float(np.max(np.abs(a - b)))
                        for a, b in zip(model.get_weights(), one_device.get_weights()))
log_difference = max(abs(a - b) for a, b in zip(recorder.losses, one_device_losses))
print(f"largest weight difference from one device: {weight_difference:.2e}")
print(f"largest per-batch loss difference from one device: {log_difference:.2e}")
assert weight_difference <= 1e-5 and log_difference <= 1e-5

"""
## `DynamicBatching`: a split that follows measured speed

To have a slower replica on this machine, the layer below does extra work on replica 1
only: 100 rounds of a 256 x 256 matrix product per sample in training, against 1 on replica
0. It stands in for a slower device; its output is its input.
"""


class SlowerOnReplica(keras.layers.Layer):
    """Identity. In training, replica `slow` spends `rounds` times the work per sample."""

    def __init__(self, slow, rounds, **kwargs):
        super().__init__(**kwargs)
        self.slow, self.rounds = slow, rounds

    def call(self, x, training=None):
        if not training:
            return x
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        rounds = tf.where(tf.equal(replica, self.slow), self.rounds, 1)
        w = tf.fill([256, 256], 0.003)
        _, h = tf.while_loop(lambda i, h: i < rounds, lambda i, h: (i + 1, tf.tanh(h @ w)),
                             [tf.constant(0), tf.tile(x, [1, 16])])
        return x + 0.0 * tf.stop_gradient(tf.reduce_sum(h))


"""
`hb.DynamicBatching()` first applies a static split, chosen by `initial`: `"flops"`
(default, the split above), `"probe"` (`probe_steps` steps measured on the even split, then
in proportion to the measured throughputs), `"uniform"`, or explicit sizes. After
`warmup_steps` it ends a measurement window every `interval` steps and hands the window's
per-replica times to its controller:

- per-replica time models t = alpha_k + beta_k * b_k, with their uncertainty;
- one change detector, for outliers and for interference that changes a replica's speed;
- a move to the equal-finish split (the one at which the models finish together) only when
  its expected saving pays for the switch;
- a search on the measured step time over a few candidate splits (successive elimination),
  which also undoes a move the step time shows slower: compute times miss costs such as a
  CPU quota spent in periods.

`controller="proportional"` gives the proportional rule of the method's source paper, the
alpha = 0 case. The controllers' tunables (e.g. `horizon`, `dead_band`, `step_time_search`)
are keyword arguments of `hb.ModelBasedController(...)`, validated as one
`hb.ControllerConfig`; pass such an object as `controller=`. `min_sizes` and `max_sizes`
bound each replica's share. With `log_dir` it writes TensorBoard balance
dashboards (one run per replica, a "Custom Scalars" layout) and a PNG at the end; `python
-m tf_hetbatch.plot LOG_DIR` draws the PNG for any log directory. See
[Reading the dashboards](dashboards.md).

Here it starts with `initial="probe"`, measuring the even split for 10 steps, with short
windows of 5 steps. The data is a `tf.data` pipeline of the usual form (next section).
"""
keras.utils.set_random_seed(0)
with strategy.scope():
    slow_model = make_model(extra_layers=[SlowerOnReplica(slow=1, rounds=100)])

x_big = rng.normal(size=(4096, 16)).astype("float32")
y_big = (x_big[:, :4].argmax(axis=1)).astype("int32")
dataset = (tf.data.Dataset.from_tensor_slices((x_big, y_big))
           .shuffle(4096, seed=1)
           .map(lambda features, label: (tf.clip_by_value(features, -3.0, 3.0), label))
           .batch(GLOBAL_BATCH)
           .prefetch(2))

dyn = hb.DynamicBatching(initial="probe", probe_steps=10, warmup_steps=3, interval=5)
slow_model.fit(dataset, epochs=2, verbose=0, callbacks=[dyn])
for change in dyn.history:
    print(f"step {change['step']:3d}: {change['old']} -> {change['new']}  ({change['reason']})")
print("settled on:", dyn.settled_batch_sizes)

"""
The probe gives replica 0 most of the batch; the controller then refines the split, and its
step-time search may try a few candidates around it. Logical CPUs share one processor's cores,
so the measurements are noisy and the exact sizes differ from run to run. `dyn.history` lists every
split applied, with the step and the reason. `dyn.settled_batch_sizes` is the split the
controller settled on (a candidate the search is measuring is left out): fix it with
`strategy.set_batch_sizes` in later runs to start there.

## Input work that follows the split

Every worker of a multi-worker job reads the same global batches and, for the pipelines
below, decodes and augments only its own replicas' samples. On one host the one process owns
every replica, so the pipeline runs as written and nothing is said about it; the forms
matter once you add workers ([Several workers](multi_worker.md)). They are:

- `source [.shuffle(n, seed)] .map(f)* .batch(B) [.prefetch]`, as in the pipeline above:
  the per-sample maps run after the split, each worker's on its own samples. Shuffle with a
  seed; an unseeded `Dataset.shuffle` there gets a seed all workers agree on.
- `fit(x, y, batch_size=B)` with arrays, as in the first `fit` above: each worker gathers only
  its own rows.
- `ds.batch(B).apply(hb.split_here()).map(g)`: declares that the batch-level maps after the
  marker act on each sample on its own (a per-sample decode or augmentation written with
  batched ops; not a mixup across samples or a normalisation by the batch's statistics).
  Used in the next section.

Same samples, same order, same results; seeded random augmentation stays reproducible, with
other draws than the unsplit pipeline's. Any other pipeline runs unsplit: every worker does
all of its per-sample work, with one warning naming why and how to write it so it splits.
`strategy.split_input_work = False` (before `fit`) keeps every pipeline unsplit. Workers
compare fingerprints of the global batches they trained at every collective of the
callbacks, and stop with the likely cause (an unseeded `fit(x, y, shuffle=True)`,
`deterministic=False`, different files) before a checkpoint of such steps is written.

Two costs are kept small. The split's own tf.data functions skip the Grappler pass that
TensorFlow runs on every function of every new iterator, so starting an epoch costs a few
milliseconds more than plain Keras, not tens. A used iterator is destroyed on a thread of its
own once nothing refers to it: with tf.data's autotuning on, its destruction can wait seconds
for the autotuning thread, and Keras drops each epoch's iterator at the next epoch's first
step, where every worker would otherwise wait for it.

## `steps_per_execution` > 1

`compile(steps_per_execution=n)` runs n steps per call into the graph: Keras's remedy for
the host's overhead per step. It fails under the stock `MirroredStrategy`
(keras-team/keras#19246); it works under both synchronous tf_hetbatch strategies.
Exactness, split switches, resuming and `DynamicBatching` windows count steps, not calls.
It pays where a step's fixed cost is large against its compute, e.g. on slow or capped
hosts.

Below: 4 steps per execution, an uneven split, and the `split_here()` pipeline form, checked
against one device on the same pipeline (without a strategy the marker does nothing).
"""


def scale_batch(features, label):  # acts on each sample of the batch on its own
    return features * 0.5, label


def marked_pipeline():
    return (tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
            .apply(hb.split_here()).map(scale_batch))


keras.utils.set_random_seed(0)
with strategy.scope():
    multi_step = make_model(steps_per_execution=4)
multi_step_initial = multi_step.get_weights()
strategy.set_batch_sizes([20, 44])
strategy.read_replica_times(reset=True)  # measure from here on (see "Per-replica times")
history = multi_step.fit(marked_pipeline(), epochs=2, verbose=0)

one_device = make_model()
one_device.set_weights(multi_step_initial)
one_device_history = one_device.fit(marked_pipeline(), epochs=2, verbose=0)
difference = max(float(np.max(np.abs(a - b)))
                 for a, b in zip(multi_step.get_weights(), one_device.get_weights()))
print(f"steps_per_execution=4, split {strategy.batch_sizes}: largest weight difference "
      f"{difference:.2e}; loss {np.round(history.history['loss'], 5)} vs one device "
      f"{np.round(one_device_history.history['loss'], 5)}")
assert difference <= 1e-5

"""
## One collective per training step

With Keras's own `train_step`, the gradients and every metric's sums travel in one
all-reduce (one pack), so the per-batch logs are true global means at no extra cost, at any
`steps_per_execution`. Its collective instance keys are fixed when the step is traced, so a
cluster sets the all-reduce up once, not at every step through the chief as the stock
`MultiWorkerMirroredStrategy` does; and a worker with one CPU replica reads its data through
a plain iterator, not a per-device one. A custom `train_step` keeps its own order: each
`apply` sums its gradients at once (a GAN's second step reads the first one's update), and
the logs' sums take a second all-reduce ([Custom steps and loops](custom_steps.md)).

## Per-replica times

`strategy.read_replica_times()` returns a `ReplicaTimes`, per replica in replica order:
compute seconds, samples, steps and step cycles, summed over the training steps so far.
A replica's compute time is its own work per step, without waiting for the others: from the
step's start to its local gradients being ready, before the all-reduce. On one host the
step starts when the replica's inputs are there; across workers it starts when the previous
all-reduce released the replica. A step cycle runs from one release to the next: the step
as the cluster lives it, and `.step_time` is the cluster's mean step. The measurements
travel in each step's all-reduce, so a read is local (no collective) and every worker reads
the same values. `read_replica_times(reset=True)` starts a new measurement, as
`DynamicBatching` does at each window; the read below covers the `steps_per_execution` fit.
"""
times = strategy.read_replica_times()
print("steps:", times.steps, "samples:", times.samples)
print("compute ms per step:", np.round(1e3 * times.time_per_step, 2),
      "samples per compute second:", np.round(times.throughput))

"""
The first step at each new per-replica batch shape is counted (samples, steps) but not
timed: it builds what that shape needs. Two settings change what can be measured:

- A step XLA compiles (`compile(..., jit_compile=True)`) can read no clock inside. It trains
  exactly, with no per-replica times: the split stays where it is (static, or
  `set_batch_sizes`) and the chief says so once. Compile with `jit_compile=False` to balance
  dynamically. This has run here on one replica only: XLA on several logical CPUs fails for
  the stock strategy too.
- Under op determinism (`tf.config.experimental.enable_op_determinism()`, which refuses
  `tf.timestamp`) the stamps read the host clock through `tf.py_function`, 0.16 ms more per
  stamp. Training is exact and reproducible at a fixed split (`set_batch_sizes`); a
  `DynamicBatching` split follows measured times, so its float rounding may differ from run
  to run.
"""
