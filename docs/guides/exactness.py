"""
# How exactness works

By the end you will have trained a masked sequence model, and a model with two outputs, an
added penalty and its own `compute_loss`, at an uneven split and checked that their weights
equal one device's to 1e-5; and you will know how each form of loss is weighted, which logs
are global values, what is refused, and what the pure core offers.
"""

"""
## The weighting

Under any `tf.distribute` strategy, Keras divides every loss it reduces by the replica
count K, and the replicas' gradients are summed: the update is the mean of the replicas'
means. That equals one device's update on the global batch only when every replica's loss
has the same denominator, i.e. when the batch is split evenly.

tf_hetbatch weights each loss term where Keras divides it. A term divides the sum of its
values on replica k by a denominator D_k (its elements, its valid entries, or its sample
weights' sum, see the table below); one device divides by D = sum D_k. So replica k's term,
as Keras scaled it, is multiplied by K * D_k / D, its share. For a plain mean over the
samples that share is b_k / B, the replica's share of the step's samples: the weight b_k / B
of the front page.

The weight is applied to the loss, before any gradient is taken, at every place Keras
divides: each compiled output's loss, every `keras.losses.Loss` a step reaches, and the
model's regularizers and `add_loss` terms. So everything linear downstream sees correctly
weighted values: SyncBatchNormalization's backward all-reduce, mixed-precision loss scaling
(`LossScaleOptimizer`), the gradient sum, any Keras optimizer. The shares come from the
actual per-replica batches of each step, never from the split in force, so a switch of split
that reaches the replicas a few steps late costs no exactness. Every optimizer applies the
gradients summed across replicas, so gradient clipping acts on the global gradient, as on
one device (stock Keras clips each replica's part).

## Two logical devices

This machine has no GPU, so the guide splits its CPU into two logical CPUs, one replica
each, before anything else touches TensorFlow. On a machine with GPUs you would name real
devices instead, e.g. `hb.HeteroMirroredStrategy(["/gpu:0", "/cpu:0"])`.

"""
import contextlib
import logging
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf

import tf_hetbatch as hb

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

"""
`train_pair` trains the same model twice from the same start on the same global batches:
once on one device (no strategy), once on the two replicas at a fixed uneven split. It
returns the largest difference between the two runs' weights, and both runs' logs: `History`,
the per-batch logs callbacks see, and `evaluate`.
"""


def train_pair(build, compile_args, x, y, split, epochs=2):
    runs = []
    for strategy in (None, hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1"])):
        if strategy:
            strategy.set_batch_sizes(split)
        with strategy.scope() if strategy else contextlib.nullcontext():
            keras.utils.set_random_seed(1)
            model = build()
            model.compile(**compile_args())
        batches = []
        per_batch = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: batches.append(dict(logs)))
        history = model.fit(x, y, batch_size=sum(split), epochs=epochs, shuffle=False,
                            verbose=0, callbacks=[per_batch])
        evaluation = model.evaluate(x, y, batch_size=sum(split), verbose=0, return_dict=True)
        runs.append((model, (history.history, batches, evaluation)))
    (one, one_logs), (ours, our_logs) = runs
    return max_diff(one, ours), one_logs, our_logs


"""
`max_diff` is the largest difference between two models' weights; `same_logs` checks that
two runs' `History`, per-batch logs and `evaluate` agree to 1e-5 (relative).
"""


def max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


def same_logs(a, b):
    flat = lambda logs: np.array([v for d in [logs[0], *logs[1], logs[2]]
                                  for k in sorted(d) for v in np.ravel(d[k])])
    return np.allclose(flat(a), flat(b), rtol=1e-5, atol=0)


"""
## A masked sequence model at an uneven split

A tagger reads token ids padded with 0 (`Embedding(mask_zero=True)`) and predicts a class
per timestep (class 0 on padding, where the mask hides it). The Keras mask reaches the
loss, so Keras divides each replica's loss by its **valid** timesteps, not by all of them.
Replicas hold sequences of different lengths, so their counts of valid entries are not in
proportion to their samples: the weight of a masked term is the replica's share of the
valid entries of the whole step. tf_hetbatch sums the
replicas' counts in the step (one small all-reduce per masked term, before the backward
pass) and weights each replica's term by its share.

The split is 7 and 25 samples of a global batch of 32.
"""
N, T, VOCAB, CLASSES = 64, 8, 20, 5
rng = np.random.default_rng(0)
tokens = np.zeros((N, T), np.int32)
for i, length in enumerate(rng.integers(1, T + 1, N)):
    tokens[i, :length] = rng.integers(1, VOCAB, length)  # then 0s: padding
