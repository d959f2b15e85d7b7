"""The TensorBoard balance dashboards, read back through a real TensorBoard server.

The log dir is written by `write_synthetic_balance_run` (BalanceWriter, 3 replicas, 60 windows,
two adjustments) and by `keras.callbacks.TensorBoard` from a tiny real `model.fit` in the same
directory, to prove the two coexist. `write_synthetic_balance_run` can later be replaced by the
logs of a real `fit` with `DynamicBatching(log_dir=...)`.
"""

from __future__ import annotations

import json
import math
import os
import re
import urllib.parse
import urllib.request
from typing import Callable, Dict, List, Tuple

import numpy as np
import pytest

from tf_hetbatch.dashboards import summaries
from tf_hetbatch.dashboards.plot import read_balance
from tf_hetbatch.dashboards.summaries import BalanceWriter

NUM_REPLICAS = 3
NUM_WINDOWS = 60
WINDOW_STEPS = 10
GLOBAL_BATCH = 96


def write_synthetic_balance_run(log_dir: str, num_windows: int = NUM_WINDOWS) -> Dict[str, object]:
    """Writes a realistic short run of 3 heterogeneous replicas through BalanceWriter.

    Replicas of throughput 2000, 1000 and 500 samples/s start with an even split of the
    global batch 96; after the window ending at step 100 the split is made proportional; from
    step 300 replica 1 slows down by half (contention) and the split is corrected after step
    360. Adjustments are logged at the step of the window that triggered them.

    Args:
      log_dir: The log dir (shared with keras.callbacks.TensorBoard).
      num_windows: Number of windows of 10 steps.

    Returns:
      A dict with `steps` (window end steps), `adjustment_steps` and `batch_sizes`
      (per-window list of the split).
    """
    rng = np.random.default_rng(0)
    speeds = np.array([2000.0, 1000.0, 500.0])
    split = [32.0, 32.0, 32.0]
    schedule = {100: [54.0, 28.0, 14.0], 360: [64.0, 16.0, 16.0]}
    steps, splits, adjustment_steps = [], [], []
    with BalanceWriter(log_dir, NUM_REPLICAS, flush_every=25, ideal=True) as writer:
        for i in range(num_windows):
            step = (i + 1) * WINDOW_STEPS
            current = speeds * np.array([1.0, 0.5 if step > 300 else 1.0, 1.0])
            times = np.array(split) / current * rng.uniform(0.97, 1.03, NUM_REPLICAS) + 0.002
            step_time = times.max() + 0.004  # all-reduce after the slowest replica
            writer.log_window(step, split, times.tolist(), float(step_time))
            steps.append(step)
            splits.append(list(split))
            if step in schedule:  # The controller acts on the window that just ended.
                writer.log_adjustment(step, split, schedule[step],
                                      reason="compute times differ; split made proportional")
                split = schedule[step]
                adjustment_steps.append(step)
    return {"steps": steps, "adjustment_steps": adjustment_steps, "batch_sizes": splits}


def write_keras_tensorboard_logs(log_dir: str) -> None:
    """Runs a tiny real `model.fit` with `keras.callbacks.TensorBoard(log_dir)`."""
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=2, validation_data=(x, y), verbose=0,
              callbacks=[keras.callbacks.TensorBoard(log_dir)])


def start_tensorboard(logdir: str) -> Tuple[str, Callable[[], None]]:
    """Starts a real TensorBoard in this process on 127.0.0.1 and a free port.

    Args:
      logdir: The `--logdir`.

    Returns:
      (base URL without trailing slash, a function that stops the server).
    """
    from tensorboard import program

    servers: List[program.WerkzeugServer] = []

    def server_class(wsgi_app, flags):
        server = program.WerkzeugServer(wsgi_app, flags)
        servers.append(server)
        return server

    tb = program.TensorBoard(server_class=server_class)
    tb.configure(argv=[
        None, "--logdir", logdir, "--host", "127.0.0.1", "--port", "0", "--load_fast", "false",
        "--reload_task", "blocking", "--reload_interval", "0",
    ])
    url = tb.launch().rstrip("/")
    (server,) = servers

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return url, stop


def get_json(url: str, path: str, **params: str):
    """GETs `url + path` with query `params` and decodes the JSON answer."""
    query = ("?" + urllib.parse.urlencode(params)) if params else ""
    with urllib.request.urlopen(url + path + query, timeout=30) as response:
        return json.loads(response.read().decode("utf-8"))


