"""Canary of `_upstream.versions`: the installed TensorFlow/Keras are the tested ones.

When one fails after an upgrade, read the matching section of
`tf_hetbatch/distribute/_upstream/versions.py`: the workaround may be obsolete
(lift it) or broken (fix it), but it must not go on silently.
"""

import keras
import tensorflow as tf

from tf_hetbatch.distribute._upstream import versions


def test_supported_versions_are_the_tested_ones():
    """`versions.TESTED_TF`, `versions.TESTED_KERAS`: fails first after an upgrade, so every
    canary of the quarantine is run against the new versions."""
    assert tf.__version__.startswith(versions.TESTED_TF), tf.__version__
    assert keras.__version__.startswith(versions.TESTED_KERAS), keras.__version__
