"""Collectives: keys, the gradient all-reduce, and what replicas agree on (TensorFlow, Keras).

Collective key bases per strategy object, the warning of a second multi-worker strategy, the
instance keys of the step's all-reduce fixed at trace time, the hook on the optimizer's
gradient all-reduce, and the non-finite-gradient agreement that LossScaleOptimizer lacks.
Canaries: `tests/test_upstream_collectives.py`.
"""

import contextlib
import hashlib
import itertools
import logging
import weakref

import tensorflow as tf

logger = logging.getLogger(__name__)


# --- Collective keys (tensorflow: several MirroredStrategy objects in one process) -------------
# Two MirroredStrategy objects in one process start their collective group/instance keys at the
# same base and can clash ("Shape mismatch in the collective instance 100"). TensorFlow reads the
# (test-only) attribute `_collective_key_base` of the strategy object while constructing its
# extended; giving every tf_hetbatch strategy its own base keeps their collectives apart.
_COLLECTIVE_KEY_STRIDE = 100_000
_collective_key_bases = itertools.count(start=1)


def assign_collective_key_base(strategy):
    """Gives `strategy` (before its `super().__init__`) a collective key base of its own."""
    strategy._collective_key_base = next(_collective_key_bases) * _COLLECTIVE_KEY_STRIDE


# --- One multi-worker strategy per process (tensorflow: collective ops enabled again) ----------
# Every MultiWorkerMirroredStrategy enables collective ops when it is created; a second one in a
# process replaces the collective executor manager (GrpcServer::UpdateServerDef), and a collective
# a peer already started with the old one is lost: the next broadcast can hang (reproduced with
# two stock strategies; examples/benchmarks/bench_fixed_cost.py runs one per process for this).
_multi_worker_strategies = itertools.count()


def warn_if_second_multi_worker_strategy(num_workers: int) -> None:
    """Logs a warning when a second multi-worker strategy with peers is created in a process."""
    if num_workers > 1 and next(_multi_worker_strategies) >= 1:
        logger.warning(
            "A second multi-worker strategy with peers in this process: TensorFlow enables "
            "collective ops again, which loses collectives the other workers already started, "
            "so training can hang. Create one HeteroMultiWorkerMirroredStrategy per process "
            "(e.g. one worker process per run) and reuse it.")


# --- Where a replica is released from the gradient all-reduce ------------------------------------
# A replica's time per step is measured from the moment the previous step's gradient all-reduce
# released it to its next local gradients being ready: its own per-step work (Keras's step
# overhead, the optimizer update, the input fetch, the forward and backward pass), without the
# time it waited for slower replicas. Keras's TensorFlow optimizer all-reduces in the private
# `TFOptimizer._all_reduce_sum_gradients(grads_and_vars)` (replica context); tf_hetbatch wraps it
# on the one optimizer instance that does the reduce (a LossScaleOptimizer's inner optimizer).
# Inside `gradients_already_reduced(optimizer)` the wrapped all-reduce passes the gradients on
# as they are: tf_hetbatch summed them already (with the logs' sums, in one all-reduce). The
# flag is a trace-time count on the optimizer, not thread-local state, because a
# LossScaleOptimizer under MirroredStrategy reaches the all-reduce in new replica threads
# (`merge_call`, then `call_for_each_replica`).
def wrap_gradient_all_reduce(optimizer):
    """Wraps `optimizer`'s all-reduce so it passes gradients on unchanged while
    `gradients_already_reduced` holds (and sums them as before otherwise)."""
    target = getattr(optimizer, "inner_optimizer", optimizer)
    original = getattr(target, "_all_reduce_sum_gradients", None)
    if original is None or getattr(target, "_tf_hetbatch_reduce_wrapped", False):
        return

    def all_reduce_sum_gradients(grads_and_vars):
        if getattr(target, "_tf_hetbatch_reduced", 0):
            return list(grads_and_vars)
        return original(grads_and_vars)
    target._all_reduce_sum_gradients = all_reduce_sum_gradients
    target._tf_hetbatch_reduce_wrapped = True
    target._tf_hetbatch_reduced = 0


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """While tracing an `apply` of gradients that are already summed across replicas: the
    optimizer's own all-reduce (wrapped by `wrap_gradient_all_reduce`) does nothing."""
    target = getattr(optimizer, "inner_optimizer", optimizer)
    target._tf_hetbatch_reduced += 1
    try:
        yield
    finally:
        target._tf_hetbatch_reduced -= 1


