"""Any other URL (``memory://``, ``gs://``, ``az://``, ``hf://``, ...) through fsspec, for what fsspec supports.

s3:// has its own backend (nvckpt.io.s3); every other scheme comes here.
``storage_options`` are the filesystem's own (``fsspec.filesystem(protocol, **options)``).

What holds here, and where it depends on the store:

- A save writes ``NAME.nvckpt-tmp-XXXXXXXX`` beside the target, streamed, and on
  commit moves it into place (``fs.mv``).  Where the filesystem renames
  (``memory://``, local and network filesystems) the checkpoint appears whole
  in one step.  Where it has no rename (gcsfs, adlfs: a move is a copy, then a
  delete), the copy still makes the object appear whole, but a process killed
  between the two leaves the temporary, which the next save to that name
  reports (``leftovers``); remove it by hand.
- A read is not pinned to a version of the object (fsspec has no conditional
  reads): an object replaced while it is read gives nvckpt's own checksum error
  naming the chunk, never wrong tensors.  Use s3:// for ETag-pinned reads.
- A DCP directory is published by one commit object written last
  (nvckpt.io.prefix), which needs only whole-object writes: it holds on every
  store.
"""

from __future__ import annotations

import errno
import secrets
from typing import Any, Callable

from .prefix import PrefixDirectory
from .ranges import Coalescing
from .source import _Counted
from .target import SinkOptions

try:
    from fsspec.core import url_to_fs
except ModuleNotFoundError as exc:  # schemes.backend_for says what to install
    raise ModuleNotFoundError("fsspec is not installed (pip install fsspec)", name="fsspec") from exc

MiB = 1 << 20
TMP_SUFFIX = ".nvckpt-tmp-"

#: A read is a call into the filesystem (a request for a remote one): neighbours share one.
FSSPEC_COALESCING = Coalescing(max_gap=1 * MiB, max_span=32 * MiB, alone_from=32 * MiB, whole_loads=True)


def filesystem(url: str, options: dict[str, Any] | None) -> tuple[Any, str]:
    """(the fsspec filesystem, the path in it) of ``url``; ValueError naming the URL for one fsspec does not know."""
    try:
        return url_to_fs(url, **(options or {}))
    except (ValueError, ImportError) as exc:
        scheme = url.split("://", 1)[0]
        if isinstance(exc, ImportError) or "Protocol not known" in str(exc):
            raise ValueError(f"{url!r}: fsspec has no filesystem for {scheme}:// here ({exc}); install the package "
                             "that provides it (gcsfs for gs://, adlfs for az://, ...)") from None
        raise ValueError(f"{url!r}: {exc}") from None


def _named(exc: BaseException, url: str) -> BaseException:
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError) and exc.filename is None:
        return OSError(exc.errno or errno.EIO, exc.strerror or str(exc).strip().splitlines()[0], url)
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(errno.ENOENT, "No such file or directory", url)
    return exc


class FsspecSource(_Counted):
    """One file of an fsspec filesystem, read by position (``cat_file`` ranges)."""

    exact_size = True
    coalescing = FSSPEC_COALESCING

    def __init__(self, fs: Any, path: str, name: str | None = None, size: int | None = None) -> None:
        super().__init__()
        self.fs = fs
        self.path = path
        self.name = name or fs.unstrip_protocol(path)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", self.name) from None
        if info.get("type") == "directory":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", self.name)
        self.size = int(info["size"]) if size is None else size
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def read(self, offset: int, length: int) -> bytes:
        with self._reading():
            self._check_range(offset, length)
            if not length:
                return b""
            try:
                data = self.fs.cat_file(self.path, start=offset, end=offset + length)
            except OSError as exc:
                raise _named(exc, self.name) from None
            if len(data) != length:
                raise OSError(errno.EIO, f"a read of {length} bytes at {offset} returned {len(data)}: the file "
                              "changed while it was read", self.name)
            self.count(length)
            return data

    def close(self) -> None:
        with self._state:
            self._drain()
            self._closed = True


