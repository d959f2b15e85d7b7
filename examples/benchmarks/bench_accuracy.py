"""Time to a target test accuracy on Fashion-MNIST: even split vs DynamicBatching.

One cluster run of 3 workers with CPU caps in the shape 3:5:12 (default 0.24/0.4/0.96, the
demo's cluster). In that one process per worker, `--repeats` rounds each train a fresh model
(same seed, same data order) twice, interleaved: once at the even split (stock behaviour), once
with `DynamicBatching(initial=...)` (`--initial`: "uniform", the default, makes the controller
learn every speed from the even split; "flops" is DynamicBatching's own default, which reads
the CPU quotas), evaluating on the test set after every epoch.
Training is exact under any split, so accuracy per epoch is the same (up to float rounding);
only the time differs. Time to target = summed training time (validation excluded) up to the
end of the first epoch whose test accuracy reaches `--target`.

Usage:
    python examples/benchmarks/bench_accuracy.py --out /tmp/tf_hetbatch_bench/accuracy.json
    python examples/benchmarks/bench_accuracy.py --initial flops --steps-per-execution 8
    python examples/benchmarks/bench_accuracy.py --steps 4     # tiny smoke run (no caps)
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


def time_to_target(run, target):
    for i, acc in enumerate(run["test_accuracy"]):
        if acc >= target:
            return float(np.sum(run["train_seconds"][: i + 1])), i + 1
    return None, None


def main(argv=None):
    parser = bc.base_parser(__doc__, os.path.join(bc.DEFAULT_OUT_DIR, "accuracy.json"),
                            out_help="JSON results; the PNG goes next to it")
    parser.add_argument("--steps", type=int, default=None,
                        help="tiny mode: this many steps per epoch, 2 epochs, 2 workers, no caps")
    parser.add_argument("--repeats", type=int, default=None,
                        help="rounds (each: an even and a dynamic run) (default 2; tiny 1)")
    parser.add_argument("--caps", default="0.24,0.4,0.96", help="CPU cap per worker")
    parser.add_argument("--target", type=float, default=0.83, help="test accuracy target")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--model", default="cnn", choices=["cnn", "small_cnn", "linear"])
    parser.add_argument("--filters", type=int, default=None,
                        help="conv filters of --model cnn (default 16; tiny mode 4)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--initial", default="uniform", choices=["uniform", "flops"],
                        help="DynamicBatching's static split: uniform (default: the controller "
                             "learns every speed) or flops (its own default: CPU quotas seen)")
    parser.add_argument("--steps-per-execution", type=int, default=1,
                        help="Keras's steps_per_execution, both runs (default 1)")
    parser.add_argument("--train-samples", type=int, default=12800)
    parser.add_argument("--test-samples", type=int, default=2048)
    parser.add_argument("--cap-after", type=float, default=20.0,
                        help="start uncapped, caps this many seconds after the start (default 20)")
    parser.add_argument("--timeout", type=float, default=2400)
    args = parser.parse_args(argv)
    tiny = args.steps is not None
    args.filters = args.filters or (4 if tiny else 16)
    args.repeats = args.repeats or (1 if tiny else 2)
    caps = [float(c) for c in args.caps.split(",")]
    epochs = 2 if tiny else args.epochs
    json_path, png, workdir = bc.out_paths(args.out)
    when = bc.now_utc()
    started = time.time()
    plan = {"task": "accuracy", "model": args.model, "filters": args.filters,
            "batch": args.batch, "epochs": epochs, "seed": args.seed,
            "initial": args.initial, "steps_per_execution": args.steps_per_execution,
            "train_samples": args.steps * args.batch if tiny else args.train_samples,
            "test_samples": 2 * args.batch if tiny else args.test_samples,
            "runs": ["even", "dynamic"] * args.repeats}
    print(f"bench_accuracy: {2 if tiny else len(caps)} workers, caps {caps if not tiny else 'none (tiny)'}, "
          f"{epochs} epochs, target {args.target}", flush=True)
    # Tiny mode: 2 uncapped workers (fewer processes than CPUs keeps it under a minute).
    result = bc.run_cluster(plan, [None, None] if tiny else caps, workdir, "accuracy",
                            args.timeout, cap_after=None if tiny else args.cap_after)
    runs = result["runs"]
    for i, run in enumerate(runs):
        run["round"] = i // 2 + 1
        run["time_to_target_s"], run["epochs_to_target"] = time_to_target(run, args.target)
    rounds = []
    for r in range(1, args.repeats + 1):
        even = next(x for x in runs if x["round"] == r and x["mode"] == "even")
        dyn = next(x for x in runs if x["round"] == r and x["mode"] == "dynamic")
        rounds.append({
            "round": r,
            "even_epoch_s": float(np.median(even["train_seconds"][1:] or even["train_seconds"])),
            "dynamic_epoch_s": float(np.median(dyn["train_seconds"][1:] or dyn["train_seconds"])),
            "even_to_target_s": even["time_to_target_s"],
            "dynamic_to_target_s": dyn["time_to_target_s"],
            "max_accuracy_gap": float(np.max(np.abs(np.subtract(even["test_accuracy"],
                                                                dyn["test_accuracy"])))),
        })
    speed_epoch = bc.stats([x["even_epoch_s"] / x["dynamic_epoch_s"] for x in rounds])
    reached = [x for x in rounds if x["even_to_target_s"] and x["dynamic_to_target_s"]]
    speed_target = bc.stats([x["even_to_target_s"] / x["dynamic_to_target_s"] for x in reached])

    lines = [f"bench_accuracy, {when}: {len(result['caps'])} workers, caps {result['caps']} ({result['cap_method']}), model "
             f"{args.model} --filters {args.filters}, B={args.batch}, {plan['train_samples']} "
             f"train / {plan['test_samples']} test samples, {epochs} epochs, target test "
             f"accuracy {args.target}, initial {args.initial!r}, steps_per_execution "
             f"{args.steps_per_execution}, seed {args.seed}, {args.repeats} round(s) interleaved "
             f"in one cluster run; median (min-max) over rounds.", ""]
    rows = []
    for mode in ("even", "dynamic"):
        mine = [x for x in runs if x["mode"] == mode]
        tt = [x["time_to_target_s"] for x in mine]
        rows.append([
            "even split (stock)" if mode == "even" else "DynamicBatching",
            bc.fmt_stats(bc.stats([np.median(x["train_seconds"][1:] or x["train_seconds"])
                                   for x in mine]), digits=1),
            bc.fmt_stats(bc.stats(tt), digits=1) if all(t is not None for t in tt)
            else f"not reached in {sum(t is None for t in tt)}/{len(tt)}",
            "/".join(str(x["epochs_to_target"]) for x in mine),
            " ".join(f"{a:.4f}" for a in mine[0]["test_accuracy"]),
            str(mine[-1]["final_sizes"])])
    lines += bc.table(["policy", "train s / epoch (after 1st)", "time to target s",
                       "epochs to target", "test accuracy per epoch (round 1)", "final split"],
                      rows, ["---", "---:", "---:", "---:", "---", "---"])
    gap = max(x["max_accuracy_gap"] for x in rounds)
    lines += ["", f"Speed-up even / dynamic: per epoch {bc.fmt_stats(speed_epoch, digits=2)}, "
              f"time to target {bc.fmt_stats(speed_target, digits=2)}; largest per-epoch test "
              f"accuracy difference between the two {gap:.4f} (training is exact: rounding only)."]
    print("\n" + "\n".join(lines))

    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        ax.plot(np.cumsum(run["train_seconds"]), run["test_accuracy"],
                "o-" if run["mode"] == "dynamic" else "s--",
                color="C0" if run["mode"] == "dynamic" else "k", alpha=0.8,
                label=f"{run['mode']} r{run['round']}")
    ax.axhline(args.target, color="r", lw=0.8, ls=":", label=f"target {args.target}")
    ax.set(xlabel="training time (s, validation excluded)", ylabel="test accuracy",
           title=f"Fashion-MNIST, caps {caps}: even vs DynamicBatching")
    ax.legend(fontsize=7)
    bc.save_figure(fig, png)
    bc.write_json(json_path, {"benchmark": "bench_accuracy", "date": when, "seed": args.seed,
                              "tiny": tiny, "caps": caps, "target": args.target,
                              "epochs": epochs, "model": args.model, "batch": args.batch,
                              "initial": args.initial,
                              "steps_per_execution": args.steps_per_execution,
                              "repeats": args.repeats, "cap_method": result["cap_method"],
                              "data": result["data"], "runs": runs, "rounds": rounds,
                              "speedup_epoch": speed_epoch, "speedup_to_target": speed_target,
                              "max_accuracy_gap": gap, "elapsed_s": time.time() - started,
                              "environment": bc.environment(), "png": png})
    print(f"\nJSON: {json_path}\nPNG:  {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
