"""TensorFlow glue: the strategies, the input split, the loss weights, per-replica timing.

Every private TensorFlow/Keras API use and upstream workaround sits in the `_upstream` package
(one module per upstream topic), which only this layer imports; the layers above reach what
they need of it through the public `coordination`, `keras_fit` and `parameter_server`
modules. Imports the core only (tests/test_layers.py).
"""
