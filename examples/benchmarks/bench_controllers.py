"""Benchmark of the batch-size controllers in the simulator (pure numpy, no TensorFlow).

For each scenario of `tf_hetbatch.core.sim.scenario` (linear CPU, affine GPU-like, CPU+GPU mix,
CPU quotas in periods with a collective, interference and recovery, +-10% noise) and each
cluster size, from the even split, compares the policies `uniform` (keep the even split),
`static` (split proportional to nominal capacity 1/beta, i.e. FLOPs, then keep it),
`proportional` (the source paper's rule, the alpha = 0 case of the mechanism),
`model-based` (the default) and `rule only` (model-based without the step-time search).
Reports, over the seeds: the windows until the settled split's step time is within 5% of
the best split's (`best_split`) and stays so, per phase (interference: start, slowdown,
recovery); the changes of split; the step time in force over the last fifth of the run over
the best split's. On the homogeneous cluster with +-10% noise: the seeds in which the
default controller moved. And the decision time of one update at 4,096 replicas.

Usage:
    python examples/benchmarks/bench_controllers.py --out /tmp/tf_hetbatch_bench/controllers.json
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

from tf_hetbatch.core.controllers import ModelBasedController, ProportionalController
from tf_hetbatch.core.sim import scenario, simulate
from tf_hetbatch.core.split import split_evenly, split_proportionally

PER_REPLICA_BATCH = 64
TOLERANCE = 0.05
INTERVAL = 10
SCENARIOS = ("linear-cpu", "affine-gpu", "cpu+gpu", "quota", "interference", "noise")
POLICIES = ("uniform", "static", "proportional", "model-based", "rule only")


def run_policy(policy, cluster, steps, total, seed):
    k = cluster.num_replicas
    if policy == "uniform":
        return simulate(None, cluster, steps, initial_sizes=split_evenly(total, k), seed=seed)
    if policy == "static":
        sizes = split_proportionally(total, 1.0 / cluster.beta, min_sizes=1)
        return simulate(None, cluster, steps, initial_sizes=sizes, seed=seed)
    controller = {"proportional": ProportionalController(),
                  "model-based": ModelBasedController(),
                  "rule only": ModelBasedController(step_time_search=False)}[policy]
    return simulate(controller, cluster, steps, adjust_every=INTERVAL, seed=seed,
                    initial_sizes=split_evenly(total, k))


def reach_per_phase(result, phases):
    ends = list(phases[1:]) + [None]
    return [result.windows_to_reach(TOLERANCE, after=a, until=b) for a, b in zip(phases, ends)]


def decision_time_ms(controller_cls, k, seed, windows=40):
    """Median and p90 wall time, and median CPU time, of one `update` at k replicas, over a
    run of the noise scenario (step times passed: the search races too)."""
    cluster = scenario("noise", k, windows * INTERVAL, seed).cluster
    rng = np.random.default_rng(seed)
    ctrl = controller_cls()
    state = ctrl.init(split_evenly(PER_REPLICA_BATCH * k, k))
    walls, cpus = [], []
    for _ in range(windows):
        sizes = state.sizes.astype(float)
        times, step = cluster.times(sizes, np.ones(k), rng.uniform(0.97, 1.03, k))
        start, start_cpu = time.perf_counter(), time.process_time()
        _, state = ctrl.update(state, sizes, times, step_time=step)
        walls.append(1e3 * (time.perf_counter() - start))
        cpus.append(1e3 * (time.process_time() - start_cpu))
    return float(np.median(walls)), float(np.percentile(walls, 90)), float(np.median(cpus))


def _fmt_reach(values):
    """Median (max) over the seeds of windows to reach; '-' where a seed never did."""
    if any(v is None for v in values):
        return f"- ({sum(v is None for v in values)}/{len(values)} never)"
    return f"{int(np.median(values))} ({max(values)})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell (default 3)")
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
    seeds = list(range(args.seed, args.seed + (1 if tiny else args.seeds)))
    decision_k = 256 if tiny else 4096
    started = time.time()
    rows = []
    for name in SCENARIOS:
        for k in sizes:
            total = PER_REPLICA_BATCH * k
            for policy in POLICIES:
                runs = []
                for seed in seeds:
                    sc = scenario(name, k, steps, seed)
                    result = run_policy(policy, sc.cluster, steps, total, seed)
                    runs.append({"seed": seed, "reach": reach_per_phase(result, sc.phases),
                                 "adjustments": result.adjustments,
                                 "steady_over_best": result.steady_ratio(),
                                 "steady_noisy_over_best": result.steady_ratio(noisy=True)})
                rows.append({"scenario": name, "replicas": k, "policy": policy, "runs": runs,
                             "steady_over_best": float(max(r["steady_over_best"] for r in runs))})
    homogeneous = {}
    for k in [v for v in sizes if v <= 128]:
        moved = 0
        for seed in range(args.seed, args.seed + (4 if tiny else 40)):
            sc = scenario("homogeneous", k, steps, seed)
            moved += simulate(ModelBasedController(), sc.cluster, steps, seed=seed,
                              global_batch=PER_REPLICA_BATCH * k).adjustments > 0
        homogeneous[k] = {"seeds": 4 if tiny else 40, "moved": int(moved)}
    decisions = {}
    for cls in (ProportionalController, ModelBasedController):
        median, p90, cpu = decision_time_ms(cls, decision_k, args.seed)
        decisions[cls.__name__] = {"replicas": decision_k, "median_ms": median, "p90_ms": p90,
                                   "median_cpu_ms": cpu}
    elapsed = time.time() - started

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Controller benchmark, {when}, seeds {seeds[0]}-{seeds[-1]}, {steps} steps, "
             f"windows of {INTERVAL} steps, B = {PER_REPLICA_BATCH} x K, from the even split. "
             f"'windows to 5%': until the settled split's step time is within {TOLERANCE:.0%} "
             "of the best split's and stays so, median (max) over the seeds, per phase "
             "(interference: start / slowdown / recovery); 'steady / best': the split in force "
             "over the last fifth, worst seed.", "",
             "| scenario | K | policy | windows to 5% | changes | steady / best |",
             "|---|---:|---|---|---:|---:|"]
    for r in rows:
        phases = len(r["runs"][0]["reach"])
        reach = " / ".join(_fmt_reach([run["reach"][i] for run in r["runs"]])
                           for i in range(phases))
        changes = int(np.median([run["adjustments"] for run in r["runs"]]))
        lines.append(f"| {r['scenario']} | {r['replicas']} | {r['policy']} | "
                     f"{reach if r['policy'] not in ('uniform', 'static') else '-'} | "
                     f"{changes} | {r['steady_over_best']:.3f} |")
    lines += ["", "Homogeneous cluster, +-10% noise, default controller: seeds with any move",
              "", "| K | seeds | moved |", "|---:|---:|---:|"]
    lines += [f"| {k} | {h['seeds']} | {h['moved']} |" for k, h in homogeneous.items()]
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
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"date": when, "seeds": seeds, "steps": steps, "tiny": tiny,
                       "python": platform.python_version(), "numpy": np.__version__,
                       "rows": rows, "homogeneous": homogeneous, "decision_time": decisions,
                       "elapsed_s": elapsed}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
