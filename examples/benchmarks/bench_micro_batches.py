"""Memory-bounded fast worker: micro-batches vs a share capped at the bound vs no bound.

Starts 3 workers on 127.0.0.1 with CPU caps in the ratio 3:5:12 (default 0.15/0.25/0.6 CPU,
cgroup quota with a 10 ms period) and trains `cnn --filters 32` at B = 128. The fast worker's
memory bound (default 48 samples) is below its fair share (about 128 * 12 / 20 = 77). IN ONE
CLUSTER RUN (`hetero_worker.py`, all phases in one process), `--repeats` rounds, the arms in a
seeded random order per round, each a fresh `DynamicBatching()` (library defaults) for
`--steps` steps:

- `unbounded`: no memory bound (the target);
- `micro`: the fast worker bounded at 48 by `set_micro_batch_limits`: its share above 48 is
  computed in micro-batches inside the step;
- `capped`: the share itself capped at 48 by `DynamicBatching(max_sizes=...)`.

The steady state is the second half of each phase (median step time); ratios are taken
within a round (arms minutes apart, so drift between rounds stays out of them).

Usage:
    python examples/benchmarks/bench_micro_batches.py --out /tmp/tf_hetbatch_bench/micro.json
    python examples/benchmarks/bench_micro_batches.py --steps 6 --repeats 1 --caps none,none,none
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

ARMS = ("unbounded", "micro", "capped")


def make_plan(args, rng):
    k = len(args.caps.split(","))
    bound = [0] * (k - 1) + [args.bound]  # the last worker is the fast one
    phases = [{"name": "warmup", "kind": "warmup", "sizes": "even", "steps": 10, "skip": 0}]
    for r in range(1, args.repeats + 1):
        for arm in rng.permutation(ARMS):
            phase = {"name": f"{arm} r{r}", "kind": "dynamic", "initial": "flops",
                     "steps": args.steps, "micro_batch_limits": [0] * k}
            if arm == "micro":
                phase["micro_batch_limits"] = bound
            elif arm == "capped":
                phase["max_sizes"] = [args.batch] * (k - 1) + [args.bound]
            phases.append(phase)
    return {"task": "phases", "model": "cnn", "filters": args.filters, "batch": args.batch,
            "train_samples": args.train_samples, "micro_batch_limits": [0] * k,
            "phases": phases}


def analyse(result, repeats):
    by_name = {p["name"]: p for p in result["phases"]}
    rounds = []
    for r in range(1, repeats + 1):
        row = {arm: by_name[f"{arm} r{r}"]["step_ms_median"] for arm in ARMS}
        row["splits"] = {arm: by_name[f"{arm} r{r}"].get("settled_sizes") for arm in ARMS}
        row["micro_over_unbounded"] = row["micro"] / row["unbounded"]
        row["micro_over_capped"] = row["micro"] / row["capped"]
        rounds.append(row)
    return rounds


def main(argv=None):
    parser = bc.base_parser(__doc__, os.path.join(bc.DEFAULT_OUT_DIR, "micro_batches.json"))
    parser.add_argument("--caps", default="0.15,0.25,0.6",
                        help="CPU cap per worker, the fast one last (default 0.15,0.25,0.6)")
    parser.add_argument("--bound", type=int, default=48, help="the fast worker's bound")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--filters", type=int, default=32)
    parser.add_argument("--steps", type=int, default=120, help="steps per phase")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--train-samples", type=int, default=12800)
    parser.add_argument("--cap-after", type=float, default=20.0)
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    caps = [None if c.strip().lower() == "none" else float(c) for c in args.caps.split(",")]
    rng = np.random.default_rng(args.seed)
    json_path, _, workdir = bc.out_paths(args.out)
    plan = make_plan(args, rng)
    when, started = bc.now_utc(), time.time()
    print(f"bench_micro_batches: caps {args.caps}, bound {args.bound}, B {args.batch}",
          flush=True)
    capped = any(c is not None for c in caps)
    result = bc.run_cluster(plan, caps, workdir, "micro_batches", args.timeout,
                            cap_after=args.cap_after if capped else None)
    rounds = analyse(result, args.repeats)
    rows = [[str(i + 1)] + [f"{r[a]:.1f}" for a in ARMS]
            + [f"{r['micro_over_unbounded']:.3f}", f"{r['micro_over_capped']:.3f}",
               " ; ".join(f"{a} {r['splits'][a]}" for a in ARMS)]
            for i, r in enumerate(rounds)]
    lines = bc.table(["round"] + [f"{a} ms" for a in ARMS]
                     + ["micro / unbounded", "micro / capped", "settled splits"], rows)
    over_unbounded = float(np.median([r["micro_over_unbounded"] for r in rounds]))
    over_capped = float(np.median([r["micro_over_capped"] for r in rounds]))
    goals = {"micro_within_10pct_of_unbounded": bool(over_unbounded <= 1.10),
             "micro_faster_than_capped": bool(over_capped < 1.0),
             "micro_over_unbounded_median": over_unbounded,
             "micro_over_capped_median": over_capped}
    lines += ["", f"Median over rounds: micro / unbounded = {over_unbounded:.3f} (target "
              f"<= 1.10), micro / capped = {over_capped:.3f} (target < 1)."]
    print("\n" + "\n".join(lines))
    bc.write_json(json_path, {
        "benchmark": "bench_micro_batches", "date": when, "seed": args.seed, "caps": caps,
        "bound": args.bound, "batch": args.batch, "filters": args.filters,
        "steps": args.steps, "repeats": args.repeats, "cap_method": result["cap_method"],
        "rounds": rounds, "goals": goals,
        "phases": [{k: v for k, v in p.items() if k not in ("stamps",)}
                   for p in result["phases"]],
        "elapsed_s": time.time() - started, "environment": bc.environment()})
    print(f"\nJSON: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
