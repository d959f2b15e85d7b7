"""Imported first by every worker script of the tests, before TensorFlow (the script's own
directory is on sys.path, so `import worker_start` finds this file).

- TensorFlow's C++ INFO and WARNING lines stay out of the launcher's logs.
- In a process started as one of these scripts, matplotlib is not importable. Keras imports
  `matplotlib.pyplot` at start-up when it is installed (for an image gallery these scripts never
  draw), which costs each process 0.5 s of CPU; the suite starts about a hundred of these
  processes, two at a time on two cores. Keras catches the ImportError and runs unchanged. The
  tests also import mw_train and resume_train as modules: there matplotlib stays (test_plot).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.path.dirname(os.path.abspath(sys.argv[0])) == os.path.dirname(os.path.abspath(__file__)):
    sys.modules.setdefault("matplotlib", None)  # None in sys.modules: `import` raises ImportError
