"""A successful multi-worker run ends quietly (`distribute.clean_exit`), with real processes."""

import io
import json
import os
import re
import socket
import sys
import time

import numpy as np
import pytest

from tf_hetbatch.distribute import clean_exit
from tf_hetbatch.launch import launch

pytestmark = pytest.mark.cluster  # real worker processes (or subprocesses): see setup.cfg

WORKER = os.path.join(os.path.dirname(__file__), "workers", "mw_exit.py")
sys.path.insert(0, os.path.dirname(WORKER))
import mw_exit  # noqa: E402

GLOG_ERROR = re.compile(r"E\d{4} ")  # TensorFlow's error lines: "E0000 00:00:...", "E1201 ..."


def worker_lines(output, index):
    prefix = f"[worker {index}] "
    return [line[len(prefix):] for line in output.splitlines() if line.startswith(prefix)]


@pytest.mark.timeout(300)
def test_fit_evaluate_predict_on_two_workers_ends_without_error_lines(tmp_path):
    # Worker 1 works on 8 s after predict, longer than a heartbeat of the coordination service
    # (its failure showed 3.6-4.3 s after the chief's exit): exiting one by one, worker 1 would
    # log "StartAbort UNAVAILABLE: Failed to send RPC to coordination service" every time.
    log = io.StringIO()
    result = launch([WORKER, "--out", str(tmp_path), "--linger", "8"], 2, threads=1,
                    timeout=240, stdout=log, stderr=log, handle_signals=False)
    output = log.getvalue()
    assert result.ok, result.message + "\n" + output[-4000:]
    assert [(w.returncode, w.stopped_by_launcher) for w in result.workers] == [(0, False)] * 2
    for i in range(2):
        lines = worker_lines(output, i)
        assert lines.count(mw_exit.DONE) == 1, output[-4000:]
        after = lines[lines.index(mw_exit.DONE) + 1:]
        errors = [line for line in after if GLOG_ERROR.match(line) or "StartAbort" in line]
        assert errors == [], "\n".join(after)
    # Evaluate and predict ran on both workers, with the same results.
    infos = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(2)]
    assert infos[0]["evaluate"] == pytest.approx(infos[1]["evaluate"])
    predictions = [np.array(info["predict"]) for info in infos]
    assert predictions[0].shape == (320, 1)
    np.testing.assert_allclose(predictions[0], predictions[1])


def test_waiting_for_peers_ends_when_their_ports_close_and_is_bounded():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        start = time.monotonic()
        assert clean_exit.wait_until_gone([address], timeout_s=0.3) == [address]
        assert 0.3 <= time.monotonic() - start < 3
    finally:
        listener.close()
    start = time.monotonic()
    assert clean_exit.wait_until_gone([address, "127.0.0.1:not-a-port"], timeout_s=5) == []
    assert time.monotonic() - start < 1


def test_a_process_without_a_cluster_registers_no_exit_hook():
    import tensorflow as tf

    local = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec({}))
    single = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["127.0.0.1:1"]}), task_type="worker", task_id=0)
    assert not clean_exit.register_exit_together(None)
    assert not clean_exit.register_exit_together(local)
    assert not clean_exit.register_exit_together(single)
