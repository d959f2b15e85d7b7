"""A multi-worker training script for the recovery tests: run by tf_hetbatch.launch.

Trains the dense model of mw_train.py (SGD with momentum, so optimizer state matters) with
HeteroMultiWorkerMirroredStrategy and a ResumableCheckpoint on deterministic, unshuffled data.
On launch attempt `--die-attempt` (TF_HETBATCH_RESTART), worker `--die-worker` SIGKILLs itself
after global step `--die-step`; on attempt `--term-attempt`, worker `--term-worker` sends
itself a SIGTERM (a preemption notice) after step `--term-step`; with `--stop-step` every
worker stops training cleanly (model.stop_training) after that step. Writes
<out>/worker<i>.npz (weights, ids trained in this process) and <out>/worker<i>.json (what it
resumed from, its first trained step, ...) at the end, and for every attempt
<out>/worker<i>.attempt<a>.json (its first step at the start; at its end, also by SystemExit,
its last step, the step saved on a notice, the ids it trained).
"""

import argparse
import json
import logging
import os
import signal

import worker_start  # noqa: F401  (first: before TensorFlow)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import mw_train  # noqa: E402  (same directory: on sys.path as the script's own)
import tf_hetbatch as hb  # noqa: E402
from tf_hetbatch.training.recovery import ResumableCheckpoint  # noqa: E402


def build(sink=None, steps_per_execution=1):
    model = mw_train.build(sink)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


class Events(keras.callbacks.Callback):
    """Records the first trained step; dies, gets a notice or stops at the configured step."""

    def __init__(self, strategy, die_step, stop_step, term_step=-1, record=None):
        super().__init__()
        self.strategy, self.die_step, self.stop_step = strategy, die_step, stop_step
        self.term_step, self.record = term_step, record
        self.first_step = None
        self.steps = 0
        self.step = 0

    def on_train_begin(self, logs=None):
        self.step = self.first_step = self.strategy.steps_trained
        if self.record:
            with open(self.record, "w") as f:
                json.dump({"first_step": self.first_step}, f)

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        self.steps += 1
        if self.step == self.die_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.step == self.term_step:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.step == self.stop_step:
            self.model.stop_training = True


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True,
                        help="the checkpoint directory; {worker} in it is replaced by the "
                             "worker's index (a directory per worker, not shared)")
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--die-worker", type=int, default=-1)
    parser.add_argument("--die-attempt", type=int, default=0)
    parser.add_argument("--die-step", type=int, default=-1)
    parser.add_argument("--stop-step", type=int, default=-1)
    parser.add_argument("--term-worker", type=int, default=-1)
    parser.add_argument("--term-attempt", type=int, default=0)
    parser.add_argument("--term-step", type=int, default=-1)
    parser.add_argument("--dynamic", action="store_true", help="with DynamicBatching")
    parser.add_argument("--layout", default="", help="replicas (logical CPUs) per worker")
    parser.add_argument("--sizes", default="",
                        help="the first attempt's split, comma separated (later: restored)")
    parser.add_argument("--micro-batch-limits", default="",
                        help="per replica, comma separated, 0 for no bound")
    parser.add_argument("--log-info", action="store_true",
                        help="show tf_hetbatch's INFO lines (resume, preemption notices)")
    args = parser.parse_args()
    if args.log_info:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    attempt = int(os.environ.get("TF_HETBATCH_RESTART", "0"))
    strategy = hb.HeteroMultiWorkerMirroredStrategy(mw_train.layout_devices(args.layout))
    index = strategy.cluster_resolver.task_id
    if args.sizes and attempt == 0:
        strategy.set_batch_sizes([int(v) for v in args.sizes.split(",")])
    if args.micro_batch_limits:
        strategy.set_micro_batch_limits(mw_train.limits(args.micro_batch_limits))
    sink = mw_train.Sink()
    with strategy.scope():
        model = build(sink)
    dynamic = None
    if args.dynamic:
        dynamic = hb.DynamicBatching(initial="uniform", warmup_steps=1, interval=3)
    ckpt = ResumableCheckpoint(args.ckpt.replace("{worker}", str(index)),
                               save_every_steps=args.every, keep=args.keep,
                               dynamic_batching=dynamic)
    initial_epoch = ckpt.restore(model)
    restored_sizes = list(strategy.batch_sizes) if strategy.batch_sizes else None
    restored_dynamic = list(dynamic.batch_sizes) if dynamic and dynamic.batch_sizes else None
    die = args.die_step if (index == args.die_worker and attempt == args.die_attempt) else -1
    term = args.term_step if (index == args.term_worker and attempt == args.term_attempt) \
        else -1
    os.makedirs(args.out, exist_ok=True)
    record = os.path.join(args.out, f"worker{index}.attempt{attempt}")
    events = Events(strategy, die, args.stop_step, term, record + ".json")
    x, y = mw_train.data(args.n)
    # A per-sample map: each worker runs it on its own samples only (distribute.input_work),
    # and a resumed epoch skips its trained batches before any of that work.
    ds = tf.data.Dataset.from_tensor_slices((x * 2.0, y)).map(
        lambda a, b: (a * 0.5, b), num_parallel_calls=2).batch(args.batch)
    callbacks = ([dynamic] if dynamic else []) + [ckpt, events]
    try:
        model.fit(ds, epochs=args.epochs, initial_epoch=initial_epoch, verbose=0,
                  callbacks=callbacks)
    finally:  # also on the SystemExit(RESTART_EXIT_CODE) of a preemption notice
        np.savez(record + ".npz", ids=np.array(sink.items, dtype=np.int64))
        with open(record + ".json", "w") as f:
            json.dump({"first_step": events.first_step, "last_step": events.step,
                       "preempted_at": ckpt.preempted_at, "restored": ckpt.restored,
                       "calls": sink.calls}, f)
    np.savez(os.path.join(args.out, f"worker{index}.npz"), *model.get_weights(),
             ids=np.array(sink.items, dtype=np.int64))
    with open(os.path.join(args.out, f"worker{index}.json"), "w") as f:
        json.dump({
            "attempt": attempt,
            "restored": ckpt.restored,
            "initial_epoch": initial_epoch,
            "first_step": events.first_step,
            "steps": events.steps,
            "steps_trained": strategy.steps_trained,
            "restored_sizes": restored_sizes,
            "restored_dynamic_sizes": restored_dynamic,
            "batch_sizes": list(strategy.batch_sizes),
            "num_replicas": strategy.num_replicas_in_sync,
            "chief": strategy.is_chief,
        }, f)


if __name__ == "__main__":
    main()
