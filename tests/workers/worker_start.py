"""Imported first by every worker script of the tests (the script's own directory is on
sys.path, so `import worker_start` finds this file). In a process started as one of these
scripts it imports TensorFlow and Keras, the way that costs least:

- TensorFlow's C++ INFO and WARNING lines stay out of the launcher's logs.
- matplotlib is not importable. Keras imports `matplotlib.pyplot` at start-up when it is
  installed (for an image gallery these scripts never draw), 0.5 s of CPU; Keras catches the
  ImportError and runs unchanged.
- The cyclic garbage collector is paused during the imports, and what they built (about
  400,000 objects that live as long as the process) is then frozen (`gc.freeze`), so no later
  collection walks it again; new objects are collected as usual. About 0.5 s of CPU less per
  process, import and training together.

The suite starts about 150 of these processes, two or three at a time on two cores. The tests
also import mw_train and resume_train as modules: there nothing of this applies (matplotlib
stays for test_plot; the test process's imports are its own).
"""

import gc
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.path.dirname(os.path.abspath(sys.argv[0])) == os.path.dirname(os.path.abspath(__file__)):
    sys.modules.setdefault("matplotlib", None)  # None in sys.modules: `import` raises ImportError
    gc.disable()
    try:
        import keras  # noqa: F401  (imports TensorFlow; the runtime starts at its first use)
    finally:
        gc.freeze()
        gc.enable()
