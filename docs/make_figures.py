"""Regenerates the manual's figures from real runs: `python docs/make_figures.py`.

docs/img/balance.png: the balance PNG of the demo's `DynamicBatching()` run (3 worker processes
on 127.0.0.1 with CPU caps in the shape 3:5:12, one epoch of in-memory Fashion-MNIST): the
batch size each replica gets over the steps, and its compute time per step. About 3 minutes on
2 cores.

docs/img/layout.png: the layout of a mixed cluster, from a real run of 2 worker processes on
127.0.0.1 started by the package's launcher: worker 0 hosts 1 replica (uncapped), worker 1
hosts 2 (logical CPUs, capped at 0.5 CPUs together). `DynamicBatching` adjusts the split over
a few windows; the chief writes the layout, the split in force at the end and each replica's
compute time per step at that split to a JSON file, and this script draws one box per worker,
one box per replica, and the all-reduce between the workers. About a minute on 2 cores.

`--only balance` or `--only layout` makes one figure alone.
"""

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from tf_hetbatch.launch import launch

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO = os.path.join(HERE, "..", "examples", "demo.py")
OUT = os.path.join(HERE, "img", "balance.png")
LAYOUT_OUT = os.path.join(HERE, "img", "layout.png")


def make_balance():
    work = tempfile.mkdtemp(prefix="hetbatch_figures_")
    try:
        subprocess.run([sys.executable, DEMO, "--epochs", "1", "--pipeline", "arrays",
                        "--out", work], check=True, timeout=1200)
        png = os.path.join(work, "logs_dynamic", "hetbatch_balance.png")
        os.makedirs(os.path.dirname(OUT), exist_ok=True)
        shutil.copyfile(png, OUT)
        print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------- layout -------
# The job the launcher runs: every worker trains; the chief writes layout.json.
LAYOUT_TRAIN_PY = '''
import json, os, sys
import numpy as np
import keras
import tensorflow as tf
import tf_hetbatch as hb

COUNTS = [1, 2]  # replicas per worker
GLOBAL_BATCH = 192


class Measure(keras.callbacks.Callback):
    """Each replica's compute time per step over one `fit`."""

    def on_train_begin(self, logs=None):
        self.before = self.model.distribute_strategy.read_replica_times()

    def on_train_end(self, logs=None):
        self.result = self.model.distribute_strategy.read_replica_times() - self.before


def main(out):
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * COUNTS[index])
    strategy = hb.HeteroMultiWorkerMirroredStrategy(
        devices=[f"/cpu:{i}" for i in range(COUNTS[index])])
    print("figure:", strategy.layout.describe(), flush=True)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * 40, 64)).astype("float32")
    y = x[:, :10].argmax(axis=1).astype("int32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    # The balancer's windows; then a short fit at the split it left, timed on its own.
    dyn = hb.DynamicBatching(initial="uniform", warmup_steps=3, interval=8)
    model.fit(dataset, epochs=EPOCHS, verbose=0, callbacks=[dyn])
    # A split the balancer asked for last reaches every worker switch_margin steps later.
    model.fit(dataset.take(strategy.switch_margin + 1), epochs=1, verbose=0)
    measure = Measure()
    model.fit(dataset.take(LAST_STEPS), epochs=1, verbose=0, callbacks=[measure])

    if strategy.is_chief:
        layout, times = strategy.layout, measure.result
        with open(os.path.join(out, "layout.json"), "w") as f:
            json.dump({"devices": [list(d) for d in layout.devices],
                       "all_reduce": layout.all_reduce,
                       "implementation": layout.implementation,
                       "describe": layout.describe(),
                       "global_batch": GLOBAL_BATCH,
                       "batch_sizes": list(strategy.batch_sizes),
                       "windows": len(dyn.windows),
                       "history": [h["new"] for h in dyn.history],
                       "measured_steps": LAST_STEPS,
                       "samples_per_step": times.samples_per_step.tolist(),
                       "ms_per_step": (1e3 * times.time_per_step).tolist()}, f)


if __name__ == "__main__":
    main(sys.argv[1])
'''
LAYOUT_CPUS = "none,0.5"  # worker 0 uncapped, worker 1 (two replicas) capped at 0.5 CPUs
LAYOUT_EPOCHS, LAYOUT_LAST_STEPS = 2, 10


def run_layout_job(work):
    """Runs the 2-worker job through the launcher; returns the chief's layout.json."""
    script = os.path.join(work, "train.py")
    with open(script, "w") as f:
        f.write(f"EPOCHS = {LAYOUT_EPOCHS}\nLAST_STEPS = {LAYOUT_LAST_STEPS}\n" + LAYOUT_TRAIN_PY)
    log = io.StringIO()
    result = launch([script, work], 2, cpus=LAYOUT_CPUS, threads=1, timeout=240, grace=5,
                    stdout=log, stderr=log)
    lines = log.getvalue().splitlines()
    for line in lines:
        if "] figure:" in line:
            print(line)
    if not result.ok:
        print("\n".join(lines[-40:]))
        raise SystemExit(f"make_figures: the layout run failed: {result.message}")
    with open(os.path.join(work, "layout.json")) as f:
        return json.load(f)


