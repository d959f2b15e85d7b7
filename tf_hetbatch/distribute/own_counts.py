"""A loss normalised by a value its replica computes from its own batch: found in the traced
graph, warned once.

The strategy weights a loss by the denominator it can see: the samples, a Keras mask's valid
entries, the sample weights' sum (`weighting`). A loss whose own code divides by a statistic
of its replica's batch, `tf.reduce_sum(l * m) / tf.reduce_sum(m)` or a Dice score over the
whole batch, is seen as a number: weighted by samples, it trains as the mean of the replicas'
normalised losses, not as one device on the global batch (the weights drift by about 1e-2 in
20 steps on a padded tagger). Nothing can weight it right without knowing the statistic, so
the strategy says so, once per loss, with the fix.

What is looked for, between a loss's value and its inputs in the traced graph: a division
whose denominator is a scalar computed from the inputs' values (through a reduction over the
batch, an index, a `tf.boolean_mask`'s size). A count of samples or elements (`tf.shape`,
`tf.size`, `reduce_mean`) is the denominator the strategy weights by; an elementwise or
per-sample division (a relative error, a per-sequence mean) keeps the loss a mean over
samples: neither is reported. Traced steps only (an eager step has no graph to read).
"""

import logging
import weakref
from typing import Iterable, Optional

import tensorflow as tf

logger = logging.getLogger(__name__)

# Ops dividing input 0 by input 1 (Reciprocal, Inv: 1 / input 0).
_DIVISIONS = {"RealDiv": 1, "Div": 1, "DivNoNan": 1, "FloorDiv": 1, "Reciprocal": 0, "Inv": 0,
              "Xdivy": 1}
# Ops whose output depends on the input's shape only.
_SHAPES = {"Shape", "ShapeN", "Size", "Rank"}
# Ops whose output's shape depends on the input's values (a shape taken of them is data).
_VALUE_SHAPED = {"Where", "Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2"}
_LIMIT = 20000  # ops visited per question: a loss's own graph is far smaller

_warned = weakref.WeakSet()  # the losses (and models) warned about


def warn_if_normalised_by_own_data(value, inputs: Iterable, owner, name: str) -> None:
    """Warns once per `owner` (a loss, a model) when the loss `value` divides by a scalar
    computed from the values of `inputs` (tensors of the same graph), naming the loss, that
    division and the fix."""
    if owner in _warned or tf.executing_eagerly():  # an eager step has no graph to read
        return
    values = [t for t in tf.nest.flatten(value) if _is_symbolic(t)]
    stops = {t.ref() for t in tf.nest.flatten(inputs) if _is_symbolic(t)}
    if not values or not stops:
        return
    division = _own_data_division(values, stops)
    if division is None:
        return
    _warned.add(owner)
    logger.warning(
        "The loss %s divides by %r (%s), a scalar computed from its replica's own batch (e.g. "
        "a count of valid entries, a sum over the batch). tf_hetbatch weights each replica's "
        "loss by its share of the step's samples, so under this strategy it trains as the mean "
        "of the replicas' normalised losses, not as one device on the global batch. Fix: let "
        "Keras see the denominator (pass the mask as sample_weight with "
        "reduction=\"mean_with_sample_weight\", or use a Keras mask), or in a custom step divide "
        "the replica's sum by the global count (tf.distribute.get_replica_context()"
        ".all_reduce(\"SUM\", count)).", name, division.name, division.type)


def _is_symbolic(tensor) -> bool:
    return isinstance(tensor, tf.Tensor) and tf.is_symbolic_tensor(tensor)


def _own_data_division(values, stops) -> Optional[tf.Operation]:
    """The first division between the `values` and the `stops` whose denominator is a scalar
    that depends on the stops' values, or None."""
    seen, todo = set(), [t.op for t in values]
    while todo and len(seen) < _LIMIT:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type in _DIVISIONS:
            denominator = op.inputs[_DIVISIONS[op.type]]
            if denominator.shape.num_elements() == 1 and _from_values(denominator, stops):
                return op
        todo.extend(t.op for t in op.inputs if t.ref() not in stops)
    return None


def _from_values(tensor, stops) -> bool:
    """Whether `tensor` depends on the values of the `stops` (a shape or size taken of them
    does not count, unless the shape itself came from values: `tf.where`, `tf.boolean_mask`)."""
    seen, todo = set(), [(tensor, False)]
    while todo and len(seen) < _LIMIT:
        t, shape_only = todo.pop()
        if t.ref() in stops:
            if not shape_only:
                return True
            continue
        op = t.op
        if (op, shape_only) in seen:
            continue
        seen.add((op, shape_only))
        if shape_only and op.type in _VALUE_SHAPED:
            shape_only = False  # its shape is its input's values
        elif op.type in _SHAPES:
            shape_only = True
        todo.extend((i, shape_only) for i in op.inputs)
    return False
