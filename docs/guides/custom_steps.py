"""
# Custom training steps and loops

Keep your own `train_step`, or your own training loop around `strategy.run`, and still make
every update exactly the one a single device makes on the whole global batch. At the end you
will have a custom `train_step`, a GAN-style step with two optimizers, and a custom training
loop kept balanced by `hb.Balancer`, each checked against one device.

## Setup

The replicas here are three logical CPUs made from this machine's CPU, so the guide runs
anywhere. On a real machine you would list your devices instead, e.g.
`hb.HeteroMirroredStrategy(["/gpu:0", "/gpu:1", "/cpu:0"])`; nothing in this guide has run on
a GPU. The logical CPUs must be made before anything else touches TensorFlow.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # no C++ INFO or WARNING lines

import logging

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)

import keras  # noqa: E402
import tf_hetbatch as hb  # noqa: E402

# tf_hetbatch speaks through `logging`: show its INFO lines and warnings, once each.
log = logging.getLogger("tf_hetbatch")
log.addHandler(logging.StreamHandler())
log.handlers[-1].setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
log.setLevel(logging.INFO)
log.propagate = False

DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2"]
SPLIT = [4, 12, 16]  # an uneven split of a global batch of 32


def regression_data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def max_weight_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


"""
Every check below trains the same model twice from the same seed, on the same global batches:
once on one device with no strategy (the reference), once under `hb.HeteroMirroredStrategy`
with an uneven split (`[4, 12, 16]` of 32 for the models, `[16, 32, 48]` of 96 for the loop).

## A custom `train_step`, as Keras's guide writes it

This is the first example of Keras's guide
[Customizing what happens in `fit()`](https://keras.io/guides/custom_train_step_in_tensorflow/),
with its custom `test_step`: the loss from `self.compute_loss`, gradients from a tape,
`self.optimizer.apply`, and the metrics updated by hand and returned with `result()`.
Nothing in it knows about tf_hetbatch.
"""


class Regressor(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return self.update_metrics(loss, y, y_pred)

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        return self.update_metrics(loss, y, y_pred)

    def update_metrics(self, loss, y, y_pred):
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def make_regressor():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="tanh",
                                kernel_regularizer=keras.regularizers.L2(1e-2))(inputs)
    model = Regressor(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model


"""
Train it on one device, then under the strategy with the uneven split, and compare the
weights, the History and `evaluate` (with a batch of 50, which the strategy splits in
proportion to the training split).
"""

x, y = regression_data(160)
x_test, y_test = regression_data(100, seed=5)

reference = make_regressor()
ref_history = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history

strategy = hb.HeteroMirroredStrategy(DEVICES)
strategy.set_batch_sizes(SPLIT)
with strategy.scope():
    model = make_regressor()
history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history

print("custom train_step, weights vs one device:", max_weight_diff(reference, model))
for key in ref_history:
    np.testing.assert_allclose(history[key], ref_history[key], rtol=1e-5)
print("History (loss, mae) as one device's:", [round(v, 5) for v in history["loss"]],
      [round(v, 5) for v in history["mae"]])
ref_eval = reference.evaluate(x_test, y_test, batch_size=50, verbose=0, return_dict=True)
our_eval = model.evaluate(x_test, y_test, batch_size=50, verbose=0, return_dict=True)
print("evaluate:", {k: round(v, 5) for k, v in our_eval.items()},
      "one device:", {k: round(v, 5) for k, v in ref_eval.items()})
assert max_weight_diff(reference, model) <= 1e-5

"""
What makes this work: the strategy weights each replica's loss where Keras scales it for
distribution, by that replica's share of the global batch, so the summed gradients are one
device's. What a custom step may use and still train exactly, with the logs one device
writes:

- the loss from `self.compute_loss(...)`, or from a `keras.losses.Loss` the model holds
  (`self.loss_fn = keras.losses.MeanSquaredError()` in `__init__` or `compile`);
- gradients from a `tf.GradientTape`, applied with `optimizer.apply` or
  `optimizer.apply_gradients`, with or without `optimizer.scale_loss`;
- one optimizer, or several that the model holds (a `compile()` override that keeps a GAN's
  two, below);
- metrics updated by hand and returned with `result()`: each becomes its global value,
  whatever key you return it under;
- a custom `test_step`.

The loss value your step reads is the one whose mean over the replicas is the global loss: at
the even split, each replica's own mean (the stock `MirroredStrategy` gives that value divided
by the replica count). So a `keras.metrics.Mean` fed with it, as above, reports the loss one
device reports.

