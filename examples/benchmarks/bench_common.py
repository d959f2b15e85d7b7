"""Shared helpers of the cluster benchmarks: launching `hetero_worker.py`, stats, tables, plots.

Pure Python + numpy (+ matplotlib for the PNGs): importing this module does not import
TensorFlow, so a benchmark driver stays light while its workers train.
"""

import datetime
import io
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tf_hetbatch.core import split  # noqa: E402  (pure Python + numpy)
from tf_hetbatch.launch import launch  # noqa: E402  (pure Python: no TensorFlow)

WORKER = os.path.join(HERE, "hetero_worker.py")
DEFAULT_OUT_DIR = "/tmp/tf_hetbatch_bench"
NOISE = ("W0000", "I0000", "E0000", "WARNING: All log", "UserWarning", "data_adapter",
         "crashed", "/job:", "grpc", "absl::InitializeLog", "cuda", "rebuild TensorFlow",
         "cpu_feature_guard", "AVX", "Error received from peer", "CoordinationService")


class Captured(io.TextIOBase):
    """Keeps every worker line; echoes the chief's `#`-prefixed progress lines if asked."""

    def __init__(self, echo=True):
        self.echo, self.lines = echo, []

    def write(self, text):
        for line in text.splitlines():
            self.lines.append(line)
            if self.echo and line.startswith("[worker 0] #"):
                sys.stdout.write("    " + line[len("[worker 0] #"):].strip() + "\n")
                sys.stdout.flush()
        return len(text)


def run_cluster(plan, caps, workdir, name, timeout, schedule=None, echo=True, threads=1,
                cap_after=None, worker=WORKER, accept_failure_with_result=False):
    """Runs `worker` (default `hetero_worker.py`) with `plan` on len(caps) workers; returns the
    chief's result dict.

    `plan["t0"]` is set to the wall clock just before the launch, so schedule times (seconds
    since the workers started) and the workers' step timestamps share one origin.

    `cap_after`: start the workers uncapped (a worker capped at 0.15 CPU needs ~30 s just to
    import TensorFlow) and apply `caps` by the launcher's schedule `cap_after` seconds after
    the start; the workers run their `warmup` phase, then wait until `cap_after + 1` s
    (`plan["start_at"]`) before the measured phases. `schedule` entries (text) are appended.
    Every worker line goes to `<workdir>/<name>.log`. `accept_failure_with_result`: a launch
    that failed after the chief wrote its result (e.g. deliberate attempts at its end) returns
    that result, with the failure in `launch_message`.
    """
    os.makedirs(workdir, exist_ok=True)
    plan = dict(plan)
    plan_path = os.path.join(workdir, f"{name}_plan.json")
    result_path = os.path.join(workdir, f"{name}_result.json")
    if os.path.exists(result_path):
        os.remove(result_path)
    launch_caps = caps
    if cap_after is not None and any(c is not None for c in caps):
        entry = f"{cap_after:g}:" + ",".join(
            f"{i}={'none' if c is None else f'{c:.4g}'}" for i, c in enumerate(caps))
        schedule = entry + (";" + schedule if schedule else "")
        plan["start_at"] = cap_after + 1.0
        launch_caps = [None] * len(caps)
    plan["t0"] = time.time()
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    caps = [None if c is None else float(c) for c in caps]
    stream = Captured(echo)
    started = time.perf_counter()
    outcome = launch([worker, "--plan", plan_path, "--result", result_path], len(caps),
                     cpus=launch_caps if any(c is not None for c in launch_caps) else None,
                     schedule=schedule, threads=threads, timeout=timeout,
                     stdout=stream, stderr=stream, handle_signals=True)
    log_path = os.path.join(workdir, f"{name}.log")
    with open(log_path, "w") as f:  # every worker line, TensorFlow's included
        f.write("\n".join(stream.lines) + "\n")
    if not outcome.ok or not os.path.exists(result_path):
        tail = [line for line in stream.lines if not any(n in line for n in NOISE)][-40:]
        sys.stdout.write("\n".join(tail) + "\n")
        if not (accept_failure_with_result and os.path.exists(result_path)):
            raise SystemExit(f"{name}: the cluster run failed: {outcome.message} (full log: "
                             f"{log_path})")
        print(f"    note: {name} ended with {outcome.message} after writing its result",
              flush=True)
    with open(result_path) as f:
        result = json.load(f)
    result["launch_message"] = outcome.message
    result["wall_seconds"] = time.perf_counter() - started
    result["cap_method"] = outcome.cap_method
    result["caps"] = caps
    result["schedule"] = schedule
    return result


def stats(values):
    """min / median / max (and n) of a list of numbers, skipping None/NaN (None if empty)."""
    arr = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    if arr.size == 0:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": float(arr.min()), "median": float(np.median(arr)), "max": float(arr.max()),
            "n": int(arr.size)}


