"""Every use of private TensorFlow/Keras API, and every workaround of an upstream bug.

Nothing else in tf_hetbatch imports `tensorflow.python.*` or `keras.src.*`, or relies on how
Keras drives a `tf.distribute` strategy. Each item names what it works around and the upstream
issue; `tests/test_compat.py` pins each one, so an upstream change fails loudly there first.

Supported: TensorFlow >= 2.16 with Keras 3 (tested on TensorFlow 2.21.0 / Keras 3.15.1).
Nothing here patches a class or a module: where an object must be adapted, it is one instance,
adapted only under a tf_hetbatch strategy.
"""

import contextlib
import hashlib
import itertools
import logging
import threading
import weakref

import keras
import tensorflow as tf

logger = logging.getLogger(__name__)

TESTED_TF = "2.21"
TESTED_KERAS = "3.15"


def _version_tuple(version):
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits or 0))
    return tuple(parts)


TF_VERSION = _version_tuple(tf.__version__)
KERAS_VERSION = _version_tuple(keras.__version__)

if TF_VERSION < (2, 16) or KERAS_VERSION < (3, 0):
    raise ImportError(
        "tf_hetbatch needs TensorFlow >= 2.16 with Keras 3. Received: "
        f"tensorflow=={tf.__version__}, keras=={keras.__version__}. "
        "Fix: pip install 'tensorflow>=2.16'."
    )


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


# --- Static batch size of a tf.data pipeline -----------------------------------------------------
def static_batch_size(dataset):
    """The dataset's batch size without partial batches, or None when it cannot be inferred.

    Uses tf.data's own inference (`compute_batch_size`, which walks the pipeline to its last
    `batch`), the same one `tf.distribute` uses for rebatching.
    """
    from tensorflow.python.data.experimental.ops import distribute as data_distribute

    try:
        value = int(data_distribute.compute_batch_size(dataset).numpy())
    except (tf.errors.OpError, TypeError, ValueError):  # pragma: no cover - defensive
        return None
    return value if value > 0 else None


# --- How Keras 3 drives Strategy.run ------------------------------------------------------------
# Keras's TensorFlow trainer calls `strategy.run(model.train_step, args=(data,))` (likewise
# `test_step`), with `data` from `strategy.experimental_distribute_dataset`. Its predict function
# passes a tf.function instead. The bound method is how the strategy finds the model whose
# optimizer it weights; if Keras changes this, `test_compat.py` fails.
_KERAS_STEP_NAMES = ("train_step", "test_step")


def keras_model_of_step(fn):
    """Returns (model, kind) when `fn` is a Keras model's bound train/test step, else (None, None)."""
    model = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", None)
    if isinstance(model, keras.Model) and name in _KERAS_STEP_NAMES:
        return model, name
    return None, None


def is_keras_own_train_step(fn):
    """Whether `fn` is Keras's own `train_step` (not a subclass's): it applies the gradients once
    and after that only updates and reads the metrics, so the update may wait until the end of
    the step (see `weighting`, "One all-reduce per step")."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return getattr(fn, "__func__", None) is TensorFlowTrainer.train_step


# --- keras-team/keras#19246: steps_per_execution > 1 under MirroredStrategy ---------------------
# Keras 3 builds the multi-step function (`TensorFlowTrainer._make_function`) with the one-step
# function as a nested `tf.function` inside tf.cond inside tf.while_loop, which fails under
# MirroredStrategy, the stock one included ("You must feed a value for placeholder tensor").
# With the one-step function inlined (a plain Python function, traced into the loop) it works.
# `inline_multi_step(model)` gives THE model being trained under a tf_hetbatch strategy an
# instance-level `_make_function` that does exactly what Keras 3.15's does, with that one
# difference; it is installed when our strategy distributes the model's data (before Keras
# builds its train/test function). `test_compat.py` checks that the stock strategy still fails.
# Not fixed upstream as of Keras 3.15.1.
STEPS_PER_EXECUTION_BROKEN = True


def inline_multi_step(model):
    """Makes `model`'s multi-step train/test functions inline their one-step function.

    A no-op for steps_per_execution == 1, with `jit_compile` (XLA compiles the inner function
    itself), or where the Keras trainer method is not there; idempotent.
    """
    spe = int(getattr(model, "steps_per_execution", 1) or 1)
    if (not STEPS_PER_EXECUTION_BROKEN or spe <= 1 or getattr(model, "jit_compile", False)
            or not hasattr(model, "_make_function")
            or getattr(model, "_tf_hetbatch_inlined_steps", False)):
        return
    import types

    model._make_function = types.MethodType(_make_function_inlined, model)
    model._tf_hetbatch_inlined_steps = True
    model.train_function = model.test_function = None  # rebuilt with the inlined step


def _make_function_inlined(self, step_function):
    """Keras 3.15 `TensorFlowTrainer._make_function`, the one-step function not a tf.function."""
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = self.distribute_strategy.run(step_function, args=(data,))
        return reduce_per_replica(outputs, self.distribute_strategy, reduction="auto")

    one_step_on_data = self._autoconvert_optionals(one_step_on_data)

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_iterator(iterator):
        empty_outputs = tf.experimental.Optional.empty(None)  # spec set while tracing

        def cond(execution_step, optional_outputs, next_optional_inputs):
            return tf.logical_and(tf.less(execution_step, self.steps_per_execution),
                                  next_optional_inputs.has_value())

        def inner_body(execution_step, optional_outputs, next_optional_inputs):
            def has_next():
                next_optional_outputs = tf.experimental.Optional.from_value(
                    one_step_on_data(next_optional_inputs.get_value()))
                empty_outputs._element_spec = next_optional_outputs.element_spec
                return next_optional_outputs

            def no_has_next():
                optional_outputs._element_spec = empty_outputs._element_spec
                return optional_outputs

            next_optional_outputs = tf.cond(
                tf.logical_and(tf.less(execution_step, self.steps_per_execution),
                               next_optional_inputs.has_value()),
                has_next, no_has_next)
            return (execution_step + 1, next_optional_outputs,
                    tf.cond(tf.less(execution_step + 1, self.steps_per_execution),
                            lambda: next_as_optional(iterator),
                            lambda: next_optional_inputs))

        def body(execution_step, optional_outputs, next_optional_inputs):
            for _ in range(min(self.unrolled_steps_per_execution, self.steps_per_execution)):
                execution_step, optional_outputs, next_optional_inputs = inner_body(
                    execution_step, optional_outputs, next_optional_inputs)
            return execution_step, optional_outputs, next_optional_inputs

        with deferred_global_logs() as deferral:
            _, final, _ = tf.while_loop(
                cond, body,
                loop_vars=[tf.constant(0), empty_outputs, next_as_optional(iterator)])
        final._element_spec = empty_outputs.element_spec
        if not deferral.used:
            return final  # every step's logs were global already
        # The last step's logs, made global in one all-reduce per execution (every worker
        # takes the same branch: their data ends together). Installed only under our
        # strategies (`inline_multi_step`), which have `global_logs`.
        return tf.cond(
            final.has_value(),
            lambda: tf.experimental.Optional.from_value(
                self.distribute_strategy.global_logs(self, final.get_value())),
            lambda: final)

    if not self.run_eagerly:
        multi_step_on_iterator = tf.function(multi_step_on_iterator, reduce_retracing=True)

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            opt_outputs = multi_step_on_iterator(iterator)
            if not opt_outputs.has_value():
                raise StopIteration
            return opt_outputs.get_value()
        for _, data in zip(range(self.steps_per_execution), iterator):
            outputs = one_step_on_data(data)
        return outputs

    function.multi_step = multi_step_on_iterator  # the traced execution, for inspection
    return function


_DEFERRED = threading.local()


class _Deferral:
    used = False  # a step of the loop returned logs that are not global yet


@contextlib.contextmanager
def deferred_global_logs():
    """While tracing a multi-step loop: our strategies' `run` may return logs of the right
    structure without the cross-replica reduce (`defer_global_logs()`); only the loop's last
    logs are read, and `_make_function_inlined` makes those global after the loop if a step
    deferred them (Keras's own train step does not: its logs ride on the gradients' all-reduce)."""
    previous = getattr(_DEFERRED, "state", None)
    _DEFERRED.state = state = _Deferral()
    try:
        yield state
    finally:
        _DEFERRED.state = previous


def defer_global_logs() -> bool:
    """Whether a step's logs may stay local (inside a multi-step loop); records that they did."""
    state = getattr(_DEFERRED, "state", None)
    if state is None:
        return False
    state.used = True
    return True


