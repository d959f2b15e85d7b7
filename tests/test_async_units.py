"""Asynchronous training pieces that need no cluster: staleness statistics, task checks."""

import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch.launch import server


def test_staleness_statistics_per_worker():
    hist = np.zeros((3, 8), np.int64)
    hist[0, [0, 1, 7]] = [5, 3, 2]  # the last bin counts ">= 7"
    hist[1, 0] = 4
    s = hb.Staleness(hist)
    np.testing.assert_array_equal(s.updates, [10, 4, 0])
    assert s.mean[0] == pytest.approx((3 * 1 + 2 * 7) / 10)
    assert s.mean[1] == 0.0 and np.isnan(s.mean[2])
    np.testing.assert_array_equal(s.max, [7, 0, -1])
    np.testing.assert_array_equal(s.overall(), hist.sum(axis=0))
    np.testing.assert_array_equal((s - hb.Staleness(hist // 2)).histogram, hist - hist // 2)


def _tf_config(kind, index, cluster=None):
    cluster = cluster or {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"],
                          "worker": ["127.0.0.1:3", "127.0.0.1:4"]}
    return json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}})


def test_server_accepts_ps_and_worker_tasks():
    cluster, kind, index = server.task_of(_tf_config("worker", 1))
    assert (kind, index) == ("worker", 1) and cluster["ps"] == ["127.0.0.1:2"]


@pytest.mark.parametrize("config, message", [
    (None, "TF_CONFIG is not set"),
    ("{not json", "must be JSON"),
    (_tf_config("chief", 0), "run the training script on the chief"),
    (_tf_config("worker", 2), "task index must address"),
])
def test_server_rejects_bad_tf_config_naming_the_fix(config, message):
    with pytest.raises(ValueError, match=message):
        server.task_of(config)


def test_server_command_line_reports_a_missing_tf_config():
    env = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "tf_hetbatch.launch.server"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "TF_CONFIG is not set" in proc.stderr


def test_strategy_rejects_a_cluster_without_workers():
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}),
        task_type="chief", task_id=0, rpc_layer="grpc")
    with pytest.raises(ValueError, match="no 'worker' task"):
        hb.HeteroParameterServerStrategy(resolver)


def test_strategy_rejects_bad_staleness_bins():
    with pytest.raises(ValueError, match="staleness_bins"):
        hb.HeteroParameterServerStrategy(staleness_bins=1)
