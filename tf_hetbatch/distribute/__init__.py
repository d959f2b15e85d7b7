"""TensorFlow glue: the strategies, the input split, the loss weights, per-replica timing.

Every private TensorFlow/Keras API use and upstream workaround sits in `_compat`. Imports the
core only (tests/test_layers.py).
"""
