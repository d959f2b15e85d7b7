"""The manual: README is a front page whose commands come first, every guide under docs/guides/
runs as a reader would run it and renders into a page with a title, and the API reference has
an entry, with a docstring, for every public name. (`bash .ci/docs` builds the site strictly.)"""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tf_hetbatch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDES = sorted((DOCS / "guides").glob("*.py"))
sys.path.insert(0, str(DOCS))
from hooks import guide_to_markdown  # noqa: E402

README_LIMIT = 6 * 1024
GUIDE_TIMEOUT_S = 300


def test_readme_is_a_front_page_with_its_two_commands_first():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= README_LIMIT
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["bash .ci/setup && .venv/bin/python examples/demo.py",
                        "bash .ci/setup && .venv/bin/python -m pytest tests"]
    assert text.index(first_block) < text.index("## ")  # before any section


def test_readme_links_to_files_that_exist():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing


def test_the_guides_are_the_manuals_and_each_has_a_title():
    names = {path.stem for path in GUIDES}
    assert names == {"quickstart", "mixed_devices", "multi_worker", "custom_steps", "memory",
                     "checkpoints", "async_training", "dashboards", "exactness", "batch_size"}
    for path in GUIDES:
        page = guide_to_markdown(path.read_text(), path.name)
        assert page.startswith("# "), path.name  # the first statement is prose with a title
        assert "```python" in page, path.name


def test_every_public_name_has_a_reference_entry_and_a_docstring():
    reference = (DOCS / "reference.md").read_text()
    entries = set(re.findall(r"^::: ([\w.]+)$", reference, re.M))
    for name in tf_hetbatch.__all__:
        module = tf_hetbatch._PUBLIC[name]
        assert f"{module}.{name}" in entries, f"{name}: no `::: {module}.{name}` in reference.md"
        value = getattr(importlib.import_module(module), name)
        if callable(value):
            assert (value.__doc__ or "").strip(), f"{name} has no docstring"
    assert len(entries) == len(tf_hetbatch.__all__)  # nothing but the public names


@pytest.mark.cluster
@pytest.mark.parametrize("guide", GUIDES, ids=[path.stem for path in GUIDES])
def test_the_guide_runs_as_a_reader_runs_it(guide, tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, str(guide)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=GUIDE_TIMEOUT_S)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])
