"""Imported first by every worker script of the tests (the script's own directory is on
sys.path, so `import worker_start` finds this file). In a process started as one of these
scripts it imports TensorFlow and Keras as a served task does
(`tf_hetbatch.launch.server.import_tensorflow_lean`: no matplotlib, whose pyplot Keras imports
at start-up, 0.5 s; the collector paused, then `gc.freeze`: 0.57 s of CPU less for a 2-worker
mw_train process), and keeps TensorFlow's C++ INFO and WARNING lines out of the launcher's logs.

The suite starts about 150 of these processes, two or three at a time on two cores. The tests
also import mw_train and resume_train as modules: there nothing of this applies (matplotlib
stays for test_plot; the test process's imports are its own).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.path.dirname(os.path.abspath(sys.argv[0])) == os.path.dirname(os.path.abspath(__file__)):
    from tf_hetbatch.launch.server import import_tensorflow_lean

    import_tensorflow_lean()
