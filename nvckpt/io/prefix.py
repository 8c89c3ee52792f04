"""A sharded checkpoint's directory in an object store: a key prefix, published by one object written last.

An object store has no rename, so a directory cannot be swapped into place as a
local one is (nvckpt.io.publish).  Instead every save writes its files under a
generation of its own, ``PREFIX/.nvckpt-generations/<token>/NAME``, where no
reader looks, and publishes them by writing one object, ``PREFIX/.nvckpt-published``
(a JSON document naming the generation and each file's size and ETag), last: the
commit point.  A single PUT appears whole or not at all, so a reader that reads
the commit object sees the complete old checkpoint or the complete new one; a
killed rank or coordinator leaves the previous one loadable and the new one
invisible.  A reader pins what it read (each file by its ETag): a file replaced
or removed since gives a named error, never a mix.  The previous generation is
deleted after the commit; what a killed save left goes with ``remove_stale``.

Objects written under PREFIX by other means (a user's config beside the
checkpoint) are entries too and stay as they are when a checkpoint is published.

``KeyStore`` is what a backend gives this module: get, head, put, list, delete by
key, and a ByteSource and a Target per key (nvckpt.io.s3, nvckpt.io.fsspec_store).
"""

from __future__ import annotations

import errno
import json
import secrets
import threading
import weakref
from typing import Any, Callable, Protocol

from .source import ByteSource
from .target import Target

COMMIT = ".nvckpt-published"
GENERATIONS = ".nvckpt-generations"
_STAGED = ".staged"  # in a generation: it was staged (and not yet published or discarded)
_FORMAT = "nvckpt-prefix-directory"

_LIVE: set[str] = set()  # generations of saves in progress in this process (remove_stale leaves them)
_LIVE_LOCK = threading.Lock()
_PUBLISHED: dict[str, int] = {}  # directory -> number of the save last published there by this process
_PUBLISH_LOCK = threading.Lock()


class KeyStore(Protocol):
    """Objects by key in one bucket (or filesystem) of an object store."""

    def url(self, key: str) -> str:
        """How errors name the object ``key``."""
        ...

    def get(self, key: str, etag: str | None = None) -> bytes:
        """The whole object (FileNotFoundError if missing; an OSError naming it if it is no longer ``etag``)."""
        ...

    def head(self, key: str) -> tuple[int, str | None] | None:
        """(size, ETag) of the object, or None if there is none."""
        ...

    def put(self, key: str, data: bytes) -> None: ...

    def list(self, prefix: str) -> dict[str, tuple[int, str | None]]:
        """Every object under ``prefix`` (recursively): key -> (size, ETag)."""
        ...

    def delete(self, keys: list[str]) -> None:
        """Delete the objects (missing ones are no error)."""
        ...

    def source(self, key: str, name: str, etag: str | None = None) -> ByteSource:
        """The object ``key`` (pinned to ``etag`` where the store can), named ``name`` in errors."""
        ...

    def target(self, key: str, name: str) -> Target:
        """An atomic Target writing the object ``key``; its errors name ``name``."""
        ...


def _live(token_key: str, alive: bool) -> None:
    with _LIVE_LOCK:
        (_LIVE.add if alive else _LIVE.discard)(token_key)


class PrefixStaging:
    """A generation being written, invisible until ``publish`` writes the commit object naming it."""

    def __init__(self, directory: "PrefixDirectory", token: str, *, create: bool) -> None:
        self.directory = directory
        self.token = token
        self.base = f"{directory.prefix}{GENERATIONS}/{token}/"
        if create:
            directory.store.put(self.base + _STAGED, b"")
            _live(directory.store.url(self.base), True)
            # A save that failed and is never discarded: its generation is stale once this object is freed.
            weakref.finalize(self, _live, directory.store.url(self.base), False)

    def _key(self, name: str) -> str:
        if "/" in name or name in ("", ".", "..") or name.startswith(".nvckpt-"):
            raise ValueError(f"{name!r} is not a plain file name")
        return self.base + name

    def target(self, name: str) -> Target:
        return self.directory.store.target(self._key(name), self.directory.join(name))

    def alive(self) -> bool:
        return self.directory.store.head(self.base + _STAGED) is not None

    def write_bytes(self, name: str, data: bytes) -> None:
        self.directory.store.put(self._key(name), data)

    def size(self, name: str) -> int:
        found = self.directory.store.head(self._key(name))
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "not written", self.directory.join(name))
        return found[0]

    def publish(self, number: int | None = None, carry: Callable[[str], bool] | None = None) -> None:
        """Write the commit object naming this generation (objects beside the checkpoint stay as they are, so
        ``carry`` has nothing to do), then delete the generation it replaced."""
        d = self.directory
        store = d.store
        try:
            files = {key[len(self.base):]: meta for key, meta in store.list(self.base).items()
                     if key != self.base + _STAGED}
            doc = {"format": _FORMAT, "version": 1, "generation": self.token,
                   "files": {name: {"size": size, "etag": etag} for name, (size, etag) in sorted(files.items())}}
            with _PUBLISH_LOCK:
                if number is not None and _PUBLISHED.get(d.name, -1) > number:
                    raise FileExistsError(errno.EEXIST, "a checkpoint saved after this one was published there "
                                          "first; this older one is not published over it", d.name)
                previous = d._read_commit()
                store.put(d.prefix + COMMIT, json.dumps(doc, sort_keys=True).encode())
                if number is not None:
                    _PUBLISHED[d.name] = number
            d._commit = doc
            store.delete([self.base + _STAGED])
        except FileExistsError:
            self.discard()
            raise
        finally:
            _live(store.url(self.base), False)
        if previous is not None and previous.get("generation") != self.token:
            old = f"{d.prefix}{GENERATIONS}/{previous['generation']}/"
            store.delete(sorted(store.list(old)))

    def discard(self) -> None:
        store = self.directory.store
        _live(store.url(self.base), False)
        store.delete([self.base + _STAGED])  # first: other ranks see it gone at once
        store.delete(sorted(store.list(self.base)))

    def release(self) -> None:
        """This save will not publish: its generation is stale for the next save's ``remove_stale``."""
        _live(self.directory.store.url(self.base), False)


