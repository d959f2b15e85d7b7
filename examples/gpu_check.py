"""Checks tf_hetbatch on this machine's devices, GPUs and CPU together, and prints one table.

On a machine with GPUs (a few minutes):

    python examples/gpu_check.py

1. every device alone (each GPU, the CPU): its kind and measured samples/s;
2. one host, all of them as replicas (GPUs and the CPU in one job): the static split (each
   replica's nominal FLOP/s, `part_capacities`) and the split `DynamicBatching` settles on;
3. exactness: that job with an uneven split against one device on the same global batches;
4. two workers (`tf_hetbatch.launch`): worker 0 hosts the GPUs, worker 1 the CPU; the kinds
   differ, so the all-reduce goes through each worker's CPU (`strategy.layout.all_reduce` is
   "host"); each replica's samples/s and the exactness against one device;
5. micro-batches, on the host of part 2 with the uneven split of part 3: the mean step time without
   micro-batch limits and with each replica bounded at a third of its share (3 micro-batches
   each, `set_micro_batch_limits`), and the bounded run's exactness against one device;
6. XLA: a `jit_compile=True` fit under `HeteroMirroredStrategy` on all GPUs (an uneven split
   where there are several; XLA compiles the step, so the replicas are not timed and the split
   stays as set): whether it trained, and its exactness against one device, jit-compiled too.

Up front, each device with memory of its own (a GPU: `tf.config.experimental.get_memory_info`)
gets a memory bound from `tf_hetbatch.probe_micro_batch_limits`: the peak memory of a training
step at two batch sizes (each after one warm-up step), fitted linearly (a fixed part plus a
part per sample) and solved for the budget TensorFlow's allocator gives the device (here,
with memory growth on and no virtual devices: nvidia-smi's total memory less TensorFlow's
per-process reserve) less headroom for the all-reduce (3x the model's trainable bytes). The
table shows the budget, where it came from, the headroom and the measured peaks side by side.

Without a GPU it says which parts it skipped (part 6: XLA with several logical CPU replicas
fails for the stock MirroredStrategy too) and runs the rest on logical CPUs: two logical
CPUs stand in for a host with two devices, and the two workers host 1 and 2 logical CPUs with
the host all-reduce forced (the path a GPU worker and a CPU worker take). `--steps 4` is the
tiny mode the test suite runs (well under a minute on CPU).
"""

import argparse
import functools
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # TensorFlow's GPU i: nvidia-smi's
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