def fmt_stats(s, scale=1.0, digits=0):
    """'median (min-max)' of a stats dict."""
    if not s["n"]:
        return "-"
    f = f"{{:.{digits}f}}"
    if s["n"] == 1:
        return f.format(s["median"] * scale)
    return (f"{f.format(s['median'] * scale)} ({f.format(s['min'] * scale)}-"
            f"{f.format(s['max'] * scale)})")


def ratio_stats(ratios, rng):
    """stats() of paired ratios plus a 90% bootstrap interval of their median ("ci90")."""
    s = stats(ratios)
    arr = np.asarray([v for v in ratios if v is not None and np.isfinite(v)], dtype=float)
    if arr.size > 1:
        medians = np.median(rng.choice(arr, size=(1000, arr.size)), axis=1)
        s["ci90"] = [float(np.percentile(medians, 5)), float(np.percentile(medians, 95))]
    return s


def fmt_ratio(s):
    """'median [90% interval]' of a ratio_stats dict."""
    if not s["n"]:
        return "-"
    if "ci90" not in s:
        return f"{s['median']:.3f}"
    return f"{s['median']:.3f} [{s['ci90'][0]:.3f}-{s['ci90'][1]:.3f}]"


def table(header, rows, align=None):
    """A markdown table as a list of lines."""
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def now_utc():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def environment():
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"python": platform.python_version(), "numpy": np.__version__,
            "cpus": os.cpu_count(), "load_average": list(load)}


def out_paths(out):
    """(json path, png path, work dir) for --out (default under /tmp/tf_hetbatch_bench)."""
    json_path = os.path.abspath(out)
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    stem = os.path.splitext(json_path)[0]
    workdir = stem + "_work"
    os.makedirs(workdir, exist_ok=True)
    return json_path, stem + ".png", workdir


def write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=_plain)
    return path


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value)}")


def pyplot():
    """matplotlib.pyplot with the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, png):
    """Lays out, writes and closes a matplotlib figure."""
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    pyplot().close(fig)


def base_parser(doc, out_default, out_help="JSON results; the PNG goes next to it"):
    """The arguments every benchmark has: --seed and --out (its description from `doc`)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", default=out_default, help=out_help)
    return parser


def temp_workdir(prefix):
    return tempfile.mkdtemp(prefix=prefix)


def all_finite(obj, path="$"):
    """Paths of non-finite floats in a nested JSON-like object (for the tests)."""
    bad = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            bad += all_finite(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            bad += all_finite(v, f"{path}[{i}]")
    elif isinstance(obj, float) and not np.isfinite(obj):
        bad.append(path)
    return bad


# ------------------------------------------------------------------ time models ---------
def fit_time_models(phases, k):
    """Least-squares t = alpha + beta * b per replica over static phases' busy times."""
    rows = [(p["busy"]["samples_per_step"], p["busy"]["time_per_step"]) for p in phases
            if p["kind"] == "static" and p.get("busy")]
    alpha, beta = np.zeros(k), np.zeros(k)
    for j in range(k):
        b = np.array([r[0][j] for r in rows], float)
        t = np.array([r[1][j] for r in rows], float)
        ok = np.isfinite(b) & np.isfinite(t)
        if ok.sum() >= 2 and np.ptp(b[ok]) > 0:
            beta[j], alpha[j] = np.polyfit(b[ok], t[ok], 1)
        elif ok.any():
            alpha[j], beta[j] = 0.0, float(np.mean(t[ok] / np.maximum(b[ok], 1)))
    beta = np.maximum(beta, 1e-9)
    return alpha, beta, len(rows)


def equal_finish(alpha, beta, total):
    """Real-valued split with equal alpha_k + beta_k b_k (replicas that would go < 0 get 0):
    (the finish time, the split), by `tf_hetbatch.core.split.equal_finish_level`."""
    return split.equal_finish_level(float(total), alpha, 1.0 / np.asarray(beta, np.float64))


def ideal_step(phases, k, batch):
    """The ideal step of a run: the equal-finish split under per-replica time models fitted to
    its static phases, plus the median remainder (step - slowest busy time: all-reduce etc.).

    Returns:
        dict with alpha_ms, beta_ms_per_sample, points, remainder_ms, ideal_split,
        ideal_busy_ms, ideal_ms.
    """
    alpha, beta, n_points = fit_time_models(phases, k)
    remainders = [p["step_ms_median"] / 1e3 - max(p["busy"]["time_per_step"]) for p in phases
                  if p["kind"] == "static" and p.get("busy")]
    remainder = float(np.median(remainders)) if remainders else 0.0
    t_eq, b_eq = equal_finish(alpha, beta, batch)
    return {"alpha_ms": (alpha * 1e3).tolist(), "beta_ms_per_sample": (beta * 1e3).tolist(),
            "points": n_points, "remainder_ms": remainder * 1e3, "ideal_split": b_eq.tolist(),
            "ideal_busy_ms": t_eq * 1e3, "ideal_ms": (t_eq + remainder) * 1e3}
