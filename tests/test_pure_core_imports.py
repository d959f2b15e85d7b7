"""The pure core must import (and work) with TensorFlow made unimportable."""

import os
import subprocess
import sys

_SCRIPT = r"""
import sys
sys.modules["tensorflow"] = None   # any `import tensorflow` now raises ImportError
import tf_hetbatch
import tf_hetbatch.split, tf_hetbatch.devices, tf_hetbatch.controllers, tf_hetbatch.sim
from tf_hetbatch import (split_evenly, split_proportionally, DeviceCapability, cpu_capability,
                         gpu_capability, ProportionalController, ModelBasedController)
ctrl = ModelBasedController()
sizes, _ = ctrl.update(ctrl.init(split_evenly(64, 2)), [32, 32], [0.1, 0.3])
assert sum(sizes) == 64
assert not any(m == "keras" or m.startswith(("tensorflow.", "keras.")) for m in sys.modules)
print("ok")
"""


def test_pure_core_imports_without_tensorflow():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
