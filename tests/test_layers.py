"""The package's folders are its layers, and every import points down (or stays in its layer).

    core        pure Python + numpy: split arithmetic, devices, controllers, simulator, protocols
    distribute  TensorFlow glue: the strategies, input split, weights, timing, `_upstream`
    dashboards  the TensorBoard balance board and the PNG
    training    Keras level: DynamicBatching, checkpoints, preemption, AsyncTrainer
    launch      the local cluster launcher and the ps/worker task server

A module may import modules of its own layer and of the layers above it in this list, never of
a later one. The package's entry modules (`tf_hetbatch/__init__.py`, the `tf_hetbatch.plot`
command line) may import any layer; no layer imports them. Every import counts, also one inside
a function or under `typing.TYPE_CHECKING`. The core also imports no TensorFlow, Keras or
TensorBoard (at run time: annotations under `TYPE_CHECKING` may name them).

Private TensorFlow/Keras API stays in its quarantine, `tf_hetbatch/distribute/_upstream/`: no
other module of the package or of the examples imports `tensorflow.python` or `keras.src`, and
only `tf_hetbatch.distribute` imports the quarantine (the layers above use the public modules
of `distribute`). The tests, the canaries above all, may import both; so may the benchmarks'
stock control strategies (`examples/benchmarks`: collective keys of their own).
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "tf_hetbatch")
LAYERS = ("core", "distribute", "dashboards", "training", "launch")
ENTRY_MODULES = ("tf_hetbatch", "tf_hetbatch.plot", "tf_hetbatch.plot.__main__")
ENTRY = len(LAYERS)  # the rank of the entry modules: above every layer
FRAMEWORKS = ("tensorflow", "keras", "tensorboard")
QUARANTINE = "tf_hetbatch.distribute._upstream"
PRIVATE = ("tensorflow.python", "keras.src")  # private TensorFlow/Keras: the quarantine only
EXAMPLES = os.path.join(ROOT, "examples")


def _module_files():
    """(dotted module name, path) of every module of the package."""
    out = []
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out.append((".".join(parts), path))
    return sorted(out)


MODULES = _module_files()


def _rank(module):
    """The layer rank of a module of the package (ENTRY for the entry modules)."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return ENTRY


def _type_checking_lines(tree):
    """Line numbers inside `if TYPE_CHECKING:` / `if typing.TYPE_CHECKING:` blocks."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def _imports(module, path):
    """(imported module, line, under TYPE_CHECKING) of every import statement of `path`."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    typing_only = _type_checking_lines(tree)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name`: name may be a submodule (`from tf_hetbatch.core import
            # split`) or an attribute; the submodule, where there is one, is what is imported.
            # Outside the package it counts as one (`from tensorflow import python`).
            names = [f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}")
                     or not _within(base, "tf_hetbatch") else base for alias in node.names]
        else:
            continue
        out += [(name, node.lineno, node.lineno in typing_only) for name in names]
    return out


def _is_module(name):
    return any(module == name for module, _ in MODULES)


def _within(name, package):
    """Whether the dotted `name` is `package` or inside it."""
    return name == package or name.startswith(package + ".")


def _check_private(module, path, bench=False):
    """Violations of the quarantine's rules in one module (of the package or the examples);
    `bench`: a benchmark, which may import the quarantine (not private API)."""
    problems = []
    inside = _within(module, QUARANTINE)
    for name, line, _ in _imports(module, path):
        where = f"{os.path.relpath(path, ROOT)}:{line}"
        if not inside and any(_within(name, private) for private in PRIVATE):
            problems.append(f"{where}: {module} imports {name} (private: only {QUARANTINE})")
        if _within(name, QUARANTINE) and not bench and not _within(module,
                                                                   "tf_hetbatch.distribute"):
            problems.append(f"{where}: {module} imports {name} (only tf_hetbatch.distribute "
                            "may: use its public modules)")
    return problems


def _example_files():
    """(dotted name, path) of every Python file under examples/."""
    out = []
    for folder, dirs, files in os.walk(EXAMPLES):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                out.append((os.path.relpath(path, ROOT)[:-3].replace(os.sep, "."), path))
    return sorted(out)


