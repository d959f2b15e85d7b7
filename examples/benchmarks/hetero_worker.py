"""One worker of a benchmark cluster: runs a plan of training phases in ONE process.

Started by the benchmark drivers through `tf_hetbatch.launch.launch` (TF_CONFIG set), or
alone (one replica, for debugging). Every phase runs in the same process, on the same model
and strategy, so all phases see the same conditions (caps, start-up state, data).

    python examples/benchmarks/hetero_worker.py --plan plan.json --result result.json

The plan (JSON) holds the model (`model`, `filters`, `batch`, `train_samples`,
`test_samples`) and a `task`:

* `"phases"`: `phases` is a list of
  - `{"name", "kind": "static", "sizes": [..] | "even" | "best" | "of", "steps", "skip"}`: a
    fixed split set with `set_batch_sizes` (a collective, same point on every worker; it takes
    effect `switch_margin` steps later, so the first `skip` steps are not measured). `"best"`
    picks, identically on every worker, the static phase whose name starts with `best_of`
    (default "grid") with the lowest cluster-mean median step time; `"of"` takes the split
    an earlier phase named `of` ended with (for a dynamic phase, the split its controller
    settled on: a step-time search's try in flight at the end is left out).
  - `{"name", "kind": "dynamic", "steps", "initial", "controller", "max_sizes"}`: a fresh
    `DynamicBatching(initial=..., max_sizes=...)` for that phase (a second `fit` in the same
    process).
  Any phase may set `micro_batch_limits` (per replica, 0: no bound) at its start; the plan's
  own `micro_batch_limits` are set before the model's step is traced.
  Each phase is one `model.fit(steps_per_epoch=steps)`; a `warmup` phase traces first.
* `"accuracy"`: `runs` (list of "even" / "dynamic"): for each, a fresh model (same seed)
  trains `epochs` epochs with validation on the test set; epoch train times and test
  accuracies are recorded.

The chief prints progress lines starting with `#` and writes the result JSON.
"""

import argparse
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
from tf_hetbatch.distribute import multi_worker  # noqa: E402
from train_fashion_mnist import make_model  # noqa: E402


class StepTimer(keras.callbacks.Callback):
    """Wall time of every step (end to end), stamps, and busy times over a measured range.

    `read_at=(first, last)`: reads `strategy.read_replica_times(reset=True)` (local)
    after step `first` (dropping what came before) and after step `last`, so the second
    read covers steps first+1..last only. None for phases where DynamicBatching reads them.
    """

    def __init__(self, strategy, t0, read_at=None):
        super().__init__()
        self.strategy, self.t0, self.read_at = strategy, t0, read_at
        self.step_seconds, self.stamps, self.busy = [], [], None
        self._count = 0

    def on_train_begin(self, logs=None):
        self._last = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._last is None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        self.step_seconds.append(now - self._last)
        self._last = now
        self.stamps.append(time.time() - self.t0)
        self._count += 1
        if self.read_at is not None:
            first, last = self.read_at
            if self._count == first:
                self.strategy.read_replica_times(reset=True)
            elif self._count == last:
                times = self.strategy.read_replica_times(reset=True)
                self.busy = {"time_per_step": times.time_per_step.tolist(),
                             "samples_per_step": times.samples_per_step.tolist(),
                             "steps": times.steps.tolist()}


class EpochTimer(keras.callbacks.Callback):
    """Per-epoch training seconds (validation excluded), validation seconds, test accuracy and
    loss, train loss and (asynchronous training) mean staleness; progress lines on the chief.

    Validation is timed by `on_test_begin`/`on_test_end`, which both Keras `fit` and
    `tf_hetbatch.AsyncTrainer.fit` call around it.
    """

    def __init__(self, chief, label):
        super().__init__()
        self.chief, self.label = chief, label
        self.train_seconds, self.val_seconds = [], []
        self.test_accuracy, self.test_loss, self.loss, self.staleness = [], [], [], []
        self._test_start = None

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()
        self._val = 0.0

    def on_test_begin(self, logs=None):
        self._test_start = time.perf_counter()

    def on_test_end(self, logs=None):
        if self._test_start is not None:
            self._val += time.perf_counter() - self._test_start
            self._test_start = None

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        total = time.perf_counter() - self._start
        self.train_seconds.append(total - self._val)
        self.val_seconds.append(self._val)
        self.test_accuracy.append(float(logs.get("val_accuracy", float("nan"))))
        self.test_loss.append(float(logs.get("val_loss", float("nan"))))
        self.loss.append(float(logs.get("loss", float("nan"))))
        if "staleness" in logs:
            self.staleness.append(float(logs["staleness"]))
        if self.chief:
            extra = f", mean staleness {logs['staleness']:.2f}" if "staleness" in logs else ""
            print(f"# {self.label} epoch {epoch + 1}: train {self.train_seconds[-1]:.1f} s, "
                  f"test accuracy {self.test_accuracy[-1]:.4f}{extra}", flush=True)


