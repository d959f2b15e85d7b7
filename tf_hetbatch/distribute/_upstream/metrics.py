"""The global-mean logs from the metric variables' sums, in one collective (Keras).

Private: `KerasVariable._value`, and that Keras's metric variables are SUM-on-read under a
strategy (each replica's own running sums). Where a variable is not, the logs are read as
Keras does. Canaries: `tests/test_upstream_metrics.py`; `tests/test_equivalence.py` compares the
per-batch logs with a single device's.
"""

import tensorflow as tf


# --- The global-mean logs in one collective (keras: Metric.stateless_result, KerasVariable) -----
# Keras reads each metric variable (ON_READ SUM under a strategy) with its own cross-replica
# reduce: one collective per variable per step (the loss's total and count, each compiled
# metric's). Summing all of them in one all-reduce (in the train step: with the gradients) and
# computing the results from the sums with the public `Metric.stateless_result` gives the same
# values for no extra collective. The tf.Variable under a Keras variable is
# `KerasVariable._value`. Only SUM-on-READ variables hold each replica's own sums: Keras < 3.10
# made them mirrored SUM-on-write variables (keras-team/keras#21061), whose every `assign_add`
# wrote K * old + the sum of the updates, and which are not per replica; any other variable
# is left to Keras's own read (and `versions` refuses those Keras releases).
def summable_metric_variables(metrics):
    """The distributed tf.Variables of `metrics`' variables, or None (read them as Keras does) if
    one is not a SUM-on-read distributed variable."""
    values = [getattr(v, "_value", None) for metric in metrics for v in metric.variables]
    if not values or not all(
            isinstance(d, tf.distribute.DistributedValues)
            and getattr(d, "synchronization", None) == tf.VariableSynchronization.ON_READ
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


def metric_results_of(strategy, metrics, reduce=True):
    """Cross-replica context: {id(metric): its global `result()`} for `metrics`, every variable
    summed across replicas in one batch all-reduce; None (read them as Keras does) if a
    variable is not a SUM-on-read distributed variable. With `reduce=False`, the results of the
    first local replica's variables, at no communication."""
    values = summable_metric_variables(metrics)
    if values is None:
        return None
    if reduce:
        values = strategy.extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM, [(d, d) for d in values])
    sums = iter([strategy.experimental_local_results(r)[0] for r in values])
    return {id(metric): metric.stateless_result([next(sums) for _ in metric.variables])
            for metric in metrics}
