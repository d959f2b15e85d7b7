"""
# Asynchronous training on parameter servers

By the end you will have trained a small Keras model asynchronously (ASP) on a local
parameter-server cluster: two workers with batch sizes of their own, the staleness of their
updates measured, the balance and staleness dashboards written, and one worker killed while
training went on without it.
"""

"""
## What it is for

In synchronous training every replica waits for the slowest one at each step. In
asynchronous training (ASP) on TensorFlow's parameter-server runtime every worker reads the
weights from the parameter servers, computes a gradient on its own mini-batch and applies it
there, without waiting for the others. A slow worker no longer stalls the fast ones, but its
updates are *stale*: other workers have changed the weights between its read and its update.

Keras 3 `fit` does not support `tf.distribute.ParameterServerStrategy`. tf_hetbatch gives you
two pieces instead:

- `hb.HeteroParameterServerStrategy` is a `ParameterServerStrategy` that splits a *round* of
  K updates (one per worker) over the K workers: worker k gets the mini-batch b_k, and the
  b_k sum to the round's batch. It supports one replica per worker (a CPU or one GPU).
- `hb.AsyncTrainer` gives you the familiar parts of `fit`: epochs of `steps_per_epoch`
  updates, a progress bar, a `History`, validation and `evaluate` on the chief, Keras
  callbacks (`DynamicBatching` and its dashboards included), checkpoints and resuming.

Each worker's update uses its own batch size b_k: the gradient of its batch mean, scaled by
b_k / mean(b) (linear gradient scaling), so every sample weighs the same whatever the
split. Unlike the synchronous strategies, an update is *not* the one a
single device would make on a global batch: it is one worker's batch, applied to weights that
may be stale. Asynchronous training trades that exactness for never waiting.

## The cluster

A parameter-server cluster has three kinds of task, each told its part by `TF_CONFIG`:
the **chief** runs your training script (this file), the **ps** tasks hold the variables, and
the **worker** tasks run the training steps the chief sends them. The ps and worker tasks
only serve: on each of their hosts you run

```bash
TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' tf-hetbatch-server
```

(`tf-hetbatch-server` is `python -m tf_hetbatch.launch.server`, installed with the package),
and on the chief, with `"task": {"type": "chief", "index": 0}`, your script.

On one machine the launcher does all of this for you:

```bash
python -m tf_hetbatch.launch --ps 1 --workers 2 --cpus 0.8,0.2 train.py
```

runs `train.py` as the chief, with one parameter server and two workers serving
`python -m tf_hetbatch.launch.server` on 127.0.0.1, the workers capped at 0.8 and 0.2 of a
CPU. The chief's exit decides the outcome; a ps that fails ends the run; a worker that dies
is only logged. Add `--preempt "30:1+10"` to kill worker 1 at 30 s and bring it back 10 s
later, to rehearse transient servers. (A worker task with one TensorFlow inter-op thread
hangs on its first step, seen with TensorFlow 2.21: the server, and the launcher's
`--threads 1`, give worker tasks 2.)

This guide starts the parameter server and the two workers itself, the way a real cluster
runs them (so it can kill a worker later), and is the chief itself. Both workers share this machine's 2 cores, uncapped, so
they are about equally fast here. Everything this guide writes goes under
`./async_training/` in the working directory.
"""

import atexit
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ INFO/WARNING lines off

OUT = os.path.abspath("async_training")
shutil.rmtree(OUT, ignore_errors=True)  # each run starts afresh (no checkpoint to resume)
os.makedirs(OUT)

"""
Four free ports on 127.0.0.1, one per task, make the cluster's addresses:
"""


