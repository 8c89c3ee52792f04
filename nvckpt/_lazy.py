"""Module attributes imported on first use (so ``import nvckpt`` loads no torch)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from ._fork import importing


def lazy_attributes(package: str, namespace: dict[str, Any], table: dict[str, str]) -> tuple[Callable, Callable]:
    """A module's ``__getattr__`` and ``__dir__`` for attributes ``name`` living in ``package.table[name]``."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        with importing():  # maybe in a thread while another forks: nvckpt._fork
            value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
