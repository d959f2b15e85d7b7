"""The iterators of a distributed dataset (TensorFlow's input_lib).

No per-step partial-batch check, used iterators handed off to be destroyed, plain iterators
for one CPU replica, and `get_next_as_optional` without a count across workers.
Canaries: `tests/test_upstream_iterators.py`.
"""

import logging

import tensorflow as tf

logger = logging.getLogger(__name__)


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
# waits until that thread's sleep ends (up to 60 s), with no CPU used; Keras drops an epoch's
# iterator at the next epoch's first step, so the training loop waits, and across workers all
# workers do (see `iterator_release`). Canary `test_upstream_iterators.py -k releases_the_gil`:
# the off-thread destruction helps only while TensorFlow releases the GIL when it destroys a
# tensor handle.
#
# --- A step function traced again for every new split (tensorflow: a trace per batch shape) ----
# `next(iterator)` gives PerReplica values whose type spec comes from their tensors' shapes
# (`values.PerReplica._type_spec`), so a `tf.function` step called on them (TensorFlow's
# custom-loop tutorial: `for x in dist_dataset: distributed_train_step(x)`) is traced again
# for every split it meets: 0.4 s a new split for a small dense model on 3 logical CPUs, and a
# step-time search tries several. The iterator's `element_spec` leaves the batch dimension
# unknown; the PerReplica values `next` gives carry it as their type spec
# (`_ElementSpecPerReplica`), so such a step is traced once for every split, as a step that
# iterates inside its function is. Private: `values.PerReplica` (`_type_spec`, `values`);
# canary `test_a_step_on_next_values_is_traced_once_for_every_split`.
#
# Both act on the eager iterators `iter(distributed)` makes: the one distributed dataset gets a
# subclass (no new state) whose `__iter__` hands each to `hold` (to be destroyed off the
# training loop) and gives it a subclass whose `get_next` types its values by its element spec.
try:
    from tensorflow.python.distribute import values as _tf_values
except ImportError:  # pragma: no cover - upstream change; the canary says so
    _tf_values = None

if _tf_values is not None:
    class _ElementSpecPerReplica(_tf_values.PerReplica):
        """A PerReplica value typed by the spec given (its iterator's element spec)."""

        def __init__(self, values, spec):
            super().__init__(values)
            self._element_spec = spec

        @property
        def _type_spec(self):
            return self._element_spec


def typed_by_element_spec(value, element_spec):
    """`value` (an eager element of a distributed iterator) with each PerReplica value typed by
    the matching spec of `element_spec`; anything else as it is."""
    if _tf_values is None:  # pragma: no cover - upstream change
        return value

    def typed(leaf, spec):
        if type(leaf) is _tf_values.PerReplica and isinstance(spec, _tf_values.PerReplicaSpec):
            return _ElementSpecPerReplica(leaf.values, spec)
        return leaf

    try:
        return tf.nest.map_structure(typed, value, element_spec)
    except (TypeError, ValueError) as error:  # pragma: no cover - upstream change
        logger.debug("distributed values keep their own type spec (%s)", error)
        return value


_ADAPTED_CLASSES = {}


def _subclass(base, key, make_methods):
    """The subclass of `base` (same names, no new state) with `make_methods()`, one per key."""
    adapted = _ADAPTED_CLASSES.get((base, key))
    if adapted is None:
        adapted = type(base.__name__, (base,), dict(
            make_methods(), __module__=base.__module__, __qualname__=base.__qualname__))
        _ADAPTED_CLASSES[base, key] = adapted
    return adapted


def _typed_iterator_methods(base):
    def get_next(self, name=None):
        value = base.get_next(self, name)
        if not tf.executing_eagerly():
            return value
        return typed_by_element_spec(value, self.element_spec)

    return {"get_next": get_next}


def adapt_iterators(distributed, hold):
    """Makes `iter(distributed)` hand each eager iterator to `hold(iterator)`, and its values
    typed by its element spec (see above)."""
    base = type(distributed)

    def dataset_methods():
        def __iter__(self):
            iterator = base.__iter__(self)
            if tf.executing_eagerly():
                hold(iterator)
                typed = type(iterator)
                iterator.__class__ = _subclass(typed, "typed",
                                               lambda: _typed_iterator_methods(typed))
            return iterator

        return {"__iter__": __iter__}

    distributed.__class__ = _subclass(base, hold, dataset_methods)
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