def free_ports(n):
    """n free TCP ports on 127.0.0.1 (bound, read, released)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


chief_port, ps_port, *worker_ports = free_ports(4)
CLUSTER = {"chief": [f"127.0.0.1:{chief_port}"], "ps": [f"127.0.0.1:{ps_port}"],
           "worker": [f"127.0.0.1:{p}" for p in worker_ports]}

"""
Each server is a process of its own, its output in a log file. `start_server` returns at
once; `wait_until_serving` waits (at most 60 s) until the task listens on its port, so a
server that fails to start stops the guide instead of leaving the chief waiting.
"""


def start_server(kind, index):
    env = dict(os.environ, TF_CONFIG=json.dumps(
        {"cluster": CLUSTER, "task": {"type": kind, "index": index}}))
    with open(os.path.join(OUT, f"{kind}{index}.log"), "w") as log:
        return subprocess.Popen([sys.executable, "-m", "tf_hetbatch.launch.server"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_until_serving(name, process, address, timeout=60.0):
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}; see {OUT}/*.log")
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{name} did not listen on {address} within {timeout:.0f} s")


"""
The servers are started before TensorFlow is imported here, so their start-up overlaps the
chief's. `stop_servers` sends each a SIGTERM (a served task exits 0 on it) and a SIGKILL
if it still runs 10 s later. `atexit` calls it however the guide ends: at its last line,
on an exception, on Ctrl-C, or on a SIGTERM. (Outside `fit` the handler below turns a
SIGTERM into a normal exit; during `fit`, `AsyncTrainer` takes a SIGTERM as a preemption
notice: it saves and exits with code 42, see the [checkpoints guide](checkpoints.md).)
"""


def stop_servers(servers):
    for process in servers.values():
        if process.poll() is None:
            process.terminate()
    for process in servers.values():
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


servers = {}
atexit.register(stop_servers, servers)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
for kind, index in [("ps", 0), ("worker", 0), ("worker", 1)]:
    servers[f"{kind} {index}"] = start_server(kind, index)

"""
## The strategy, the model and the trainer

On the chief, `TF_CONFIG` names the chief task; `HeteroParameterServerStrategy()` reads
it, as the stock strategy does. Build the model under its scope, so its variables live
on the parameter server. tf_hetbatch never prints: it logs through Python's `logging`, and
the `tf_hetbatch` logger at INFO shows what it does (a resumed checkpoint, a worker that
finished no update, where the dashboards went).

`AsyncTrainer` takes the model, an optimizer, a loss and metrics. The metrics are
accumulated over every worker's updates on the parameter servers (each update adds its
counts with atomic additions, so concurrent updates lose nothing); validation runs on the
chief, into copies of them. With `checkpoint_dir`, the model, the optimizer, the split and
the `DynamicBatching` state are saved at each epoch end (and every
`checkpoint_interval` updates, if you set it), and `fit` resumes from the newest
checkpoint there. The [checkpoints guide](checkpoints.md) has the details, preemption
notices included.
"""
os.environ["TF_CONFIG"] = json.dumps({"cluster": CLUSTER,
                                      "task": {"type": "chief", "index": 0}})
import logging

import keras
import numpy as np
import tensorflow as tf

import tf_hetbatch as hb

log = logging.getLogger("tf_hetbatch")
log.setLevel(logging.INFO)
log.addHandler(logging.StreamHandler())
log.handlers[-1].setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
log.propagate = False  # one line each, also when something configured the root logger

"""
Wait for the servers, then create the strategy, the model and the trainer:
"""
for kind, index in [("ps", 0), ("worker", 0), ("worker", 1)]:
    wait_until_serving(f"{kind} {index}", servers[f"{kind} {index}"], CLUSTER[kind][index])
print("cluster:", json.dumps(CLUSTER))
strategy = hb.HeteroParameterServerStrategy()
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(3)])
trainer = hb.AsyncTrainer(
    model, keras.optimizers.SGD(0.1),
    keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
    checkpoint_dir=os.path.join(OUT, "checkpoints"))
print("workers:", strategy.num_workers)

"""
## The data

`fit` takes a `dataset_fn`: a function of a `tf.distribute.InputContext` that returns a
dataset of **single examples** (not batches), with fixed shapes. It is called once per
worker, with `input_pipeline_id` set to the worker's index; the trainer batches each
worker's examples itself, b_k of them per update. The stream is repeated without end: an
epoch is a number of updates, not a pass over the data. Here each worker shuffles with
its own seed.

Validation data is a dataset of batches, evaluated on the chief after each epoch.
"""
rng = np.random.default_rng(0)
w = rng.normal(size=(16, 3)).astype("float32")


def make_data(n):  # 3 classes, learnable: the argmax of a fixed linear map
    x = rng.normal(size=(n, 16)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int32")


x, y = make_data(4096)
x_val, y_val = make_data(1024)


def dataset_fn(context):
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    return examples.shuffle(4096, seed=context.input_pipeline_id).repeat()


val_ds = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(256)

"""
## Training with a batch size per worker

`batch_size` is the batch of one update at the even split: the round over the K workers
sums to `batch_size * K`, and worker k's update is scaled by b_k / `batch_size`. Until
you set a split (or `DynamicBatching` does), it is even. Here worker 0 gets 24 samples
per update and worker 1 gets 8: a round of 2 updates holds 32 = 2 x 16 samples, and the
updates are scaled by 24 / 16 = 1.5 and 8 / 16 = 0.5. A split set before `fit` waits for
the `fit` whose round it sums to.

