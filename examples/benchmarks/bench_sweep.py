"""Heterogeneity sweep (the source paper's Figure 6 analogue), interference, linear model.

`--scenario heterogeneity` (default): for H = max cap / min cap in `--hs` (default 1..6) at a
constant total capacity (`--total-cap` CPUs over `--workers` workers, caps ~ [1, (1+H)/2, H]),
one cluster run per H, `--repeats` interleaved rounds of three one-epoch phases:
`even` (stock), `static` (cap-proportional: what a FLOPs split gives when capacity is known)
and `dynamic` (`DynamicBatching(initial=--dynamic-initial)`, default "flops": the library's
default, which reads each worker's CPU cap; "uniform" starts from the even split). Each phase is
preceded by switch_margin+1 unmeasured steps on its starting split. The dynamic phase runs
`--dynamic-epochs` epochs (default 3) and its last epoch is reported: its steady state after
the static split landed and the controller and its step-time search settled (its first epoch,
all of that included, is reported beside). Reported: the steady step time (median of the
even/static phase's second half, of the dynamic run's last epoch) and the time per epoch,
normalised to the even run at the first H (H=1 by default), and speed-ups vs even in the same
run. The CNN has 32 filters by default: with 16, a step on this fast CPU is mostly fixed cost.
The ideal step at each H: the equal-finish split under per-worker time models alpha + beta b
fitted to that run's even and static phases, plus the measured remainder (all-reduce etc.).
`--model linear` gives the communication-bound case (expect small gains).

`--scenario interference`: equal caps; worker 0 is slowed 3x by the launcher's schedule
mid-run and recovers. Two cluster runs, static (the cap-proportional split = even here, kept)
and dynamic; reported: step time before / during / after, and the adjustments
`DynamicBatching.history` made to rebalance after each change.

Usage:
    python examples/benchmarks/bench_sweep.py --out /tmp/tf_hetbatch_bench/sweep.json
    python examples/benchmarks/bench_sweep.py --model linear --out /tmp/tf_hetbatch_bench/sweep_linear.json
    python examples/benchmarks/bench_sweep.py --scenario interference --out /tmp/tf_hetbatch_bench/interference.json
    python examples/benchmarks/bench_sweep.py --steps 6      # tiny smoke run (no caps)
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

POLICIES = ("even", "static", "dynamic")
PREP = 9  # switch_margin + 1: the phase's own split is in force from its first step


def sweep_caps(h, workers, total):
    """Caps ~ [1, ..., H] (evenly spaced), scaled to sum to `total`."""
    shape = np.linspace(1.0, h, workers)
    return [float(c) for c in np.round(shape / shape.sum() * total, 4)]


def proportional(batch, caps):
    from tf_hetbatch.core.split import split_proportionally

    return [int(s) for s in split_proportionally(batch, caps, min_sizes=1)]


def sweep_plan(args, caps, tiny):
    epoch = args.steps if tiny else args.epoch_steps
    # The dynamic policy runs `--dynamic-epochs` epochs: its steady state is the last one.
    dyn_epoch = max(epoch, 16) if tiny else epoch * args.dynamic_epochs
    static = proportional(args.batch, caps)
    phases = [{"name": "warmup", "kind": "warmup", "sizes": "even", "steps": 3 if tiny else 8,
               "skip": 0}]
    for r in range(1, args.repeats + 1):
        for policy in (POLICIES if r % 2 else POLICIES[::-1]):
            start = "even" if policy != "static" else static
            phases.append({"name": f"prep {policy} r{r}", "kind": "static", "sizes": start,
                           "steps": PREP, "skip": 0})
            if policy == "dynamic":
                phases.append({"name": f"dynamic r{r}", "kind": "dynamic",
                               "initial": args.dynamic_initial,
                               "steps": dyn_epoch})
            else:
                phases.append({"name": f"{policy} r{r}", "kind": "static", "sizes": start,
                               "steps": epoch, "skip": 0})
    return {"task": "phases", "model": args.model, "filters": args.filters, "batch": args.batch,
            "train_samples": 1280 if tiny else args.train_samples, "seed": args.seed,
            "phases": phases}


def steady_ms(phase):
    secs = np.asarray(phase["step_seconds"])
    return float(np.median(secs[len(secs) // 2:]) * 1e3)


def run_heterogeneity(args, tiny, workdir):
    hs = [float(h) for h in args.hs.split(",")]
    runs = []
    for h in hs:
        caps = sweep_caps(h, args.workers, args.total_cap)
        plan = sweep_plan(args, caps, tiny)
        print(f"H = {h:g}: caps {caps}, static split {proportional(args.batch, caps)}", flush=True)
        result = bc.run_cluster(plan, [None] * len(caps) if tiny else caps, workdir,
                                f"sweep_h{h:g}", args.timeout,
                                cap_after=None if tiny else args.cap_after)
        rounds = []
        for r in range(1, args.repeats + 1):
            row = {"round": r}
            for policy in POLICIES:
                p = next(q for q in result["phases"] if q["name"] == f"{policy} r{r}")
                row[f"{policy}_step_ms"] = steady_ms(p)
                row[f"{policy}_epoch_s"] = p["phase_seconds"]
                row[f"{policy}_sizes"] = p["sizes"]
                if policy == "dynamic":
                    row["dynamic_adjustments"] = p["adjustments"]
                    row["dynamic_search_tries"] = p.get("search_tries", 0)
                    secs = np.asarray(p["step_seconds"])
                    epoch = min(len(secs), args.steps if tiny else args.epoch_steps)
                    if len(secs) > epoch:  # several epochs: the first, then the last
                        row["dynamic_first_epoch_s"] = float(secs[:epoch].sum())
                        row["dynamic_epoch_s"] = float(secs[-epoch:].sum())
                        row["dynamic_step_ms"] = float(np.median(secs[-epoch:]) * 1e3)
            rounds.append(row)
        runs.append({"h": h, "caps": caps, "cap_method": result["cap_method"], "rounds": rounds,
                     "phases": [{k: v for k, v in p.items() if k != "stamps"}
                                for p in result["phases"]]})
    base_step = np.median([r["even_step_ms"] for r in runs[0]["rounds"]])
    base_epoch = np.median([r["even_epoch_s"] for r in runs[0]["rounds"]])
    for run in runs:
        summary = {}
        for policy in POLICIES:
            summary[policy] = {
                "step_ms": bc.stats([r[f"{policy}_step_ms"] for r in run["rounds"]]),
                "epoch_s": bc.stats([r[f"{policy}_epoch_s"] for r in run["rounds"]]),
                "step_norm": bc.stats([r[f"{policy}_step_ms"] / base_step for r in run["rounds"]]),
                "epoch_norm": bc.stats([r[f"{policy}_epoch_s"] / base_epoch
                                        for r in run["rounds"]]),
                "speedup_step": bc.stats([r["even_step_ms"] / r[f"{policy}_step_ms"]
                                          for r in run["rounds"]]),
                "speedup_epoch": bc.stats([r["even_epoch_s"] / r[f"{policy}_epoch_s"]
                                           for r in run["rounds"]]),
            }
        run["summary"] = summary
        run["naive_ceiling"] = float(sum(run["caps"]) / (len(run["caps"]) * min(run["caps"])))
        measured = [p for p in run["phases"] if p["kind"] != "warmup"
                    and not p["name"].startswith("prep")]
        run["ideal"] = bc.ideal_step(measured, len(run["caps"]), args.batch)
        ideal = run["ideal"]["ideal_ms"]
        summary["dynamic"]["over_ideal"] = bc.stats([r["dynamic_step_ms"] / ideal
                                                     for r in run["rounds"]])
        summary["static"]["over_ideal"] = bc.stats([r["static_step_ms"] / ideal
                                                    for r in run["rounds"]])
    return {"hs": hs, "runs": runs, "base_step_ms": float(base_step),
            "base_epoch_s": float(base_epoch)}


def heterogeneity_lines(res, args, when):
    lines = [f"bench_sweep heterogeneity, {when}: {args.workers} workers, caps ~ linspace(1, H) "
             f"summing to {args.total_cap} CPUs, model {args.model}"
             + (f" --filters {args.filters}" if args.model == "cnn" else "")
             + f", B={args.batch}, epoch = {args.epoch_steps} steps, seed {args.seed}, "
             f"{args.repeats} round(s) per H in one cluster run each; median (min-max) over "
             f"rounds. norm = / H={res['hs'][0]:g} even ({res['base_step_ms']:.1f} ms/step, "
             f"{res['base_epoch_s']:.1f} s/epoch); speed-up = even / policy, same round.", ""]
    rows = []
    for run in res["runs"]:
        s = run["summary"]
        rows.append([f"{run['h']:g}", "/".join(f"{c:.2f}" for c in run["caps"]),
                     bc.fmt_stats(s["even"]["step_norm"], digits=2),
                     bc.fmt_stats(s["static"]["step_norm"], digits=2),
                     bc.fmt_stats(s["dynamic"]["step_norm"], digits=2),
                     bc.fmt_stats(s["even"]["epoch_norm"], digits=2),
                     bc.fmt_stats(s["static"]["epoch_norm"], digits=2),
                     bc.fmt_stats(s["dynamic"]["epoch_norm"], digits=2),
                     bc.fmt_stats(s["static"]["speedup_epoch"], digits=2),
                     bc.fmt_stats(s["dynamic"]["speedup_epoch"], digits=2),
                     f"{run['naive_ceiling']:.2f}",
                     bc.fmt_stats(s["static"]["over_ideal"], digits=3),
                     bc.fmt_stats(s["dynamic"]["over_ideal"], digits=3),
                     str(run["rounds"][-1]["dynamic_sizes"])])
    lines += bc.table(["H", "caps", "step even", "step static", "step dyn", "epoch even",
                       "epoch static", "epoch dyn", "epoch speed-up static",
                       "epoch speed-up dyn", "naive ceiling", "step static/ideal",
                       "step dyn/ideal", "dyn split (last round)"], rows)
    first = [(run["h"], [r["dynamic_first_epoch_s"] / r["even_epoch_s"] for r in run["rounds"]])
             for run in res["runs"] if "dynamic_first_epoch_s" in run["rounds"][0]]
    if first:
        lines += ["", f"Dynamic runs {args.dynamic_epochs} epochs from the even split; its "
                      f"columns are the last epoch (steady state). Its first epoch (static split "
                      f"landing, controller and search at work) / even epoch: " + "; ".join(
                          f"H={h:g} {bc.fmt_stats(bc.stats(v), digits=2)}" for h, v in first)
                  + ". Adjustments (rule / search moves, per round): " + "; ".join(
                      f"H={run['h']:g} " + ", ".join(
                          f"{r['dynamic_adjustments']}/{r['dynamic_search_tries']}"
                          for r in run["rounds"]) for run in res["runs"]) + "."]
    worst = max(run["summary"]["dynamic"]["over_ideal"]["median"] for run in res["runs"])
    lines += ["", f"Target: dynamic step within 10% of the ideal at every H: worst median "
                  f"dynamic/ideal {worst:.3f} ({'met' if worst <= 1.10 else 'MISSED'})."]
    return lines + no_harm_lines(res)


def no_harm_spread(run):
    """The even split's own round-to-round spread of its epoch time: half its range over
    its median (what two rounds of the same policy differ by, in this run)."""
    epochs = [r["even_epoch_s"] for r in run["rounds"]]
    return (max(epochs) - min(epochs)) / 2 / float(np.median(epochs))


def no_harm_lines(res):
    """Do no harm: dynamic / even epoch speed, per H, against the even split's own spread.
    Target: >= 0.98 where nothing can be gained (H = 1); at H >= 2, not below the even
    split by more than the spread."""
    lines = ["", "Do no harm (epoch speed dynamic / even, same round; median (min-max) over "
                 "rounds; spread: the even split's own half-range over its median):"]
    rows = []
    for run in res["runs"]:
        ratio = run["summary"]["dynamic"]["speedup_epoch"]
        spread = no_harm_spread(run)
        floor = 0.98 if run["h"] <= 1 else 1.0 - spread
        rows.append([f"{run['h']:g}", bc.fmt_stats(ratio, digits=3), f"{spread * 100:.1f}%",
                     f">= {floor:.3f}", "met" if ratio["median"] >= floor else "MISSED"])
        run["summary"]["no_harm"] = {"ratio": ratio, "spread": spread, "floor": floor}
    return lines + bc.table(["H", "dynamic / even", "even spread", "target", "verdict"], rows)


def run_interference(args, tiny, workdir):
    caps = [args.total_cap / args.workers] * args.workers
    slow_at, recover_at = (None, None) if tiny else (args.cap_after + 1 + args.slow_at,
                                                    args.cap_after + 1 + args.recover_at)
    steps = max(args.steps, 20) if tiny else args.interference_steps
    out = []
    for r in range(1, args.repeats + 1):
        for policy in ("static", "dynamic"):
            phases = [{"name": "warmup", "kind": "warmup", "sizes": "even",
                       "steps": 3 if tiny else 8, "skip": 0}]
            if policy == "static":
                phases.append({"name": "static", "kind": "static",
                               "sizes": proportional(args.batch, caps), "steps": steps,
                               "skip": 0})
            else:
                phases.append({"name": "dynamic", "kind": "dynamic",
                               "initial": args.dynamic_initial,
                               "steps": steps})
            plan = {"task": "phases", "model": args.model, "filters": args.filters,
                    "batch": args.batch, "train_samples": 1280 if tiny else args.train_samples,
                    "seed": args.seed, "phases": phases}
            schedule = None
            if not tiny:
                slowed = caps[0] / args.slowdown
                schedule = f"{slow_at:g}:0={slowed:.4g};{recover_at:g}:0={caps[0]:.4g}"
            print(f"interference round {r}, {policy}: caps {caps}, worker 0 slowed "
                  f"{args.slowdown:g}x from {slow_at} s to {recover_at} s", flush=True)
            result = bc.run_cluster(plan, [None] * len(caps) if tiny else caps, workdir,
                                    f"interference_{policy}_r{r}", args.timeout,
                                    schedule=schedule, cap_after=None if tiny else args.cap_after)
            p = result["phases"][-1]
            stamps, secs = np.asarray(p["stamps"]), np.asarray(p["step_seconds"])
            first = stamps[0] if stamps.size else 0.0
            bounds = [(-np.inf, slow_at), (slow_at, recover_at), (recover_at, np.inf)] \
                if not tiny else [(-np.inf, np.inf)] * 3
            regions = {}
            for name, (lo, hi) in zip(("before", "during", "after"), bounds):
                mask = (stamps >= lo) & (stamps < hi) if not tiny else np.ones(len(secs), bool)
                regions[name] = {"steps": int(mask.sum()),
                                 "median_ms": float(np.median(secs[mask]) * 1e3) if mask.any()
                                 else float("nan"),
                                 "mean_ms": float(np.mean(secs[mask]) * 1e3) if mask.any()
                                 else float("nan")}
            history = p.get("history", [])
            adjust = {"during": [], "after": []}
            for e in history[1:]:
                t = stamps[min(e["step"], len(stamps)) - 1]
                for name, (lo, hi) in zip(("during", "after"), bounds[1:]):
                    if lo <= t < hi:
                        adjust[name].append({"step": e["step"], "t": float(t - lo) if not tiny
                                             else float(t - first), "new": e["new"],
                                             "search": _is_search(e)})
            out.append({"round": r, "policy": policy, "regions": regions,
                        "adjustments": {k: sum(not a["search"] for a in v)
                                        for k, v in adjust.items()},
                        "search_tries": {k: sum(a["search"] for a in v)
                                         for k, v in adjust.items()},
                        "adjustment_log": adjust, "final_sizes": p["sizes"],
                        "total_s": float(secs.sum()), "stamps": stamps.tolist(),
                        "step_seconds": secs.tolist(), "cap_method": result["cap_method"],
                        "history": history})
    return {"caps": caps, "slowdown": args.slowdown, "slow_at_s": slow_at,
            "recover_at_s": recover_at, "steps": steps, "runs": out}


def _is_search(entry):
    """A change made by the controllers' step-time search (a try, a return), not the rule."""
    return entry.get("reason", "").startswith("step-time search")


