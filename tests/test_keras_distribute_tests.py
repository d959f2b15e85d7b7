"""Keras's own tf.distribute tests pass with HeteroMirroredStrategy in place of
MirroredStrategy, as they pass with the stock one: the installed Keras's
`keras/src/backend/tensorflow/distribute_test.py` and `optimizer_distribute_test.py`, run by
`workers/keras_distribute_run.py` in a process of their own (they reset TensorFlow's context)."""

import json
import os
import subprocess
import sys

RUNNER = os.path.join(os.path.dirname(__file__), "workers", "keras_distribute_run.py")


def run_keras_tests(which):
    """{test id: outcome} of Keras's two test modules under the `which` strategy."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, RUNNER, which], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_keras_distribute_tests_pass_with_our_strategy_as_with_the_stock_one():
    ours = run_keras_tests("ours")
    assert len(ours) >= 17 and sum(o == "ok" for o in ours.values()) >= 16, ours
    failed = {t: o for t, o in ours.items() if o.startswith("failed")}
    if failed:  # only where the stock strategy fails too (a Keras or TensorFlow change)
        stock = run_keras_tests("stock")
        ours_only = {t: o for t, o in failed.items() if not stock[t].startswith("failed")}
        assert not ours_only, "\n\n".join(f"{t}: {o}" for t, o in ours_only.items())