def short_device(name):
    """"/job:worker/task:1/device:CPU:0" -> "CPU:0"."""
    return name.rsplit("device:", 1)[-1]


def draw_layout(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    devices, sizes, ms = data["devices"], data["batch_sizes"], data["ms_per_step"]
    total = data["global_batch"]
    measured = [round(s) for s in data["samples_per_step"]]
    if measured != list(sizes):  # a switch took effect during the timed steps
        raise SystemExit(f"make_figures: the timed steps mixed two splits (samples per step "
                         f"{data['samples_per_step']}, split {sizes}); run it again.")
    fig, ax = plt.subplots(figsize=(8, 3.5), dpi=100)
    ax.set_xlim(0, 8)
    ax.set_ylim(0, 3.5)
    ax.axis("off")

    replica_w, replica_h, gap, pad = 1.6, 1.05, 0.2, 0.2
    widths = [len(d) * replica_w + (len(d) - 1) * gap + 2 * pad for d in devices]
    between = 1.3
    x = (8 - sum(widths) - between * (len(devices) - 1)) / 2
    worker_y, worker_h = 0.6, 2.3
    centers, replica = [], 0
    for w, (worker_devices, width) in enumerate(zip(devices, widths)):
        ax.add_patch(FancyBboxPatch((x, worker_y), width, worker_h,
                                    boxstyle="round,pad=0.02,rounding_size=0.08",
                                    fc="#eef2f7", ec="#4a5a70", lw=1.2))
        role = " (chief)" if w == 0 else ""
        cap = LAYOUT_CPUS.split(",")[w]
        cap = "uncapped" if cap == "none" else f"capped at {cap} CPUs"
        ax.text(x + width / 2, worker_y + worker_h - 0.25, f"worker {w}{role}",
                ha="center", va="center", fontsize=11, weight="bold", color="#2a3a50")
        ax.text(x + width / 2, worker_y + worker_h - 0.55, cap,
                ha="center", va="center", fontsize=9, color="#2a3a50")
        for i, device in enumerate(worker_devices):
            rx = x + pad + i * (replica_w + gap)
            ry = worker_y + 0.25
            ax.add_patch(FancyBboxPatch((rx, ry), replica_w, replica_h,
                                        boxstyle="round,pad=0.02,rounding_size=0.06",
                                        fc="white", ec="#3b7dd8", lw=1.2))
            ax.text(rx + replica_w / 2, ry + replica_h - 0.2,
                    f"replica {replica}: {short_device(device)}",
                    ha="center", va="center", fontsize=9.5)
            ax.text(rx + replica_w / 2, ry + replica_h / 2 - 0.08,
                    f"b = {sizes[replica]} of {total}",
                    ha="center", va="center", fontsize=11, weight="bold", color="#1d4f91")
            ax.text(rx + replica_w / 2, ry + 0.18, f"{ms[replica]:.1f} ms/step",
                    ha="center", va="center", fontsize=9.5, color="#444444")
            replica += 1
        centers.append((x, x + width))
        x += width + between

    # The all-reduce between neighbouring workers' boxes.
    ar_y = worker_y + worker_h / 2
    for (_, right), (left, _) in zip(centers, centers[1:]):
        ax.annotate("", xy=(left, ar_y), xytext=(right, ar_y),
                    arrowprops=dict(arrowstyle="<->", lw=1.8, color="#c0392b"))
        ax.text((left + right) / 2, ar_y + 0.2, "all-reduce", ha="center", va="bottom",
                fontsize=9.5, color="#c0392b")
        ax.text((left + right) / 2, ar_y - 0.2,
                ("one group\nof all replicas" if data["all_reduce"] == "device"
                 else "through each\nworker's CPU") + f"\n({data['all_reduce']}, "
                f"{data['implementation']})",
                ha="center", va="top", fontsize=8.5, color="#c0392b")

    ax.set_title(f"A mixed cluster: global batch B = {total}, split "
                 f"{' + '.join(str(s) for s in sizes)} by DynamicBatching",
                 fontsize=12)
    ax.text(4, 0.22, "2 worker processes on 127.0.0.1, replicas on logical CPUs. ms/step: each "
            f"replica's compute time per step, mean of {data['measured_steps']} steps at this "
            "split.", ha="center", va="center", fontsize=8, color="#555555")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def make_layout():
    work = tempfile.mkdtemp(prefix="hetbatch_layout_")
    try:
        data = run_layout_job(work)
        print("layout data:", json.dumps(data))
        os.makedirs(os.path.dirname(LAYOUT_OUT), exist_ok=True)
        draw_layout(data, LAYOUT_OUT)
        print(f"wrote {LAYOUT_OUT} ({os.path.getsize(LAYOUT_OUT)} bytes)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


FIGURES = {"balance": make_balance, "layout": make_layout}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(FIGURES), help="make this figure alone")
    args = parser.parse_args()
    # A SIGTERM runs the `finally` blocks (the work directory removed; `launch` stops its
    # workers itself).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    for name in [args.only] if args.only else ["balance", "layout"]:
        FIGURES[name]()


if __name__ == "__main__":
    main()
