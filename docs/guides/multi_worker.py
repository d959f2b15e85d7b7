"""
# Several workers

At the end of this guide you will have run one training script as a job of two worker
processes on this machine, with the package's launcher, the workers hosting different
numbers of replicas; and you will have checked that both workers end with the weights one
device reaches on the same global batches.
"""

"""
## The strategy

`hb.HeteroMultiWorkerMirroredStrategy` subclasses `tf.distribute.MultiWorkerMirroredStrategy`
with the same constructor, and is configured by `TF_CONFIG` as the stock one (or by a cluster
resolver). It does everything `HeteroMirroredStrategy` does, across workers: one split of
each global batch over all replicas of all workers, each replica's gradient weighted by
b_k / B, and the same model on every worker, equal to one device's on the global batch.

`devices=[...]` takes the worker's own replica devices, in `HeteroMirroredStrategy`'s form:
`["/gpu:0", "/gpu:1"]` on a 2-GPU box, `["/cpu:0"]`, logical CPUs, or `["/gpu:0", "/cpu:0"]`.
Each worker passes its own; the default is all of the worker's GPUs, else its CPU. Workers
may host different numbers and kinds of replicas:

- they exchange their lists at start-up; `num_replicas_in_sync` is the total;
- replicas are numbered in worker order, the chief's first; the split, the weights, the
  timing, the input slices, the checkpoints and the dashboards are per replica, in that
  order;
- a layout that cannot work (a worker with no device, a device that does not exist, workers
  created with different arguments) is refused with the same error on every worker, before
  any step;
- replicas of one kind all-reduce in one group, with your `communication_options` (NCCL only
  if every replica is a GPU); where kinds differ, each worker sums its replicas on its CPU
  and the workers' CPUs all-reduce (RING). `strategy.layout` says which, and
  `strategy.layout.describe()` says it in one line.

## The training script

The launcher runs a script as worker processes; the same script runs unchanged on a real
cluster, where the cluster tool sets `TF_CONFIG`. This guide writes its script, piece by
piece, to `./multi_worker_run/train.py`; at the end it imports the script's model and data
again for the one-device check.

The data is read the same on every worker: every worker reads every global batch and keeps
its own replicas' slices. The per-sample map runs after the split, so each worker maps only
its own replicas' samples; the script counts them. A seeded `Dataset.shuffle` before the map
would be fine too; this one keeps a fixed order for the one-device comparison (the
[quickstart](quickstart.md) says why).
"""
import io
import json
import os
import sys

import numpy as np

from tf_hetbatch.launch import launch

RUN_DIR = os.path.abspath("multi_worker_run")
os.makedirs(RUN_DIR, exist_ok=True)

TRAIN_PY = '''
import json, os, sys
import keras
import numpy as np
import tensorflow as tf
import tf_hetbatch as hb

GLOBAL_BATCH = 48
rng = np.random.default_rng(0)
x = rng.normal(size=(960, 16)).astype("float32")  # 20 global batches of 48
y = (x[:, :4].argmax(axis=1)).astype("int32")
'''

"""
The model, and the pipeline in the form whose per-sample maps run after the split:
`source .map(f) .batch(B)`. The map counts its samples in a variable, when given one.
"""
TRAIN_PY += '''

def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(4, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def make_dataset(mapped=None):
    def per_sample(features, label):  # per-sample input work: decoding, augmenting...
        if mapped is not None:
            mapped.assign_add(1)
        return tf.clip_by_value(features, -3.0, 3.0), label
    return tf.data.Dataset.from_tensor_slices((x, y)).map(per_sample).batch(GLOBAL_BATCH)
'''

"""
The rest runs on each worker. Worker 0 hosts one replica, worker 1 two: here they
are logical CPUs, split before anything else touches TensorFlow, and the script reads its
task index from `TF_CONFIG` to know how many. On machines with GPUs each worker would pass
its own GPUs, e.g. `devices=["/gpu:0", "/gpu:1"]`, or leave `devices` out.

The split is set before `fit` and switched after step 4, on every worker at the same point
with the same sizes. Across workers a new split starts on every worker at the same step,
`switch_margin` steps (default 8) after the call, with no collective once a step was trained;
only before this process's first trained step do the workers ask each other once whether
any has read data yet. The callback records each step's samples per replica from
`read_replica_times()`, which is local: every step's all-reduce brought every replica's
measurements to every worker.
"""
TRAIN_PY += '''

class Record(keras.callbacks.Callback):
    def __init__(self, strategy, mapped):
        super().__init__()
        self.strategy, self.mapped, self.steps, self.mapped_per_epoch = strategy, mapped, [], []

    def on_train_begin(self, logs=None):
        self.before = self.strategy.read_replica_times()

    def on_train_batch_end(self, batch, logs=None):
        now = self.strategy.read_replica_times()
        self.steps.append((now - self.before).samples.astype(int).tolist())
        self.before = now
        if len(self.steps) == 4:
            self.strategy.set_batch_sizes([24, 12, 12])

    def on_epoch_end(self, epoch, logs=None):
        self.mapped_per_epoch.append(int(self.mapped.numpy()))
'''

