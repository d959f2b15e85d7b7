"""
# Reading the balance dashboards

By the end you will have run a short `fit` whose balance dashboards, TensorBoard runs and a
PNG, are written under `./dashboards_logs`, and you will know what each series means, how to
read the same numbers in code (`read_replica_times()`), and what the demo shows.
"""

"""
## Devices, and a slow one

This machine has no GPU, so the guide splits its CPU into three logical CPUs, one replica
each, before anything else touches TensorFlow. On a machine with GPUs you would name real
devices instead, e.g. `hb.HeteroMirroredStrategy(["/gpu:0", "/gpu:1", "/cpu:0"])`.

"""
import os
import shutil
import subprocess
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tf_hetbatch as hb

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)

"""
Logical CPUs are equally fast, and they share the same two cores, so a balanced run would
give flat, dull charts. To see the dashboards move, replica 2 is made slow on purpose:
`SlowDevice` below waits 0.5 ms per sample on replica 2, in training only (a sleep in a
`tf.numpy_function`, declared stateless so the replicas' waits do not queue behind each
other). It stands in for a device many times slower than the others; it changes no value.
On a real mixed machine you would not need it.
"""


class SlowDevice(keras.layers.Layer):
    """Identity. In training, replica `slow` also waits `seconds_per_sample` per sample."""

    def __init__(self, slow, seconds_per_sample, **kwargs):
        super().__init__(**kwargs)
        self.slow, self.seconds_per_sample = slow, seconds_per_sample

    def call(self, x, training=None):
        if not training:
            return x
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group

        def wait(replica, samples):
            if replica == self.slow:
                time.sleep(self.seconds_per_sample * samples)
            return np.float32(0.0)

        token = tf.numpy_function(wait, [replica, tf.shape(x)[0]], tf.float32, stateful=False)
        return x + 0.0 * tf.reshape(token, [])


"""
## A fit that writes the dashboards

`DynamicBatching(log_dir=...)` writes the balance dashboards while it balances. Here it
starts from the even split (`initial="uniform"`), measures windows of 5 steps after 3
warm-up steps, and moves samples off the slow replica. `keras.callbacks.TensorBoard` can
share the same `log_dir`: its runs (`train`, `validation`) and the balance runs (all under
`hetbatch/`) sit side by side in one TensorBoard.
"""
LOG_DIR = os.path.abspath("dashboards_logs")
shutil.rmtree(LOG_DIR, ignore_errors=True)  # a fresh log directory for each run

strategy = hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
rng = np.random.default_rng(0)
x = rng.normal(size=(96 * 40, 16)).astype("float32")
y = (x @ rng.normal(size=(16, 1))).astype("float32")

with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), SlowDevice(slow=2, seconds_per_sample=5e-4),
                              keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")

balancing = hb.DynamicBatching(initial="uniform", warmup_steps=3, interval=5, log_dir=LOG_DIR)
model.fit(x, y, batch_size=96, epochs=2, validation_split=0.1, verbose=0,
          callbacks=[balancing, keras.callbacks.TensorBoard(LOG_DIR)])

for change in balancing.history:
    print(f"step {change['step']:3d}: {change['old']} -> {change['new']}  ({change['reason']})")
print("settled split:", balancing.settled_batch_sizes)

"""
Each line is one change of split: the step it was decided at (on one host it reaches the
replicas at most 3 steps later), the old and new split, and the controller's reason. The
first line is the static split. A "step-time search" line is the controller trying a
neighbouring split and keeping the faster one. `settled_batch_sizes` is the split it settled
on (a try in flight left out): pass it to `strategy.set_batch_sizes` to train later runs at
a fixed split.

## What is written where
"""
for root, _, files in sorted(os.walk(LOG_DIR)):
    for name in sorted(files):
        print(os.path.relpath(os.path.join(root, name), LOG_DIR).split(".tfevents")[0])

