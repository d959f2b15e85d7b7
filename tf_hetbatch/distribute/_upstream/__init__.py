"""The quarantine: every use of private TensorFlow/Keras API, every upstream workaround.

One module per upstream topic (`versions`, `autograph`, `collectives`, `keras_trainer`,
`keras_callbacks`, `keras_callers`, `keras_losses`, `metrics`, `tf_data`, `iterators`,
`coordination`, `ps_coordinator`, `device_layout`, `clock`, `merge_calls`), each with its
canary tests in `tests/test_upstream_<module>.py`, so an upstream change fails loudly there
first. Each section names what it works around and the upstream issue.

The rules (`tests/test_layers.py` checks the first two):
- No private TensorFlow/Keras use outside this package: nothing else in tf_hetbatch imports
  `tensorflow.python.*` or `keras.src.*`, or relies on how Keras drives a `tf.distribute`
  strategy.
- Only `tf_hetbatch.distribute` imports this package; the layers above reach what they need
  through public modules of `tf_hetbatch.distribute` (`coordination`, `parameter_server`,
  `keras_fit`).
- Nothing here patches a class or a module: where an object must be adapted, it is one
  instance, adapted only under a tf_hetbatch strategy.

Supported: TensorFlow 2.16-2.21 with Keras 3.12-3.15 (`versions.TESTED_PAIRS`); `versions`,
imported first, refuses TensorFlow < 2.16 and Keras < 3.10 and warns of an untested pair.
"""

from tf_hetbatch.distribute._upstream import versions  # noqa: F401  (the version check first)