class PrefixDirectory:
    """A sharded checkpoint's directory under a key prefix of a KeyStore (see the module docstring).

    ``name``: the URL as the caller gave it.  What the commit object said is read once and kept: every file
    this object reads comes from that one published checkpoint (``exists``, ``entries`` and the checks of a
    save read it afresh)."""

    def __init__(self, store: KeyStore, prefix: str, name: str) -> None:
        self.store = store
        self.key = prefix.rstrip("/")
        self.prefix = self.key + "/" if self.key else ""
        self.name = name.rstrip("/")
        self._commit: dict[str, Any] | None = None
        self._read = False

    def _read_commit(self) -> dict[str, Any] | None:
        try:
            data = self.store.get(self.prefix + COMMIT)
        except FileNotFoundError:
            self._commit, self._read = None, True
            return None
        try:
            doc = json.loads(data)
            if doc.get("format") != _FORMAT or doc.get("version") != 1:
                raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
            str(doc["generation"])
            {str(k): (int(v["size"]), v.get("etag")) for k, v in doc["files"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise OSError(errno.EIO, f"its commit object {COMMIT} is not one nvckpt wrote ({exc}): remove it, or "
                          "give another prefix", self.name) from None
        self._commit, self._read = doc, True
        return doc

    def _published(self) -> dict[str, Any] | None:
        return self._commit if self._read else self._read_commit()

    def _file(self, name: str) -> tuple[str, int | None, str | None]:
        """Where entry ``name`` is: (key, size, ETag); size None if there is no such entry."""
        doc = self._published()
        if doc is not None and name in doc["files"]:
            meta = doc["files"][name]
            return f"{self.prefix}{GENERATIONS}/{doc['generation']}/{name}", int(meta["size"]), meta.get("etag")
        if "/" in name or name.startswith(".nvckpt-") or not name:
            return self.prefix + name, None, None
        found = self.store.head(self.prefix + name)
        return self.prefix + name, (None if found is None else found[0]), (None if found is None else found[1])

    def exists(self) -> bool:
        return self._read_commit() is not None or bool(self._others(limit_one=True))

    def is_file(self) -> bool:
        return bool(self.key) and self.store.head(self.key) is not None

    def _others(self, limit_one: bool = False) -> list[str]:
        """Names under the prefix that are not this format's own (objects, and folders by their first part)."""
        names = []
        for key in self.store.list(self.prefix):
            first = key[len(self.prefix):].split("/", 1)[0]
            if first in (COMMIT, GENERATIONS) or first in names:
                continue
            names.append(first)
            if limit_one:
                break
        return names

    def entries(self) -> list[str]:
        doc = self._read_commit()
        return sorted(set(self._others()) | set(doc["files"] if doc is not None else ()))

    def join(self, name: str) -> str:
        return f"{self.name}/{name}"

    def read_bytes(self, name: str) -> bytes:
        key, size, etag = self._file(name)
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", self.join(name))
        return self.store.get(key, etag)

    def size(self, name: str) -> int | None:
        return self._file(name)[1]

    def one_save(self) -> bool:
        return self._published() is not None  # every entry read is of the generation the commit object names

    def open_source(self, name: str) -> ByteSource:
        key, size, etag = self._file(name)
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", self.join(name))
        return self.store.source(key, self.join(name), etag)

    def check_replaceable(self, own: Callable[[str], bool], overwrite: bool) -> None:
        if self.is_file():
            raise FileExistsError(errno.EEXIST, "is an object, not a checkpoint directory (a prefix); a checkpoint "
                                  "directory is written under it", self.name)
        doc = self._read_commit()
        published = doc["files"] if doc is not None else {}
        if any(own(e) for e in published):
            if not overwrite:
                raise FileExistsError(errno.EEXIST, "a checkpoint exists there and overwrite=False", self.name)
        elif published or self._others(limit_one=True):
            raise FileExistsError(errno.EEXIST, "holds other objects, not a checkpoint; a checkpoint directory is "
                                  "published only under an empty prefix or over a checkpoint", self.name)

    def remove_stale(self) -> list[str]:
        doc = self._read_commit()
        current = None if doc is None else doc["generation"]
        base = f"{self.prefix}{GENERATIONS}/"
        generations: dict[str, list[str]] = {}
        for key in self.store.list(base):
            generations.setdefault(key[len(base):].split("/", 1)[0], []).append(key)
        removed = []
        for token, keys in sorted(generations.items()):
            with _LIVE_LOCK:
                live = self.store.url(f"{base}{token}/") in _LIVE
            if token == current or live:
                continue
            self.store.delete(sorted(keys))
            removed.append(self.store.url(f"{base}{token}/"))
        return removed

    def stage(self) -> PrefixStaging:
        return PrefixStaging(self, secrets.token_hex(8), create=True)

    def staging(self, token: str) -> PrefixStaging:
        if not token or "/" in token or token.startswith("."):
            raise ValueError(f"{token!r} is not a staging token of {self.name}")
        return PrefixStaging(self, token, create=False)


__all__ = ["KeyStore", "PrefixDirectory", "PrefixStaging", "COMMIT", "GENERATIONS"]
