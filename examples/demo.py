"""The main demo: a heterogeneous local cluster trains a CNN on Fashion-MNIST, stock split vs ours.

Starts 3 worker processes on 127.0.0.1 with CPU caps in the shape 3:5:12 (the source paper's
uneven core counts, scaled to this machine), trains the same model twice on the same data:
once with the even split every stock tf.distribute strategy uses, once with
`DynamicBatching()`, and prints time per epoch, speedup, balance efficiency and test accuracy,
and per worker its input time per step beside its compute time per step.

The training data are PNG-encoded TFRecord files (written once, cached), decoded and augmented
per sample in a tf.data pipeline (`--pipeline png`, the default; `--augment light` decodes
only); each worker decodes only its own replicas' samples (`--input-work unsplit`: every
worker decodes every sample). `--pipeline arrays` trains from in-memory arrays instead.

    python examples/demo.py              # 4-6 minutes on 2 cores (longer when loaded)
    python examples/demo.py --steps 3    # tiny mode (the test suite runs it)
    python examples/demo.py --layout 1,2 --caps 0.24,0.96  # worker 1 hosts 2 replicas
"""

import argparse
import io
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tf_hetbatch.launch import launch  # noqa: E402  (pure Python: no TensorFlow here)

NOISE = ("W0000", "I0000", "E0000", "WARNING: All log", "UserWarning", "data_adapter",
         "crashed", "/job:", "grpc", "absl::InitializeLog", "cuda", "rebuild TensorFlow",
         "cpu_feature_guard", "AVX", "Error received from peer", "CoordinationService")


class Filtered(io.TextIOBase):
    """Passes the chief's progress lines through, drops TensorFlow's start-up noise."""

    def __init__(self, out, keep_all=False):
        self.out, self.keep_all, self.lines = out, keep_all, []

    def write(self, text):
        for line in text.splitlines():
            self.lines.append(line)
            if self.keep_all or (line.startswith("[worker 0]") and not any(n in line for n in NOISE)
                                 and not line.startswith("[worker 0] {")):
                self.out.write(line.replace("[worker 0] ", "    ") + "\n")
        self.out.flush()
        return len(text)


def run(mode, args, caps, workdir):
    result = os.path.join(workdir, f"{mode}.json")
    log_dir = os.path.join(workdir, f"logs_{mode}")
    script = [os.path.join(HERE, "train_fashion_mnist.py"), "--mode", mode,
              "--epochs", str(args.epochs), "--train-samples", str(args.train_samples),
              "--test-samples", str(args.test_samples),
              "--batch", str(args.batch), "--filters", str(args.filters),
              "--pipeline", args.pipeline, "--augment", args.augment,
              "--input-work", args.input_work,
              "--steps-per-execution", str(args.steps_per_execution),
              "--result", result, "--log-dir", log_dir,
              "--progress-every", "0" if args.steps else "20", "--layout", args.layout]
    if args.steps:
        script += ["--steps", str(args.steps)]
    stream = Filtered(sys.stdout, keep_all=args.verbose)
    start = time.perf_counter()
    outcome = launch(script, len(caps), cpus=caps, threads=1, timeout=args.timeout, stdout=stream,
                     stderr=stream, handle_signals=True)
    if not outcome.ok:
        sys.stdout.write("\n".join(stream.lines[-40:]) + "\n")
        raise SystemExit(f"demo: the {mode} run failed: {outcome.message}")
    with open(result) as f:
        summary = json.load(f)
    summary["wall_seconds"] = time.perf_counter() - start
    summary["cap_method"] = outcome.cap_method
    summary["log_dir"] = log_dir
    return summary


def replica_names(caps, layout):
    """(name, the cap of its worker) of every replica, in replica order."""
    counts = [int(c) for c in layout.split(",")] if layout else [1] * len(caps)
    if len(counts) == 1 or max(counts) == 1:
        return [(f"worker {w}", cap) for w, cap in enumerate(caps)]
    return [(f"worker {w}/{i}", cap) for w, (cap, n) in enumerate(zip(caps, counts))
            for i in range(n)]


