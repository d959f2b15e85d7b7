"""Chief of an asynchronous test cluster: trains a small real model with AsyncTrainer.

Run as the chief of a TF_CONFIG cluster with "ps" and "worker" tasks (e.g. by
`python -m tf_hetbatch.launch --ps 1 --workers 2 asp_train.py --out result.json`).
Writes a JSON result: per-epoch logs, per-worker samples/updates, staleness histogram, split;
and per launch attempt <out>.attempt<a>.json (updates applied, the update saved at on a
preemption notice), also when fit ends by the SystemExit of a notice.
"""

import argparse
import json
import os
import signal
import sys

import worker_start  # noqa: F401  (first: before TensorFlow)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_hetbatch as hb  # noqa: E402


def make_data(n, seed=0):
    """A learnable 3-class problem: the class is the argmax of a fixed linear map of x."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    w = np.random.default_rng(123).normal(size=(16, 3)).astype(np.float32)
    y = np.argmax(x @ w, axis=1).astype(np.int32)
    return x, y


def kill_task(task):
    """SIGKILLs the local process serving `task` ("worker:1") of TF_CONFIG's cluster."""
    kind, index = task.split(":")
    port = int(json.loads(os.environ["TF_CONFIG"])["cluster"][kind][int(index)].split(":")[1])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
                    inodes.add(fields[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds}
        except OSError:
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            print(f"killing {task} (pid {pid})", flush=True)
            os.kill(int(pid), signal.SIGKILL)
            return
    raise RuntimeError(f"no process listens on port {port} for {task}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="updates per epoch")
    p.add_argument("--batch-size", type=int, default=16, help="mean batch per update")
    p.add_argument("--sizes", default=None, help="fixed per-worker sizes, e.g. 24,8")
    p.add_argument("--dynamic", action="store_true", help="use DynamicBatching")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-interval", type=int, default=None)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--kill-after-epoch", default=None, metavar="TYPE:INDEX",
                   help="SIGKILL this task (e.g. worker:1, ps:0) at the end of the first "
                        "epoch, on launch attempt --kill-attempt only (fault-tolerance tests)")
    p.add_argument("--kill-attempt", type=int, default=0)
    p.add_argument("--term-at-update", type=int, default=None, metavar="N",
                   help="the chief sends itself a SIGTERM (a preemption notice) after its N-th "
                        "scheduled update, on the first launch attempt only")
    p.add_argument("--keras-callbacks", default=None, metavar="DIR",
                   help="also keras.callbacks.TensorBoard(DIR), EarlyStopping, CSVLogger")
    args = p.parse_args(argv)

    strategy = hb.HeteroParameterServerStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(3)])
        # Both ways of naming a metric: an object (made under the scope) or a name.
        metric = (keras.metrics.SparseCategoricalAccuracy(name="accuracy") if args.dynamic
                  else "accuracy")
    trainer = hb.AsyncTrainer(
        model, keras.optimizers.SGD(args.lr),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=[metric],
        checkpoint_dir=args.checkpoint_dir, checkpoint_interval=args.checkpoint_interval)
    x, y = make_data(4096)
    xv, yv = make_data(1024, seed=1)

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        return ds.shuffle(4096, seed=context.input_pipeline_id).repeat()

    class Counts(keras.callbacks.Callback):
        """Samples the loss metric counted vs samples trained, per epoch."""

        def on_train_begin(self, logs=None):
            self.seen, self.rows = float(strategy.read_totals().samples.sum()), []
            self.torn = 0  # reads whose samples and updates came from different updates

        def on_train_batch_end(self, batch, logs=None):
            if args.sizes:  # a fixed split: worker k's samples are b_k per update
                totals = strategy.read_totals()
                self.torn += int(not np.array_equal(totals.samples, sizes * totals.steps))

        def on_epoch_end(self, epoch, logs=None):
            total = float(strategy.read_totals().samples.sum())
            self.rows.append([float(trainer.loss_tracker.count.numpy()), total - self.seen])
            self.seen = total

    counts = Counts()
    callbacks = [counts]
    if args.dynamic:
        callbacks.append(hb.DynamicBatching(log_dir=args.log_dir, interval=10, warmup_steps=4))
    attempt = os.environ.get("TF_HETBATCH_RESTART", "0")
    if args.kill_after_epoch and attempt == str(args.kill_attempt):
        class Kill(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 0:
                    kill_task(args.kill_after_epoch)
        callbacks.append(Kill())
    if args.term_at_update and attempt == "0":
        class Term(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.count = 0

            def on_train_batch_end(self, batch, logs=None):
                self.count += 1
                if self.count == args.term_at_update:
                    os.kill(os.getpid(), signal.SIGTERM)
        callbacks.append(Term())
    if args.keras_callbacks:
        callbacks += [keras.callbacks.TensorBoard(args.keras_callbacks),
                      keras.callbacks.EarlyStopping(monitor="val_loss", patience=5),
                      keras.callbacks.CSVLogger(os.path.join(args.keras_callbacks, "log.csv"))]
    sizes = np.array([int(v) for v in args.sizes.split(",")]) if args.sizes else None
    if args.sizes:
        strategy.set_global_batch_size(args.batch_size * strategy.num_workers)
        strategy.set_batch_sizes([int(v) for v in args.sizes.split(",")])
    try:
        history = trainer.fit(dataset_fn, batch_size=args.batch_size, epochs=args.epochs,
                              steps_per_epoch=args.steps,
                              validation_data=tf.data.Dataset.from_tensor_slices((xv, yv))
                              .batch(256), callbacks=callbacks, verbose=2)
    finally:
        try:
            updates = strategy.updates
        except tf.errors.OpError:  # a parameter server is gone
            updates = None
        with open(f"{args.out}.attempt{attempt}.json", "w") as f:
            json.dump({"updates": updates, "preempted_at": trainer.preempted_at,
                       "restored": trainer.restored}, f)
    times = strategy.read_replica_times()
    result = {
        "history": history.history,
        "samples": times.samples.tolist(),
        "updates": times.steps.tolist(),
        "seconds": times.compute_seconds.tolist(),
        "staleness_histogram": trainer.staleness.histogram.tolist(),
        "batch_sizes": list(strategy.batch_sizes),
        "iterations": int(trainer.optimizer.iterations.numpy()),
        "update_count": strategy.updates,
        "restored": trainer.restored,
        "metric_vs_trained_samples": counts.rows,
        "torn_reads": counts.torn,
        "evaluate": trainer.evaluate(tf.data.Dataset.from_tensor_slices((xv, yv)).batch(256),
                                     return_dict=True, verbose=0),
    }
    if args.dynamic:
        result["adjustments"] = callbacks[1].history
    with open(args.out, "w") as f:
        json.dump(result, f)
    print("done", json.dumps(result["history"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
