"""Which checkpoint a run resumes from (one process): a damaged newest checkpoint is skipped,
none readable is a named error that restores nothing, and the run position and the earlier
formats are read by one record and one reader.

Workers that agree on the choice are in test_recovery.py (2 workers) and test_async.py.
"""

import json
import logging
import os

import numpy as np
import pytest
import tensorflow as tf

import tf_hetbatch as hb
import test_recovery as tr
from helpers import (delete_checkpoint_data, delete_checkpoint_index, flip_a_checkpoint_byte,
                     truncate_checkpoint)
from tf_hetbatch.training import checkpoint_choice, run_checkpoint
from tf_hetbatch.training.recovery import ResumableCheckpoint
from tf_hetbatch.training.run_checkpoint import RunPosition

CHOICE_LOGGER = "tf_hetbatch.training.checkpoint_choice"

# Positions as today's writers save them (ResumableCheckpoint; AsyncTrainer, which wrote an
# empty split as []): the on-disk form that must keep loading.
TODAY_FIT = {"format": "tf_hetbatch.run/2", "trainer": "fit", "step": 13, "epoch": 1,
             "batch": 3, "batch_sizes": [16, 16], "num_parts": 2, "dynamic_batching": None}
TODAY_ASYNC = {"format": "tf_hetbatch.run/2", "trainer": "async", "step": 25, "epoch": 0,
               "batch": 25, "batch_sizes": [], "num_parts": 2,
               "dynamic_batching": [{"format": "x"}]}


# ---------------------------------------------------------------------- damage ------------
DAMAGE = {"truncated data": (truncate_checkpoint, "IndexError: Read less bytes than requested"),
          "deleted index": (delete_checkpoint_index, "its index file ckpt-10.index is missing"),
          "deleted data": (delete_checkpoint_data, "No such file"),
          "flipped byte": (flip_a_checkpoint_byte, "Checksum does not match")}


def one_epoch_of_checkpoints(directory, cpus):
    """ckpt-8 (epoch 0, batch 8) and ckpt-10 (epoch 1, batch 0) of one replica."""
    model = tr._model_under(hb.HeteroMirroredStrategy(cpus[:1]))
    ckpt = ResumableCheckpoint(directory, save_every_steps=4)
    model.fit(tr._data(), epochs=1, verbose=0, initial_epoch=ckpt.restore(model),
              callbacks=[ckpt])
    assert tr.checkpoints_in(directory) == ["ckpt-8", "ckpt-10"]


def skips(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == CHOICE_LOGGER and r.levelno == logging.WARNING]


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_resumes_exactly(
        tmp_path, cpus, caplog, damage):
    one_epoch_of_checkpoints(tmp_path, cpus)
    spoil, reason = DAMAGE[damage]
    spoil(str(tmp_path / "ckpt-10"))
    caplog.set_level(logging.WARNING, logger=CHOICE_LOGGER)
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model = tr._model_under(strategy)
    ckpt = ResumableCheckpoint(tmp_path, save_every_steps=4)
    initial_epoch = ckpt.restore(model)
    # One WARNING names the skipped checkpoint and why; the previous one is restored.
    [warning] = skips(caplog)
    assert "ckpt-10" in warning and reason in warning and str(tmp_path) in warning
    assert (ckpt.restored["step"], ckpt.restored["epoch"], ckpt.restored["batch"]) == (8, 0, 8)
    assert initial_epoch == 0 and strategy.steps_trained == 8
    model.fit(tr._data(), epochs=tr.EPOCHS, initial_epoch=initial_epoch, verbose=0,
              callbacks=[ckpt])
    assert strategy.steps_trained == tr.TOTAL_STEPS
    assert int(model.optimizer.iterations.numpy()) == tr.TOTAL_STEPS
    assert tr.max_diff(model.get_weights(), tr.reference_weights()) <= 1e-5


def test_no_readable_checkpoint_is_a_named_error_that_restores_nothing(tmp_path, cpus):
    one_epoch_of_checkpoints(tmp_path, cpus)
    truncate_checkpoint(str(tmp_path / "ckpt-10"))
    delete_checkpoint_index(str(tmp_path / "ckpt-8"))
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model = tr._model_under(strategy)
    before = [w.copy() for w in model.get_weights()]
    ckpt = ResumableCheckpoint(tmp_path)
    with pytest.raises(ValueError) as info:
        ckpt.restore(model)
    message = str(info.value)
    assert str(tmp_path) in message
    assert "ckpt-10 (IndexError: Read less bytes than requested)" in message
    assert "ckpt-8 (its index file ckpt-8.index is missing)" in message
    assert "Fix:" in message and "delete these checkpoints" in message
    assert "new, empty directory" in message
    # Nothing was restored, and a fit after the failed restore does not start afresh.
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert strategy.steps_trained == 0 and int(model.optimizer.iterations.numpy()) == 0
    with pytest.raises(ValueError, match="restore\\(\\) was not called"):
        model.fit(tr._data(), epochs=1, verbose=0, callbacks=[ckpt])
    with pytest.raises(ValueError, match="No checkpoint in"):
        ckpt.latest()