tags = np.where(tokens > 0, rng.integers(1, CLASSES, (N, T)), 0)  # class 0 on padding


def tagger(mask_zero=True):
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=mask_zero)(inputs)
    h = keras.layers.LSTM(8, return_sequences=True)(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


def tagger_compile():
    return dict(optimizer=keras.optimizers.Adam(1e-2),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


"""
Train it on one device and at the split [7, 25], and compare:
"""
diff, one, ours = train_pair(tagger, tagger_compile, tokens, tags, split=[7, 25])
print(f"masked LSTM tagger at [7, 25]: max weight difference from one device {diff:.1e}")
print("  loss per epoch, one device:", np.round(one[0]["loss"], 6).tolist(),
      " ours:", np.round(ours[0]["loss"], 6).tolist())
assert diff <= 1e-5 and same_logs(one, ours)

"""
The logs are global values too: the progress bar and the per-batch logs callbacks see,
`History` (each output's loss as well) and `evaluate` hold the values one device reports,
not a mean of the replicas' values. `same_logs` checks all three.

## Loss forms and how each is weighted

| loss form | Keras divides a replica's term by | the replica's weight |
|---|---|---|
| `"sum_over_batch_size"` / `"mean"` (the default): a mean over the samples | its elements (samples x entries) | its share of the step's samples, b_k / B |
| the same with a Keras mask reaching the loss (`Embedding(mask_zero=True)`, `Masking`, a layer's `compute_mask`): masked per-timestep losses | its valid entries | its share of the step's valid entries, summed across replicas in the step (one small all-reduce per masked term, before the backward pass) |
| `"mean_with_sample_weight"` | the sum of its sample weights (masked, with a mask) | its share of the step's sample weights (with a mask: summed in the step) |
| `"sum"` | nothing | none: its term is already its share of the global sum |
| `"none"` / `None` | nothing (you reduce the values) | none: reduce with `tf.nn.compute_average_loss(values, global_batch_size=B)` |
| sample weights with zeros (padding passed as `sample_weight`) | under the default reduction all its entries, zeros included, as on one device | its share of the samples: exact, no collective |
| the model's regularizers, `add_loss` terms | nothing (Keras divides them by the replica count) | its share of the samples (a replica with no samples in a step adds nothing) |
| several outputs, with `loss_weights` | each output's term by its own denominator | each term by its own form, as above; `loss_weights` multiply as on one device |
| a `compute_loss` override: the terms it adds itself | what your code divides by | its share of the samples: write a mean divided by `num_replicas_in_sync`, as under any strategy |
| your own code normalising by a count it computes from its replica's data, e.g. `tf.reduce_sum(l * m) / tf.reduce_sum(m)` | that count: not seen | not exact: warned once when traced; divide by the global count instead (below) |

A term's weight follows its own form: outputs with different reductions in one model are
each weighted by their own. Gradients and logs follow from the weighted terms.

## Two outputs, a regularizer, `add_loss` and a `compute_loss` override

One model collects several rows of the table: a classification output and a regression
output with `loss_weights`, an L2 kernel regularizer, an `add_loss` penalty (a mean over
the samples), and a `compute_loss` override that adds a term of its own, divided by
`num_replicas_in_sync` as under any `tf.distribute` strategy. The optimizer clips the global
gradient norm to 0.05 (`global_clipnorm`), far below this model's gradient norm (about 0.9),
so the clip acts on every step: on the summed gradient, as on one device.
"""


class MeanPenalty(keras.layers.Layer):
    def call(self, h):
        self.add_loss(1e-2 * tf.reduce_mean(tf.square(h)))
        return h


class WithOwnTerm(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                    training=training)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        return loss + 0.1 * tf.reduce_mean(tf.abs(y_pred["reg"])) / replicas


def two_outputs():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu",
                           kernel_regularizer=keras.regularizers.L2(1e-2))(inputs)
    h = MeanPenalty()(h)
    return WithOwnTerm(inputs, {"cls": keras.layers.Dense(3, name="cls")(h),
                                "reg": keras.layers.Dense(1, name="reg")(h)})


def two_outputs_compile():
    return dict(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=0.05),
                loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      "reg": "mse"},
                loss_weights={"cls": 1.0, "reg": 0.5})