@pytest.fixture(scope="module")
def balance_log_dir(tmp_path_factory) -> Tuple[str, Dict[str, object]]:
    log_dir = str(tmp_path_factory.mktemp("logs"))
    write_keras_tensorboard_logs(log_dir)
    written = write_synthetic_balance_run(log_dir)
    return log_dir, written


@pytest.fixture(scope="module")
def tensorboard_url(balance_log_dir, request) -> str:
    url, stop = start_tensorboard(balance_log_dir[0])
    request.addfinalizer(stop)
    return url


def _layout_categories(url: str) -> Dict[str, List[dict]]:
    layout = get_json(url, "/data/plugin/custom_scalars/layout")
    return {c["title"]: c.get("chart", []) for c in layout.get("category", [])}


def test_runs_of_replicas_cluster_and_keras_coexist(tensorboard_url):
    runs = get_json(tensorboard_url, "/data/runs")
    expected = {summaries.replica_run(k) for k in range(NUM_REPLICAS)} | {summaries.cluster_run()}
    assert expected <= set(runs)
    assert {"train", "validation"} <= set(runs), runs


def test_plugins_listing_has_custom_scalars_text_and_scalars_active(tensorboard_url):
    listing = get_json(tensorboard_url, "/data/plugins_listing")
    for plugin in ("custom_scalars", "scalars", "text"):
        assert listing[plugin]["enabled"], (plugin, listing[plugin])


def test_layout_serves_our_categories_with_all_charts(tensorboard_url):
    categories = _layout_categories(tensorboard_url)
    for title, charts in ((summaries.LAYOUT_CATEGORY, summaries.REPLICA_CHARTS),
                          (summaries.LAYOUT_CLUSTER_CATEGORY, summaries.CLUSTER_CHARTS)):
        assert title in categories, categories.keys()
        served = {c["title"]: c["multiline"]["tag"] for c in categories[title]}
        assert served == {t: list(regexes) for t, regexes in charts}


def test_replica_charts_return_every_replica_with_every_step(tensorboard_url, balance_log_dir):
    _, written = balance_log_dir
    categories = _layout_categories(tensorboard_url)
    for chart in categories[summaries.LAYOUT_CATEGORY]:
        (regex,) = chart["multiline"]["tag"]
        for k in range(NUM_REPLICAS):
            answer = get_json(tensorboard_url, "/data/plugin/custom_scalars/scalars",
                              run=summaries.replica_run(k), tag=regex)
            assert answer["regex_valid"]
            (tag,) = answer["tag_to_events"]  # exactly one tag per chart and run
            steps = [event[1] for event in answer["tag_to_events"][tag]]
            assert steps == written["steps"], (chart["title"], k)
        # The chart must not pick up the cluster's aggregates.
        answer = get_json(tensorboard_url, "/data/plugin/custom_scalars/scalars",
                          run=summaries.cluster_run(), tag=regex)
        assert answer["tag_to_events"] == {}, chart["title"]


def test_batch_sizes_served_are_the_split_written(tensorboard_url, balance_log_dir):
    _, written = balance_log_dir
    for k in range(NUM_REPLICAS):
        answer = get_json(tensorboard_url, "/data/plugin/custom_scalars/scalars",
                          run=summaries.replica_run(k), tag=f"^{summaries.TAG_BATCH_SIZE}$")
        values = [event[2] for event in answer["tag_to_events"][summaries.TAG_BATCH_SIZE]]
        assert values == [split[k] for split in written["batch_sizes"]]


def test_cluster_charts_return_the_aggregates(tensorboard_url, balance_log_dir):
    _, written = balance_log_dir
    for chart in _layout_categories(tensorboard_url)[summaries.LAYOUT_CLUSTER_CATEGORY]:
        for regex in chart["multiline"]["tag"]:
            answer = get_json(tensorboard_url, "/data/plugin/custom_scalars/scalars",
                              run=summaries.cluster_run(), tag=regex)
            (tag,) = answer["tag_to_events"]
            events = answer["tag_to_events"][tag]
            assert [e[1] for e in events] == written["steps"], chart["title"]
    answer = get_json(tensorboard_url, "/data/plugin/custom_scalars/scalars",
                      run=summaries.cluster_run(), tag=f"^{summaries.TAG_GLOBAL_BATCH}$")
    assert {e[2] for e in answer["tag_to_events"][summaries.TAG_GLOBAL_BATCH]} == {GLOBAL_BATCH}
    answer = get_json(tensorboard_url, "/data/plugin/custom_scalars/scalars",
                      run=summaries.cluster_run(), tag=f"^{summaries.TAG_BALANCE_EFFICIENCY}$")
    efficiency = [e[2] for e in answer["tag_to_events"][summaries.TAG_BALANCE_EFFICIENCY]]
    assert all(0 < e <= 1 for e in efficiency)
    # Even split of unequal replicas is unbalanced; the proportional split is nearly balanced.
    assert efficiency[0] < 0.7 < 0.9 < efficiency[20]  # windows ending at steps 10 and 210


