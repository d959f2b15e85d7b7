"""Input work under the split: each worker decodes its own samples (new) vs every sample (old).

Trains `cnn --filters 32` at B = 128 from PNG TFRecords of Fashion-MNIST through
`TFRecordDataset.shuffle(n, seed).map(decode [+ augment], AUTOTUNE).batch(B)`
(`examples/fashion_mnist.py`), on two local clusters with real CPU caps (cgroup quota, 10 ms
period), one launch each, every phase of a cluster in ONE process per worker
(`input_worker.py`):

* 2 workers capped 0.8 / 0.2, fixed uneven split [118, 10];
* 3 workers capped 0.24 / 0.4 / 0.96 (3:5:12), fixed uneven split [15, 30, 83].

Per cluster and round (`--repeats`), in a seeded random order of the four blocks
(light = PNG decode only, heavy = decode + resize 96 + random crop 84 + flip + resize 28;
old = `strategy.split_input_work = False`, every worker decodes every sample; new = each worker
decodes only its own replicas' samples), each block runs three phases: the even split, the
fixed uneven split, `DynamicBatching()` with the library defaults (its second half measured).
Every phase reports the median step time and, per worker, its compute time per step
(`read_replica_times`) and its input work per step (an `InputMeter` in the pipeline: the
per-sample map's summed time, samples and bytes), against its share of the global batch.

The 2-worker cluster also runs the reference of issue 16: the heavy pipeline at [118, 10]
where the capped worker decodes nothing at all (its map looks up pre-decoded images in
memory; the raw global batches are the same), in `--h2h-blocks` pairs of short blocks with the
new path at the same split, in random order; the ratio of the blocks of a pair (drift
between phases minutes apart cancels) is read as a median with a 90% bootstrap interval.

Last, read amplification: one pass over a finite pipeline of `--amp-samples` records at the
fixed split, through the strategy's distributed dataset (no training): per worker, the bytes
of the records it read (every record: every worker reads the whole files) against the bytes of
its own samples' records, and the process's `/proc/self/io` rchar delta.

Usage:
    python examples/benchmarks/bench_input.py --out /tmp/tf_hetbatch_bench/input.json
    python examples/benchmarks/bench_input.py --steps 4     # tiny smoke run (no caps)

Targets (issue 16), measured, not tuned for: heavy, 0.8/0.2, [118, 10]: new path's step
<= 1.15x the reference's; `DynamicBatching()` >= 2.2x faster than the even split on the heavy
pipeline; light pipeline: the new path no slower than the old one.
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

INPUT_WORKER = os.path.join(bc.HERE, "input_worker.py")
CLUSTERS = (
    {"name": "2 workers", "key": "w2", "caps": [0.8, 0.2], "fixed": [118, 10], "reference": True},
    {"name": "3 workers", "key": "w3", "caps": [0.24, 0.4, 0.96], "fixed": [15, 30, 83],
     "reference": False},
)
PIPELINES = ("light", "heavy")
PATHS = ("unsplit", "split")
PATH_NAMES = {"unsplit": "old (every worker decodes all)", "split": "new (own samples only)"}
POLICIES = ("even", "fixed", "dynamic")
TARGET_REFERENCE = 1.15
TARGET_DYNAMIC = 2.2


def make_plan(args, cluster, tiny):
    rng = np.random.default_rng(args.seed)
    steps = args.steps if tiny else 24
    dyn_steps = 8 if tiny else args.dynamic_steps
    fixed = cluster["fixed"]
    phases = [{"name": "warmup", "kind": "warmup", "pipeline": "heavy", "input_work": "split",
               "sizes": "even", "steps": 3 if tiny else 10, "skip": 0}]
    # Tiny mode (a smoke test of every code path) leaves out the 3-worker light blocks.
    pipelines = ("heavy",) if tiny and not cluster["reference"] else PIPELINES
    for r in range(1, args.repeats + 1):
        blocks = [(p, w) for p in pipelines for w in PATHS]
        for i in rng.permutation(len(blocks)):
            pipeline, path = blocks[i]
            base = {"pipeline": pipeline, "input_work": path}
            phases.append({**base, "name": f"r{r} {pipeline} {path} even", "kind": "static",
                           "sizes": "even", "steps": steps})
            phases.append({**base, "name": f"r{r} {pipeline} {path} fixed", "kind": "static",
                           "sizes": fixed, "steps": steps})
            phases.append({**base, "name": f"r{r} {pipeline} {path} dynamic", "kind": "dynamic",
                           "steps": dyn_steps})
        if cluster["reference"]:
            for block in range(1, args.h2h_blocks + 1):
                for arm in rng.permutation(["heavy", "reference"]):
                    phases.append({"name": f"r{r} h2h {arm} b{block}", "kind": "static",
                                   "pipeline": arm, "input_work": "split", "sizes": fixed,
                                   "steps": steps})
    # The fixed split is in force switch_margin (8) trained steps after it is set: train
    # that long at it first, so the pass's batches (keyed from the steps trained) all get it.
    phases.append({"name": "amplification set-up", "kind": "static", "pipeline": "heavy",
                   "input_work": "split", "sizes": fixed, "steps": 10, "skip": 9})
    phases.append({"name": "amplification", "kind": "epoch", "pipeline": "heavy",
                   "input_work": "split", "samples": 640 if tiny else args.amp_samples})
    return {"task": "input", "model": "cnn", "filters": args.filters, "batch": args.batch,
            "train_samples": 640 if tiny else args.train_samples, "seed": args.seed,
            "shuffle_buffer": args.shuffle_buffer,
            "decode_free": [int(np.argmin(cluster["caps"]))], "phases": phases}


def _phase_key(name):
    """(round, pipeline, path, policy) of a block phase's name, else None."""
    parts = name.split()
    if len(parts) == 4 and parts[0].startswith("r") and parts[1] in PIPELINES:
        return int(parts[0][1:]), parts[1], parts[2], parts[3]
    return None


