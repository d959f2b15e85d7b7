"""TensorFlow glue: the strategies, the input split, the loss weights, per-replica timing.

Every private TensorFlow/Keras API use and upstream workaround sits in the `_upstream` package
(one module per upstream topic), which only this layer imports; the layers above reach what
they need of it through the public `coordination`, `keras_fit` and `parameter_server`
modules. Imports the core only (tests/test_layers.py).

Importing it checks the installed TensorFlow/Keras first (`_upstream.versions`: an ImportError
for unsupported ones, a warning for an untested pair); every TensorFlow part of the package
imports it before it uses TensorFlow (tests/test_upstream_versions.py).
"""

from tf_hetbatch.distribute import _upstream  # noqa: F401  (the version check, before any use)
