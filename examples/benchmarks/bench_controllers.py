"""Benchmark of the batch-size controllers on the simulator (pure numpy, no TensorFlow).

For each scenario and cluster size, compares four policies, all starting from the even
split: `uniform` (keep it), `static` (split proportional to nominal capacity 1/beta, i.e.
FLOPs, then keep it), `proportional` (the source paper's dynamic rule) and `model-based`
(the default). Reports the adjustments made until the noise-free step time stays within
5% of the ideal (equal-finish split of the true model), the steady-state step time over the
ideal, and the decision time of one controller update at 4,096 replicas.

Usage:
    python examples/benchmarks/bench_controllers.py --seed 0 --out bench.json
    python examples/benchmarks/bench_controllers.py --steps 40     # tiny smoke run
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

from tf_hetbatch.controllers import ModelBasedController, ProportionalController
from tf_hetbatch.sim import ClusterModel, Slowdown, simulate
from tf_hetbatch.split import split_evenly, split_proportionally

PER_REPLICA_BATCH = 64
TOLERANCE = 0.05


def _cpus(rng, k):
    """CPU workers: time per sample inversely proportional to 4..64 cores, no fixed cost."""
    cores = rng.choice([4, 8, 16, 32, 64], size=k)
    return np.zeros(k), 0.064 / cores


def _gpus(rng, k):
    """GPU-like workers (P4/T4/V100/A100 ratios): fast per sample, 10-40 ms fixed per step."""
    speed = rng.choice([5.5, 8.1, 15.7, 60.0], size=k)
    return rng.uniform(0.01, 0.04, k), 0.0008 / speed


def scenario_cluster(name, rng, k, steps):
    """Returns (ClusterModel, step after which convergence is measured)."""
    if name == "linear-cpu":
        alpha, beta = _cpus(rng, k)
        return ClusterModel(alpha, beta), 0
    if name == "affine-gpu":
        alpha, beta = _gpus(rng, k)
        return ClusterModel(alpha, beta, allreduce=0.005), 0
    if name == "cpu+gpu":
        n_gpu = max(1, k // 4)
        a_g, b_g = _gpus(rng, n_gpu)
        a_c, b_c = _cpus(rng, k - n_gpu)
        alpha, beta = np.concatenate([a_g, a_c + 0.005]), np.concatenate([b_g, b_c])
        return ClusterModel(alpha, beta, allreduce=0.005), 0
    if name == "interference":
        alpha, beta = _cpus(rng, k)
        alpha = alpha + 0.01
        victims = rng.choice(k, size=max(1, k // 10), replace=False)
        slow = tuple(Slowdown(int(v), steps // 2, None, 2.0) for v in victims)
        return ClusterModel(alpha, beta, slowdowns=slow, allreduce=0.005), steps // 2
    if name == "noise":
        alpha, beta = _gpus(rng, k)
        return ClusterModel(alpha, beta, noise=0.1, allreduce=0.005), 0
    raise ValueError(f"unknown scenario {name!r}")


SCENARIOS = ("linear-cpu", "affine-gpu", "cpu+gpu", "interference", "noise")
POLICIES = ("uniform", "static", "proportional", "model-based")


def run_policy(policy, cluster, steps, total, seed):
    k = cluster.num_replicas
    even = split_evenly(total, k)
    if policy == "uniform":
        return simulate(None, cluster, steps, initial_sizes=even, seed=seed)
    if policy == "static":
        sizes = split_proportionally(total, 1.0 / cluster.beta, min_sizes=1)
        return simulate(None, cluster, steps, initial_sizes=sizes, seed=seed)
    controller = ProportionalController() if policy == "proportional" else ModelBasedController()
    return simulate(controller, cluster, steps, adjust_every=10, initial_sizes=even, seed=seed)


def decision_time_ms(controller_cls, k, seed, repeats=30):
    """Median and p90 wall time, and median CPU time, of one `update` at k replicas (warm)."""
    rng = np.random.default_rng(seed)
    alpha, beta = _gpus(rng, k)
    ctrl = controller_cls()
    state = ctrl.init(split_evenly(PER_REPLICA_BATCH * k, k))
    samples, cpu = [], []
    for i in range(repeats + 3):
        sizes = np.asarray(state.sizes, float)
        times = (alpha + beta * sizes) * rng.uniform(0.97, 1.03, k)
        start, start_cpu = time.perf_counter(), time.process_time()
        _, state = ctrl.update(state, sizes, times)
        if i >= 3:
            samples.append(1e3 * (time.perf_counter() - start))
            cpu.append(1e3 * (time.process_time() - start_cpu))
    return float(np.median(samples)), float(np.percentile(samples, 90)), float(np.median(cpu))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", default=None, help="write all results to this JSON file")
    parser.add_argument("--steps", type=int, default=None,
                        help="tiny mode: this many steps, small clusters only")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated replica counts (default 3,16,128,1024)")
    args = parser.parse_args(argv)
    tiny = args.steps is not None
    steps = args.steps if tiny else 600
    sizes = [int(v) for v in args.sizes.split(",")] if args.sizes else (
        [3, 16] if tiny else [3, 16, 128, 1024])
    decision_k = 256 if tiny else 4096
    started = time.time()
    rows = []
    for scenario in SCENARIOS:
        for k in sizes:
            cluster, after = scenario_cluster(scenario, np.random.default_rng(args.seed), k, steps)
            total = PER_REPLICA_BATCH * k
            for policy in POLICIES:
                result = run_policy(policy, cluster, steps, total, args.seed)
                converged = result.adjustments_to_converge(TOLERANCE, after=after)
                rows.append({
                    "scenario": scenario, "replicas": k, "policy": policy,
                    "adjustments_to_converge": converged,
                    "adjustments": sum(1 for s in result.adjust_steps if s >= after),
                    "steady_over_ideal": result.steady_ratio(),
                    "steady_noisy_over_ideal": result.steady_ratio(noisy=True),
                    "ideal_over_flow": float(result.ideal_step_times[-1]
                                             / result.flow_step_times[-1]),
                })
    decisions = {}
    for cls in (ProportionalController, ModelBasedController):
        median, p90, cpu = decision_time_ms(cls, decision_k, args.seed)
        decisions[cls.__name__] = {"replicas": decision_k, "median_ms": median, "p90_ms": p90,
                                   "median_cpu_ms": cpu}
    elapsed = time.time() - started

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Controller benchmark, {when}, seed {args.seed}, {steps} steps, adjust every 10 "
             f"steps, B = {PER_REPLICA_BATCH} x K, start from the even split; converged = "
             f"noise-free step time within {TOLERANCE:.0%} of ideal to the end "
             "('-' never; interference counts from the slowdown on).", "",
             "| scenario | K | policy | adj. to converge | adjustments | steady / ideal "
             "| steady noisy / ideal |", "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        conv = "-" if r["adjustments_to_converge"] is None else str(r["adjustments_to_converge"])
        lines.append(f"| {r['scenario']} | {r['replicas']} | {r['policy']} | {conv} | "
                     f"{r['adjustments']} | {r['steady_over_ideal']:.3f} | "
                     f"{r['steady_noisy_over_ideal']:.3f} |")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines += ["", f"Decision time of one update (machine load average {load:.1f} on "
              f"{os.cpu_count()} CPUs):", "",
              "| controller | K | wall median ms | wall p90 ms | CPU median ms |",
              "|---|---:|---:|---:|---:|"]
    for name, d in decisions.items():
        lines.append(f"| {name} | {d['replicas']} | {d['median_ms']:.2f} | {d['p90_ms']:.2f} | "
                     f"{d['median_cpu_ms']:.2f} |")
    lines += ["", f"Total benchmark time {elapsed:.1f} s."]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": when, "seed": args.seed, "steps": steps, "tiny": tiny,
                       "python": platform.python_version(), "numpy": np.__version__,
                       "rows": rows, "decision_time": decisions, "elapsed_s": elapsed},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
