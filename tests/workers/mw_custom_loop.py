"""A multi-worker script: TensorFlow's multi-worker custom-loop tutorial under
HeteroMultiWorkerMirroredStrategy, on workers that host different numbers of replicas.

`--layout 2,1`: worker i hosts that many logical CPUs as its replicas (configured before
TensorFlow starts). As the tutorial: `distribute_datasets_from_function` (each worker its shard
of the rows, batched per replica by `get_per_replica_batch_size`), a `tf.function` step that
runs `strategy.run` of a replica step on `next(iterator)`, the loss scaled by the global batch
(`tf.nn.compute_average_loss`), `optimizer.apply_gradients`, a metric. Writes
<out>/worker<i>.npz (weights) and worker<i>.json (losses, accuracy, layout).
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

import tf_hetbatch as hb  # noqa: E402

GLOBAL_BATCH, STEPS, N = 30, 5, 240


def data(n=N):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    return x, y


def build():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(3)])


def layout_devices(layout):
    """This worker's replica devices from `--layout`; its logical CPUs configured here."""
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    count = [int(c) for c in layout.split(",")][index]
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * count)
    return [f"/cpu:{i}" for i in range(count)]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layout", required=True, help="replicas (logical CPUs) per worker")
    args = parser.parse_args()
    strategy = hb.HeteroMultiWorkerMirroredStrategy(layout_devices(args.layout))
    index = strategy.cluster_resolver.task_id
    x, y = data()

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(GLOBAL_BATCH)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
        dataset = dataset.shard(input_context.num_input_pipelines,
                                input_context.input_pipeline_id)
        return dataset.batch(batch_size)

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    with strategy.scope():
        model = build()
        optimizer = keras.optimizers.SGD(0.1)
        train_accuracy = keras.metrics.SparseCategoricalAccuracy()
    loss_object = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=keras.losses.Reduction.NONE
        if hasattr(keras.losses, "Reduction") else None)

    @tf.function
    def train_step(iterator):
        def step_fn(inputs):
            features, labels = inputs
            with tf.GradientTape() as tape:
                predictions = model(features, training=True)
                loss = tf.nn.compute_average_loss(loss_object(labels, predictions),
                                                  global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            train_accuracy.update_state(labels, predictions)
            return loss

        losses = strategy.run(step_fn, args=(next(iterator),))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    iterator = iter(dataset)
    losses = [float(train_step(iterator)) for _ in range(STEPS)]
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"worker{index}.npz"), *model.get_weights())
    with open(os.path.join(args.out, f"worker{index}.json"), "w") as f:
        json.dump({"losses": losses, "accuracy": float(train_accuracy.result()),
                   "num_replicas": strategy.num_replicas_in_sync,
                   "local_replicas": strategy.num_local_replicas}, f)


if __name__ == "__main__":
    main()