def check_steps_per_execution(model):
    """Refuses steps_per_execution > 1 where `inline_multi_step` could not be installed (data
    a user distributed, a jit-compiled model), instead of failing deep inside TensorFlow."""
    spe = int(getattr(model, "steps_per_execution", 1) or 1)
    if STEPS_PER_EXECUTION_BROKEN and spe > 1 and not getattr(
            model, "_tf_hetbatch_inlined_steps", False):
        raise ValueError(
            "`steps_per_execution` > 1 works under a tf_hetbatch strategy when Keras's fit, "
            "evaluate or predict distributes the data (keras-team/keras#19246 breaks it in "
            "Keras itself otherwise), and without jit_compile. Received: steps_per_execution="
            f"{spe}, jit_compile={getattr(model, 'jit_compile', None)}. Fix: pass the "
            "tf.data.Dataset itself (not a distributed one) to fit, or compile with "
            "steps_per_execution=1."
        )


def keras_model_distributing_data(max_depth=8):
    """The Keras model whose `fit`/`evaluate`/`predict` is distributing a dataset, or None
    (call it from within the strategy's `experimental_distribute_dataset`)."""
    frame = _keras_loop_frame(max_depth + 1)
    return None if frame is None else frame.f_locals.get("self")


# --- Keras's symbolic build reduces a data batch across replicas --------------------------------
# `TensorFlowTrainer._maybe_symbolic_build` calls `strategy.reduce("MEAN", data_batch, axis=None)`
# on the first distributed batch, only to build the model from its shapes. With uneven
# per-replica batches the element-wise mean fails in AddN (the stock strategy crashes the same way
# when the global batch does not divide by the replica count). `reduce` of tf_hetbatch strategies
# recognises that call (axis=None over per-replica values of different batch sizes) and returns
# the largest replica's batch, which has the shapes the build needs.
def is_uneven_batch_reduce(strategy, reduce_op, value, axis):
    if axis is not None or not isinstance(value, tf.distribute.DistributedValues):
        return False
    if str(getattr(reduce_op, "value", reduce_op)).upper() != "MEAN":
        return False
    local = strategy.experimental_local_results(value)
    if not all(isinstance(t, tf.Tensor) for t in local) or not tf.executing_eagerly():
        return False
    shapes = {tuple(t.shape) for t in local}
    return len(shapes) > 1 and len({s[1:] for s in shapes}) == 1


def largest_local_batch(strategy, value):
    local = strategy.experimental_local_results(value)
    return max(local, key=lambda t: int(t.shape[0]))


# --- Every layer of a model, nested ones included (Keras has no public walk) -------------------
def all_layers(model):
    return list(model._flatten_layers(include_self=False, recursive=True))


