"""Multi-worker heterogeneity benchmark: even vs best static vs DynamicBatching vs ideal.

Starts K workers on 127.0.0.1 with CPU caps (default 0.8/0.2: ratio 4:1, cgroup quota with a
10 ms period) and trains `cnn --filters 32` at B=128 (per-sample compute outweighs the fixed
per-step cost). IN ONE CLUSTER RUN (`hetero_worker.py`, all phases in one
process, so conditions are equal), repeated `--repeats` rounds, interleaved:

1. even split (the stock behaviour);
2. static search: a grid of splits b_k ~ cap_k ** p (p from 0 = even upwards), each set with
   `set_batch_sizes`, the switch lag skipped, the median step time measured;
3. the best static split of that round's grid, measured again;
4. `DynamicBatching(initial="uniform")` from the even split (the source paper's protocol);
5. `DynamicBatching()` with the library defaults (initial="flops": under cgroup caps the
   nominal capacity already reflects the caps, so it starts cap-proportional);
6. head to head: the splits the two dynamic phases settled on and the round's best static
   split, each set as a fixed split, in short blocks in a seeded random order per block
   (`--h2h-blocks`). Phase medians of different phases differ by 10-30% for the same split on
   a shared machine (drift between phases minutes apart); the ratio of adjacent blocks does
   not carry that drift, so "dynamic's split vs the best static split" is read from it, as a
   median over blocks with a 90% bootstrap interval.

From the grid's per-replica busy times it fits t_k = alpha_k + beta_k * b_k and computes the
ideal step time: the equal-finish split's time under those models plus the measured
remainder (step time - max busy: all-reduce and fixed per-step work outside the busy time).
Ratios are speed-ups against the even split of the same round.

Usage:
    python examples/benchmarks/bench_hetero.py --out /tmp/tf_hetbatch_bench/hetero.json
    python examples/benchmarks/bench_hetero.py --steps 4     # tiny smoke run (no caps)
    python examples/benchmarks/bench_hetero.py --layout 1,2 --caps 0.24,0.96  # 2 replicas on one
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

EXPONENTS = (0.5, 1.0, 1.25, 1.5, 2.0, 2.5)
EXPONENTS_TINY = (1.0, 2.0)
# Head-to-head arms: the phase whose settled split each arm runs (the first is the reference).
ARMS = ("best", "dynamic", "dyn-defaults")


def grid_splits(batch, caps, exponents, min_size=1):
    """Splits b_k ~ cap_k ** p for each exponent p (distinct, each >= min_size)."""
    from tf_hetbatch.core.split import split_proportionally  # pure Python

    seen, out = set(), []
    for p in exponents:
        sizes = tuple(int(s) for s in split_proportionally(
            batch, np.asarray(caps, float) ** p, min_sizes=min_size))
        if sizes not in seen:
            seen.add(sizes)
            out.append(list(sizes))
    return out


def make_plan(args, caps, tiny):
    rng = np.random.default_rng(args.seed)
    steps = args.steps if tiny else 24
    # Long enough for the controller to settle (~60 steps) and its step-time search to try
    # the neighbouring splits (~70): the second half is the steady state measured.
    dyn_steps = 16 if tiny else 240
    grid = grid_splits(args.batch, caps, EXPONENTS_TINY if tiny else EXPONENTS)
    phases = [{"name": "warmup", "kind": "warmup", "sizes": "even", "steps": 3 if tiny else 10,
               "skip": 0}]
    for r in range(1, args.repeats + 1):
        phases.append({"name": f"even r{r}", "kind": "static", "sizes": "even", "steps": steps})
        for sizes in grid:
            phases.append({"name": f"grid r{r} {'/'.join(map(str, sizes))}", "kind": "static",
                           "sizes": sizes, "steps": steps})
        phases.append({"name": f"best r{r}", "kind": "static", "sizes": "best",
                       "best_of": f"grid r{r} ", "steps": steps})
        phases.append({"name": f"dynamic r{r}", "kind": "dynamic", "initial": "uniform",
                       "steps": dyn_steps})
        if not tiny:
            phases.append({"name": f"dyn-defaults r{r}", "kind": "dynamic", "initial": "flops",
                           "steps": dyn_steps})
        for block in range(1, args.h2h_blocks + 1):
            for arm in rng.permutation(ARMS[:2] if tiny else ARMS):
                phases.append({"name": f"h2h r{r} {arm} b{block}", "kind": "static",
                               "sizes": "of", "of": f"{arm} r{r}", "steps": steps})
    return {"task": "phases", "model": args.model, "filters": args.filters,
            "batch": args.batch, "train_samples": 1280 if tiny else args.train_samples,
            "seed": args.seed, "phases": phases}, grid


def head_to_head(phases, seed):
    """Per arm: its split(s), block step times, and the ratio to the "best" arm's block next
    to it (same round and block number), median with a 90% bootstrap interval."""
    blocks, splits = {}, {}
    for p in phases:
        if p["name"].startswith("h2h "):
            _, rnd, arm, block = p["name"].split()
            blocks.setdefault((rnd, block), {})[arm] = p["step_ms_median"]
            splits.setdefault(arm, [])
            if p["sizes"] not in splits[arm]:
                splits[arm].append(p["sizes"])
    rng = np.random.default_rng(seed)
    out = {}
    for arm in (a for a in ARMS if a in splits):
        out[arm] = {"sizes": splits[arm],
                    "step_ms": bc.stats([b[arm] for b in blocks.values() if arm in b]),
                    "over_best": bc.ratio_stats([b[arm] / b["best"] for b in blocks.values()
                                                 if arm in b and "best" in b], rng)}
    return out


def verdict(ratio):
    """'met' (median <= 1), 'tie' (the 90% interval reaches 1) or 'MISSED' for a ratio to the
    best static split."""
    if ratio["median"] is None:
        return "n/a"
    if ratio["median"] <= 1.0:
        return "met"
    return "tie" if ratio.get("ci90", [ratio["median"]])[0] <= 1.0 else "MISSED"


def _round_of(name):
    return name.split(" r")[-1].split()[0]


def analyse(result, caps, batch, seed):
    phases = [p for p in result["phases"] if p["kind"] != "warmup"]
    k = len(caps)
    rounds = sorted({_round_of(p["name"]) for p in phases})
    per_round = []
    for r in rounds:
        mine = {p["name"].split(" r")[0]: p for p in phases if _round_of(p["name"]) == r
                and not p["name"].startswith(("grid", "h2h"))}
        even = mine["even"]["step_ms_median"]
        row = {"round": int(r), "even_ms": even,
               "best_ms": mine["best"]["step_ms_median"], "best_sizes": mine["best"]["sizes"],
               "dynamic_ms": mine["dynamic"]["step_ms_median"],
               "dynamic_sizes": mine["dynamic"]["settled_sizes"],
               "dynamic_adjustments": mine["dynamic"]["adjustments"],
               "dynamic_search_tries": mine["dynamic"].get("search_tries", 0),
               "dynamic_phase_mean_ms": mine["dynamic"]["step_ms_mean"],
               "dynamic_steps": mine["dynamic"]["steps"]}
        if "dyn-defaults" in mine:
            row.update(defaults_ms=mine["dyn-defaults"]["step_ms_median"],
                       defaults_sizes=mine["dyn-defaults"]["settled_sizes"],
                       defaults_adjustments=mine["dyn-defaults"]["adjustments"],
                       defaults_search_tries=mine["dyn-defaults"].get("search_tries", 0),
                       defaults_initial=mine["dyn-defaults"]["history"][0]["new"]
                       if mine["dyn-defaults"]["history"] else None)
        per_round.append(row)
    # The time models are fitted to the grid (and even, best) phases only: the head-to-head
    # blocks would weight the fit towards two or three splits.
    ideal = bc.ideal_step([p for p in phases if not p["name"].startswith("h2h")], k, batch)
    grid = {}
    for p in phases:
        if p["name"].startswith("grid") or p["name"].startswith("even"):
            grid.setdefault(tuple(p["sizes"]), []).append(p["step_ms_median"])
    return {
        "rounds": per_round,
        "time_model": {key: ideal[key] for key in ("alpha_ms", "beta_ms_per_sample", "points")},
        **{key: ideal[key] for key in ("remainder_ms", "ideal_split", "ideal_busy_ms", "ideal_ms")},
        "naive_ceiling": float(sum(caps) / (k * min(caps))) if all(caps) else None,
        "grid": [{"sizes": list(s), "step_ms": v} for s, v in grid.items()],
        "head_to_head": head_to_head(phases, seed),
    }


def report(a, args, caps, result, when):
    rounds = a["rounds"]
    keys = ("even_ms", "best_ms", "dynamic_ms") + (
        ("defaults_ms",) if "defaults_ms" in rounds[0] else ())
    s = {key: bc.stats([r[key] for r in rounds]) for key in keys}
    speed = {key: bc.stats([r["even_ms"] / r[key] for r in rounds]) for key in s}
    ideal = a["ideal_ms"]
    hosted = f" hosting {args.layout} replicas" if args.layout else ""
    lines = [f"bench_hetero, {when}: {len(caps)} workers{hosted}, caps {caps} "
             f"({result['cap_method']}), "
             f"model {args.model} --filters {args.filters}, B={args.batch}, seed {args.seed}, "
             f"{len(rounds)} round(s) in one cluster run; median (min-max) over rounds; "
             f"speed-up = even step time / step time, same round.", ""]
    rows = [["even split (stock)", bc.fmt_stats(s["even_ms"], digits=1), "1.00", "even"]]
    rows.append(["best static (grid search)", bc.fmt_stats(s["best_ms"], digits=1),
                 bc.fmt_stats(speed["best_ms"], digits=2),
                 " ; ".join(sorted({str(r["best_sizes"]) for r in rounds}))])
    rows.append(["DynamicBatching(initial='uniform')", bc.fmt_stats(s["dynamic_ms"], digits=1),
                 bc.fmt_stats(speed["dynamic_ms"], digits=2),
                 " ; ".join(str(r["dynamic_sizes"]) for r in rounds)
                 + f" ({'/'.join(str(r['dynamic_adjustments']) for r in rounds)} adj., "
                 f"{'/'.join(str(r['dynamic_search_tries']) for r in rounds)} search)"])
    if "defaults_ms" in s:
        rows.append(["DynamicBatching() defaults (flops start)",
                     bc.fmt_stats(s["defaults_ms"], digits=1),
                     bc.fmt_stats(speed["defaults_ms"], digits=2),
                     " ; ".join(str(r["defaults_sizes"]) for r in rounds)
                     + f" (start {rounds[0]['defaults_initial']}, "
                     f"{'/'.join(str(r['defaults_adjustments']) for r in rounds)} adj., "
                     f"{'/'.join(str(r['defaults_search_tries']) for r in rounds)} search)"])
    rows.append(["ideal (fitted models + remainder)", f"{ideal:.1f}",
                 f"{s['even_ms']['median'] / ideal:.2f}",
                 "[" + ", ".join(f"{b:.1f}" for b in a["ideal_split"]) + "]"])
    if a["naive_ceiling"]:
        rows.append(["naive ceiling sum X / (K min X)", "-", f"{a['naive_ceiling']:.2f}", "-"])
    lines += bc.table(["policy", "step ms", "speed-up vs even", "split"], rows,
                      ["---", "---:", "---:", "---"])
    tm = a["time_model"]
    lines += ["", "Fitted busy-time models t_k = alpha_k + beta_k b_k (ms): " + "; ".join(
        f"replica {j}: {tm['alpha_ms'][j]:.1f} + {tm['beta_ms_per_sample'][j]:.2f} b"
        for j in range(len(tm["alpha_ms"]))) + f"; remainder (step - max busy) {a['remainder_ms']:.1f} ms.",
              "", "Static grid (median step ms per round): " + "; ".join(
                  f"{'/'.join(map(str, g['sizes']))}: " + ",".join(f"{v:.0f}" for v in g["step_ms"])
                  for g in a["grid"])]
    whole = bc.stats([r["dynamic_phase_mean_ms"] for r in rounds])
    lines += ["", f"Whole DynamicBatching(initial='uniform') phase, start-up and search included "
              f"({rounds[0]['dynamic_steps']} steps from the even split): mean "
              f"{bc.fmt_stats(whole, digits=1)} ms/step."]
    h2h = a["head_to_head"]
    if h2h:
        first = next(p for p in result["phases"] if p["name"].startswith("h2h"))
        lines += ["", "Head to head (settled splits set as fixed splits, blocks of "
                  f"{first['steps']} steps ({first['steps'] - first['skip']} measured after "
                  "the switch) in random order; block median step ms, "
                  "median (min-max) over blocks; ratio to the best static split's block next "
                  "to it, median [90% bootstrap interval]):", ""]
        lines += bc.table(
            ["split of", "split", "step ms", "ratio to best static"],
            [[arm, " ; ".join(map(str, h["sizes"])), bc.fmt_stats(h["step_ms"], digits=1),
              bc.fmt_ratio(h["over_best"]) if arm != "best" else "1"]
             for arm, h in h2h.items()], ["---", "---", "---:", "---:"])
    dyn_phase_vs_best = s["dynamic_ms"]["median"] / s["best_ms"]["median"]
    dyn_vs_ideal = s["dynamic_ms"]["median"] / ideal
    ratio = h2h.get("dynamic", {}).get("over_best", bc.stats([]))
    goals = {"dynamic_split_over_best_static": ratio,
             "dynamic_split_vs_best_static": verdict(ratio),
             "dynamic_phase_over_best_static": dyn_phase_vs_best,
             "dynamic_within_10pct_of_ideal": bool(dyn_vs_ideal <= 1.10),
             "dynamic_over_ideal": dyn_vs_ideal}
    if "dyn-defaults" in h2h:
        goals["defaults_split_over_best_static"] = h2h["dyn-defaults"]["over_best"]
        goals["defaults_split_vs_best_static"] = verdict(h2h["dyn-defaults"]["over_best"])
    lines += ["", f"Goals: DynamicBatching's split / best static split = "
              f"{bc.fmt_ratio(ratio)} ({goals['dynamic_split_vs_best_static']}: <= 1; 'tie' = "
              f"the interval reaches 1); dynamic / ideal = {dyn_vs_ideal:.3f} "
              f"({'met' if goals['dynamic_within_10pct_of_ideal'] else 'MISSED'}: <= 1.10). "
              f"Phase medians (minutes apart, drift included): dynamic phase / best static "
              f"phase = {dyn_phase_vs_best:.3f}."]
    return lines, s, speed, goals


def plot(a, result, png, caps):
    plt = bc.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    phases = [p for p in result["phases"]
              if p["kind"] == "dynamic" and p["name"].startswith("dynamic")]
    for p in phases:
        ax1.plot(np.arange(1, len(p["step_seconds"]) + 1), np.array(p["step_seconds"]) * 1e3,
                 lw=0.8, label=p["name"])
    r = a["rounds"]
    for key, label, style in (("even_ms", "even (median)", "k--"),
                              ("best_ms", "best static", "g:")):
        ax1.axhline(np.median([x[key] for x in r]), color=style[0], ls=style[1:], label=label)
    ax1.axhline(a["ideal_ms"], color="r", ls="-.", label="ideal")
    ax1.set(xlabel="step of the dynamic phase", ylabel="step time (ms)",
            title="DynamicBatching from the even split", yscale="log")
    ax1.legend(fontsize=7)
    tm = a["time_model"]
    for j in range(len(caps)):
        pts = [(p["busy"]["samples_per_step"][j], p["busy"]["time_per_step"][j] * 1e3)
               for p in result["phases"] if p["kind"] == "static" and p.get("busy")]
        xs = np.array([q[0] for q in pts])
        ax2.scatter(xs, [q[1] for q in pts], s=12, label=f"replica {j} (cap {caps[j]:.3g})")
        grid = np.linspace(0, max(xs.max(), 1), 50)
        ax2.plot(grid, tm["alpha_ms"][j] + tm["beta_ms_per_sample"][j] * grid, lw=0.8)
    ax2.set(xlabel="samples per step b_k", ylabel="busy ms per step",
            title="measured busy time and fitted alpha + beta b")
    ax2.legend(fontsize=7)
    bc.save_figure(fig, png)


def main(argv=None):
    parser = bc.base_parser(__doc__, os.path.join(bc.DEFAULT_OUT_DIR, "hetero.json"),
                            out_help="JSON results; the PNG goes next to it")
    parser.add_argument("--steps", type=int, default=None,
                        help="tiny mode: this many steps per static phase, 1 round, no caps")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved rounds in the one cluster run (default 2; tiny 1)")
    parser.add_argument("--caps", default=None,
                        help="CPU cap per worker (default 0.8,0.2; tiny: none,none)")
    parser.add_argument("--layout", default="",
                        help="replicas (logical CPUs) per worker, e.g. 1,2: a worker hosting 2 "
                             "replicas under its one cap (default: one each)")
    parser.add_argument("--model", default="cnn", choices=["cnn", "small_cnn", "linear"])
    parser.add_argument("--filters", type=int, default=None,
                        help="conv filters of --model cnn (default 32; tiny mode 4)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--train-samples", type=int, default=12800)
    parser.add_argument("--cap-after", type=float, default=20.0,
                        help="start uncapped, apply the caps this many seconds after the "
                             "start, before the measured phases (default 20)")
    parser.add_argument("--h2h-blocks", type=int, default=None,
                        help="head-to-head blocks per arm and round (default 6; tiny 1)")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    tiny = args.steps is not None
    args.filters = args.filters or (4 if tiny else 32)
    args.repeats = args.repeats or (1 if tiny else 2)
    if args.h2h_blocks is None:
        args.h2h_blocks = 1 if tiny else 6
    if args.h2h_blocks < 0:
        parser.error(f"--h2h-blocks must be >= 0 (0 skips the head to head), got "
                     f"{args.h2h_blocks}")
    caps_text = args.caps or ("none,none" if tiny else "0.8,0.2")
    caps = [None if c.strip().lower() == "none" else float(c) for c in caps_text.split(",")]
    counts = [int(c) for c in args.layout.split(",")] if args.layout else [1] * len(caps)
    if len(counts) != len(caps):
        parser.error(f"--layout names {len(counts)} workers and --caps {len(caps)}")
    # Per replica: its worker's cap shared by the worker's replicas.
    nominal = [(c if c is not None else 1.0) / n for c, n in zip(caps, counts) for _ in range(n)]
    json_path, png, workdir = bc.out_paths(args.out)
    # Tiny mode runs uncapped; its grid still uses a 4:1 shape so the grid has distinct splits.
    shape = [0.8, 0.2] if tiny and None in caps and len(nominal) == 2 else nominal
    plan, grid = make_plan(args, shape, tiny)
    plan["layout"] = args.layout
    when = bc.now_utc()
    print(f"bench_hetero: {len(caps)} workers, caps {caps_text}"
          f"{f', hosting {args.layout} replicas' if args.layout else ''}, grid {grid}", flush=True)
    started = time.time()
    result = bc.run_cluster(plan, caps, workdir, "hetero", args.timeout,
                            cap_after=None if tiny else args.cap_after)
    a = analyse(result, nominal, args.batch, args.seed)
    lines, s, speed, goals = report(a, args, caps, result, when)
    print("\n" + "\n".join(lines))
    plot(a, result, png, nominal)
    bc.write_json(json_path, {
        "benchmark": "bench_hetero", "date": when, "seed": args.seed, "tiny": tiny,
        "caps": caps, "layout": args.layout, "replica_shares": nominal, "model": args.model, "filters": args.filters, "batch": args.batch,
        "repeats": args.repeats, "cap_method": result["cap_method"], "data": result["data"],
        "step_ms": s, "speedup_vs_even": speed, "goals": goals, **a,
        "phases": [{k: v for k, v in p.items() if k not in ("stamps",)} for p in result["phases"]],
        "elapsed_s": time.time() - started, "environment": bc.environment(), "png": png})
    print(f"\nJSON: {json_path}\nPNG:  {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
