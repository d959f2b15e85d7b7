"""Fashion-MNIST for the examples, from Debian's `dataset-fashion-mnist` (no download).

Two forms:

* `load(split)`: in-memory arrays (float32 images in [0, 1], int32 labels).
* `png_records(split)` + `png_pipeline(records, batch)`: the realistic form. The images are
  written once as PNG-encoded TFRecord files (a `tf.train.Example` per image: its PNG bytes and
  its label), cached between runs, and a `tf.data` pipeline reads, decodes and augments them
  per sample: `TFRecordDataset(files).shuffle(n, seed).map(decode + augment,
  num_parallel_calls=AUTOTUNE).batch(B)`, the form a tf_hetbatch strategy splits (each worker
  decodes only its own replicas' samples).

Falls back, loudly labelled, to a synthetic stand-in of the same shapes when the package is
not installed (`apt-get install dataset-fashion-mnist` gives the real data).
"""

import contextlib
import fcntl
import gzip
import json
import os
from typing import List, NamedTuple

import numpy as np

DATA_DIR = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
REAL = "Fashion-MNIST (Debian dataset-fashion-mnist)"
SYNTHETIC = "SYNTHETIC stand-in (install dataset-fashion-mnist for the real data)"
SPLIT_SIZES = {"train": 60000, "test": 10000}
SHARD_SIZE = 10_000  # records per TFRecord file
# The decode-heavy augmentation (issue 16): PNG decode, resize up, random crop, random flip,
# resize back to 28x28.
UPSCALED, CROP, SIZE = 96, 84, 28
AUGMENTATIONS = ("heavy", "light")


def _read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def available():
    return all(os.path.exists(os.path.join(DATA_DIR, f)) for pair in FILES.values() for f in pair)


def load_uint8(split, limit=None):
    """Returns (images uint8 [n, 28, 28], labels uint8 [n], source label)."""
    if split not in FILES:
        raise ValueError(f"`split` must be one of {sorted(FILES)}. Received: split={split!r}.")
    if available():
        images_file, labels_file = FILES[split]
        x = _read_idx(os.path.join(DATA_DIR, images_file))
        y = _read_idx(os.path.join(DATA_DIR, labels_file))
        source = REAL
    else:
        n = SPLIT_SIZES[split]
        rng = np.random.default_rng(0 if split == "train" else 1)
        y = rng.integers(0, 10, size=n).astype(np.uint8)
        prototypes = np.random.default_rng(42).uniform(0, 255, size=(10, 28, 28))
        x = np.clip(prototypes[y] + rng.normal(0, 60, size=(n, 28, 28)), 0, 255).astype(np.uint8)
        source = SYNTHETIC
    if limit:
        x, y = x[:limit], y[:limit]
    return x, y, source


def load(split, limit=None):
    """Returns (images float32 [n, 28, 28, 1] in [0, 1], labels int32 [n], source label)."""
    x, y, source = load_uint8(split, limit)
    return (x.astype(np.float32) / 255.0)[..., None], y.astype(np.int32), source


# ------------------------------------------------------------------ PNG TFRecords --------
class PngRecords(NamedTuple):
    """A cached set of PNG TFRecord files: `files` (in order), `count` records, `source`
    (the data's label, as `load` gives it), `bytes` (the files' total size)."""

    files: List[str]
    count: int
    source: str
    bytes: int