def test_adjustments_are_text_in_the_cluster_run(tensorboard_url, balance_log_dir):
    _, written = balance_log_dir
    tags = get_json(tensorboard_url, "/data/plugin/text/tags")
    assert summaries.TAG_ADJUSTMENT in tags[summaries.cluster_run()]
    texts = get_json(tensorboard_url, "/data/plugin/text/text",
                     run=summaries.cluster_run(), tag=summaries.TAG_ADJUSTMENT)
    assert [t["step"] for t in texts] == written["adjustment_steps"]
    assert "[32, 32, 32] -&gt; [54, 28, 14]" in texts[0]["text"] or \
        "[32, 32, 32] -> [54, 28, 14]" in texts[0]["text"], texts[0]["text"]
    assert "reason" in texts[0]["text"]


def test_layouts_of_several_runs_merge_without_duplicates(tmp_path, request):
    # Two experiments under one --logdir plus a user's own custom-scalars layout.
    import tensorflow as tf
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    for name in ("exp1", "exp2"):
        write_synthetic_balance_run(str(tmp_path / name), num_windows=3)
    user_layout = layout_pb2.Layout(category=[layout_pb2.Category(
        title="my charts", chart=[layout_pb2.Chart(
            title="loss", multiline=layout_pb2.MultilineChartContent(tag=[r"^epoch_loss$"]))])])
    with tf.summary.create_file_writer(str(tmp_path / "user")).as_default():
        tf.summary.write(tag=metadata.CONFIG_SUMMARY_TAG,
                         tensor=tf.constant(user_layout.SerializeToString()),
                         metadata=metadata.create_summary_metadata(), step=0)
    url, stop = start_tensorboard(str(tmp_path))
    request.addfinalizer(stop)
    categories = _layout_categories(url)
    assert set(categories) == {summaries.LAYOUT_CATEGORY, summaries.LAYOUT_CLUSTER_CATEGORY,
                               "my charts"}
    assert len(categories[summaries.LAYOUT_CATEGORY]) == len(summaries.REPLICA_CHARTS)
    runs = set(get_json(url, "/data/runs"))
    assert {"exp1/hetbatch/replica_0", "exp2/hetbatch/replica_0", "user"} <= runs


def test_writer_works_from_a_keras_callback_inside_fit_with_a_strategy(tmp_path):
    import keras
    import tensorflow as tf

    class LogBalance(keras.callbacks.Callback):
        def __init__(self, writer):
            super().__init__()
            self.writer = writer

        def on_train_batch_end(self, batch, logs=None):
            self.writer.log_window(batch, [8, 8], [0.01, 0.02], 0.025)

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    writer = BalanceWriter(str(tmp_path), num_replicas=2, flush_every=3)
    x = np.zeros((64, 4), "float32")
    model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0, callbacks=[LogBalance(writer)])
    writer.close()
    run = read_balance(str(tmp_path))
    assert run.batch_sizes[0].steps == (0, 1, 2, 3)
    assert run.compute_times_ms[1].values == pytest.approx((20.0,) * 4)


def test_derived_quantities_of_a_window(tmp_path):
    with BalanceWriter(str(tmp_path), 3, ideal=True) as writer:
        window = writer.log_window(5, [40, 20, 0], [0.04, 0.01, 0.0], step_time=0.05)
    assert window.throughputs == pytest.approx((1000.0, 2000.0, 0.0))
    assert window.wait_times == pytest.approx((0.0, 0.03, 0.04))
    assert window.balance_efficiency == pytest.approx(0.05 / 3 / 0.04)
    assert window.global_batch == 60
    assert window.throughput == pytest.approx(1200.0)
    # Balanced: 60 samples at 3000 samples/s plus the 10 ms non-compute part.
    assert window.ideal_step_time == pytest.approx(0.02 + 0.01)


