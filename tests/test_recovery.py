"""ResumableCheckpoint: TensorFlow checkpoints from the chief, exact mid-epoch resume, preemption
notices that redo no step, another layout (fewer replicas), plain-Keras restore, the earlier
format.

Multi-process tests run real workers through the launcher (tests/workers/resume_train.py) and
compare with one device trained on the same global batches in this process.
"""

import hashlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
from helpers import delete_checkpoint_index, run_once, truncate_checkpoint
from tf_hetbatch.training import legacy_checkpoint
from tf_hetbatch.training.recovery import ResumableCheckpoint
from tf_hetbatch.launch import launch

WORKER = os.path.join(os.path.dirname(__file__), "workers", "resume_train.py")
sys.path.insert(0, os.path.dirname(WORKER))
import mw_train  # noqa: E402
import resume_train  # noqa: E402

N, BATCH, EPOCHS = 320, 32, 3
STEPS_PER_EPOCH = N // BATCH
TOTAL_STEPS = EPOCHS * STEPS_PER_EPOCH


# ---------------------------------------------------------------------- helpers -----------
def run_cluster(out, ckpt, num_workers, *args, max_restarts=0, timeout=150, preempt=None):
    log = io.StringIO()
    result = launch(  # the default grace, as a user's launch
        [WORKER, "--out", str(out), "--ckpt", str(ckpt), *args], num_workers, threads=1,
        max_restarts=max_restarts, timeout=timeout, stdout=log, stderr=log,
        handle_signals=False, preempt=preempt,
    )
    return result, log.getvalue()


def outputs_of(out, num_workers):
    outputs = []
    for i in range(num_workers):
        weights = np.load(os.path.join(out, f"worker{i}.npz"))
        with open(os.path.join(out, f"worker{i}.json")) as f:
            outputs.append((weights, json.load(f)))
    return outputs


def attempt_of(out, worker, attempt):
    """(record, ids) a worker wrote for one launch attempt (ids None if it was SIGKILLed)."""
    with open(os.path.join(out, f"worker{worker}.attempt{attempt}.json")) as f:
        record = json.load(f)
    path = os.path.join(out, f"worker{worker}.attempt{attempt}.npz")
    return record, (np.load(path)["ids"] if os.path.exists(path) else None)


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


def ids_of_steps(first, end):
    """Sample ids of global steps [first, end) (unshuffled data, BATCH per step)."""
    return np.concatenate([np.arange((s % STEPS_PER_EPOCH) * BATCH,
                                     (s % STEPS_PER_EPOCH + 1) * BATCH)
                           for s in range(first, end)])


def checkpoints_in(directory):
    state = tf.train.get_checkpoint_state(str(directory))
    return [os.path.basename(p) for p in state.all_model_checkpoint_paths] if state else []