def cache_root():
    """`$XDG_CACHE_HOME/tf_hetbatch/fashion_mnist_png` (default `~/.cache/...`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tf_hetbatch", "fashion_mnist_png")


def png_records(split, limit=None, cache_dir=None):
    """The PNG TFRecord files of `split` (its first `limit` samples), written on first use.

    The files are cached under `cache_dir` (default `cache_root()`), keyed by split, sample
    count and source (real or synthetic). Safe when several processes on one host call it at
    once (e.g. the workers of a local cluster): one writes under an exclusive `fcntl` lock,
    the others wait for it and read its files. Every file (and the manifest, written last) is
    written to a temporary name and renamed into place, so a crash leaves no partial set.

    Returns:
        `PngRecords`.
    """
    if split not in FILES:
        raise ValueError(f"`split` must be one of {sorted(FILES)}. Received: split={split!r}.")
    total = SPLIT_SIZES[split]
    count = min(limit, total) if limit else total
    key = f"{split}-{count}-{'real' if available() else 'synthetic'}"
    root = cache_dir or cache_root()
    folder = os.path.join(root, key)
    manifest = os.path.join(folder, "manifest.json")
    os.makedirs(folder, exist_ok=True)
    cached = _read_manifest(manifest, folder)
    if cached is None:
        with _locked(os.path.join(root, key + ".lock")):
            cached = _read_manifest(manifest, folder)  # another process may have written it
            if cached is None:
                x, y, source = load_uint8(split, limit)
                cached = _write_records(x, y, source, folder, manifest)
    return cached


@contextlib.contextmanager
def _locked(path):
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read_manifest(manifest, folder):
    try:
        with open(manifest) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    files = [os.path.join(folder, name) for name in info["files"]]
    if not all(os.path.exists(f) for f in files):
        return None
    return PngRecords(files, info["count"], info["source"], sum(os.path.getsize(f) for f in files))


def _replace_atomically(path, write):
    temporary = f"{path}.tmp-{os.getpid()}"
    write(temporary)
    os.replace(temporary, path)


def _write_records(x, y, source, folder, manifest):
    import tensorflow as tf

    pngs = (tf.data.Dataset.from_tensor_slices(x[..., None])
            .map(tf.io.encode_png, num_parallel_calls=tf.data.AUTOTUNE)
            .batch(1024).as_numpy_iterator())
    encoded = [png for batch in pngs for png in batch]
    names = []
    for shard, start in enumerate(range(0, len(x), SHARD_SIZE)):
        name = f"shard-{shard:03d}.tfrecord"

        def write(path, start=start):
            with tf.io.TFRecordWriter(path) as writer:
                for i in range(start, min(start + SHARD_SIZE, len(x))):
                    example = tf.train.Example(features=tf.train.Features(feature={
                        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded[i]])),
                        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y[i])])),
                    }))
                    writer.write(example.SerializeToString())

        _replace_atomically(os.path.join(folder, name), write)
        names.append(name)

    def write_manifest(path):
        with open(path, "w") as f:
            json.dump({"files": names, "count": len(x), "source": source}, f)

    _replace_atomically(manifest, write_manifest)
    return _read_manifest(manifest, folder)


class InputMeter:
    """Input work, measured inside a pipeline on this process.

    A float64 variable [4], accumulated by `png_pipeline`'s maps:
    0. the per-sample map's summed wall time, seconds (`tf.timestamp()` at its start and end;
       parallel calls overlap, so this is the busy time of the map's threads);
    1. the samples that map finished;
    2. their records' bytes in the files (payload + TFRecord framing);
    3. the bytes of all records read from the files (every record that enters the pipeline).
    Create it outside any strategy scope (a local variable of this process).
    """

    FIELDS = ("seconds", "samples", "own_bytes", "read_bytes")

    def __init__(self):
        import tensorflow as tf

        self.variable = tf.Variable(tf.zeros([len(self.FIELDS)], tf.float64), trainable=False,
                                    name="input_meter")

    def read(self):
        """The four totals so far, as a numpy array (see the class docs)."""
        return self.variable.numpy().copy()


# A TFRecord stores each record as: length (8 bytes), its CRC (4), the data, the data's CRC (4).
RECORD_FRAMING = 16


def decode_function(augment="heavy", meter=None):
    """The per-sample map of `png_pipeline`: (record, seed) -> (image float32 [28, 28, 1] in
    [0, 1], label int32 []).

    Args:
        augment: "heavy" (PNG decode, resize to 96x96, random crop 84x84, random left-right
            flip, resize back to 28x28) or "light" (PNG decode only).
        meter: optional `InputMeter` that accumulates this map's work.
    """
    import tensorflow as tf

    if augment not in AUGMENTATIONS:
        raise ValueError(f"`augment` must be one of {AUGMENTATIONS}. Received: augment={augment!r}.")
    features = {"image": tf.io.FixedLenFeature([], tf.string),
                "label": tf.io.FixedLenFeature([], tf.int64)}

    def decode(record, seed):
        example = tf.io.parse_single_example(record, features)
        image = tf.io.decode_png(example["image"], channels=1)
        if augment == "heavy":
            # Stateless random ops seeded per sample: the same draws whatever the map's
            # parallelism, and whichever worker decodes the sample.
            image = tf.image.resize(image, [UPSCALED, UPSCALED])
            image = tf.image.stateless_random_crop(image, [CROP, CROP, 1],
                                                   seed=tf.stack([seed, 1]))
            image = tf.image.stateless_random_flip_left_right(image, seed=tf.stack([seed, 2]))
            image = tf.image.resize(image, [SIZE, SIZE])
            image = tf.clip_by_value(image / 255.0, 0.0, 1.0)
        else:
            image = tf.cast(image, tf.float32) / 255.0
        image = tf.ensure_shape(image, [SIZE, SIZE, 1])
        label = tf.ensure_shape(tf.cast(example["label"], tf.int32), [])
        return image, label

    return decode if meter is None else metered(decode, meter)


def metered(decode, meter):
    """`decode` (a per-sample map of (record, seed)), accumulating its wall time, samples and
    their records' bytes into `meter` (an `InputMeter`)."""
    import tensorflow as tf

    def measured(record, seed):
        start = tf.timestamp()
        with tf.control_dependencies([start]):
            record = tf.identity(record)
        image, label = decode(record, seed)
        with tf.control_dependencies([image, label]):
            elapsed = tf.timestamp() - start
        size = tf.cast(tf.strings.length(record) + RECORD_FRAMING, tf.float64)
        zero, one = tf.constant(0.0, tf.float64), tf.constant(1.0, tf.float64)
        added = meter.variable.assign_add(tf.stack([elapsed, one, size, zero]))
        with tf.control_dependencies([added]):
            return tf.identity(image), tf.identity(label)

    return measured


