"""One worker of a `bench_input.py` cluster: input-work phases in ONE process.

Started by `bench_input.py` through `tf_hetbatch.launch.launch` (TF_CONFIG set), or alone
(one replica, for debugging):

    python examples/benchmarks/input_worker.py --plan plan.json --result result.json

Trains `make_model(model, filters)` at global batch `batch` from PNG TFRecords of the first
`train_samples` Fashion-MNIST images (`fashion_mnist.png_records`, repeated, a shuffle buffer
of `shuffle_buffer` records), with an `InputMeter` in the pipeline. `phases` is a list of:

- `{"name", "kind": "static" | "warmup", "pipeline", "input_work", "sizes", "steps", "skip"}`:
  a fixed split (`[..]` or "even", set with `set_batch_sizes` when the fit begins) for `steps`
  steps, the first `skip` not measured (the switch lag);
- `{"name", "kind": "dynamic", "pipeline", "input_work", "steps"}`: a fresh
  `DynamicBatching()` (library defaults); its second half is measured;
- `{"name", "kind": "epoch", "pipeline", "input_work", "samples"}`: read amplification:
  one pass over a finite pipeline of the first `samples` records, through the strategy's
  distributed dataset (what `fit` iterates; no training), at the split in force (put a
  static phase of at least switch_margin + 2 steps at the wanted split before it): bytes read
  by the process (`/proc/self/io` rchar) and by the pipeline against its own samples' bytes.
  Put these last (they produce batches that are never trained, so no split may be set after
  them).

`pipeline`: "heavy" (decode + resize + random crop + flip + resize), "light" (decode only) or
"reference": heavy, except on the workers listed in the plan's `decode_free`, whose per-sample
map decodes nothing (it looks up a pre-decoded image, `seed mod n`, in an in-memory table): the
raw global batches (records and seeds) are the same on every worker, so the split, the
bookkeeping and the workers' batch check are those of the heavy pipeline. `input_work`:
"split" (each worker decodes its own replicas' samples) or "unsplit"
(`strategy.split_input_work = False`: every worker decodes every sample).

Per measured window every worker reports its compute time per step
(`read_replica_times`) and its input work per step (the meter's deltas), gathered to the
chief with `gather_replica_values`. The chief prints `#` progress lines and writes the JSON.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # examples/: fashion_mnist, train_fashion_mnist
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fashion_mnist  # noqa: E402
import tf_hetbatch as hb  # noqa: E402
from hetero_worker import build_model, make_strategy, parse_plan_args, wait_until  # noqa: E402
from tf_hetbatch.distribute import multi_worker  # noqa: E402

# What a window reports per worker: the meter's four totals and the process's rchar.
FIELDS = fashion_mnist.InputMeter.FIELDS + ("rchar",)


def rchar():
    """Bytes this process has read through read()/pread() so far (/proc/self/io), or NaN."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return float(line.split()[1])
    except OSError:
        pass
    return float("nan")


class Window(keras.callbacks.Callback):
    """Step wall times; busy times and input-work deltas over steps first+1..last (local reads;
    the busy-time reads are collectives, at the same step on every worker)."""

    def __init__(self, strategy, meter, first, last, read_busy):
        super().__init__()
        self.strategy, self.meter = strategy, meter
        self.first, self.last, self.read_busy = first, last, read_busy
        self.step_seconds, self.busy, self.delta = [], None, None
        self._count, self._last, self._start = 0, None, None

    def _local(self):
        return np.concatenate([self.meter.read(), [rchar()]])

    def on_train_batch_begin(self, batch, logs=None):
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        self.step_seconds.append(now - self._last)
        self._last = now
        self._count += 1
        if self._count == self.first:
            self._start = self._local()
            if self.read_busy:
                self.strategy.read_replica_times(reset=True)
        elif self._count == self.last and self._start is not None:
            self.delta = (self._local() - self._start) / (self.last - self.first)
            if self.read_busy:
                times = self.strategy.read_replica_times(reset=True)
                self.busy = {"time_per_step": times.time_per_step.tolist(),
                             "samples_per_step": times.samples_per_step.tolist()}