# ---------------------------------------------------------------------- multi-process -----
@pytest.mark.cluster
def test_notice_saves_at_one_step_and_a_kill_loses_only_steps_since_the_last_save(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    # Attempt 0: worker 1 (not the chief) gets a SIGTERM after step 14: every worker saves at
    # one agreed step and exits with RESTART_EXIT_CODE; the launcher restarts the cluster
    # without using up max_restarts. Attempt 1: worker 1 dies (SIGKILL) after step 22, a
    # failure: the relaunch (max_restarts=1) resumes from the periodic save at step 20.
    result, log = run_cluster(
        out, ckpt, 2, "--every", "4", "--dynamic", "--term-worker", "1", "--term-step", "14",
        "--die-worker", "1", "--die-attempt", "1", "--die-step", "22", max_restarts=1)
    assert result.ok, result.message + "\n" + log[-4000:]
    assert result.attempts == 3
    # The notice: every worker saved at the same step soon after it, and the relaunch started
    # exactly there: no step trained twice, none lost.
    first = [attempt_of(out, i, 0) for i in range(2)]
    saved = {record["preempted_at"] for record, _ in first}
    assert len(saved) == 1 and None not in saved
    saved = saved.pop()
    assert 14 < saved <= 16
    np.testing.assert_array_equal(np.sort(np.concatenate([ids for _, ids in first])),
                                  np.sort(ids_of_steps(0, saved)))
    for i in range(2):
        resumed, _ = attempt_of(out, i, 1)
        assert resumed["first_step"] == saved
    # The kill: the relaunch redid the steps since the last periodic save (20) only.
    outputs = outputs_of(out, 2)
    ref = reference_weights()
    for weights, info in outputs:
        assert info["attempt"] == 2
        assert info["restored"]["step"] == 20
        assert (info["restored"]["epoch"], info["restored"]["batch"]) == (2, 0)
        assert info["first_step"] == 20
        assert info["steps"] == TOTAL_STEPS - 20 and info["steps_trained"] == TOTAL_STEPS
        # The saved split and DynamicBatching state came back.
        assert info["restored_sizes"] == info["restored"]["batch_sizes"]
        assert sum(info["restored_sizes"]) == BATCH
        assert info["restored_dynamic_sizes"] == info["restored"]["dynamic_batching"][
            "batch_sizes"]
        # The final weights equal one device trained uninterrupted on the same batches.
        assert max_diff(weights_of(weights, len(ref)), ref) <= 1e-5
    for a, b in zip(weights_of(outputs[0][0], len(ref)), weights_of(outputs[1][0], len(ref))):
        np.testing.assert_array_equal(a, b)
    ids = np.sort(np.concatenate([w["ids"] for w, _ in outputs]))
    np.testing.assert_array_equal(ids, np.sort(ids_of_steps(20, TOTAL_STEPS)))
    # keep=2: the two newest checkpoints remain; the newest is the end of the run.
    assert checkpoints_in(ckpt) == ["ckpt-28", "ckpt-30"]
    final = ResumableCheckpoint(ckpt).latest()
    assert (final["step"], final["epoch"], final["batch"]) == (30, 3, 0)


@pytest.mark.cluster
def test_resume_on_another_layout_resplits_the_global_batch(tmp_path):
    out3, out2, ckpt = tmp_path / "out3", tmp_path / "out2", tmp_path / "ckpt"
    # Two workers hosting 1 and 2 replicas stop cleanly after step 14: mid-epoch 1, a
    # checkpoint at the stop.
    result, log = run_cluster(out3, ckpt, 2, "--every", "4", "--stop-step", "14",
                              "--layout", "1,2")
    assert result.ok, result.message + "\n" + log[-4000:]
    saved = ResumableCheckpoint(ckpt).latest()
    assert (saved["step"], saved["epoch"], saved["batch"]) == (14, 1, 4)
    assert saved["num_parts"] == 3 and saved["batch_sizes"] == [11, 11, 10]
    # Relaunched with one replica each (worker 1 lost a device): 3 replicas -> 2.
    result, log = run_cluster(out2, ckpt, 2, "--every", "4", "--layout", "1,1")
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
    np.testing.assert_array_equal(ids, np.sort(ids_of_steps(14, TOTAL_STEPS)))


@pytest.fixture(scope="module")
def stopped_at_step_14(tmp_path_factory):
    """The checkpoints of 2 workers stopped after step 14: ckpt-12 and ckpt-14 (epoch 1)."""

    def produce(base):
        result, log = run_cluster(base / "out", base / "ckpt", 2, "--every", "4",
                                  "--stop-step", "14")
        assert result.ok, result.message + "\n" + log[-4000:]

    base, _ = run_once(tmp_path_factory, "stopped_at_step_14", produce)
    assert checkpoints_in(base / "ckpt") == ["ckpt-12", "ckpt-14"]
    return base / "ckpt"


@pytest.mark.parametrize("damage, reason", [
    (truncate_checkpoint, "IndexError: Read less bytes than requested"),
    (delete_checkpoint_index, "its index file ckpt-14.index is missing"),
], ids=["truncated data", "deleted index"])
@pytest.mark.cluster
def test_workers_skip_a_damaged_newest_checkpoint_and_resume_exactly(tmp_path, stopped_at_step_14,
                                                                     damage, reason):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(stopped_at_step_14, ckpt)
    damage(str(ckpt / "ckpt-14"))
    result, log = run_cluster(tmp_path / "out", ckpt, 2, "--every", "4")
    assert result.ok, result.message + "\n" + log[-4000:]
    # Every worker read it the same way: one WARNING in the cluster, the chief's.
    warnings = [line for line in log.splitlines() if "Checkpoint ckpt-14 in" in line]
    assert len(warnings) == 1 and warnings[0].startswith("[worker 0] ") and reason in warnings[0]
    # Both resumed from the previous checkpoint and trained every later step once, exactly.
    outputs = outputs_of(tmp_path / "out", 2)
    ref = reference_weights()
    for weights, info in outputs:
        assert (info["restored"]["step"], info["restored"]["epoch"],
                info["restored"]["batch"]) == (12, 1, 2)
        assert info["first_step"] == 12
        assert info["steps"] == TOTAL_STEPS - 12 and info["steps_trained"] == TOTAL_STEPS
        assert max_diff(weights_of(weights, len(ref)), ref) <= 1e-5
    ids = np.sort(np.concatenate([w["ids"] for w, _ in outputs]))
    np.testing.assert_array_equal(ids, np.sort(ids_of_steps(12, TOTAL_STEPS)))


@pytest.mark.cluster
def test_a_checkpoint_one_worker_cannot_read_is_skipped_by_every_worker(tmp_path,
                                                                        stopped_at_step_14):
    # A directory per worker, the same files but worker 1's newest cut short: as when one
    # worker's read of shared storage fails. The workers agree to resume from ckpt-12.
    for i in range(2):
        shutil.copytree(stopped_at_step_14, tmp_path / f"ckpt{i}")
    truncate_checkpoint(str(tmp_path / "ckpt1" / "ckpt-14"))
    result, log = run_cluster(tmp_path / "out", tmp_path / "ckpt{worker}", 2, "--every", "4")
    assert result.ok, result.message + "\n" + log[-4000:]
    warnings = [line for line in log.splitlines() if "Checkpoint ckpt-14 in" in line]
    assert len(warnings) == 1 and warnings[0].startswith("[worker 1] ")
    outputs = outputs_of(tmp_path / "out", 2)
    ref = reference_weights()
    for weights, info in outputs:
        assert info["restored"]["step"] == info["first_step"] == 12
        assert max_diff(weights_of(weights, len(ref)), ref) <= 1e-5


@pytest.mark.cluster
def test_workers_with_no_readable_checkpoint_stop_with_the_named_error(tmp_path,
                                                                       stopped_at_step_14):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(stopped_at_step_14, ckpt)
    truncate_checkpoint(str(ckpt / "ckpt-14"))
    delete_checkpoint_index(str(ckpt / "ckpt-12"))
    before = _tree_digest(ckpt)
    result, log = run_cluster(tmp_path / "out", ckpt, 2, "--every", "4")
    assert not result.ok
    for i in range(2):
        errors = [line for line in log.splitlines()
                  if line.startswith(f"[worker {i}] ValueError: No checkpoint in")]
        assert len(errors) == 1, log[-4000:]
        assert str(ckpt) in errors[0] and "Fix:" in errors[0]
        assert "ckpt-14 (IndexError: Read less bytes than requested)" in errors[0]
        assert "ckpt-12 (its index file ckpt-12.index is missing)" in errors[0]
    # Nothing started afresh over them: no step trained, no file written.
    assert _tree_digest(ckpt) == before
    assert not os.path.exists(tmp_path / "out" / "worker0.attempt0.json")


# ---------------------------------------------------------------------- one process -------
def _model_under(strategy, steps_per_execution=1):
    with strategy.scope():
        return resume_train.build(steps_per_execution=steps_per_execution)


def _data():
    x, y = mw_train.data(N)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


class At(keras.callbacks.Callback):
    """Calls `action(self)` after the `call`-th on_train_batch_end."""

    def __init__(self, call, action):
        super().__init__()
        self.call, self.action, self.count = call, action, 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1
        if self.count == self.call:
            self.action(self)


def stop_at(call):
    return At(call, lambda cb: setattr(cb.model, "stop_training", True))


@pytest.mark.parametrize("spe, where", [(3, "local"), (1, "ram")])
def test_in_process_stop_and_resume_equals_one_device(tmp_path, cpus, spe, where):
    # steps_per_execution=3: calls end at steps 3, 6, 9, 10 of each 10-step epoch; the 5th
    # call ends at step 13, as the 13th does with 1. ram://: any tf.io.gfile file system.
    directory = str(tmp_path) if where == "local" else f"ram://{tmp_path.name}/{spe}"
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model = _model_under(strategy, spe)
    ckpt = ResumableCheckpoint(directory, save_every_steps=3, keep=3)
    assert ckpt.restore(model) == 0 and ckpt.restored == {}
    model.fit(_data(), epochs=EPOCHS, verbose=0, callbacks=[ckpt, stop_at(13 if spe == 1 else 5)])
    # Stopped early mid-epoch: the epoch-end checkpoint records the partial epoch.
    latest = ckpt.latest()
    assert (latest["step"], latest["epoch"], latest["batch"]) == (13, 1, 3)
    # keep=3: the three newest checkpoints, as TensorFlow's state file and the files say.
    names = checkpoints_in(directory)
    assert len(names) == 3 and names[-1] == "ckpt-13"
    assert sorted(n for n in tf.io.gfile.listdir(directory) if n.endswith(".index")) == \
        sorted(n + ".index" for n in names)

    # A fresh process' view: new strategy (3 replicas: re-split), new model, restore, fit.
    strategy2 = hb.HeteroMirroredStrategy(cpus[:3])
    model2 = _model_under(strategy2, spe)
    ckpt2 = ResumableCheckpoint(directory, save_every_steps=3, keep=3)
    initial_epoch = ckpt2.restore(model2)
    assert initial_epoch == 1
    assert strategy2.steps_trained == 13 and strategy2.batch_sizes == (11, 11, 10)
    model2.fit(_data(), epochs=EPOCHS, initial_epoch=initial_epoch, verbose=0, callbacks=[ckpt2])
    assert strategy2.steps_trained == TOTAL_STEPS
    assert max_diff(model2.get_weights(), reference_weights()) <= 1e-5
    # The optimizer state came back too (momentum buffers, iterations).
    assert int(model2.optimizer.iterations.numpy()) == TOTAL_STEPS


def test_request_preemption_saves_the_step_and_exits_with_the_restart_code(tmp_path, cpus):
    handler = signal.getsignal(signal.SIGTERM)
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model = _model_under(strategy)
    ckpt = ResumableCheckpoint(tmp_path, save_every_steps=100)
    ckpt.restore(model)
    with pytest.raises(SystemExit) as exit_info:
        model.fit(_data(), epochs=EPOCHS, verbose=0,
                  callbacks=[ckpt, At(7, lambda cb: ckpt.request_preemption())])
    assert exit_info.value.code == hb.RESTART_EXIT_CODE
    # One host: the save is at the next step boundary; no periodic save was due before it.
    assert ckpt.preempted_at == strategy.steps_trained == 8
    latest = ckpt.latest()
    assert (latest["step"], latest["epoch"], latest["batch"]) == (8, 0, 8)
    assert signal.getsignal(signal.SIGTERM) == handler  # fit's handler is gone again
    strategy2 = hb.HeteroMirroredStrategy(cpus[:2])
    model2 = _model_under(strategy2)
    ckpt2 = ResumableCheckpoint(tmp_path, save_every_steps=100, on_notice="stop")
    model2.fit(_data(), epochs=EPOCHS, initial_epoch=ckpt2.restore(model2), verbose=0,
               callbacks=[ckpt2])
    assert ckpt2.preempted_at is None
    assert max_diff(model2.get_weights(), reference_weights()) <= 1e-5


def test_a_notice_at_an_epochs_last_step_saves_that_epochs_end(tmp_path, cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:1])
    model = _model_under(strategy)
    ckpt = ResumableCheckpoint(tmp_path, on_notice="stop")
    ckpt.restore(model)
    history = model.fit(_data(), epochs=EPOCHS, verbose=0,
                        callbacks=[ckpt, At(STEPS_PER_EPOCH - 1,
                                            lambda cb: ckpt.request_preemption())])
    assert ckpt.preempted_at == STEPS_PER_EPOCH
    assert len(history.history["loss"]) == 1
    latest = ckpt.latest()
    assert (latest["step"], latest["epoch"], latest["batch"]) == (STEPS_PER_EPOCH, 1, 0)