"""
`main` sets this worker's devices, creates the strategy and trains.
"""
TRAIN_PY += '''

def main(out):
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    count = [1, 2][index]  # this worker's replicas
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    strategy = hb.HeteroMultiWorkerMirroredStrategy(devices=[f"/cpu:{i}" for i in range(count)])
    if strategy.is_chief:
        print("guide: TF_CONFIG", os.environ["TF_CONFIG"], flush=True)
    print("guide:", strategy.layout.describe(), flush=True)

    with strategy.scope():
        model = make_model()
    mapped = tf.Variable(0, dtype=tf.int64, trainable=False)
    strategy.set_batch_sizes([8, 20, 20])
    record = Record(strategy, mapped)
    model.fit(make_dataset(mapped), epochs=2, verbose=0, callbacks=[record])
    save(out, index, strategy, model, record)
'''

"""
`save` writes what the worker saw: the weights, the samples of each step per replica, the
samples it mapped per epoch, the per-replica times. Each worker writes its own files.
"""
TRAIN_PY += '''

def save(out, index, strategy, model, record):
    times = strategy.read_replica_times()
    np.savez(os.path.join(out, f"worker{index}.npz"), *model.get_weights())
    with open(os.path.join(out, f"worker{index}.json"), "w") as f:
        json.dump({"replicas": strategy.num_replicas_in_sync,
                   "first": strategy.layout.offset, "local": strategy.num_local_replicas,
                   "steps": record.steps, "mapped_per_epoch": record.mapped_per_epoch,
                   "split": list(strategy.batch_sizes),
                   "ms_per_step": np.round(1e3 * times.time_per_step, 3).tolist()}, f)


if __name__ == "__main__":
    main(sys.argv[1])
'''
with open(os.path.join(RUN_DIR, "train.py"), "w") as f:
    f.write(TRAIN_PY)

"""
## Launching on this machine

`python -m tf_hetbatch.launch --workers N [options] script.py [args...]` (also installed as
`tf-hetbatch-launch`) runs the script as N worker processes on 127.0.0.1, each with its own
`TF_CONFIG`, exactly as a cluster tool would set it. Its options:

- `--cpus 0.2,0.3,0.9`: a CPU cap per worker (`none` for uncapped), to emulate slower
  machines: a cgroup CPU quota where the launcher may create cgroups, else a SIGSTOP/SIGCONT
  duty cycle (`--cap-method`, `--period-ms`);
- `--schedule "30:1=0.1;60:1=0.3"`: cap changes during the run (at 30 s worker 1 gets 0.1
  CPUs, ...);
- `--gpus "0,1|2|"`: each worker's GPUs, as its `CUDA_VISIBLE_DEVICES`: one group per
  worker, separated by `|`, of positions in the launcher's `CUDA_VISIBLE_DEVICES` if set,
  else in `nvidia-smi -L`; an empty group or `none` for a CPU-only worker; `none` for all
  CPU-only, `all` to leave the variable alone. By default each worker gets one GPU when the
  launcher sees GPUs, workers beyond the GPU count are CPU-only (with a warning), and without
  GPUs nothing is set. The launcher logs one line per worker, e.g. `worker 1: GPUs 2,3`.
  This machine has no GPU: the option has not run here.
- `--threads N`: TensorFlow's inter- and intra-op threads (and OpenMP's) of every worker;
- `--timeout SECONDS`: stop everything after that long (exit status 124);
- `--max-restarts N`: restart the whole cluster after a failure (next section);
- `--grace SECONDS`: from SIGTERM to SIGKILL when stopping workers (default 30).

Each worker's output lines come prefixed with `[worker i]`. If a worker fails, the others are
stopped. The exit status is 0 only if every worker exits 0; otherwise the failed worker's
code. From Python, `tf_hetbatch.launch.launch(["train.py"], num_workers=2, cpus=[None, 0.6])`
does the same and returns a `LaunchResult`.

Here worker 1 is capped at 0.6 CPUs and each worker gets one thread (two workers share two
cores). The guide calls `launch()`, the same as
`python -m tf_hetbatch.launch --workers 2 --cpus none,0.6 --threads 1 --timeout 150 --grace 5
multi_worker_run/train.py multi_worker_run`: everything stops after 150 s at most, and a
SIGINT or SIGTERM to the guide stops the workers too. The workers' lines are kept in
`./multi_worker_run/launch.log`.
"""
log = io.StringIO()
result = launch([os.path.join(RUN_DIR, "train.py"), RUN_DIR], 2, cpus=[None, 0.6], threads=1,
                timeout=150, grace=5, stdout=log, stderr=log)
