"""Merge calls: Keras's gradient accumulation under a mirrored strategy (TensorFlow, Keras).

An optimizer with `gradient_accumulation_steps` applies inside `ops.cond(is_update_step, update,
accumulate)` in replica context (`BaseOptimizer._backend_apply_gradients`). Its update branch
reaches `maybe_merge_call` (the TensorFlow backend's update step and weight decay), and
MirroredStrategy and MultiWorkerMirroredStrategy refuse a merge call inside a `tf.cond` branch, a
graph of its own: "`merge_call` called while defining a new graph or a tf.function", in every
traced step, under the stock strategies too (keras-team/keras#17429,
tensorflow/tensorflow#59487).

The strategy hands an optimizer gradients already summed across replicas
(`collectives.gradients_already_reduced`): the same values on every replica. Applying them needs
no merge call: every replica updates its own copy, which is TensorFlow's own path for a
strategy without merge calls (`extended._use_merge_call()` False, as under XLA on GPUs):
`maybe_merge_call` calls the update directly, `extended.update` in replica context updates the
replica's own component (`MirroredExtended._replica_ctx_update`), and a variable of aggregation
NONE (Keras's weights, slots and accumulators) is assigned on the replica's device. So while an
accumulating optimizer applies already-summed gradients, the thread that applies sees
`_use_merge_call()` False; every other thread, at every other time, gets the strategy's own
answer. Per thread: a LossScaleOptimizer applies its inner optimizer in new replica threads
(`call_for_each_replica` in its cross-replica cond), and a merge call anywhere else (the step's
all-reduce) must stay one in every replica thread. Adapted: the one optimizer instance that
accumulates (a LossScaleOptimizer's inner one) and the strategy's extended instance.
Canaries: `tests/test_upstream_merge_calls.py`.
"""

import contextlib
import threading

import tensorflow as tf

from tf_hetbatch.distribute._upstream import collectives

_without = threading.local()


def adapt_accumulating_optimizer(optimizer) -> None:
    """Wraps the `apply` of `optimizer` (or of its inner optimizer) if it accumulates gradients:
    while its gradients are already summed across replicas, it applies them without merge calls
    (idempotent; nothing for an optimizer that does not accumulate)."""
    target = getattr(optimizer, "inner_optimizer", optimizer)
    if not getattr(target, "gradient_accumulation_steps", None) or getattr(
            target, "_tf_hetbatch_accumulation_adapted", False):
        return
    original = target.apply

    def apply(grads, trainable_variables=None):
        if not collectives.already_reduced(target):
            return original(grads, trainable_variables)
        with _without_merge_calls(tf.distribute.get_strategy().extended):
            return original(grads, trainable_variables)

    apply.__doc__ = original.__doc__
    target.apply = apply
    target._tf_hetbatch_accumulation_adapted = True


@contextlib.contextmanager
def _without_merge_calls(extended):
    """In this thread, `extended._use_merge_call()` answers False (the strategy's extended
    instance answers through `_answer_per_thread`)."""
    _answer_per_thread(extended)
    _without.depth = getattr(_without, "depth", 0) + 1
    try:
        yield
    finally:
        _without.depth -= 1


def _answer_per_thread(extended) -> None:
    if getattr(extended, "_tf_hetbatch_merge_call_per_thread", False):
        return
    own = extended._use_merge_call

    def use_merge_call():
        return False if getattr(_without, "depth", 0) else own()

    extended._use_merge_call = use_merge_call
    extended._tf_hetbatch_merge_call_per_thread = True
