"""Checks tf_hetbatch on this machine's devices, GPUs and CPU together, and prints one table.

On a machine with GPUs (a few minutes):

    python examples/gpu_check.py

1. every device alone (each GPU, the CPU): its kind and measured samples/s;
2. one host, all of them as replicas (GPUs and the CPU in one job): the static split (each
   replica's nominal FLOP/s, `part_capacities`) and the split `DynamicBatching` settles on;
3. exactness: that job with an uneven split against one device on the same global batches;
4. two workers (`tf_hetbatch.launch`): worker 0 hosts the GPUs, worker 1 the CPU (the
   launcher's `gpus`: all on worker 0, none on worker 1); the kinds differ, so the all-reduce
   goes through each worker's CPU (`strategy.layout.all_reduce` is "host"); each replica's
   samples/s and the exactness against one device;
5. micro-batches, on the host of part 2 with the uneven split of part 3: the mean step time without
   micro-batch limits and with each replica bounded at a third of its share (3 micro-batches
   each, `set_micro_batch_limits`), and the bounded run's exactness against one device;
6. XLA: a `jit_compile=True` fit under `HeteroMirroredStrategy` on all GPUs (an uneven split
   where there are several; XLA compiles the step, so the replicas are not timed and the split
   stays as set): whether it trained, and its exactness against one device, jit-compiled too;
7. op determinism (`tf.config.experimental.enable_op_determinism()`, in a process of its own:
   it stays on for the process): a fit under `HeteroMirroredStrategy` on all GPUs at an uneven
   split, twice: the two runs bit-identical, every replica timed
   (`read_replica_times().timed_steps`), exact against one device;
8. out of memory before the update gate: on the GPUs with micro-batch limits all None,
   replica 0's share (32 samples, on the GPU with the smallest budget the probe found) needs
   1.25x that budget at once (half of it fits; the others get 4 samples; memory growth on);
   fit must lower its bound to half its share (one WARNING "ran out of memory"), run the
   step again and end exact against one device. The row gives the time from the step's
   start to the failure (TensorFlow's GPU allocator waits up to 10 s before it fails an
   allocation) and of the re-run. Runs last: the allocator keeps what it took;
9. NCCL across 2 local workers with different GPU counts: the launcher's `gpus="0|1,2"`
   (worker 0 GPU 0, worker 1 GPUs 1 and 2; with 2 GPUs "0|1"; with 1 skipped), one collective
   group of all replicas (`strategy.layout.all_reduce` "device", implementation NCCL), exact
   against one device;
10. soft device placement off (`tf.config.set_soft_device_placement(False)`, in a process of
   its own): a fit on all GPUs at an uneven split trains (every op of the step, the timing
   stamps too, on a device with a kernel for it) and is exact against one device.

Parts 4, 7, 9 and 10 run first, in processes of their own (7, 10 beside 9; 4 alone, as it
measures speeds), before this process takes GPU memory; each is compared with this process's
one-device run. The table ends with a summary: PASS, FAIL or skipped per checking part (also
in `--out`'s JSON, each part's "status").

Up front, each device with memory of its own (a GPU: `tf.config.experimental.get_memory_info`)
gets a memory bound from `tf_hetbatch.probe_micro_batch_limits`: the peak memory of a training
step at two batch sizes (each after one warm-up step), fitted linearly (a fixed part plus a
part per sample) and solved for the budget TensorFlow's allocator gives the device (here,
with memory growth on and no virtual devices: nvidia-smi's total memory less TensorFlow's
per-process reserve) less headroom for the all-reduce (3x the model's trainable bytes). The
table shows the budget, where it came from, the headroom and the measured peaks side by side.

Without a GPU it says which parts it skipped (part 6: XLA with several logical CPU replicas
fails for the stock MirroredStrategy too) and runs the rest on logical CPUs: two logical
CPUs stand in for a host with two devices (parts 1-3, 5, 7, 8, 10), part 4's workers host 1
and 2 logical CPUs with the host all-reduce forced (the path a GPU worker and a CPU worker
take), part 9's the same with RING for NCCL, and part 8's allocation is injected (4 TiB
asked for above half of replica 0's share, refused at once, as the tests do). `--steps 4` is
the tiny mode the test suite runs (about a minute on CPU).
"""

