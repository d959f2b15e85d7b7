"""ResumableCheckpoint: atomic chief-only checkpoints, exact mid-epoch resume, fewer workers.

Multi-process tests run real workers through the launcher (tests/workers/resume_train.py) and
compare with one device trained on the same global batches in this process.
"""

import io
import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from tf_hetbatch import recovery
from tf_hetbatch.launch import launch
from tf_hetbatch.recovery import ResumableCheckpoint

WORKER = os.path.join(os.path.dirname(__file__), "workers", "resume_train.py")
sys.path.insert(0, os.path.dirname(WORKER))
import mw_train  # noqa: E402
import resume_train  # noqa: E402

N, BATCH, EPOCHS = 320, 32, 3
STEPS_PER_EPOCH = N // BATCH


# ---------------------------------------------------------------------- helpers -----------
def run_cluster(out, ckpt, num_workers, *args, max_restarts=0, timeout=150):
    log = io.StringIO()
    result = launch(
        [WORKER, "--out", str(out), "--ckpt", str(ckpt), *args], num_workers, threads=1,
        max_restarts=max_restarts, timeout=timeout, stdout=log, stderr=log,
        handle_signals=False,
    )
    return result, log.getvalue()


def outputs_of(out, num_workers):
    outputs = []
    for i in range(num_workers):
        weights = np.load(os.path.join(out, f"worker{i}.npz"))
        with open(os.path.join(out, f"worker{i}.json")) as f:
            outputs.append((weights, json.load(f)))
    return outputs


_REFERENCE = {}


def reference_weights(epochs=EPOCHS):
    """One device, no strategy, on the same global batches (cached per epoch count)."""
    if epochs not in _REFERENCE:
        x, y = mw_train.data(N)
        model = resume_train.build()
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=epochs,
                  verbose=0)
        _REFERENCE[epochs] = model.get_weights()
    return _REFERENCE[epochs]


def weights_of(npz, count):
    return [npz[f"arr_{i}"] for i in range(count)]


def max_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def ids_of_batches(epoch_batches):
    """Sample ids trained for [(first batch, end batch), ...] ranges of global batches."""
    return np.concatenate([np.arange(b0 * BATCH, b1 * BATCH) for b0, b1 in epoch_batches])