class SetSplit(keras.callbacks.Callback):
    """Sets a fixed split when the fit begins (a collective, the same point on every worker).

    When the fit begins, Keras has pulled the first batch from a fresh iterator, whose keys
    restart at the steps trained, so the switch lands at the phase's first steps. (Split
    pipelines once ended on tf.data's injected autotuned prefetch, whose buffer could run
    9 batches ahead and made `set_batch_sizes` refuse; they end on a fixed one-batch
    prefetch now.)
    """

    def __init__(self, strategy, sizes):
        super().__init__()
        self.strategy, self.sizes = strategy, sizes

    def on_train_begin(self, logs=None):
        self.strategy.set_batch_sizes(self.sizes)


def gather_rows(strategy, row):
    """Every replica's copy of its worker's `row` (a collective)."""
    local = len(strategy.extended.worker_devices)
    return strategy.gather_replica_values(np.tile(np.asarray(row, np.float64), (local, 1)))


def per_worker_input(gathered):
    """{field: [per replica]} of gathered window deltas (per step)."""
    return {name: gathered[:, i].tolist() for i, name in enumerate(FIELDS)}


def reference_decode(images, labels):
    """A per-sample map that decodes nothing: a pre-decoded image and its label from memory."""
    table_x = tf.Variable(images, trainable=False, name="predecoded_images")
    table_y = tf.Variable(labels.astype(np.int32), trainable=False, name="predecoded_labels")
    n = int(images.shape[0])

    def lookup(record, seed):
        del record
        row = tf.math.floormod(seed, n)
        image = tf.cast(tf.gather(table_x, row), tf.float32)[..., None] / 255.0
        return (tf.ensure_shape(image, [28, 28, 1]),
                tf.ensure_shape(tf.gather(table_y, row), []))

    return lookup


class Pipelines:
    """The datasets of each pipeline kind, built once per process (repeated, seeded)."""

    def __init__(self, plan, task, meter):
        self.plan, self.task, self.meter = plan, task, meter
        self.records = fashion_mnist.png_records("train", plan["train_samples"])
        self.source = self.records.source
        self._cache = {}

    def get(self, kind, samples=None):
        key = (kind, samples)
        if key in self._cache and samples is None:
            return self._cache[key]
        records = self.records
        if samples is not None:  # a finite pipeline over the first `samples` records
            records = fashion_mnist.png_records("train", samples)
        decode = None
        if kind == "reference" and self.task in self.plan.get("decode_free", []):
            images, labels, _ = fashion_mnist.load_uint8("train", records.count)
            decode = fashion_mnist.metered(reference_decode(images, labels), self.meter)
        augment = "light" if kind == "light" else "heavy"
        dataset = fashion_mnist.png_pipeline(
            records, self.plan["batch"], seed=self.plan["seed"], augment=augment,
            meter=self.meter, repeat=samples is None, decode=decode,
            shuffle_buffer=self.plan.get("shuffle_buffer"))
        if samples is None:
            self._cache[key] = dataset
        return dataset


def resolve_sizes(sizes, batch, k):
    if sizes == "even":
        return [int(s) for s in hb.split_evenly(batch, k)]
    return [int(s) for s in sizes]


