"""Trains a CNN on Fashion-MNIST with a tf_hetbatch strategy: one worker of a cluster, or alone.

Run it as N workers with the launcher (TF_CONFIG set), or on its own (one host, logical CPUs):

    python -m tf_hetbatch.launch --workers 3 --cpus 0.15,0.25,0.6 examples/train_fashion_mnist.py --mode dynamic
    python examples/train_fashion_mnist.py --replicas 3 --mode even

`--mode even` is the stock behaviour (every replica gets B/K), `--mode static --sizes ...` a
fixed split, `--mode dynamic` DynamicBatching() with its defaults. The chief prints progress
and writes a JSON summary to --result.

`--pipeline png` (default) trains from PNG-encoded TFRecord files (written once, cached; see
fashion_mnist.py) through a tf.data pipeline that decodes and augments every sample
(`--augment heavy`: decode, resize 96, random crop 84, flip, resize 28; `light`: decode only);
under a multi-worker strategy each worker decodes only its own replicas' samples
(`--input-work unsplit`: every worker decodes every sample, the behaviour before the split of
input work). The summary then holds each worker's input time per step (the per-sample map's
work, measured in the pipeline) beside its compute time. `--pipeline arrays` trains from
in-memory arrays (`from_tensor_slices`). The test set is in-memory arrays either way.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fashion_mnist  # noqa: E402
import tf_hetbatch as hb  # noqa: E402


def make_model(kind, filters=16, steps_per_execution=1):
    keras.utils.set_random_seed(7)
    if kind == "linear":  # communication bound: tiny compute, the all-reduce dominates
        layers = [keras.layers.Flatten(), keras.layers.Dense(10)]
    elif kind == "small_cnn":
        layers = [
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    else:  # "cnn": per-sample compute outweighs a capped worker's ~20 ms fixed cost per step
        layers = [
            keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(4),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    model = keras.Sequential([keras.Input((28, 28, 1))] + layers)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return model


class Progress(keras.callbacks.Callback):
    """Chief-only progress lines and per-epoch wall times."""

    def __init__(self, chief, every, total_steps):
        super().__init__()
        self.chief, self.every, self.total = chief, every, total_steps
        self.epoch_times, self.step_times, self.first_step_times = [], [], []

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.perf_counter()
        self._done = 0  # steps of this epoch so far

    def on_train_batch_begin(self, batch, logs=None):
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        # One call per execution: `batch` is its last step (steps_per_execution > 1; Keras
        # counts a whole execution at an epoch's end).
        done = min(batch + 1, self.total)
        steps, before = max(done - self._done, 1), self._done
        if before == 0:  # from the epoch's start: its iterator, the previous one's release
            self.first_step_times.append(time.perf_counter() - self._epoch_start)
        self._done = done
        self.step_times.extend([(time.perf_counter() - self._t) / steps] * steps)
        if self.chief and self.every and done // self.every > before // self.every:
            recent = np.median(self.step_times[-self.every:]) * 1e3
            print(f"  step {done}/{self.total}  loss {logs['loss']:.3f}  "
                  f"{recent:.0f} ms/step", flush=True)

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_times.append(time.perf_counter() - self._epoch_start)
        if self.chief:
            print(f"  epoch {epoch + 1}: {self.epoch_times[-1]:.1f} s, loss {logs['loss']:.3f}, "
                  f"accuracy {logs['accuracy']:.3f}", flush=True)


class ComputeTimes(keras.callbacks.Callback):
    """Per-replica compute time per step over the run (after warm-up), for the summary."""

    def __init__(self, strategy, warmup):
        super().__init__()
        self.strategy, self.warmup, self.step = strategy, warmup, 0
        self.windows = []

    def on_epoch_begin(self, epoch, logs=None):
        self._done = 0

    def on_train_batch_end(self, batch, logs=None):
        before, self.step = self.step, self.step + batch + 1 - self._done
        self._done = batch + 1
        if (before < self.warmup <= self.step
                or (self.step > self.warmup and self.step // 10 > before // 10)):
            times = self.strategy.read_replica_times(reset=True)  # local: every worker has all
            # (DynamicBatching reads with reset too: a read at the same call finds no steps.)
            if self.step > self.warmup and np.all(np.asarray(times.steps) > 0):
                self.windows.append((times.samples_per_step.tolist(), times.time_per_step.tolist()))


def gather_input_work(strategy, meter, steps):
    """Every worker's input work per training step, per replica (None without a meter).

    A collective (`gather_replica_values`): every worker calls it at the same point.
    """
    if meter is None or not steps:
        return None
    local = len(strategy.extended.worker_devices)  # this worker's replicas share its meter
    seconds, samples = strategy.gather_replica_values(np.tile(meter.read(), (local, 1))).T[:2]
    return {"ms_per_step": (seconds / steps * 1e3).tolist(),
            "samples_per_step": (samples / steps).tolist()}


def worker_devices(layout):
    """This worker's replicas for `--layout` ("1,2": worker i hosts that many logical CPUs,
    configured here before TensorFlow starts); None without one (TensorFlow's choice)."""
    if not layout:
        return None
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    count = [int(c) for c in layout.split(",")][index]
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * count)
    return [f"/cpu:{i}" for i in range(count)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["even", "static", "dynamic"], default="dynamic")
    parser.add_argument("--sizes", default="", help="per-replica sizes for --mode static")
    parser.add_argument("--pipeline", choices=["png", "arrays"], default="png",
                        help="training input: PNG TFRecords decoded per sample (default), or "
                             "in-memory arrays")
    parser.add_argument("--augment", choices=list(fashion_mnist.AUGMENTATIONS), default="heavy",
                        help="--pipeline png: per-sample work (default heavy)")
    parser.add_argument("--input-work", choices=["split", "unsplit"], default="split",
                        help="multi-worker: each worker decodes its own samples only (split, "
                             "default) or every sample (unsplit)")
    parser.add_argument("--model", choices=["cnn", "small_cnn", "linear"], default="cnn")
    parser.add_argument("--filters", type=int, default=16, help="conv filters (--model cnn)")
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-samples", type=int, default=12800)
    parser.add_argument("--test-samples", type=int, default=10000)
    parser.add_argument("--steps", type=int, default=0, help="tiny mode: steps per epoch")
    parser.add_argument("--steps-per-execution", type=int, default=1,
                        help="Keras's steps_per_execution (cuts a step's fixed cost)")
    parser.add_argument("--replicas", type=int, default=0,
                        help="without TF_CONFIG: logical CPU replicas on this host")
    parser.add_argument("--layout", default="",
                        help="with TF_CONFIG: logical CPU replicas per worker, e.g. 1,2 (a "
                             "worker hosting several devices); default: one each")
    parser.add_argument("--log-dir", default="")
    parser.add_argument("--result", default="")
    parser.add_argument("--progress-every", type=int, default=25)
    args = parser.parse_args(argv)

    if "TF_CONFIG" in os.environ:
        strategy = hb.HeteroMultiWorkerMirroredStrategy(worker_devices(args.layout))
    else:
        cpus = tf.config.list_physical_devices("CPU")
        n = max(args.replicas, 1)
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * n)
        strategy = hb.HeteroMirroredStrategy([f"/cpu:{i}" for i in range(n)])
    chief = strategy.is_chief

    train_samples = min(args.train_samples, args.steps * args.batch) if args.steps else args.train_samples
    xt, yt, _ = fashion_mnist.load("test", 2 * args.batch if args.steps else args.test_samples)
    meter = None
    # The same order on every worker: a seeded shuffle.
    if args.pipeline == "png":
        records = fashion_mnist.png_records("train", train_samples)
        meter = fashion_mnist.InputMeter()  # this worker's; outside the strategy scope
        train = fashion_mnist.png_pipeline(records, args.batch, seed=1, augment=args.augment,
                                           meter=meter)
        n_train, source = records.count, records.source
        input_text = f"PNG TFRecords, {args.augment} per-sample work, input work {args.input_work}"
    else:
        x, y, source = fashion_mnist.load("train", train_samples)
        train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=1).batch(args.batch)
        n_train, input_text = len(x), "in-memory arrays"
    test = tf.data.Dataset.from_tensor_slices((xt, yt)).batch(args.batch)
    strategy.split_input_work = args.input_work == "split"
    if chief:
        print(f"data: {source}; {n_train} train ({input_text}) / {len(xt)} test samples; "
              f"{strategy.num_replicas_in_sync} replicas; mode {args.mode}", flush=True)

    if args.mode == "static":
        strategy.set_batch_sizes([int(s) for s in args.sizes.split(",")])
    with strategy.scope():
        model = make_model(args.model, args.filters, args.steps_per_execution)
    steps = n_train // args.batch + (n_train % args.batch > 0)
    progress = Progress(chief, args.progress_every, steps)
    warmup = min(5, max(steps - 1, 1))
    times = ComputeTimes(strategy, warmup)
    callbacks = [progress, times]
    dynamic = None
    if args.mode == "dynamic":
        dynamic = hb.DynamicBatching(log_dir=args.log_dir or None)
        callbacks.insert(0, dynamic)
    elif args.log_dir and chief:
        callbacks.append(keras.callbacks.TensorBoard(args.log_dir))
    model.fit(train, epochs=args.epochs, verbose=0, callbacks=callbacks)
    input_work = gather_input_work(strategy, meter, len(progress.step_times))  # collective
    result = model.evaluate(test, verbose=0, return_dict=True)

    last = times.windows[len(times.windows) // 2:] or times.windows
    balance = [np.mean(t) / np.max(t) for _, t in last if np.max(t) > 0]
    summary = {
        "mode": args.mode,
        "model": args.model,
        "data": source,
        "replicas": strategy.num_replicas_in_sync,
        "global_batch": args.batch,
        "steps_per_execution": args.steps_per_execution,
        "epoch_seconds": progress.epoch_times,
        "first_step_seconds": progress.first_step_times,
        "step_ms_median": float(np.median(progress.step_times[warmup:]) * 1e3),
        "step_ms_late_median": float(np.median(progress.step_times[len(progress.step_times) // 2:]) * 1e3),
        "balance_efficiency": float(np.mean(balance)) if balance else None,
        "final_batch_sizes": list(strategy.batch_sizes or []),
        "compute_ms_per_step": (np.array(last[-1][1]) * 1e3).tolist() if last else None,
        "samples_per_step": last[-1][0] if last else None,
        "test_accuracy": float(result["accuracy"]),
        "test_loss": float(result["loss"]),
        "adjustments": len(dynamic.history) if dynamic is not None else 0,
        "pipeline": args.pipeline,
        "augment": args.augment if args.pipeline == "png" else None,
        "input_work": args.input_work,
        # Per replica (a worker's value for each of its replicas), over the whole run: the
        # per-sample map's time and samples per training step (None for array input).
        "input_ms_per_step": input_work and input_work["ms_per_step"],
        "input_samples_per_step": input_work and input_work["samples_per_step"],
        "log_dir": args.log_dir,
    }
    if chief:
        print(json.dumps(summary), flush=True)
        if args.result:
            with open(args.result, "w") as f:
                json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
