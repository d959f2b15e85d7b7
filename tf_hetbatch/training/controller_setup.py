"""Which controller `DynamicBatching` runs: a built-in one by name, or a user's object.

A user's controller must implement `tf_hetbatch.core.protocols.Controller` (checked when the
callback is constructed, so a wrong one fails before any training). The built-in names make
the controller with the callback's bounds; a user's controller keeps its own bounds, which
must not contradict the callback's. Pure Python + numpy (the controllers are pure core).
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Mapping, Optional

from tf_hetbatch.core import controllers as _controllers
from tf_hetbatch.core._validate import format_value
from tf_hetbatch.core.bounds import Bounds, plain_bounds
from tf_hetbatch.core.protocols import Controller

__all__ = ["CONTROLLERS", "make_controller", "controller_config", "controller_from_config"]

CONTROLLERS = {
    "model": _controllers.ModelBasedController,
    "proportional": _controllers.ProportionalController,
}


def make_controller(controller: Any, min_sizes: Bounds, max_sizes: Bounds) -> Controller:
    """The controller for `DynamicBatching(controller=...)`.

    Args:
        controller: None or "model" (`ModelBasedController`), "proportional"
            (`ProportionalController`), or a `protocols.Controller`.
        min_sizes, max_sizes: the callback's bounds (already checked alone).

    Returns:
        The controller object.

    Raises:
        ValueError: an unknown name, or bounds that contradict the controller's own.
        TypeError: an object that is not a `protocols.Controller`, or whose `update` does not
            take the keyword `step_time`.
    """
    if controller is None or isinstance(controller, str):
        key = "model" if controller is None else controller
        if key not in CONTROLLERS:
            raise ValueError(
                f"`controller` must be one of {tuple(CONTROLLERS)} or a controller object with "
                f"init() and update(). Received: controller={controller!r}")
        return CONTROLLERS[key](min_sizes=plain_bounds(min_sizes),
                                max_sizes=plain_bounds(max_sizes))
    if not (isinstance(controller, Controller) and callable(controller.init)
            and callable(controller.update)):
        raise TypeError(
            "`controller` must be 'model', 'proportional' or an object with init(sizes) and "
            "update(state, sizes, times, step_time=None) -> (sizes, state). Received: "
            f"controller={controller!r} ({type(controller).__name__}).")
    _check_update_takes_step_time(controller)
    for name, value in (("min_sizes", min_sizes), ("max_sizes", max_sizes)):
        if not hasattr(controller, name):
            continue  # optional (protocols.Controller): the static split uses these bounds
        own = getattr(controller, name)
        default = 1 if name == "min_sizes" else None
        if value != default and plain_bounds(own) != plain_bounds(value):
            raise ValueError(
                f"`{name}` conflicts with the controller's own bounds. Received: {name}="
                f"{format_value(value)} and a controller with {name}={format_value(own)}. Fix: "
                f"set the bounds on the controller only, e.g. ModelBasedController({name}=...).")
    return controller


def _check_update_takes_step_time(controller) -> None:
    """`DynamicBatching` passes `step_time=` to every `update` (protocols.Controller)."""
    try:
        signature = inspect.signature(controller.update)
    except (TypeError, ValueError):
        return  # no signature to check (e.g. a C function): the first update will tell
    try:
        signature.bind(None, None, None, step_time=None)
    except TypeError:
        raise TypeError(
            "`controller.update` must take (state, sizes, times) and the keyword `step_time` "
            "(the window's step time in seconds, or None), as tf_hetbatch.Controller "
            f"says. Received: {type(controller).__name__}.update{signature}. Fix: define "
            "`def update(self, state, sizes, times, step_time=None)` (it may ignore it)."
        ) from None


def controller_config(controller: Controller, name: Optional[str]) -> Any:
    """The `controller` entry of `DynamicBatching.get_config()`: the name given, else the
    object's class and `get_config()`.

    Raises:
        ValueError: a controller object without `get_config()`.
    """
    if name is not None:
        return name
    if hasattr(controller, "get_config"):  # optional (protocols.Controller)
        return {"class_name": type(controller).__name__, "config": controller.get_config()}
    raise ValueError(
        f"The controller {type(controller).__name__} has no get_config(), so this "
        "callback cannot be serialised. Fix: give the controller get_config() and "
        "from_config(), or pass controller='model' or 'proportional'.")


def controller_from_config(entry: Any,
                           custom_objects: Optional[Mapping[str, type]] = None) -> Any:
    """The `controller` argument for `DynamicBatching` from a `controller_config` entry.

    Raises:
        ValueError: an unknown controller class (not built in, not in `custom_objects`).
    """
    if not isinstance(entry, Mapping):
        return entry
    classes: Dict[str, type] = {c.__name__: c for c in CONTROLLERS.values()}
    classes.update(custom_objects or {})
    name = entry.get("class_name")
    if name not in classes:
        raise ValueError(
            f"Unknown controller class {name!r} in the config. Fix: pass "
            f"custom_objects={{{name!r}: TheClass}} to DynamicBatching.from_config.")
    return classes[name].from_config(entry.get("config", {}))
