"""MkDocs hook: renders each guide under docs/guides/ (a Python file a reader can run) into a
page. Every module-level bare string is Markdown prose; the code between them is shown as it is,
in Python code blocks. The .py file itself stays in the site, linked from its page."""

import ast
import inspect
from pathlib import Path


def guide_to_markdown(source: str, name: str) -> str:
    """The Markdown page of a guide's `source`; `name` is its file name (e.g. quickstart.py)."""
    lines = source.splitlines()
    parts = []
    code_from = 0  # the first line (0-based) not yet shown

    def code(until):
        chunk = "\n".join(lines[code_from:until]).strip("\n")
        if chunk.strip():
            parts.append(f"```python\n{chunk}\n```")

    for node in ast.parse(source).body:
        prose = (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                 and isinstance(node.value.value, str) and node.col_offset == 0)
        if prose:
            code(node.lineno - 1)
            parts.append(inspect.cleandoc(node.value.value))
            code_from = node.end_lineno
    code(len(lines))
    parts.append(f"Run this guide: `python docs/guides/{name}` ([{name}]({name})).")
    return "\n\n".join(parts) + "\n"


def on_files(files, config):
    from mkdocs.structure.files import File  # only when MkDocs builds (the tests render alone)

    guides = Path(config["docs_dir"]) / "guides"
    for path in sorted(guides.glob("*.py")):
        page = File.generated(config, f"guides/{path.stem}.md",
                              content=guide_to_markdown(path.read_text(), path.name))
        files.append(page)
    return files
