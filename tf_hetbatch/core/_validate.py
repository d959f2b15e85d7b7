"""Argument checks shared by the package's public entry points (Python stdlib only).

Every check raises an error that names the argument, states the rule, echoes the value and,
where the caller gives one, says the fix (house style: "errors that teach"). It imports
neither TensorFlow nor numpy, so the launcher and the pure core can use it.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, Optional

__all__ = ["check_int", "format_value"]

_MAX_CHARS = 200


def check_int(name: str, value: Any, minimum: int, fix: Optional[str] = None) -> int:
    """Checks that `value` is an integer (not a bool) >= `minimum`; returns it as an int.

    Args:
        name: the argument's name, as the user spells it.
        value: the value received.
        minimum: the smallest value allowed.
        fix: what to do instead, e.g. "pass e.g. interval=10." (optional, ends the message).

    Returns:
        `int(value)`.

    Raises:
        ValueError: `value` is a bool, not an integer (numpy integers count), or below
            `minimum`, e.g. "`interval` must be an integer >= 1. Received: interval=0.
            Fix: pass e.g. interval=10."

    Example:
        >>> check_int("keep", 2, 1)
        2
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        fix_text = f" Fix: {fix}" if fix else ""
        raise ValueError(f"`{name}` must be an integer >= {minimum}. "
                         f"Received: {name}={format_value(value)}.{fix_text}")
    return int(value)


def format_value(value: Any) -> str:
    """A short printable form of `value` for error messages (numpy arrays as lists, at most
    200 characters)."""
    numpy = sys.modules.get("numpy")  # not imported: then `value` is no numpy array
    if numpy is not None and isinstance(value, numpy.ndarray):
        value = value.tolist()
    text = repr(value)
    return text if len(text) <= _MAX_CHARS else text[:_MAX_CHARS - 3] + "..."