# --- LossScaleOptimizer checks only the first replica's gradients -------------------------------
# Under tf.distribute, Keras's `LossScaleOptimizer._tf_apply` decides whether to apply or skip a
# step from `check_finite` of the FIRST replica's local gradients, assuming (wrongly: they are
# not all-reduced yet) that all replicas agree (keras-team/keras#18666 introduced the code, in
# PR #18691). An overflow on another replica then writes inf/NaN into the weights. With uneven
# batches the replicas overflow at different loss scales, so it bites often. Workaround, in the
# optimizer hook installed under tf_hetbatch strategies only: the replicas all-reduce a
# non-finite flag and, if any replica overflowed, every replica's gradients become NaN, so the
# first replica's check sees it and the step is skipped everywhere, as it should be.
def agree_on_finite_gradients(grads):
    """In replica context: makes every replica's grads non-finite if any replica's are."""
    ctx = tf.distribute.get_replica_context()
    dense = [
        t for g in grads if g is not None for t in tf.nest.flatten(g, expand_composites=True)
        if t.dtype.is_floating
    ]
    if ctx is None or ctx.num_replicas_in_sync == 1 or not dense:
        return grads
    local_bad = tf.cast(
        tf.logical_not(tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in dense])),
        tf.float32,
    )
    any_bad = ctx.all_reduce(tf.distribute.ReduceOp.SUM, local_bad) > 0

    def poison(t):
        if not t.dtype.is_floating:
            return t
        return t * tf.where(any_bad, tf.constant(float("nan"), t.dtype), tf.constant(1, t.dtype))

    return [
        None if g is None else tf.nest.map_structure(poison, g, expand_composites=True)
        for g in grads
    ]


# --- Keras 3 fit under MultiWorkerMirroredStrategy ----------------------------------------------
# Keras 3.15 `fit` crashes under any MultiWorkerMirroredStrategy before the first step:
# (a) `_maybe_symbolic_build` calls `strategy.reduce("MEAN", <data batch>, axis=None)` eagerly,
#     only to build the model from the batch's shapes;
# (b) `reduce_per_replica`, in its multi-worker branch, calls `strategy.reduce("MEAN", v, axis=0)`
#     on every log value, scalars included ("Invalid reduction dimension 0 for input with 0
#     dimensions").
# Both pass through the strategy's own `reduce`; HeteroMultiWorkerMirroredStrategy answers (a)
# with this worker's largest local batch (the shapes are what matter; no collective) and (b) as
# a reduce with axis=None. (a) is recognised by its caller, so a user's own reduce with
# axis=None keeps its meaning.
def called_from_keras_symbolic_build(max_depth=4):
    import sys

    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code.co_name == "_maybe_symbolic_build" and "keras" in frame.f_code.co_filename:
            return True
    return False


def is_scalar_reduce_with_axis(strategy, value, axis):
    if axis != 0:
        return False
    leaves = (
        strategy.experimental_local_results(value)
        if isinstance(value, tf.distribute.DistributedValues)
        else [value]
    )
    return all(getattr(getattr(t, "shape", None), "rank", None) == 0 for t in leaves)


def is_data_batch_reduce(strategy, reduce_op, value):
    flat = tf.nest.flatten(value)
    return (
        bool(flat)
        and all(isinstance(v, tf.distribute.DistributedValues) for v in flat)
        and called_from_keras_symbolic_build()
    )


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
def wrap_gradient_all_reduce(optimizer, on_reduced):
    """Wraps `optimizer`'s all-reduce so `on_reduced(reduced_grads)` runs in replica context."""
    target = getattr(optimizer, "inner_optimizer", optimizer)
    original = getattr(target, "_all_reduce_sum_gradients", None)
    if original is None or getattr(target, "_tf_hetbatch_reduce_wrapped", False):
        return

    def all_reduce_sum_gradients(grads_and_vars):
        if getattr(target, "_tf_hetbatch_reduced", 0):
            return list(grads_and_vars)
        reduced = original(grads_and_vars)
        return on_reduced(list(reduced))
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


# --- A resumed (shortened) epoch: Keras runs one extra, empty train step ------------------------
def undo_iteration_of_exhausted_step(model, iterations_at_begin, steps_trained) -> None:
    """Resets `optimizer.iterations` after the step that found the shortened epoch's data out.

    A resumed epoch has fewer batches than Keras expects (`fit` takes the epoch length from the
    data's cardinality), so Keras runs one more train step, whose `get_next` ends the epoch
    with OutOfRangeError. Under a tf.distribute strategy that step's
    `optimizer.iterations.assign_add(1)` has no data dependency on the batch and can run
    before the error (seen with TensorFlow 2.21 / Keras 3.15: iterations one ahead of the
    steps trained); it would shift learning-rate schedules and Adam's bias correction. Nothing
    data-dependent runs (gradients, slots, weights, tf_hetbatch's step counter), so only the
    counter is restored. Local, no collective; the same value on every worker.
    """
    if iterations_at_begin is None:
        return
    expected = iterations_at_begin + steps_trained
    optimizer = getattr(model, "optimizer", None)
    actual = None if optimizer is None else int(optimizer.iterations.numpy())
    if actual is not None and actual != expected:
        logger.debug("optimizer.iterations %d after the resumed epoch's exhausted step; "
                     "reset to %d.", actual, expected)
        model.optimizer.iterations.assign(expected)