@pytest.mark.parametrize("state_file", ["missing", "unparsable"])
def test_a_lost_state_file_resumes_from_the_checkpoint_files(tmp_path, cpus, state_file):
    one_epoch_of_checkpoints(tmp_path, cpus)
    if state_file == "missing":
        os.remove(tmp_path / "checkpoint")
    else:
        (tmp_path / "checkpoint").write_text("model_checkpoint_path: ")
    assert ResumableCheckpoint(tmp_path).latest()["step"] == 10
    model = tr._model_under(hb.HeteroMirroredStrategy(cpus[:1]))
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        model.fit(tr._data(), epochs=1, verbose=0, callbacks=[ResumableCheckpoint(tmp_path)])


# ---------------------------------------------------------------------- the position ------
def test_the_run_position_reads_todays_dicts_and_writes_them_back():
    fit = RunPosition.from_dict(TODAY_FIT, "ckpt-13")
    assert fit == RunPosition("fit", 13, 1, 3, num_parts=2, batch_sizes=(16, 16))
    assert fit.to_dict() == TODAY_FIT
    asynchronous = RunPosition.from_dict(TODAY_ASYNC, "ckpt-25")
    assert asynchronous.batch_sizes is None and asynchronous.num_parts == 2
    assert asynchronous.dynamic_batching == [{"format": "x"}]
    assert RunPosition.from_dict(asynchronous.to_dict(), "x") == asynchronous
    bounded = dict(TODAY_FIT, micro_batch_limits=[None, 4])
    assert RunPosition.from_dict(bounded, "x").micro_batch_limits == (None, 4)
    assert RunPosition.from_dict(bounded, "x").to_dict() == bounded
    with pytest.raises(ValueError, match="ckpt-7 holds a malformed run position.*Fix"):
        RunPosition.from_dict({"trainer": "fit", "step": 7}, "ckpt-7")


class _Literal(tf.train.experimental.PythonState):
    """A position saved as given text (not through RunPosition)."""

    def __init__(self, text):
        self.text = text

    def serialize(self):
        return self.text

    def deserialize(self, string_value):
        self.text = string_value


def test_a_checkpoint_with_a_position_dict_of_todays_format_resumes_exactly(tmp_path, cpus):
    model = tr._model_under(hb.HeteroMirroredStrategy(cpus[:2]))
    model.fit(tr._data(), epochs=tr.EPOCHS, verbose=0, callbacks=[tr.stop_at(13)])
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                                     tf_hetbatch=_Literal(json.dumps(TODAY_FIT, sort_keys=True)))
    tf.train.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=2,
                               checkpoint_name="ckpt").save(checkpoint_number=13)
    strategy = hb.HeteroMirroredStrategy(cpus[:2])
    model2 = tr._model_under(strategy)
    ckpt = ResumableCheckpoint(tmp_path, save_every_steps=5)
    initial_epoch = ckpt.restore(model2)
    assert initial_epoch == 1 and strategy.steps_trained == 13
    assert strategy.batch_sizes == (16, 16)
    assert {k: ckpt.restored[k] for k in TODAY_FIT} == TODAY_FIT
    model2.fit(tr._data(), epochs=tr.EPOCHS, initial_epoch=initial_epoch, verbose=0,
               callbacks=[ckpt])
    assert tr.max_diff(model2.get_weights(), tr.reference_weights()) <= 1e-5


def test_the_earlier_async_format_is_read_by_the_one_reader(tmp_path):
    # AsyncTrainer's earlier format: ckpt-<update> of model and optimizer only, and the
    # newest one's position in hetbatch_async.json beside them.
    model = tr.resume_train.build()
    model.fit(tr._data(), epochs=1, verbose=0)
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=model.optimizer), str(tmp_path),
        max_to_keep=2)
    manager.save(checkpoint_number=20)
    path = manager.save(checkpoint_number=40)
    meta = {"checkpoint": path, "step": 40, "epoch": 1, "batch": 0, "batch_sizes": [24, 8],
            "dynamic_batching": [{"format": "x"}]}
    (tmp_path / "hetbatch_async.json").write_text(json.dumps(meta))
    checkpoint, position = checkpoint_choice.newest(str(tmp_path), "async")
    assert position == RunPosition("async", 40, 1, 0, num_parts=2, batch_sizes=(24, 8),
                                   dynamic_batching=[{"format": "x"}])
    model2 = tr.resume_train.build()
    model2.optimizer.build(model2.trainable_variables)
    checkpoint.restore(run_checkpoint.RunCheckpoint(str(tmp_path), model2, model2.optimizer),
                       log=False)
    for a, b in zip(model.get_weights(), model2.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(model2.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())
    with pytest.raises(ValueError, match="written by 'async' training \\(AsyncTrainer\\)"):
        checkpoint_choice.newest(str(tmp_path), "fit")
    # Its older checkpoints carry no position: with the newest damaged, none can be resumed.
    truncate_checkpoint(path)
    with pytest.raises(ValueError, match="ckpt-20 \\(its position is unknown"):
        checkpoint_choice.newest(str(tmp_path), "async")