def print_workers(runs, caps, layout=""):
    """Per replica: samples, compute and input time per step, for each run."""
    header = f"{'':12}{'cap':>6}"
    for mode in runs:
        header += f"  | {mode + ': samples':>16}{'compute ms':>11}{'input ms':>9}"
    lines = [header]
    for k, (name, cap) in enumerate(replica_names(caps, layout)):
        line = f"{name:12}{cap:>6g}"
        for r in runs.values():
            samples = r["samples_per_step"][k] if r["samples_per_step"] else None
            compute = r["compute_ms_per_step"][k] if r["compute_ms_per_step"] else None
            inputs = r["input_ms_per_step"][k] if r.get("input_ms_per_step") else None
            line += (f"  | {'-' if samples is None else f'{samples:.0f}':>16}"
                     f"{'-' if compute is None else f'{compute:.0f}':>11}"
                     f"{'-' if inputs is None else f'{inputs:.0f}':>9}")
        lines.append(line)
    print("\nPer worker, per step (samples and compute: the late steps; input: the per-sample "
          "map's\ntime in the worker's pipeline over the whole run, parallel calls summed):")
    print("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", default="0.24,0.4,0.96",
                        help="CPU cap per worker (default: 3:5:12 over 1.6 of this machine's 2 CPUs)")
    parser.add_argument("--layout", default="",
                        help="replicas (logical CPUs) per worker, e.g. 1,2 with --caps 0.24,0.96: "
                             "a worker hosting 2 replicas under one cap (default: one each)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train-samples", type=int, default=7680)
    parser.add_argument("--test-samples", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--filters", type=int, default=32,
                        help="conv filters of the CNN (default 32; with 16, a capped worker's step "
                             "on a fast CPU is mostly fixed cost, which no split removes)")
    parser.add_argument("--pipeline", choices=["png", "arrays"], default="png",
                        help="training input: PNG TFRecords decoded and augmented per sample "
                             "(default), or in-memory arrays")
    parser.add_argument("--augment", choices=["heavy", "light"], default="heavy",
                        help="--pipeline png: decode + resize/crop/flip (heavy, default) or "
                             "decode only (light)")
    parser.add_argument("--input-work", choices=["split", "unsplit"], default="split",
                        help="each worker decodes its own samples only (default), or all")
    parser.add_argument("--steps-per-execution", type=int, default=1,
                        help="Keras's steps_per_execution, both runs (default 1)")
    parser.add_argument("--steps", type=int, default=0, help="tiny mode: steps per epoch")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default="", help="folder for logs and results (default: a new temp dir)")
    parser.add_argument("--verbose", action="store_true", help="show every worker's output")
    args = parser.parse_args(argv)
    caps = [float(c) for c in args.caps.split(",")]
    if args.layout and len(args.layout.split(",")) != len(caps):
        parser.error(f"--layout names {len(args.layout.split(','))} workers and --caps "
                     f"{len(caps)}: give one cap per worker")
    workdir = args.out or tempfile.mkdtemp(prefix="tf_hetbatch_demo_")
    os.makedirs(workdir, exist_ok=True)

    hosted = f" hosting {args.layout} replicas" if args.layout else ""
    print(f"tf_hetbatch demo: {len(caps)} workers{hosted} on 127.0.0.1, CPU caps {caps} "
          f"(H = {max(caps) / min(caps):.1f}), global batch {args.batch}, "
          f"steps_per_execution {args.steps_per_execution}")
    runs = {}
    for mode, title in (("even", "stock even split (what every tf.distribute strategy does)"),
                        ("dynamic", "tf_hetbatch DynamicBatching()")):
        print(f"\n== {title}")
        runs[mode] = run(mode, args, caps, workdir)
    even, dyn = runs["even"], runs["dynamic"]
    print(f"\nCPU caps enforced by: {dyn['cap_method']}; data: {dyn['data']}; input: "
          + (f"PNG TFRecords, {args.augment} per-sample work, input work {args.input_work}"
             if args.pipeline == "png" else "in-memory arrays"))
    rows = [
        ("time per epoch (s)", [f"{e:.1f}" for e in (even["epoch_seconds"][-1], dyn["epoch_seconds"][-1])]),
        ("step time, median (ms)", [f"{r['step_ms_late_median']:.0f}" for r in (even, dyn)]),
        ("the epoch's first step (s)", [f"{r['first_step_seconds'][-1]:.2f}" for r in (even, dyn)]),
        ("balance efficiency", [f"{r['balance_efficiency']:.0%}" if r["balance_efficiency"] else "-"
                                for r in (even, dyn)]),
        ("final split", [str(r["final_batch_sizes"]) for r in (even, dyn)]),
        ("test accuracy", [f"{r['test_accuracy']:.4f}" for r in (even, dyn)]),
    ]
    print(f"\n{'':26}{'stock even split':>20}{'DynamicBatching':>20}")
    for name, (a, b) in rows:
        print(f"{name:26}{a:>20}{b:>20}")
    counts = [int(c) for c in args.layout.split(",")] if args.layout else [1] * len(caps)
    shares = [cap / n for cap, n in zip(caps, counts) for _ in range(n)]  # X per replica
    speedup = even["epoch_seconds"][-1] / dyn["epoch_seconds"][-1]
    step_speedup = even["step_ms_late_median"] / dyn["step_ms_late_median"]
    print(f"\nspeedup: {speedup:.2f}x per epoch ({step_speedup:.2f}x per step; "
          f"naive ceiling sum X / (K min X) = {sum(shares) / (len(shares) * min(shares)):.2f}x)")
    print_workers(runs, caps, args.layout)
    print("Training is exact under any split, so both runs learn the same model "
          "(accuracies differ only by floating-point rounding).")
    print(f"TensorBoard: tensorboard --logdir {dyn['log_dir']}  (Custom Scalars tab)")
    png = os.path.join(dyn["log_dir"], "hetbatch_balance.png")
    if os.path.exists(png):
        print(f"Balance picture: {png}")
    with open(os.path.join(workdir, "demo_summary.json"), "w") as f:
        json.dump({"even": even, "dynamic": dyn, "speedup": speedup, "caps": caps}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