_PLAIN_KERAS = r"""
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import keras, numpy as np, tensorflow as tf
model = keras.Sequential([keras.Input((8,)), keras.layers.Lambda(lambda t: t),
                          keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
tf.train.Checkpoint(model=model).restore(tf.train.latest_checkpoint(sys.argv[1])).expect_partial()
assert not any(m.startswith("tf_hetbatch") for m in sys.modules)
np.savez(sys.argv[2], *model.get_weights())
"""


def test_weights_load_into_a_plain_keras_model_without_tf_hetbatch(tmp_path, cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model = _model_under(strategy)
    ckpt = ResumableCheckpoint(tmp_path / "ckpt", save_every_steps=100)
    model.fit(_data(), epochs=1, verbose=0, initial_epoch=ckpt.restore(model), callbacks=[ckpt])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _PLAIN_KERAS, str(tmp_path / "ckpt"),
                           str(tmp_path / "w.npz")], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = np.load(tmp_path / "w.npz")
    for i, w in enumerate(model.get_weights()):
        np.testing.assert_array_equal(loaded[f"arr_{i}"], w)


def _write_legacy_directory(directory, model, step, epoch, batch, batch_sizes):
    """A directory of the earlier format, as its writer left it (pointer written last)."""
    name = f"step-{step:09d}.epoch-{epoch:04d}.batch-{batch:05d}"
    os.makedirs(os.path.join(directory, name))
    weights = [v.numpy() for v in legacy_checkpoint.model_variables(model)]
    opt = [v.numpy() for v in legacy_checkpoint.optimizer_variables(model)]
    arrays = {f"w{i}": w for i, w in enumerate(weights)}
    arrays.update({f"o{i}": o for i, o in enumerate(opt)})
    np.savez(os.path.join(directory, name, "variables.npz"), **arrays)
    meta = {"format": legacy_checkpoint.FORMAT, "step": step, "epoch": epoch, "batch": batch,
            "batch_sizes": batch_sizes, "num_replicas": len(batch_sizes),
            "num_weights": len(weights), "num_optimizer_variables": len(opt),
            "dynamic_batching": None}
    with open(os.path.join(directory, name, "meta.json"), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(directory, "checkpoint.json"), "w") as f:
        json.dump({"format": legacy_checkpoint.FORMAT, "latest": name, "step": step}, f)
    return name