output = log.getvalue().splitlines()
with open(os.path.join(RUN_DIR, "launch.log"), "w") as f:
    f.write(log.getvalue())
for line in output:
    if "] guide:" in line:
        print(line)
print("launch:", result.message)
if not result.ok:
    print("\n".join(output[-40:]))
    sys.exit(f"the launch failed ({result.returncode}): {result.message}")

"""
Three replicas in sync, one on worker 0 and two on worker 1, all CPUs: one collective group
("all-reduce device"). Worker 0 is the chief: with no `chief` task in `TF_CONFIG`, worker 0
is.

![Two workers: worker 0 hosts replica 0, worker 1 (capped) replicas 1 and 2; each replica's share of the global batch and its time per step; the all-reduce between the workers](../img/layout.png)

The figure shows a layout of this shape after `DynamicBatching` balanced it: it was drawn by
`docs/make_figures.py` from a real run of two worker processes on logical CPUs (worker 1 capped
at 0.5 CPUs), so its numbers vary from run to run. The times are each replica's compute time per
step at the settled split; they need not be equal, since the controller keeps the split whose
measured step time is shortest, and a step holds more than the replicas' compute.

## What the workers trained

Each worker wrote what it saw. Both recorded the same samples per replica at every step
(replica order: worker 0's replica, then worker 1's two). The split set before `fit` holds
until step 12: the switch was asked for after step 4 and started 8 steps later, on both
workers at the same step. The last line is the split in force at the end.
"""
results = []
for index in range(2):
    with open(os.path.join(RUN_DIR, f"worker{index}.json")) as f:
        results.append(json.load(f))
steps = results[0]["steps"]
assert results[1]["steps"] == steps, "the workers recorded different steps"
first = 0
for step in range(1, len(steps) + 1):
    if step == len(steps) or steps[step] != steps[first]:
        print(f"steps {first + 1:2d}-{step:2d}: samples per replica {steps[first]}")
        first = step
print("split in force:", results[0]["split"], "replicas in sync:", results[0]["replicas"])

"""
Each worker ran the per-sample map on its own replicas' samples only: in the second epoch,
the samples each worker mapped equal the samples its replicas trained. (The first epoch's
count is larger: it also holds the samples the pipeline had mapped before training started,
when Keras first reads the data.)
"""
for index, result in enumerate(results):
    local = slice(result["first"], result["first"] + result["local"])
    trained = int(np.sum(np.asarray(steps[20:])[:, local]))
    mapped = result["mapped_per_epoch"][1] - result["mapped_per_epoch"][0]
    print(f"worker {index}: mapped {mapped} samples in epoch 2, its replicas trained {trained}")
    assert mapped == trained

"""
Every worker reads the same per-replica times: milliseconds of compute per step, from the
release by the previous all-reduce to the replica's local gradients being ready (its own
work, not its wait for the others).
"""
print("ms per step, per replica:", results[0]["ms_per_step"])
assert results[0]["ms_per_step"] == results[1]["ms_per_step"]

"""
## The same model as one device

Both workers hold the same weights, equal to those of one device trained on the same global
batches. The guide imports the script's model and data for that (without running its
`main`).
"""
sys.path.insert(0, RUN_DIR)
import train  # noqa: E402  (the script written above)

one_device = train.make_model()
one_device.fit(train.make_dataset(), epochs=2, verbose=0)
for index in range(2):
    saved = np.load(os.path.join(RUN_DIR, f"worker{index}.npz"))
    weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    difference = max(float(np.max(np.abs(a - b)))
                     for a, b in zip(weights, one_device.get_weights()))
    print(f"worker {index}: largest weight difference from one device {difference:.2e}")
    assert difference <= 1e-5

"""
## Recovery by relaunch

`--max-restarts N` restarts the whole cluster, on new ports, after a failure. The script
resumes from its own checkpoint; the environment variable `TF_HETBATCH_RESTART` gives it the
attempt number (0 first). `hb.ResumableCheckpoint` makes a script survive a lost worker and a
preemption notice:

```python
dyn = hb.DynamicBatching()
ckpt = hb.ResumableCheckpoint("gs://bucket/run1", save_every_steps=100, dynamic_batching=dyn)
initial_epoch = ckpt.restore(model)       # every worker, before fit; 0 on a fresh start
model.fit(ds, epochs=10, initial_epoch=initial_epoch, callbacks=[dyn, ckpt])
# Relaunch with the same command (e.g. --max-restarts 3); on fewer workers the global batch
# is re-split over the survivors. Data order must be the same every run (seeded shuffle).
```

[Checkpoints and restarts](checkpoints.md) covers the checkpoints, preemption notices and
rehearsing them with the launcher's `--preempt`.
"""
