"""The TensorFlow/Keras versions tf_hetbatch supports, and those it is tested on.

Importing the quarantine (`tf_hetbatch.distribute._upstream`) imports this first: with
TensorFlow older than 2.16 or Keras older than 3 it raises an ImportError naming the versions.
Canary: `tests/test_upstream_versions.py`.
"""

import itertools

import keras
import tensorflow as tf


TESTED_TF = "2.21"
TESTED_KERAS = "3.15"


def _version_tuple(version):
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits or 0))
    return tuple(parts)


TF_VERSION = _version_tuple(tf.__version__)
KERAS_VERSION = _version_tuple(keras.__version__)

if TF_VERSION < (2, 16) or KERAS_VERSION < (3, 0):
    raise ImportError(
        "tf_hetbatch needs TensorFlow >= 2.16 with Keras 3. Received: "
        f"tensorflow=={tf.__version__}, keras=={keras.__version__}. "
        "Fix: pip install 'tensorflow>=2.16'."
    )
