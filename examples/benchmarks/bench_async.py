"""ASP with variable batching: time to a target test accuracy and staleness on Fashion-MNIST.

One cluster shape, 2 workers with CPU caps 4:1 (default 0.8/0.2; the chief and the parameter
server uncapped, one TF thread per task), and per round three runs, each its own launch with
the same seed and data:

  1. ASP, even split: `AsyncTrainer` on `HeteroParameterServerStrategy`, every update a batch
     of `--batch` (stock asynchronous training);
  2. ASP with `DynamicBatching()`: the split starts from each worker's nominal FLOP/s (its
     capped CPU) and follows the measured speeds, so both workers finish their updates at
     the same pace (less staleness);
  3. BSP for reference: `HeteroMultiWorkerMirroredStrategy` + `DynamicBatching()` on the same
     two capped workers (no ps), global batch 2 x `--batch`, learning rate 2 x `--lr`.

An epoch is `--epoch-updates` ASP updates (plain SGD, learning rate `--lr`, mean batch
`--batch`); a BSP epoch is half as many steps of twice the batch, i.e. the same samples. The
chief evaluates on the test set after each epoch. (`--batch` is the mean over the workers'
batches; per update it is that only if the workers do equally many updates: an ASP epoch
holds sum over updates of the updating worker's batch, which the JSON records as
`counted_samples`, and the table as training samples/s.) Time to target = summed training time
(evaluation excluded) up to the end of the first epoch whose test accuracy reaches
`--target`. Ratios compare with the even-split ASP run of the same round.

Usage:
    python examples/benchmarks/bench_async.py --out /tmp/tf_hetbatch_bench/async.json
    python examples/benchmarks/bench_async.py --steps 4     # tiny smoke run (no caps)

Each run's full log is kept in the work directory next to the JSON (`<out>_work/`).
"""

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

SCRIPT = os.path.join(bc.HERE, "async_worker.py")
RUNS = (("asp_even", "ASP even split (stock)", "asp", False),
        ("asp_dynamic", "ASP + DynamicBatching", "asp", True),
        ("bsp_dynamic", "BSP + DynamicBatching", "bsp", True))


class RunFailed(RuntimeError):
    """A sub-run's launch failed: names the run, its exit code and the launcher's message."""

    def __init__(self, name, returncode, message, log):
        super().__init__(f"run '{name}' failed with exit code {returncode}: {message} "
                         f"(full log: {log})")
        self.returncode = returncode


class Captured(bc.Captured):
    """Keeps every line in a log file; echoes the chief's `#` progress lines (ASP: the
    `[chief]` task; BSP: `[worker 0]`)."""

    PREFIXES = ("[chief] #", "[worker 0] #")

    def __init__(self, log_path, echo=True):
        super().__init__(echo=False)
        self.echo_progress = echo
        self.log = open(log_path, "w")

    def write(self, text):
        for line in text.splitlines():
            self.lines.append(line)
            self.log.write(line + "\n")
            for prefix in self.PREFIXES:
                if self.echo_progress and line.startswith(prefix):
                    sys.stdout.write("    " + line[len(prefix):].strip() + "\n")
                    sys.stdout.flush()
        return len(text)

    def close(self):
        self.log.close()


def run_one(name, plan, caps, workdir, timeout, cap_after, threads=1, echo=True):
    """Launches `async_worker.py` with `plan` (ASP: chief + 1 ps + workers; BSP: workers
    only); returns the chief's result dict. Raises RunFailed if the launch fails."""
    plan = dict(plan)
    plan_path = os.path.join(workdir, f"{name}_plan.json")
    result_path = os.path.join(workdir, f"{name}_result.json")
    log_path = os.path.join(workdir, f"{name}.log")
    if os.path.exists(result_path):
        os.remove(result_path)
    capped = any(c is not None for c in caps)
    schedule, launch_caps = None, caps
    if capped and cap_after is not None:
        # Start uncapped (a worker at 0.2 CPU needs ~30 s to import TensorFlow), cap at
        # `cap_after` s; the training script waits until `start_at` before training.
        schedule = f"{cap_after:g}:" + ",".join(
            f"{i}={'none' if c is None else f'{c:.4g}'}" for i, c in enumerate(caps))
        plan["start_at"] = cap_after + 1.0
        launch_caps = [None] * len(caps)
    plan["t0"] = time.time()
    with open(plan_path, "w") as f:
        json.dump(plan, f)
    stream = Captured(log_path, echo)
    started = time.perf_counter()
    try:
        outcome = bc.launch([SCRIPT, "--plan", plan_path, "--result", result_path], len(caps),
                            num_ps=1 if plan["mode"] == "asp" else 0,
                            cpus=launch_caps if any(c is not None for c in launch_caps)
                            else None,
                            schedule=schedule, threads=threads, timeout=timeout,
                            stdout=stream, stderr=stream, handle_signals=True)
    finally:
        stream.close()
    if not outcome.ok or not os.path.exists(result_path):
        tail = [line for line in stream.lines if not any(n in line for n in bc.NOISE)][-40:]
        sys.stdout.write("\n".join(tail) + "\n")
        message = outcome.message if not outcome.ok else "exited 0 but wrote no result"
        raise RunFailed(name, outcome.returncode if not outcome.ok else 1, message, log_path)
    with open(result_path) as f:
        result = json.load(f)
    result.update(wall_seconds=time.perf_counter() - started, cap_method=outcome.cap_method,
                  caps=caps, schedule=schedule, log=log_path)
    return result


