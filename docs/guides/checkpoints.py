"""
# Checkpoints, restarts and preemption

Make a training run survive being stopped, killed or preempted, and resume it in the middle of
an epoch exactly where its last checkpoint left it. At the end you will have a run that
stopped, resumed, got a preemption notice, resumed again on another number of replicas, and
ended with the weights of an uninterrupted run on one device.

## Setup

The replicas here are logical CPUs made from this machine's CPU (on a real machine you would
list your devices, e.g. `hb.HeteroMirroredStrategy(["/gpu:0", "/gpu:1", "/cpu:0"])`; nothing
in this guide has run on a GPU). Three logical CPUs are made, so that a later run can resume
on another number of replicas. The checkpoints go under the current directory, in
`./checkpoints_guide/` (and a damaged copy in `./checkpoints_guide_damaged/`).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # no C++ INFO or WARNING lines

import glob
import logging
import shutil
import signal

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)

import keras  # noqa: E402
import tf_hetbatch as hb  # noqa: E402

# tf_hetbatch speaks through `logging`: show its INFO lines and warnings, once each.
log = logging.getLogger("tf_hetbatch")
log.addHandler(logging.StreamHandler())
log.handlers[-1].setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
log.setLevel(logging.INFO)
log.propagate = False

DIRECTORY = "checkpoints_guide"
shutil.rmtree(DIRECTORY, ignore_errors=True)  # start afresh each time the guide runs

GLOBAL_BATCH, EPOCHS = 32, 3
rng = np.random.default_rng(0)
x = rng.normal(size=(320, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(320, 1))).astype("float32")
STEPS_PER_EPOCH = len(x) // GLOBAL_BATCH  # 10


def dataset():
    # The same global batches in the same order in every run: a seeded shuffle, drawn once.
    return (tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(len(x), seed=7, reshuffle_each_iteration=False)
            .batch(GLOBAL_BATCH))


def make_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    # Momentum: the optimizer has state of its own, which the checkpoint must carry too.
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    return model


def max_weight_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


"""
The yardstick: one device, no strategy, three epochs without a break.
"""

reference = make_model()
reference.fit(dataset(), epochs=EPOCHS, shuffle=False, verbose=0)

"""
## Saving: `ResumableCheckpoint`

`hb.ResumableCheckpoint(directory, save_every_steps=50, keep=2, dynamic_batching=None)` is a
Keras callback. Call `restore(model)` before `fit`, on every worker, and pass what it returns
as `fit(initial_epoch=...)`: 0 on a fresh start, else the epoch to resume in.

It saves every `save_every_steps` global steps, at the end of each epoch, and on a preemption
notice. Each checkpoint is one ordinary TensorFlow checkpoint (`tf.train.Checkpoint` with
`tf.train.CheckpointManager`), `<directory>/ckpt-<step>`, written by the chief only, and it
holds the model, its optimizer and the run's position: the global step, the epoch and the
batches of it already done, the split (`strategy.batch_sizes`), the replica count, the
`DynamicBatching` state given as `dynamic_batching`, and the memory bounds
(`strategy.micro_batch_limits`, see [Memory-bounded replicas](memory.md)). The manager keeps
the newest `keep`. Every file goes through `tf.io.gfile`, so any TensorFlow file system works:
a shared file system, `gs://`, `s3://` (with tensorflow-io), `ram://`.

The first run trains on two replicas with `DynamicBatching` and stops early, after step 13 of
30, in the middle of its second epoch (a callback sets `model.stop_training`, as a time budget
would).
"""


class StopAfter(keras.callbacks.Callback):
    def __init__(self, steps):
        super().__init__()
        self.steps, self.seen = steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.steps:
            self.model.stop_training = True


strategy = hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = make_model()
dynamic = hb.DynamicBatching(warmup_steps=2, interval=3)
ckpt = hb.ResumableCheckpoint(DIRECTORY, save_every_steps=4, dynamic_batching=dynamic)
initial_epoch = ckpt.restore(model)  # 0: nothing to resume yet
model.fit(dataset(), epochs=EPOCHS, initial_epoch=initial_epoch, shuffle=False, verbose=0,
          callbacks=[dynamic, ckpt, StopAfter(13)])
latest = ckpt.latest()
print("latest checkpoint:", {key: latest[key] for key in
                             ("path", "step", "epoch", "batch", "batch_sizes", "num_parts")})
print("files:", sorted(os.listdir(DIRECTORY)))

"""
Saves came at steps 4, 8, 10 (the end of epoch 0) and 12, and one at step 13, where `fit`
stopped: an epoch that ends early is saved as unfinished (epoch 1, 3 of its batches done).
`keep=2` (the default) left the two newest. The file `checkpoint` is the manager's state
file: it is replaced only after a checkpoint's files are written, so it names whole
checkpoints only.

