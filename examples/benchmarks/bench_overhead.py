"""Overhead of tf_hetbatch's strategy against the stock one at an even split and equal B.

(a) One host, 2 logical CPUs: stock `tf.distribute.MirroredStrategy` vs
    `HeteroMirroredStrategy`, the same model (a small CNN and a Dense model on Fashion-MNIST)
    with the same initial weights and data, `--repeats` short interleaved repetitions (the
    order alternates; default 15 x 40 steps), median step time of each; ratio = ours / stock
    of the same repetition, median over repetitions. Also the process CPU time per step: on a
    shared 2-core machine the wall-clock ratio of one repetition swings by +-10%, the CPU
    time (what the extra work costs when the cores are the bottleneck) much less.
(b) A homogeneous 2-worker cluster (equal CPU caps, one process per worker): ours at the even
    split vs ours + `DynamicBatching(initial="uniform")` (its measurement collectives every
    10 steps and any split changes it makes), interleaved rounds in ONE cluster run. The stock
    `MultiWorkerMirroredStrategy` cannot be compared: Keras 3.15 `fit` crashes under it before
    the first step (FINDINGS 6), so the multi-worker baseline is our strategy at the even split.

Goal: ratios <= 1.03.

Usage:
    python examples/benchmarks/bench_overhead.py --out /tmp/tf_hetbatch_bench/overhead.json
    python examples/benchmarks/bench_overhead.py --steps 5    # tiny smoke run
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

GOAL = 1.03
MWMS_NOTE = ("stock MultiWorkerMirroredStrategy: not measurable - Keras 3.15 `fit` crashes under "
             "it before the first step (FINDINGS 6: eager reduce of the data batch in "
             "_maybe_symbolic_build; axis=0 reduce of scalar logs), so the multi-worker "
             "baseline is HeteroMultiWorkerMirroredStrategy at the even split.")


def single_host(args, tiny, repeats):
    """Part (a): in this process, 2 logical CPUs, stock vs ours, interleaved."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.dirname(bc.HERE))  # examples/
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    import fashion_mnist
    import tf_hetbatch as hb
    from hetero_worker import build_model

    devices = ["/cpu:0", "/cpu:1"]
    steps = args.steps if tiny else 40
    x, y, source = fashion_mnist.load("train", 2560 if tiny else 12800)
    ds = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=args.seed)
          .batch(args.batch, drop_remainder=True).repeat())

    class Timer(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.times, self._last = [], None
            self.cpu0 = time.process_time()

        def on_train_end(self, logs=None):
            self.cpu_per_step = (time.process_time() - self.cpu0) / max(1, len(self.times))

        def on_train_batch_begin(self, batch, logs=None):
            if self._last is None:
                self._last = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            self.times.append(now - self._last)
            self._last = now

    out = {}
    # One strategy of each kind for the whole process: a second pair would reuse collective
    # instance keys of the first and abort with a shape mismatch.
    strategies = {"stock": tf.distribute.MirroredStrategy(devices),
                  "ours": hb.HeteroMirroredStrategy(devices)}
    for model_name in args.models.split(","):
        plan = {"model": model_name, "filters": 8}
        models = {}
        for name, strategy in strategies.items():
            models[name] = build_model(strategy, plan)
            models[name].fit(ds, epochs=1, steps_per_epoch=3, verbose=0)  # trace
        medians = {"stock": [], "ours": []}
        cpu = {"stock": [], "ours": []}
        ratios, cpu_ratios = [], []
        for rep in range(repeats):
            order = ("stock", "ours") if rep % 2 == 0 else ("ours", "stock")
            got = {}
            for name in order:
                timer = Timer()
                models[name].fit(ds, epochs=1, steps_per_epoch=steps, verbose=0,
                                 callbacks=[timer])
                skip = min(3, len(timer.times) - 1)
                got[name] = float(np.median(timer.times[skip:]))
                medians[name].append(got[name] * 1e3)
                cpu[name].append(timer.cpu_per_step * 1e3)
            ratios.append(got["ours"] / got["stock"])
            cpu_ratios.append(cpu["ours"][-1] / cpu["stock"][-1])
            print(f"    (a) {model_name} rep {rep + 1}: stock {got['stock'] * 1e3:.2f} ms, "
                  f"ours {got['ours'] * 1e3:.2f} ms, ratio {ratios[-1]:.3f}; CPU per step "
                  f"{cpu['stock'][-1]:.1f} / {cpu['ours'][-1]:.1f} ms, ratio {cpu_ratios[-1]:.3f}",
                  flush=True)
        out[model_name] = {"stock_ms": medians["stock"], "ours_ms": medians["ours"],
                           "ratios": ratios, "ratio": bc.stats(ratios),
                           "stock": bc.stats(medians["stock"]), "ours": bc.stats(medians["ours"]),
                           "stock_cpu_ms": cpu["stock"], "ours_cpu_ms": cpu["ours"],
                           "cpu_ratios": cpu_ratios, "cpu_ratio": bc.stats(cpu_ratios)}
    return {"data": source, "steps": steps, "models": out}


def cluster(args, tiny, workdir):
    """Part (b): 2 workers, equal caps, even vs DynamicBatching in one cluster run."""
    steps = args.steps + 12 if tiny else 60
    phases = [{"name": "warmup", "kind": "warmup", "sizes": "even", "steps": 3 if tiny else 10,
               "skip": 0}]
    for r in range(1, args.repeats + 1):
        pair = [{"name": f"even r{r}", "kind": "static", "sizes": "even", "steps": steps,
                 "skip": 12},
                {"name": f"dynamic r{r}", "kind": "dynamic", "initial": "uniform",
                 "steps": 24 if tiny else steps}]
        phases += pair if r % 2 else pair[::-1]
    plan = {"task": "phases", "model": args.cluster_model, "filters": 32, "batch": args.batch,
            "train_samples": 1280 if tiny else 12800, "seed": args.seed, "phases": phases}
    caps = [None, None] if tiny else [args.cap, args.cap]
    result = bc.run_cluster(plan, caps, workdir, "overhead_cluster", args.timeout,
                            cap_after=None if tiny else 20.0)
    rounds = []
    for r in range(1, args.repeats + 1):
        even = next(p for p in result["phases"] if p["name"] == f"even r{r}")
        dyn = next(p for p in result["phases"] if p["name"] == f"dynamic r{r}")
        # Same measured range: even skips its switch lag; dynamic's first 12 steps likewise.
        dyn_ms = float(np.median(dyn["step_seconds"][12:] or dyn["step_seconds"]) * 1e3)
        rounds.append({"round": r, "even_ms": even["step_ms_median"], "dynamic_ms": dyn_ms,
                       "ratio": dyn_ms / even["step_ms_median"], "dynamic_sizes": dyn["sizes"],
                       "adjustments": dyn["adjustments"]})
        print(f"    (b) round {r}: even {even['step_ms_median']:.1f} ms, dynamic {dyn_ms:.1f} ms "
              f"(split {dyn['sizes']}, {dyn['adjustments']} adj.)", flush=True)
    return {"caps": caps, "cap_method": result["cap_method"], "model": args.cluster_model,
            "rounds": rounds, "ratio": bc.stats([r["ratio"] for r in rounds]),
            "even": bc.stats([r["even_ms"] for r in rounds]),
            "dynamic": bc.stats([r["dynamic_ms"] for r in rounds]), "stock_mwms": MWMS_NOTE,
            "phases": [{k: v for k, v in p.items() if k != "stamps"} for p in result["phases"]]}


def plot(a, b, png):
    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, data = [], []
    for name, m in a["models"].items():
        labels.append(f"(a) {name}\nours/stock")
        data.append(m["ratios"])
    labels.append(f"(b) cluster {b['model']}\ndynamic/even")
    data.append([r["ratio"] for r in b["rounds"]])
    for i, vals in enumerate(data):
        ax.scatter([i] * len(vals), vals, color="C0")
        ax.hlines(np.median(vals), i - 0.25, i + 0.25, color="C1")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(GOAL, color="r", ls="--", lw=0.8, label=f"goal {GOAL}")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("median step time ratio")
    ax.set_title("tf_hetbatch overhead at an even split (each dot one repetition)")
    ax.legend()
    bc.save_figure(fig, png)


def main(argv=None):
    parser = bc.base_parser(__doc__, os.path.join(bc.DEFAULT_OUT_DIR, "overhead.json"),
                            out_help="JSON results; the PNG goes next to it")
    parser.add_argument("--steps", type=int, default=None,
                        help="tiny mode: this many measured steps per repetition, no caps")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved repetitions (default 15 for the single host and 5 "
                             "cluster rounds; tiny 2)")
    parser.add_argument("--models", default="small_cnn,dense",
                        help="models for part (a) (small_cnn, dense, cnn, linear)")
    parser.add_argument("--cluster-model", default="small_cnn", help="model for part (b)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--cap", type=float, default=0.8,
                        help="CPU cap of each of the 2 workers in part (b) (default 0.8)")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    tiny = args.steps is not None
    host_repeats = args.repeats or (2 if tiny else 15)
    args.repeats = args.repeats or (2 if tiny else 5)
    json_path, png, workdir = bc.out_paths(args.out)
    when = bc.now_utc()
    started = time.time()
    print("bench_overhead (b): homogeneous 2-worker cluster", flush=True)
    b = cluster(args, tiny, workdir)
    print("bench_overhead (a): one host, 2 logical CPUs", flush=True)
    a = single_host(args, tiny, host_repeats)

    lines = [f"bench_overhead, {when}: B={args.batch}, even split, seed {args.seed}, "
             f"{host_repeats} interleaved repetitions on one host, {args.repeats} cluster "
             "rounds; median (min-max) over repetitions.", ""]
    rows = []
    for name, m in a["models"].items():
        rows.append([f"(a) one host, 2 logical CPUs, {name}", "MirroredStrategy",
                     bc.fmt_stats(m["stock"], digits=2), "HeteroMirroredStrategy",
                     bc.fmt_stats(m["ours"], digits=2),
                     bc.fmt_stats(m["ratio"], digits=3)
                     + f"; CPU/step {bc.fmt_stats(m['cpu_ratio'], digits=3)}"])
    rows.append([f"(b) 2 workers, caps {b['caps']}, {b['model']}", "ours, even split",
                 bc.fmt_stats(b["even"], digits=1), "ours + DynamicBatching",
                 bc.fmt_stats(b["dynamic"], digits=1), bc.fmt_stats(b["ratio"], digits=3)])
    rows.append(["(b) stock MultiWorkerMirroredStrategy", "-", "-", "-", "-",
                 "n/a: Keras 3.15 fit crashes (FINDINGS 6)"])
    lines += bc.table(["setting", "baseline", "ms/step", "ours", "ms/step", "ratio ours/baseline"],
                      rows, ["---", "---", "---:", "---", "---:", "---:"])
    met = {name: m["ratio"]["median"] <= GOAL for name, m in a["models"].items()}
    met["cluster"] = b["ratio"]["median"] <= GOAL
    lines += ["", f"Goal median ratio <= {GOAL}: " + ", ".join(
        f"{k} {'met' if v else 'MISSED'}" for k, v in met.items()) + ".", "", MWMS_NOTE]
    print("\n" + "\n".join(lines))
    plot(a, b, png)
    bc.write_json(json_path, {"benchmark": "bench_overhead", "date": when, "seed": args.seed,
                              "tiny": tiny, "batch": args.batch, "repeats": args.repeats,
                              "host_repeats": host_repeats,
                              "single_host": a, "cluster": b, "goal": GOAL, "goal_met": met,
                              "elapsed_s": time.time() - started,
                              "environment": bc.environment(), "png": png})
    print(f"\nJSON: {json_path}\nPNG:  {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
