"""Asynchronous training (AsyncTrainer on HeteroParameterServerStrategy) with real processes.

Each test launches a chief, one parameter server and workers on 127.0.0.1 through the
launcher (`num_ps=1`); the chief runs a script from tests/workers and writes a JSON result.
"""

import functools
import glob
import io
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from helpers import delete_checkpoint_index, truncate_checkpoint
from tf_hetbatch.training import checkpoint_choice
from tf_hetbatch.launch import launch

pytestmark = pytest.mark.cluster  # real worker processes (or subprocesses): see setup.cfg

HERE = os.path.join(os.path.dirname(__file__), "workers")
TRAIN = os.path.join(HERE, "asp_train.py")
EXACT = os.path.join(HERE, "asp_exact.py")


def run_async(script, out, *args, num_workers=2, cpus=None, max_restarts=0, timeout=240,
              expect_ok=True):
    log = io.StringIO()
    result = launch([script, "--out", str(out), *args], num_workers, num_ps=1, threads=1,
                    cpus=cpus, max_restarts=max_restarts, timeout=timeout, stdout=log,
                    stderr=log, handle_signals=False)
    text = log.getvalue()
    if expect_ok:
        assert result.ok, result.message + "\n" + text[-5000:]
    elif not os.path.exists(out):
        return None, result, text
    with open(out) as f:
        return json.load(f), result, text


def test_workers_train_with_their_own_batch_sizes_and_survive_a_killed_worker(tmp_path):
    data, result, text = run_async(TRAIN, tmp_path / "r.json", "--sizes", "24,8", "--epochs",
                                   "3", "--steps", "40", "--kill-after-epoch", "worker:1")
    samples, updates = np.array(data["samples"]), np.array(data["updates"])
    # Every update of worker k used exactly b_k examples, and every scheduled step ran once:
    # also after worker 1 was SIGKILLed at the end of epoch 1 (its work went to worker 0).
    np.testing.assert_array_equal(samples, np.array([24, 8]) * updates)
    assert updates.sum() == data["update_count"] == 120
    # Read while workers update, each worker's samples and updates are of the same updates.
    assert data["torn_reads"] == 0
    assert np.all(updates > 0) and updates[0] > updates[1]
    assert "killing worker:1" in text
    assert any("worker 1" in event for event in result.events), result.events
    # Metrics on the parameter servers count every sample of every concurrent update.
    for counted, trained in data["metric_vs_trained_samples"]:
        assert counted == trained > 0
    # Staleness: one histogram entry per update, per worker.
    np.testing.assert_array_equal(np.array(data["staleness_histogram"]).sum(axis=1), updates)
    history = data["history"]
    assert len(history["staleness"]) == 3 and all(s >= 0 for s in history["staleness"])
    # It learns: validation loss falls and accuracy is well above chance (1/3).
    assert history["val_loss"][-1] < history["val_loss"][0]
    assert history["val_accuracy"][-1] > 0.7
    assert data["evaluate"]["accuracy"] == pytest.approx(history["val_accuracy"][-1])


def test_linear_gradient_scaling_gives_every_sample_the_same_weight(tmp_path):
    data, _, _ = run_async(EXACT, tmp_path / "s.json", "--mode", "scaling", "--sizes", "24,8",
                           "--steps", "30")
    np.testing.assert_array_equal(np.array(data["samples"]), np.array([24, 8]) *
                                  np.array(data["updates"]))
    np.testing.assert_allclose(data["weights"], data["expected_scaled"], rtol=0, atol=1e-5)
    # Negative control: without the b_k / mean(b) scaling the weights would differ.
    assert np.max(np.abs(np.subtract(data["weights"], data["expected_unscaled"]))) > 1e-2


def test_one_worker_equals_plain_sgd_on_one_device(tmp_path):
    data, _, _ = run_async(EXACT, tmp_path / "ref.json", "--mode", "reference", "--steps",
                           "20", num_workers=1)
    assert data["update_count"] == 20
    assert data["moved"] > 1e-3
    assert data["max_abs_diff"] <= 1e-6


def test_dynamic_batching_splits_by_worker_speed_and_logs_staleness(tmp_path):
    """Also: Keras's TensorBoard, EarlyStopping and CSVLogger callbacks work with the trainer."""
    from tensorboard.backend.event_processing import event_accumulator

    logs = tmp_path / "logs"
    data, _, _ = run_async(TRAIN, tmp_path / "d.json", "--dynamic", "--log-dir", str(logs),
                           "--keras-callbacks", str(logs), "--epochs", "2", "--steps", "30",
                           cpus=[0.9, 0.25])
    first = data["adjustments"][0]
    assert first["reason"].startswith("initial split: proportional to nominal peak")
    # The static split read each worker's own CPU cap on the worker: 0.9 vs 0.15.
    assert first["new"][0] > 3 * first["new"][1]
    assert sum(data["batch_sizes"]) == 32 and data["batch_sizes"][0] > data["batch_sizes"][1]
    for k in range(2):
        run = logs / "hetbatch" / f"replica_{k}"
        acc = event_accumulator.EventAccumulator(str(run))
        acc.Reload()
        tags = set(acc.Tags()["tensors"])
        assert {"hetbatch/batch_size", "hetbatch/staleness_mean",
                "hetbatch/staleness_max"} <= tags, tags
        means = [float(tf.make_ndarray(e.tensor_proto))
                 for e in acc.Tensors("hetbatch/staleness_mean")]
        assert means and all(m >= 0 for m in means)
    assert glob.glob(str(logs / "hetbatch" / "cluster" / "events.*"))
    for run in ("train", "validation"):  # keras.callbacks.TensorBoard beside our runs
        assert glob.glob(str(logs / run / "events.*")), run
    csv = (logs / "log.csv").read_text().splitlines()
    assert csv[0].split(",") == ["epoch", "accuracy", "loss", "staleness", "val_accuracy",
                                 "val_loss"] and len(csv) == 3


