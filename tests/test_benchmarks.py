"""Runs every cluster benchmark's tiny mode in a subprocess, so the scripts cannot rot.

Checks the exit code, the markdown table, and that the JSON has the expected keys and only
finite numbers. No timing assertions: this machine is shared and noisy.
"""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster  # real worker processes (or subprocesses): see setup.cfg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "examples", "benchmarks")
TIMEOUT = 240  # a tiny mode takes < 60 s on a quiet machine; leave room for a busy one

sys.path.insert(0, BENCH)
from bench_common import all_finite  # noqa: E402  (pure Python)


def _run(script, *args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(BENCH, script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT)


def _check(proc, out, keys, table_header):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert table_header in proc.stdout, proc.stdout[-3000:]
    data = json.loads(out.read_text())
    missing = [k for k in keys if k not in data]
    assert not missing, f"missing keys {missing} in {sorted(data)}"
    assert data["tiny"] is True and data["seed"] == 3
    assert not all_finite(data), f"non-finite numbers at {all_finite(data)}"
    assert os.path.exists(data["png"]) and os.path.getsize(data["png"]) > 0
    return data


def _finite(*values):
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


@pytest.mark.parametrize("script", ["bench_overhead.py", "bench_hetero.py", "bench_sweep.py",
                                    "bench_accuracy.py", "bench_input.py", "hetero_worker.py",
                                    "input_worker.py", "bench_micro_batches.py"])
def test_benchmark_help(script):
    proc = _run(script, "--help")
    assert proc.returncode == 0, proc.stderr
    if not script.endswith("_worker.py"):
        assert "--steps" in proc.stdout and "--out" in proc.stdout and "--seed" in proc.stdout
        assert "--repeats" in proc.stdout


def test_bench_overhead_tiny_mode(tmp_path):
    out = tmp_path / "overhead.json"
    # Part (a) on one model (the flow is the same for each); part (b)'s model is small_cnn.
    proc = _run("bench_overhead.py", "--steps", "4", "--seed", "3", "--models", "dense",
                "--out", str(out))
    data = _check(proc, out, ["single_host", "cluster", "goal", "goal_met", "date"],
                  "| setting | baseline |")
    assert "MultiWorkerMirroredStrategy" in proc.stdout
    assert "input as fit(x, y, batch_size=128) builds it" in proc.stdout
    assert list(data["single_host"]["models"]) == ["dense"]
    assert data["cluster"]["model"] == "small_cnn"
    m = data["single_host"]["models"]["dense"]
    for figures in (m, m["arrays"]):  # tf.data with drop_remainder; array-style input
        for key in ("ratio", "control_ratio", "cpu_ratio"):
            ratio = figures[key]  # per-block paired ratios: 2 blocks in tiny mode
            assert ratio["n"] == 2 and _finite(ratio["min"], ratio["median"], ratio["max"])
            assert ratio["min"] > 0
            assert ratio["ci90"][0] <= ratio["median"] <= ratio["ci90"][1]
        assert len(figures["stock_ms"]) == len(figures["ours_ms"]) == 2
        assert len(figures["control_ms"]) == 2
    for key in ("pipeline_start_ms", "pipeline_end_ms"):
        got = m[key]
        assert got["stock"]["n"] == got["ours"]["n"] == 2 and got["ours"]["min"] > 0
    assert data["cluster"]["ratio"]["n"] == 2 and data["cluster"]["ratio"]["median"] > 0


def test_bench_micro_batches_tiny_run(tmp_path):
    out = tmp_path / "micro.json"
    proc = _run("bench_micro_batches.py", "--steps", "6", "--repeats", "1", "--seed", "3",
                "--caps", "none,none,none", "--filters", "4", "--train-samples", "1280",
                "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| round | unbounded ms | micro ms | capped ms |" in proc.stdout
    data = json.loads(out.read_text())
    assert not all_finite(data), f"non-finite numbers at {all_finite(data)}"
    (round_,) = data["rounds"]
    assert all(round_[arm] > 0 for arm in ("unbounded", "micro", "capped"))
    micro = next(p for p in data["phases"] if p["name"] == "micro r1")
    assert micro["micro_batch_limits"] == [0, 0, 48]


def test_bench_hetero_tiny_mode(tmp_path):
    out = tmp_path / "hetero.json"
    proc = _run("bench_hetero.py", "--steps", "4", "--seed", "3", "--out", str(out))
    data = _check(proc, out, ["step_ms", "speedup_vs_even", "goals", "ideal_ms", "ideal_split",
                              "time_model", "remainder_ms", "rounds", "grid", "phases"],
                  "| policy | step ms | speed-up vs even | split |")
    for key in ("even_ms", "best_ms", "dynamic_ms"):
        assert data["step_ms"][key]["median"] > 0
    assert data["ideal_ms"] > 0 and abs(sum(data["ideal_split"]) - data["batch"]) < 1e-6
    round_ = data["rounds"][0]
    assert sum(round_["best_sizes"]) == data["batch"] == sum(round_["dynamic_sizes"])
    # The head to head runs the splits the phases settled on, as fixed splits.
    h2h = data["head_to_head"]
    assert h2h["best"]["sizes"] == [round_["best_sizes"]]
    assert h2h["dynamic"]["sizes"] == [round_["dynamic_sizes"]]
    assert h2h["dynamic"]["over_best"]["median"] > 0
    assert data["goals"]["dynamic_split_vs_best_static"] in ("met", "tie", "MISSED")


def test_bench_sweep_tiny_mode(tmp_path):
    out = tmp_path / "sweep.json"
    # 2 workers (the default is 3): the flow is the same, one process less to start.
    proc = _run("bench_sweep.py", "--steps", "5", "--seed", "3", "--workers", "2", "--out",
                str(out))
    data = _check(proc, out, ["hs", "runs", "base_step_ms", "base_epoch_s", "scenario"],
                  "| H | caps |")
    assert all(len(run["caps"]) == 2 for run in data["runs"])
    assert [run["h"] for run in data["runs"]] == data["hs"]
    for run in data["runs"]:
        for policy in ("even", "static", "dynamic"):
            s = run["summary"][policy]
            assert s["step_norm"]["median"] > 0 and s["epoch_norm"]["median"] > 0
        assert math.isclose(sum(run["caps"]), 1.5, rel_tol=1e-3)


def test_bench_sweep_interference_tiny_mode(tmp_path):
    out = tmp_path / "interference.json"
    proc = _run("bench_sweep.py", "--scenario", "interference", "--steps", "5", "--seed", "3",
                "--workers", "2", "--out", str(out))
    data = json.loads(out.read_text()) if out.exists() else {}
    # slow_at/recover_at are null in tiny mode (no schedule): check the rest by hand.
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| round | policy | before |" in proc.stdout
    assert {r["policy"] for r in data["runs"]} == {"static", "dynamic"}
    for run in data["runs"]:
        assert run["total_s"] > 0 and set(run["adjustments"]) == {"during", "after"}
    assert not all_finite(data)


def test_bench_accuracy_tiny_mode(tmp_path):
    out = tmp_path / "accuracy.json"
    proc = _run("bench_accuracy.py", "--steps", "4", "--seed", "3", "--out", str(out),
                "--initial", "flops", "--steps-per-execution", "2")
    data = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| policy | train s / epoch" in proc.stdout
    for key in ("runs", "rounds", "speedup_epoch", "max_accuracy_gap", "target"):
        assert key in data
    assert (data["initial"], data["steps_per_execution"]) == ("flops", 2)
    assert {r["mode"] for r in data["runs"]} == {"even", "dynamic"}
    dynamic = next(r for r in data["runs"] if r["mode"] == "dynamic")
    assert isinstance(dynamic["windows"], list)  # the controller's input, for analysis
    for run in data["runs"]:
        assert len(run["test_accuracy"]) == data["epochs"] == len(run["train_seconds"])
        assert all(0.0 <= a <= 1.0 for a in run["test_accuracy"])
    # time to target may be None (not reached in 2 tiny epochs): None is allowed, NaN is not.
    assert not all_finite(data)


def test_bench_async_tiny_mode(tmp_path):
    """ASP even / ASP DynamicBatching / BSP tiny runs: JSON, per-worker updates, staleness."""
    helped = _run("bench_async.py", "--help")
    assert helped.returncode == 0, helped.stderr
    for flag in ("--steps", "--out", "--seed", "--repeats", "--caps", "--target"):
        assert flag in helped.stdout
    out = tmp_path / "async.json"
    proc = _run("bench_async.py", "--steps", "4", "--seed", "3", "--out", str(out))
    data = _check(proc, out, ["runs", "rounds", "ratios", "target", "epochs", "steps_per_epoch",
                              "caps", "cap_method", "date"], "| run | train s / epoch")
    assert "Staleness of the ASP updates" in proc.stdout
    assert [r["name"] for r in data["runs"]] == ["asp_even", "asp_dynamic", "bsp_dynamic"]
    updates = data["epochs"] * data["steps_per_epoch"]
    for run in data["runs"]:
        assert len(run["test_accuracy"]) == data["epochs"] == len(run["train_seconds"])
        assert all(0.0 <= a <= 1.0 for a in run["test_accuracy"])
        assert all(t > 0 for t in run["train_seconds"])
        assert len(run["final_sizes"]) == 2
        if run["mode"] != "asp":
            continue
        assert run["update_count"] == updates
        assert sum(run["updates_per_worker"]) == updates
        assert run["counted_updates_per_worker"] == run["updates_per_worker"]
        assert sum(run["final_sizes"]) == 2 * data["batch"] and min(run["final_sizes"]) >= 1
        histogram = run["staleness"]["histogram"]
        assert len(histogram) == 2
        assert [sum(row) for row in histogram] == run["updates_per_worker"]
        assert sum(run["staleness"]["overall"]) == updates
        assert len(run["staleness"]["mean"]) == 2 and len(run["staleness"]["max"]) == 2
    assert data["ratios"]["asp_dynamic_vs_even_epoch"]["n"] == 1
    assert data["rounds"][0]["asp_dynamic_vs_even_epoch"] > 0


def test_bench_input_tiny_mode(tmp_path):
    """The 2-worker cluster, old and new input paths, the reference and the read
    amplification (3 workers mapping only their own samples: tests/test_multi_worker.py)."""
    out = tmp_path / "input.json"
    proc = _run("bench_input.py", "--steps", "4", "--seed", "3", "--clusters", "w2",
                "--out", str(out))
    data = _check(proc, out, ["clusters", "goals", "phases", "command", "date"],
                  "| cluster | pipeline | input work | even ms |")
    assert "| cluster | split | worker | share | samples decoded |" in proc.stdout
    assert [c["name"] for c in data["clusters"]] == ["2 workers"]
    for cluster in data["clusters"]:
        k, batch = len(cluster["caps"]), data["batch"]
        for paths in cluster["steps"].values():
            assert set(paths) == {"split", "unsplit"}
            for cells in paths.values():
                assert set(cells) == {"even", "fixed", "dynamic"}
                for cell in cells.values():
                    assert cell["step_ms"]["median"] > 0
                    assert all(sum(sizes) == batch for sizes in cell["sizes"])
                    assert len(cell["input"]["seconds"]) == k
        amp = cluster["amplification"]
        assert amp["sizes"] == cluster["fixed"]
        # Every worker reads every record; each decodes exactly its own share of each batch.
        assert amp["read_bytes"] == [amp["file_bytes"]] * k
        batches = amp["global_batches"][0]
        assert amp["own_samples"] == [b * batches for b in cluster["fixed"]]
        assert amp["own_bytes"][0] < amp["file_bytes"]
    assert data["clusters"][0]["reference"]["new_over_reference"]["median"] > 0
    assert set(data["goals"]) >= {"reference_met", "dynamic_met", "light_met"}