# --- Per-worker input pipelines of a ClusterCoordinator, each knowing its worker -------------
# `ClusterCoordinator.create_per_worker_dataset` traces ONE dataset function for all workers,
# so a pipeline cannot know which worker it runs on (and its InputContext is the same for all).
# The asynchronous trainer needs the worker index in the data (to take that worker's batch
# size) and gives each worker a proper InputContext. This builds the per-worker iterators the
# way `create_per_worker_dataset` does (tensorflow/python/distribute/coordinator/values.py,
# `PerWorkerDatasetFromDatasetFunction.__iter__`), with one function per worker. Like the
# stock ones they are resource closures: re-created when a failed worker comes back.
def per_worker_iterator(coordinator, make_dataset):
    """A `PerWorkerValues` of iterators over `make_dataset(worker_index)`, and its element spec.

    Raises:
        ValueError: the workers' datasets have different element specs.
    """
    from tensorflow.python.distribute.coordinator import values as coordinator_values

    def no_variables(next_creator, **kwargs):
        raise ValueError("Creating variables in `dataset_fn` is not allowed.")

    remote_values, element_spec = [], None
    for worker in coordinator._cluster.workers:
        with tf.variable_creator_scope(no_variables):
            dataset = make_dataset(worker.worker_index)  # eager: validates and gives the spec
            spec = dataset.element_spec
            if element_spec is None:
                element_spec = spec
            elif spec != element_spec:
                raise ValueError(f"`dataset_fn` gave worker {worker.worker_index} elements "
                                 f"{spec}, but worker 0 {element_spec}. Fix: the same "
                                 "structure, dtypes and shapes on every worker.")
            function = tf.function(
                lambda index=worker.worker_index: iter(make_dataset(index))
            ).get_concrete_function()
        value = worker.create_resource(function)
        value._type_spec = tf.data.IteratorSpec(element_spec)
        remote_values.append(value)
    return coordinator_values.PerWorkerDistributedIterator(tuple(remote_values)), element_spec


# --- Has a scheduled step finished? (no public non-blocking check) ----------------------------
# `RemoteValue` offers only blocking `fetch`/`get`. The trainer bounds how many steps are
# queued without blocking on one slow worker's step, so it looks at the status and the event
# that `RemoteValueImpl` (coordinator/values.py) keeps.
def remote_value_done(value) -> bool:
    """True once the scheduled function behind `value` finished (or failed)."""
    from tensorflow.python.distribute.coordinator import remote_value as rv

    return value._status is not rv.RemoteValueStatus.NOT_READY


def wait_remote_value(value, timeout: float) -> None:
    """Waits up to `timeout` seconds for `value`'s function to finish."""
    value._status_available_event.wait(timeout)


# --- Which Keras loop distributes a dataset: evaluation data may have any batch size -----------
# A tf_hetbatch strategy needs TRAINING data batched by sum(batch_sizes) (anything else is a
# user error it reports), but Keras users batch evaluation data freely: `evaluate(batch_size=
# 512)`, `predict(x, batch_size=1000)`, `fit(validation_data=val.batch(256))`, as the stock
# strategy allows. Keras 3 gives a strategy no sign of what a dataset is for: `fit`,
# `evaluate` and `predict` each build a `TFEpochIterator`, whose constructor calls
# `strategy.experimental_distribute_dataset` (keras/src/backend/tensorflow/trainer.py). So the
# strategy asks who built that iterator:
# - `Trainer.evaluate` or `Trainer.predict`: evaluation data;
# - `Trainer.fit`: its training iterator is built first, before fit's local `epoch_iterator`
#   exists; the one it builds later, inside the epoch loop, is for `validation_data`.
# Anything else (a custom loop distributing its own data) is training data, checked as before.
# The answer depends only on the Keras call, so every worker of a cluster gets the same one.
# Canary: test_compat.test_keras_distributes_data_from_fit_evaluate_and_predict_iterators.
_KERAS_TF_TRAINER = ("keras", "src", "backend", "tensorflow", "trainer.py")


def _is_keras_tf_trainer_code(code):
    import os

    parts = os.path.normpath(code.co_filename).split(os.sep)
    return tuple(parts[-len(_KERAS_TF_TRAINER):]) == _KERAS_TF_TRAINER


EVALUATION_LOOPS = ("validation", "evaluate", "predict")


def keras_loop_distributing_data(max_depth=8):
    """Which Keras loop is distributing a dataset: "train", "validation", "evaluate",
    "predict", or None when it is not Keras's `TFEpochIterator` (e.g. a custom loop).

    Call it from within the strategy's `experimental_distribute_dataset`; `max_depth` bounds
    the frames searched for the `TFEpochIterator` constructor (strategy subclasses add some).
    """
    caller = _keras_loop_frame(max_depth + 1)
    if caller is None:
        return None
    name = caller.f_code.co_name
    if name == "fit":
        # Read only: whether fit has already bound its training iterator.
        return "validation" if "epoch_iterator" in caller.f_locals else "train"
    if name in ("evaluate", "predict"):
        return name
    return None


def _keras_loop_frame(max_depth):
    """The frame of the Keras trainer method that constructs the `TFEpochIterator` on the
    current stack (within `max_depth` frames of the caller's caller), or None."""
    import sys

    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return None
        code = frame.f_code
        if (
            code.co_name == "__init__"
            and getattr(code, "co_qualname", "TFEpochIterator.__init__")
            == "TFEpochIterator.__init__"
            and _is_keras_tf_trainer_code(code)
        ):
            break
    else:
        return None
    caller = frame.f_back
    if caller is None or not _is_keras_tf_trainer_code(caller.f_code):
        return None
    return caller


# --- The split's own tf.data functions: inline, and instantiated without Grappler (tensorflow) -
# `Dataset.map` runs its function with inter-op parallelism: its ops are scheduled on the
# inter-op threads the replicas compute with. For the split's per-batch bookkeeping (a few dozen
# scalar ops) that scheduling cost more CPU than the ops (several percent of a small model's
# step on 2 cores, BUILD_NOTES "Overhead"). The MapDataset op's `use_inter_op_parallelism=False`
# runs the function inline with a single-threaded executor; it is not exposed publicly. The
# function must not contain v1 control flow (no tf.cond, no tf.debugging.Assert guard).
# Every tf.data iterator instantiates its pipeline's functions anew, and tf.data runs a function
# "multi-device" by default, which Grappler optimizes at every instantiation: 3-15 ms CPU per
# function even for a trivial one, on every iterator (Keras makes two an epoch; at a 0.24-CPU
# cap four times that). A function with the attribute `experimental_ints_on_device` runs on
# the pipeline's device alone with no such pass (tensorflow/core/data/captured_function.cc), as
# TensorFlow's own prefetch-to-device functions do: for the split's functions (host-CPU ops on
# host variables) nothing is lost. Users' functions keep tf.data's default.
_HOST_FUNCTION = {"experimental_ints_on_device": True}