class FsspecTarget:
    """A save to a file of an fsspec filesystem: a temporary beside it, moved into place at commit (see the
    module docstring for what that guarantees on which store)."""

    atomic = True

    def __init__(self, fs: Any, path: str, name: str | None = None) -> None:
        self.fs = fs
        self.final = path
        self.name = name or fs.unstrip_protocol(path)
        self.path: str | None = fs.unstrip_protocol(path)
        self.order_key: str | None = self.path
        self.tmp = f"{path}{TMP_SUFFIX}{secrets.token_hex(4)}"
        self._file: Any = None
        self._written = False

    def check(self) -> None:
        if self.final.endswith("/") or self.fs.isdir(self.final):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", self.name)

    def leftovers(self) -> list[str]:
        try:
            return sorted(self.fs.unstrip_protocol(p) for p in self.fs.glob(f"{self.final}{TMP_SUFFIX}*"))
        except OSError:
            return []

    def open_sink(self, options: SinkOptions) -> Any:
        parent = self.final.rsplit("/", 1)[0]
        if parent and parent != self.final:
            self.fs.makedirs(parent, exist_ok=True)  # a no-op on object stores; a folder on a filesystem
        self._file = self.fs.open(self.tmp, "wb")
        self._written = True
        return self._file

    def commit(self, before_publish: Callable[[], None] | None = None) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()
        if before_publish is not None:
            before_publish()
        self.fs.mv(self.tmp, self.final)
        self._written = False

    def abort(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001 - the error that ended the save is the one to report
                pass
        if self._written:
            self._written = False
            try:
                self.fs.rm(self.tmp)
            except (OSError, FileNotFoundError):
                pass

    def restate(self, exc: BaseException) -> BaseException:
        return _named(exc, self.name)


class FsspecKeys:
    """Files of an fsspec filesystem by path (nvckpt.io.prefix's KeyStore)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def url(self, key: str) -> str:
        return self.fs.unstrip_protocol(key)

    def get(self, key: str, etag: str | None = None) -> bytes:
        try:
            return self.fs.cat_file(key)
        except OSError as exc:
            raise _named(exc, self.url(key)) from None

    def head(self, key: str) -> tuple[int, str | None] | None:
        try:
            info = self.fs.info(key)
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return int(info["size"]), info.get("ETag") or info.get("etag")

    def put(self, key: str, data: bytes) -> None:
        parent = key.rsplit("/", 1)[0]
        if parent and parent != key:
            self.fs.makedirs(parent, exist_ok=True)
        self.fs.pipe_file(key, data)

    def list(self, prefix: str) -> dict[str, tuple[int, str | None]]:
        try:
            found = self.fs.find(prefix.rstrip("/") or "/", detail=True)
        except FileNotFoundError:
            return {}
        return {p: (int(i["size"]), i.get("ETag") or i.get("etag")) for p, i in found.items()
                if p.startswith(prefix) and i.get("type") != "directory"}

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.fs.rm_file(key)
            except FileNotFoundError:
                pass

    def source(self, key: str, name: str, etag: str | None = None) -> FsspecSource:
        return FsspecSource(self.fs, key, name)

    def target(self, key: str, name: str) -> FsspecTarget:
        return FsspecTarget(self.fs, key, name)


# -- the backend's entry points (nvckpt.io.schemes) ------------------------------------------------

def open_source(url: str, options: dict[str, Any] | None = None) -> FsspecSource:
    fs, path = filesystem(url, options)
    return FsspecSource(fs, path, url)


def open_target(url: str, options: dict[str, Any] | None = None) -> FsspecTarget:
    fs, path = filesystem(url, options)
    return FsspecTarget(fs, path, url)


def open_directory(url: str, options: dict[str, Any] | None = None) -> PrefixDirectory:
    fs, path = filesystem(url, options)
    return PrefixDirectory(FsspecKeys(fs), path, url)


__all__ = ["FsspecSource", "FsspecTarget", "FsspecKeys", "open_source", "open_target", "open_directory"]
