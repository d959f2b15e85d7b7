"""Runs Keras's own tf.distribute tests (the installed Keras's
keras/src/backend/tensorflow/distribute_test.py and optimizer_distribute_test.py) in this
process, with `tf.distribute.MirroredStrategy` inside those two test modules either the stock
one (`stock`) or HeteroMirroredStrategy (`ours`). Only the modules' own name `tf` is replaced,
by a view of TensorFlow whose `distribute.MirroredStrategy` is ours: TensorFlow, Keras and the
rest of the process are untouched.

A process of its own: the tests reset TensorFlow's context and configure 2 logical CPUs, and a
collective that TensorFlow aborts stays aborted until the process ends. Prints one JSON line,
{test id: "ok" | "skipped" | "failed: ..."}.
"""

import json
import os
import sys
import unittest

import worker_start  # noqa: F401  (first: before TensorFlow)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import tensorflow as tf  # noqa: E402
from keras.src.backend.tensorflow import distribute_test, optimizer_distribute_test  # noqa: E402

import tf_hetbatch as hb  # noqa: E402

MODULES = (distribute_test, optimizer_distribute_test)


class _View:
    """`target` with some attributes replaced."""

    def __init__(self, target, **replaced):
        self._target = target
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._target, name)


class _Outcomes(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes = {}

    def addSuccess(self, test):
        super().addSuccess(test)
        self.outcomes[test.id()] = "ok"

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcomes[test.id()] = "skipped"

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.outcomes[test.id()] = "failed: " + self._exc_info_to_string(err, test)[-1500:]

    def addError(self, test, err):
        super().addError(test, err)
        self.outcomes[test.id()] = "failed: " + self._exc_info_to_string(err, test)[-1500:]


def main():
    which = sys.argv[1]
    if which == "ours":
        view = _View(tf, distribute=_View(tf.distribute,
                                          MirroredStrategy=hb.HeteroMirroredStrategy))
        for module in MODULES:
            module.tf = view
    elif which != "stock":
        raise SystemExit(f"usage: {sys.argv[0]} stock|ours (received {which!r})")
    suite = unittest.TestSuite(unittest.defaultTestLoader.loadTestsFromModule(m) for m in MODULES)
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=_Outcomes)
    result = runner.run(suite)
    print(json.dumps(result.outcomes), flush=True)


if __name__ == "__main__":
    main()