A custom step keeps its own order: each `apply` sums its gradients across the replicas at
once (so a GAN's second update reads the first one's result, as on one device), and the logs'
sums take a second all-reduce. Keras's own `train_step` packs the gradients and the metrics
into one all-reduce.

## Two optimizers, and the batch dimension

Keras's [GAN example](https://keras.io/examples/generative/dcgan_overriding_train_step/)
keeps two optimizers and a loss in a `compile()` override, updates the discriminator, then
the generator (whose update reads the discriminator just updated), and makes its labels with
the batch size. The tiny GAN below does the same on 2-D points. It takes its latent vectors
from the data instead of drawing them in the step, so that one device and the strategy see
the same numbers.

One thing to write differently from the stock strategy: a replica's batch size is not known
when the step is traced, because one trace serves every split. `real.shape[0]` is `None`
(where the stock strategy may have a number), so take the size from the tensor at run time with
`tf.shape(real)[0]`, as the Keras example does for its labels:
`tf.zeros((tf.shape(real_images)[0], 1))`.
"""

TRACED_BATCH_DIMS = []  # what `real.shape[0]` was when the step was traced


class TinyGAN(keras.Model):
    def __init__(self):
        super().__init__()
        self.generator = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
        self.discriminator = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, data):
        latent, real = data
        TRACED_BATCH_DIMS.append(real.shape[0])
        batch_size = tf.shape(real)[0]  # not real.shape[0]: None when traced
        # The discriminator: fakes labelled 1, real points 0.
        points = tf.concat([self.generator(latent), real], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(points))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        # The generator, against the discriminator just updated.
        misleading = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(misleading, self.discriminator(self.generator(latent)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def make_gan():
    keras.utils.set_random_seed(1)
    gan = TinyGAN()
    gan.compile(keras.optimizers.Adam(1e-2), keras.optimizers.Adam(1e-2),
                keras.losses.BinaryCrossentropy(from_logits=True))
    gan.build((None, 4))  # its networks are built; this marks the model built for fit
    # Build the optimizers up front: an optimizer first built inside a distributed step
    # fails under the stock strategy too (keras-team/keras#19246).
    gan.d_optimizer.build(gan.discriminator.trainable_weights)
    gan.g_optimizer.build(gan.generator.trainable_weights)
    return gan


def gan_data(n=160):
    rng = np.random.default_rng(2)
    latent = rng.normal(size=(n, 4)).astype("float32")
    real = (rng.normal(size=(n, 2)) * [0.5, 0.2] + [2.0, -1.0]).astype("float32")
    return tf.data.Dataset.from_tensor_slices((latent, real)).batch(32)


reference_gan = make_gan()
ref_gan_history = reference_gan.fit(gan_data(), epochs=2, shuffle=False, verbose=0).history

strategy = hb.HeteroMirroredStrategy(DEVICES)
strategy.set_batch_sizes(SPLIT)
with strategy.scope():
    gan = make_gan()
TRACED_BATCH_DIMS.clear()
gan_history = gan.fit(gan_data(), epochs=2, shuffle=False, verbose=0).history

print("traced per-replica batch dimension:", set(TRACED_BATCH_DIMS))
print("GAN, weights vs one device:", max_weight_diff(reference_gan, gan))
for key in ref_gan_history:
    np.testing.assert_allclose(gan_history[key], ref_gan_history[key], rtol=1e-5)
assert max_weight_diff(reference_gan, gan) <= 1e-5

"""
## What is refused, and what is not seen