def _function_dataset(input_dataset, wrapper, make_variant, element_spec=None):
    """A dataset over `input_dataset` made by one op that takes a tf.data function: the op is
    `make_variant(input_variant, wrapper, common_args)`, `wrapper` the function's
    StructuredFunctionWrapper; the elements are `element_spec(wrapper)` (default: its output)."""
    from tensorflow.python.data.ops import dataset_ops

    class _FunctionDataset(dataset_ops.UnaryDataset):
        def __init__(self):
            self._input_dataset = input_dataset
            self._map_func = wrapper
            self._name = None
            variant = make_variant(input_dataset._variant_tensor, wrapper, self._common_args)
            super().__init__(input_dataset, variant)

        def _functions(self):
            return [wrapper]

        @property
        def element_spec(self):
            return element_spec(wrapper) if element_spec else wrapper.output_structure

    return _FunctionDataset()


def _host_dataset(input_dataset, fn, transformation, make_variant, fallback, element_spec=None):
    """`_function_dataset` with `fn` traced as a host function (see above); `fallback()` (the
    stock transformation) where TensorFlow's private pieces are gone."""
    try:
        from tensorflow.python.data.ops import structured_function
        from tensorflow.python.ops import gen_dataset_ops
    except ImportError as error:  # pragma: no cover - upstream change
        logger.debug("host tf.data functions unavailable (%s): using %s", error, transformation)
        return fallback()
    wrapper = structured_function.StructuredFunctionWrapper(
        fn, transformation, dataset=input_dataset, defun_kwargs=dict(_HOST_FUNCTION))
    return _function_dataset(input_dataset, wrapper,
                             lambda *args: make_variant(gen_dataset_ops, *args), element_spec)


def map_inline(dataset, fn):
    """`dataset.map(fn)` with `fn` a host function run in the calling thread (see above)."""

    def make_variant(ops, variant, wrapper, common_args):
        return ops.map_dataset(
            variant, wrapper.function.captured_inputs, f=wrapper.function,
            use_inter_op_parallelism=False, preserve_cardinality=True, **common_args)

    return _host_dataset(dataset, fn, "Dataset.map()", make_variant, lambda: dataset.map(fn))


def flat_map_host(dataset, fn):
    """`dataset.flat_map(fn)` with `fn` a host function (see above)."""

    def make_variant(ops, variant, wrapper, common_args):
        return ops.flat_map_dataset(
            variant, wrapper.function.captured_inputs, f=wrapper.function, **common_args)

    return _host_dataset(dataset, fn, "Dataset.flat_map()", make_variant,
                         lambda: dataset.flat_map(fn),
                         element_spec=lambda wrapper: wrapper.output_structure.element_spec)


# --- The per-step "did every replica get data" check of a distributed iterator (tensorflow) ----
# A distributed dataset whose elements are not statically shaped and whose cardinality is not
# infinite gets "partial batch handling": every `get_next` fetches each replica's element as an
# optional, counts the replicas with values and runs a `tf.cond` that feeds empty dummies to
# the replicas without. It exists for replicas whose data ends at different times. Our split
# gives every replica a slice of every global batch (possibly empty), and every worker reads
# every global batch, so all replicas' data ends together and the check is dead weight:
# measured 3-5% of a small model's step on 2 cores, and across workers an all-reduce before
# each step's compute (BUILD_NOTES: "Overhead", "No collective before a step's compute").
# `DistributedDatasetsFromFunction` keeps the decision in
# `_enable_get_next_as_optional`, read when an iterator is created; there is no public switch
# per dataset (the strategy-wide `extended.experimental_enable_get_next_as_optional` would
# also change datasets a user distributes with `distribute_datasets_from_function`).
def disable_partial_batch_handling(distributed):
    """Makes the iterators of `distributed` use plain `get_next` (see above)."""
    if not hasattr(distributed, "_enable_get_next_as_optional"):  # pragma: no cover - upstream
        logger.debug("distributed dataset has no partial batch switch: left as it is")
        return distributed
    distributed._enable_get_next_as_optional = False
    return distributed


# --- A used iterator's destruction waits for tf.data's autotuning thread (tensorflow) ----------
# Destroying a tf.data iterator that has produced elements, with autotuning on, joins its
# autotuning thread (`RootDataset::Iterator::~Iterator` -> `LogicalThreadWrapper`), which often
# waits until that thread's sleep ends (up to 60 s), with no CPU used; Keras drops an epoch's iterator at the next epoch's first step,
# so the training loop waits, and across workers all workers do (see `iterator_release`). The
# iterators of a distributed dataset come from its class's `__iter__`: the one instance gets a
# subclass (no new state) whose `__iter__` hands each eager iterator to `hold`, which destroys
# it off the training loop. Canary `test_compat.py -k releases_the_gil`: the off-thread
# destruction helps only while TensorFlow releases the GIL when it destroys a tensor handle.
_HELD_ITERATORS_CLASSES = {}


def hold_iterators(distributed, hold):
    """Makes `iter(distributed)` hand each eager iterator to `hold(iterator)` as well."""
    base = type(distributed)
    held = _HELD_ITERATORS_CLASSES.get((base, hold))
    if held is None:
        def __iter__(self):
            iterator = base.__iter__(self)
            if tf.executing_eagerly():
                hold(iterator)
            return iterator

        held = type(base.__name__, (base,), {"__iter__": __iter__, "__module__": base.__module__,
                                             "__qualname__": base.__qualname__})
        _HELD_ITERATORS_CLASSES[base, hold] = held
    distributed.__class__ = held
    return distributed


