"""Fashion-MNIST for the examples, from Debian's `dataset-fashion-mnist` (no download).

Falls back, loudly labelled, to a synthetic stand-in of the same shapes when the package is
not installed (`apt-get install dataset-fashion-mnist` gives the real data).
"""

import gzip
import os

import numpy as np

DATA_DIR = os.environ.get("FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


def _read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def available():
    return all(os.path.exists(os.path.join(DATA_DIR, f)) for pair in FILES.values() for f in pair)


def load(split, limit=None):
    """Returns (images float32 [n, 28, 28, 1] in [0, 1], labels int32 [n], source label)."""
    if available():
        images_file, labels_file = FILES[split]
        x = _read_idx(os.path.join(DATA_DIR, images_file))
        y = _read_idx(os.path.join(DATA_DIR, labels_file))
        source = "Fashion-MNIST (Debian dataset-fashion-mnist)"
    else:
        n = 60000 if split == "train" else 10000
        rng = np.random.default_rng(0 if split == "train" else 1)
        y = rng.integers(0, 10, size=n).astype(np.uint8)
        prototypes = np.random.default_rng(42).uniform(0, 255, size=(10, 28, 28))
        x = np.clip(prototypes[y] + rng.normal(0, 60, size=(n, 28, 28)), 0, 255).astype(np.uint8)
        source = "SYNTHETIC stand-in (install dataset-fashion-mnist for the real data)"
    if limit:
        x, y = x[:limit], y[:limit]
    return (x.astype(np.float32) / 255.0)[..., None], y.astype(np.int32), source
