"""Overhead of tf_hetbatch's strategy against the stock one at an even split and equal B.

(a) One host, 2 logical CPUs: stock `tf.distribute.MirroredStrategy` vs
    `HeteroMirroredStrategy`, the same model (a small CNN and a Dense model on Fashion-MNIST)
    with the same initial weights and data. Per model:
    - per step, steady state: what `fit` runs per step (the model's train function on a
      distributed iterator that lives through the epoch), `--blocks` blocks of 10 steps, the
      models in random order in each block; ratio = ours / stock of the same block, median
      over blocks with a 90% bootstrap interval. A second stock strategy with its own copy of
      the model ("control") gives the noise floor: two identical set-ups differ by a few % on
      a shared 2-core machine. Also the process CPU time per step. Two inputs, one figure
      each: a tf.data pipeline batched with `drop_remainder=True` (the stock strategy's best
      case: static per-replica shapes, which a split that changes between steps cannot
      have), and batches of unknown size from a finite dataset, as `fit(x, y, batch_size=B)`
      builds from arrays (dynamic shapes for both strategies).
    - with `--noise`, a fourth set-up: ours measuring the gradient noise scale
      (`measure_gradient_noise`), its per-step ratio to ours without (goal: < 1.01).
    - once per epoch: the pipeline start (a new distributed iterator to its first step) and
      end (the iterator released after 10 steps), alternating, in ms.
(b) A homogeneous 2-worker cluster (equal CPU caps, one process per worker): ours at the even
    split vs ours + `DynamicBatching(initial="uniform")` (its measurement collectives every
    10 steps and any split changes it makes), interleaved rounds in ONE cluster run. The stock
    `MultiWorkerMirroredStrategy` cannot be compared: Keras 3.15 `fit` crashes under it before
    the first step (tensorflow#72388), so the multi-worker baseline is our strategy at the even
    split.

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
             "it before the first step (tensorflow#72388: eager reduce of the data batch in "
             "_maybe_symbolic_build; axis=0 reduce of scalar logs), so the multi-worker "
             "baseline is HeteroMultiWorkerMirroredStrategy at the even split.")


def single_host(args, tiny, blocks):
    """Part (a): in this process, 2 logical CPUs, stock vs a second stock vs ours."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.dirname(bc.HERE))  # examples/
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

    import fashion_mnist
    import tf_hetbatch as hb
    from hetero_worker import build_model
    from tf_hetbatch.distribute._upstream import collectives

    devices = ["/cpu:0", "/cpu:1"]
    block = args.steps if tiny else 10
    starts = 2 if tiny else 8
    x, y, source = fashion_mnist.load("train", 2560 if tiny else 12800)
    # Two ways data reaches fit, one per-step figure each:
    inputs = {
        # a tf.data pipeline batched with drop_remainder=True, repeated: the stock strategy
        # gets static per-replica shapes (B/K rows), which no changing split can have;
        "drop_remainder": (tf.data.Dataset.from_tensor_slices((x, y))
                           .shuffle(len(x), seed=args.seed)
                           .batch(args.batch, drop_remainder=True).repeat()),
        # batches of unknown size, finite (as fit(x, y, batch_size=B) builds them from
        # arrays): dynamic shapes and the stock per-step partial-batch check.
        "arrays": tf.data.Dataset.from_tensor_slices((x, y)).repeat(1000).batch(args.batch),
    }
    ds = inputs["drop_remainder"]
    rng = np.random.default_rng(args.seed)

    class Control(tf.distribute.MirroredStrategy):
        """The stock strategy, with collective keys of its own: two stock instances in one
        process share their keys, and their all-reduces of different models collide."""

        def __init__(self, devices):
            collectives.assign_collective_key_base(self)
            super().__init__(devices)

    # One strategy of each kind for the whole process, shared by the models. "control" is a
    # second stock strategy with its own copy of the model: ratio control/stock is the noise
    # floor of this comparison (two identical set-ups differ by a few % on a shared machine).
    strategies = {"stock": tf.distribute.MirroredStrategy(devices),
                  "control": Control(devices),
                  "ours": hb.HeteroMirroredStrategy(devices)}
    if args.noise:  # ours measuring the gradient noise scale: its cost against ours without
        strategies["noise"] = hb.HeteroMirroredStrategy(devices)
        strategies["noise"].measure_gradient_noise()
    out = {}
    for model_name in args.models.split(","):
        plan = {"model": model_name, "filters": 8}
        models = {}
        for name, strategy in strategies.items():
            models[name] = build_model(strategy, plan)
            models[name].fit(ds, epochs=1, steps_per_epoch=3, verbose=0)  # trace
        m = {"block_steps": block, "blocks": blocks}
        for style, data in inputs.items():
            got = _steady_state(strategies, models, data, block, blocks, rng)
            if style == "drop_remainder":
                m.update(got)  # the main figure, at the top level of the JSON
            else:
                m[style] = got

        # Once per epoch: a new distributed iterator to its first batch (the pipeline start),
        # and its release after `block` steps (Keras drops its iterator at the end of fit).
        start_ms = {name: [] for name in ("stock", "ours")}
        end_ms = {name: [] for name in ("stock", "ours")}
        for rep in range(starts):
            for name in (("stock", "ours") if rep % 2 == 0 else ("ours", "stock")):
                dist = strategies[name].experimental_distribute_dataset(ds)
                w0 = time.perf_counter()
                iterator = iter(dist)
                _train_steps(models[name], iterator, 1)
                start_ms[name].append((time.perf_counter() - w0) * 1e3)
                _train_steps(models[name], iterator, block)
                w0 = time.perf_counter()
                del iterator
                end_ms[name].append((time.perf_counter() - w0) * 1e3)
        m["pipeline_start_ms"] = {n: bc.stats(v) for n, v in start_ms.items()}
        m["pipeline_end_ms"] = {n: bc.stats(v) for n, v in end_ms.items()}
        out[model_name] = m
        print(f"    (a) {model_name}: per step (median of {blocks} blocks of {block} steps) "
              f"stock {m['stock']['median']:.2f} ms, ours {m['ours']['median']:.2f} ms, ratio "
              f"{bc.fmt_ratio(m['ratio'])}; control/stock {bc.fmt_ratio(m['control_ratio'])}; "
              f"array-style input: ratio {bc.fmt_ratio(m['arrays']['ratio'])}; per epoch: start "
              f"{m['pipeline_start_ms']['stock']['median']:.0f} / "
              f"{m['pipeline_start_ms']['ours']['median']:.0f} ms, end "
              f"{m['pipeline_end_ms']['stock']['median']:.0f} / "
              f"{m['pipeline_end_ms']['ours']['median']:.0f} ms", flush=True)
        if "noise_ratio" in m:
            print(f"    (a) {model_name}: measuring the noise scale / not: "
                  f"{bc.fmt_ratio(m['noise_ratio'])} per step, CPU "
                  f"{bc.fmt_ratio(m['noise_cpu_ratio'])}", flush=True)
    return {"data": source, "models": out}


