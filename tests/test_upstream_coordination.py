"""Canaries of `_upstream.coordination`: the coordination service's barrier and store.

When one fails after an upgrade, read the matching section of
`tf_hetbatch/distribute/_upstream/coordination.py`: the workaround may be obsolete
(lift it) or broken (fix it), but it must not go on silently.
"""

import pytest
import tensorflow as tf

from tf_hetbatch.distribute._upstream import coordination


def test_coordination_barrier_is_the_context_method():
    """`coordination.wait_at_coordination_barrier` (tensorflow/tensorflow#58434, used by
    tf_hetbatch.distribute.clean_exit at exit): the eager context's `wait_at_barrier(barrier_id,
    timeout_in_ms)` reaches the coordination service's barrier; in a process without one it
    fails at once (test_clean_exit runs the barrier in a real two-worker job)."""
    import inspect

    from tensorflow.python.eager import context

    params = list(inspect.signature(context.Context.wait_at_barrier).parameters)
    assert params == ["self", "barrier_id", "timeout_in_ms"]
    with pytest.raises(tf.errors.FailedPreconditionError, match="Coordination service"):
        coordination.wait_at_coordination_barrier("tf_hetbatch/canary", timeout_s=1)


def test_coordination_key_value_store_is_the_context_api():
    """Canary of the private API a multi-worker preemption notice agrees through
    (`coordination.insert_coordination_key`, `coordination.get_coordination_key`)."""
    import inspect

    from tensorflow.python.eager import context

    ctx = context.context()
    assert callable(ctx.set_config_key_value)
    assert "timeout_in_ms" in inspect.signature(ctx.get_config_key_value).parameters
