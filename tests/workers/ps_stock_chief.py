"""Chief of a ParameterServerStrategy cluster for the launcher test, with STOCK TensorFlow only.

Run by ``tf_hetbatch.launch`` with ``num_ps >= 1``: TF_CONFIG names this task the "chief",
and the ps and worker tasks run ``python -m tf_hetbatch.launch.server``. Builds a one-layer Keras 3
model under ``ParameterServerStrategy.scope()``, schedules ``--steps`` training steps on the
workers through a ``ClusterCoordinator`` (each step runs ``strategy.run``, which Keras 3
optimizers need), joins, and prints ``final loss <value>``.
"""

import argparse

import worker_start  # noqa: F401  (first: before TensorFlow)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def dataset_fn(_input_context=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256, seed=0).repeat().batch(16)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(learning_rate=0.05)
        optimizer.build(model.trainable_variables)  # Variables on the ps, before scheduling.

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(iterator):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss

        x, y = next(iterator)
        return strategy.run(replica_fn, args=(x, y))

    first = coordinator.schedule(step, args=(iterator,))
    for _ in range(args.steps - 2):
        coordinator.schedule(step, args=(iterator,))
    last = coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    print(f"first loss {float(first.fetch()):.6f}", flush=True)
    print(f"final loss {float(last.fetch()):.6f}", flush=True)


if __name__ == "__main__":
    main()
