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
import threading
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
        if already_reduced(target):
            return list(grads_and_vars)
        return original(grads_and_vars)
    target._all_reduce_sum_gradients = all_reduce_sum_gradients
    target._tf_hetbatch_reduce_wrapped = True
    target._tf_hetbatch_reduced = 0


def already_reduced(optimizer) -> bool:
    """Whether `optimizer` (or its inner optimizer) is applying gradients that are already
    summed across replicas (inside `gradients_already_reduced`)."""
    return bool(getattr(getattr(optimizer, "inner_optimizer", optimizer),
                        "_tf_hetbatch_reduced", 0))


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
# disagree once workers retrace at different times. The step's sums (`updates`) get keys from
# what each collective reduces instead: a hash of its tensor's dtype and shape and of its rank
# among the collectives of that dtype and shape in the function being traced, the same on every
# worker whatever each has traced, so it is resolved once and every later step reuses it (as
# TensorFlow's own multi-step loops reuse one key per execution). Measured (bench_fixed_cost, 3
# workers capped 0.24/0.4/0.96, B = 3): 25-31 ms per step vs 34-43 ms with per-call keys.
# TensorFlow keeps what it resolved for a key (group, dtype, shape) for the life of the process,
# and refuses the key for anything else, aborting every collective of the process ("Shape
# mismatch in the collective instance", "expected data_type 2 but got data_type 1"). So:
# - a key stands for one (group, dtype, shape, rank): a process-wide table hands out each key
#   once, and a hash that lands on a taken key moves to the next free one;
# - the keys live in [2**30, 2**31), apart from TensorFlow's counter (from 100, one a call);
# - eager all-reduces (and anything of unknown shape, or not a step's sum) keep TensorFlow's
#   keys: its counter, consistent across workers for eager calls, and per call when traced.
#   An eager all-reduce runs on a new pool thread per device, so nothing of the calling
#   thread (its default graph) can count it.
# The ranks count per function graph (the outermost graph of control flow, as TensorFlow's
# launcher does), so a nested trace neither resets nor shares its caller's count.
# Private: `_launchers` of the strategy's cross-device ops, each launcher's `all_reduce`,
# `_next_instance_key` and `_group_key`, adapted per launcher instance; canary
# `test_tensorflow_feeds_a_collective_a_new_instance_key_at_every_call`, and
# `test_a_nested_trace_keeps_its_own_ranks_and_eager_calls_keep_tensorflows_keys`,
# `test_a_static_key_stands_for_one_dtype_shape_and_rank_in_the_process`.
_STATIC_KEY_BASE = 1 << 30
_static_keys_lock = threading.Lock()
_static_keys = {}  # (group key, instance key) -> (dtype, shape, rank): each handed out once
_static_key_of = {}  # (group key, dtype, shape, rank) -> instance key


def collective_launchers(strategy):
    """The per-device collective launchers of `strategy` (empty without collective ops)."""
    cross_device_ops = getattr(strategy.extended, "_cross_device_ops", None)
    return list(getattr(cross_device_ops, "_launchers", None) or [])


@contextlib.contextmanager
def static_instance_keys(launchers):
    """While a step's sum is traced: the all-reduces the `launchers` (`collective_launchers`)
    trace get instance keys fixed at trace time (see above); eager ones and those of unknown
    shape keep TensorFlow's. May nest."""
    states = [_adapted_launcher_state(launcher) for launcher in launchers]
    for state in states:
        with state["lock"]:
            state["depth"] += 1
    try:
        yield
    finally:
        for state in states:
            with state["lock"]:
                state["depth"] -= 1


def static_instance_key(group_key, dtype, shape, rank):
    """The instance key of the `rank`-th all-reduce of (`dtype`, `shape`) in a traced function
    of collective group `group_key`: the same in every process that asks in the same order,
    and never the key of another (dtype, shape, rank) of the group in this process."""
    identity = (group_key, tf.as_dtype(dtype).name, tuple(shape), rank)
    with _static_keys_lock:
        key = _static_key_of.get(identity)
        if key is not None:
            return key
        digest = hashlib.blake2b(repr(identity[1:]).encode(), digest_size=4).digest()
        offset = int.from_bytes(digest, "big") % _STATIC_KEY_BASE
        while (group_key, _STATIC_KEY_BASE + offset) in _static_keys:  # taken: the next one
            offset = (offset + 1) % _STATIC_KEY_BASE
        key = _STATIC_KEY_BASE + offset
        _static_keys[(group_key, key)] = identity[1:]
        _static_key_of[identity] = key
        return key


def _function_graph():
    """The graph of the function being traced (None in eager mode or outside functions)."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "is_control_flow_graph", False):  # as TensorFlow's launcher does
        graph = graph.outer_graph
    return graph if getattr(graph, "building_function", False) else None


def _adapted_launcher_state(launcher):
    state = getattr(launcher, "_tf_hetbatch_keys", None)
    if state is not None:
        return state
    state = {"depth": 0, "lock": threading.Lock(), "tensor": threading.local(),
             "ranks": weakref.WeakKeyDictionary()}  # function graph -> {(dtype, shape): n}
    original_key, original_all_reduce = launcher._next_instance_key, launcher.all_reduce

    def all_reduce(input_tensor, *args, **kwargs):
        state["tensor"].value = input_tensor
        try:
            return original_all_reduce(input_tensor, *args, **kwargs)
        finally:
            state["tensor"].value = None

    def next_instance_key():
        tensor = getattr(state["tensor"], "value", None)
        state["tensor"].value = None  # one key per all_reduce
        graph = _function_graph()
        shape = getattr(tensor, "shape", None)
        if (not state["depth"] or graph is None or shape is None
                or not shape.is_fully_defined()):
            return original_key()
        kind = (tensor.dtype.name, tuple(shape))
        with state["lock"]:
            ranks = state["ranks"].setdefault(graph, {})
            rank = ranks.get(kind, 0)
            ranks[kind] = rank + 1
        return static_instance_key(launcher._group_key, tensor.dtype, shape, rank)
    launcher._tf_hetbatch_keys = state
    launcher._next_instance_key = next_instance_key
    launcher.all_reduce = all_reduce
    return state
