"""docs/troubleshooting.md quotes every message of tf_hetbatch that names a fix.

Reads the package's source with `ast` (no TensorFlow import, no package import). A message is
a string given to an exception (`raise SomeError(...)`, or `SomeError(...)` built to be raised
or returned; TensorFlow's errors take it third), to `logger.warning/error/exception/critical`
or to `warnings.warn`: a str constant, an implicit concatenation, an f-string, or a `+` of
such. A name in it (an f-string's `{fix}`, a `+ _SOME_FIX`, or the whole message) that is
assigned exactly one string in the same function, or at module level, is read as that string.
Other strings that are not docstrings (reasons a warning fills in, the messages of in-graph
assertions) are read too. Every one whose whole text holds "Fix" must be on the page.

What the page must hold is the message's opening constant text: up to its first value filled
in at run time (an f-string's `{...}`, a %-placeholder of a logger call, a non-string operand
of `+`), if that is at least `MIN_CHARS` characters. A shorter opening (the message begins with
a value, "`{name}` must ...", or with a short phrase, "The checkpoint {path} holds ...") is
checked with the words after it: a pattern of the constant text, up to `FALLBACK_CHARS`
characters, each value in between matching any 1-60 characters (the page writes it as e.g.
`<path>`). A message with less than `MIN_CHARS` characters of constant text in all is skipped:
it has nothing a reader could search for (one: `check_int`'s " Fix: {fix}" tail, whose callers'
messages begin with the argument's name and are covered on the page as one entry).

The page and the message are compared with whitespace normalised and backticks removed (the
page writes a message's code spans as Markdown code spans).
"""
import ast
import functools
import os
import re
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "tf_hetbatch")
PAGE = os.path.join(ROOT, "docs", "troubleshooting.md")

MIN_CHARS = 25        # the shortest opening checked on its own
FALLBACK_CHARS = 40   # the constant text a pattern takes (a short opening and the words after)
_LOG_METHODS = {"warning", "warn", "error", "exception", "critical"}
# A %-format placeholder (logger calls format their message so); "%%" is a literal "%".
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[diouxXeEfFgGcrsa%]")

VALUE = None  # a part of a message filled in at run time


@dataclass
class Message:
    where: str                      # "tf_hetbatch/....py:LINE"
    kind: str                       # "raise ValueError", "logger.warning", "other string"
    parts: List[Optional[str]] = field(default_factory=list)  # constant text, or VALUE

    @property
    def text(self) -> str:
        return "".join("{...}" if p is VALUE else p for p in self.parts)


# ------------------------------------------------------------------------ reading the source ---
def _docstring_nodes(tree) -> set:
    """Bare string statements (docstrings and other statement-level strings)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


class _Module:
    def __init__(self, path: str):
        self.path = path
        self.rel = os.path.relpath(path, ROOT)
        with open(path, encoding="utf-8") as f:
            self.tree = ast.parse(f.read(), path)
        self.parents = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.docstrings = _docstring_nodes(self.tree)
        self.used = set()  # ids of string nodes read as part of a message

    def _scope(self, node):
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return self.tree

    def _assigned_string(self, name: str, at, depth: int):
        """The parts of the one string assigned to `name` in `at`'s function, else at module
        level; None if there is not exactly one such assignment."""
        function = self._scope(at)
        for nodes in ((ast.walk(function) if function is not self.tree else ()),
                      self.tree.body):
            values = []
            for node in nodes:
                if (isinstance(node, ast.Assign) and len(node.targets) == 1
                        and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name):
                    values.append(node.value)
                elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                      and node.target.id == name and node.value is not None):
                    values.append(node.value)
            if len(values) == 1:
                return self.parts(values[0], depth + 1, resolve=True)
            if values:
                return None
        return None

    def parts(self, node, depth: int = 0, resolve: bool = True, percent: bool = False):
        """A string expression's parts (constant text, or VALUE), or None if `node` is none."""
        if depth > 5:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            self.used.add(id(node))
            return _split_percent(node.value) if percent else [node.value]
        if isinstance(node, ast.JoinedStr):
            self.used.add(id(node))
            out = []
            for value in node.values:
                if isinstance(value, ast.Constant):
                    out.append(value.value)
                    continue
                inner = value.value
                sub = (self._assigned_string(inner.id, node, depth)
                       if resolve and isinstance(inner, ast.Name) and value.format_spec is None
                       and value.conversion == -1 else None)
                out.extend(sub if sub is not None else [VALUE])
            return out
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left = self.parts(node.left, depth, resolve, percent)
            right = self.parts(node.right, depth, resolve, percent)
            if left is None and right is None:
                return None
            self.used.add(id(node))
            return (left if left is not None else [VALUE]) + (right if right is not None
                                                              else [VALUE])
        if resolve and isinstance(node, ast.Name):
            return self._assigned_string(node.id, node, depth)
        return None


