"""User code by name, for the registries of policies and routers: an import path
`package.module:Class` (attributes may be dotted), or the name of an entry point in a group that
installed packages declare (`pagesim.policies`, `pagesim.routers`)."""

from __future__ import annotations

import importlib
import inspect
import numbers
import types
import typing
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points
from typing import Any


def load_plugin(name: str, group: str, kind: str, known: Iterable[str]) -> Any:
    """The object `name` points to; a ValueError naming what did not resolve (the module, the
    attribute, or an unknown name with the registry's `known` names)."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            target: Any = importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"{kind} {name!r}: cannot import module {module!r} ({e})") from None
        except SyntaxError as e:  # was: a traceback from inside importlib
            raise ValueError(f"{kind} {name!r}: module {module!r} does not parse: {e.filename}: line {e.lineno}: "
                             f"{e.msg}") from None
        except Exception as e:  # the module's own code failed as it ran (was: that exception's traceback)
            raise ValueError(f"{kind} {name!r}: importing module {module!r} raised {type(e).__name__}: {e}") from None
        for part in attr.split("."):
            if not hasattr(target, part):
                raise ValueError(f"{kind} {name!r}: module {module!r} has no attribute {attr!r}")
            target = getattr(target, part)
        return target
    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if not found:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(known)} "
                         f"(or package.module:Class, or a '{group}' entry point)")
    return found[0].load()


# The annotations an option's value is checked against; a parameter annotated otherwise is not checked.
_PLAIN = (bool, int, float, str, type(None))


def _plain_types(hint: Any) -> tuple[type, ...] | None:
    """The plain types a parameter's annotation allows (`float`, `int | None`, ...), or None."""
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    return kinds if kinds and all(k in _PLAIN for k in kinds) else None


def _fits(value: Any, kinds: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # a bool is an int to Python, never a count or a rate here
        return bool in kinds
    if isinstance(value, numbers.Integral):  # numpy's too
        return int in kinds or float in kinds
    if isinstance(value, numbers.Real):
        return float in kinds
    return isinstance(value, tuple(kinds))


def check_option_types(target: Callable[..., Any], options: dict[str, Any], label: str) -> None:
    """Refuse an option (`--policy-arg`, `--router-arg`: read as int, float, bool, none or text)
    whose value does not fit its parameter's plain annotation: `aging=abc` reached `"abc" >= 0` as a
    TypeError, `max_imbalance=2.5` ran as a float. `label` names the policy or router."""
    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # a plug-in's annotations may not resolve here: left unchecked, as before
        return
    for key, value in options.items():
        kinds = _plain_types(hints.get(key))
        if kinds is not None and not _fits(value, kinds):
            expected = " or ".join("none" if k is type(None) else k.__name__ for k in kinds)
            raise ValueError(f"{label}: option {key}={value!r} must be {expected}")