## Resuming in the middle of an epoch

A new process builds the strategy and the model as the first did, and restores (here the
same process plays it, with a new strategy, model and callback). `restore`
loads the weights and the optimizer's variables, puts back the split and the
`DynamicBatching` state, and tells the strategy to resume at step 13 with the first 3 global
batches of epoch 1 dropped from the input pipeline, since they were trained. So the next
`fit` starts at the first batch not trained: nothing is trained twice and nothing is skipped.

This second run gets a preemption notice: a SIGTERM to this process after its fifth step.
"""


class SigtermAfter(keras.callbacks.Callback):
    """Sends this process a SIGTERM, as a cloud platform does before it takes a VM away."""

    def __init__(self, steps):
        super().__init__()
        self.steps, self.seen = steps, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.steps:
            os.kill(os.getpid(), signal.SIGTERM)


strategy = hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = make_model()
dynamic = hb.DynamicBatching(warmup_steps=2, interval=3)
ckpt = hb.ResumableCheckpoint(DIRECTORY, save_every_steps=4, dynamic_batching=dynamic)
initial_epoch = ckpt.restore(model)
print("resumes at epoch", initial_epoch, "after step", strategy.steps_trained,
      "with the split", strategy.batch_sizes)
try:
    model.fit(dataset(), epochs=EPOCHS, initial_epoch=initial_epoch, shuffle=False, verbose=0,
              callbacks=[dynamic, ckpt, SigtermAfter(5)])
except SystemExit as exit_:
    print("fit raised SystemExit with code", exit_.code,
          "(hb.RESTART_EXIT_CODE is", hb.RESTART_EXIT_CODE, "); saved at step", ckpt.preempted_at)

"""
## Preemption notices

Spot and preemptible VMs, and evicted pods, are taken away with a notice: a SIGTERM, then a
SIGKILL some seconds later. While `fit` runs, `ResumableCheckpoint` turns a SIGTERM to any
worker (or `ckpt.request_preemption()`, callable from any thread) into one checkpoint at one
step that every worker agrees on, then exits with `hb.RESTART_EXIT_CODE` (42), so the relaunch
redoes no step. On one host the save comes at the next step boundary: above, the signal arrived
after step 18 (the fifth step of that run) and the save came at step 19. Across workers it
comes one step after the next boundary: the worker that got the notice posts
"save at step S + 1" to TensorFlow's coordination service and waits for every worker to
acknowledge it, and synchronous workers are never more than one step apart. At an epoch's
last step the checkpoint is that epoch's end, without its validation. In steady state this
costs nothing per step.

- `on_notice="exit"` (the default) raises `SystemExit(42)` out of `fit`;
  `on_notice="stop"` ends `fit` normally instead, `ckpt.preempted_at` says the step, and your
  script exits (with `hb.RESTART_EXIT_CODE`, to be restarted) when it is done.
- A SIGTERM is caught only if `fit` runs in the main thread; `request_preemption()` works from
  any thread. While `fit` runs, a SIGTERM does not end the process: it asks for the save.
- A SIGKILL (a process killed outright, or the SIGKILL after the grace period) cannot be
  caught: the run loses the steps since the last save, at most `save_every_steps - 1`.
- `hb.AsyncTrainer`'s chief does the same on a SIGTERM, with the same checkpoints (see
  [Asynchronous training](async_training.md)).