def run_phase(model, strategy, pipelines, phase, plan, chief):
    k, batch = strategy.num_replicas_in_sync, plan["batch"]
    steps = int(phase["steps"])
    record = {key: phase[key] for key in ("name", "kind", "pipeline", "input_work")}
    record["steps"] = steps
    strategy.split_input_work = phase["input_work"] == "split"
    dataset = pipelines.get(phase["pipeline"])
    callbacks = []
    dynamic = None
    if phase["kind"] == "dynamic":
        dynamic = hb.DynamicBatching()
        callbacks.append(dynamic)
        first, read_busy = steps // 2, False
    else:
        sizes = resolve_sizes(phase.get("sizes", "even"), batch, k)
        callbacks.append(SetSplit(strategy, sizes))
        skip = int(phase.get("skip", multi_worker.DEFAULT_SWITCH_MARGIN + 4))
        first = min(skip, max(steps - 2, 0))
        record.update(sizes=sizes, skip=first)
        read_busy = True
    window = Window(strategy, pipelines.meter, max(first, 1), steps, read_busy)
    callbacks.append(window)
    start = time.perf_counter()
    model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks)
    record["fit_seconds"] = time.perf_counter() - start
    secs = np.array(window.step_seconds)
    record["step_seconds"] = secs.tolist()
    measured = secs[window.first:] if secs.size > window.first else secs
    record["step_ms_median"] = float(np.median(measured) * 1e3)
    record["step_ms_mean"] = float(np.mean(secs) * 1e3)
    if dynamic is not None:
        record["sizes"] = list(dynamic.batch_sizes or [])
        record["settled_sizes"] = list(dynamic.settled_batch_sizes or [])
        record["initial_sizes"] = dynamic.history[0]["new"] if dynamic.history else None
        record["adjustments"] = max(len(dynamic.history) - 1, 0)
        used = [w for w in dynamic.windows if w["used"]]
        tail = used[len(used) // 2:] or dynamic.windows[-1:]
        if tail:
            record["busy"] = {
                "time_per_step": np.mean([w["time_per_step"] for w in tail], axis=0).tolist(),
                "samples_per_step": np.mean([w["samples_per_step"] for w in tail],
                                            axis=0).tolist()}
    else:
        record["busy"] = window.busy
    delta = window.delta if window.delta is not None else np.full(len(FIELDS), np.nan)
    record["input"] = per_worker_input(gather_rows(strategy, delta))  # a collective
    if chief:
        busy = record.get("busy") or {}
        tps = ", ".join(f"{t * 1e3:.0f}" for t in busy.get("time_per_step", []))
        ims = ", ".join(f"{t * 1e3:.0f}" for t in record["input"]["seconds"])
        print(f"# {record['name']:<28} split {record.get('settled_sizes', record.get('sizes'))} "
              f"{record['step_ms_median']:.1f} ms/step (busy ms [{tps}], input ms [{ims}])",
              flush=True)
    return record


def run_epoch(strategy, pipelines, phase, plan, chief):
    """Read amplification: one pass over a finite pipeline's distributed dataset."""
    sizes = list(strategy.batch_sizes)  # set by the phase before (see `SetSplit`)
    strategy.split_input_work = phase["input_work"] == "split"
    dataset = pipelines.get(phase["pipeline"], samples=int(phase["samples"]))
    records = fashion_mnist.png_records("train", int(phase["samples"]))
    before = np.concatenate([pipelines.meter.read(), [rchar()]])
    batches = 0
    for _ in strategy.experimental_distribute_dataset(dataset):
        batches += 1
    delta = np.concatenate([pipelines.meter.read(), [rchar()]]) - before
    gathered = gather_rows(strategy, np.concatenate([delta, [batches]]))  # a collective
    record = {key: phase[key] for key in ("name", "kind", "pipeline", "input_work")}
    record.update(sizes=sizes, samples=records.count, file_bytes=records.bytes,
                  global_batches=gathered[:, -1].tolist(),
                  input={name: gathered[:, i].tolist() for i, name in enumerate(FIELDS)})
    if chief:
        own = record["input"]["own_bytes"]
        read = record["input"]["read_bytes"]
        print(f"# {record['name']:<28} split {sizes}: read/own bytes "
              + ", ".join(f"{r / o:.2f}" if o else "inf" for r, o in zip(read, own)), flush=True)
    return record


def main(argv=None):
    args, plan = parse_plan_args(__doc__, argv)
    strategy = make_strategy()
    chief = strategy.is_chief
    task = _task_index()
    started = time.time() - plan["t0"]
    meter = fashion_mnist.InputMeter()  # this worker's; outside the strategy scope
    pipelines = Pipelines(plan, task, meter)
    model = build_model(strategy, plan)
    done, waited = [], "start_at" not in plan
    for phase in plan["phases"]:
        if phase["kind"] != "warmup" and not waited:
            wait_until(plan, chief)  # the caps are applied now (bench_common.run_cluster)
            waited = True
        if phase["kind"] == "epoch":
            done.append(run_epoch(strategy, pipelines, phase, plan, chief))
        else:
            done.append(run_phase(model, strategy, pipelines, phase, plan, chief))
    result = {"data": pipelines.source, "phases": done, "replicas": strategy.num_replicas_in_sync,
              "model": plan["model"], "batch": plan["batch"], "worker_started_s": started,
              "switch_margin": multi_worker.DEFAULT_SWITCH_MARGIN}
    if chief:
        with open(args.result, "w") as f:
            json.dump(result, f)
    return 0


def _task_index():
    config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    return config.get("task", {}).get("index", 0)


if __name__ == "__main__":
    sys.exit(main())