"""
On one device and at [7, 25], with 3 classes and a regression target:
"""
x6 = rng.normal(size=(N, 6)).astype("float32")
y6 = {"cls": rng.integers(0, 3, N), "reg": rng.normal(size=(N, 1)).astype("float32")}
diff, one, ours = train_pair(two_outputs, two_outputs_compile, x6, y6, split=[7, 25])
print(f"two outputs at [7, 25]: max weight difference {diff:.1e}; History keys:",
      sorted(ours[0]))
assert diff <= 1e-5 and same_logs(one, ours)

"""
## A count your own code computes

A loss that divides by a count your code computes from its own replica's data is not seen:
Keras and tf_hetbatch see only a number. Below, a loss function ignores padded timesteps
(label 0) by hand, `tf.reduce_sum(l * m) / tf.reduce_sum(m)`. tf_hetbatch weights it as a
mean over samples (b_k / B), but each replica divided by its own count of valid entries,
and those counts are not in proportion to the samples: the result is a mean of the
replicas' means, and the weights drift from one device's. It cannot weight what it cannot
see, but it finds the division in the traced step (a scalar computed from the replica's
own batch) and says so once, naming the loss and the fix, in the `tf_hetbatch` logger.

The fix: let Keras see the denominator. Pass the mask as a per-timestep `sample_weight` and
use `reduction="mean_with_sample_weight"`: Keras divides by the sum of the weights (the
valid entries), and each replica's term is weighted by its share of the step's sample
weights. The update is then the one a single device makes with the hand-written loss. (In a
custom training loop, divide each replica's sum by the global count: the replicas' counts
summed with `tf.distribute.get_replica_context().all_reduce("SUM", count)`.)
"""
valid = (tags > 0).astype("float32")


def token_classifier():  # a class per token, no Keras mask
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8)(inputs)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


def by_hand(y_true, y_pred):
    m = tf.cast(y_true > 0, "float32")
    losses = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
    return tf.reduce_sum(losses * m) / tf.reduce_sum(m)


def train(loss, strategy=None, sample_weight=None):
    with strategy.scope() if strategy else contextlib.nullcontext():
        keras.utils.set_random_seed(1)
        model = token_classifier()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    model.fit(tokens, tags, sample_weight=sample_weight, batch_size=32, epochs=2,
              shuffle=False, verbose=0)
    return model


"""
One device with the hand-written loss is the reference. Ours with the same loss at
[7, 25] drifts from it; ours with the mask as sample weights and
`"mean_with_sample_weight"` does not:
"""
strategy = hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1"])
strategy.set_batch_sizes([7, 25])
one_device = train(by_hand)
said = []
heard = logging.Handler()
heard.emit = lambda record: said.append(record.getMessage())
logging.getLogger("tf_hetbatch").addHandler(heard)
wrong = max_diff(one_device, train(by_hand, strategy))
logging.getLogger("tf_hetbatch").removeHandler(heard)
print(f"count by hand at [7, 25]: max weight difference {wrong:.1e} (not exact)")
print("tf_hetbatch said:", *[m[:100] + "..." for m in said if "by_hand" in m])
assert any("by_hand" in m and "own batch" in m for m in said)
keras_sees_it = keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction="mean_with_sample_weight")
right = max_diff(one_device, train(keras_sees_it, strategy, sample_weight=valid))
print(f"mask as sample_weight, mean_with_sample_weight: max weight difference {right:.1e}")
assert wrong > 1e-4 and right <= 1e-5