def time_to_target(run, target):
    for i, acc in enumerate(run["test_accuracy"]):
        if acc is not None and acc >= target:
            return float(np.sum(run["train_seconds"][: i + 1])), i + 1
    return None, None


def finite_or_none(obj, path="$", bad=None):
    """A copy of a JSON-like object with NaN/inf replaced by None; their paths go to `bad`."""
    if isinstance(obj, dict):
        return {k: finite_or_none(v, f"{path}.{k}", bad) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v, f"{path}[{i}]", bad) for i, v in enumerate(obj)]
    if isinstance(obj, float) and not np.isfinite(obj):
        if bad is not None:
            bad.append(path)
        return None
    return obj


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt(value, digits=1, none="-"):
    return none if value is None else f"{value:.{digits}f}"


def fmt_list(values, digits=2):
    return "/".join("-" if v is None else f"{v:.{digits}f}" for v in values)


def main(argv=None):
    parser = bc.base_parser(__doc__, os.path.join(bc.DEFAULT_OUT_DIR, "async.json"))
    parser.add_argument("--steps", type=int, default=None,
                        help="tiny mode: this many updates per epoch, 2 epochs, 2 uncapped "
                             "workers, a tiny model on a small data subset")
    parser.add_argument("--repeats", type=int, default=None,
                        help="rounds, each an ASP-even, ASP-dynamic and BSP run (default 1)")
    parser.add_argument("--caps", default="0.8,0.2",
                        help="CPU cap per worker (2 workers; default 0.8,0.2)")
    parser.add_argument("--target", type=float, default=0.80,
                        help="test accuracy target (default 0.80)")
    parser.add_argument("--epochs", type=int, default=6, help="epochs (default 6; tiny 2)")
    parser.add_argument("--epoch-updates", type=int, default=200,
                        help="ASP updates per epoch, all workers together (default 200)")
    parser.add_argument("--batch", type=int, default=None,
                        help="mean batch per ASP update (default 64; tiny 16)")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="SGD learning rate of an ASP update (BSP: x workers)")
    parser.add_argument("--filters", type=int, default=None,
                        help="conv filters of the CNN (default 16; tiny 4)")
    parser.add_argument("--train-samples", type=int, default=24000)
    parser.add_argument("--test-samples", type=int, default=2048,
                        help="test samples (BSP uses a multiple of 2 x batch)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="DynamicBatching(warmup_steps=...) of the dynamic runs (default: "
                             "its default, 5; tiny 1)")
    parser.add_argument("--interval", type=int, default=None,
                        help="DynamicBatching(interval=...) (default: its default, 10; tiny 2)")
    parser.add_argument("--runs", default=",".join(r[0] for r in RUNS),
                        help="which runs, comma-separated (default all three; "
                             "asp_even is needed for the ratios)")
    parser.add_argument("--cap-after", type=float, default=20.0,
                        help="start uncapped, caps this many seconds after the start "
                             "(default 20)")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds per run (default 900)")
    args = parser.parse_args(argv)
    tiny = args.steps is not None
    if tiny and args.steps < 1:
        parser.error("--steps must be >= 1")
    args.repeats = args.repeats or 1
    batch = args.batch or (16 if tiny else 64)
    filters = args.filters or (4 if tiny else 16)
    epochs = 2 if tiny else args.epochs
    steps = args.steps if tiny else args.epoch_updates
    caps = [float(c) for c in args.caps.split(",")]
    if len(caps) != 2:
        parser.error(f"--caps needs 2 values (2 workers). Received: {args.caps!r}")
    selected = [r for r in RUNS if r[0] in args.runs.split(",")]
    unknown = set(args.runs.split(",")) - {r[0] for r in RUNS}
    if unknown or not selected:
        parser.error(f"--runs: unknown run(s) {sorted(unknown)}; choose from "
                     f"{[r[0] for r in RUNS]}")
    run_caps = [None, None] if tiny else caps
    json_path, png, workdir = bc.out_paths(args.out)
    when = bc.now_utc()
    started = time.time()
    plan = {"seed": args.seed, "filters": filters, "batch": batch, "lr": args.lr,
            "epochs": epochs, "steps": steps,
            "train_samples": 32 * batch if tiny else args.train_samples,
            "test_samples": 8 * batch if tiny else args.test_samples}
    if tiny:  # let DynamicBatching adjust within the few steps
        plan.update(warmup_steps=1, interval=2)
    for key in ("warmup_steps", "interval"):
        if getattr(args, key) is not None:
            plan[key] = getattr(args, key)
    print(f"bench_async: 2 workers, caps {'none (tiny)' if tiny else caps}, 1 ps (ASP), "
          f"{epochs} epochs x {steps} updates, mean batch {batch}, lr {args.lr}, target "
          f"{args.target}, runs {[r[0] for r in selected]} x {args.repeats}", flush=True)

    runs = []
    try:
        for r in range(1, args.repeats + 1):
            for name, label, mode, dynamic in selected:
                print(f"  round {r}: {label} ...", flush=True)
                result = run_one(f"{name}_r{r}", dict(plan, mode=mode, dynamic=dynamic),
                                 run_caps, workdir, args.timeout,
                                 None if tiny else args.cap_after)
                result.update(name=name, label=label, round=r)
                result["time_to_target_s"], result["epochs_to_target"] = time_to_target(
                    result, args.target)
                runs.append(result)
    except RunFailed as e:
        print(f"bench_async: {e}", file=sys.stderr, flush=True)
        return e.returncode if 0 < e.returncode < 256 else 1

    def med_epoch(run):
        s = run["train_seconds"]
        return float(np.median(s[1:] or s))

    rounds = []
    for r in range(1, args.repeats + 1):
        mine = {x["name"]: x for x in runs if x["round"] == r}
        even = mine.get("asp_even")
        row = {"round": r}
        for name in ("asp_dynamic", "bsp_dynamic"):
            other = mine.get(name)
            if even is None or other is None:
                continue
            row[f"{name}_vs_even_to_target"] = ratio(other["time_to_target_s"],
                                                     even["time_to_target_s"])
            row[f"{name}_vs_even_epoch"] = ratio(med_epoch(other), med_epoch(even))
        rounds.append(row)
    summary = {key: bc.stats([x.get(key) for x in rounds])
               for key in ("asp_dynamic_vs_even_to_target", "asp_dynamic_vs_even_epoch",
                           "bsp_dynamic_vs_even_to_target", "bsp_dynamic_vs_even_epoch")}

    cap_method = runs[0]["cap_method"]
    lines = [f"bench_async, {when}: 2 workers, caps {run_caps} ({cap_method}), 1 ps; CNN "
             f"--filters {filters}, SGD lr {args.lr} (BSP {args.lr * 2:g}), mean batch {batch} "
             f"(BSP global {2 * batch}), {plan['train_samples']} train / "
             f"{plan['test_samples']} test samples ({runs[0]['data']}), {epochs} epochs x "
             f"{steps} updates, target test accuracy {args.target}, seed {args.seed}, "
             f"{args.repeats} round(s).", ""]
    rows = []
    for run in runs:
        even = next((x for x in runs if x["round"] == run["round"]
                     and x["name"] == "asp_even"), None)
        to_target = ratio(run["time_to_target_s"], even and even["time_to_target_s"])
        per_epoch = ratio(med_epoch(run), even and med_epoch(even))
        upd = run.get("updates_per_worker")
        samples = (sum(run["samples_per_worker"]) if run["mode"] == "asp"
                   else run["steps_per_epoch"] * run["batch"] * len(run["train_seconds"]))
        rows.append([
            f"{run['label']} r{run['round']}" if args.repeats > 1 else run["label"],
            fmt(med_epoch(run)), fmt(per_epoch, 2),
            fmt(samples / max(sum(run["train_seconds"]), 1e-9), 0),
            fmt(run["time_to_target_s"]) if run["time_to_target_s"] is not None
            else "not reached",
            str(run["epochs_to_target"] or "-"), fmt(to_target, 2),
            fmt(run["test_accuracy"][-1], 4), fmt(max(a for a in run["test_accuracy"]
                                                      if a is not None), 4),
            str(run["final_sizes"]), "/".join(str(u) for u in upd) if upd else "-"])
    lines += bc.table(["run", "train s / epoch (after 1st)", "x ASP-even", "samples / s",
                       "time to target s",
                       "epochs to target", "x ASP-even (to target)", "final test acc",
                       "best test acc", "final split", "updates per worker"], rows,
                      ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---:",
                       "---", "---"])
    lines += ["", "Test accuracy per epoch:", ""]
    lines += bc.table(["run"] + [f"e{i + 1}" for i in range(epochs)],
                      [[f"{x['label']} r{x['round']}"] + [fmt(a, 4) for a in x["test_accuracy"]]
                       for x in runs], ["---"] + ["---:"] * epochs)
    asp = [x for x in runs if x["mode"] == "asp"]
    if asp:
        lines += ["", "Staleness of the ASP updates (updates by other workers between a "
                  "worker's read and its update):", ""]
        srows = []
        for x in asp:
            s = x["staleness"]
            overall = s["overall"]
            shown = max(s["overall_max"] + 1, 1)
            srows.append([f"{x['label']} r{x['round']}", fmt_list(s["mean"]),
                          "/".join(str(m) for m in s["max"]), fmt(s["overall_mean"], 2),
                          "/".join(str(s["percentiles"][k]) for k in ("p50", "p90", "p99")),
                          " ".join(str(c) for c in overall[:min(shown, 12)])
                          + (" ..." if shown > 12 else ""),
                          fmt_list(x["seconds_per_update"], 3)])
        lines += bc.table(["run", "mean per worker", "max per worker", "mean overall",
                           "p50/p90/p99", "histogram 0,1,2,...", "s / update per worker"],
                          srows, ["---", "---:", "---:", "---:", "---:", "---", "---:"])
    lines += [""]
    for key, text in (("asp_dynamic_vs_even_to_target", "ASP-dynamic / ASP-even time to target"),
                      ("bsp_dynamic_vs_even_to_target", "BSP / ASP-even time to target"),
                      ("asp_dynamic_vs_even_epoch", "ASP-dynamic / ASP-even train s per epoch"),
                      ("bsp_dynamic_vs_even_epoch", "BSP / ASP-even train s per epoch")):
        if summary[key]["n"]:
            lines.append(f"{text}: {bc.fmt_stats(summary[key], digits=2)}")
    print("\n" + "\n".join(lines))

    plt = bc.pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    styles = {"asp_even": ("s--", "k"), "asp_dynamic": ("o-", "C0"), "bsp_dynamic": ("^-", "C2")}
    for run in runs:
        marker, color = styles[run["name"]]
        acc = [np.nan if a is None else a for a in run["test_accuracy"]]
        ax.plot(np.cumsum(run["train_seconds"]), acc, marker, color=color, alpha=0.8,
                label=run["label"] + (f" r{run['round']}" if args.repeats > 1 else ""))
    ax.axhline(args.target, color="r", lw=0.8, ls=":", label=f"target {args.target}")
    ax.set(xlabel="training time (s, evaluation excluded)", ylabel="test accuracy",
           title=f"Fashion-MNIST, caps {run_caps}")
    ax.legend(fontsize=7)
    width = 0.8 / max(len(asp), 1)
    top = max([x["staleness"]["overall_max"] for x in asp] + [0]) + 1
    for i, run in enumerate(asp):
        counts = np.asarray(run["staleness"]["overall"][:top], float)
        frac = counts / max(counts.sum(), 1)
        bx.bar(np.arange(top) + (i - (len(asp) - 1) / 2) * width, frac, width,
               color=styles[run["name"]][1], alpha=0.8,
               label=f"{run['label']} r{run['round']} (mean "
                     f"{run['staleness']['overall_mean']:.2f})")
    bx.xaxis.get_major_locator().set_params(integer=True)
    bx.set(xlabel="staleness (updates)", ylabel="fraction of updates",
           title="ASP staleness, all workers")
    bx.legend(fontsize=7)
    bc.save_figure(fig, png)

    bad = []
    data = finite_or_none({
        "benchmark": "bench_async", "date": when, "seed": args.seed, "tiny": tiny,
        "caps": run_caps, "requested_caps": caps, "cap_method": cap_method,
        "target": args.target, "epochs": epochs, "steps_per_epoch": steps, "batch": batch,
        "lr": args.lr, "filters": filters,
        "dynamic_batching": {k: plan.get(k) for k in ("warmup_steps", "interval")},
        "train_samples": plan["train_samples"],
        "test_samples": plan["test_samples"], "repeats": args.repeats, "data": runs[0]["data"],
        "runs": runs, "rounds": rounds, "ratios": summary,
        "elapsed_s": time.time() - started, "environment": bc.environment(), "png": png},
        bad=bad)
    if bad:
        print(f"warning: non-finite values written as null at {bad[:10]}", flush=True)
    bc.write_json(json_path, data)
    print(f"\nJSON: {json_path}\nPNG:  {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