# Records counted in chunks: a map per record (a function call and a variable update each) cost
# ~20 us a record, ~0.15 s CPU every time an iterator fills a shuffle buffer of 7,680 records,
# ~0.6 s at a 0.24-CPU cap: an instrument that slowed what it measured. Per chunk: ~1 us a record.
_COUNT_CHUNK = 256


def _count_read(source, meter):
    """`source` (serialized records) unchanged, adding the bytes of the records read to `meter`
    (counted per chunk of records as they are read; cardinality kept)."""
    import tensorflow as tf

    def count(chunk):
        size = tf.cast(tf.reduce_sum(tf.strings.length(chunk) + RECORD_FRAMING), tf.float64)
        added = meter.variable.assign_add(tf.stack([tf.constant(0.0, tf.float64)] * 3 + [size]))
        with tf.control_dependencies([added]):
            return tf.identity(chunk)

    counted = source.batch(_COUNT_CHUNK).map(count).unbatch()
    return counted.apply(tf.data.experimental.assert_cardinality(source.cardinality()))


def png_pipeline(records, batch_size, seed=0, augment="heavy", meter=None, repeat=False,
                 shuffle_buffer=None, decode=None):
    """The realistic input pipeline over `png_records` files, batched by the GLOBAL batch size.

    `TFRecordDataset(files)` [`.repeat()`] (with a `meter`: the bytes read counted per chunk),
    zipped with a per-sample seed stream
    (`Dataset.random(seed)`, new draws every iteration), `.shuffle(shuffle_buffer, seed)`,
    `.map(decode_function(augment, meter), num_parallel_calls=AUTOTUNE)`, `.batch(batch_size)`.
    Outputs have static shapes, so a tf_hetbatch strategy moves the map after the split.

    Seeded throughout: the same seed gives the same batches, whatever the parallelism (and
    the same samples under any split).

    Args:
        records: `PngRecords`.
        batch_size: the global batch size.
        seed: shuffle and augmentation seed (int, default 0).
        augment: "heavy" (default) or "light", see `decode_function`.
        meter: optional `InputMeter`.
        repeat: repeat the records forever (for `fit(steps_per_epoch=...)`).
        shuffle_buffer: default: all records.
        decode: another per-sample map of (record, seed) instead of `decode_function`.
    """
    import tensorflow as tf

    # A known length (the files' record count) lets Keras count an epoch's steps.
    source = tf.data.TFRecordDataset(records.files).apply(
        tf.data.experimental.assert_cardinality(records.count))
    if repeat:
        source = source.repeat()
    if meter is not None:
        source = _count_read(source, meter)
    seeds = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True)
    samples = tf.data.Dataset.zip((source, seeds)).shuffle(shuffle_buffer or records.count,
                                                           seed=seed)
    return (samples.map(decode or decode_function(augment, meter),
                        num_parallel_calls=tf.data.AUTOTUNE)
            .batch(batch_size))