def _mean_busy(phases, field, scale=1.0):
    """Per-replica mean over phases of a busy-time field, or None if none was measured."""
    rows = [p["busy"][field] for p in phases if p.get("busy")]
    return (np.mean(rows, axis=0) * scale).tolist() if rows else None


def analyse_cluster(result, cluster, batch, seed):
    phases = result["phases"]
    k = len(cluster["caps"])
    cells = {}
    for p in phases:
        key = _phase_key(p["name"])
        if key is not None:
            cells.setdefault(key[1:], []).append(p)
    steps = {}
    for (pipeline, path, policy), ps in cells.items():
        entry = {"step_ms": bc.stats([p["step_ms_median"] for p in ps]),
                 "per_round_ms": [p["step_ms_median"] for p in ps],
                 "sizes": [p.get("settled_sizes") or p.get("sizes") for p in ps],
                 "busy_ms": _mean_busy(ps, "time_per_step", 1e3),
                 "busy_samples": _mean_busy(ps, "samples_per_step"),
                 "input": {f: np.nanmean([p["input"][f] for p in ps], axis=0).tolist()
                           for f in ps[0]["input"]}}
        if policy == "dynamic":
            entry["adjustments"] = [p.get("adjustments", 0) for p in ps]
            entry["initial_sizes"] = ps[0].get("initial_sizes")
        steps.setdefault(pipeline, {}).setdefault(path, {})[policy] = entry

    def paired(num, den):
        """Per-round ratios of two cells' phase medians (same round)."""
        a, b = num["per_round_ms"], den["per_round_ms"]
        return bc.stats([x / y for x, y in zip(a, b)])

    ratios = {}
    for pipeline in steps:
        s = steps[pipeline]
        if "split" in s and "unsplit" in s:
            ratios[pipeline] = {
                "new_over_old": {pol: paired(s["split"][pol], s["unsplit"][pol])
                                 for pol in POLICIES if pol in s["split"] and pol in s["unsplit"]},
                "even_over_dynamic_new": paired(s["split"]["even"], s["split"]["dynamic"]),
                "even_old_over_dynamic_new": paired(s["unsplit"]["even"], s["split"]["dynamic"]),
                "even_over_dynamic_old": paired(s["unsplit"]["even"], s["unsplit"]["dynamic"]),
            }
    out = {"name": cluster["name"], "caps": cluster["caps"], "fixed": cluster["fixed"],
           "cap_method": result["cap_method"], "data": result["data"], "steps": steps,
           "ratios": ratios}
    h2h = {}
    for p in phases:
        parts = p["name"].split()
        if len(parts) == 4 and parts[1] == "h2h":
            h2h.setdefault((parts[0], parts[3]), {})[parts[2]] = p
    if h2h:
        rng = np.random.default_rng(seed)
        pairs = [v for v in h2h.values() if "heavy" in v and "reference" in v]
        out["reference"] = {
            "reference_ms": bc.stats([v["reference"]["step_ms_median"] for v in pairs]),
            "new_ms": bc.stats([v["heavy"]["step_ms_median"] for v in pairs]),
            "new_over_reference": bc.ratio_stats(
                [v["heavy"]["step_ms_median"] / v["reference"]["step_ms_median"] for v in pairs],
                rng),
            "reference_input_ms": np.mean([np.array(v["reference"]["input"]["seconds"]) * 1e3
                                           for v in pairs], axis=0).tolist(),
            "new_input_ms": np.mean([np.array(v["heavy"]["input"]["seconds"]) * 1e3
                                     for v in pairs], axis=0).tolist(),
            "blocks": len(pairs)}
    amp = next((p for p in phases if p["kind"] == "epoch"), None)
    if amp is not None:
        inp = amp["input"]
        out["amplification"] = {
            "sizes": amp["sizes"], "records": amp["samples"], "file_bytes": amp["file_bytes"],
            "global_batches": amp["global_batches"],
            "read_bytes": inp["read_bytes"], "own_bytes": inp["own_bytes"],
            "own_samples": inp["samples"], "rchar": inp["rchar"],
            "read_over_own": [r / o if o else None for r, o in zip(inp["read_bytes"],
                                                                    inp["own_bytes"])],
            "rchar_over_own": [r / o if o else None for r, o in zip(inp["rchar"],
                                                                     inp["own_bytes"])],
            "batch_over_share": [batch / b if b else None for b in amp["sizes"]]}
    return out