# --- One CPU replica on a worker: a plain iterator (tensorflow: a MultiDeviceIterator always) ---
# The iterators of a distributed dataset feed a worker's replicas through a MultiDeviceIterator
# whenever the replication is PER_WORKER (`input_lib._should_use_multi_device_iterator`), also
# for one replica: every iterator creation traces its per-device functions and initializes the
# resource, and every `get_next` crosses it. Measured on one CPU thread, our one-replica
# iterator with it / without: 0.15 / 0.06 s CPU to create (Keras creates two an epoch), 0.9 /
# 0.6 ms CPU a step (a plain iterator over the unsplit data: 0.35). What it is
# for, prefetching to several devices, needs more than one replica or an accelerator; for one
# CPU replica the iterators are told what TensorFlow does for PER_REPLICA data not fetched to
# the device: `iter(dataset)` on the worker. Private reads: the `_options` the iterators of a
# DistributedDatasetsFromFunction read; canary `test_iterators_read_the_dataset_options`.
def plain_iterators(distributed):
    """Makes the iterators of `distributed` (one CPU replica per worker) plain iterators."""
    if not hasattr(distributed, "_options"):  # pragma: no cover - upstream
        logger.debug("distributed dataset has no options: its iterators left as they are")
        return distributed
    distributed._options = tf.distribute.InputOptions(
        experimental_fetch_to_device=False,
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)
    return distributed


# `DistributedIterator.get_next_as_optional`, which Keras's multi-step loop calls, ignores that
# switch: it always counts the replicas with values, and across workers that count is an
# all-reduce before every step (TensorFlow skips it only for an infinite cardinality, which our
# split pipelines do not declare). For an iterator whose switch is off, i.e. one whose replicas'
# data ends together, `next_as_optional` is the same optional without the count: the local
# replicas' `has_value` is every replica's. Private reads: `_enable_get_next_as_optional`,
# `_iterators`, `_input_workers`, `_replica_order`, `_reorder_replicas`, `_strategy` and
# `input_lib._create_per_replica`; canary `test_next_as_optional_reads_what_it_needs`.
def next_as_optional(iterator):
    """`iterator.get_next_as_optional()`, with no cross-worker count where data ends together."""
    try:
        from tensorflow.python.distribute import input_lib

        local = (getattr(iterator, "_enable_get_next_as_optional", True) is False
                 and iterator._cardinality != tf.data.INFINITE_CARDINALITY)
        create_per_replica = input_lib._create_per_replica
    except (ImportError, AttributeError) as error:  # pragma: no cover - upstream change
        logger.debug("next_as_optional falls back to get_next_as_optional (%s)", error)
        local = False
    if not local:
        return iterator.get_next_as_optional()
    optionals = []
    for i, worker in enumerate(iterator._input_workers.worker_devices):
        with tf.device(worker):
            optionals.append(iterator._iterators[i].get_next_as_optional_list())

    def value():
        values = [optional.get_value() for worker in optionals for optional in worker]
        if iterator._replica_order is not None:
            values = iterator._reorder_replicas(values)
        return tf.experimental.Optional.from_value(
            create_per_replica(values, iterator._strategy))

    return tf.cond(optionals[0][0].has_value(), value,
                   lambda: tf.experimental.Optional.empty(iterator.element_spec))


# --- The structure of a tf.data pipeline (tensorflow, no public API) ----------------------------
# To move per-sample input work after the split (`input_work`), the strategy reads
# how a pipeline was built: each Python `Dataset` of a transformation keeps its input in
# `_input_dataset`, a map its function (`_map_func`: a StructuredFunctionWrapper whose
# `.function` is the traced concrete function, `._func` the Python function, `.output_structure`
# its output spec) and its parallelism (`_num_parallel_calls`, `_deterministic`), a batch its
# `_batch_size` / `_drop_remainder`, a prefetch its `_buffer_size`, a shuffle its `_buffer_size`,
# `_seed`, `_seed2` and `_reshuffle_each_iteration`, a repeat, take or skip its `_count`
# (TF 2.21). Public tf.data has no view of a pipeline's transformations. Anything not
# recognised here is "other": the pipeline then runs unsplit, as before, so an upstream change
# costs speed, never correctness.
_TRANSFORM_KINDS = {
    "_PrefetchDataset": "prefetch",
    "_OptionsDataset": "options",
    "_BatchDataset": "batch",
    "_ParallelBatchDataset": "batch",
    "_MapDataset": "map",
    "_ParallelMapDataset": "map",
    "_ShuffleDataset": "shuffle",
    "_RepeatDataset": "repeat",
    "_TakeDataset": "take",
    "_SkipDataset": "skip",
}


class PipelineStep:
    """One transformation of a tf.data pipeline, as `pipeline_steps` reads it.

    Attributes:
        kind: "prefetch", "options", "batch", "map", "shuffle", "repeat", "take", "skip",
            "split_marker" or "other".
        dataset: the transformation's output dataset.
        input: its single input dataset, or None (a source, or several inputs).
        batch_size / drop_remainder: a batch's static size and flag (None if not constant).
        num_parallel_calls / deterministic: a map's (1 / None for a sequential map).
        buffer_size: a prefetch's or a shuffle's.
        count: a repeat's, take's or skip's.
        seeded: a shuffle's: whether it was given a seed (op-level or global).
    """

    def __init__(self, dataset):
        self.dataset = dataset
        name = type(dataset).__name__
        self.kind = _TRANSFORM_KINDS.get(name, "other")
        if isinstance(dataset, _SplitMarker):
            self.kind = "split_marker"
        self.input = getattr(dataset, "_input_dataset", None)
        if not isinstance(self.input, tf.data.Dataset):
            self.input = None
            if self.kind != "other":
                self.kind = "other"
        self.batch_size = self.drop_remainder = self.buffer_size = self.count = None
        self.num_parallel_calls, self.deterministic, self.seeded = 1, None, False
        if self.kind == "batch":
            self.batch_size = _constant_or_none(getattr(dataset, "_batch_size", None))
            self.drop_remainder = _constant_or_none(getattr(dataset, "_drop_remainder", None))
            if self.batch_size is None or self.drop_remainder is None:
                self.kind = "other"
        elif self.kind == "map":
            wrapper = getattr(dataset, "_map_func", None)
            if not all(hasattr(wrapper, a) for a in ("function", "_func", "output_structure")):
                self.kind = "other"
            self.num_parallel_calls = _constant_or_none(
                getattr(dataset, "_num_parallel_calls", 1)
            )
            self.deterministic = {"true": True, "false": False}.get(
                getattr(dataset, "_deterministic", "default"), None
            )
        elif self.kind in ("repeat", "take", "skip"):
            self.count = _constant_or_none(getattr(dataset, "_count", None))
            if self.count is None:
                self.kind = "other"
        elif self.kind in ("prefetch", "shuffle"):
            self.buffer_size = _constant_or_none(getattr(dataset, "_buffer_size", None))
            if self.buffer_size is None:
                self.kind = "other"
            if self.kind == "shuffle":
                # random_seed.get_seed gives (None, None) with no op seed and no global seed.
                self.seeded = getattr(dataset, "_seed", None) not in (None, 0) or getattr(
                    dataset, "_seed2", None
                ) not in (None, 0)

    @property
    def name(self):
        return type(self.dataset).__name__

    @property
    def map_function(self):
        """A map's Python function (the one passed to `Dataset.map`)."""
        return self.dataset._map_func._func