# ---------------------------------------------------------------------- multi-process -----
def test_killed_worker_resumes_from_last_checkpoint_and_equals_one_device(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    # Checkpoints every 4 steps; worker 1 dies after step 14 (epoch 1, batch 4) on attempt 0:
    # the newest checkpoint is step 12 (epoch 1 after 2 batches).
    result, log = run_cluster(
        out, ckpt, 2, "--every", "4", "--die-worker", "1", "--die-step", "14", "--dynamic",
        max_restarts=1,
    )
    assert result.ok, result.message + "\n" + log[-4000:]
    assert result.attempts == 2
    outputs = outputs_of(out, 2)
    ref = reference_weights()
    for weights, info in outputs:
        assert info["attempt"] == 1
        # Only the work since the last checkpoint was redone: the resumed run started at the
        # checkpoint's step, trained the rest, and the interrupted epoch's first 2 batches
        # were skipped.
        assert info["restored"]["step"] == 12
        assert (info["restored"]["epoch"], info["restored"]["batch"]) == (1, 2)
        assert info["initial_epoch"] == 1
        assert info["first_step"] == 12
        assert info["steps"] == EPOCHS * STEPS_PER_EPOCH - 12
        assert info["steps_trained"] == EPOCHS * STEPS_PER_EPOCH
        # The saved split and DynamicBatching state came back.
        assert info["restored_sizes"] == info["restored"]["batch_sizes"]
        assert sum(info["restored_sizes"]) == BATCH
        assert info["restored_dynamic_sizes"] == info["restored"]["dynamic_batching"][
            "batch_sizes"]
        assert max_diff(weights_of(weights, len(ref)), ref) <= 1e-5
    for a, b in zip(weights_of(outputs[0][0], len(ref)), weights_of(outputs[1][0], len(ref))):
        np.testing.assert_array_equal(a, b)
    # Every sample of the resumed part trained exactly once: epoch 1 from batch 2, epoch 2.
    ids = np.sort(np.concatenate([w["ids"] for w, _ in outputs]))
    expected = np.sort(ids_of_batches([(2, STEPS_PER_EPOCH), (0, STEPS_PER_EPOCH)]))
    np.testing.assert_array_equal(ids, expected)
    # keep=2: only the two newest checkpoints remain, and the pointer names the final one.
    names = recovery.list_checkpoints(str(ckpt))
    assert len(names) == 2
    final = ResumableCheckpoint(ckpt).latest()
    assert (final["step"], final["epoch"], final["batch"]) == (30, 3, 0)


def test_resume_with_fewer_workers_resplits_the_global_batch(tmp_path):
    out3, out2, ckpt = tmp_path / "out3", tmp_path / "out2", tmp_path / "ckpt"
    # Three workers stop cleanly after step 14: mid-epoch 1, a checkpoint at the stop.
    result, log = run_cluster(out3, ckpt, 3, "--every", "4", "--stop-step", "14")
    assert result.ok, result.message + "\n" + log[-4000:]
    saved = ResumableCheckpoint(ckpt).latest()
    assert (saved["step"], saved["epoch"], saved["batch"]) == (14, 1, 4)
    assert saved["num_replicas"] == 3 and saved["batch_sizes"] == [11, 11, 10]
    # Relaunched on two workers (the third VM did not come back).
    result, log = run_cluster(out2, ckpt, 2, "--every", "4")
    assert result.ok, result.message + "\n" + log[-4000:]
    outputs = outputs_of(out2, 2)
    ref = reference_weights()
    for weights, info in outputs:
        assert info["first_step"] == 14
        assert info["num_replicas"] == 2
        assert info["restored_sizes"] == [16, 16]
        assert sum(info["batch_sizes"]) == BATCH and len(info["batch_sizes"]) == 2
        assert max_diff(weights_of(weights, len(ref)), ref) <= 1e-5
    ids = np.sort(np.concatenate([w["ids"] for w, _ in outputs]))
    np.testing.assert_array_equal(
        ids, np.sort(ids_of_batches([(4, STEPS_PER_EPOCH), (0, STEPS_PER_EPOCH)])))
    assert "resuming with 2" in log


# ---------------------------------------------------------------------- one process -------
def _model_under(strategy, steps_per_execution=1):
    with strategy.scope():
        return resume_train.build(steps_per_execution=steps_per_execution)


def _data():
    x, y = mw_train.data(N)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


class StopAt(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step, self.count = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1
        if self.count == self.step:
            self.model.stop_training = True


@pytest.mark.parametrize("spe", [1, 3])
def test_in_process_stop_and_resume_equals_one_device(tmp_path, cpus, spe):
    # steps_per_execution=3: calls end at steps 3, 6, 9, 10 of each 10-step epoch; the 5th
    # call ends at step 13, as the 13th does with 1.
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model = _model_under(strategy, spe)
    ckpt = ResumableCheckpoint(tmp_path, save_every_steps=3, keep=3)
    assert ckpt.restore(model) == 0 and ckpt.restored == {}
    model.fit(_data(), epochs=EPOCHS, verbose=0, callbacks=[ckpt, StopAt(13 if spe == 1 else 5)])
    # Stopped early mid-epoch: the epoch-end checkpoint records the partial epoch.
    latest = ckpt.latest()
    assert (latest["step"], latest["epoch"], latest["batch"]) == (13, 1, 3)
    names = recovery.list_checkpoints(str(tmp_path))
    assert len(names) == 3 and names[-1] == recovery.checkpoint_name(13, 1, 3)

    # A fresh process' view: new strategy (3 replicas: re-split), new model, restore, fit.
    strategy2 = hb.HeteroMirroredStrategy(cpus[:3])
    model2 = _model_under(strategy2, spe)
    ckpt2 = ResumableCheckpoint(tmp_path, save_every_steps=3, keep=3)
    initial_epoch = ckpt2.restore(model2)
    assert initial_epoch == 1
    assert strategy2.steps_trained == 13 and strategy2.batch_sizes == (11, 11, 10)
    model2.fit(_data(), epochs=EPOCHS, initial_epoch=initial_epoch, verbose=0, callbacks=[ckpt2])
    assert strategy2.steps_trained == EPOCHS * STEPS_PER_EPOCH
    assert max_diff(model2.get_weights(), reference_weights()) <= 1e-5
    # The optimizer state came back too (momentum buffers, iterations).
    assert int(model2.optimizer.iterations.numpy()) == EPOCHS * STEPS_PER_EPOCH


def test_half_written_checkpoint_without_pointer_update_is_ignored(tmp_path, cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:1])
    model = _model_under(strategy)
    ckpt = ResumableCheckpoint(tmp_path, save_every_steps=5)
    ckpt.restore(model)
    model.fit(_data(), epochs=1, verbose=0, callbacks=[ckpt])
    assert ckpt.latest()["step"] == STEPS_PER_EPOCH
    # A newer checkpoint renamed into place whose pointer update never happened (crash), a
    # newer one still in its temp dir, and a stale pointer temp file.
    newer = tmp_path / recovery.checkpoint_name(99, 9, 0)
    newer.mkdir()
    (newer / recovery.META).write_text(json.dumps({"format": "garbage"}))
    (tmp_path / ".tmp-step-000000100.x").mkdir()
    (tmp_path / ".tmp-pointer.x").write_text("{")
    assert ckpt.latest()["step"] == STEPS_PER_EPOCH
    model2 = _model_under(hb.HeteroMirroredStrategy(cpus[:1]))
    assert ResumableCheckpoint(tmp_path).restore(model2) == 1
    assert max_diff(model2.get_weights(), model.get_weights()) == 0.0
    # The next write replaces the stray directory of the same name and cleans the temp files.
    recovery.write_checkpoint(str(tmp_path), {"format": recovery._FORMAT, "step": 99,
                                              "epoch": 9, "batch": 0}, {})
    recovery.prune(str(tmp_path), keep=5)
    assert json.loads((newer / recovery.META).read_text())["format"] == recovery._FORMAT
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_pointer_naming_a_missing_checkpoint_fails_loudly(tmp_path):
    (tmp_path / recovery.POINTER).write_text(json.dumps({"latest": "step-000000001.x"}))
    with pytest.raises(ValueError, match="missing or unreadable"):
        ResumableCheckpoint(tmp_path).latest()


def test_keep_prunes_to_the_newest_checkpoints(tmp_path):
    for step in range(1, 6):
        recovery.write_checkpoint(str(tmp_path), {"format": recovery._FORMAT, "step": step,
                                                  "epoch": 0, "batch": step}, {})
        recovery.prune(str(tmp_path), keep=2, protect=recovery.checkpoint_name(step, 0, step))
    assert recovery.list_checkpoints(str(tmp_path)) == [
        recovery.checkpoint_name(4, 0, 4), recovery.checkpoint_name(5, 0, 5)]
    assert json.loads((tmp_path / recovery.POINTER).read_text())["step"] == 5


def test_fit_without_restore_on_an_existing_checkpoint_is_an_error(tmp_path, cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:1])
    model = _model_under(strategy)
    ckpt = ResumableCheckpoint(tmp_path, save_every_steps=100)
    model.fit(_data(), epochs=1, verbose=0, callbacks=[ckpt])  # no checkpoint yet: fine
    model.fit(_data(), epochs=1, verbose=0, callbacks=[ckpt])  # its own checkpoint: fine
    with pytest.raises(ValueError, match="restore\\(\\) was not called"):
        model.fit(_data(), epochs=1, verbose=0, callbacks=[ResumableCheckpoint(tmp_path)])