def _steady_state(strategies, models, data, block, blocks, rng):
    """Per step, steady state: each set-up's train function on a distributed iterator of `data`
    that lives through the run, `blocks` blocks of `block` steps, random order in each block."""
    iterators = {}
    for name, strategy in strategies.items():
        iterators[name] = iter(strategy.experimental_distribute_dataset(data))
        _train_steps(models[name], iterators[name], 3)  # a new input signature may retrace
    wall = {name: [] for name in strategies}
    cpu = {name: [] for name in strategies}
    for _ in range(blocks):
        for name in rng.permutation(list(strategies)):
            w0, c0 = time.perf_counter(), time.process_time()
            _train_steps(models[name], iterators[name], block)
            wall[name].append((time.perf_counter() - w0) / block * 1e3)
            cpu[name].append((time.process_time() - c0) / block * 1e3)
    ratio = {name: list(np.array(wall[name]) / np.array(wall["stock"]))
             for name in ("control", "ours")}
    cpu_ratio = {name: list(np.array(cpu[name]) / np.array(cpu["stock"]))
                 for name in ("control", "ours")}
    noise = {}
    if "noise" in strategies:
        noise = {"noise_ms": wall["noise"],
                 "noise_ratio": bc.ratio_stats(list(np.array(wall["noise"]) /
                                                    np.array(wall["ours"])), rng),
                 "noise_cpu_ratio": bc.ratio_stats(list(np.array(cpu["noise"]) /
                                                        np.array(cpu["ours"])), rng)}
    return {**noise, "stock_ms": wall["stock"], "control_ms": wall["control"],
            "ours_ms": wall["ours"],
            "stock": bc.stats(wall["stock"]), "control": bc.stats(wall["control"]),
            "ours": bc.stats(wall["ours"]),
            "ratios": ratio["ours"], "control_ratios": ratio["control"],
            "ratio": bc.ratio_stats(ratio["ours"], rng),
            "control_ratio": bc.ratio_stats(ratio["control"], rng),
            "cpu_ratio": bc.ratio_stats(cpu_ratio["ours"], rng),
            "control_cpu_ratio": bc.ratio_stats(cpu_ratio["control"], rng),
            "stock_cpu_ms": bc.stats(cpu["stock"]), "ours_cpu_ms": bc.stats(cpu["ours"])}


