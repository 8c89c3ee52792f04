"""Storage backends by URL scheme: where a new one lands (one module, one line here).

A path with no scheme (or ``file://``) is a local file.  A backend module has
``open_source(url, options)``, ``open_target(url, options)`` and
``open_directory(url, options)`` returning the io protocols' objects
(``ByteSource``, ``Target``, ``Directory``); ``options`` is the caller's
``storage_options`` dict (endpoint, credentials, ...), or None.  Backends are
imported when a URL first needs them, so their clients stay optional extras.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType
from typing import Any

from .._fork import importing

#: scheme -> module.  Any other scheme goes to the fsspec backend, which serves whatever fsspec knows.
SCHEMES: dict[str, str] = {"s3": "nvckpt.io.s3"}
FSSPEC = "nvckpt.io.fsspec_store"

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://")


def url_scheme(path: str) -> str | None:
    """The scheme of ``path`` ("s3" for "s3://bucket/key"), or None for a local path."""
    found = _URL.match(path)
    return found.group(1).lower() if found else None


def local_path(path: str) -> str:
    """``path`` without a ``file://`` prefix."""
    return path[len("file://"):] if path[:7].lower() == "file://" else path


def backend_for(path: str) -> ModuleType | None:
    """The backend module for ``path``'s scheme, or None for a local path (ValueError naming what to install
    when the backend's client library is missing)."""
    scheme = url_scheme(path)
    if scheme is None or scheme == "file":
        return None
    module = SCHEMES.get(scheme, FSSPEC)
    try:
        with importing():  # maybe in a thread of the caller's: a fork waits for the import (nvckpt._fork)
            return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.startswith("nvckpt"):
            raise ValueError(f"{path!r}: this nvckpt has no storage backend for {scheme}:// URLs") from None
        extra = "s3" if scheme == "s3" else "fsspec"
        raise ValueError(f"{path!r}: {scheme}:// URLs need {exc.name!r}, which is not installed "
                         f"(pip install 'nvckpt[{extra}]')") from None


def describe(target: Any) -> str:
    """How errors name a target: a path or URL as given, a stream by its name."""
    return str(getattr(target, "name", target))


__all__ = ["SCHEMES", "url_scheme", "local_path", "backend_for"]