The small callback below prints, after each epoch, how many updates each worker made and
on how many samples. It reads `strategy.read_totals()`, the per-worker sums since the
strategy was created (kept on the parameter servers).
"""
strategy.set_batch_sizes([24, 8])


class PerWorker(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = strategy.read_totals()

    def on_epoch_end(self, epoch, logs=None):
        now = strategy.read_totals()
        updates = (now.steps - self.start.steps).astype(int).tolist()
        samples = (now.samples - self.start.samples).astype(int).tolist()
        print(f"  epoch {epoch + 1}: updates per worker {updates}, samples {samples}")


history = trainer.fit(dataset_fn, batch_size=16, epochs=2, steps_per_epoch=40,
                      validation_data=val_ds, callbacks=[PerWorker()], verbose=2)

"""
`verbose=2` prints one line per epoch (`verbose=1`, the default, a progress bar). The
epoch's logs hold the loss and metrics (running means over the epoch's updates, read from
the parameter servers), `staleness` and the `val_` values.

Check what the split promised: every update of worker k used exactly b_k samples. The
workers do not make equal numbers of updates: each takes the next step when it is free.
So an epoch of `steps_per_epoch` updates at an uneven split holds more or fewer samples
than `steps_per_epoch * batch_size`: compare runs by time to accuracy, or by samples, not
by epochs.
"""
totals = strategy.read_totals()
updates, samples = totals.steps.astype(int), totals.samples.astype(int)
assert (samples == np.array([24, 8]) * updates).all()
assert updates.sum() == strategy.updates == 80
print("updates per worker:", updates.tolist(), "samples:", samples.tolist(),
      "(24 and 8 per update)")
print("val_accuracy per epoch:", [round(v, 3) for v in history.history["val_accuracy"]])

"""
## Staleness

An update's staleness is the number of updates the other workers applied between its
read of the weights (just before its forward pass) and its own update. The strategy counts
it for every update, per worker, on the parameter servers. You read it three ways:

- the epoch logs: `staleness` is the mean over the epoch's updates (in `History` too);
- `trainer.staleness` after `fit`: a `Staleness` of the fit's updates, whose
  `histogram[k, s]` counts worker k's updates that were s updates stale (the last bin,
  of the strategy's `staleness_bins`, 64 by default, counts 63 or more), with `.mean` and
  `.max` per worker and `.updates`;
- the "tf_hetbatch staleness" dashboard of `DynamicBatching(log_dir=...)` (below).

With two workers and small steps, most updates here are 0 or 1 update stale. With more
workers, or a slow worker with a large batch, it grows: giving each worker a batch in
proportion to its speed evens out their update times, and so the staleness.
"""
stale = trainer.staleness
print("staleness per epoch:", [round(s, 3) for s in history.history["staleness"]])
print("mean staleness per worker:", np.round(stale.mean, 3).tolist(),
      "max:", stale.max.tolist())
print("histogram (0, 1, 2, 3+ updates stale):",
      np.concatenate([stale.histogram[:, :3], stale.histogram[:, 3:].sum(1, keepdims=True)],
                     axis=1).tolist())
assert (stale.updates == updates).all()  # one entry per update

"""
## Balancing, its dashboards, and a dead worker