A Keras loss the model does not hold (a module-level `loss_fn`, say) is divided by the replica
count, as Keras does under any strategy, and the strategy cannot see it to weight it. Such a
step is refused when it is traced, before any step runs, and the error names the fix: hold
the loss on the model.
"""

outside_loss = keras.losses.MeanSquaredError()  # not an attribute of the model


class HiddenLoss(keras.Sequential):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = outside_loss(y, self(x, training=True))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        return {"loss": loss}


strategy = hb.HeteroMirroredStrategy(DEVICES[:2])
with strategy.scope():
    hidden = HiddenLoss([keras.Input((8,)), keras.layers.Dense(1)])
    hidden.compile("sgd")
try:
    hidden.fit(x, y, batch_size=32, epochs=1, verbose=0)
except ValueError as error:
    message = str(error)
    print("refused:", message[:message.index(":")])
    print("  ", message[message.index("Fix:"):][:170], "...")

"""
Not seen, as under the stock strategy: a loss you average by hand (`tf.reduce_mean` over the
replica's own samples) is no Keras loss, so nothing weights it, and its gradients are summed
across the replicas as they are. Divide the summed per-sample losses by the global batch
instead (`tf.nn.compute_average_loss(per_example_loss, global_batch_size=B)`), or use a Keras
loss the model holds.

## A custom training loop

TensorFlow's tutorial
[Custom training with tf.distribute.Strategy](https://www.tensorflow.org/tutorials/distribute/custom_training)
runs `strategy.run` once per global batch. Here each replica's per-example losses are summed
and divided by the global batch size B with
`tf.nn.compute_average_loss(per_example_loss, global_batch_size=B)`, as the tutorial long
wrote it (its current text leaves `global_batch_size` out: see below). Under tf_hetbatch the
loop is exact as it is; only the strategy line changes. Batch the data by the global batch
and distribute it with `experimental_distribute_dataset`.
"""

GLOBAL_BATCH = 96
EPOCH_STEPS = 30
x_loop, y_loop = regression_data(GLOBAL_BATCH * EPOCH_STEPS, seed=3)
train_dataset = tf.data.Dataset.from_tensor_slices((x_loop, y_loop)).batch(GLOBAL_BATCH)


def make_dense():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(1)])


strategy = hb.HeteroMirroredStrategy(DEVICES)  # was tf.distribute.MirroredStrategy()
strategy.set_batch_sizes([16, 32, 48])
with strategy.scope():
    loop_model = make_dense()
    optimizer = keras.optimizers.SGD(0.05)
loss_object = keras.losses.MeanSquaredError(reduction="none")


def train_step(inputs):
    features, labels = inputs
    with tf.GradientTape() as tape:
        per_example_loss = loss_object(labels, loop_model(features, training=True))
        loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
    gradients = tape.gradient(loss, loop_model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, loop_model.trainable_variables))
    return loss


@tf.function
def distributed_train_step(inputs):
    per_replica_losses = strategy.run(train_step, args=(inputs,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)


train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
losses = [float(distributed_train_step(batch)) for batch in train_dist_dataset]

"""
The reference is one device fitting the same model with the same optimizer on the same global
batches. The losses the loop summed over the replicas are the global losses, as under the
stock strategy, so their mean over the epoch is the loss Keras reports for it.
"""

loop_reference = make_dense()
loop_reference.compile(keras.optimizers.SGD(0.05), "mse")
ref_loop_history = loop_reference.fit(train_dataset, epochs=1, shuffle=False, verbose=0).history
print("custom loop, weights vs one device:", max_weight_diff(loop_reference, loop_model))
print("mean of the loop's losses:", round(np.mean(losses), 6),
      "one device's loss:", round(ref_loop_history["loss"][0], 6))
times = strategy.read_replica_times()
print("steps per replica:", times.steps.tolist(), "samples per replica:", times.samples.tolist())
assert max_weight_diff(loop_reference, loop_model) <= 1e-5

"""
`strategy.read_replica_times()` measures a loop's replicas as it does `fit`'s: each step that
applies gradients counts as one trained step (one per global batch), with each replica's
samples and compute time.

Other ways of writing the loss in a loop:

- A Keras loss the step function reaches (through its closure, or a global its code names),
  e.g. `loss_object = keras.losses.MeanSquaredError()` with its default reduction, is weighted
  like a model's own: exact, and its values summed over the replicas are the global loss.
- `tf.nn.compute_average_loss(per_example_loss)` without `global_batch_size` (how the
  tutorial's current text writes it) divides each replica's loss by its own batch times the
  replica count, which is wrong under an uneven split. The strategy sees it when the step is
  traced and weights that step's gradients in the optimizer instead: the update stays exact,
  a `tf.nn.scale_regularization_loss` added to it included. A warning says once that the value
  the step returns is then the mean of the replicas' means, not the global mean. It is
  refused, naming the fix, where the gradients cannot be weighted that way: after
  SyncBatchNormalization (its backward all-reduce has already mixed the replicas), or with an
  optimizer the step function does not reach. Pass `global_batch_size=B` for exact logged
  losses too.
- `strategy.reduce("MEAN", value, axis=None)` of per-replica values the strategy did not weight
  (a `tf.reduce_mean` over each replica's own samples, a loss or an accuracy) gives every
  replica the same weight, whatever its samples. Under an uneven split that is not the global
  mean; a warning says so once, naming the fix: return per-example values and reduce them
  with `axis=0`, or sums reduced with `SUM`.
- `strategy.distribute_datasets_from_function(dataset_fn)` lets your function batch each
  replica's data itself, so the split (`set_batch_sizes`, `DynamicBatching`, `Balancer`)
  cannot reach it; one warning says so. Training on it stays exact (the weights follow each
  step's actual batches), but to balance, batch by the global batch and use
  `experimental_distribute_dataset`.

## Balancing a custom loop with `hb.Balancer`

`hb.Balancer(strategy, ...)` is the balancing loop of [`DynamicBatching`](mixed_devices.md)
for any training loop, with the same options (`initial`, `controller`, `min_sizes`,
`max_sizes`, `warmup_steps`, `interval`, `probe_steps`, `log_dir`, `verbose`):
`DynamicBatching` is its Keras adapter, and `AsyncTrainer` drives one itself. It sets the
static split when training begins; then, after `warmup_steps`, every `interval` steps it
reads the per-replica times the strategy measured and applies its controller's new split
with `strategy.set_batch_sizes`. The global batch never changes, so neither does the maths.

A loop tells it where it is:

- `step_end()` after each step (or `step_end(steps=n)` after a block of n steps); the first
  call begins, or call `begin()` yourself;
- `epoch_begin()` after a pause that is no replica's work (an evaluation, a checkpoint), so the
  next step is timed from its inputs;
- `end()` at the end (it closes the dashboards, if `log_dir` is set).

The balancer is a `tf.train.experimental.PythonState`: give it to the run's
`tf.train.Checkpoint` and its state (split, controller, history) is saved and restored with
the model. The checkout's `examples/custom_loop.py` is TensorFlow's custom-loop tutorial with
these lines added:

```python
strategy = hb.HeteroMirroredStrategy()               # was tf.distribute.MirroredStrategy()
balancer = hb.Balancer(strategy)
checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, balancer=balancer)
for x in train_dist_dataset:                          # global batches, as the tutorial
    total_loss += distributed_train_step(x)           # strategy.run(train_step, ...)
    balancer.step_end()                               # after each step (or block: steps=n)
```

Here the same loop runs one more epoch with a balancer and saves a checkpoint at the end, in
`./custom_steps_ckpt/` under the current directory. The
balancer begins with its static split (`initial="flops"` by default: in proportion to each
device's nominal peak FLOP/s, so identical logical CPUs get the even split), and
`warmup_steps=3, interval=5` make its windows short enough to act within 30 steps (the
defaults are 5 and 10). `min_sizes=8` keeps every replica at 8 samples or more (the default
is 1), for a reason given below.
"""

balancer = hb.Balancer(strategy, warmup_steps=3, interval=5, min_sizes=8)
checkpoint = tf.train.Checkpoint(model=loop_model, optimizer=optimizer, balancer=balancer)
for batch in train_dist_dataset:
    distributed_train_step(batch)
    balancer.step_end()
balancer.end()
saved_at = checkpoint.save(os.path.join("custom_steps_ckpt", "ckpt"))

loop_reference.fit(train_dataset, epochs=1, shuffle=False, verbose=0)
print("balanced loop, weights vs one device:", max_weight_diff(loop_reference, loop_model))
for entry in balancer.history:
    print(f"  step {entry['step']}: {entry['old']} -> {entry['new']} "
          f"({entry['reason'].split(';')[0][:60]})")
window = balancer.windows[-1]
print("last window: compute ms per replica",
      [round(t * 1000, 2) for t in window["time_per_step"]],
      "step ms", round(window["step_time"] * 1000, 2))
print("tf.function traces of the step:", distributed_train_step.experimental_get_tracing_count())
assert max_weight_diff(loop_reference, loop_model) <= 1e-5

"""
Every split change left the update exact, and the `@tf.function` step was traced once for all
the splits it met: the per-replica values carry the distributed dataset's `element_spec`,
whose batch dimension is unknown (`None`). That also holds for a step called on
`next(iterator)`.

What the balancer measured here says little: these replicas are logical CPUs sharing 2 cores,
and this model is tiny, so a replica computes for a fraction of a millisecond in a step of a
few milliseconds (the last window is printed above; a replica can read 0, below the clock's
resolution, which counts as no measurement). Its time models and step-time search then send
the split far from the even one, and where it goes varies from run to run: without
`min_sizes=8` a run here gave one replica 94 of the 96 samples. On devices of different
speeds, with real work per sample, the split follows their speeds; see
[Mixed devices](mixed_devices.md).

A new process restores the balancer with the model: build a new `Balancer` with the same
options and restore the checkpoint into it.
"""

restored = hb.Balancer(strategy, warmup_steps=3, interval=5, min_sizes=8)
tf.train.Checkpoint(model=loop_model, optimizer=optimizer, balancer=restored).restore(saved_at)
print("balancer state restored:", restored.get_state() == balancer.get_state(),
      "split:", restored.batch_sizes)

"""
`balancer.settled_batch_sizes` is the split the controller settled on (`batch_sizes`, unless
its step-time search is trying a neighbouring split at that moment). To train later runs at
a fixed split, pass it to `strategy.set_batch_sizes`.

## Another global batch later

A later `fit`, or a loop's new data, may be batched by another global batch size. The split in
force is then re-made in its proportions for the new size, with one INFO line, and a balancer
that goes on re-makes its settled split the same way and records it in its history ("global
batch changed").

The tutorial's step above divides by a fixed `GLOBAL_BATCH`, so this part uses a step whose
loss needs no batch size: a mean-reduced Keras loss that the step function reaches (a global
its code names), which the strategy weights like a model's own loss.
"""

mean_squared_error = keras.losses.MeanSquaredError()  # a global the step's code names


def keras_loss_step(inputs):
    features, labels = inputs
    with tf.GradientTape() as tape:
        loss = mean_squared_error(labels, loop_model(features, training=True))
    gradients = tape.gradient(loss, loop_model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, loop_model.trainable_variables))
    return loss


@tf.function
def distributed_keras_loss_step(inputs):
    per_replica_losses = strategy.run(keras_loss_step, args=(inputs,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)


half_batches = tf.data.Dataset.from_tensor_slices((x_loop, y_loop)).batch(GLOBAL_BATCH // 2)
for batch in strategy.experimental_distribute_dataset(half_batches):
    distributed_keras_loss_step(batch)
    balancer.step_end()
balancer.end()
for entry in balancer.history:
    if entry["reason"] == "global batch changed":
        print(f"  balancer, step {entry['step']}: {entry['old']} -> {entry['new']} "
              "(global batch changed)")

"""
Sizes you set with `set_batch_sizes` that do not sum to the global batch of the data in use
are not applied to it: they wait for the next training data, which must be batched by their
sum (one INFO line says so). Training data batched by another size is then refused, naming
the fix.
"""

strategy.set_batch_sizes([8, 8, 16])  # for the next data, batched by 32
batches_of_32 = tf.data.Dataset.from_tensor_slices((x_loop, y_loop)).batch(32).take(4)
for batch in strategy.experimental_distribute_dataset(batches_of_32):
    distributed_keras_loss_step(batch)
print("split for 32:", list(strategy.batch_sizes))

loop_reference.fit(half_batches, epochs=1, shuffle=False, verbose=0)
loop_reference.fit(batches_of_32, epochs=1, shuffle=False, verbose=0)
print("after both, weights vs one device:", max_weight_diff(loop_reference, loop_model))
assert max_weight_diff(loop_reference, loop_model) <= 1e-5

"""
## Where to go next

- [Memory-bounded replicas](memory.md): a replica that computes its share in micro-batches,
  also in a custom loop or `train_step`.
- [Checkpoints and restarts](checkpoints.md): `ResumableCheckpoint` for `fit`.
- [Exactness](exactness.md): how each loss form is weighted.
"""
