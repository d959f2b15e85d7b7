"""Runs the controller benchmark's tiny mode, as CI does for every example."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "benchmarks", "bench_controllers.py")


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_bench_controllers_help():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    assert "--steps" in proc.stdout and "--out" in proc.stdout and "--seed" in proc.stdout


def test_bench_controllers_tiny_mode_prints_table_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run("--steps", "30", "--seed", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "| scenario | K | policy |" in proc.stdout
    assert "| ModelBasedController | 256 |" in proc.stdout
    data = json.loads(out.read_text())
    assert data["tiny"] and data["seeds"] == [1]
    policies = {row["policy"] for row in data["rows"]}
    assert policies == {"uniform", "static", "proportional", "model-based", "rule only"}
    assert all(row["steady_over_best"] >= 1.0 - 1e-9 for row in data["rows"])
    assert set(data["homogeneous"]) == {"3", "16"}