def report(analyses, args, when):
    lines = [f"bench_input, {when}: cnn --filters {args.filters}, B={args.batch}, seed "
             f"{args.seed}, {args.repeats} round(s) per cluster; step ms = median of the "
             "measured steps of a phase, median (min-max) over rounds. old = every worker "
             "decodes every sample (`split_input_work = False`), new = own samples only. "
             "light = PNG decode; heavy = decode + resize 96 + random crop 84 + flip + "
             "resize 28.", ""]
    rows = []
    for a in analyses:
        for pipeline in PIPELINES:
            for path in PATHS:
                cell = a["steps"].get(pipeline, {}).get(path)
                if not cell:
                    continue
                dyn = cell["dynamic"]
                rows.append([a["name"], pipeline, PATH_NAMES[path],
                             bc.fmt_stats(cell["even"]["step_ms"], digits=1),
                             bc.fmt_stats(cell["fixed"]["step_ms"], digits=1),
                             bc.fmt_stats(dyn["step_ms"], digits=1),
                             " ; ".join(str(s) for s in dyn["sizes"])])
    lines += bc.table(["cluster", "pipeline", "input work", "even ms", "fixed ms",
                       "DynamicBatching() ms", "settled split"], rows,
                      ["---", "---", "---", "---:", "---:", "---:", "---"])
    lines += ["", "Fixed splits: " + "; ".join(f"{a['name']} {a['fixed']} (caps {a['caps']}, "
                                               f"{a['cap_method']})" for a in analyses) + "."]
    # Per-worker input work against its share of the global batch.
    lines += ["", "Per worker at the even and the fixed split: share of the global batch, "
              "samples its per-sample map ran per step, that map's time per step (summed over "
              "its parallel calls) and per sample, compute (busy) time per step:", ""]
    rows = []
    for a in analyses:
        for pipeline in PIPELINES:
            for path in PATHS:
                for policy in ("even", "fixed"):
                    cell = a["steps"].get(pipeline, {}).get(path, {}).get(policy)
                    if not cell:
                        continue
                    sizes = cell["sizes"][0]
                    inp = cell["input"]
                    for j, cap in enumerate(a["caps"]):
                        per_sample = (inp["seconds"][j] / inp["samples"][j] * 1e6
                                      if inp["samples"][j] else float("nan"))
                        rows.append([a["name"], pipeline, path, str(sizes), j, f"{cap:g}",
                                     f"{sizes[j] / args.batch:.2f}",
                                     f"{inp['samples'][j]:.0f}",
                                     f"{inp['seconds'][j] * 1e3:.1f}", f"{per_sample:.0f}",
                                     f"{cell['busy_ms'][j]:.0f}" if cell["busy_ms"] else "-"])
    lines += bc.table(["cluster", "pipeline", "input work", "split", "worker", "cap", "share",
                       "decoded / step", "input ms / step", "input us / sample",
                       "busy ms / step"], rows,
                      ["---", "---", "---", "---", "---:", "---:", "---:", "---:", "---:",
                       "---:", "---:"])
    goals = {}
    for a in analyses:
        r = a["ratios"]
        lines += ["", f"{a['name']}: new / old step (per round, median (min-max)): " + "; ".join(
            f"{pipeline} " + ", ".join(f"{pol} {bc.fmt_stats(r[pipeline]['new_over_old'][pol], digits=3)}"
                                       for pol in POLICIES if pol in r[pipeline]["new_over_old"])
            for pipeline in PIPELINES if pipeline in r) + "."]
        if "heavy" in r:
            h = r["heavy"]
            lines += [f"{a['name']}, heavy: even / DynamicBatching() speed-up: new path "
                      f"{bc.fmt_stats(h['even_over_dynamic_new'], digits=2)}x, old path "
                      f"{bc.fmt_stats(h['even_over_dynamic_old'], digits=2)}x; old even / new "
                      f"DynamicBatching() {bc.fmt_stats(h['even_old_over_dynamic_new'], digits=2)}x."]
        if "reference" in a:
            ref = a["reference"]
            lines += [f"{a['name']}, heavy at {a['fixed']}: new path "
                      f"{bc.fmt_stats(ref['new_ms'], digits=1)} ms vs reference (capped worker "
                      f"decodes nothing) {bc.fmt_stats(ref['reference_ms'], digits=1)} ms; "
                      f"paired ratio {bc.fmt_ratio(ref['new_over_reference'])} over "
                      f"{ref['blocks']} block pair(s); input ms/step per worker: new "
                      + ", ".join(f"{v:.1f}" for v in ref["new_input_ms"]) + ", reference "
                      + ", ".join(f"{v:.1f}" for v in ref["reference_input_ms"]) + "."]
    two = analyses[0]
    if "reference" in two and "heavy" in two["ratios"]:
        ref = two["reference"]["new_over_reference"]["median"]
        dyn = two["ratios"]["heavy"]["even_over_dynamic_new"]["median"]
        dyn_old_even = two["ratios"]["heavy"]["even_old_over_dynamic_new"]["median"]
        light = two["ratios"].get("light", {}).get("new_over_old", {})
        light_worst = max(v["median"] for v in light.values()) if light else None
        goals = {
            "new_over_reference": ref, "reference_met": bool(ref <= TARGET_REFERENCE),
            "dynamic_speedup_vs_even_new": dyn,
            "dynamic_speedup_vs_even_old": dyn_old_even,
            "dynamic_met": bool(dyn >= TARGET_DYNAMIC),
            "light_new_over_old_worst": light_worst,
            "light_met": bool(light_worst is not None and light_worst <= 1.0),
        }
        lines += ["", f"Targets ({two['name']}, caps {two['caps']}): heavy new path / reference "
                  f"= {ref:.3f} ({'met' if goals['reference_met'] else 'MISSED'}: <= "
                  f"{TARGET_REFERENCE}); heavy DynamicBatching() vs even split (new path) "
                  f"{dyn:.2f}x ({'met' if goals['dynamic_met'] else 'MISSED'}: >= "
                  f"{TARGET_DYNAMIC}x; vs the old path's even split {dyn_old_even:.2f}x); light "
                  f"new / old, worst policy median {light_worst:.3f} "
                  f"({'met' if goals['light_met'] else 'MISSED'}: <= 1; per-round phase "
                  "medians, so noise of a few % either way)."]
    lines += ["", "Read amplification (one pass over a finite heavy pipeline at the fixed "
              "split, through the distributed dataset; bytes include the 16-byte TFRecord "
              "framing):", ""]
    rows = []
    for a in analyses:
        amp = a.get("amplification")
        if not amp:
            continue
        for j in range(len(a["caps"])):
            rows.append([a["name"], str(amp["sizes"]), j, f"{amp['sizes'][j]}/{args.batch}",
                         f"{amp['own_samples'][j]:.0f} / {amp['records']}",
                         f"{amp['file_bytes']:,}", f"{amp['read_bytes'][j]:,.0f}",
                         f"{amp['own_bytes'][j]:,.0f}",
                         _fmt_ratio(amp["read_over_own"][j]), _fmt_ratio(amp["rchar_over_own"][j]),
                         _fmt_ratio(amp["batch_over_share"][j])])
    lines += bc.table(["cluster", "split", "worker", "share", "samples decoded", "file bytes",
                       "record bytes read", "own records' bytes", "read / own", "rchar / own",
                       "B / b_k"], rows,
                      ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:",
                       "---:", "---:"])
    return lines, goals