"""
- `hetbatch/replica_0`, `replica_1`, `replica_2`: one TensorBoard run per replica, with the
  same tags, so in the Scalars tab each replica gets its own colour.
- `hetbatch/cluster`: the aggregates, the text of every change of split, and the layout of
  the Custom Scalars tab.
- `train`, `validation`: `keras.callbacks.TensorBoard`'s own runs.
- `hetbatch_balance.png`: the picture, drawn at the end of `fit` (below).

Only the chief writes (in multi-worker training the other workers write nothing). The
windows are buffered and written every 50 windows and at the end of `fit`, so a running
TensorBoard sees them in batches.

## Opening it

```bash
tensorboard --logdir dashboards_logs
```

and open the **Custom Scalars** tab. Its layout has two categories:

- **tf_hetbatch balance**, one chart per series with every replica overlaid: "Batch size per
  replica (samples/step)", "Compute time per replica (ms/step)", "Throughput per replica
  (samples/s)", "Wait time per replica (ms/step)";
- **tf_hetbatch cluster**: "Balance efficiency mean(t)/max(t)", "Step time vs ideal (ms)",
  "Aggregate throughput (samples/s)", "Global batch (samples/step)".

Asynchronous training adds a third, **tf_hetbatch staleness** (see the
[asynchronous training guide](async_training.md)). The **Text** tab lists the changes of
split under `hetbatch/adjustment`.

## What each series means

Each point is one measurement window (`interval` steps), drawn at the step that ends it:
the balancer's step count, which goes on across the `fit`s of one `DynamicBatching`. The
values are means over the window's steps.

| tag (run) | what it is |
|---|---|
| `hetbatch/batch_size` (replica_k) | b_k: the replica's mean samples per step |
| `hetbatch/compute_time_ms` (replica_k) | t_k: its compute time per step, from the step's start to its local gradients being ready (its own work: without waiting for the others, before the all-reduce) |
| `hetbatch/replica_throughput` (replica_k) | b_k / t_k, in samples per second of compute |
| `hetbatch/wait_time_ms` (replica_k) | max(t) - t_k: how long it waits for the slowest replica each step |
| `hetbatch/balance_efficiency` (cluster) | mean(t) / max(t): 1.0 when every replica finishes at once |
| `hetbatch/step_time_ms` (cluster) | the mean wall time of a whole step (one process: its clock; several workers: the step cycle, the same on every worker) |
| `hetbatch/throughput` (cluster) | sum(b) / step time, samples per second |
| `hetbatch/global_batch` (cluster) | sum(b) = B, constant unless the data's batch changes |
| `hetbatch/ideal_step_time_ms` (cluster) | a balanced split's step time, written only when the writer is given one (`BalanceWriter(ideal=True)` or `log_window(ideal_step_time=...)`); `DynamicBatching` writes the step time alone |
| `hetbatch/adjustment` (cluster, text) | "**step N**: batch split [...] -> [...] (global batch B -> B); reason: ..." |

A replica whose compute time reads 0 while it had samples (a step shorter than the clock's
1 microsecond resolution) is "not measured": its batch size is drawn, its time, throughput
and wait are not, nor that window's balance efficiency.

What to look for: before the first move, replica 2's compute time towers over the others
and their wait times are large; after it, replica 2 keeps few samples (here often 1, the
default `min_sizes=1`), the compute times come together, the waits shrink, the balance
efficiency rises and the step time falls. Where the controller searches, the batch sizes
step between neighbouring splits.

The same numbers can be read back in code. `read_balance` returns what the event files
hold; here it is checked against the windows `DynamicBatching` kept in memory
(`balancing.windows`, the last 10,000).
"""
from tf_hetbatch.dashboards.plot import read_balance

run = read_balance(LOG_DIR)
print("replica runs:", run.num_replicas, " windows:", len(run.batch_sizes[0].steps))
assert list(run.batch_sizes[0].steps) == [w["step"] for w in balancing.windows]
first, last = balancing.windows[0], balancing.windows[-1]
for name, window in (("first", first), ("last", last)):
    times = np.array(window["time_per_step"])
    print(f"{name} window (step {window['step']}): batch sizes "
          f"{np.round(window['samples_per_step'], 1).tolist()}, compute ms "
          f"{np.round(1e3 * times, 1).tolist()}, step ms {1e3 * window['step_time']:.1f}, "
          f"balance efficiency {times.mean() / times.max():.2f}")
print(f"mean balance efficiency: {run.mean_balance_efficiency:.2f}")