def _train_steps(model, iterator, steps):
    """`steps` training steps as `fit` runs them (Keras's train function on the iterator)."""
    for _ in range(steps):
        logs = model.train_function(iterator)
    float(logs["loss"])  # the last step has finished


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
                       "adjustments": dyn["adjustments"],
                       "search_tries": dyn.get("search_tries", 0)})
        print(f"    (b) round {r}: even {even['step_ms_median']:.1f} ms, dynamic {dyn_ms:.1f} ms "
              f"(split {dyn['sizes']}, {dyn['adjustments']} adj., "
              f"{dyn.get('search_tries', 0)} search tries)", flush=True)
    return {"caps": caps, "cap_method": result["cap_method"], "model": args.cluster_model,
            "rounds": rounds, "ratio": bc.stats([r["ratio"] for r in rounds]),
            "even": bc.stats([r["even_ms"] for r in rounds]),
            "dynamic": bc.stats([r["dynamic_ms"] for r in rounds]), "stock_mwms": MWMS_NOTE,
            "phases": [{k: v for k, v in p.items() if k != "stamps"} for p in result["phases"]]}


def plot(a, b, png):
    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    labels, data = [], []
    for name, m in a["models"].items():
        labels.append(f"(a) {name}\nours/stock")
        data.append(m["ratios"])
        labels.append(f"(a) {name}\narrays\nours/stock")
        data.append(m["arrays"]["ratios"])
        labels.append(f"(a) {name}\ncontrol/stock")
        data.append(m["control_ratios"])
    if b is not None:
        labels.append(f"(b) cluster {b['model']}\ndynamic/even")
        data.append([r["ratio"] for r in b["rounds"]])
    for i, vals in enumerate(data):
        ax.scatter([i] * len(vals), vals, color="C0")
        ax.hlines(np.median(vals), i - 0.25, i + 0.25, color="C1")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(GOAL, color="r", ls="--", lw=0.8, label=f"goal {GOAL}")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("step time ratio")
    ax.set_title("tf_hetbatch overhead at an even split\n(each dot: (a) one block of steps, "
                 "(b) one cluster round)", fontsize=10)
    ax.legend()
    bc.save_figure(fig, png)


