"""The pure core (`tf_hetbatch/core/`) imports, and works, without TensorFlow."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = os.path.join(ROOT, "tf_hetbatch", "core")
CORE_MODULES = sorted(f"tf_hetbatch.core.{name[:-3]}" for name in os.listdir(CORE)
                      if name.endswith(".py") and name != "__init__.py")

_SCRIPT = r"""
import sys
sys.modules["tensorflow"] = None   # any `import tensorflow` now raises ImportError
import tf_hetbatch
import tf_hetbatch.core.split, tf_hetbatch.core.devices, tf_hetbatch.core.controllers
import tf_hetbatch.core.sim
from tf_hetbatch import (split_evenly, split_proportionally, DeviceCapability, cpu_capability,
                         gpu_capability, ProportionalController, ModelBasedController)
ctrl = ModelBasedController()
sizes, _ = ctrl.update(ctrl.init(split_evenly(64, 2)), [32, 32], [0.1, 0.3])
assert sum(sizes) == 64
assert not any(m == "keras" or m.startswith(("tensorflow.", "keras.")) for m in sys.modules)
print("ok")
"""

# Imports one module in a fresh interpreter (TensorFlow importable) and lists what it loaded
# of TensorFlow, Keras and TensorBoard.
_IMPORT_ONE = r"""
import importlib, sys
importlib.import_module(sys.argv[1])
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in ("tensorflow", "keras", "tensorboard", "tf_keras"))
print("loaded:", heavy)
"""


def _run(args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_pure_core_imports_without_tensorflow():
    proc = _run(["-c", _SCRIPT])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_the_core_folder_holds_the_pure_modules():
    assert {"tf_hetbatch.core.split", "tf_hetbatch.core.devices", "tf_hetbatch.core.controllers",
            "tf_hetbatch.core.sim", "tf_hetbatch.core.protocols"} <= set(CORE_MODULES)


@pytest.mark.parametrize("module", CORE_MODULES)
def test_every_core_module_imports_no_tensorflow_or_keras(module):
    proc = _run(["-c", _IMPORT_ONE, module])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "loaded: []", f"importing {module} loaded TensorFlow/Keras"