def _constant_or_none(value):
    if value is None:
        return None
    if isinstance(value, (bool, int)):
        return value
    try:
        constant = tf.get_static_value(value)
    except (TypeError, ValueError):  # pragma: no cover - e.g. a symbolic tensor
        return None
    return None if constant is None else constant.item()


def pipeline_steps(dataset):
    """The transformations of `dataset`, outermost first, down to the first with no single
    input (a source, a zip, a concatenation, ...), which is listed as "other"."""
    steps = []
    while dataset is not None:
        step = PipelineStep(dataset)
        steps.append(step)
        if step.kind == "other":
            break
        dataset = step.input
    return steps


def first_map_below(dataset):
    """The name of the transformation just above the first map found under `dataset`
    (following single inputs through anything), or None if there is no map."""
    above = None
    while isinstance(dataset, tf.data.Dataset):
        if _TRANSFORM_KINDS.get(type(dataset).__name__) == "map":
            return type(above).__name__ if above is not None else None
        above, dataset = dataset, getattr(dataset, "_input_dataset", None)
    return None


def replay_map(dataset, step, num_parallel_calls=None):
    """`step`'s map (a "map" PipelineStep) applied to `dataset`, deterministically.

    Reuses the traced function itself (same graph, same captured state and seeds) when
    `dataset`'s elements have the spec it was traced for, and traces the Python function again
    otherwise (e.g. batches of another size than a static one). Parallelism is the original
    map's (or `num_parallel_calls`); order is always kept, whatever the original asked for.
    """
    from tensorflow.python.ops import gen_dataset_ops

    calls = step.num_parallel_calls if num_parallel_calls is None else num_parallel_calls
    calls = 1 if calls is None else calls
    wrapper = step.dataset._map_func
    if not _accepts(step.input.element_spec, dataset.element_spec):
        return dataset.map(wrapper._func, num_parallel_calls=None if calls == 1 else calls,
                           deterministic=True)

    def make_variant(variant, wrapper, common_args):
        if calls == 1:
            return gen_dataset_ops.map_dataset(
                variant, wrapper.function.captured_inputs, f=wrapper.function,
                use_inter_op_parallelism=True, preserve_cardinality=True, **common_args)
        return gen_dataset_ops.parallel_map_dataset_v2(
            variant, wrapper.function.captured_inputs, f=wrapper.function,
            num_parallel_calls=tf.constant(calls, tf.int64), deterministic="true",
            preserve_cardinality=True, **common_args)

    return _function_dataset(dataset, wrapper, make_variant)


def _accepts(traced_for, spec):
    """Whether a function traced for elements `traced_for` takes elements `spec` as they are
    (the same structure, each component a subtype: e.g. not [None] for a traced [32])."""
    try:
        tf.nest.assert_same_structure(traced_for, spec)
    except (TypeError, ValueError):
        return False
    return all(new.is_subtype_of(old)
               for old, new in zip(tf.nest.flatten(traced_for), tf.nest.flatten(spec)))


def replay_shuffle(step, dataset, seed=None):
    """`step`'s shuffle (a "shuffle" PipelineStep) rebuilt over `dataset`.

    With `seed` None, exactly the original (its buffer, its seed pair, its reshuffling), so
    the order is the one the user's pipeline gives; with `seed`, that seed instead (for an
    unseeded shuffle: each epoch still gets a new order, the same on every worker).
    """
    reshuffle = bool(getattr(step.dataset, "_reshuffle_each_iteration", True))
    if seed is not None:
        return dataset.shuffle(step.buffer_size, seed=seed, reshuffle_each_iteration=reshuffle)
    from tensorflow.python.data.ops import dataset_ops
    from tensorflow.python.ops import gen_dataset_ops

    original = step.dataset

    class _ReplayedShuffle(dataset_ops.UnaryUnchangedStructureDataset):
        def __init__(self, input_dataset):
            self._input_dataset = input_dataset
            self._buffer_size = original._buffer_size
            self._seed, self._seed2 = original._seed, original._seed2
            self._reshuffle_each_iteration = reshuffle
            self._name = None
            variant = gen_dataset_ops.shuffle_dataset_v3(
                input_dataset._variant_tensor, buffer_size=self._buffer_size,
                seed=self._seed, seed2=self._seed2,
                seed_generator=gen_dataset_ops.dummy_seed_generator(),
                reshuffle_each_iteration=reshuffle, **self._common_args)
            super().__init__(input_dataset, variant)

    return _ReplayedShuffle(dataset)


