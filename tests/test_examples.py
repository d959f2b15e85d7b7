"""The examples run (tiny modes), so they cannot rot."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.cluster  # real worker processes (or subprocesses): see setup.cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import fashion_mnist  # noqa: E402


def run(args, timeout, env=None):
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_demo_tiny_mode_prints_the_comparison(tmp_path):
    # Milder caps than the demo's default (0.24 CPU takes ~20 s to import TensorFlow) and less
    # data: the flow is what is checked here; the figures come from the full demo. Its layout
    # mode: worker 1 hosts 2 of the 3 replicas (logical CPUs) under its one cap.
    out = run(["examples/demo.py", "--steps", "3", "--epochs", "1", "--caps", "0.5,1.0",
               "--layout", "1,2", "--train-samples", "1280", "--test-samples", "512", "--out",
               str(tmp_path)], 300)
    assert "2 workers hosting 1,2 replicas" in out
    assert "worker 1/0" in out and "worker 1/1" in out
    assert "stock even split" in out and "DynamicBatching" in out
    assert "speedup:" in out and "test accuracy" in out
    summary = json.loads((tmp_path / "demo_summary.json").read_text())
    assert summary["even"]["final_batch_sizes"] == [43, 43, 42]
    assert sum(summary["dynamic"]["final_batch_sizes"]) == 128
    # Exact training: the same model whatever the split, so the same test accuracy.
    assert summary["even"]["test_accuracy"] == pytest.approx(summary["dynamic"]["test_accuracy"], abs=0.01)
    assert os.path.isdir(summary["dynamic"]["log_dir"])
    # The PNG pipeline by default; every worker's input time per step beside its compute time.
    assert "input ms" in out and "compute ms" in out
    for run_ in (summary["even"], summary["dynamic"]):
        assert run_["pipeline"] == "png" and run_["input_work"] == "split"
        assert len(run_["input_ms_per_step"]) == 3 and min(run_["input_ms_per_step"]) > 0


@pytest.mark.parametrize("pipeline", ["png", "arrays"])
def test_training_script_runs_on_one_host(tmp_path, pipeline):
    result = tmp_path / "r.json"
    run(["examples/train_fashion_mnist.py", "--replicas", "2", "--mode", "static", "--sizes",
         "40,24", "--batch", "64", "--steps", "4", "--epochs", "1", "--model", "small_cnn",
         "--pipeline", pipeline, "--result", str(result)], 180)
    summary = json.loads(result.read_text())
    assert summary["final_batch_sizes"] == [40, 24]
    assert summary["samples_per_step"] in (None, [40.0, 24.0])
    assert summary["pipeline"] == pipeline
    assert (summary["input_ms_per_step"] is None) == (pipeline == "arrays")


def test_png_records_are_written_once_when_processes_race(tmp_path):
    code = ("import sys; sys.path.insert(0, 'examples'); import fashion_mnist as fm; "
            "r = fm.png_records('train', 300, cache_dir=sys.argv[1]); "
            "print(r.count, r.bytes, *r.files)")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [proc.communicate(timeout=180) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), [err[-2000:] for _, err in outs]
    assert len({out for out, _ in outs}) == 1  # every process sees the same files
    assert not glob.glob(str(tmp_path / "**" / "*.tmp-*"), recursive=True)
    records = fashion_mnist.png_records("train", 300, cache_dir=str(tmp_path))
    assert records.count == 300 and outs[0][0].split()[2:] == records.files

    import tensorflow as tf

    features = {"image": tf.io.FixedLenFeature([], tf.string),
                "label": tf.io.FixedLenFeature([], tf.int64)}
    x, y, _ = fashion_mnist.load_uint8("train", 300)
    stored = list(tf.data.TFRecordDataset(records.files).map(
        lambda r: tf.io.parse_single_example(r, features)).as_numpy_iterator())
    assert len(stored) == 300
    assert [int(e["label"]) for e in stored] == y.tolist()
    assert all((tf.io.decode_png(e["image"]).numpy()[..., 0] == x[i]).all()
               for i, e in enumerate(stored))


def test_png_pipeline_is_seeded_with_static_shapes_and_metered(tmp_path):
    records = fashion_mnist.png_records("train", 256, cache_dir=str(tmp_path))
    for augment in fashion_mnist.AUGMENTATIONS:
        meter = fashion_mnist.InputMeter()
        first = list(fashion_mnist.png_pipeline(records, 64, seed=5, augment=augment,
                                                meter=meter).as_numpy_iterator())
        again = list(fashion_mnist.png_pipeline(records, 64, seed=5,
                                                augment=augment).as_numpy_iterator())
        other = list(fashion_mnist.png_pipeline(records, 64, seed=6,
                                                augment=augment).as_numpy_iterator())
        assert len(first) == 4
        assert all((a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(first, again))
        assert not all((a[1] == b[1]).all() for a, b in zip(first, other))
        images = np.concatenate([b[0] for b in first])
        assert images.shape == (256, 28, 28, 1) and images.min() >= 0 and images.max() <= 1
        seconds, samples, own_bytes, read_bytes = meter.read()
        assert seconds > 0 and samples == 256 and own_bytes == read_bytes == records.bytes
    spec = fashion_mnist.png_pipeline(records, 64).element_spec
    assert spec[0].shape.as_list() == [None, 28, 28, 1] and spec[1].shape.as_list() == [None]
    # Decode only: the stored images themselves.
    x, _, _ = fashion_mnist.load("train", 256)
    light = np.concatenate([b[0] for b in fashion_mnist.png_pipeline(
        records, 64, augment="light").as_numpy_iterator()])
    assert np.allclose(np.sort(light.sum(axis=(1, 2, 3))), np.sort(x.sum(axis=(1, 2, 3))))


def test_custom_loop_tiny_mode_runs_the_tutorial_with_a_balancer(tmp_path):
    summary_path = tmp_path / "summary.json"
    out = run(["examples/custom_loop.py", "--steps", "4", "--epochs", "2", "--train-samples",
               "2000", "--checkpoint-dir", str(tmp_path / "ckpt"), "--summary",
               str(summary_path)], 300)
    assert "Epoch 2, Loss:" in out
    summary = json.loads(summary_path.read_text())
    assert summary["history"][0]["new"] == [64, 64]
    assert sum(summary["batch_sizes"]) == 128
    assert glob.glob(str(tmp_path / "ckpt" / "ckpt-2*"))  # the balancer saved with the run


def test_gpu_check_tiny_mode_on_cpu_says_what_it_skipped(tmp_path):
    # No GPU here: the check runs its mechanisms on logical CPUs (one host of 2; two workers
    # hosting 1 and 2, the host all-reduce forced) and says which GPU parts it skipped.
    results = tmp_path / "gpu_check.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = run(["examples/gpu_check.py", "--steps", "4", "--filters", "8", "--out",
               str(results)], timeout=420, env={"TMPDIR": str(scratch)})
    assert not glob.glob(str(scratch / "tf_hetbatch_gpu_check_*"))  # its work files removed
    assert "0 GPU(s)" in out and "No GPU here: skipped the GPU devices" in out
    assert "two workers: 2 workers: [1 CPU] [2 CPU]; 3 replicas; all-reduce host (RING)" in out
    with open(results) as f:
        found = json.load(f)
    assert [row["kind"] for row in found["devices"]] == ["CPU", "CPU"]
    assert all(row["samples_per_s"] > 0 for row in found["devices"])
    host, cluster = found["one_host"], found["two_workers"]
    assert sum(host["static_split"]) == sum(host["settled_split"]) == 64
    assert host["exact_split"] != host["static_split"]  # an uneven split, checked
    assert host["max_weight_diff"] <= 1e-5 and cluster["max_weight_diff"] <= 1e-5
    assert len(cluster["split"]) == 3 and sum(cluster["split"]) == 64
    assert len(set(cluster["split"])) > 1
    assert cluster["kinds"] == ["CPU"] * 3 and all(s > 0 for s in cluster["samples_per_s"])
    # Micro-batches: the uneven split again, each replica bounded at a third of its share.
    assert "memory bounds: skipped: no device reports memory" in out
    assert "jit_compile: skipped: no GPU" in out and found["jit"] is None  # part 6: GPUs only
    assert found["memory_bounds"] == []
    micro = found["micro_batches"]
    assert micro["split"] == host["exact_split"]
    assert micro["limits"] == [-(-b // 3) for b in micro["split"]]  # set on the strategy
    # Counts from the strategy's shares and bounds after the run: limits it ignored fail here.
    assert micro["counts"] == [-(-b // m) for b, m in zip(micro["split"], micro["limits"])]
    assert max(micro["counts"]) > 1
    assert micro["step_ms_unbounded"] > 0 and micro["step_ms_bounded"] > 0
    assert micro["max_weight_diff"] <= 1e-5
    assert "micro-batches, one host, split" in out and " micro-batches) " in out
    # Parts 7-10 run their code paths on logical CPUs (part 9 with RING for NCCL, part 8 with
    # the allocation injected); each says PASS, and the summary lists every checking part.
    for part in ("determinism", "out_of_memory", "device_all_reduce", "soft_placement_off"):
        assert found[part]["status"] == "PASS", (part, found[part])
        assert found[part]["max_weight_diff"] <= 1e-5
    assert found["determinism"]["bit_identical"] and min(found["determinism"]["timed_steps"]) > 0
    oom = found["out_of_memory"]
    assert len(oom["warnings"]) == 1 and oom["limits"] == [oom["split"][0] // 2, None]
    assert "all-reduce device (RING)" in found["device_all_reduce"]["layout"]
    assert "summary:" in out and "FAIL" not in out