def _check(module, path):
    """The import rules' violations in one module, as readable lines."""
    problems = []
    own = _rank(module)
    for name, line, typing_only in _imports(module, path):
        where = f"{os.path.relpath(path, ROOT)}:{line}"
        top = name.split(".")[0]
        if top == "tf_hetbatch":
            target = _rank(name)
            if own < ENTRY and target > own:
                layer = LAYERS[target] if target < ENTRY else "the package's entry modules"
                problems.append(f"{where}: {module} ({LAYERS[own]}) imports {name} ({layer})")
        elif top in FRAMEWORKS and own == 0 and not typing_only:
            problems.append(f"{where}: {module} (core) imports {name}")
    return problems


def test_every_module_sits_in_a_layer_folder_or_is_an_entry_module():
    stray = [m for m, _ in MODULES if _rank(m) == ENTRY and m not in ENTRY_MODULES]
    assert not stray, f"modules outside the layer folders {LAYERS}: {stray}"
    for layer in LAYERS:
        assert os.path.isfile(os.path.join(PACKAGE, layer, "__init__.py")), layer


@pytest.mark.parametrize("module, path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_point_down_the_layers(module, path):
    assert _check(module, path) == []


def test_the_check_sees_an_upward_import_a_lazy_one_and_a_framework_in_the_core(tmp_path):
    source = ("import numpy\n"
              "from tf_hetbatch.core import split\n"
              "from tf_hetbatch.distribute import timing\n"
              "def f():\n"
              "    from tf_hetbatch.training.callback import DynamicBatching\n"
              "    import tensorflow as tf\n"
              "    from tf_hetbatch import DynamicBatching\n")
    path = tmp_path / "fake.py"
    path.write_text(source)
    problems = _check("tf_hetbatch.core.fake", str(path))
    assert len(problems) == 4, problems
    assert "imports tf_hetbatch.distribute.timing (distribute)" in problems[0]
    assert "imports tf_hetbatch.training.callback (training)" in " ".join(problems)
    assert "(core) imports tensorflow" in " ".join(problems)
    assert "imports tf_hetbatch (the package's entry modules)" in " ".join(problems)
    top = _check("tf_hetbatch.launch.fake", str(path))  # the top layer: only the package
    assert len(top) == 1 and "imports tf_hetbatch (the package's entry modules)" in top[0]


@pytest.mark.parametrize("module, path", MODULES + _example_files(),
                         ids=[m for m, _ in MODULES + _example_files()])
def test_private_tensorflow_and_keras_stay_in_the_quarantine(module, path):
    bench = _within(module, "examples.benchmarks")
    assert _check_private(module, path, bench=bench) == []


def test_the_quarantine_exists_and_the_check_sees_private_use_outside_it(tmp_path):
    assert QUARANTINE in dict(MODULES), "the quarantine package moved: update QUARANTINE"
    assert _within(f"{QUARANTINE}.collectives", QUARANTINE)
    source = ("import tensorflow as tf\n"
              "from tensorflow.python.eager import context\n"
              "from tensorflow import python\n"
              "def f():\n"
              "    import keras.src.backend\n"
              "    from tf_hetbatch.distribute._upstream import coordination\n"
              "    from tf_hetbatch.distribute import _upstream\n")
    path = tmp_path / "fake.py"
    path.write_text(source)
    problems = _check_private("tf_hetbatch.training.fake", str(path))
    assert len(problems) == 5, problems
    assert "imports tensorflow.python.eager.context (private" in problems[0]
    assert "imports tensorflow.python (private" in problems[1]
    assert "imports keras.src.backend (private" in problems[2]
    assert all("only tf_hetbatch.distribute may" in p for p in problems[3:]), problems
    # Another distribute module may import the quarantine, but not private API itself.
    assert len(_check_private("tf_hetbatch.distribute.fake", str(path))) == 3
    # A quarantine module may do both; a benchmark may import the quarantine only.
    assert _check_private(f"{QUARANTINE}.fake", str(path)) == []
    assert len(_check_private("examples.benchmarks.fake", str(path), bench=True)) == 3


def test_every_public_name_resolves():
    import tf_hetbatch as hb

    assert hb.__all__ == list(hb._PUBLIC)
    for name in hb.__all__:
        assert getattr(hb, name) is not None, name
    namespace = {}
    exec("from tf_hetbatch import *", namespace)
    assert set(hb.__all__) <= set(namespace)
