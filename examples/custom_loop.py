"""TensorFlow's tutorial "Custom training with tf.distribute.Strategy", balanced.

The tutorial's code as it stands (Fashion-MNIST, its CNN, `strategy.run` of a replica step per
global batch, `tf.nn.compute_average_loss`, a `tf.train.Checkpoint`), with two changes marked
"tf_hetbatch": the strategy line, and a `Balancer` told where each step ends. Replicas are
logical CPUs on one host here (`--replicas`); one of them can be made slower per sample
(`--slow`, pure TensorFlow compute on that replica), as a slower device would be, so the
balancer has something to do. Data: Debian's Fashion-MNIST (`dataset-fashion-mnist`), else a
labelled synthetic stand-in.

    python examples/custom_loop.py                  # 3 replicas, replica 2 three times slower
    python examples/custom_loop.py --steps 4 --epochs 1   # a tiny run (the test suite's)
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fashion_mnist  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2, help="logical CPUs (replicas)")
    parser.add_argument("--slow", type=float, default=3.0,
                        help="per-sample work of the last replica, relative to the others")
    parser.add_argument("--batch-per-replica", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0, help="steps per epoch (0: all data)")
    parser.add_argument("--train-samples", type=int, default=12_000)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--summary", default=None, help="write a JSON summary here")
    return parser.parse_args()


class SlowerReplica(tf.keras.layers.Layer):
    """Identity in value; the last replica does `slow` times the per-sample work of the others
    (rounds of a matmul on each sample), as a slower device would."""

    def __init__(self, num_replicas, slow, rounds=300, **kwargs):
        super().__init__(**kwargs)
        work = [1] * num_replicas
        work[-1] = max(1, int(round(slow)))
        self.work = tf.constant([w * rounds for w in work])
        self.mix = tf.constant(np.random.default_rng(0).normal(size=(196, 196)).astype(
            "float32") / 196)

    def call(self, x, training=None):
        ctx = tf.distribute.get_replica_context()
        if not training or ctx is None:
            return x
        trips = tf.gather(self.work, ctx.replica_id_in_sync_group)
        flat = tf.reshape(tf.nn.avg_pool2d(x, 2, 2, "VALID"), [-1, 196])
        _, h = tf.while_loop(lambda i, h: i < trips,
                             lambda i, h: (i + 1, tf.tanh(tf.matmul(h, self.mix))),
                             (tf.constant(0), flat))
        return x + tf.stop_gradient(tf.minimum(tf.abs(tf.reduce_sum(h)), 0.0))


def main():
    args = parse_args()
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    # One thread per op: each replica's ops run on one core at a time, as a device of its own
    # would (with a shared pool, one replica's matmul takes every core and the other waits).
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import tf_hetbatch as hb  # after the devices are configured

    train_images, train_labels, source = fashion_mnist.load_uint8("train", args.train_samples)
    test_images, test_labels, _ = fashion_mnist.load_uint8("test", 2_000)
    print(f"Fashion-MNIST: {source}")
    # As the tutorial: a channel axis, values in [0, 1].
    train_images = train_images[..., None] / np.float32(255)
    test_images = test_images[..., None] / np.float32(255)

    # tf_hetbatch: was strategy = tf.distribute.MirroredStrategy()
    strategy = hb.HeteroMirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])
    print(f"Number of devices: {strategy.num_replicas_in_sync}")

    BUFFER_SIZE = len(train_images)
    BATCH_SIZE_PER_REPLICA = args.batch_per_replica
    GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    EPOCHS = args.epochs

    train_dataset = tf.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(
        BUFFER_SIZE, seed=0).batch(GLOBAL_BATCH_SIZE)
    test_dataset = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).batch(
        GLOBAL_BATCH_SIZE)
    train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    def create_model():
        regularizer = tf.keras.regularizers.L2(1e-5)
        return tf.keras.Sequential([
            tf.keras.layers.Input((28, 28, 1)),
            SlowerReplica(args.replicas, args.slow),
            tf.keras.layers.Conv2D(32, 3, activation="relu", kernel_regularizer=regularizer),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Conv2D(64, 3, activation="relu", kernel_regularizer=regularizer),
            tf.keras.layers.MaxPooling2D(),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(64, activation="relu", kernel_regularizer=regularizer),
            tf.keras.layers.Dense(10),
        ])

    with strategy.scope():
        # Set reduction to `NONE` so you can do the reduction yourself.
        loss_object = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf.keras.losses.Reduction.NONE)

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = tf.nn.compute_average_loss(per_example_loss)
            if model_losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model_losses))
            return loss

        test_loss = tf.keras.metrics.Mean(name="test_loss")
        train_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")
        test_accuracy = tf.keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")
        model = create_model()
        optimizer = tf.keras.optimizers.Adam(learning_rate=0.001)
        checkpoint = tf.train.Checkpoint(optimizer=optimizer, model=model)

    # tf_hetbatch: a balancer, saved with the run's checkpoint.
    balancer = hb.Balancer(strategy, warmup_steps=3, interval=5)
    checkpoint.balancer = balancer

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            predictions = model(images, training=True)
            loss = compute_loss(labels, predictions, model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs):
        images, labels = inputs
        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    @tf.function
    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

    @tf.function
    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(dataset_inputs,))

    epoch_seconds = []
    for epoch in range(EPOCHS):
        total_loss, num_batches, start = 0.0, 0, time.perf_counter()
        for x in train_dist_dataset:
            total_loss += distributed_train_step(x)
            num_batches += 1
            balancer.step_end()  # tf_hetbatch: where a step ends
            if args.steps and num_batches >= args.steps:
                break
        epoch_seconds.append(time.perf_counter() - start)
        train_loss = total_loss / num_batches
        for x in test_dist_dataset:
            distributed_test_step(x)
        balancer.epoch_begin()  # tf_hetbatch: the evaluation was no replica's training work
        if args.checkpoint_dir:
            checkpoint.save(os.path.join(args.checkpoint_dir, "ckpt"))
        print(f"Epoch {epoch + 1}, Loss: {float(train_loss):.4f}, "
              f"Accuracy: {train_accuracy.result() * 100:.2f}, "
              f"Test Loss: {test_loss.result():.4f}, "
              f"Test Accuracy: {test_accuracy.result() * 100:.2f}, "
              f"{epoch_seconds[-1]:.1f} s, split {list(balancer.batch_sizes or [])}")
        test_loss.reset_state()
        train_accuracy.reset_state()
        test_accuracy.reset_state()
    balancer.end()
    for window in balancer.windows[-3:]:
        print(f"  window at step {window['step']}: samples {window['samples_per_step']}, "
              f"compute ms {[round(t * 1000, 1) for t in window['time_per_step']]}, "
              f"step ms {window['step_time'] * 1000:.1f}")
    for entry in balancer.history:
        print(f"  step {entry['step']}: {entry['old']} -> {entry['new']} ({entry['reason']})")
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump({"epoch_seconds": epoch_seconds, "history": balancer.history,
                       "batch_sizes": list(balancer.batch_sizes or []),
                       "settled_batch_sizes": list(balancer.settled_batch_sizes or [])}, f)


if __name__ == "__main__":
    main()
