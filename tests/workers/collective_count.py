"""Counts the cross-worker collectives TensorFlow executes eagerly, for tests.

TensorFlow calls an op callback (`op_callbacks.add_op_callback`, its own instrumentation)
after every op and every function it executes eagerly in the calling thread; a function's
callback names it, and its definition (and the functions it calls) shows whether it holds a
collective op. So `EagerCollectives` counts every collective executed from Python while it is
active: a strategy's gather or reduce, an ON_READ variable's cross-worker read, a collective
a tf.function issues. A training step run by Keras outside the block is not counted.
"""

import contextlib

from tensorflow.python.eager import context
from tensorflow.python.framework import op_callbacks

_COLLECTIVE_OPS = ("CollectiveReduceV2", "CollectiveReduceV3", "CollectiveGatherV2",
                   "CollectiveBcastSendV2", "CollectiveBcastRecvV2", "CollectiveAllToAllV2",
                   "CollectiveAllToAllV3", "CollectiveReduce", "CollectiveGather",
                   "CollectiveBcastSend", "CollectiveBcastRecv", "NcclAllReduce")


class EagerCollectives:
    """Counts collectives executed eagerly (directly or in a function) while `counting()`."""

    def __init__(self):
        self.count = 0
        self.calls = []  # (what executed, collectives in it)
        self._in_function = {}

    def _collectives_in(self, name, seen=()):
        if name in self._in_function:
            return self._in_function[name]
        ctx = context.context()
        if name in seen or not ctx.has_function(name):
            return 0
        found = 0
        for node in ctx.get_function_def(name).node_def:
            if node.op in _COLLECTIVE_OPS:
                found += 1
            for attr in node.attr.values():
                names = [attr.func.name] if attr.HasField("func") else [
                    f.name for f in attr.list.func]
                found += sum(self._collectives_in(n, seen + (name,)) for n in names)
        self._in_function[name] = found
        return found

    def _callback(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is not None:  # an op created while tracing, not executed
            return None
        op_type = op_type.decode() if isinstance(op_type, bytes) else op_type
        found = 1 if op_type in _COLLECTIVE_OPS else self._collectives_in(op_type)
        if found:
            self.count += found
            self.calls.append((op_type, found))
        return None

    @contextlib.contextmanager
    def counting(self):
        op_callbacks.add_op_callback(self._callback)
        try:
            yield self
        finally:
            op_callbacks.remove_op_callback(self._callback)
