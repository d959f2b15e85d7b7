"""A multi-worker script for the custom-step tests: run by tf_hetbatch.launch with TF_CONFIG.

Trains each of `--variants`, one after the other on the same strategy (one cluster for all):
one of `custom_models.VARIANTS` (a train_step written as Keras's guide teaches) with `fit`, or
a custom training loop (`loop`: TensorFlow's multi-worker custom-loop guide, `strategy.run` of
a replica step per global batch) under HeteroMultiWorkerMirroredStrategy, with a split
switched mid-run, then evaluates; writes <out>/<variant>/worker<i>.npz (weights) and
worker<i>.json (history, evaluation, the variant's own times). The first variant starts at
`--sizes` and switches to `--switch-sizes` at its step `--switch-step`; each later one starts
from the split the one before left and switches to the other of the two (once the cluster has
trained, a split lands `switch_margin` steps after it is set, so a variant cannot start at a
split of its own). `loop_balanced` is balanced by a Balancer instead.
"""

import argparse
import json
import os
import sys

import worker_start  # noqa: F401  (first: before TensorFlow)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import custom_models  # noqa: E402
import tf_hetbatch as hb  # noqa: E402

BATCH, EPOCHS = 32, 2


class SwitchAt(keras.callbacks.Callback):
    def __init__(self, strategy, at_step, sizes):
        super().__init__()
        self.strategy, self.at_step, self.sizes, self.step = strategy, at_step, sizes, 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step == self.at_step:
            self.strategy.set_batch_sizes(self.sizes)  # collective, every worker


def train_loop(strategy, n, switch_step, switch_sizes, balancer=None):
    """TensorFlow's custom-loop guide, with the loss scaled by the global batch; with a
    `balancer` (the guide plus one line), it balances instead of switching by hand."""
    with strategy.scope():
        model = custom_models.build("compute_loss")
        loss_object = keras.losses.MeanSquaredError(reduction="none")
        train_mae = keras.metrics.MeanAbsoluteError()
    optimizer = model.optimizer
    x, y = custom_models.data(n)
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(features, training=True)
            loss = tf.nn.compute_average_loss(loss_object(labels, predictions),
                                              global_batch_size=BATCH)
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_mae.update_state(labels, predictions)
        return loss

    @tf.function
    def distributed_train_step(inputs):
        losses = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    history = {"loss": [], "mae": []}
    step = 0
    for _ in range(EPOCHS):
        total, batches = 0.0, 0
        train_mae.reset_state()
        for batch in dist:
            total += float(distributed_train_step(batch))
            batches += 1
            step += 1
            if step == 1:  # the first call may trace twice (it creates the optimizer's slots)
                first_traces = distributed_train_step.experimental_get_tracing_count()
            if balancer is not None:
                balancer.step_end()
            elif step == switch_step:
                strategy.set_batch_sizes(switch_sizes)
        history["loss"].append(total / batches)
        history["mae"].append(float(train_mae.result()))
    # Traces of the step after its first call: none for all the splits it met
    # (`iterators.typed_by_element_spec`).
    history["later_traces"] = (distributed_train_step.experimental_get_tracing_count()
                               - first_traces)
    return model, history


def train_variant(strategy, variant, args, switch_sizes):
    """(model, history, evaluation, balancer) of one variant, from the current split."""
    evaluation, balancer = {}, None
    if variant.startswith("loop"):
        if variant == "loop_balanced":
            balancer = hb.Balancer(strategy, initial="uniform", warmup_steps=2, interval=3)
        model, history = train_loop(strategy, args.n, args.switch_step, switch_sizes, balancer)
        return model, history, evaluation, balancer
    with strategy.scope():
        model = custom_models.build(variant)
    columns = custom_models.data(args.n, sample_weight=variant == "sample_weight")
    history = model.fit(tf.data.Dataset.from_tensor_slices(columns).batch(BATCH),
                        epochs=EPOCHS, verbose=0,
                        callbacks=[SwitchAt(strategy, args.switch_step, switch_sizes)]).history
    if variant == "compute_loss":  # its custom test_step
        xe, ye = custom_models.data(100, seed=5)
        evaluation = model.evaluate(xe, ye, batch_size=50, verbose=0, return_dict=True)
    return model, history, evaluation, balancer


def main():
    variants = [*custom_models.VARIANTS, "loop", "loop_balanced"]
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", required=True,
                        help=f"comma separated, in the order to run, of {variants}")
    parser.add_argument("--n", type=int, default=160, help="training samples")
    parser.add_argument("--sizes", required=True, help="initial split, comma separated")
    parser.add_argument("--switch-step", type=int, default=2)
    parser.add_argument("--switch-sizes", required=True)
    args = parser.parse_args()
    chosen = args.variants.split(",")
    unknown = sorted(set(chosen) - set(variants))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {variants}")
    sizes = [int(s) for s in args.sizes.split(",")]
    switch_sizes = [int(s) for s in args.switch_sizes.split(",")]

    strategy = hb.HeteroMultiWorkerMirroredStrategy()
    index = strategy.cluster_resolver.task_id
    strategy.set_batch_sizes(sizes)  # before the first step: the first variant starts there
    for variant in chosen:
        strategy.read_replica_times(reset=True)  # the times below: this variant's alone
        model, history, evaluation, balancer = train_variant(strategy, variant, args,
                                                             switch_sizes)
        sizes, switch_sizes = switch_sizes, sizes  # the next one switches back
        times = strategy.read_replica_times(reset=True)
        out = os.path.join(args.out, variant)
        os.makedirs(out, exist_ok=True)
        np.savez(os.path.join(out, f"worker{index}.npz"), *model.get_weights())
        with open(os.path.join(out, f"worker{index}.json"), "w") as f:
            json.dump({"history": history, "evaluation": evaluation,
                       "balancer": None if balancer is None else balancer.get_state(),
                       "samples": times.samples.tolist(),
                       "seconds": times.compute_seconds.tolist()}, f)


if __name__ == "__main__":
    main()
