"""Canaries of `_upstream.versions`: the installed pair is a tested one, the check's table, and
every TensorFlow part of the package checking the versions before use.

When the first fails after an upgrade, run every `tests/test_upstream_*.py` against the new
versions (each workaround may be obsolete or broken), then add the pair to
`versions.TESTED_PAIRS` (and to `setup.cfg`'s ranges if it is outside them).
"""

import ast
import os
import re
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

from tf_hetbatch.distribute._upstream import versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "tf_hetbatch")


def _major_minor(version):
    return versions.version_tuple(version)[:2]


def test_the_installed_pair_is_among_the_tested_pairs():
    """Fails first after an upgrade, so that every canary is looked at for the new pair."""
    pair = (_major_minor(tf.__version__), _major_minor(keras.__version__))
    assert pair in versions.TESTED_PAIRS, (tf.__version__, keras.__version__)
    assert versions.check_versions(tf.__version__, keras.__version__) is None


@pytest.mark.parametrize("tf_version, keras_version", [
    ("2.16.2", "3.12.4"), ("2.18.1", "3.15.1"), ("2.21.0", "3.12.0"), ("2.21.0", "3.15.1"),
    ("2.20.0rc1", "3.15.0.dev2026"),
])
def test_a_tested_pair_is_accepted_silently(tf_version, keras_version):
    assert versions.check_versions(tf_version, keras_version) is None


@pytest.mark.parametrize("tf_version, keras_version", [
    ("2.22.0", "3.15.1"),  # a newer TensorFlow
    ("2.21.0", "3.16.0"),  # a newer Keras
    ("2.21.0", "4.0.0"),
    ("2.20.0", "3.12.4"),  # within the supported ranges, not measured
    ("2.18.1", "3.11.3"),  # refuses steps_per_execution > 1, else works
    ("2.16.2", "3.10.0"),
])
def test_an_untested_pair_gets_a_warning_naming_it_and_the_tested_pairs(tf_version,
                                                                         keras_version):
    warning = versions.check_versions(tf_version, keras_version)
    assert f"tensorflow=={tf_version} and keras=={keras_version}" in warning
    assert "2.16/3.12" in warning and "2.21/3.15" in warning
    assert "pytest tests/test_upstream_*.py" in warning


@pytest.mark.parametrize("tf_version, keras_version", [
    ("2.15.1", "3.15.1"), ("2.21.0", "2.15.0"), ("1.15.5", "2.3.1"),
])
def test_tensorflow_before_2_16_or_keras_2_is_refused(tf_version, keras_version):
    with pytest.raises(ImportError, match=r"TensorFlow >= 2\.16 with Keras 3\. Received: "
                       rf"tensorflow=={tf_version}, keras=={keras_version}"):
        versions.check_versions(tf_version, keras_version)


@pytest.mark.parametrize("keras_version", ["3.0.5", "3.8.0", "3.9.2"])
def test_keras_before_3_10_is_refused_for_its_wrong_logs(keras_version):
    """Keras < 3.10: History and the per-batch logs are silently wrong under any strategy
    (its metric variables; `test_upstream_metrics.py` shows the mechanism)."""
    with pytest.raises(ImportError, match=r"Keras < 3\.10.*logs are silently wrong.*21061.*"
                       rf"keras=={keras_version}\. Fix: pip install 'keras>=3\.12"):
        versions.check_versions("2.18.1", keras_version)


def test_the_tested_pairs_lie_in_the_supported_ranges_of_setup_cfg():
    with open(os.path.join(ROOT, "setup.cfg")) as f:
        text = f.read()
    ranges = {}
    for name in ("tensorflow", "keras"):
        low, high = re.search(rf"^\s*{name}>=([\d.]+),<([\d.]+)\s*$", text, re.M).groups()
        ranges[name] = (versions.version_tuple(low)[:2], versions.version_tuple(high)[:2])
    for tf_pair, keras_pair in versions.TESTED_PAIRS:
        assert ranges["tensorflow"][0] <= tf_pair < ranges["tensorflow"][1], tf_pair
        assert ranges["keras"][0] <= keras_pair < ranges["keras"][1], keras_pair


def _imports_by_scope(tree):
    """{scope: names of the modules imported in it at run time}: a scope is a path of function
    names from the module body, `()` (a class's body belongs to its enclosing scope); imports
    under `if TYPE_CHECKING:` do not run."""
    found = {}

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                child = ast.Module(body=child.orelse, type_ignores=[])
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, scope + (child.name,))
                continue
            if isinstance(child, ast.Import):
                found.setdefault(scope, []).extend(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                found.setdefault(scope, []).append(child.module or "")
            visit(child, scope)

    visit(tree, ())
    return found


def test_every_tensorflow_part_of_the_package_checks_the_versions_first():
    """Every module of the package that imports TensorFlow or Keras is in
    `tf_hetbatch.distribute` (whose `__init__` runs the check) or imports a module of it in
    the same scope or an enclosing one, so the check runs before TensorFlow is used.
    `import tf_hetbatch` itself imports no TensorFlow (`test_pure_core_imports.py`)."""
    unchecked = []
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT)
            if not name.endswith(".py") or rel.startswith(os.path.join("tf_hetbatch",
                                                                       "distribute", "")):
                continue
            with open(path) as f:
                scopes = _imports_by_scope(ast.parse(f.read(), path))
            checks = {scope for scope, names in scopes.items() if any(
                n == "tf_hetbatch.distribute" or n.startswith("tf_hetbatch.distribute.")
                for n in names)}
            for scope, names in scopes.items():
                uses = any(n.split(".")[0] in ("tensorflow", "keras") for n in names)
                if uses and not any(scope[:i] in checks for i in range(len(scope) + 1)):
                    unchecked.append(f"{rel}: {'.'.join(scope) or '<module>'}")
    assert not unchecked, unchecked


_IMPORT = r"""
import logging, sys
logging.basicConfig(level=logging.WARNING)
import tf_hetbatch
assert "tensorflow" not in sys.modules
import tf_hetbatch.training.checkpoint_choice  # outside `distribute`: checks through it
assert "tf_hetbatch.distribute._upstream.versions" in sys.modules
print("ok")
"""


def test_the_installed_tested_pair_imports_without_a_warning():
    """The check runs on import (`versions` loaded) and says nothing for a tested pair."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _IMPORT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert "tf_hetbatch is not tested" not in proc.stderr, proc.stderr