Exit code 42 tells whatever restarts the job that this was a planned stop. tf_hetbatch's
launcher restarts the cluster on it without counting it in `--max-restarts`; a cluster tool
can do the same, e.g. a Kubernetes Job's `podFailurePolicy` rule
`onExitCodes: {operator: In, values: [42]}` with `action: Ignore`. The launcher can rehearse a
notice: `--preempt "30:1/term"` sends worker 1 a SIGTERM 30 s after the start, then a SIGKILL
`--grace` seconds later if it still runs. `--grace` defaults to 30 s, Kubernetes' default
`terminationGracePeriodSeconds`: a save and exit on a notice was measured at up to 7.5 s, and
a grace of 3 s was too short (such a notice ended in a SIGKILL). Tasks that exit sooner are
not waited for. Give `--grace` your platform's grace period.

## Resuming on another number of replicas

The relaunch here has three replicas instead of two (on a cluster: a worker came back with
another device, or the job restarts on fewer workers). The global batch stays 32; it is split
evenly over the new replicas, the `DynamicBatching` state starts afresh, and one INFO line
says so. The update is still one device's on the whole global batch, so the run stays exact.
"""

strategy = hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
with strategy.scope():
    model = make_model()
dynamic = hb.DynamicBatching(warmup_steps=2, interval=3)
ckpt = hb.ResumableCheckpoint(DIRECTORY, save_every_steps=4, dynamic_batching=dynamic)
initial_epoch = ckpt.restore(model)
print("resumes at epoch", initial_epoch, "after step", strategy.steps_trained,
      "with the split", strategy.batch_sizes)
model.fit(dataset(), epochs=EPOCHS, initial_epoch=initial_epoch, shuffle=False, verbose=0,
          callbacks=[dynamic, ckpt])

print("steps trained:", strategy.steps_trained,
      "optimizer steps:", int(model.optimizer.iterations.numpy()))
print("weights vs one device, uninterrupted:", max_weight_diff(reference, model))
assert max_weight_diff(reference, model) <= 1e-5

"""
Stopped at step 13, preempted at step 19, finished at step 30 on another replica count, with
splits that changed along the way: the weights (and the optimizer's momentum, which the last
updates used) are those of one device trained without a break. Keras warns "Your input ran
out of data" at the end of a resumed epoch, which is shorter by the batches dropped: that is
expected.

What a resumed run needs (checked where possible):

- The directory is on storage every worker sees (a shared file system or bucket). `restore`
  runs collectives: every worker lists the checkpoints, and they check that they all found
  the same ones.