def make_strategy(layout=""):
    """The plan's strategy; `layout` ("1,2"): worker i hosts that many logical CPUs as its
    replicas (configured here, before TensorFlow's runtime starts)."""
    if "TF_CONFIG" in os.environ:
        devices = None
        if layout:
            count = [int(c) for c in layout.split(",")][
                json.loads(os.environ["TF_CONFIG"])["task"]["index"]]
            tf.config.set_logical_device_configuration(
                tf.config.list_physical_devices("CPU")[0],
                [tf.config.LogicalDeviceConfiguration()] * count)
            devices = [f"/cpu:{i}" for i in range(count)]
        return hb.HeteroMultiWorkerMirroredStrategy(devices)
    return hb.HeteroMirroredStrategy(["/cpu:0"])


def build_model(strategy, plan):
    with strategy.scope():
        if plan["model"] == "dense":
            keras.utils.set_random_seed(7)
            model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(),
                                      keras.layers.Dense(128, activation="relu"),
                                      keras.layers.Dense(10)])
            model.compile(optimizer=keras.optimizers.Adam(1e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
            return model
        return make_model(plan["model"], plan.get("filters", 16),
                          plan.get("steps_per_execution", 1))


def best_static(strategy, phases, prefix="grid"):
    """Index (into `phases`) of the `prefix...` phase with the lowest cluster-mean median step.

    Each worker's medians differ slightly, so they are gathered (a collective) and averaged:
    every worker then picks the same split.
    """
    grid = [i for i, p in enumerate(phases) if p["name"].startswith(prefix)]
    local = np.array([p["step_ms_median"] for p in (phases[i] for i in grid)], np.float64)
    n_local = len(strategy.extended.worker_devices)
    gathered = strategy.gather_replica_values(np.tile(local, (n_local, 1)))
    return grid[int(np.argmin(gathered.mean(axis=0)))]


def run_phase(model, strategy, dataset, phase, done, plan, chief):
    k, batch, t0 = strategy.num_replicas_in_sync, plan["batch"], plan["t0"]
    steps = int(phase["steps"])
    record = {"name": phase["name"], "kind": phase["kind"], "steps": steps}
    callbacks = []
    dynamic = None
    if phase["kind"] in ("static", "warmup"):
        sizes = phase.get("sizes", "even")
        if sizes == "even":
            sizes = list(hb.split_evenly(batch, k))
        elif sizes == "best":
            best = best_static(strategy, done, phase.get("best_of", "grid"))
            sizes = done[best]["sizes"]
            record["best_phase"] = done[best]["name"]
        elif sizes == "of":
            of = next(p for p in done if p["name"] == phase["of"])
            sizes = of.get("settled_sizes", of["sizes"])
        sizes = [int(s) for s in sizes]
        strategy.set_batch_sizes(sizes)  # a collective: every worker at the same point
        skip = int(phase.get("skip", multi_worker.DEFAULT_SWITCH_MARGIN + 4))
        skip = min(skip, max(steps - 2, 0))
        record.update(sizes=sizes, skip=skip)
        timer = StepTimer(strategy, t0, read_at=(skip, steps) if steps - skip >= 1 else None)
    else:
        dynamic = hb.DynamicBatching(initial=phase.get("initial", "uniform"),
                                     controller=phase.get("controller"),
                                     max_sizes=phase.get("max_sizes"))
        callbacks.append(dynamic)
        timer = StepTimer(strategy, t0)
        record["initial"] = phase.get("initial", "uniform")
    callbacks.append(timer)
    if "micro_batch_limits" in phase:  # read by the traced step: no retrace (plan-wide limits)
        strategy.set_micro_batch_limits([m or None for m in phase["micro_batch_limits"]])
        record["micro_batch_limits"] = phase["micro_batch_limits"]
    start = time.perf_counter()
    model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks)
    record["fit_seconds"] = time.perf_counter() - start
    secs = np.array(timer.step_seconds)
    record["step_seconds"] = secs.tolist()
    record["stamps"] = timer.stamps
    record["phase_seconds"] = float(secs.sum())
    if dynamic is not None:
        record["history"] = dynamic.history
        record["windows"] = dynamic.windows
        record["sizes"] = list(dynamic.batch_sizes or [])
        # Without a step-time search's try in flight at the end of the phase.
        record["settled_sizes"] = list(dynamic.settled_batch_sizes or [])
        steady = secs[len(secs) // 2:]
        record["step_ms_median"] = float(np.median(steady) * 1e3)
        record["step_ms_mean"] = float(np.mean(secs) * 1e3)
        # Changes after the initial split: by the controller's rule, and its step-time
        # search's tries (and returns).
        search = [e for e in dynamic.history[1:] if e["reason"].startswith("step-time search")]
        record["adjustments"] = max(len(dynamic.history) - 1 - len(search), 0)
        record["search_tries"] = len(search)
        used = [w for w in dynamic.windows if w["used"]]
        tail = used[len(used) // 2:] or dynamic.windows[-1:]
        if tail:
            record["busy"] = {
                "time_per_step": np.mean([w["time_per_step"] for w in tail], axis=0).tolist(),
                "samples_per_step": np.mean([w["samples_per_step"] for w in tail],
                                            axis=0).tolist()}
    else:
        measured = secs[record["skip"]:]
        record["step_ms_median"] = float(np.median(measured if measured.size else secs) * 1e3)
        record["busy"] = timer.busy
    if chief:
        busy = record.get("busy") or {}
        tps = ", ".join(f"{t * 1e3:.0f}" for t in busy.get("time_per_step", []))
        print(f"# {record['name']:<22} split {record.get('sizes')} "
              f"{record['step_ms_median']:.1f} ms/step (busy ms [{tps}])"
              + (f", {record['adjustments']} adjustments" if dynamic is not None else ""),
              flush=True)
    return record


def wait_until(plan, chief):
    """Sleeps until `start_at` seconds after t0 (when the launcher has applied the caps)."""
    if "start_at" not in plan:
        return
    delay = plan["t0"] + plan["start_at"] - time.time()
    if chief:
        print(f"# waiting {max(delay, 0):.1f} s for the CPU caps (start_at "
              f"{plan['start_at']:g} s)", flush=True)
    if delay > 0:
        time.sleep(delay)


def task_phases(strategy, plan, chief):
    x, y, source = fashion_mnist.load("train", plan.get("train_samples", 12800))
    batch = plan["batch"]
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=1)
               .batch(batch, drop_remainder=True).repeat())
    if "micro_batch_limits" in plan:  # before the step is traced: phases may change them
        strategy.set_micro_batch_limits([m or None for m in plan["micro_batch_limits"]])
    model = build_model(strategy, plan)
    done, waited = [], "start_at" not in plan
    for phase in plan["phases"]:
        if phase["kind"] != "warmup" and not waited:
            wait_until(plan, chief)  # the caps are applied now (bench_common.run_cluster)
            waited = True
        done.append(run_phase(model, strategy, dataset, phase, done, plan, chief))
    return {"data": source, "phases": done}


def task_accuracy(strategy, plan, chief):
    x, y, source = fashion_mnist.load("train", plan.get("train_samples", 12800))
    xt, yt, _ = fashion_mnist.load("test", plan.get("test_samples", 10000))
    batch, k = plan["batch"], strategy.num_replicas_in_sync
    test = tf.data.Dataset.from_tensor_slices((xt, yt)).batch(batch, drop_remainder=True)
    runs = []
    if "start_at" in plan:
        wait_until(plan, chief)  # the caps are applied now (bench_common.run_cluster)
    for i, mode in enumerate(plan["runs"]):
        model = build_model(strategy, plan)
        # A new dataset per run: a seeded shuffle continues its sequence of orders on every
        # new iterator of the same dataset object, so reusing it would change the data order.
        train = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=1)
                 .batch(batch, drop_remainder=True))
        timer = EpochTimer(chief, f"{mode} #{i // 2 + 1}")
        callbacks = [timer]
        dynamic = None
        if mode == "dynamic":
            dynamic = hb.DynamicBatching(initial=plan.get("initial", "uniform"))
            callbacks.insert(0, dynamic)
        else:
            strategy.set_batch_sizes(list(hb.split_evenly(batch, k)))
        model.fit(train, epochs=plan["epochs"], validation_data=test, verbose=0,
                  callbacks=callbacks)
        runs.append({"mode": mode, "train_seconds": timer.train_seconds,
                     "val_seconds": timer.val_seconds, "test_accuracy": timer.test_accuracy,
                     "loss": timer.loss,
                     "final_sizes": list(strategy.batch_sizes or []),
                     "adjustments": max(len(dynamic.history) - 1, 0) if dynamic else 0,
                     "history": dynamic.history if dynamic else [],
                     "windows": dynamic.windows if dynamic else []})
    return {"data": source, "runs": runs}


def parse_plan_args(doc, argv=None):
    """`--plan PLAN.json --result RESULT.json` of a benchmark worker script: (args, plan)."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True, help="the plan JSON file")
    parser.add_argument("--result", required=True, help="the chief writes its result here")
    args = parser.parse_args(argv)
    with open(args.plan) as f:
        plan = json.load(f)
    plan.setdefault("t0", time.time())
    return args, plan


def main(argv=None):
    args, plan = parse_plan_args(__doc__, argv)
    strategy = make_strategy(plan.get("layout", ""))
    chief = strategy.is_chief
    started = time.time() - plan["t0"]
    if plan.get("task", "phases") == "phases":
        result = task_phases(strategy, plan, chief)
    else:
        result = task_accuracy(strategy, plan, chief)
    result.update(replicas=strategy.num_replicas_in_sync, model=plan["model"],
                  batch=plan["batch"], worker_started_s=started,
                  switch_margin=multi_worker.DEFAULT_SWITCH_MARGIN)
    if chief:
        with open(args.result, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