def test_fit_at_another_epoch_than_the_checkpoint_is_an_error(tmp_path, cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:1])
    model = _model_under(strategy)
    ckpt = ResumableCheckpoint(tmp_path)
    model.fit(_data(), epochs=1, verbose=0, callbacks=[ckpt])
    ckpt2 = ResumableCheckpoint(tmp_path)
    assert ckpt2.restore(model) == 1
    with pytest.raises(ValueError, match="initial_epoch=ckpt.restore"):
        model.fit(_data(), epochs=2, verbose=0, callbacks=[ckpt2])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(directory=""), ValueError, "directory"),
        (dict(directory=None), ValueError, "directory"),
        (dict(directory="d", save_every_steps=0), ValueError, "save_every_steps=0"),
        (dict(directory="d", save_every_steps=2.5), ValueError, "save_every_steps=2.5"),
        (dict(directory="d", save_every_steps=True), ValueError, "save_every_steps=True"),
        (dict(directory="d", keep=0), ValueError, "keep=0"),
        (dict(directory="d", dynamic_batching="yes"), TypeError, "dynamic_batching"),
    ],
)
def test_bad_arguments_fail_early_with_the_value_and_the_fix(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        ResumableCheckpoint(**kwargs)
    assert "Fix" in str(info.value) or "e.g." in str(info.value)


def test_restore_needs_a_tf_hetbatch_strategy(tmp_path):
    model = resume_train.build()
    with pytest.raises(ValueError, match="tf_hetbatch strategy"):
        ResumableCheckpoint(tmp_path).restore(model)
