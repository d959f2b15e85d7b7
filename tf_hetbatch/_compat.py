"""Every use of private TensorFlow/Keras API, and every workaround of an upstream bug.

Nothing else in tf_hetbatch imports `tensorflow.python.*` or `keras.src.*`, or relies on how
Keras drives a `tf.distribute` strategy. Each item names what it works around and the upstream
issue; `tests/test_compat.py` pins each one, so an upstream change fails loudly there first.

Supported: TensorFlow >= 2.16 with Keras 3 (tested on TensorFlow 2.21.0 / Keras 3.15.1).
Nothing here patches a class or a module: where an object must be adapted, it is one instance,
adapted only under a tf_hetbatch strategy.
"""

import itertools
import logging

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


# --- keras-team/keras#19246: steps_per_execution > 1 under MirroredStrategy ---------------------
# Keras 3 nests the tf.function `one_step_on_data` inside tf.cond inside tf.while_loop, which
# fails under MirroredStrategy ("You must feed a value for placeholder tensor"). The fix inlines
# that function in Keras itself; a strategy cannot reach it, so tf_hetbatch refuses the setting
# with a clear error instead of failing deep inside TensorFlow. `test_compat.py` checks that the
# stock strategy still fails, so the refusal is lifted as soon as upstream is fixed.
# Not fixed upstream as of Keras 3.15.1; test_compat's canary fails once the stock strategy works.
STEPS_PER_EXECUTION_BROKEN = True


def check_steps_per_execution(model):
    spe = getattr(model, "steps_per_execution", 1) or 1
    if STEPS_PER_EXECUTION_BROKEN and int(spe) > 1:
        raise ValueError(
            "`steps_per_execution` must be 1 under a tf.distribute MirroredStrategy with "
            f"Keras {keras.__version__}: Keras fails there even with the stock strategy "
            "(keras-team/keras#19246). Received: steps_per_execution="
            f"{spe}. Fix: model.compile(..., steps_per_execution=1)."
        )


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
def wrap_gradient_all_reduce(optimizer, on_reduced):
    """Wraps `optimizer`'s all-reduce so `on_reduced(reduced_grads)` runs in replica context."""
    target = getattr(optimizer, "inner_optimizer", optimizer)
    original = getattr(target, "_all_reduce_sum_gradients", None)
    if original is None or getattr(target, "_tf_hetbatch_reduce_wrapped", False):
        return
    def all_reduce_sum_gradients(grads_and_vars):
        reduced = original(grads_and_vars)
        return on_reduced(list(reduced))
    target._all_reduce_sum_gradients = all_reduce_sum_gradients
    target._tf_hetbatch_reduce_wrapped = True


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
    import sys

    frame = sys._getframe(0)
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
    name = caller.f_code.co_name
    if name == "fit":
        # Read only: whether fit has already bound its training iterator.
        return "validation" if "epoch_iterator" in caller.f_locals else "train"
    if name in ("evaluate", "predict"):
        return name
    return None


# --- A tf.data map run in the pipeline's own thread (tensorflow, no public API) ---------------
# `Dataset.map` runs its function with inter-op parallelism: its ops are scheduled on the
# inter-op threads the replicas compute with. For the split's per-batch bookkeeping (a few dozen
# scalar ops) that scheduling cost more CPU than the ops (several percent of a small model's
# step on 2 cores, BUILD_NOTES "Overhead"). The MapDataset op's `use_inter_op_parallelism=False`
# runs the function inline with a single-threaded executor; it is not exposed publicly. The
# function must not contain v1 control flow (no tf.cond, no tf.debugging.Assert guard).
def map_inline(dataset, fn):
    """`dataset.map(fn)`, run in the calling thread (falls back to `map` where unavailable)."""
    try:
        from tensorflow.python.data.ops.map_op import _MapDataset
    except ImportError as error:  # pragma: no cover - upstream change
        logger.debug("inline tf.data map unavailable (%s): using Dataset.map", error)
        return dataset.map(fn)
    return _MapDataset(dataset, fn, use_inter_op_parallelism=False)


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


# --- A barrier of all tasks of a multi-worker cluster (tensorflow: no public API) -------------
# tensorflow/tensorflow#58434: the tasks of a MultiWorkerMirroredStrategy cluster that exit one
# at a time can end a successful run with "StartAbort UNAVAILABLE" error lines (a task outliving
# the coordination service's leader, or the leader outliving a task's heartbeats). The
# coordination service has a barrier of all tasks, `Context.wait_at_barrier`
# (tensorflow/python/eager/context.py), with no public API; tf_hetbatch.clean_exit waits at it
# when a process exits. Canary: test_compat.test_coordination_barrier_is_the_context_method.
def wait_at_coordination_barrier(barrier_id, timeout_s):
    """Blocks until every task of the cluster reached the barrier `barrier_id`.

    Raises:
        tf.errors.OpError: on a timeout, a failed task, or without a coordination service
            (FailedPreconditionError).
    """
    from tensorflow.python.eager import context

    context.context().wait_at_barrier(barrier_id, int(timeout_s * 1000))