# --- The step's all-reduce: an instance key fixed at trace time (tensorflow: a new key per call) -
# TensorFlow's collective launcher (`CollectiveReplicaLauncher._next_instance_key`) gives every
# call of a traced function new instance keys (a call-time capture), so the cluster resolves
# every step's all-reduce anew, through task 0 (an RPC from every other worker to the chief,
# and work on the chief's CPU). It does so because keys assigned at trace time by its counter
# disagree once workers retrace at different times. The step's sum (`weighting.finish_step`)
# gets keys from what it reduces instead: a hash of its values' dtypes and shapes and of the
# request's rank among such requests in the function being traced (one per pack), the same on
# every worker whatever each has traced, so it is resolved once and every later step reuses it
# (as TensorFlow's own multi-step loops reuse one key per execution). The keys live in
# [2**30, 2**31), apart from TensorFlow's counter (from 100); a reused key with another shape is
# TensorFlow's "Shape mismatch in the collective instance" error, not a hang. Measured
# (bench_fixed_cost, 3 workers capped 0.24/0.4/0.96, B = 3): 25-31 ms per step vs 34-43 ms with
# TensorFlow's per-call keys. Private: `_launchers` of the strategy's cross-device ops and each
# launcher's `_next_instance_key`, adapted per launcher instance; canary
# `test_tensorflow_feeds_a_collective_a_new_instance_key_at_every_call`.
_STATIC_KEY_BASE = 1 << 30


def collective_launchers(strategy):
    """The per-device collective launchers of `strategy` (empty without collective ops)."""
    cross_device_ops = getattr(strategy.extended, "_cross_device_ops", None)
    return list(getattr(cross_device_ops, "_launchers", None) or [])


@contextlib.contextmanager
def instance_keys_from_values(launchers, values):
    """While tracing the all-reduce of `values`: the `launchers` (`collective_launchers`) give
    it instance keys derived from the values' dtypes and shapes and from the order of the
    requests within the function being traced. No launchers, or values of unknown shape:
    TensorFlow's keys, unchanged."""
    shapes = [v.shape for v in values]
    if not launchers or not all(s.is_fully_defined() for s in shapes):
        yield
        return
    signature = repr([(v.dtype.name, tuple(s)) for v, s in zip(values, shapes)])
    states = [_adapted_launcher_state(launcher) for launcher in launchers]
    for state in states:
        if state["depth"] and state["signature"] != signature:
            raise RuntimeError("two tf_hetbatch step all-reduces traced at once on one launcher")
        state["signature"] = signature
        state["depth"] += 1
    try:
        yield
    finally:
        for state in states:
            state["depth"] -= 1


def _adapted_launcher_state(launcher):
    state = getattr(launcher, "_tf_hetbatch_keys", None)
    if state is not None:
        return state
    state = {"depth": 0, "signature": None, "graph": None, "calls": 0}
    original = launcher._next_instance_key

    def next_instance_key():
        if not state["depth"]:
            return original()
        graph = tf.compat.v1.get_default_graph()
        while getattr(graph, "is_control_flow_graph", False):  # as TensorFlow's launcher does
            graph = graph.outer_graph
        if state["graph"] is None or state["graph"]() is not graph:
            state["graph"], state["calls"] = weakref.ref(graph), 0  # distinct keys per function
        digest = hashlib.blake2b(f"{state['signature']}#{state['calls']}".encode(),
                                 digest_size=4).digest()
        state["calls"] += 1
        return _STATIC_KEY_BASE + int.from_bytes(digest, "big") % _STATIC_KEY_BASE
    launcher._tf_hetbatch_keys = state
    launcher._next_instance_key = next_instance_key
    return state