def _tree_digest(directory):
    digest = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                digest[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return digest


def test_a_directory_of_the_earlier_format_resumes_and_its_files_stay(tmp_path, cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model = _model_under(strategy)
    model.fit(_data(), epochs=EPOCHS, verbose=0, callbacks=[stop_at(13)])
    _write_legacy_directory(tmp_path, model, 13, 1, 3, [16, 16])
    before = _tree_digest(tmp_path)
    strategy2 = hb.HeteroMirroredStrategy(cpus[:2])
    model2 = _model_under(strategy2)
    ckpt = ResumableCheckpoint(tmp_path, save_every_steps=5)
    assert ckpt.latest()["step"] == 13
    model2.fit(_data(), epochs=EPOCHS, initial_epoch=ckpt.restore(model2), verbose=0,
               callbacks=[ckpt])
    assert strategy2.steps_trained == TOTAL_STEPS
    assert max_diff(model2.get_weights(), reference_weights()) <= 1e-5
    after = _tree_digest(tmp_path)
    assert {k: after[k] for k in before} == before  # nothing of the earlier files changed
    assert ckpt.latest()["step"] == TOTAL_STEPS and "ckpt-30" in checkpoints_in(tmp_path)
    # A later restore takes the newer TensorFlow checkpoint, not the earlier format's.
    model3 = _model_under(hb.HeteroMirroredStrategy(cpus[:2]))
    assert ResumableCheckpoint(tmp_path).restore(model3) == EPOCHS


def test_an_earlier_format_checkpoint_that_does_not_match_is_refused_with_the_fix(tmp_path,
                                                                                  cpus):
    strategy = hb.HeteroMirroredStrategy(cpus[:1])
    model = _model_under(strategy)
    model.fit(_data(), epochs=1, verbose=0)
    name = _write_legacy_directory(tmp_path, model, 10, 1, 0, [32])
    meta_path = tmp_path / name / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(dict(meta, num_weights=meta["num_weights"] - 1)))
    with pytest.raises(ValueError, match="Fix: build and compile the model"):
        ResumableCheckpoint(tmp_path).restore(_model_under(hb.HeteroMirroredStrategy(cpus[:1])))
    (tmp_path / "checkpoint.json").write_text("{")
    with pytest.raises(ValueError, match="unreadable.*Fix"):
        ResumableCheckpoint(tmp_path).latest()


def test_the_state_file_decides_which_checkpoints_exist(tmp_path, cpus, caplog):
    model = _model_under(hb.HeteroMirroredStrategy(cpus[:1]))
    ckpt = ResumableCheckpoint(tmp_path, save_every_steps=4)
    model.fit(_data(), epochs=1, verbose=0, initial_epoch=ckpt.restore(model), callbacks=[ckpt])
    assert checkpoints_in(tmp_path) == ["ckpt-8", "ckpt-10"]
    # A newer checkpoint whose files were written but not the state file (a crash between):
    # ignored, the state file's newest is used.
    tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt-99"))
    assert ckpt.latest()["step"] == 10
    # The newest the state file names, with its files gone: skipped with a warning.
    for name in os.listdir(tmp_path):
        if name.startswith("ckpt-10."):
            os.remove(tmp_path / name)
    assert ResumableCheckpoint(tmp_path).latest()["step"] == 8
    assert "Checkpoint ckpt-10 in" in caplog.text and "is missing" in caplog.text


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
        (dict(directory="d", on_notice="quit"), ValueError, "on_notice='quit'"),
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


def test_a_local_notice_is_due_at_the_next_step_boundary_and_restores_the_handler():
    from tf_hetbatch.training.preemption import PreemptionNotice

    handler = signal.getsignal(signal.SIGTERM)
    notice = PreemptionNotice(None)
    assert not notice.multi_worker
    notice.start()
    try:
        assert signal.getsignal(signal.SIGTERM) != handler
        assert not notice.due(3) and notice.agreed_step is None
        notice.request()
        assert notice.requested and notice.due(5) and notice.agreed_step == 5
        assert notice.due(6)  # stays due until acted on
    finally:
        notice.close()
    assert signal.getsignal(signal.SIGTERM) == handler


def test_only_a_synchronous_cluster_agrees_on_the_step():
    from tf_hetbatch.training.preemption import PreemptionNotice

    def resolver(jobs, task_type="worker", task_id=1):
        spec = tf.train.ClusterSpec({job: [f"127.0.0.1:{1000 + i}" for i in range(n)]
                                     for job, n in jobs.items()})
        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            spec, task_type=task_type, task_id=task_id)

    assert PreemptionNotice(resolver({"worker": 2})).multi_worker
    assert PreemptionNotice(resolver({"chief": 1, "worker": 1}, task_id=0)).multi_worker
    assert not PreemptionNotice(resolver({"worker": 1}, task_id=0)).multi_worker
    assert not PreemptionNotice(resolver({"chief": 1, "ps": 1, "worker": 2}, "chief", 0)) \
        .multi_worker


