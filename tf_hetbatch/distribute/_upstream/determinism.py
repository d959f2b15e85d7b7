"""Op determinism: whether it is on (tensorflow: no public reader).

`tf.config.experimental.enable_op_determinism()` makes nondeterministic kernels refuse to run;
`tf.timestamp` is one ("Timestamp cannot be called when determinism is enabled"), so the
per-replica stamps read the host clock another way while it is on (`timing.now`). TensorFlow
exposes the setter only; the reader is `tensorflow.python.framework.config
.is_op_determinism_enabled`. Canary: tests/test_upstream_determinism.py.
"""

import logging

logger = logging.getLogger(__name__)

try:
    from tensorflow.python.framework import config as _config
except ImportError as error:  # pragma: no cover - upstream change
    logger.debug("op determinism reader unavailable (%s)", error)
    _config = None


def op_determinism_enabled() -> bool:
    """Whether `tf.config.experimental.enable_op_determinism()` is in force."""
    reader = getattr(_config, "is_op_determinism_enabled", None)
    return bool(reader()) if reader is not None else False