def test_a_replica_not_measured_keeps_its_batch_size_and_loses_its_timed_points(tmp_path):
    """Time 0 with samples (below the clock's resolution): drawn without time-derived points."""
    with BalanceWriter(str(tmp_path), 2, ideal=True) as writer:
        first = writer.log_window(3, [24, 8], [0.03, 0.0], step_time=0.04)
        writer.log_window(6, [20, 12], [0.02, 0.01], step_time=0.03)
    assert first.measured == (True, False)
    assert first.ideal_step_time is None
    assert math.isnan(first.balance_efficiency) and math.isnan(first.throughputs[1])
    run = read_balance(str(tmp_path))
    assert run.batch_sizes[0].steps == run.batch_sizes[1].steps == (3, 6)
    assert run.batch_sizes[1].values == pytest.approx((8, 12))
    assert run.compute_times_ms[0].steps == (3, 6)
    assert run.compute_times_ms[1].steps == (6,)
    assert run.balance_efficiency.steps == (6,)


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_sizes=[1, 2]), "one value per replica (num_replicas=3)"),
    (dict(compute_times=[0.1, -1, 0.1]), "finite values >= 0"),
    (dict(step_time=0), "step_time=0"),
    (dict(step=-1), "step=-1"),
])
def test_bad_window_fails_naming_the_value(tmp_path, kwargs, message):
    args = dict(step=1, batch_sizes=[1, 2, 3], compute_times=[0.1, 0.1, 0.1], step_time=0.2)
    args.update(kwargs)
    writer = BalanceWriter(str(tmp_path), 3)
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        writer.log_window(**args)
    writer.close()
    assert not os.path.exists(tmp_path / "hetbatch")  # nothing written, nothing created


def test_bad_constructor_arguments_fail_naming_the_value(tmp_path):
    with pytest.raises(ValueError, match="num_replicas=0"):
        BalanceWriter(str(tmp_path), 0)
    with pytest.raises(ValueError, match="flush_every=0"):
        BalanceWriter(str(tmp_path), 2, flush_every=0)
    writer = BalanceWriter(str(tmp_path), 2)
    writer.close()
    with pytest.raises(RuntimeError, match="after close"):
        writer.log_window(1, [1, 1], [0.1, 0.1], 0.1)


def test_staleness_of_asynchronous_workers_is_served_per_worker(tmp_path, request):
    """log_staleness adds a staleness category; a worker without updates gets no point."""
    written = {0: [], 1: []}
    with BalanceWriter(str(tmp_path), 2, flush_every=4) as writer:
        for i in range(10):
            step = (i + 1) * WINDOW_STEPS
            writer.log_window(step, [24, 8], [0.05, 0.05], 0.06)
            mean = [0.5 + 0.1 * i, float("nan") if i == 3 else 1.5]
            maximum = [2, -1 if i == 3 else 4]
            writer.log_staleness(step, mean, maximum)
            for k in range(2):
                if maximum[k] >= 0:
                    written[k].append((step, mean[k]))
    url, stop = start_tensorboard(str(tmp_path))
    request.addfinalizer(stop)
    categories = _layout_categories(url)
    assert summaries.LAYOUT_STALENESS_CATEGORY in categories, categories.keys()
    served = {c["title"]: c["multiline"]["tag"]
              for c in categories[summaries.LAYOUT_STALENESS_CATEGORY]}
    assert served == {t: list(r) for t, r in summaries.STALENESS_CHARTS}
    for k in range(2):
        answer = get_json(url, "/data/plugin/custom_scalars/scalars",
                          run=summaries.replica_run(k),
                          tag=summaries.STALENESS_CHARTS[0][1][0])
        (events,) = answer["tag_to_events"].values()
        assert [(e[1], round(e[2], 5)) for e in events] == \
            [(s, round(m, 5)) for s, m in written[k]], k


def test_synchronous_runs_have_no_staleness_category(tensorboard_url):
    assert summaries.LAYOUT_STALENESS_CATEGORY not in _layout_categories(tensorboard_url)


def test_bad_staleness_fails_naming_the_value(tmp_path):
    with BalanceWriter(str(tmp_path), 2) as writer:
        with pytest.raises(ValueError, match="one value per worker"):
            writer.log_staleness(10, [0.5], [1, 2])