@pytest.mark.parametrize("reshuffle", [True, False])
def test_resuming_a_later_epoch_of_data_that_reshuffles_says_its_order_differs(
        tmp_path, cpus, caplog, reshuffle):
    """A seeded shuffle that reshuffles each epoch (tf.data's default) draws epoch e's order
    as the process' e-th draw: a new process resuming epoch 1 trains it in another order than
    the interrupted run would have. Said once; nothing is said for an order kept every epoch."""
    def data():
        return _data().unbatch().shuffle(N, seed=3, reshuffle_each_iteration=reshuffle) \
            .batch(BATCH)

    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model = _model_under(strategy)
    ckpt = ResumableCheckpoint(str(tmp_path), save_every_steps=3)
    ckpt.restore(model)
    model.fit(data(), epochs=EPOCHS, verbose=0, callbacks=[ckpt, stop_at(13)])
    strategy2 = hb.HeteroMirroredStrategy(cpus[:2])
    model2 = _model_under(strategy2)
    ckpt2 = ResumableCheckpoint(str(tmp_path), save_every_steps=3)
    with caplog.at_level(logging.WARNING, logger="tf_hetbatch"):
        model2.fit(data(), epochs=EPOCHS, initial_epoch=ckpt2.restore(model2), verbose=0,
                   callbacks=[ckpt2])
    said = [r for r in caplog.records if "reshuffles each epoch" in r.getMessage()]
    assert len(said) == (1 if reshuffle else 0)
    if reshuffle:
        assert "reshuffle_each_iteration=False" in said[0].getMessage()