def test_a_notice_to_the_chief_redoes_no_update_and_a_lost_ps_resumes_from_the_checkpoint(
        tmp_path):
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "p.json"
    # Attempt 0: the chief gets a SIGTERM after scheduling its 25th update (mid-epoch 0): it
    # waits for the scheduled updates, saves and exits with RESTART_EXIT_CODE; the launcher
    # restarts the cluster without counting a failure. Attempt 1 resumes at the saved update;
    # the ps is killed at the end of its epoch 0: training stops with ParameterServerLostError,
    # a failure (max_restarts=1). Attempt 2 resumes from the checkpoint of epoch 0's end.
    data, result, text = run_async(
        TRAIN, out, "--epochs", "3", "--steps", "40", "--checkpoint-dir", str(ckpt),
        "--term-at-update", "25", "--kill-after-epoch", "ps:0", "--kill-attempt", "1",
        max_restarts=1)
    assert result.attempts == 3
    first = json.loads((tmp_path / "p.json.attempt0.json").read_text())
    saved = first["preempted_at"]
    # The notice: every update scheduled before it was applied and saved; the relaunch went
    # on from exactly there: no update done twice, none lost.
    assert saved == first["updates"] == 25
    second = json.loads((tmp_path / "p.json.attempt1.json").read_text())
    assert second["restored"]["step"] == saved
    assert "killing ps:0" in text
    # The lost ps: the last attempt resumed from the end of epoch 0 and trained epochs 1, 2.
    assert data["restored"]["step"] == 40
    assert len(data["history"]["val_accuracy"]) == 2
    assert data["update_count"] == 80
    _, position = checkpoint_choice.newest(str(ckpt), "async")
    assert (position.step, position.epoch, position.batch) == (120, 3, 0)
    assert data["history"]["val_accuracy"][-1] > 0.7


def test_the_chief_skips_a_damaged_newest_checkpoint_and_names_them_if_none_is_left(tmp_path):
    # The chief alone reads the checkpoints: one worker is enough (3 launches of 3 processes).
    run = functools.partial(run_async, num_workers=1)
    first = tmp_path / "first"
    # Epoch 0 of 40 updates, saved at updates 15, 30 and the epoch's end (keep 2: 30, 40).
    run(TRAIN, tmp_path / "a.json", "--epochs", "1", "--steps", "40", "--checkpoint-dir",
        str(first), "--checkpoint-interval", "15")
    state = tf.train.get_checkpoint_state(str(first))
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == \
        ["ckpt-30", "ckpt-40"]
    # The newest cut short: the relaunch resumes at update 30 (epoch 0, batch 30).
    resumed = tmp_path / "resumed"
    shutil.copytree(first, resumed)
    truncate_checkpoint(str(resumed / "ckpt-40"))
    data, _, text = run(TRAIN, tmp_path / "b.json", "--epochs", "2", "--steps", "40",
                        "--checkpoint-dir", str(resumed), "--checkpoint-interval", "15")
    warnings = [line for line in text.splitlines() if "Checkpoint ckpt-40 in" in line]
    assert len(warnings) == 1 and "Read less bytes than requested" in warnings[0]
    restored = data["restored"]
    assert (restored["step"], restored["epoch"], restored["batch"]) == (30, 0, 30)
    assert data["update_count"] == 10 + 40  # the rest of epoch 0, then epoch 1
    assert len(data["history"]["val_accuracy"]) == 2
    # None readable: the chief stops with the error naming them, and writes nothing.
    broken = tmp_path / "broken"
    shutil.copytree(first, broken)
    truncate_checkpoint(str(broken / "ckpt-40"))
    delete_checkpoint_index(str(broken / "ckpt-30"))
    files = sorted(os.listdir(broken))
    data, result, text = run(TRAIN, tmp_path / "c.json", "--epochs", "2", "--steps", "40",
                             "--checkpoint-dir", str(broken), expect_ok=False)
    assert not result.ok and data is None
    [error] = [line for line in text.splitlines() if "ValueError: No checkpoint in" in line]
    assert "ckpt-40 (IndexError" in error and "ckpt-30 (its index file" in error
    assert "Fix:" in error
    assert sorted(os.listdir(broken)) == files
