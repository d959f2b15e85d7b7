"""Chief of an asynchronous test cluster checking the update arithmetic exactly.

--mode scaling (any number of workers): a linear "model" w with loss -w.x, whose gradient
does not depend on w, so the final weights do not depend on the order or staleness of the
updates: with linear gradient scaling, w_final = w_0 + lr / mean(b) * (sum of all samples
trained). Worker k reads the constant example c_k = (k + 1, 1, -0.5 k). Writes the weights,
the per-worker samples and updates, and the two predictions (with and without scaling).

--mode reference (one worker): a small real model trained asynchronously on one worker must
equal plain SGD on one device over the same consecutive batches. Writes the largest weight
difference.
"""

import argparse
import json
import sys

import worker_start  # noqa: F401  (first: before TensorFlow)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_hetbatch as hb  # noqa: E402


def scaling(args, strategy):
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)),
                                  keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    trainer = hb.AsyncTrainer(model, keras.optimizers.SGD(args.lr),
                              lambda y, pred: -tf.squeeze(pred, -1))
    num = strategy.num_workers

    def dataset_fn(context):
        k = float(context.input_pipeline_id)
        c = tf.constant([k + 1.0, 1.0, -0.5 * k])
        return tf.data.Dataset.from_tensors((c, tf.constant(0.0))).repeat()

    sizes = [int(v) for v in args.sizes.split(",")]
    strategy.set_global_batch_size(sum(sizes))
    strategy.set_batch_sizes(sizes)
    mean_batch = sum(sizes) // num
    trainer.fit(dataset_fn, batch_size=mean_batch, epochs=1, steps_per_epoch=args.steps,
                verbose=0)
    times = strategy.read_replica_times()
    consts = np.array([[k + 1.0, 1.0, -0.5 * k] for k in range(num)])
    w = model.get_weights()[0][:, 0]
    return {
        "weights": w.tolist(),
        "samples": times.samples.tolist(),
        "updates": times.steps.tolist(),
        "expected_scaled": (args.lr / mean_batch * times.samples @ consts).tolist(),
        "expected_unscaled": (args.lr * times.steps @ consts).tolist(),
        "update_count": strategy.updates,
    }


def reference(args, strategy):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=256).astype(np.int32)

    def make_model():
        keras.utils.set_random_seed(1)
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                                 keras.layers.Dense(3)])

    with strategy.scope():
        model = make_model()
    local = make_model()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainer = hb.AsyncTrainer(model, keras.optimizers.SGD(args.lr), loss)
    trainer.fit(lambda context: tf.data.Dataset.from_tensor_slices((x, y)),
                batch_size=args.batch_size, epochs=1, steps_per_epoch=args.steps, verbose=0)
    optimizer = keras.optimizers.SGD(args.lr)
    batches = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(args.batch_size)
    for xb, yb in batches.take(args.steps):
        with tf.GradientTape() as tape:
            value = loss(yb, local(xb, training=True))
        optimizer.apply(tape.gradient(value, local.trainable_variables),
                        local.trainable_variables)
    diff = max(float(np.max(np.abs(a - b)))
               for a, b in zip(model.get_weights(), local.get_weights()))
    moved = max(float(np.max(np.abs(a - b)))
                for a, b in zip(local.get_weights(), make_model().get_weights()))
    return {"max_abs_diff": diff, "moved": moved, "update_count": strategy.updates}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mode", choices=["scaling", "reference"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sizes", default="24,8")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args(argv)
    strategy = hb.HeteroParameterServerStrategy()
    result = (scaling if args.mode == "scaling" else reference)(args, strategy)
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