_FAILED_FIT_THEN_SIGTERM = """
import os, signal, sys, time
sys.path.insert(0, {workers!r})
import worker_start  # noqa: F401
import keras, numpy as np
import tf_hetbatch as hb

class Fails(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            raise RuntimeError("a step failed")

strategy = hb.HeteroMirroredStrategy(["/cpu:0"])
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
x = np.zeros((64, 4), "float32")
try:
    model.fit(x, x[:, :1], batch_size=8, verbose=0,
              callbacks=[hb.ResumableCheckpoint({directory!r}), Fails()])
except RuntimeError:
    print("caught", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(10)
print("survived", flush=True)
"""


def test_a_sigterm_after_a_fit_that_raised_ends_the_process(tmp_path):
    """Keras calls `on_train_end` only when `fit` returns, so a fit that raised left the notice's
    SIGTERM handler installed and a process that caught the error ignored every later SIGTERM.
    Now a SIGTERM outside the fit that started the notice goes to the previous handler (the
    default: the process ends)."""
    script = tmp_path / "failed_fit.py"
    script.write_text(_FAILED_FIT_THEN_SIGTERM.format(
        workers=os.path.dirname(WORKER), directory=str(tmp_path / "ckpt")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert "caught" in done.stdout, done.stderr[-2000:]
    assert "survived" not in done.stdout
    assert done.returncode == -signal.SIGTERM