def main(argv=None):
    parser = bc.base_parser(__doc__, os.path.join(bc.DEFAULT_OUT_DIR, "overhead.json"),
                            out_help="JSON results; the PNG goes next to it")
    parser.add_argument("--steps", type=int, default=None,
                        help="tiny mode: this many steps per block of part (a) and per "
                             "cluster phase of part (b), no caps")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved cluster rounds of part (b) (default 15; tiny 2)")
    parser.add_argument("--blocks", type=int, default=None,
                        help="blocks of 10 steps per model in part (a) (default 150; tiny 2)")
    parser.add_argument("--models", default="small_cnn,dense",
                        help="models for part (a) (small_cnn, dense, cnn, linear)")
    parser.add_argument("--cluster-model", default="small_cnn", help="model for part (b)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--cap", type=float, default=0.8,
                        help="CPU cap of each of the 2 workers in part (b) (default 0.8)")
    parser.add_argument("--parts", default="a,b",
                        help="parts to run: a (one host), b (the 2-worker cluster) or a,b")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--noise", action="store_true",
                        help="(a) also ours measuring the gradient noise scale, against ours")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts or parts - {"a", "b"}:
        parser.error(f"--parts takes a, b or a,b. Received: --parts {args.parts}")
    tiny = args.steps is not None
    blocks = args.blocks or (2 if tiny else 150)
    args.repeats = args.repeats or (2 if tiny else 15)
    json_path, png, workdir = bc.out_paths(args.out)
    when = bc.now_utc()
    started = time.time()
    a, b = {"models": {}}, None
    if "b" in parts:
        print("bench_overhead (b): homogeneous 2-worker cluster", flush=True)
        b = cluster(args, tiny, workdir)
    if "a" in parts:
        print("bench_overhead (a): one host, 2 logical CPUs", flush=True)
        a = single_host(args, tiny, blocks)

    lines = [f"bench_overhead, {when}: B={args.batch}, even split, seed {args.seed}. (a) per "
             f"step: median over {blocks} blocks of ms/step, ratio = median of per-block "
             f"ratios [90% bootstrap interval]; (b) {args.repeats} cluster rounds, median "
             "(min-max).", ""]
    rows = []
    for name, m in a["models"].items():
        rows.append([f"(a) one host, 2 logical CPUs, {name}, per step", "MirroredStrategy",
                     f"{m['stock']['median']:.2f}", "HeteroMirroredStrategy",
                     f"{m['ours']['median']:.2f}",
                     f"{bc.fmt_ratio(m['ratio'])}; CPU/step {bc.fmt_ratio(m['cpu_ratio'])}; "
                     f"control (2nd stock) {bc.fmt_ratio(m['control_ratio'])}"])
        arr = m["arrays"]
        rows.append([f"(a) {name}, per step, input as fit(x, y, batch_size={args.batch}) "
                     "builds it", "MirroredStrategy", f"{arr['stock']['median']:.2f}",
                     "HeteroMirroredStrategy", f"{arr['ours']['median']:.2f}",
                     f"{bc.fmt_ratio(arr['ratio'])}; CPU/step {bc.fmt_ratio(arr['cpu_ratio'])}; "
                     f"control (2nd stock) {bc.fmt_ratio(arr['control_ratio'])}"])
        for what, key in (("start (new iterator to its first step)", "pipeline_start_ms"),
                          ("end (iterator released)", "pipeline_end_ms")):
            got = m[key]
            rows.append([f"(a) {name}, once per epoch: {what}", "MirroredStrategy",
                         bc.fmt_stats(got["stock"]), "HeteroMirroredStrategy",
                         bc.fmt_stats(got["ours"]),
                         f"{got['ours']['median'] - got['stock']['median']:+.0f} ms"])
    if b is not None:
        rows.append([f"(b) 2 workers, caps {b['caps']}, {b['model']}", "ours, even split",
                     bc.fmt_stats(b["even"], digits=1), "ours + DynamicBatching",
                     bc.fmt_stats(b["dynamic"], digits=1), bc.fmt_stats(b["ratio"], digits=3)])
        rows.append(["(b) stock MultiWorkerMirroredStrategy", "-", "-", "-", "-",
                     "n/a: Keras 3.15 fit crashes (tensorflow#72388)"])
    lines += bc.table(["setting", "baseline", "ms/step", "ours", "ms/step", "ratio ours/baseline"],
                      rows, ["---", "---", "---:", "---", "---:", "---:"])
    met = {}
    for name, m in a["models"].items():
        met[name] = m["ratio"]["median"] <= GOAL
        met[f"{name} (array input)"] = m["arrays"]["ratio"]["median"] <= GOAL
    if b is not None:
        met["cluster"] = b["ratio"]["median"] <= GOAL
        met["cluster: no move"] = all(r["adjustments"] + r["search_tries"] == 0
                                      for r in b["rounds"])
    lines += ["", f"Goal median ratio <= {GOAL}: " + ", ".join(
        f"{k} {'met' if v else 'MISSED'}" for k, v in met.items()) + ".", "", MWMS_NOTE]
    print("\n" + "\n".join(lines))
    plot(a, b, png)
    bc.write_json(json_path, {"benchmark": "bench_overhead", "date": when, "seed": args.seed,
                              "tiny": tiny, "batch": args.batch, "repeats": args.repeats,
                              "blocks": blocks,
                              "single_host": a, "cluster": b, "goal": GOAL, "goal_met": met,
                              "elapsed_s": time.time() - started,
                              "environment": bc.environment(), "png": png})
    print(f"\nJSON: {json_path}\nPNG:  {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
