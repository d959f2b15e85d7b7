"""The TensorFlow/Keras versions tf_hetbatch supports, and those it is tested on.

Importing `tf_hetbatch.distribute` imports the quarantine, which imports this module first, and
every TensorFlow part of the package imports `tf_hetbatch.distribute` before it uses TensorFlow
(`tests/test_upstream_versions.py` checks it), so the installed pair is judged once per process,
before use, while `import tf_hetbatch` itself stays TensorFlow-free:
- TensorFlow < 2.16, Keras < 3, or Keras < 3.10: an ImportError naming the versions and the fix;
- a pair outside `TESTED_PAIRS`: one warning (logging) naming it and the tested pairs.
Canary: `tests/test_upstream_versions.py`.
"""

import itertools
import logging
from typing import Optional, Tuple

import keras
import tensorflow as tf

logger = logging.getLogger(__name__)

# (TensorFlow, Keras) major.minor pairs on which the upstream canaries and the equivalence,
# strategy and callback tests pass (Linux, CPU, Python 3.11); the multi-worker tests on
# 2.16/3.12, 2.16/3.15, 2.18/3.12 and 2.21/3.15. Supported (`setup.cfg`): TensorFlow 2.16-2.21
# with Keras 3.12-3.15 (Keras 3.10/3.11 lack what the inlined multi-step loop calls:
# `keras_trainer.check_steps_per_execution` refuses steps_per_execution > 1 there).
TESTED_PAIRS = (
    ((2, 16), (3, 12)), ((2, 16), (3, 15)),
    ((2, 17), (3, 15)),
    ((2, 18), (3, 12)), ((2, 18), (3, 15)),
    ((2, 19), (3, 15)),
    ((2, 20), (3, 15)),
    ((2, 21), (3, 12)), ((2, 21), (3, 15)),
)
INSTALL_SUPPORTED = "pip install 'tensorflow>=2.16,<2.22' 'keras>=3.12,<3.16'"


def version_tuple(version: str) -> Tuple[int, ...]:
    """(major, minor, patch) of a version string such as "2.21.0" or "3.15.1.dev2025"."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits or 0))
    return tuple(parts)


def check_versions(tf_version: str, keras_version: str) -> Optional[str]:
    """Judges a TensorFlow/Keras pair: refused, untested (a warning), or tested.

    Args:
        tf_version: a TensorFlow version string, e.g. "2.21.0".
        keras_version: a Keras version string, e.g. "3.15.1".

    Returns:
        None for a pair in `TESTED_PAIRS`, else the warning to log for it.

    Raises:
        ImportError: TensorFlow < 2.16 or Keras < 3 (unsupported), or Keras < 3.10, whose
            metric variables make History and the per-batch logs silently wrong under any
            tf.distribute strategy.
    """
    tf_v, keras_v = version_tuple(tf_version), version_tuple(keras_version)
    received = f"Received: tensorflow=={tf_version}, keras=={keras_version}."
    if tf_v < (2, 16) or keras_v < (3, 0):
        raise ImportError(f"tf_hetbatch needs TensorFlow >= 2.16 with Keras 3. {received} "
                          f"Fix: {INSTALL_SUPPORTED}.")
    if keras_v < (3, 10):
        # Keras < 3.10 `Metric.add_variable` sets no `synchronization="on_read"`: under a
        # strategy a metric variable is mirrored (SUM on write) and every replica's
        # `assign_add` (an `assign(self + value)` in a merge_call) writes K * old + the sum of
        # the updates, so the logs drift from the second step on; the weights stay right.
        raise ImportError(
            "tf_hetbatch refuses Keras < 3.10: under a tf.distribute strategy its metric "
            "variables are mirrored instead of per replica, so each update adds every "
            "replica's previous total again and History and the per-batch logs are silently "
            "wrong (the weights are right; keras-team/keras#21061, fixed in Keras 3.10.0 by "
            f"keras-team/keras#21072). {received} Fix: pip install 'keras>=3.12,<3.16'.")
    if (tf_v[:2], keras_v[:2]) in TESTED_PAIRS:
        return None
    tested = ", ".join(f"{t[0]}.{t[1]}/{k[0]}.{k[1]}" for t, k in TESTED_PAIRS)
    return (f"tf_hetbatch is not tested with tensorflow=={tf_version} and keras=={keras_version} "
            f"(tested TensorFlow/Keras pairs: {tested}). It relies on private TensorFlow/Keras "
            "behaviour, which another release may change: run `pytest tests/test_upstream_*.py` "
            f"in a checkout of tf_hetbatch to check this pair, or {INSTALL_SUPPORTED}.")


_untested = check_versions(tf.__version__, keras.__version__)
if _untested is not None:
    logger.warning(_untested)
