"""A multi-worker training script for the tests: run by tf_hetbatch.launch with TF_CONFIG set.

Trains a small dense model with HeteroMultiWorkerMirroredStrategy on deterministic data that
carries a sample id, records the ids each worker's replicas trained on, optionally changes the
split mid-run from a callback, and saves weights and ids to <out>/worker<i>.npz.

`--layout 1,2` gives worker i that many logical CPUs as its replicas (configured before
TensorFlow starts): the shape of a cluster whose workers have different numbers of devices.
"""

import argparse
import json
import logging
import os
import sys
import time

import worker_start  # noqa: F401  (first: before TensorFlow)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_hetbatch as hb  # noqa: E402
from collective_count import EagerCollectives  # noqa: E402
from helpers import OutOfMemoryAbove  # noqa: E402
from tf_hetbatch.distribute.multi_worker import DEFAULT_SWITCH_MARGIN  # noqa: E402


def data(n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    x[:, 0] = np.arange(n)  # sample id, zeroed before the model sees it
    y = (x[:, 1:2] * 2.0 - x[:, 2:3] + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


class IdRecorder(keras.layers.Layer):
    def __init__(self, sink, **kwargs):
        super().__init__(**kwargs)
        self._sink = sink

    def call(self, inputs, training=None):
        if training:
            token = tf.py_function(
                lambda ids: self._sink.extend(ids.numpy().astype(int).tolist()) or np.int32(0),
                [inputs[:, 0]],
                tf.int32,
            )
            with tf.control_dependencies([token]):
                inputs = tf.identity(inputs)
        return inputs * tf.constant([0.0] + [1.0] * 7)


def read_late():
    """Every read of the coordination service's store waits 1.5 s first."""
    from tf_hetbatch.distribute._upstream import coordination

    get = coordination.get_coordination_key

    def late_get(key, timeout_s):
        time.sleep(1.5)
        return get(key, timeout_s)
    coordination.get_coordination_key = late_get


def layout_devices(layout, worker_devices=""):
    """This worker's replica devices from `--layout` (replicas per worker, in worker order) and
    `--worker-devices` ("1=/cpu:1,/cpu:1;..." overrides a worker's list); its logical CPUs
    are configured here, before TensorFlow starts. None without a layout."""
    if not layout:
        return None
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    count = [int(c) for c in layout.split(",")][index]
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * count)
    overrides = dict(item.split("=", 1) for item in worker_devices.split(";") if item)
    if str(index) in overrides:
        return [d for d in overrides[str(index)].split(",") if d]
    return [f"/cpu:{i}" for i in range(count)]


class ReplicaWork(keras.layers.Layer):
    """Identity in value. In training, replica `slow` runs `slow_iterations` matmul rounds on
    its batch, the others `fast_iterations`: a slower device, in pure TensorFlow compute (a
    `tf.py_function` sleep does not model one)."""

    def __init__(self, slow, slow_iterations=1000, fast_iterations=3, **kwargs):
        super().__init__(**kwargs)
        self.slow, self.iterations = slow, (fast_iterations, slow_iterations)

    def call(self, x, training=None):
        if not training:
            return x
        ctx = tf.distribute.get_replica_context()
        replica = ctx.replica_id_in_sync_group if ctx is not None else 0
        rounds = tf.where(tf.equal(replica, self.slow), self.iterations[1], self.iterations[0])
        w = tf.fill([512, 512], 0.002)
        _, h = tf.while_loop(lambda i, h: i < rounds,
                             lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w))),
                             [tf.constant(0), tf.tile(x, [1, 64])])
        return x + 0.0 * tf.stop_gradient(tf.reduce_sum(h))