`DynamicBatching` works in `AsyncTrainer.fit` as it does in Keras's `fit`, with workers
in place of replicas: it sets the static split (from each worker's nominal peak FLOP/s,
read on the worker itself, so a capped worker reports its cap), then adjusts it from
the workers' measured times every `interval` updates, after `warmup_steps` updates and
once every worker finished 2 updates. With `log_dir` it writes the balance dashboards
(see the [dashboards guide](dashboards.md)) and, in asynchronous training, each worker's
mean and largest staleness per window: the "tf_hetbatch staleness" category of the
Custom Scalars tab (`hetbatch/staleness_mean` and `hetbatch/staleness_max` in each
worker's run).

This second `fit` reuses the trainer and its `checkpoint_dir`, so it **resumes** from
the checkpoint of epoch 2 (an INFO line names it): `epochs=5` trains epochs 3 to 5. At the
end of epoch 3 the callback kills worker 1 (SIGKILL), as a lost machine would. TensorFlow's
coordinator logs the failure (`ERROR:tensorflow:Worker ... failed with UnavailableError`),
the steps that were on worker 1 run again on worker 0, and training goes on. TensorFlow
then logs an error line for each new function it cannot register on the dead worker; they
are harmless. While a worker finishes no update, `DynamicBatching` keeps the split (one
INFO line per window), and the window's staleness has no mean for it (None) and a max of
-1.
"""


class KillWorker1(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 2:
            servers["worker 1"].kill()
            servers["worker 1"].wait(timeout=10)
            print("  killed worker 1")


log_dir = os.path.join(OUT, "logs")
balancing = hb.DynamicBatching(log_dir=log_dir, warmup_steps=4, interval=10)
history = trainer.fit(dataset_fn, batch_size=16, epochs=5, steps_per_epoch=40,
                      validation_data=val_ds, verbose=2,
                      callbacks=[balancing, PerWorker(), KillWorker1()])
print("resumed from update", trainer.restored["step"], "(epoch", trainer.restored["epoch"],
      "done)")
print("splits applied:", [(e["step"], e["new"]) for e in balancing.history])
for window in balancing.windows:
    mean = [None if v is None else round(v, 2) for v in window["staleness_mean"]]
    print(f"  window ending at update {window['step']} of this fit: mean staleness {mean}, "
          f"max {window['staleness_max']}")
print("updates in all:", strategy.updates, "of", 5 * 40, "scheduled")
assert strategy.updates == 200  # every scheduled update ran once, worker 1 dead or not

"""
Every scheduled update ran exactly once: those that failed with worker 1 ran again on
worker 0. When a worker comes back at the same address (the launcher's `--preempt
"30:1+10"` does that), the coordinator, which polls for it, reconnects within seconds,
re-creates its input pipeline and sends it steps again.

Losing a **parameter server** is different: the variables are gone. Training stops with
`hb.ParameterServerLostError`, whose message names the latest checkpoint in
`checkpoint_dir` ("run the same command again to resume from it"), or says that nothing
was saved when no `checkpoint_dir` was set. With the launcher's `--max-restarts 1` the
whole cluster starts again and `fit` resumes from there. If the number of workers
changed, the resumed split is even and `DynamicBatching` starts afresh.

The dashboards are under `log_dir`: one TensorBoard run per worker (`hetbatch/replica_<k>`,
named by the worker's index) and one for the cluster, and at the end the PNG. A window here
is `interval` updates of all workers together; each worker's series are means over its own
updates that finished in the window. No worker waits for another in asynchronous training,
so the "wait time" and "balance efficiency" series compare the workers' times per update:
how far they are from finishing their batches in equal times.
"""
from tensorboard.backend.event_processing import event_accumulator

run = event_accumulator.EventAccumulator(os.path.join(log_dir, "hetbatch", "replica_0"))
run.Reload()
print("worker 0's series:", sorted(run.Tags()["tensors"]))
assert {"hetbatch/staleness_mean", "hetbatch/staleness_max"} <= set(run.Tags()["tensors"])
png = os.path.join(log_dir, "hetbatch_balance.png")
print("balance picture:", png if os.path.exists(png) else "(install matplotlib)")
print(f"open the dashboards: tensorboard --logdir {log_dir}")

"""
`trainer.evaluate` runs on the chief, over a dataset of batches, and returns the loss and
metrics (`return_dict=True` for a dict).
"""
print("evaluate:", {k: round(v, 4) for k, v in
                    trainer.evaluate(val_ds, return_dict=True, verbose=0).items()})
del trainer, model, strategy, balancing  # TensorFlow releases its remote functions
gc.collect()                              # while the servers still run
stop_servers(servers)
print("servers stopped:", {name: p.returncode for name, p in servers.items()})

"""
## Where to go next

- The same script on a real cluster: set `TF_CONFIG` with "chief", "ps" and "worker"
  addresses on every host, run `tf-hetbatch-server` on the ps and worker hosts and your
  script on the chief. Only the chief reads and writes checkpoints: give `checkpoint_dir`
  a path that outlives it, on a shared file system or `gs://` (any `tf.io.gfile` path). Each worker task uses one replica: one GPU
  (`CUDA_VISIBLE_DEVICES`; the launcher's `--gpus` assigns them) or its CPU. Nothing in
  this project has run on a GPU yet.
- `HeteroParameterServerStrategy` holds the split like the synchronous strategies:
  `strategy.batch_sizes`, `strategy.set_batch_sizes([...])`, and the measurements
  `read_replica_times()` (per worker: seconds from a step's start on the worker to its
  update applied, samples, updates) and `read_staleness()`.
- `AsyncTrainer(max_outstanding=...)`: the scheduled steps allowed to be queued or running
  at once (default 2 per worker: one running, one waiting).
- The [API reference](../reference.md) lists every argument.
"""