def _split_marker_class():
    from tensorflow.python.data.ops import dataset_ops

    class SplitMarker(dataset_ops.UnaryUnchangedStructureDataset):
        """Its input, unchanged (no op of its own): marks where a tf_hetbatch strategy splits."""

        def __init__(self, input_dataset):
            self._input_dataset = input_dataset
            super().__init__(input_dataset, input_dataset._variant_tensor)

    return SplitMarker


_SplitMarker = _split_marker_class()


def mark_split(dataset):
    """`dataset` itself, marked as the place where the global batch is split (no cost)."""
    return _SplitMarker(dataset)


# --- Keras's array input (keras: trainers/data_adapters/array_data_adapter.py) -----------------
# `fit(x, y, batch_size=B)` builds batches of sample indices, zips them with the whole arrays
# (`from_tensors(arrays).repeat()`) and gathers each batch in a parallel map (`grab_batch`).
# The gather works row by row, so a worker can gather only its own replicas' indices.
def keras_array_gather(step):
    """For the map step of Keras's array input: (index-batch dataset, arrays dataset), else None."""
    if step.kind != "map" or step.input is None:
        return None
    func = step.map_function
    if getattr(func, "__name__", "") != "grab_batch" or "array_data_adapter" not in getattr(
        func, "__module__", ""
    ):
        return None
    zipped = step.input
    inputs = getattr(zipped, "_datasets", None)
    if type(zipped).__name__ != "_ZipDataset" or not isinstance(inputs, tuple) or len(inputs) != 2:
        return None
    indices, arrays = inputs
    if type(arrays).__name__ != "_RepeatDataset" or indices.element_spec.shape.rank != 1:
        return None
    return indices, arrays


# --- A barrier of all tasks of a multi-worker cluster (tensorflow: no public API) -------------
# tensorflow/tensorflow#58434: the tasks of a MultiWorkerMirroredStrategy cluster that exit one
# at a time can end a successful run with "StartAbort UNAVAILABLE" error lines (a task outliving
# the coordination service's leader, or the leader outliving a task's heartbeats). The
# coordination service has a barrier of all tasks, `Context.wait_at_barrier`
# (tensorflow/python/eager/context.py), with no public API; `clean_exit` waits at it
# when a process exits. Canary: test_compat.test_coordination_barrier_is_the_context_method.
def wait_at_coordination_barrier(barrier_id, timeout_s):
    """Blocks until every task of the cluster reached the barrier `barrier_id`.

    Raises:
        tf.errors.OpError: on a timeout, a failed task, or without a coordination service
            (FailedPreconditionError).
    """
    from tensorflow.python.eager import context

    context.context().wait_at_barrier(barrier_id, int(timeout_s * 1000))


# --- The global-mean logs in one collective (keras: Metric.stateless_result, KerasVariable) -----
# Keras reads each metric variable (ON_READ SUM under a strategy) with its own cross-replica
# reduce: one collective per variable per step (the loss's total and count, each compiled
# metric's). Summing all of them in one all-reduce (in the train step: with the gradients) and
# computing the results from the sums with the public `Metric.stateless_result` gives the same
# values for no extra collective. The tf.Variable under a Keras variable is
# `KerasVariable._value`.
def summable_metric_variables(metrics):
    """The distributed tf.Variables of `metrics`' variables, or None (read them as Keras does) if
    one is not a SUM-on-read distributed variable."""
    values = [getattr(v, "_value", None) for metric in metrics for v in metric.variables]
    if not values or not all(
            isinstance(d, tf.distribute.DistributedValues)
            and getattr(d, "aggregation", None) == tf.VariableAggregation.SUM for d in values):
        return None
    return values


def metric_results_from_sums(metrics, sums):
    """`model.get_metrics_result()` for `metrics`, from the values of their variables (in the
    order of `summable_metric_variables`)."""
    sums = iter(sums)
    results = {}
    for metric in metrics:
        result = metric.stateless_result([next(sums) for _ in metric.variables])
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results


def metric_results_in_one_reduce(strategy, metrics, reduce=True):
    """Cross-replica context: `model.get_metrics_result()` for `metrics`, with every variable
    summed across replicas in one batch all-reduce; None (read them as Keras does) if a
    variable is not a SUM-on-read distributed variable. With `reduce=False`, the same structure
    from the first local replica's variables, at no communication."""
    values = summable_metric_variables(metrics)
    if values is None:
        return None
    if reduce:
        values = strategy.extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM, [(d, d) for d in values])
    return metric_results_from_sums(
        metrics, [strategy.experimental_local_results(r)[0] for r in values])


# --- The coordination service's key-value store (tensorflow: no public API in 2.21) ---------
# `tf.distribute.MultiWorkerMirroredStrategy` runs TensorFlow's coordination service; its
# key-value store (insert-if-absent, blocking get with a timeout) is what
# `tf.distribute.experimental.PreemptionCheckpointHandler` agrees on a step with, and what
# `tf_hetbatch.training.preemption` uses: `context.Context.set_config_key_value` /
# `get_config_key_value(key, timeout_in_ms)`. Canary:
# `test_coordination_key_value_store_is_the_context_api`.
def insert_coordination_key(key, value):
    """Inserts `key` = `value` into the cluster's store; False if the key already exists.

    Raises:
        tf.errors.OpError: no coordination service, or it is unreachable.
    """
    from tensorflow.python.eager import context

    try:
        context.context().set_config_key_value(key, value)
    except tf.errors.AlreadyExistsError:
        return False
    return True


def get_coordination_key(key, timeout_s):
    """The value of `key`, waiting for it at most `timeout_s` seconds; None on timeout.

    Raises:
        tf.errors.OpError: no coordination service, or it is unreachable.
    """
    from tensorflow.python.eager import context

    try:
        return context.context().get_config_key_value(key, max(1, int(timeout_s * 1000)))
    except tf.errors.DeadlineExceededError:
        return None
