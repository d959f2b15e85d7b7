"""A multi-worker training script for the tests: run by tf_hetbatch.launch with TF_CONFIG set.

Trains a small dense model with HeteroMultiWorkerMirroredStrategy on deterministic data that
carries a sample id, records the ids each worker's replicas trained on, optionally changes the
split mid-run from a callback, and saves weights and ids to <out>/worker<i>.npz.
"""

import argparse
import json
import logging
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_hetbatch as hb  # noqa: E402


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


def sample_weights(n):
    return np.random.default_rng(1).uniform(0.2, 3.0, size=(n,)).astype("float32")


def build(sink=None, weighted=False, steps_per_execution=1):
    keras.utils.set_random_seed(1)
    layers = [keras.Input((8,))]
    layers.append(IdRecorder(sink) if sink is not None else keras.layers.Lambda(
        lambda t: t * tf.constant([0.0] + [1.0] * 7)))
    layers += [
        keras.layers.Dense(16, activation="tanh", kernel_regularizer=keras.regularizers.L2(1e-2)),
        keras.layers.Dense(1),
    ]
    model = keras.Sequential(layers)
    # weighted: the loss is the sample-weighted mean, so replicas are weighted by their summed
    # sample weight, not their samples.
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight") if weighted \
        else "mse"
    model.compile(keras.optimizers.SGD(0.05), loss, metrics=["mae"],
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
        self.samples, self.extra = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        # A collective on every worker; each worker's index (+ 0.5) rides along, as a
        # worker's step time does for DynamicBatching.
        index = self.strategy.cluster_resolver.task_id
        times, extra = self.strategy.read_replica_times_and_gather([index + 0.5], reset=True)
        self.samples.append(times.samples.tolist())
        self.extra.append(extra.tolist())
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
    args = parser.parse_args()
    logging.getLogger("tf_hetbatch").setLevel(logging.INFO)
    if args.log_collectives:
        tf.get_logger().setLevel("INFO")

    strategy = hb.HeteroMultiWorkerMirroredStrategy()
    if args.sizes:
        strategy.set_batch_sizes([int(s) for s in args.sizes.split(",")])
    if args.micro_batch_limits:
        strategy.set_micro_batch_limits(limits(args.micro_batch_limits))
    sink = Sink()
    with strategy.scope():
        model = build(sink, weighted=args.sample_weight,
                      steps_per_execution=args.steps_per_execution)
    callbacks = []
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
                "extra": switch.extra if args.switch_step else [],
                "batch_sizes": list(strategy.batch_sizes),
                "chief": strategy.is_chief,
                "per_epoch": per_epoch.counts,
                "collectives": collectives_of(model.train_function),
                "calls": sink.calls,
            },
            f,
        )


if __name__ == "__main__":
    main()
