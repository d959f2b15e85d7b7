"""
# The global batch: the gradient noise scale and accumulation

How large should the global batch B be? Up to a point, doubling B halves the steps a model
needs; past it, the extra samples of each step buy little. That point is the gradient noise
scale B_noise (McCandlish et al., 2018, "An Empirical Model of Large-Batch Training"). This
guide measures it while training, at no extra collective, reads what it says about the B in
use, and grows the batch exactly with Keras's gradient accumulation.
"""

"""
## Why an uneven split measures the noise for free

Replica k's gradient is a mean over its b_k samples. Its squared norm is, in expectation,
|G|^2 + tr(S) / b_k: the true gradient's squared norm plus the noise of one sample's
gradient (the trace of its covariance) divided by the samples averaged. The global gradient,
over all B samples, has |G|^2 + tr(S) / B. So every step already holds gradients at several
batch sizes: the K replicas' (b_k, uneven under tf_hetbatch) and the global one (B). The
strategy fits the line |G|^2 + tr(S) x through the points (1 / b_k, |g_k|^2) and
(1 / B, |g|^2), smoothed over steps, and B_noise = tr(S) / |G|^2. Each replica adds its
squared norm and its samples to the step's one all-reduce (2 floats a replica); no collective
of its own. An even split works too (two batch sizes: B / K and B); one replica does not.

It is off by default. `strategy.measure_gradient_noise()` turns it on for the steps traced
after it: call it before `fit`.
"""
import keras
import numpy as np
import tensorflow as tf

import tf_hetbatch as hb

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

GLOBAL_BATCH = 32
rng = np.random.default_rng(0)
x = rng.normal(size=(32 * 200, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 3)) + rng.normal(size=(len(x), 3))).argmax(1).astype("int32")


def make_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


strategy = hb.HeteroMirroredStrategy(["/cpu:0", "/cpu:1"])
strategy.set_batch_sizes([7, 25])
strategy.measure_gradient_noise(smoothing=0.99)  # about the last 100 steps
with strategy.scope():
    model = make_model()
history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0,
                    callbacks=[hb.DynamicBatching(initial=[7, 25])])

"""
## Read it

`strategy.gradient_noise_scale` is a `GradientNoise`: the smoothed estimates `gradient_sq`
(|G|^2) and `trace` (tr(S)), the `steps` measured, and `scale`, B_noise. Read it between
steps, on any worker: every worker holds the same values. With `DynamicBatching`, each
epoch's logs carry `gradient_noise_scale` (so `History` does), and each window and the
TensorBoard board ("tf_hetbatch cluster") the scale and the statistical efficiency of B.

A single step's |G|^2 estimate can be negative, and so can a short average of them: `scale` is
then inf (noise dominates whatever B), which is why this guide averages over about 100 steps.

`efficiency(B)` is B_noise / (B_noise + B): the share of its ideal progress a sample keeps at
batch B (1 for a batch far below B_noise). `efficiency(B, base_batch=B0)` compares two
batches, as Pollux does: (B_noise + B0) / (B_noise + B).
"""
noise = strategy.gradient_noise_scale
print(f"B_noise {noise.scale:.0f} samples over {noise.steps} steps "
      f"(|G|^2 {noise.gradient_sq:.3g}, tr(S) {noise.trace:.3g})")
print("per epoch:", [f"{v:.0f}" for v in history.history["gradient_noise_scale"]])
for batch in (GLOBAL_BATCH, 4 * GLOBAL_BATCH, 16 * GLOBAL_BATCH):
    print(f"  efficiency at B = {batch:4d}: {noise.efficiency(batch):.2f}")
assert noise.steps == 2 * len(x) // GLOBAL_BATCH and noise.scale > 0

"""
## What it says

- B well below B_noise (efficiency near 1): a larger global batch would need almost
  proportionally fewer steps. If your replicas have memory and throughput to spare (a larger
  b_k is often faster per sample on a GPU), grow B, or accumulate gradients (below) when
  memory is the limit.
- B well above B_noise (efficiency low): most of each step's samples are wasted; a smaller B
  (and more steps) reaches the same loss with less compute.
- The noise scale grows as training goes on (gradients shrink faster than their noise), so
  the batch that suits the start rarely suits the end.

Scale the learning rate with the batch: linearly for SGD while B stays well below B_noise
(Goyal et al.), by about the square root for Adam-like optimizers.

The estimate is per sample, from a loss averaged over samples; with a loss divided by
something else (valid entries under a mask, sample weights) it is measured per sample all
the same. Each step reads every replica's gradients once more, and the summed ones, and runs
a few dozen small ops: 1-9% of a step in tf_hetbatch's overhead benchmark on a CPU (6 ms
steps of small models). Measure while you choose the batch, not necessarily always.
"""

"""
## Accumulation: a larger batch in the same memory

Keras optimizers take `gradient_accumulation_steps=n`: they update every n steps, with the
mean of the n steps' gradients, so the effective batch is n * B. Under both synchronous
tf_hetbatch strategies this trains exactly as one device accumulating the same n global
batches, at any split, with `steps_per_execution` and micro-batches. (Under the stock
`MirroredStrategy` every traced step fails with it: Keras's accumulation puts the update in a
`tf.cond` branch, where the stock strategy refuses its merge call, keras-team/keras#17429.
tf_hetbatch sums the gradients before the optimizer sees them, so the update needs none.)
"""


def accumulating_model():
    model = make_model()
    model.compile(keras.optimizers.Adam(1e-3, gradient_accumulation_steps=4),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


with strategy.scope():
    accumulating = accumulating_model()
accumulating.fit(x[:1024], y[:1024], batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
                 verbose=0)
one_device = accumulating_model()
one_device.fit(x[:1024], y[:1024], batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
               verbose=0)
difference = max(float(np.max(np.abs(a - b)))
                 for a, b in zip(accumulating.get_weights(), one_device.get_weights()))
print(f"accumulating 4 x {GLOBAL_BATCH} at the split {strategy.batch_sizes}: "
      f"max |w - w_one_device| = {difference:.1e}")
assert difference < 1e-5