"""
## What is refused

Where the weighting cannot be exact, tf_hetbatch refuses when the step is traced, with the
cause and the fix, instead of training something else than one device would:

- **A masked loss in micro-batches.** A replica whose share is computed in micro-batches
  (`strategy.set_micro_batch_limits`, see the [memory guide](memory.md)) cannot know the
  step's count of valid entries. Fix: lift the bounds, or pass the padding as
  `sample_weight` under the default reduction instead of a mask.
- **A Keras loss the step does not reach.** In a custom `train_step`, a `keras.losses.Loss`
  the model does not hold would be divided by the replica count unseen. Fix: compute the
  loss with `self.compute_loss(...)`, or hold the loss on the model
  (`self.loss_fn = ...`); see the [custom steps guide](custom_steps.md).
- **`tf.nn.compute_average_loss` without `global_batch_size`** after SyncBatchNormalization,
  or with an optimizer the step does not reach. Fix: pass `global_batch_size=B`.
- **A `compute_loss` of raw operations** (no Keras loss inside) whose compiled losses mix
  reductions that need different weights. Fix: give every loss the same kind of reduction.
- **`tf.nn.scale_regularization_loss` in a micro-batched step.** Fix: compute the loss with
  `model.compute_loss`, or lift the bounds.

The [troubleshooting page](../troubleshooting.md) lists every refusal with its message. The
first one, as you would meet it:
"""
strategy = hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1"])
strategy.set_batch_sizes([7, 25])
strategy.set_micro_batch_limits([None, 10])
with strategy.scope():
    model = tagger()
    model.compile(**tagger_compile())
try:
    model.fit(tokens, tags, batch_size=32, epochs=1, verbose=0)
    raise AssertionError("the masked loss in micro-batches was not refused")
except ValueError as refusal:
    print("refused:", str(refusal).split("\n")[0][:400])

"""
## The pure core

The arithmetic behind the split lives in `tf_hetbatch.core`, in plain Python and numpy:
`import tf_hetbatch` alone, and every module of the core, import no TensorFlow, so you can
plan splits, read device peaks, try controllers and simulate clusters anywhere. The
package's top level names them lazily (`hb.split_proportionally`, `hb.simulate`, ...).

- `split`: `split_evenly`, `split_proportionally` (within `min_sizes`/`max_sizes`),
  `validate_sizes`, the water-filling and equal-finish arithmetic;
- `devices`: `cpu_capability()` and `gpu_capability(name, compute_capability)`, the nominal
  peak FLOP/s the static split starts from;
- `controllers`: `ModelBasedController` (the default of `DynamicBatching`) and
  `ProportionalController`, pure functions of their state and the measurements;
- `sim`: `simulate(controller, ClusterModel(...), steps)`, a discrete-event simulator of a
  synchronous heterogeneous cluster, driven by the same controllers.
"""
code = ("import sys; from tf_hetbatch.core import split, devices, controllers, sim; "
        "print('tensorflow' in sys.modules)")
print("TensorFlow imported by the core:",
      subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                     check=True, timeout=60).stdout.strip())

from tf_hetbatch.core import controllers, devices, sim, split

print("split_proportionally(64, [1, 3]):", split.split_proportionally(64, [1.0, 3.0]))
print("split_proportionally(64, [1, 3], max_sizes=40):",
      split.split_proportionally(64, [1.0, 3.0], max_sizes=40))
print(f"this CPU's nominal peak: {devices.cpu_capability().peak_flops / 1e9:.0f} GFLOP/s")
print(f"a Tesla T4: {devices.gpu_capability('Tesla T4', (7, 5)).peak_flops / 1e12:.1f} TFLOP/s")
cluster = sim.ClusterModel(alpha=[0.0, 0.0, 0.0], beta=[1e-3, 2e-3, 4e-3])
result = sim.simulate(controllers.ModelBasedController(), cluster, steps=60,
                      initial_sizes=[64, 64, 64])
print("simulated: replicas 1x, 2x, 4x slower per sample, split from [64, 64, 64] to",
      result.sizes[-1].tolist())

"""
`ClusterModel` takes per-replica fixed seconds (`alpha`) and seconds per sample (`beta`),
and optionally noise, slowdowns over a range of steps (`Slowdown`), lost replicas, an
all-reduce time, CPU quotas and the collective's own cost. The [API reference](../reference.md)
has every argument.
"""
