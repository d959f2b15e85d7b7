"""The Keras level: `DynamicBatching` and its collaborators, checkpoints, preemption notices and
the asynchronous trainer.

Imports the core, distribute and dashboards (tests/test_layers.py).
"""
