"""The examples run (tiny modes), so they cannot rot."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, timeout):
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_demo_tiny_mode_prints_the_comparison(tmp_path):
    # Milder caps than the demo's default (0.24 CPU takes ~20 s to import TensorFlow) and less
    # data: the flow is what is checked here; the figures come from the full demo.
    out = run(["examples/demo.py", "--steps", "3", "--epochs", "1", "--caps", "0.5,0.5,1.0",
               "--train-samples", "1280", "--test-samples", "512", "--out", str(tmp_path)], 300)
    assert "stock even split" in out and "DynamicBatching" in out
    assert "speedup:" in out and "test accuracy" in out
    summary = json.loads((tmp_path / "demo_summary.json").read_text())
    assert summary["even"]["final_batch_sizes"] == [43, 43, 42]
    assert sum(summary["dynamic"]["final_batch_sizes"]) == 128
    # Exact training: the same model whatever the split, so the same test accuracy.
    assert summary["even"]["test_accuracy"] == pytest.approx(summary["dynamic"]["test_accuracy"], abs=0.01)
    assert os.path.isdir(summary["dynamic"]["log_dir"])


def test_training_script_runs_on_one_host(tmp_path):
    result = tmp_path / "r.json"
    run(["examples/train_fashion_mnist.py", "--replicas", "2", "--mode", "static", "--sizes",
         "40,24", "--batch", "64", "--steps", "4", "--epochs", "1", "--model", "small_cnn",
         "--result", str(result)], 180)
    summary = json.loads(result.read_text())
    assert summary["final_batch_sizes"] == [40, 24]
    assert summary["samples_per_step"] in (None, [40.0, 24.0])