"""
## The picture

At the end of `fit`, `DynamicBatching` draws `hetbatch_balance.png` in `log_dir` if
matplotlib is installed (`pip install "tf_hetbatch[plot]"`; without it you get the event
files and one INFO log line saying so). It has two panels over the steps: the batch size
of each replica (each value drawn over the window it is the mean of) and the compute time
of each replica, one colour and one legend entry per replica, a dashed vertical line at
every change of split, and the mean balance efficiency in the title.

![The balance PNG of the demo's DynamicBatching run: three workers capped 3:5:12](../img/balance.png)

This one is the demo's (`examples/demo.py`: three worker processes capped in the shape 3:5:12,
one epoch of in-memory Fashion-MNIST), redrawn by `docs/make_figures.py`: the slowest worker's
replica 0 gets about 18 of 128 samples, the fastest's replica 2 about 78.

`python -m tf_hetbatch.plot LOG_DIR [--out file.png]` draws it for any log directory, also
while training runs or long after (it prints the PNG's path; it exits with 1 when the logs
or matplotlib are missing). In Python: `hb.plot_balance(log_dir, out_png=None)`.
"""
png = os.path.join(LOG_DIR, "hetbatch_balance.png")
print("written by the fit:", png, os.path.getsize(png), "bytes")
again = os.path.join(LOG_DIR, "balance_again.png")
command = [sys.executable, "-m", "tf_hetbatch.plot", LOG_DIR, "--out", again]
print("python -m tf_hetbatch.plot printed:",
      subprocess.run(command, check=True, capture_output=True, text=True,
                     timeout=120).stdout.strip())
print(f"open the dashboards: tensorboard --logdir {LOG_DIR}  (Custom Scalars tab)")

"""
## Per-replica times in code: `read_replica_times()`

The dashboards draw what the strategy measures in every step. `strategy.read_replica_times()`
gives you the same measurements directly, as a `ReplicaTimes`: per replica its compute
seconds, samples and steps accumulated (and its step cycles, from one release by the step's
all-reduce to the next). The measurements travel in each step's all-reduce, so a read is
local and every worker reads the same values. Its properties are the per-step means:
`time_per_step`, `samples_per_step`, `throughput` (samples per compute second) and
`step_time` (the cluster's mean step: the longest replica's mean cycle).

`reset=True` makes the next read cover only later steps. `DynamicBatching` reads that way at
every window, so read it yourself outside a balanced `fit` (or without `reset`, and take
differences). Here: one more epoch at the settled split, without the callback. The
[mixed devices guide](mixed_devices.md) says more about what the clock measures.
"""
strategy.set_batch_sizes(list(balancing.settled_batch_sizes))
strategy.read_replica_times(reset=True)  # start the count here
model.fit(x, y, batch_size=96, epochs=1, verbose=0)
times = strategy.read_replica_times()
print("steps:", times.steps.astype(int).tolist())
print("samples per step:", np.round(times.samples_per_step, 1).tolist())
print("compute ms per step:", np.round(1e3 * times.time_per_step, 1).tolist())
print("throughput (samples/s):", np.round(times.throughput).astype(int).tolist())
print(f"step time: {1e3 * times.step_time:.1f} ms")

"""
`hb.Balancer(strategy, log_dir=...)` writes the same dashboards from a custom training loop
(see the [custom steps guide](custom_steps.md)), and `hb.BalanceWriter(log_dir,
num_replicas)` writes windows you measured yourself in the same layout.

## The demo

`examples/demo.py` is the project's demonstration on a heterogeneous cluster. It takes 4-6
minutes on a 2-core machine, so this guide does not run it:

```bash
python examples/demo.py
```

It starts 3 worker processes on 127.0.0.1 through the launcher, with CPU caps in the shape
3:5:12 (`--caps`, default `0.24,0.4,0.96` CPUs), and trains a CNN on Fashion-MNIST twice:
once with the stock even split and once with `DynamicBatching()`. The CNN has 2 convolutions
of 32 filters (`--filters`): with a smaller model, a capped worker's step on a fast CPU is
mostly fixed cost, which no split removes. The data is real Fashion-MNIST from Debian's
`dataset-fashion-mnist` package, or a labelled synthetic stand-in without it, written once
as PNG-encoded TFRecord files (cached) and read with a PNG decode and augmentation per
sample; each worker decodes only its own replicas' samples.

It prints, for both runs side by side: time per epoch, median step time, the epoch's first
step, balance efficiency, the final split and test accuracy; then the speedup per epoch and
per step (with the naive ceiling sum X / (K min X)), and per worker its samples, compute
time and input time per step, for each run. Training is exact under any split, so both runs
learn the same model. It ends with the `tensorboard --logdir` command and the PNG of the
`DynamicBatching` run (under `--out`, default a new temporary directory).

Options: `--pipeline arrays` trains from in-memory arrays; `--input-work unsplit` makes
every worker decode every sample, as before the input split; `--layout 1,2 --caps
0.24,0.96` has worker 1 host 2 replicas; `--steps 3` is a tiny run (the test suite's).
Measured figures, the benchmarks and how to reproduce them are in `BUILD_NOTES.md` at the
top of the repository; each benchmark writes its plots next to its JSON output.
"""