def _adjustment_cell(log):
    rebalances = [a for a in log if not a.get("search")]
    cell = f"{len(rebalances)}" + (f" (+{rebalances[0]['t']:.1f} s)" if rebalances else "")
    tries = len(log) - len(rebalances)
    return cell + (f", {tries} search" if tries else "")


def interference_lines(res, args, when):
    lines = [f"bench_sweep interference, {when}: {args.workers} workers at "
             f"{res['caps'][0]:.2f} CPU, worker 0 slowed {args.slowdown:g}x at "
             f"{res['slow_at_s']} s, restored at {res['recover_at_s']} s (launcher schedule, "
             f"seconds since start); model {args.model}, B={args.batch}, {res['steps']} steps; "
             f"step times median (mean) ms; adjustments = DynamicBatching.history entries "
             f"in the region made by the rule (first at + seconds after the change), then the "
             f"step-time search's tries.", ""]
    rows = []
    for run in res["runs"]:
        g = run["regions"]
        adj = run["adjustment_log"]
        rows.append([run["round"], run["policy"]] + [
            f"{g[k]['median_ms']:.0f} ({g[k]['mean_ms']:.0f})" for k in ("before", "during", "after")]
            + [_adjustment_cell(adj[k]) for k in ("during", "after")]
            + [f"{run['total_s']:.1f}"])
    lines += bc.table(["round", "policy", "before", "during (slowed)", "after (restored)",
                       "adj. during", "adj. after", "total s"], rows,
                      ["---:", "---"] + ["---:"] * 6)
    by = {p: [r for r in res["runs"] if r["policy"] == p] for p in ("static", "dynamic")}
    if by["static"] and by["dynamic"]:
        sp = bc.stats([s["total_s"] / d["total_s"] for s, d in zip(by["static"], by["dynamic"])])
        res["speedup_total"] = sp
        lines += ["", f"Total time static / dynamic (same steps): {bc.fmt_stats(sp, digits=2)}."]
    return lines