- The data gives the same global batches in the same order in every run: no shuffle, or a
  seeded one that draws its order once, as here. Only then does dropping the trained batches
  resume the same sequence. A seeded shuffle that draws a new order every epoch
  (`reshuffle_each_iteration=True`, tf.data's default) starts every new process at the first
  epoch's order, so a run resumed in epoch 1 trains other batches than the uninterrupted run
  would have; nothing detects it, and the weights differ (this guide with that one change:
  a difference of about 2, not 1e-6).
- The data's number of batches is known (`dataset.cardinality()`), so that Keras keeps the
  epoch length after a shortened first epoch; else add
  `dataset.apply(tf.data.experimental.assert_cardinality(num_batches))`. Resuming mid-epoch
  on data of unknown length is refused, naming that fix.
- `fit(initial_epoch=ckpt.restore(model))`: a `fit` that starts at another epoch is refused.
- A `fit` whose directory already holds a checkpoint must come after `restore`; otherwise it
  is refused, so that nothing is overwritten. Use a new directory to start afresh.

Not restored: the metrics' state (the logs of a resumed epoch cover its resumed steps only)
and other callbacks' state.

## A chief killed while saving, and damaged checkpoints

A chief killed in the middle of a save leaves no half checkpoint to resume from:
`CheckpointManager` replaces its state file only once a checkpoint's files are all written,
and a checkpoint whose files are on disk but which the state file does not name is ignored.
To see it, a copy of the directory gets the files of a "ckpt-99" that was never added to the
state file, as a chief killed between the two would leave them:
"""

copy = DIRECTORY + "_damaged"
shutil.rmtree(copy, ignore_errors=True)
shutil.copytree(DIRECTORY, copy)
tf.train.Checkpoint(model=model).write(os.path.join(copy, "ckpt-99"))
print("with ckpt-99's files but no entry, a run resumes from step",
      hb.ResumableCheckpoint(copy).latest()["step"])

"""
If the state file itself is lost, the `ckpt-<step>.index` files present stand in for it, so
a run never starts afresh over its checkpoints. In a multi-worker job the launcher stops the
other workers when one dies (the chief or any other), and relaunches the cluster if
`--max-restarts` allows (a cluster tool does the same with its own restart policy); the run
then loses the steps since the last save.

A checkpoint can also be damaged behind the run's back: a data file cut short by a failing
disk or an interrupted copy, an index file lost, a checksum that does not match. `restore`
(and `latest()`) read each candidate whole before using it, newest first: one that cannot be
read is skipped with one WARNING naming it and why, and the run resumes from the newest
checkpoint every worker can read. The model is only ever restored from a checkpoint read
whole. Here the copy's newest data file is cut to a third:
"""

newest = tf.train.latest_checkpoint(copy)
data_file = glob.glob(newest + ".data-*")[0]
with open(data_file, "r+b") as f:
    f.truncate(os.path.getsize(data_file) // 3)
print("with", os.path.basename(newest), "damaged, a run resumes from step",
      hb.ResumableCheckpoint(copy).latest()["step"])

"""
If no checkpoint can be read, `restore` raises an error that names the directory, every
checkpoint it tried and why, and what to do. The run does not start afresh by itself, which
would write over them:
"""

for index_file in glob.glob(os.path.join(copy, "ckpt-*.index")):
    os.remove(index_file)
try:
    hb.ResumableCheckpoint(copy).latest()
except ValueError as error:
    message = str(error)
    print("ValueError:", message.split(";")[0])
    print("  ", message[message.index("Fix:"):][:160], "...")

"""
## Relaunching a multi-worker job

The same callback makes a multi-worker script survive a lost worker and a preemption notice.
`python -m tf_hetbatch.launch --workers 3 --max-restarts 3 train.py` runs the script as 3
worker processes on 127.0.0.1 with TF_CONFIG set (with optional per-worker CPU caps and a
`--schedule` of cap changes), and relaunches the cluster after a failure, at most
`--max-restarts` times; on a real cluster the same script runs with TF_CONFIG set by the
cluster tool (see [Multi-worker training](multi_worker.md)):

```python
strategy = hb.HeteroMultiWorkerMirroredStrategy()
with strategy.scope():
    model = make_model()
dyn = hb.DynamicBatching()
ckpt = hb.ResumableCheckpoint("gs://bucket/run1", save_every_steps=100, dynamic_batching=dyn)
initial_epoch = ckpt.restore(model)       # every worker, before fit; 0 on a fresh start
model.fit(ds, epochs=10, initial_epoch=initial_epoch, callbacks=[dyn, ckpt])
# Relaunch with the same command (e.g. --max-restarts 3); on fewer workers the global batch
# is re-split over the survivors. Data order must be the same every run (no shuffle, or a
# seeded one that draws its order once).
```

Every worker calls `restore`, and they agree on the checkpoint with one collective per
candidate: one that any worker cannot read whole is skipped by all. Saving needs no
collective beyond one check that all workers trained the same batches, so a checkpoint of
steps trained on different data is never written.

## Leaving tf_hetbatch, and older checkpoints

The checkpoints are plain TensorFlow checkpoints, so a plain Keras process (no tf_hetbatch)
loads the weights into the same model:
"""

plain = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(1)])
tf.train.Checkpoint(model=plain).restore(tf.train.latest_checkpoint(DIRECTORY)).expect_partial()
print("plain Keras model vs the run:", max_weight_diff(plain, model))

"""
A directory of tf_hetbatch's earlier checkpoint format (`checkpoint.json`, and a folder per
checkpoint with `variables.npz` and `meta.json`) resumes too: the new TensorFlow checkpoints
are written beside its files, which are left as they are (delete them once a new checkpoint
exists).

## Where to go next

- [Multi-worker training](multi_worker.md): the launcher, `--max-restarts`, `--preempt`.
- [Memory-bounded replicas](memory.md): bounds lowered by a step out of memory are saved too.
- [Troubleshooting](../troubleshooting.md): errors and what they mean.
"""
