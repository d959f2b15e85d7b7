"""Shared model and data builders for the strategy tests (real Keras, real strategies), runs
several tests read (`run_once`), and the damage a checkpoint can come to (its files cut short
or lost)."""

import fcntl
import json
import os
import time

import keras
import numpy as np
import tensorflow as tf


def regression_data(n=320, features=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, 1)).astype("float32")
    y = (x @ w + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def image_data(n=160, seed=0, classes=4):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 1)).astype("float32")
    y = rng.integers(0, classes, size=(n,)).astype("int32")
    return x, y


def dense_model(optimizer=None, loss="mse", metrics=("mae",), seed=1, regularize=True,
                steps_per_execution=1):
    keras.utils.set_random_seed(seed)
    reg = keras.regularizers.L2(1e-2) if regularize else None
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", kernel_regularizer=reg),
            keras.layers.Dense(1),
        ]
    )
    model.compile(
        optimizer=optimizer or keras.optimizers.SGD(0.05), loss=loss, metrics=list(metrics),
        steps_per_execution=steps_per_execution,
    )
    return model


def conv_syncbn_model(seed=1, classes=4):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            # No bias before BatchNorm: its true gradient is 0, so Adam would amplify rounding noise.
            keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(synchronized=True),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(classes),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def build_under(strategy, builder, **kwargs):
    """Builds a model under `strategy` (None: no strategy); callable kwargs are factories."""

    def build():
        return builder(**{k: v() if callable(v) else v for k, v in kwargs.items()})

    if strategy is None:
        return build()
    with strategy.scope():
        return build()


def max_weight_diff(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights()))


class OwnStep(keras.Sequential):
    """A model with its own train_step (Keras's order: the update inside the step)."""

    def train_step(self, data):
        return super().train_step(data)


class BatchLogs(keras.callbacks.Callback):
    """Records the per-batch logs that callbacks and the progress bar see."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs))


class SwitchAtBatch(keras.callbacks.Callback):
    """Sets the split `sizes` at the end of batch `at` (once), as a user's callback would."""

    def __init__(self, strategy, at, sizes):
        super().__init__()
        self.strategy, self.at, self.sizes, self.done = strategy, at, sizes, False

    def on_train_batch_end(self, batch, logs=None):
        if not self.done and batch >= self.at:
            self.strategy.set_batch_sizes(self.sizes)
            self.done = True


class Sink:
    """A plain holder (Keras would wrap a list attribute of a layer in a tracked copy)."""

    def __init__(self):
        self.items = []

    def append(self, item):
        self.items.append(item)


class ShapeRecorder(keras.layers.Layer):
    """Identity layer that records, inside the step, (replica id, batch size) in training."""

    def __init__(self, sink, **kwargs):
        super().__init__(**kwargs)
        self._sink = sink

    def call(self, inputs, training=None):
        if not training:
            return inputs
        ctx = tf.distribute.get_replica_context()
        replica = ctx.replica_id_in_sync_group if ctx is not None else 0

        def record(rid, n):
            self._sink.append((int(rid), int(n)))
            return np.int32(0)

        token = tf.py_function(record, [replica, tf.shape(inputs)[0]], tf.int32)
        with tf.control_dependencies([token]):
            return tf.identity(inputs)


def stock_mirrored(devices):
    """A stock tf.distribute.MirroredStrategy with collective keys of its own.

    Stock strategies in one process share collective keys and can clash ("Shape mismatch in
    the collective instance 100"); tf_hetbatch strategies avoid it the same way.
    """
    from tf_hetbatch.distribute._upstream import collectives

    strategy = tf.distribute.MirroredStrategy.__new__(tf.distribute.MirroredStrategy)
    collectives.assign_collective_key_base(strategy)
    strategy.__init__(devices)
    return strategy


def our_children():
    """Live (non-zombie) processes whose parent is this test process (launcher tests)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                kids.append(int(entry))
    return kids


def cgroups_writable() -> bool:
    """Whether this machine lets the launcher create CPU-capping cgroups (launcher tests)."""
    from tf_hetbatch.launch.cpu_caps import make_caps

    try:
        make_caps("cgroup", 1).close()
        return True
    except RuntimeError:
        return False


def run_once(tmp_path_factory, name, produce, timeout=600):
    """(directory, value): `produce(directory)`'s JSON value, computed once per test session,
    also when several xdist processes ask for it: the first runs it under a file lock in the
    session's shared temporary directory, the others wait for it (at most `timeout` s) and read
    what it wrote. For a launched cluster that several tests only read."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    directory, done = shared / name, shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: another test process held it for {timeout} s")
                time.sleep(0.2)
        if not done.exists():
            directory.mkdir(exist_ok=True)
            done.write_text(json.dumps(produce(directory)))
    return directory, json.loads(done.read_text())


# ---------------------------------------------------------------------- checkpoint damage
def checkpoint_data_file(prefix):
    """The (single) data file of the TensorFlow checkpoint at `prefix`."""
    return tf.io.gfile.glob(f"{prefix}.data-*")[0]


def truncate_checkpoint(prefix):
    """Cuts the data file to a third, as a failing disk or an interrupted copy leaves it."""
    path = checkpoint_data_file(prefix)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)


def delete_checkpoint_index(prefix):
    os.remove(f"{prefix}.index")


def delete_checkpoint_data(prefix):
    os.remove(checkpoint_data_file(prefix))


def flip_a_checkpoint_byte(prefix):
    """Changes one byte of the largest weight in the data file: only its checksum tells."""
    reader = tf.compat.v1.train.NewCheckpointReader(prefix)
    values = max((reader.get_tensor(key) for key in reader.get_variable_to_dtype_map()),
                 key=lambda value: getattr(value, "nbytes", 0))
    path = checkpoint_data_file(prefix)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    at = data.find(values.tobytes())
    assert at >= 0, "the weight's bytes are not in the data file"
    data[at + values.nbytes // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(data)


class OutOfMemoryAbove(keras.layers.Layer):
    """Identity layer whose replica `replica` runs out of memory (a real allocation beyond the
    machine's memory: TensorFlow's ResourceExhaustedError, where a full GPU reports it) on a
    batch of more than `size` samples in training."""

    def __init__(self, replica, size, **kwargs):
        super().__init__(**kwargs)
        self.replica, self.size = replica, size

    def call(self, inputs, training=None):
        ctx = tf.distribute.get_replica_context()
        if not training or ctx is None:
            return inputs
        too_big = tf.logical_and(tf.equal(ctx.replica_id_in_sync_group, self.replica),
                                 tf.shape(inputs)[0] > self.size)
        length = tf.where(too_big, tf.constant(2**40, tf.int64), tf.constant(1, tf.int64))
        waste = tf.zeros(tf.reshape(length, [1]), inputs.dtype)  # 4 TiB when too big
        return inputs + 0.0 * waste[0]