def plot(res, args, png):
    plt = bc.pyplot()
    if args.scenario == "interference":
        fig, ax = plt.subplots(figsize=(9, 4))
        for run in res["runs"]:
            ax.plot(run["stamps"], np.asarray(run["step_seconds"]) * 1e3, lw=0.7,
                    label=f"{run['policy']} r{run['round']}")
            for e in run["history"][1:]:
                ax.axvline(run["stamps"][min(e["step"], len(run["stamps"])) - 1], color="C1",
                           lw=0.4, alpha=0.5)
        if res["slow_at_s"] is not None:
            ax.axvspan(res["slow_at_s"], res["recover_at_s"], color="r", alpha=0.08,
                       label=f"worker 0 slowed {res['slowdown']:g}x")
        ax.set(xlabel="seconds since start", ylabel="step time (ms)", yscale="log",
               title="interference: static vs DynamicBatching (vertical lines: adjustments)")
        ax.legend(fontsize=7)
    else:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        hs = [run["h"] for run in res["runs"]]
        for policy, style in zip(POLICIES, ("k-o", "g-s", "b-^")):
            for ax, key in ((ax1, "step_norm"), (ax2, "epoch_norm")):
                med = [run["summary"][policy][key]["median"] for run in res["runs"]]
                lo = [run["summary"][policy][key]["min"] for run in res["runs"]]
                hi = [run["summary"][policy][key]["max"] for run in res["runs"]]
                ax.errorbar(hs, med, yerr=[np.subtract(med, lo), np.subtract(hi, med)],
                            fmt=style, capsize=3, label=policy)
        ax1.set(xlabel="heterogeneity H = max cap / min cap",
                ylabel="steady step time / H=1 even", title=f"{args.model}: step time")
        ax2.set(xlabel="heterogeneity H = max cap / min cap", ylabel="time per epoch / H=1 even",
                title=f"{args.model}: time per epoch (dynamic: its last)")
        for ax in (ax1, ax2):
            ax.legend()
            ax.grid(alpha=0.3)
    bc.save_figure(fig, png)


