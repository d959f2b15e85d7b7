"""A multi-worker job that ends as a user's script does: fit, evaluate, predict, exit.

Run by tf_hetbatch.launch with TF_CONFIG set; the model and data are mw_train.py's. After the
last training step each worker writes "mw_exit: training done" to stderr, where TensorFlow
writes its log lines, so a test can read what follows. It saves the evaluation and the
predictions to <out>/worker<i>.json; then worker `--linger-worker` works on (sleeps) for
`--linger` seconds before it exits, as a worker that writes results after training would.
"""

import argparse
import json
import os
import sys
import time

import worker_start  # noqa: F401  (first: before TensorFlow)

import tensorflow as tf  # noqa: E402

import mw_train  # noqa: E402  (same directory: on sys.path as the script's own)
import tf_hetbatch as hb  # noqa: E402

DONE = "mw_exit: training done"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--linger", type=float, default=0.0)
    parser.add_argument("--linger-worker", type=int, default=1)
    args = parser.parse_args()

    strategy = hb.HeteroMultiWorkerMirroredStrategy()
    with strategy.scope():
        model = mw_train.build()
    x, y = mw_train.data(args.n)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)
    model.fit(ds, epochs=1, verbose=0)
    print(DONE, file=sys.stderr, flush=True)
    evaluated = model.evaluate(ds, verbose=0, return_dict=True)
    predicted = model.predict(ds, verbose=0)
    index = strategy.cluster_resolver.task_id
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"worker{index}.json"), "w") as f:
        json.dump({"evaluate": evaluated, "predict": predicted.tolist()}, f)
    if index == args.linger_worker:
        time.sleep(args.linger)


if __name__ == "__main__":
    main()
