"""User code by name, for the registries of policies and routers: an import path
`package.module:Class` (attributes may be dotted), or the name of an entry point in a group that
installed packages declare (`pagesim.policies`, `pagesim.routers`)."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
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
        for part in attr.split("."):
            if not hasattr(target, part):
                raise ValueError(f"{kind} {name!r}: module {module!r} has no attribute {attr!r}")
            target = getattr(target, part)
        return target
    found = [ep for ep in entry_points(group=group) if ep.name == name]
    if not found:
        raise ValueError(f"unknown {kind} {name!r}; known {kind}s: {', '.join(known)} "
                         f"(or package.module:Class, or a '{group}' entry point)")
    return found[0].load()