def _fmt_ratio(value):
    return "-" if value is None or not np.isfinite(value) else f"{value:.2f}"


def plot(analyses, png, batch):
    plt = bc.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    labels, values, colors = [], [], []
    palette = {"unsplit": "tab:red", "split": "tab:green"}
    for a in analyses:
        for pipeline in PIPELINES:
            for path in PATHS:
                cell = a["steps"].get(pipeline, {}).get(path)
                if not cell:
                    continue
                for policy in POLICIES:
                    labels.append(f"{a['key'] if 'key' in a else a['name']} {pipeline} "
                                  f"{'new' if path == 'split' else 'old'} {policy}")
                    values.append(cell[policy]["step_ms"]["median"])
                    colors.append(palette[path])
    ax.barh(np.arange(len(values)), values, color=colors)
    ax.set_yticks(np.arange(len(values)))
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set(xlabel="median step ms", title="step time (red: old path, green: new path)")
    ax = axes[1]
    markers = {"light": "o", "heavy": "s"}
    for a in analyses:
        for pipeline in PIPELINES:
            for path in PATHS:
                for policy in ("even", "fixed"):
                    cell = a["steps"].get(pipeline, {}).get(path, {}).get(policy)
                    if not cell:
                        continue
                    shares = np.array(cell["sizes"][0]) / batch
                    ax.scatter(shares, np.array(cell["input"]["seconds"]) * 1e3,
                               marker=markers[pipeline], color=palette[path], s=18, alpha=0.7)
    ax.set(xlabel="worker's share of the global batch b_k / B",
           ylabel="input ms per step (per-sample map, threads summed)",
           title="per-worker input work (o light, s heavy; red old, green new)")
    bc.save_figure(fig, png)