class MaskedBy(keras.layers.Layer):
    """Passes its input on with a Keras mask (feature 1 > 0): a mask that reaches the loss, so
    each replica's loss divides by its unmasked samples."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, x):
        return x

    def compute_mask(self, x, mask=None):
        return x[:, 1] > 0.0


def sample_weights(n):
    return np.random.default_rng(1).uniform(0.2, 3.0, size=(n,)).astype("float32")


def build(sink=None, weighted=False, steps_per_execution=1, model="dense", slow_replica=-1,
          out_of_memory_above=None):
    """The model: "dense" (SGD, L2), "masked" (the same, its loss masked to the samples whose
    feature 1 is positive), "accumulate" (the same, momentum SGD accumulating 3 steps' gradients)
    or "bn-adam" (SyncBatchNormalization, Adam); with
    `slow_replica` >= 0 that replica computes more (`ReplicaWork`); with
    `out_of_memory_above` (replica, samples) that replica runs out of memory on more samples."""
    keras.utils.set_random_seed(1)
    layers = [keras.Input((8,))]
    if slow_replica >= 0:
        layers.append(ReplicaWork(slow_replica))
    if out_of_memory_above is not None:
        layers.append(OutOfMemoryAbove(*out_of_memory_above))
    layers.append(IdRecorder(sink) if sink is not None else keras.layers.Lambda(
        lambda t: t * tf.constant([0.0] + [1.0] * 7)))
    if model == "masked":
        layers.append(MaskedBy())
    if model == "bn-adam":
        # No bias before BatchNormalization: its true gradient is 0, so Adam would amplify
        # rounding noise.
        layers += [keras.layers.Dense(16, use_bias=False),
                   keras.layers.BatchNormalization(synchronized=True),
                   keras.layers.Activation("tanh"), keras.layers.Dense(1)]
        optimizer = keras.optimizers.Adam(0.01)
    else:
        layers += [keras.layers.Dense(16, activation="tanh",
                                      kernel_regularizer=keras.regularizers.L2(1e-2)),
                   keras.layers.Dense(1)]
        optimizer = keras.optimizers.SGD(0.05) if model != "accumulate" else \
            keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=3)
    model = keras.Sequential(layers)
    # weighted: the loss is the sample-weighted mean, so replicas are weighted by their summed
    # sample weight, not their samples.
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight") if weighted \
        else "mse"
    model.compile(optimizer, loss, metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


class Sink:
    """A plain holder (Keras would wrap a list attribute of a layer in a tracked copy)."""

    def __init__(self):
        self.items = []
        self.calls = []  # samples per call: per step, or per micro-batch

    def extend(self, values):
        self.items.extend(values)
        self.calls.append(len(values))


class SwitchAt(keras.callbacks.Callback):
    def __init__(self, strategy, at_step, sizes):
        super().__init__()
        self.strategy, self.at_step, self.sizes, self.step = strategy, at_step, sizes, 0
        self.samples, self.extra, self.rows, self.totals = [], [], [], None

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        # Local: the step's all-reduce brought every replica's measurements to every worker.
        # (Read without a reset, which would start a new measurement window each step.)
        totals = self.strategy.read_replica_times()
        times = totals if self.totals is None else totals - self.totals
        self.totals = totals
        self.samples.append(times.samples.tolist())
        self.rows.append(times.rows().tolist())
        # A collective on every worker: each worker's index (+ 0.5), in replica order.
        index = self.strategy.cluster_resolver.task_id
        self.extra.append(self.strategy.gather_replica_values(
            [index + 0.5] * self.strategy.num_local_replicas).tolist())
        if self.step == self.at_step:
            self.strategy.set_batch_sizes(self.sizes)  # collective, every worker


_COLLECTIVES = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveBcastSendV2",
                "CollectiveBcastRecvV2", "CollectiveAllToAllV2")


def collectives_of(train_function):
    """{"per_step": n, "per_execution": m, "step_keys": [...]} of the traced multi-step train
    function (spe > 1): n cross-worker collectives inside its step loop, m outside it, and
    the instance key of each one in the loop: its value where the graph holds it as a
    constant (fixed at trace time), "call-time" where it is fed at every call. None at spe 1."""
    multi_step = getattr(train_function, "multi_step", None)
    if multi_step is None:
        return None
    traced = multi_step._list_all_concrete_functions()
    if not traced:  # steps run one at a time (micro-batch limits: `guard_train_step`)
        return None
    concrete = traced[-1]
    graph = concrete.graph.as_graph_def()
    library = {f.signature.name: f for f in graph.library.function}
    step_keys = []

    def instance_key(node, nodes):  # CollectiveReduceV2 etc.: inputs (t, size, group, instance)
        source = nodes.get(node.input[3].split(":")[0])
        if source is not None and source.op == "Const":
            return int(source.attr["value"].tensor.int_val[0])
        return "call-time"

    def count(nodes, in_loop=False):  # (outside any loop, inside a loop)
        outside = inside = 0
        by_name = {n.name: n for n in nodes}
        for node in nodes:
            if node.op in _COLLECTIVES:
                outside += 1
                if in_loop:
                    step_keys.append(instance_key(node, by_name))
            for key, attr in node.attr.items():
                names = [attr.func.name] if attr.HasField("func") else [
                    f.name for f in attr.list.func]
                for name in names:
                    if name in library:
                        body = node.op in ("While", "StatelessWhile") and key == "body"
                        o, i = count(library[name].node_def, in_loop or body)
                        if body:
                            inside += o + i
                        else:
                            outside += o
                            inside += i
        return outside, inside

    outside, inside = count(graph.node)
    return {"per_step": inside, "per_execution": outside, "step_keys": step_keys}


# The strategy's own Python entry points into cross-worker communication: all go through the
# topology's `gather`. (Stock `reduce` and the like, which Keras also calls while tracing its
# steps, are seen by the eager count instead.)
_ENTRY_POINTS = ("gather_replica_values", "part_capacities", "check_input_agreement")


def count_window_collectives(dynamic, strategy):
    """Counts the collectives DynamicBatching issues after its `on_train_begin` (the window
    ends; the static split at the start may need one): those TensorFlow executes eagerly
    (`EagerCollectives`) and the calls into the strategy's communicating methods. Returns
    {"eager": EagerCollectives, "entries": [names called]}; wraps this one instance."""
    eager, entries = EagerCollectives(), []
    active = [False]

    def counted(owner, name):
        method = getattr(owner, name)

        def call(*args, **kwargs):
            if active[0]:
                entries.append(name)
            return method(*args, **kwargs)
        setattr(owner, name, call)

    for name in _ENTRY_POINTS:
        counted(strategy, name)
    counted(strategy._topology, "gather")

    def watched(name):
        hook = getattr(dynamic, name)

        def call(*args, **kwargs):
            active[0] = True
            try:
                with eager.counting():
                    return hook(*args, **kwargs)
            finally:
                active[0] = False
        setattr(dynamic, name, call)

    for name in ("on_epoch_begin", "on_train_batch_begin", "on_test_begin", "on_epoch_end",
                 "on_train_end", "get_state"):
        watched(name)
    return {"eager": eager, "entries": entries}


def control_collectives(strategy):
    """The same counters around one `gather_replica_values` (a collective): they see it."""
    eager = EagerCollectives()
    with eager.counting():
        strategy.gather_replica_values(np.zeros(strategy.num_local_replicas))
    return eager.count


def limits(text):
    """"0,9" -> [None, 9]: per-replica micro-batch limits, 0 for no bound."""
    return [int(v) or None for v in text.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--sizes", default="", help="initial split, comma separated")
    parser.add_argument("--switch-step", type=int, default=0)
    parser.add_argument("--switch-sizes", default="")
    parser.add_argument("--validation", type=int, default=0, help="validation samples")
    parser.add_argument("--sample-weight", action="store_true",
                        help="(x, y, sample_weight) data and a sample-weighted mean loss")
    parser.add_argument("--pipeline", default="batches",
                        choices=["batches", "per-sample-map", "keras-arrays", "marked",
                                 "batch-map", "reorder"],
                        help="batches: from_tensor_slices(...).batch(B); per-sample-map: a "
                        "counting map per sample before batch(B); keras-arrays: fit(x, y, "
                        "batch_size=B); marked: a counting batch-level map after "
                        "batch(B).apply(split_here()); batch-map: an unmarked map after "
                        "batch(B) (runs unsplit); reorder: as batch-map, after a parallel "
                        "per-sample map with deterministic=False that reorders")
    parser.add_argument("--steps-per-execution", type=int, default=1)
    parser.add_argument("--micro-batch-limits", default="",
                        help="per replica, comma separated, 0 for no bound")
    parser.add_argument("--refit-batch", type=int, default=0,
                        help="then one more epoch, the data batched by this size")
    parser.add_argument("--log-collectives", action="store_true",
                        help="TensorFlow's INFO log (it names each all-reduce it builds)")
    parser.add_argument("--unseeded", action="store_true",
                        help="no global seed; the data is shuffled with no seed")
    parser.add_argument("--layout", default="", help="replicas (logical CPUs) per worker")
    parser.add_argument("--worker-devices", default="",
                        help="W=dev,dev;... : worker W's device list instead (bad layouts)")
    parser.add_argument("--worker-switch-margin", default="",
                        help="W=m : worker W creates its strategy with switch_margin=m (workers "
                        "that disagree)")
    parser.add_argument("--all-reduce", default=None, choices=["device", "host"])
    parser.add_argument("--measure-noise", action="store_true",
                        help="measure the gradient noise scale (`noise` in the JSON)")
    parser.add_argument("--model", default="dense", choices=["dense", "masked", "accumulate", "bn-adam"])
    parser.add_argument("--slow-replica", type=int, default=-1,
                        help="this replica computes more (ReplicaWork)")
    parser.add_argument("--dynamic", default="", choices=["", "model", "proportional"],
                        help="DynamicBatching(initial='uniform') with this controller")
    parser.add_argument("--count-window-collectives", action="store_true",
                        help="count the collectives DynamicBatching issues after the start")
    parser.add_argument("--stock-worker", type=int, default=-1,
                        help="this worker creates a stock MultiWorkerMirroredStrategy (it never "
                        "publishes its devices); the others wait 2 s for it")
    parser.add_argument("--late-reader", type=int, default=-1,
                        help="this worker reads the others' devices 1.5 s after publishing its "
                        "own (a busy host): the others must not exit before it has read them")
    parser.add_argument("--out-of-memory-above", default="",
                        help="R,S : replica R runs out of memory on more than S samples")
    args = parser.parse_args()
    logging.getLogger("tf_hetbatch").setLevel(logging.INFO)
    if args.log_collectives:
        tf.get_logger().setLevel("INFO")

    devices = layout_devices(args.layout, args.worker_devices)
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    options = None
    if args.stock_worker >= 0:
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=2)
        if index == args.stock_worker:
            tf.distribute.MultiWorkerMirroredStrategy()
            time.sleep(60)
    if index == args.late_reader:
        read_late()
    margins = dict(item.split("=") for item in args.worker_switch_margin.split(";") if item)
    strategy = hb.HeteroMultiWorkerMirroredStrategy(
        devices, communication_options=options, all_reduce=args.all_reduce,
        switch_margin=int(margins.get(str(index), DEFAULT_SWITCH_MARGIN)))
    print(f"mw_train: strategy created, {strategy.layout.describe()}", flush=True)
    if args.sizes:
        strategy.set_batch_sizes([int(s) for s in args.sizes.split(",")])
    if args.micro_batch_limits:
        strategy.set_micro_batch_limits(limits(args.micro_batch_limits))
    if args.measure_noise:
        strategy.measure_gradient_noise()
    sink = Sink()
    with strategy.scope():
        model = build(sink, weighted=args.sample_weight,
                      steps_per_execution=args.steps_per_execution, model=args.model,
                      slow_replica=args.slow_replica,
                      out_of_memory_above=[int(v) for v in args.out_of_memory_above.split(
                          ",")] if args.out_of_memory_above else None)
    callbacks = []
    dynamic = None
    if args.dynamic:
        dynamic = hb.DynamicBatching(initial="uniform", controller=args.dynamic, warmup_steps=8,
                                     interval=6)
        callbacks.append(dynamic)
    window_collectives = None
    if args.count_window_collectives:
        window_collectives = count_window_collectives(dynamic, strategy)
    if args.switch_step:
        switch = SwitchAt(strategy, args.switch_step, [int(s) for s in args.switch_sizes.split(",")])
        callbacks.append(switch)
    x, y = data(args.n)
    columns = (x, y, sample_weights(args.n)) if args.sample_weight else (x, y)
    # Samples the training pipeline's map worked on (this worker's copy of the pipeline).
    mapped = tf.Variable(0, dtype=tf.int64, trainable=False)

    def per_sample(*sample):  # raw x is scaled by 2: the map's work must reach the model
        mapped.assign_add(1)
        return (sample[0] * 0.5, *sample[1:])

    def per_batch(*batch):
        mapped.assign_add(tf.shape(batch[0], out_type=tf.int64)[0])
        return (batch[0] * 0.5, *batch[1:])

    raw = (columns[0] * 2.0, *columns[1:])
    if args.unseeded:
        tf.random.set_seed(None)  # build() seeded everything; the data here is not

    def source(values):
        ds = tf.data.Dataset.from_tensor_slices(values)
        return ds.shuffle(args.n) if args.unseeded else ds

    def jittered(*sample):  # a random delay, so a parallel map's outputs come out of order
        delay = tf.py_function(lambda: time.sleep(np.random.uniform(0, 0.002)) or 0.0, [],
                               tf.float32)
        with tf.control_dependencies([delay]):
            return per_sample(*sample)

    class PerEpoch(keras.callbacks.Callback):  # (mapped, trained) samples of this worker
        def __init__(self):
            super().__init__()
            self.counts = []

        def on_train_begin(self, logs=None):  # after Keras's symbolic build, before tracing
            print("mw_train: training starts", flush=True)

        def on_epoch_end(self, epoch, logs=None):
            self.counts.append([int(mapped.numpy()), len(sink.items)])

    per_epoch = PerEpoch()
    callbacks.append(per_epoch)
    if args.pipeline == "per-sample-map":
        ds = source(raw).map(per_sample).batch(args.batch)
    elif args.pipeline == "marked":
        ds = source(raw).batch(args.batch).apply(hb.split_here()).map(per_batch)
    elif args.pipeline == "batch-map":
        ds = source(raw).batch(args.batch).map(per_batch)
    elif args.pipeline == "reorder":
        ds = source(raw).map(jittered, num_parallel_calls=4, deterministic=False)
        ds = ds.batch(args.batch).map(lambda *batch: batch)
    else:
        ds = source(columns).batch(args.batch)
    validation = None
    if args.validation:
        xv, yv = data(args.validation)
        validation = tf.data.Dataset.from_tensor_slices((xv, yv))
        if args.pipeline == "per-sample-map":  # the same per-sample work, after the split
            validation = tf.data.Dataset.from_tensor_slices((xv * 2.0, yv)).map(
                lambda a, b: (a * 0.5, b))
        validation = validation.batch(args.batch)
    if args.pipeline == "keras-arrays":
        history = model.fit(*columns[:2], sample_weight=columns[2] if args.sample_weight
                            else None, batch_size=args.batch, shuffle=args.unseeded,
                            epochs=args.epochs,
                            verbose=0, callbacks=callbacks, validation_data=validation)
    else:
        history = model.fit(ds, epochs=args.epochs, verbose=0, callbacks=callbacks,
                            validation_data=validation)
    if args.refit_batch:
        model.fit(source(columns).batch(args.refit_batch), epochs=1, verbose=0)
    counted = None
    if window_collectives is not None:
        eager = window_collectives["eager"]
        counted = {"eager": eager.count, "eager_calls": eager.calls,
                   "entries": window_collectives["entries"],
                   "control": control_collectives(strategy)}
    index = strategy.cluster_resolver.task_id
    os.makedirs(args.out, exist_ok=True)
    np.savez(
        os.path.join(args.out, f"worker{index}.npz"),
        *model.get_weights(),
        ids=np.array(sink.items, dtype=np.int64),
    )
    with open(os.path.join(args.out, f"worker{index}.json"), "w") as f:
        json.dump(
            {
                "history": history.history,
                "samples": switch.samples if args.switch_step else [],
                "times": switch.rows if args.switch_step else [],
                "extra": switch.extra if args.switch_step else [],
                "batch_sizes": list(strategy.batch_sizes),
                "noise": [getattr(strategy.gradient_noise_scale, name, None)
                          for name in ("gradient_sq", "trace", "steps")],
                "chief": strategy.is_chief,
                "num_replicas": strategy.num_replicas_in_sync,
                "replica_range": [strategy.layout.offset, strategy.num_local_replicas],
                "all_reduce": strategy.layout.all_reduce,
                "dynamic": dynamic.history if dynamic is not None else None,
                "windows": dynamic.windows if dynamic is not None else None,
                "per_epoch": per_epoch.counts,
                "collectives": collectives_of(model.train_function),
                "calls": sink.calls,
                "micro_batch_limits": strategy.micro_batch_limits,
                "window_collectives": counted,
            },
            f,
        )


if __name__ == "__main__":
    main()