BATCH = 64
EXACT = 1e-5  # the same kind of device: float32 rounding only
EXACT_MIXED = 1e-4  # GPUs and CPUs: different kernels round differently


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=0,
                        help="tiny mode: steps of each part (default: the full check)")
    parser.add_argument("--filters", type=int, default=32, help="conv filters of the model")
    parser.add_argument("--out", default="", help="write the results as JSON here too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default="", help=argparse.SUPPRESS)
    parser.add_argument("--gpus", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def steps_of(args):
    """Steps of each part: (per device, dynamic, exactness, cluster)."""
    if args.steps:
        return args.steps, 5 * args.steps, args.steps, args.steps
    return 40, 300, 20, 40


# ------------------------------------------------------------------------- model, data ----
def data(n, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, n)
    x = rng.normal(0.0, 1.0, (n, 28, 28, 1)).astype("float32")
    x[np.arange(n), y * 2 + 4, 4:24, 0] += 3.0  # a learnable mark per class
    return x, y.astype("int64")


def dataset(steps, seed=0):
    import tensorflow as tf

    x, y = data(steps * BATCH, seed)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def make_model(filters, jit_compile=False):
    import keras

    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(4),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    return model


def max_diff(a, b):
    import numpy as np

    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def skewed(split):
    """`split` made clearly uneven for the exactness checks: half of the first replica's
    share moved to the last (equal devices get an even static split, which would check
    little)."""
    moved = split[0] // 2
    return [split[0] - moved] + list(split[1:-1]) + [split[-1] + moved]


@functools.lru_cache(maxsize=None)  # parts 3 and 5 compare against the same run
def one_device_weights(steps, filters):
    """One device (TensorFlow's default placement) on the same global batches."""
    model = make_model(filters)
    model.fit(dataset(steps), epochs=1, verbose=0)
    return model.get_weights()


class StepClock:
    """Wall time of each training step (a Keras callback)."""

    def __init__(self):
        import keras

        clock = self

        class Callback(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                clock.start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                clock.seconds.append(time.perf_counter() - clock.start)

        self.seconds, self.start, self.callback = [], 0.0, Callback()

    def samples_per_second(self):
        import numpy as np

        late = self.seconds[len(self.seconds) // 2:] or self.seconds
        return BATCH / float(np.median(late))

    def mean_ms(self):
        """Mean step time in ms, the first step (tracing) left out."""
        later = self.seconds[1:] or self.seconds
        return 1000.0 * sum(later) / len(later)


# ------------------------------------------------------------------------- one host -------
def set_up_devices(num_gpus):
    """This process's replica devices: every GPU and the CPU; without GPUs, 2 logical CPUs."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if not num_gpus:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        return ["/cpu:0", "/cpu:1"]
    tf.config.experimental.enable_tensor_float_32_execution(False)  # float32, as on the CPU
    return [f"/gpu:{i}" for i in range(num_gpus)] + ["/cpu:0"]


def measure_devices(devices, args):
    """Per device alone: (kind, samples/s)."""
    import tensorflow as tf

    import tf_hetbatch as hb

    steps = steps_of(args)[0]
    out = []
    for device in devices:
        strategy = hb.HeteroMirroredStrategy([device])
        with strategy.scope():
            model = make_model(args.filters)
        clock = StepClock()
        model.fit(dataset(steps).repeat(), steps_per_epoch=steps, epochs=1, verbose=0,
                  callbacks=[clock.callback])
        kind = tf.DeviceSpec.from_string(device).device_type
        out.append({"device": device, "kind": kind, "samples_per_s": clock.samples_per_second()})
    return out


def one_host(devices, args):
    """Static split, settled split and exactness of one job over all `devices`."""
    import tf_hetbatch as hb
    from tf_hetbatch.core.split import split_proportionally

    _, dynamic_steps, exact_steps, _ = steps_of(args)
    strategy = hb.HeteroMirroredStrategy(devices)
    static = [int(s) for s in split_proportionally(
        BATCH, strategy.part_capacities(), min_sizes=1)]
    with strategy.scope():
        model = make_model(args.filters)
    dynamic = hb.DynamicBatching(initial="flops", warmup_steps=2 if args.steps else 5,
                                 interval=4 if args.steps else 10)
    model.fit(dataset(dynamic_steps, seed=1).repeat(), steps_per_epoch=dynamic_steps,
              epochs=1, verbose=0, callbacks=[dynamic])
    # Exactness: a fresh model, an uneven split, against one device from the same start.
    exact = hb.HeteroMirroredStrategy(devices)
    exact.set_batch_sizes(skewed(static))
    with exact.scope():
        ours = make_model(args.filters)
    ours.fit(dataset(exact_steps), epochs=1, verbose=0)
    diff = max_diff(ours.get_weights(), one_device_weights(exact_steps, args.filters))
    return {"static_split": static, "settled_split": list(dynamic.settled_batch_sizes),
            "exact_split": skewed(static), "max_weight_diff": diff}


def micro_batches(devices, split, args):
    """Mean step time of one job over `devices` with the uneven `split`, without micro-batch
    limits and with each replica bounded at a third of its share; the bounded run's limits,
    micro-batch counts (from the strategy after the run: a bound lowered after running out of
    memory shows) and exactness against one device."""
    import tf_hetbatch as hb
    from tf_hetbatch.core.micro_batches import micro_batch_counts

    steps = steps_of(args)[2]
    result = {}
    for name, limits in (("unbounded", None), ("bounded", [-(-b // 3) for b in split])):
        strategy = hb.HeteroMirroredStrategy(devices)
        strategy.set_batch_sizes(split)
        if limits is not None:
            strategy.set_micro_batch_limits(limits)
        with strategy.scope():
            model = make_model(args.filters)
        clock = StepClock()
        model.fit(dataset(steps), epochs=1, verbose=0, callbacks=[clock.callback])
        result[f"step_ms_{name}"] = clock.mean_ms()
    limits = strategy.micro_batch_limits
    result.update(
        split=list(split), limits=list(limits) if limits is not None else None,
        counts=micro_batch_counts(strategy.batch_sizes, limits).astype(int).tolist(),
        max_weight_diff=max_diff(model.get_weights(),
                                 one_device_weights(steps, args.filters)))
    return result


# ------------------------------------------------------------------------- XLA ------------
def jit_fit(num_gpus, args):
    """A `jit_compile=True` fit under `HeteroMirroredStrategy` on the `num_gpus` GPUs, uneven
    where there are several: whether it trained (else the error) and its exactness against one
    device (TensorFlow's default placement), jit-compiled too, on the same global batches."""
    import tf_hetbatch as hb

    steps = steps_of(args)[2]
    strategy = hb.HeteroMirroredStrategy([f"/gpu:{i}" for i in range(num_gpus)])
    even = [BATCH // num_gpus + (i < BATCH % num_gpus) for i in range(num_gpus)]
    split = skewed(even) if num_gpus > 1 else even
    strategy.set_batch_sizes(split)
    with strategy.scope():
        model = make_model(args.filters, jit_compile=True)
    try:
        model.fit(dataset(steps), epochs=1, verbose=0)
    except Exception as error:  # the check reports it: the other parts' results still print
        message = _cause(error)
        return {"split": split, "trained": False, "error": f"{type(error).__name__}: {message}"}
    one = make_model(args.filters, jit_compile=True)
    one.fit(dataset(steps), epochs=1, verbose=0)
    return {"split": split, "trained": True,
            "max_weight_diff": max_diff(model.get_weights(), one.get_weights())}


def _cause(error):
    """The line of a TensorFlow error that says what failed (not its trace), shortened."""
    lines = [line.strip() for line in str(error).splitlines()
             if line.strip() and not line[:1].isspace()]
    said = [line for line in lines if not line.startswith(
        ("Graph execution error", "Detected at node", "Stack trace", "[["))]
    return (said or lines or [""])[0][:300]


# ------------------------------------------------------------------------- memory ---------
def reports_memory(device):
    """Whether `device` has memory of its own that TensorFlow reports: a GPU (or TPU). CPUs
    report the host's allocator (TensorFlow 2.21), shared by every CPU replica and the input
    pipeline: no bound of one replica's."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device)
    if spec.device_type not in ("GPU", "TPU"):
        return False
    try:
        tf.config.experimental.get_memory_info(f"{spec.device_type}:{spec.device_index or 0}")
    except ValueError:  # memory statistics not tracked
        return False
    return True


def probe_memory(devices, args):
    """Per device with memory of its own (GPUs): its peak memory at the probe's two batch
    sizes, the budget the probe used (bytes, source, detail), the all-reduce headroom and the
    bound a linear fit gives (`tf_hetbatch.probe_micro_batch_limits`); [] where none has
    (CPUs)."""
    import tf_hetbatch as hb

    reporting = [d for d in devices if reports_memory(d)]  # starts the runtime on the GPUs
    if not reporting:
        return []
    probes = hb.probe_micro_batch_limits(functools.partial(make_model, args.filters),
                                         data(256, seed=2), reporting)
    return [{"device": p.device, "sizes": list(p.sizes), "peak_bytes": list(p.peak_bytes),
             "budget_bytes": p.memory_bytes, "budget_source": p.memory_source,
             "budget_detail": p.memory_detail, "headroom_bytes": p.headroom_bytes,
             "bound": p.bound} for p in probes]


# ------------------------------------------------------------------------- two workers ----
def worker(args):
    """One worker of the two-worker job (TF_CONFIG set by the launcher)."""
    import tensorflow as tf

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    if args.gpus:
        if index == 0:
            devices = set_up_devices(args.gpus)[:-1]  # the GPUs
        else:
            tf.config.set_visible_devices([], "GPU")  # the CPU only
            devices = ["/cpu:0"]
    else:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * (index + 1))
        devices = [f"/cpu:{i}" for i in range(index + 1)]
    import numpy as np

    import tf_hetbatch as hb
    from tf_hetbatch.core.split import split_proportionally

    steps = steps_of(args)[3]
    strategy = hb.HeteroMultiWorkerMirroredStrategy(
        devices, all_reduce=None if args.gpus else "host")
    split = skewed([int(s) for s in split_proportionally(
        BATCH, strategy.part_capacities(), min_sizes=1)])  # a collective: every worker
    strategy.set_batch_sizes(split)
    with strategy.scope():
        model = make_model(args.filters)
    model.fit(dataset(steps), epochs=1, verbose=0)
    times = strategy.read_replica_times()  # local: every worker reads every replica
    if strategy.is_chief:
        layout = strategy.layout
        result = {"layout": layout.describe(), "all_reduce": layout.all_reduce,
                  "kinds": list(layout.replica_kinds), "split": split,
                  "samples_per_s": np.nan_to_num(times.throughput).tolist(),
                  "max_weight_diff": max_diff(model.get_weights(),
                                              one_device_weights(steps, args.filters))}
        with open(args.result, "w") as f:
            json.dump(result, f)


def two_workers(args, num_gpus, workdir):
    """Runs the two-worker job through the launcher; the chief's result."""
    from tf_hetbatch.launch import launch

    result = os.path.join(workdir, "two_workers.json")
    command = [os.path.abspath(__file__), "--worker", "--result", result, "--gpus",
               str(num_gpus), "--filters", str(args.filters), "--steps", str(args.steps)]
    lines = []

    class Lines:
        def write(self, text):
            lines.extend(text.splitlines())
            return len(text)

        def flush(self):
            pass

    outcome = launch(command, 2, threads=None if num_gpus else 1, timeout=900,
                     stdout=Lines(), stderr=Lines(), handle_signals=False)
    if not outcome.ok:
        print("\n".join(lines[-30:]))
        raise SystemExit(f"gpu_check: the two-worker job failed: {outcome.message}")
    with open(result) as f:
        return json.load(f)


# ------------------------------------------------------------------------- the table ------
def verdict(diff, mixed):
    bound = EXACT_MIXED if mixed else EXACT
    return f"{diff:.1e} ({'ok' if diff <= bound else 'NOT'} <= {bound:g})"


def print_table(results):
    gpus = results["gpus"]
    print(f"\ntf_hetbatch GPU check: TensorFlow {results['tensorflow']}, {gpus} GPU(s)")
    if not gpus:
        print("No GPU here: skipped the GPU devices, CPU+GPU replicas in one job, and a GPU "
              "worker beside a CPU worker; their mechanisms ran on logical CPUs instead (2 "
              "logical CPUs as one host's devices; workers hosting 1 and 2 logical CPUs, "
              "the host all-reduce forced).")
    host = results["one_host"]
    print(f"\n{'device':12}{'kind':>6}{'samples/s':>12}{'static split':>14}"
          f"{'settled split':>15}")
    for row, static, settled in zip(results["devices"], host["static_split"],
                                    host["settled_split"]):
        print(f"{row['device']:12}{row['kind']:>6}{row['samples_per_s']:>12.0f}"
              f"{static:>14}{settled:>15}")
    mixed = gpus > 0
    print(f"\none host, {len(results['devices'])} replicas"
          f"{' (GPUs and the CPU)' if mixed else ''}, split {host['exact_split']}: "
          f"exact vs one device: {verdict(host['max_weight_diff'], mixed)}")
    cluster = results["two_workers"]
    speeds = ", ".join(f"{k} {s:.0f}" for k, s in zip(cluster["kinds"],
                                                       cluster["samples_per_s"]))
    print(f"two workers: {cluster['layout']}\n  split {cluster['split']}; samples/s per "
          f"replica: {speeds}\n  exact vs one device: "
          f"{verdict(cluster['max_weight_diff'], mixed)}")
    micro = results["micro_batches"]
    counts = ", ".join(str(c) for c in micro["counts"])
    bounded = f"bounds {micro['limits']} ({counts} micro-batches)"
    print(f"micro-batches, one host, split {micro['split']}:\n"
          f"  {'no bounds':40} step {micro['step_ms_unbounded']:7.1f} ms\n"
          f"  {bounded:40} step {micro['step_ms_bounded']:7.1f} ms; exact vs one device: "
          f"{verdict(micro['max_weight_diff'], mixed)}")
    jit = results["jit"]
    if jit is None:
        print("jit_compile: skipped: no GPU (XLA with several logical CPU replicas fails for "
              "the stock MirroredStrategy too)")
    elif jit["trained"]:
        print(f"jit_compile=True, {gpus} GPU(s), split {jit['split']}: trained; exact vs one "
              f"device: {verdict(jit['max_weight_diff'], False)}")
    else:
        print(f"jit_compile=True, {gpus} GPU(s), split {jit['split']}: did NOT train: "
              f"{jit['error']}")
    if not results["memory_bounds"]:
        print("memory bounds: skipped: no device reports memory of its own (no GPU; CPU "
              "replicas share the host's)")
    for row in results["memory_bounds"]:
        print(memory_bound_line(row))


def memory_bound_line(row):
    """One device's probe: the measured peaks next to the budget, its source and headroom."""
    peaks = ", ".join(f"{p / 2**20:.1f} MB at {b}" for b, p in zip(row["sizes"],
                                                                   row["peak_bytes"]))
    budget = ("unknown" if row["budget_bytes"] is None else
              f"{row['budget_bytes'] / 2**30:.2f} GB less headroom "
              f"{row['headroom_bytes'] / 2**20:.1f} MB")
    return (f"memory bound of {row['device']}: step peak {peaks}; budget {budget} "
            f"[{row['budget_source']}: {row['budget_detail']}]: "
            f"{'none' if row['bound'] is None else row['bound']} samples at once")


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args)
    import tensorflow as tf  # listing physical devices does not start the runtime

    num_gpus = len(tf.config.list_physical_devices("GPU"))
    workdir = tempfile.mkdtemp(prefix="tf_hetbatch_gpu_check_")
    results = {"tensorflow": tf.__version__, "gpus": num_gpus,
               "two_workers": two_workers(args, num_gpus, workdir)}  # before this process
    devices = set_up_devices(num_gpus)                             # takes GPU memory
    results["memory_bounds"] = probe_memory(devices, args)
    results["devices"] = measure_devices(devices, args)
    results["one_host"] = one_host(devices, args)
    results["micro_batches"] = micro_batches(devices, results["one_host"]["exact_split"], args)
    results["jit"] = jit_fit(num_gpus, args) if num_gpus else None
    print_table(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