import argparse
import functools
import json
import logging
import math
import os
import shutil
import subprocess
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
ISOLATED = ("determinism", "soft-placement-off")  # parts 7 and 10: process-wide settings
OOM_SHARE = {"GPU": 32, "CPU": 48}  # part 8: the share of replica 0, which runs out


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=0,
                        help="tiny mode: steps of each part (default: the full check)")
    parser.add_argument("--filters", type=int, default=32, help="conv filters of the model")
    parser.add_argument("--out", default="", help="write the results as JSON here too")
    parser.add_argument("--worker", choices=("host", "device"), help=argparse.SUPPRESS)
    parser.add_argument("--isolated", choices=ISOLATED, help=argparse.SUPPRESS)
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


def dataset(steps, seed=0, batch=BATCH):
    import tensorflow as tf

    x, y = data(steps * batch, seed)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def make_model(filters, jit_compile=False, front=()):
    """The check's model; `front`: layers put before it (part 8's memory)."""
    import keras

    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((28, 28, 1)), *front,
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


def status(passed):
    return "PASS" if passed else "FAIL"


def uneven_split(k):
    """The global batch over `k` equal replicas, made uneven where there are several."""
    even = [BATCH // k + (i < BATCH % k) for i in range(k)]
    return skewed(even) if k > 1 else even


def fit_on(devices, split, args, jit_compile=False):
    """A fit under `HeteroMirroredStrategy(devices)` at `split`: (strategy, model)."""
    import tf_hetbatch as hb

    strategy = hb.HeteroMirroredStrategy(devices)
    strategy.set_batch_sizes(split)
    with strategy.scope():
        model = make_model(args.filters, jit_compile=jit_compile)
    model.fit(dataset(steps_of(args)[2]), epochs=1, verbose=0)
    return strategy, model


def skewed(split):
    """`split` made clearly uneven for the exactness checks: half of the first replica's
    share moved to the last (equal devices get an even static split, which would check
    little)."""
    moved = split[0] // 2
    return [split[0] - moved] + list(split[1:-1]) + [split[-1] + moved]


def save_weights(model, result_path, result):
    """A part's other process: its model's weights beside its result, for `compare`."""
    import numpy as np

    result["weights"] = result_path + ".npz"
    np.savez(result["weights"], *model.get_weights())


def compare(found, steps, args):
    """The max weight difference between the model a part's other process saved
    (`save_weights`) and one device's (this process's) on the same `steps` global batches;
    into `found` too. Infinite if nothing was saved (the part failed)."""
    import numpy as np

    if "weights" not in found:
        return float("inf")
    with np.load(found.pop("weights")) as saved:
        weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    found["max_weight_diff"] = max_diff(weights, one_device_weights(steps, args.filters))
    return found["max_weight_diff"]


@functools.lru_cache(maxsize=None)  # parts 3-5 and 7-10 compare against the same run
def one_device_weights(steps, filters, batch=BATCH):
    """One device (TensorFlow's default placement) on the same global batches."""
    model = make_model(filters)
    model.fit(dataset(steps, batch=batch), epochs=1, verbose=0)
    return model.get_weights()


class StepClock:
    """Wall time of each training step (a Keras callback)."""

    def __init__(self):
        import keras

        clock = self

        class Callback(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                clock.start = time.perf_counter()
                clock.starts.append(clock.start)

            def on_train_batch_end(self, batch, logs=None):
                clock.seconds.append(time.perf_counter() - clock.start)

        self.seconds, self.starts, self.start, self.callback = [], [], 0.0, Callback()

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
        return logical_cpus(2)
    tf.config.experimental.enable_tensor_float_32_execution(False)  # float32, as on the CPU
    return [f"/gpu:{i}" for i in range(num_gpus)] + ["/cpu:0"]


def logical_cpus(n):
    """`n` logical CPUs (before TensorFlow's runtime starts): their names."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    return [f"/cpu:{i}" for i in range(n)]


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
    split = uneven_split(num_gpus)
    try:
        _, model = fit_on([f"/gpu:{i}" for i in range(num_gpus)], split, args, jit_compile=True)
    except Exception as error:  # the check reports it: the other parts' results still print
        return {"split": split, "trained": False, "error": _cause(error)}
    one = make_model(args.filters, jit_compile=True)
    one.fit(dataset(steps_of(args)[2]), epochs=1, verbose=0)
    return {"split": split, "trained": True,
            "max_weight_diff": max_diff(model.get_weights(), one.get_weights())}


def _cause(error):
    """The error's type and the line of its message that says what failed (not its trace),
    shortened."""
    lines = [line.strip() for line in str(error).splitlines()
             if line.strip() and not line[:1].isspace()]
    said = [line for line in lines if not line.startswith(
        ("Graph execution error", "Detected at node", "Stack trace", "[["))]
    return f"{type(error).__name__}: {(said or lines or [''])[0][:300]}"


# ------------------------------------------------------------------------- settings -------
def isolated(args):
    """Part 7 or 10 in a process of its own (`--isolated`; the setting stays on for the
    process): op determinism, or soft device placement off, then fits on all GPUs (else 2
    logical CPUs) at an uneven split. Writes the part's result to `--result`."""
    import tensorflow as tf

    num_gpus = len(tf.config.list_physical_devices("GPU"))
    devices = set_up_devices(num_gpus)[:num_gpus or None]  # the GPUs, else 2 logical CPUs
    split = uneven_split(len(devices))
    result = {"devices": devices, "split": split}
    try:
        if args.isolated == "determinism":
            tf.config.experimental.enable_op_determinism()
        else:
            tf.config.set_soft_device_placement(False)
        strategy, model = fit_on(devices, split, args)
        if args.isolated == "determinism":  # a second run, bit for bit; every replica timed
            import numpy as np

            _, again = fit_on(devices, split, args)
            result.update(bit_identical=all(np.array_equal(a, b) for a, b in zip(
                model.get_weights(), again.get_weights())), timed_steps=strategy.
                read_replica_times().timed_steps.astype(int).tolist())
        save_weights(model, args.result, result)
    except Exception as error:  # reported in the part's row
        result.update(status="FAIL", error=_cause(error))
    with open(args.result, "w") as f:
        json.dump(result, f)


def start_isolated(name, args, workdir):
    """Starts part `name` (`ISOLATED`) in a process of its own: (the process, its result
    file); its output goes to a log file beside the result."""
    result = os.path.join(workdir, f"{name}.json")
    command = [sys.executable, os.path.abspath(__file__), "--isolated", name, "--result",
               result, "--filters", str(args.filters), "--steps", str(args.steps)]
    with open(result + ".log", "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), result


def finish_isolated(started, timeout=900):
    """The result of a part `start_isolated` started, or a FAIL naming how its process
    ended (with its log's last line)."""
    process, result = started
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.returncode == 0 and os.path.exists(result):
        with open(result) as f:
            return json.load(f)
    with open(result + ".log") as f:
        last = (f.read().strip().splitlines() or [""])[-1][:300]
    return {"status": "FAIL", "error": f"its process exited with {process.returncode} "
            f"(log {result}.log): {last}"}


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


# ------------------------------------------------------------------------- out of memory --
def memory_layer(per_sample_bytes=None, fail_above=None):
    """Part 8's first layer: its input unchanged, after it held memory in training. On a GPU
    (`per_sample_bytes`): that many bytes per sample of its batch, all at once (zeros in
    pieces of at most 2**30 floats: TensorFlow's GPU fill indexes with 32 bits). On CPU
    (`fail_above`, the tests' injection; an allocation near the host's memory is not safe):
    4 TiB for a batch of more than `fail_above` samples, which the allocator refuses, else 4
    bytes."""
    import keras
    import tensorflow as tf

    class Memory(keras.layers.Layer):
        def call(self, x, training=None):
            if not training:
                return x
            n = tf.shape(x, out_type=tf.int64)[0]
            if fail_above is not None:
                sizes = [tf.where(n > fail_above, tf.constant(2**40, tf.int64),
                                  tf.constant(1, tf.int64))]
            else:
                pieces = math.ceil(per_sample_bytes * OOM_SHARE["GPU"] / 4 / 2**30)
                sizes = [n * math.ceil(per_sample_bytes / 4 / pieces)] * pieces
            held = [tf.zeros(tf.reshape(size, [1]), x.dtype) for size in sizes]
            shapes = tf.shape_n(held, out_type=tf.int64)  # takes every piece: all held
            used = [h[0] for h in held] + [tf.cast(shape[0], x.dtype) for shape in shapes]
            return x + 0.0 * tf.add_n(used)

    return Memory()


def out_of_memory(devices, num_gpus, memory_bounds, args):
    """Part 8: replica 0's share does not fit its device, the micro-batch limits are all
    None: fit must lower its bound to half the share (one warning), run the step again and
    end exact against one device (the model without `memory_layer`, which has no weights, on
    the same global batches). On the GPUs with a budget from the probe, replica 0 on the
    smallest holds 1.25 x its budget at its share (0.63 x at half of it); the others get 4
    samples. On CPU the
    allocation is injected (`memory_layer`). Also timed: from the failing step's start to the
    warning (on a GPU, TensorFlow's allocator waits up to 10 s before it fails) and from the
    warning to the step's end (the re-run)."""
    import tf_hetbatch as hb
    from tf_hetbatch.core.micro_batches import lowered_limit

    share = OOM_SHARE["GPU" if num_gpus else "CPU"]
    if num_gpus:
        known = sorted((row["budget_bytes"], row["device"]) for row in memory_bounds
                       if row["device"] in devices[:num_gpus] and row["budget_bytes"])
        if not known:
            return {"status": "skipped", "reason": "no GPU memory budget known (see the "
                    "memory bound rows)"}
        devices = [device for _, device in known]  # replica 0: the least memory
        layer = functools.partial(memory_layer, per_sample_bytes=math.ceil(
            1.25 * known[0][0] / share))
        split = [share] + [4] * (len(devices) - 1)
    else:
        layer = functools.partial(memory_layer, fail_above=share // 2)
        split = [share, BATCH - share]
    strategy = hb.HeteroMirroredStrategy(devices)
    strategy.set_batch_sizes(split)
    strategy.set_micro_batch_limits([None] * len(devices))
    with strategy.scope():
        model = make_model(args.filters, front=[layer()])
    said, clock = [], StepClock()

    class Said(logging.Handler):
        def emit(self, record):
            if "ran out of memory" in record.getMessage():
                said.append((time.perf_counter(), record.getMessage()))

    logger, handler = logging.getLogger("tf_hetbatch.distribute.out_of_memory"), Said()
    logger.addHandler(handler)
    steps, bound = steps_of(args)[2], lowered_limit(share)
    try:
        model.fit(dataset(steps, batch=sum(split)), epochs=1, verbose=0,
                  callbacks=[clock.callback])
    except Exception as error:  # reported in the part's row
        return {"status": "FAIL", "split": split, "error": _cause(error)}
    finally:
        logger.removeHandler(handler)
    limits = list(strategy.micro_batch_limits)
    # One device: the same model without the layer (it has no weights), as it fits there.
    diff = max_diff(model.get_weights(), one_device_weights(steps, args.filters, sum(split)))
    result = {"split": split, "warnings": [m for _, m in said], "limits": limits,
              "bound": bound, "steps_trained": int(strategy.steps_trained),
              "max_weight_diff": diff, "failed_after_s": None, "rerun_s": None}
    if said:
        at = said[0][0]
        step = max(i for i, start in enumerate(clock.starts) if start <= at)
        result.update(failed_after_s=at - clock.starts[step],
                      rerun_s=clock.starts[step] + clock.seconds[step] - at)
    passed = (len(said) == 1 and limits == [bound] + [None] * (len(split) - 1)
              and result["steps_trained"] == steps and diff <= EXACT)
    result["status"] = status(passed)
    return result


# ------------------------------------------------------------------------- two workers ----
def worker(args):
    """One worker of a two-worker job (TF_CONFIG set by the launcher, which also chose the
    GPUs it sees). Its replicas: its GPUs; on a machine without GPUs (`--gpus 0`), 1 logical
    CPU on worker 0 and 2 on worker 1; the CPU of part 4's worker without GPUs. All-reduce:
    `--worker host` (part 4) the strategy's choice, forced to the host path without GPUs;
    `--worker device` (part 9) one collective group, NCCL on GPUs (RING between CPUs)."""
    import tensorflow as tf

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    gpus = len(tf.config.list_physical_devices("GPU"))
    if gpus:
        devices = set_up_devices(gpus)[:-1]  # the GPUs
    elif args.gpus:
        devices = ["/cpu:0"]  # part 4: the CPU worker beside the GPU worker
    else:
        devices = logical_cpus(index + 1)
    import numpy as np

    import tf_hetbatch as hb
    from tf_hetbatch.core.split import split_proportionally

    steps = steps_of(args)[3]
    if args.worker == "device":
        implementation = tf.distribute.experimental.CommunicationImplementation
        strategy = hb.HeteroMultiWorkerMirroredStrategy(
            devices, all_reduce="device",
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=implementation.NCCL if gpus else implementation.RING))
    else:
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
                  "implementation": layout.implementation,
                  "kinds": list(layout.replica_kinds), "split": split,
                  "samples_per_s": np.nan_to_num(times.throughput).tolist()}
        save_weights(model, args.result, result)
        with open(args.result, "w") as f:
            json.dump(result, f)


def two_workers(args, num_gpus, workdir, mode="host", gpus=None):
    """Runs a two-worker job (`worker`, `--worker mode`) through the launcher, `gpus` each
    worker's GPUs (part 4 on GPUs: all on worker 0, none on worker 1); the chief's result."""
    from tf_hetbatch.launch import launch

    if mode == "host" and num_gpus:
        gpus = ",".join(str(i) for i in range(num_gpus)) + "|"
    result = os.path.join(workdir, f"two_workers_{mode}.json")
    command = [os.path.abspath(__file__), "--worker", mode, "--result", result, "--gpus",
               str(num_gpus), "--filters", str(args.filters), "--steps", str(args.steps)]
    lines = []

    class Lines:
        def write(self, text):
            lines.extend(text.splitlines())
            return len(text)

        def flush(self):
            pass

    outcome = launch(command, 2, threads=None if num_gpus else 1, timeout=900, gpus=gpus,
                     stdout=Lines(), stderr=Lines(), handle_signals=False)
    if not outcome.ok:
        if mode == "device":  # part 9: its row says so
            return {"status": "FAIL", "gpus": gpus, "error": outcome.message,
                    "last_lines": lines[-30:]}
        print("\n".join(lines[-30:]))
        raise SystemExit(f"gpu_check: the two-worker job failed: {outcome.message}")
    with open(result) as f:
        return json.load(f)


def device_all_reduce_workers(args, num_gpus, workdir):
    """Part 9: two local workers, one collective group of all replicas: with 3 GPUs or more
    worker 0 gets GPU 0 and worker 1 GPUs 1 and 2 (the launcher's `gpus="0|1,2"`), with 2 one
    each, NCCL; without GPUs 1 and 2 logical CPUs, RING. Exact against one device."""
    if num_gpus == 1:
        return {"status": "skipped", "reason": "1 GPU: NCCL across 2 workers needs 2 (3 for "
                "different counts)"}
    gpus = None if not num_gpus else "0|1" if num_gpus == 2 else "0|1,2"
    found = two_workers(args, num_gpus, workdir, mode="device", gpus=gpus)
    found.setdefault("gpus", gpus)
    return found


def judge(results, num_gpus, args):
    """Parts 4, 7, 9 and 10 (other processes) against one device (this one): their weight
    differences, and the statuses of 7, 9 and 10."""
    steps = steps_of(args)
    compare(results["two_workers"], steps[3], args)
    group = results["device_all_reduce"]
    if "status" not in group:  # it ran
        want = "NCCL" if num_gpus else "RING"
        diff = compare(group, steps[3], args)
        group["status"] = status(group["all_reduce"] == "device"
                                 and group["implementation"] == want and diff <= EXACT)
    for name in ("determinism", "soft_placement_off"):
        found = results[name]
        if "status" not in found:
            passed = compare(found, steps[2], args) <= EXACT
            if name == "determinism":
                passed = passed and found["bit_identical"] and min(found["timed_steps"]) > 0
            found["status"] = status(passed)


# ------------------------------------------------------------------------- the table ------
def verdict(diff, mixed):
    bound = EXACT_MIXED if mixed else EXACT
    return f"{diff:.1e} ({'ok' if diff <= bound else 'NOT'} <= {bound:g})"


def print_table(results, args):
    gpus = results["gpus"]
    print(f"\ntf_hetbatch GPU check: TensorFlow {results['tensorflow']}, {gpus} GPU(s)")
    if not gpus:
        print("No GPU here: skipped the GPU devices, CPU+GPU replicas in one job, a GPU "
              "worker beside a CPU worker, NCCL and a GPU's own out of memory; their "
              "mechanisms ran on logical CPUs instead (2 logical CPUs as one host's devices; "
              "workers hosting 1 and 2 logical CPUs, the host all-reduce forced or RING in "
              "NCCL's place; the out-of-memory allocation injected).")
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
    print_new_parts(results, args)
    print("\nsummary:")
    for name, found in summary(results):
        print(f"  {found:8} {name}")


def print_new_parts(results, args):
    """Parts 7-10: a line naming the part, where it ran and its status, then what it found
    (or why it was skipped, or the error)."""
    gpus = results["gpus"]
    where = f"{gpus} GPU(s)" if gpus else "2 logical CPUs"
    det, oom = results["determinism"], results["out_of_memory"]
    group, soft = results["device_all_reduce"], results["soft_placement_off"]
    rows = [
        (f"op determinism (own process), {where}, split {det.get('split')}", det,
         lambda: f"two runs {'bit-identical' if det['bit_identical'] else 'DIFFER'}; steps "
         f"timed per replica {det['timed_steps']} of {steps_of(args)[2]} (a share's first "
         f"is not); exact vs one device: "
         f"{verdict(det['max_weight_diff'], False)}"),
        (f"out of memory before the gate ({'a real allocation' if gpus else 'injected'}), "
         f"{where}, split {oom.get('split')}, bounds all None", oom,
         lambda: f"{len(oom['warnings'])} warning \"ran out of memory\"; bounds now "
         f"{oom['limits']} (replica 0: {oom['bound']}, half its share); the step failed "
         f"{oom['failed_after_s'] or 0:.2f} s after it started (tracing included), its "
         f"re-run took {oom['rerun_s'] or 0:.2f} s; exact vs one device: "
         f"{verdict(oom['max_weight_diff'], False)}"),
        ("one all-reduce group across 2 local workers, " + (
            f"NCCL, launcher gpus={group.get('gpus')!r}" if gpus else
            "logical CPUs and RING (no GPU for NCCL)"), group,
         lambda: f"{group['layout']}; split {group['split']}; exact vs one device: "
         f"{verdict(group['max_weight_diff'], False)}"),
        (f"soft device placement off (own process), {where}, split {soft.get('split')}",
         soft, lambda: f"trained; exact vs one device: "
         f"{verdict(soft['max_weight_diff'], False)}"),
    ]
    for title, found, detail in rows:
        said = found.get("reason") or found.get("error") or detail()
        print(f"{title.replace(', split None', '')}: {found['status']}\n  {said}")


def summary(results):
    """(part, PASS/FAIL/skipped) for the parts that check a result."""
    mixed = results["gpus"] > 0
    bound = EXACT_MIXED if mixed else EXACT
    jit = results["jit"]
    return [
        ("3 one host, uneven split, exact",
         status(results["one_host"]["max_weight_diff"] <= bound)),
        ("4 two workers, host all-reduce, exact",
         status(results["two_workers"]["max_weight_diff"] <= bound)),
        ("5 micro-batches, exact", status(results["micro_batches"]["max_weight_diff"] <= bound)),
        ("6 jit_compile=True", "skipped" if jit is None else status(
            jit["trained"] and jit["max_weight_diff"] <= EXACT)),
        ("7 op determinism", results["determinism"]["status"]),
        ("8 out of memory before the gate", results["out_of_memory"]["status"]),
        ("9 one all-reduce group across 2 workers", results["device_all_reduce"]["status"]),
        ("10 soft device placement off", results["soft_placement_off"]["status"]),
    ]


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
    if args.isolated:
        return isolated(args)
    import tensorflow as tf  # listing physical devices does not start the runtime

    num_gpus = len(tf.config.list_physical_devices("GPU"))
    if not num_gpus:  # part 8's injection: refused at once (oneDNN's allocator waits 10 s)
        os.environ.setdefault("TF_ONEDNN_USE_SYSTEM_ALLOCATOR", "true")
    workdir = tempfile.mkdtemp(prefix="tf_hetbatch_gpu_check_")
    results = {"tensorflow": tf.__version__, "gpus": num_gpus}
    started = []
    try:
        # Processes of their own first, before this one takes GPU memory. Part 4 alone (it
        # measures speeds); parts 7 and 10 beside part 9.
        results["two_workers"] = two_workers(args, num_gpus, workdir)
        started = [start_isolated(name, args, workdir) for name in ISOLATED]
        results["device_all_reduce"] = device_all_reduce_workers(args, num_gpus, workdir)
        results["determinism"], results["soft_placement_off"] = map(finish_isolated, started)
        devices = set_up_devices(num_gpus)
        judge(results, num_gpus, args)  # reads the weights the processes saved in workdir
        results["memory_bounds"] = probe_memory(devices, args)
        results["devices"] = measure_devices(devices, args)
        results["one_host"] = one_host(devices, args)
        results["micro_batches"] = micro_batches(devices, results["one_host"]["exact_split"],
                                                 args)
        results["jit"] = jit_fit(num_gpus, args) if num_gpus else None
        # Last: on GPUs it fills one, and this process's allocator keeps what it took.
        results["out_of_memory"] = out_of_memory(devices, num_gpus, results["memory_bounds"],
                                                 args)
        print_table(results, args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        for process, _ in started:  # not left running if a part raised
            if process.poll() is None:
                process.kill()
                process.wait()
        if any(isinstance(r, dict) and r.get("status") == "FAIL" for r in results.values()):
            print(f"The logs of the parts' processes: {workdir}")  # a FAIL names its log
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