def _split_percent(text: str) -> List[Optional[str]]:
    out, last = [], 0
    for match in _PERCENT.finditer(text):
        out.append(text[last:match.start()])
        out.append("%" if match.group() == "%%" else VALUE)
        last = match.end()
    out.append(text[last:])
    return out


_EXCEPTION_SUFFIXES = ("Error", "Exception", "Warning", "Exit")


def _package_exceptions(trees) -> set:
    """Names of the package's own exception classes whose names do not say so, e.g.
    `UnreadableCheckpoint(ValueError)`."""
    return {node.name for tree in trees for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(base).endswith(_EXCEPTION_SUFFIXES) for base in node.bases)}


def _call_kind(call: ast.Call, exceptions: set) -> Optional[Tuple[str, bool]]:
    """(kind, %-formatted) of a call that takes a message, else None."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if isinstance(func, ast.Attribute) and name in _LOG_METHODS:
        owner = ast.unparse(func.value)
        if owner == "warnings" and name == "warn":
            return "warnings.warn", False
        if "log" in owner.lower():
            return f"{owner}.{name}", True
        return None
    if name.endswith(_EXCEPTION_SUFFIXES) or name in exceptions:
        return name, False
    return None


@functools.lru_cache(maxsize=None)
def collect() -> Tuple[Message, ...]:
    """Every message (and other non-docstring string) of the package whose text holds "Fix"."""
    modules = [_Module(os.path.join(folder, file))
               for folder, _, files in sorted(os.walk(PACKAGE))
               for file in sorted(files) if file.endswith(".py")]
    exceptions = _package_exceptions(module.tree for module in modules)
    messages = []
    for module in modules:
        messages += _messages_of_calls(module, exceptions)
        messages += _other_strings(module)  # after the calls: they mark what they read
    return tuple(sorted(messages, key=lambda m: m.where))


def _messages_of_calls(module: _Module, exceptions: set) -> List[Message]:
    """The messages given to exceptions, loggers and `warnings.warn` in `module`."""
    messages = []
    for node in ast.walk(module.tree):
        kind = _call_kind(node, exceptions) if isinstance(node, ast.Call) else None
        if kind is None:
            continue
        label, percent = kind
        if isinstance(module.parents.get(node), ast.Raise):
            label = "raise " + label
        for arg in node.args:  # the first string argument (TensorFlow's errors: the third)
            parts = module.parts(arg, percent=percent)
            if parts is not None:
                message = Message(f"{module.rel}:{node.lineno}", label, parts)
                if "Fix" in message.text:
                    messages.append(message)
                break
    return messages


def _other_strings(module: _Module) -> List[Message]:
    """Strings with "Fix" that no call above read: reasons and hints built apart from their
    message, the messages of in-graph assertions (`tf.debugging.assert_*(message=...)`)."""
    messages = []
    for node in ast.walk(module.tree):
        if (id(node) in module.used or id(node) in module.docstrings
                or isinstance(node, ast.Name)):  # a name is read where it is used
            continue
        parent = module.parents.get(node)
        if isinstance(parent, (ast.JoinedStr, ast.FormattedValue)):
            continue
        if (isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Add)
                and module.parts(parent, resolve=False) is not None):
            continue  # part of a larger `+`: that one is read whole
        parts = module.parts(node)
        if parts is not None:
            message = Message(f"{module.rel}:{node.lineno}", "other string", parts)
            if "Fix" in message.text:
                messages.append(message)
    return messages


# ------------------------------------------------------------------------------- comparing ---
def _normal(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def key_of(message: Message) -> Optional[Tuple[str, bool]]:
    """(text, False) or (regex, True) the normalised page must hold for `message`; None to
    skip it (its constant text is shorter than MIN_CHARS in all)."""
    parts = []
    for p in message.parts:  # merge adjacent constants
        if p is not VALUE and parts and parts[-1] is not VALUE:
            parts[-1] += p
        else:
            parts.append(p)
    opening = parts[0] if parts and parts[0] is not VALUE else ""
    if len(_normal(opening)) >= MIN_CHARS:
        return _normal(opening), False
    # A short opening: it, each value as 1-60 characters, and the words after it, up to
    # FALLBACK_CHARS characters of constant text.
    pattern, chars = [], 0
    for p in parts:
        if p is VALUE:
            if pattern:  # (a leading value needs no pattern: the page may show anything)
                pattern.append(r".{1,60}?")
            continue
        words = _normal(p).split()
        if not words:
            continue
        if p[:1].isspace():
            pattern.append(" ?")
        taken = []
        for word in words:
            taken.append(word)
            chars += len(word) + 1
            if chars > FALLBACK_CHARS:
                break
        pattern.append(re.escape(" ".join(taken)))
        if chars > FALLBACK_CHARS:
            return "".join(pattern), True
        if p[-1:].isspace():
            pattern.append(" ?")
    if chars < MIN_CHARS:
        return None  # too little constant text to find it by
    return "".join(pattern), True


def _page_text() -> str:
    with open(PAGE, encoding="utf-8") as f:
        return _normal(f.read())


def check(messages, page: str):
    """(checked, skipped, missing) of `messages` against the normalised `page`; checked and
    missing hold (message, key) pairs."""
    checked, skipped, missing = [], [], []
    for message in messages:
        key = key_of(message)
        if key is None:
            skipped.append(message)
            continue
        text, is_regex = key
        found = re.search(text, page) if is_regex else text in page
        (checked if found else missing).append((message, key))
    return checked, skipped, missing


# ----------------------------------------------------------------------------------- tests ---
def test_every_message_that_names_a_fix_is_on_the_troubleshooting_page():
    messages = collect()
    checked, skipped, missing = check(messages, _page_text())
    by_pattern = sum(1 for _, (_, is_regex) in checked + missing if is_regex)
    print(f"\n{len(messages)} messages name a fix: {len(checked) + len(missing)} checked "
          f"({by_pattern} by a pattern of a short opening and the words after it), "
          f"{len(skipped)} skipped (under {MIN_CHARS} characters of constant text):")
    for message in skipped:
        print(f"  skipped {message.where} ({message.kind}): {message.text!r}")
    for message, (text, _) in missing:
        print(f"MISSING {message.where} ({message.kind}): looked for {text!r}\n"
              f"    message: {message.text[:300]!r}")
    assert not missing, (
        f"{len(missing)} message(s) that name a fix are not quoted in docs/troubleshooting.md "
        "(see the printed list): " + "; ".join(m.where for m, _ in missing))


def test_the_reader_finds_the_package_messages():
    """Guards the test above against passing on nothing (a reader that finds no message)."""
    messages = collect()
    assert len(messages) >= 100
    assert {m.kind.split()[0] for m in messages} >= {"raise", "logger.warning", "other"}
    texts = [m.text for m in messages]
    # A module-level name joined with `+` (step_run's _EMPTY_REPLICA_FIX) and a local one in
    # an f-string (core/micro_batches' `fix`) are read as their strings.
    assert any(t.startswith("Every replica needs at least 1 sample") for t in texts)
    assert any("entries must be ints >= 1 or None" in t and "Fix: pass one entry" in t
               for t in texts)
    # A logger call's %-placeholders are values; a TensorFlow error's message is its third
    # argument; an in-graph assertion's message is read as an "other string".
    assert any(m.kind == "logger.warning" and m.parts[0] == "No memory bound for "
               for m in messages)
    assert any(m.kind.endswith("ResourceExhaustedError") for m in messages)
    assert any(t.startswith("A global batch followed a short one") for t in texts)
    assert len(check(messages, "")[1]) <= 3  # skipped: only messages with no words to find


def test_keys():
    def message(*parts):
        return Message("x.py:1", "raise ValueError", list(parts))

    # A long enough opening: itself, up to the first value, without backticks.
    assert key_of(message("`steps` must be an integer of at least one. Received: ", VALUE,
                          ". Fix: ...")) == (
        "steps must be an integer of at least one. Received:", False)
    # A short opening: a pattern with the words after the value.
    text, is_regex = key_of(message("The checkpoint ", VALUE, " holds optimizer variables but "
                                    "the model has no optimizer. Fix: compile it."))
    assert is_regex
    page = _normal("**The checkpoint `<path>` holds optimizer variables but the model has no "
                   "optimizer. Fix: compile it.**")
    assert re.search(text, page)
    assert not re.search(text, _normal("The checkpoint `<path>` holds shape `<shape>`"))
    # A message that begins with a value.
    text, _ = key_of(message("`", VALUE, "` must be one of ", VALUE, ". Received: ", VALUE))
    assert re.search(text, _normal("**`<name>` must be one of `<choices>`. Received: `<v>`**"))
    # Too little text to search for.
    assert key_of(message(" Fix: ", VALUE)) is None


if __name__ == "__main__":  # the inventory, to write the page from
    for m in collect():
        key = key_of(m)
        print(f"{m.where} [{m.kind}] key={key}\n    {m.text}\n")
