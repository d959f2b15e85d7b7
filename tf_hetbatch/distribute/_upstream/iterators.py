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
# workers do (see `iterator_release`). The iterators of a distributed dataset come from its
# class's `__iter__`: the one instance gets a subclass (no new state) whose `__iter__` hands
# each eager iterator to `hold`, which destroys it off the training loop. Canary
# `test_upstream_iterators.py -k releases_the_gil`: the off-thread destruction helps only while
# TensorFlow releases the GIL when it destroys a tensor handle.
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
