"""One training run of `bench_async.py`: ASP on a parameter-server cluster, or BSP for reference.

Started by `bench_async.py` through `tf_hetbatch.launch.launch` (TF_CONFIG set):

* `"mode": "asp"` (a cluster with chief, ps and workers; `launch(..., num_ps=1)`): this script
  is the chief. It trains with `hb.AsyncTrainer` on `hb.HeteroParameterServerStrategy`, at
  the even split (`"dynamic": false`, every update a batch of `batch`: stock ASP) or with
  `hb.DynamicBatching()` (`"dynamic": true`). An epoch is `steps` updates (all workers
  together); each update is plain SGD with learning rate `lr` on a mean batch of `batch`.
* `"mode": "bsp"` (a worker-only cluster; `launch(..., num_ps=0)`): every worker runs this
  script; `hb.HeteroMultiWorkerMirroredStrategy` + `DynamicBatching()`, global batch
  K x `batch`, an epoch of `steps / K` steps (the same samples per epoch as ASP) with SGD at
  learning rate K x `lr` (the linear scaling rule: one step on K x `batch` samples stands for
  K updates on `batch`).

Every run builds the same model from the same seed and reads the same data. After each epoch
the chief evaluates on the test set; training time per epoch excludes that evaluation. The
chief prints progress lines starting with `#` and writes the result JSON.

    python examples/benchmarks/async_worker.py --plan plan.json --result result.json
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # examples/: fashion_mnist
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fashion_mnist  # noqa: E402
import tf_hetbatch as hb  # noqa: E402
from hetero_worker import EpochTimer as EpochClock, parse_plan_args, wait_until  # noqa: E402,E501


def build_model(plan):
    """A small CNN (the `cnn` of train_fashion_mnist.py with `filters`), seeded, uncompiled."""
    keras.utils.set_random_seed(plan["seed"])
    f = plan["filters"]
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(f, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(f, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(4),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])


def load_data(plan):
    """(train uint8 images, labels, test float images, labels, source); uint8 keeps the graph
    constants of the per-worker input pipelines small (they are sent to every worker)."""
    x, y, source = fashion_mnist.load("train", plan["train_samples"])
    xt, yt, _ = fashion_mnist.load("test", plan["test_samples"])
    return np.round(x * 255).astype(np.uint8), y, xt, yt, source


def to_float(image, label):
    return tf.cast(image, tf.float32) / 255.0, label


class MetricCheck(keras.callbacks.Callback):
    """Per epoch: samples the trainer's `loss` metric counted vs samples the strategy counted
    (its exact per-worker counters). They differ if concurrent metric updates are lost."""

    def __init__(self, strategy, trainer):
        super().__init__()
        self.strategy, self.trainer = strategy, trainer
        self.metric, self.counted = [], []

    def _samples(self):
        return float(self.strategy.read_totals().samples.sum())

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self._samples()

    def on_epoch_end(self, epoch, logs=None):
        self.metric.append(float(self.trainer.loss_tracker.count.numpy()))
        self.counted.append(self._samples() - self._start)


def make_dynamic(plan):
    kwargs = {k: plan[k] for k in ("warmup_steps", "interval") if plan.get(k) is not None}
    return hb.DynamicBatching(**kwargs)


def percentiles(histogram, qs=(50, 90, 99)):
    """Percentiles of integer staleness values given their histogram (None if empty)."""
    counts = np.asarray(histogram, np.int64)
    total = int(counts.sum())
    if total == 0:
        return {f"p{q}": None for q in qs}
    cum = np.cumsum(counts)
    return {f"p{q}": int(np.searchsorted(cum, q / 100.0 * total - 1e-9)) for q in qs}


def _none_nan(values):
    return [None if not np.isfinite(v) else float(v) for v in values]


def run_asp(plan):
    strategy = hb.HeteroParameterServerStrategy(staleness_bins=plan.get("staleness_bins", 64))
    k, batch = strategy.num_workers, plan["batch"]
    with strategy.scope():
        model = build_model(plan)
    trainer = hb.AsyncTrainer(
        model, keras.optimizers.SGD(plan["lr"]),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    x, y, xt, yt, source = load_data(plan)
    seed = plan["seed"]

    def dataset_fn(context):
        # Each worker its own seeded order of the same examples.
        return (tf.data.Dataset.from_tensor_slices((x, y))
                .shuffle(len(x), seed=seed * 1000 + context.input_pipeline_id)
                .repeat().map(to_float))

    test = tf.data.Dataset.from_tensor_slices((xt, yt)).batch(256)
    label = "ASP dynamic" if plan["dynamic"] else "ASP even"
    clock = EpochClock(True, label)
    metric_check = MetricCheck(strategy, trainer)
    callbacks = [clock, metric_check]
    dynamic = None
    if plan["dynamic"]:
        dynamic = make_dynamic(plan)
        callbacks.insert(0, dynamic)
    wait_until(plan, True)
    started = time.perf_counter()
    history = trainer.fit(dataset_fn, batch_size=batch, epochs=plan["epochs"],
                          steps_per_epoch=plan["steps"], validation_data=test, verbose=0,
                          callbacks=callbacks)
    fit_seconds = time.perf_counter() - started
    stale = trainer.staleness
    # Cumulative per-worker counters (read_replica_times() is reset by DynamicBatching's
    # windows, so it cannot give totals over the fit).
    totals = strategy.read_totals()
    samples, steps, seconds = totals.samples, totals.steps, totals.compute_seconds
    overall = stale.overall()
    return {
        "mode": "asp", "dynamic": plan["dynamic"], "label": label, "data": source,
        "workers": k, "batch": batch, "lr": plan["lr"],
        "train_seconds": clock.train_seconds, "val_seconds": clock.val_seconds,
        "test_accuracy": clock.test_accuracy, "test_loss": clock.test_loss,
        "loss": clock.loss, "epoch_staleness": clock.staleness,
        "history": {key: [float(v) for v in vals] for key, vals in history.history.items()},
        "fit_seconds": fit_seconds,
        "final_sizes": list(strategy.batch_sizes or []),
        "update_count": strategy.updates,
        "updates_per_worker": stale.updates.tolist(),
        "counted_updates_per_worker": steps.tolist(),
        "samples_per_worker": samples.tolist(),
        "seconds_per_update": _none_nan(seconds / np.maximum(steps, 1)),
        "staleness": {
            "histogram": stale.histogram.tolist(),
            "overall": overall.tolist(),
            "mean": _none_nan(stale.mean),
            "max": stale.max.tolist(),
            "overall_mean": float(overall @ np.arange(len(overall)) / max(1, overall.sum())),
            "overall_max": int(stale.max.max()),
            "percentiles": percentiles(overall),
            "bins": len(overall),
        },
        "adjustments": max(len(dynamic.history) - 1, 0) if dynamic else 0,
        "split_history": dynamic.history if dynamic else [],
        "windows": dynamic.windows if dynamic else [],
        # Samples per epoch as the train `loss` metric counted them vs as the strategy did.
        "metric_samples": metric_check.metric, "counted_samples": metric_check.counted,
    }


def run_bsp(plan):
    strategy = hb.HeteroMultiWorkerMirroredStrategy()
    chief = strategy.is_chief
    k = strategy.num_replicas_in_sync
    batch, steps = plan["batch"] * k, max(1, plan["steps"] // k)
    x, y, xt, yt, source = load_data(plan)
    # Every worker reads the same seeded sequence of global batches (the strategy keeps each
    # replica's slice).
    train = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=plan["seed"])
             .repeat().map(to_float).batch(batch, drop_remainder=True))
    # The hetero strategies split every batch they see, validation too: batch it like training
    # (choose test_samples a multiple of K x batch to use them all).
    test = tf.data.Dataset.from_tensor_slices((xt, yt)).batch(batch, drop_remainder=True)
    with strategy.scope():
        model = build_model(plan)
        model.compile(optimizer=keras.optimizers.SGD(plan["lr"] * k),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    clock = EpochClock(chief, "BSP dynamic")
    dynamic = make_dynamic(plan)
    wait_until(plan, chief)
    started = time.perf_counter()
    model.fit(train, epochs=plan["epochs"], steps_per_epoch=steps, validation_data=test,
              verbose=0, callbacks=[dynamic, clock])
    fit_seconds = time.perf_counter() - started
    return {
        "mode": "bsp", "dynamic": True, "label": "BSP dynamic", "data": source,
        "workers": k, "batch": batch, "lr": plan["lr"] * k, "steps_per_epoch": steps,
        "train_seconds": clock.train_seconds, "val_seconds": clock.val_seconds,
        "test_accuracy": clock.test_accuracy, "test_loss": clock.test_loss,
        "loss": clock.loss, "fit_seconds": fit_seconds,
        "final_sizes": list(strategy.batch_sizes or []),
        "adjustments": max(len(dynamic.history) - 1, 0),
        "split_history": dynamic.history,
        "windows": dynamic.windows,
        "chief": chief,
    }


def main(argv=None):
    args, plan = parse_plan_args(__doc__, argv)
    started = time.time() - plan["t0"]
    if plan["mode"] == "asp":
        result = run_asp(plan)
    elif plan["mode"] == "bsp":
        result = run_bsp(plan)
    else:
        raise SystemExit(f"unknown mode {plan['mode']!r} (expected 'asp' or 'bsp')")
    result["started_s"] = started
    if result.pop("chief", True):
        with open(args.result, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