def main(argv=None):
    parser = bc.base_parser(__doc__, os.path.join(bc.DEFAULT_OUT_DIR, "input.json"))
    parser.add_argument("--steps", type=int, default=None,
                        help="tiny mode: this many steps per static phase, 1 round, no caps")
    parser.add_argument("--repeats", type=int, default=None,
                        help="rounds per cluster, in one cluster run (default 2; tiny 1)")
    parser.add_argument("--clusters", default="w2,w3",
                        help="which clusters: w2 (0.8/0.2), w3 (0.24/0.4/0.96); default both")
    parser.add_argument("--filters", type=int, default=None,
                        help="conv filters of the CNN (default 32; tiny mode 4)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--train-samples", type=int, default=12800)
    parser.add_argument("--shuffle-buffer", type=int, default=2048,
                        help="shuffle buffer of the pipelines, records (default 2048; every "
                             "fit fills it, twice: Keras pulls a first batch from an iterator "
                             "of its own)")
    parser.add_argument("--dynamic-steps", type=int, default=200,
                        help="steps of a DynamicBatching() phase (its second half measured)")
    parser.add_argument("--h2h-blocks", type=int, default=None,
                        help="reference pairs of blocks per round (default 4; tiny 1)")
    parser.add_argument("--amp-samples", type=int, default=2560,
                        help="records of the read-amplification pass (default 2560)")
    parser.add_argument("--cap-after", type=float, default=20.0,
                        help="start uncapped, apply the caps this many seconds after the "
                             "start, before the measured phases (default 20)")
    parser.add_argument("--timeout", type=float, default=3600, help="per cluster run, seconds")
    args = parser.parse_args(argv)
    tiny = args.steps is not None
    if tiny and args.steps < 2:
        parser.error(f"--steps must be >= 2, got {args.steps}")
    args.filters = args.filters or (4 if tiny else 32)
    args.repeats = args.repeats or (1 if tiny else 2)
    args.h2h_blocks = args.h2h_blocks if args.h2h_blocks is not None else (1 if tiny else 4)
    chosen = [c.strip() for c in args.clusters.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in {cl["key"] for cl in CLUSTERS}]
    if unknown or not chosen:
        parser.error(f"--clusters must list w2 and/or w3, got {args.clusters!r}")
    clusters = [cl for cl in CLUSTERS if cl["key"] in chosen]
    json_path, png, workdir = bc.out_paths(args.out)
    when = bc.now_utc()
    started = time.time()
    analyses, results, failed = [], {}, []
    for cluster in clusters:
        caps = [None] * len(cluster["caps"]) if tiny else cluster["caps"]
        plan = make_plan(args, cluster, tiny)
        print(f"bench_input: {cluster['name']}, caps {caps}, fixed split {cluster['fixed']}, "
              f"{len(plan['phases'])} phases", flush=True)
        try:
            result = bc.run_cluster(plan, caps, workdir, f"input_{cluster['key']}", args.timeout,
                                    cap_after=None if tiny else args.cap_after,
                                    worker=INPUT_WORKER)
        except SystemExit as failure:  # report the other clusters, then fail
            failed.append(f"{cluster['name']}: {failure}")
            print(failed[-1], flush=True)
            continue
        results[cluster["key"]] = result
        a = analyse_cluster(result, cluster, args.batch, args.seed)
        a["key"] = cluster["key"]
        analyses.append(a)
    if not analyses:
        raise SystemExit("bench_input: every cluster run failed: " + "; ".join(failed))
    lines, goals = report(analyses, args, when)
    lines += [f"FAILED: {f}" for f in failed]
    print("\n" + "\n".join(lines))
    plot(analyses, png, args.batch)
    bc.write_json(json_path, {
        "benchmark": "bench_input", "date": when, "seed": args.seed, "tiny": tiny,
        "model": "cnn", "filters": args.filters, "batch": args.batch, "repeats": args.repeats,
        "clusters": analyses, "goals": goals, "failed": failed,
        "phases": {key: [{k: v for k, v in p.items() if k != "step_seconds"}
                         for p in r["phases"]] for key, r in results.items()},
        "elapsed_s": time.time() - started, "environment": bc.environment(), "png": png,
        "command": " ".join(["python", "examples/benchmarks/bench_input.py"] + list(
            argv if argv is not None else sys.argv[1:]))})
    print(f"\nJSON: {json_path}\nPNG:  {png}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