def main(argv=None):
    parser = bc.base_parser(__doc__, None,
                            out_help="JSON results (default /tmp/tf_hetbatch_bench/sweep[_linear|"
                             "_interference].json); the PNG goes next to it")
    parser.add_argument("--scenario", choices=["heterogeneity", "interference"],
                        default="heterogeneity")
    parser.add_argument("--steps", type=int, default=None,
                        help="tiny mode: this many steps per phase, H = 3 only, no caps")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved rounds per cluster run (default 2; interference 1; "
                             "tiny 1)")
    parser.add_argument("--model", default="cnn", choices=["cnn", "small_cnn", "linear"])
    parser.add_argument("--filters", type=int, default=None,
                        help="conv filters of --model cnn (default 32; tiny mode 4)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dynamic-initial", default="flops",
                        choices=["flops", "uniform", "probe"],
                        help="DynamicBatching(initial=...) of the dynamic runs (default flops)")
    parser.add_argument("--dynamic-epochs", type=int, default=3,
                        help="epochs of each dynamic run from the even split; the last one is "
                             "reported as its steady state (default 3; tiny mode 1)")
    parser.add_argument("--hs", default=None, help="heterogeneities (default 1,2,3,4,5,6)")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--total-cap", type=float, default=1.5,
                        help="total CPUs over all workers (default 1.5)")
    parser.add_argument("--epoch-steps", type=int, default=50,
                        help="steps per one-epoch phase (default 50: 6400 samples)")
    parser.add_argument("--train-samples", type=int, default=6400)
    parser.add_argument("--interference-steps", type=int, default=None,
                        help="steps of each interference run (default: 600 cnn, ~200 of them after "
                             "the recovery on this machine; 2000 linear)")
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--slow-at", type=float, default=15.0,
                        help="interference: seconds after the measured start (default 15)")
    parser.add_argument("--recover-at", type=float, default=45.0,
                        help="interference: seconds after the measured start (default 45)")
    parser.add_argument("--cap-after", type=float, default=20.0,
                        help="start uncapped, caps this many seconds after the start (default 20)")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    tiny = args.steps is not None
    args.filters = args.filters or (4 if tiny else 32)
    args.repeats = args.repeats or (1 if tiny or args.scenario == "interference" else 2)
    args.hs = args.hs or ("3" if tiny else "1,2,3,4,5,6")
    if args.interference_steps is None:
        args.interference_steps = 2000 if args.model == "linear" else 600
    name = "interference" if args.scenario == "interference" else (
        "sweep" if args.model == "cnn" else f"sweep_{args.model}")
    json_path, png, workdir = bc.out_paths(args.out or os.path.join(bc.DEFAULT_OUT_DIR,
                                                                    f"{name}.json"))
    when = bc.now_utc()
    started = time.time()
    if args.scenario == "interference":
        res = run_interference(args, tiny, workdir)
        lines = interference_lines(res, args, when)
    else:
        res = run_heterogeneity(args, tiny, workdir)
        lines = heterogeneity_lines(res, args, when)
    print("\n" + "\n".join(lines))
    plot(res, args, png)
    bc.write_json(json_path, {"benchmark": "bench_sweep", "scenario": args.scenario,
                              "date": when, "seed": args.seed, "tiny": tiny, "model": args.model,
                              "filters": args.filters, "batch": args.batch,
                              "repeats": args.repeats, **res,
                              "elapsed_s": time.time() - started,
                              "environment": bc.environment(), "png": png})
    print(f"\nJSON: {json_path}\nPNG:  {png}\nTotal {time.time() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
