"""DynamicBatching(log_dir=...) in a real `fit`: event files, the PNG, and a real TensorBoard.

One short `fit` of 3 replicas writes the balance dashboards next to
`keras.callbacks.TensorBoard` in the same log dir; a real TensorBoard server then serves every
replica's batch-size series at exactly the window steps the callback measured, and the
gradient noise scale the strategy measures (`measure_gradient_noise`).
"""

import glob
import logging
import os

import keras
import pytest

import tf_hetbatch as hb
from helpers import build_under, dense_model, regression_data
from test_summaries import _layout_categories, get_json, start_tensorboard
from tf_hetbatch.dashboards import summaries

NUM_REPLICAS = 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Trains 2 epochs of 10 steps with DynamicBatching(log_dir) and TensorBoard(log_dir)."""
    log_dir = str(tmp_path_factory.mktemp("logs"))
    x, y = regression_data()  # 320 samples, global batch 32
    strategy = hb.HeteroMirroredStrategy([f"/cpu:{i}" for i in range(NUM_REPLICAS)])
    strategy.measure_gradient_noise()
    model = build_under(strategy, dense_model)
    callback = hb.DynamicBatching(initial=[8, 8, 16], log_dir=log_dir, warmup_steps=2,
                                  interval=3)
    handler = _Records()
    logger = logging.getLogger("tf_hetbatch")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                  callbacks=[callback, keras.callbacks.TensorBoard(log_dir)])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return log_dir, callback, handler.messages


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def tensorboard_url(trained, request):
    url, stop = start_tensorboard(trained[0])
    request.addfinalizer(stop)
    return url


def test_event_files_of_every_replica_and_the_cluster_exist(trained):
    log_dir, callback, _ = trained
    runs = [summaries.replica_run(k) for k in range(NUM_REPLICAS)] + [summaries.cluster_run()]
    for run in runs:
        files = glob.glob(os.path.join(log_dir, *run.split("/"), "events.out.tfevents.*"))
        assert files, run
    assert glob.glob(os.path.join(log_dir, "train", "events.out.tfevents.*"))  # Keras's own
    # Windows after the 2 warm-up steps, every 3 steps of the 20 trained.
    assert [w["step"] for w in callback.windows] == [5, 8, 11, 14, 17, 20]


def test_png_is_written_and_its_path_logged(trained):
    log_dir, _, messages = trained
    png = os.path.join(log_dir, "hetbatch_balance.png")
    assert os.path.getsize(png) > 1000
    assert any(png in m for m in messages), messages


def test_tensorboard_serves_each_replicas_batch_sizes_at_the_steps_trained(
        trained, tensorboard_url):
    _, callback, _ = trained
    runs = get_json(tensorboard_url, "/data/runs")
    assert {summaries.replica_run(k) for k in range(NUM_REPLICAS)} <= set(runs)
    steps = [w["step"] for w in callback.windows]
    for k in range(NUM_REPLICAS):
        answer = get_json(tensorboard_url, "/data/plugin/custom_scalars/scalars",
                          run=summaries.replica_run(k), tag=f"^{summaries.TAG_BATCH_SIZE}$")
        events = answer["tag_to_events"][summaries.TAG_BATCH_SIZE]
        assert [e[1] for e in events] == steps, k
        assert [e[2] for e in events] == pytest.approx(
            [w["samples_per_step"][k] for w in callback.windows]), k


def test_tensorboard_serves_every_change_of_split_as_text(trained, tensorboard_url):
    _, callback, _ = trained
    texts = get_json(tensorboard_url, "/data/plugin/text/text",
                     run=summaries.cluster_run(), tag=summaries.TAG_ADJUSTMENT)
    assert [t["step"] for t in texts] == [e["step"] for e in callback.history]
    assert "initial split: given sizes" in texts[0]["text"]


def test_tensorboard_serves_the_noise_scale_and_efficiency_of_every_window(
        trained, tensorboard_url):
    _, callback, _ = trained
    charts = _layout_categories(tensorboard_url)[summaries.LAYOUT_NOISE_CATEGORY]
    assert [c["title"] for c in charts] == [title for title, _ in summaries.NOISE_CHARTS]
    for tag, key in ((summaries.TAG_NOISE_SCALE, "gradient_noise_scale"),
                     (summaries.TAG_STATISTICAL_EFFICIENCY, "statistical_efficiency")):
        answer = get_json(tensorboard_url, "/data/plugin/custom_scalars/scalars",
                          run=summaries.cluster_run(), tag=f"^{tag}$")
        events = answer["tag_to_events"][tag]
        assert [e[1] for e in events] == [w["step"] for w in callback.windows]
        assert [e[2] for e in events] == pytest.approx([w[key] for w in callback.windows])
