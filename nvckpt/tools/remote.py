"""Files at URLs (s3://, fsspec) for the CLI's file tools (convert, recover), which work on local files.

A URL source is fetched to a temporary folder first (concurrent ranged GETs), and a URL destination is
written there, then uploaded whole through the URL's Target (an S3 multipart upload completed only at the
end: the object appears complete or not at all).  The temporary folder is removed either way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

from ..io.schemes import url_scheme
from ..io.source import open_source
from ..io.target import SinkOptions, open_target

_PIECE = 64 << 20


def is_url(path: str | os.PathLike) -> bool:
    return isinstance(path, str) and url_scheme(path) not in (None, "file")


def exists(url: str) -> bool:
    """An object is at ``url``."""
    try:
        open_source(url).close()
    except (FileNotFoundError, IsADirectoryError):
        return False
    return True


def _local_name(url: str, folder: str) -> str:
    return os.path.join(folder, url.rstrip("/").rsplit("/", 1)[-1] or "object")


def fetch(url: str, local: str) -> None:
    """Copy the object at ``url`` into the local file ``local``."""
    source = open_source(url)
    try:
        buf = bytearray(min(_PIECE, max(source.size, 1)))
        with open(local, "wb") as f:
            for offset in range(0, source.size, _PIECE):
                view = memoryview(buf)[: min(_PIECE, source.size - offset)]
                source.read_into(offset, view)
                f.write(view)
    finally:
        source.close()


def upload(local: str, url: str) -> None:
    """Write the local file ``local`` as the object at ``url``, complete or not at all."""
    target = open_target(url)
    try:
        target.check()
        sink = target.open_sink(SinkOptions(direct=False))
        with open(local, "rb") as f:
            while True:
                piece = f.read(_PIECE)
                if not piece:
                    break
                sink.write(piece)
        target.commit()
    except BaseException as exc:
        target.abort()
        restated = target.restate(exc)
        if restated is not exc:
            raise restated from None
        raise


@contextlib.contextmanager
def local_files(src: str, dst: str, *, keep_src: bool = False, keep_dst: bool = False) -> Iterator[tuple[str, str]]:
    """(src, dst) as local paths: a URL source fetched, a URL destination uploaded when the block succeeds;
    ``keep_src`` / ``keep_dst``: that one is given as it is (a DCP directory, read or written where it is)."""
    fetched, uploaded = is_url(src) and not keep_src, is_url(dst) and not keep_dst
    if not fetched and not uploaded:
        yield src, dst
        return
    folder = tempfile.mkdtemp(prefix="nvckpt-remote-")
    try:
        local_src, local_dst = src, dst
        if fetched:
            local_src = _local_name(src, os.path.join(folder, "src"))
            os.mkdir(os.path.dirname(local_src))
            fetch(src, local_src)
        if uploaded:
            local_dst = _local_name(dst, os.path.join(folder, "dst"))
            os.mkdir(os.path.dirname(local_dst))
        yield local_src, local_dst
        if uploaded:
            upload(local_dst, dst)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


__all__ = ["is_url", "exists", "fetch", "upload", "local_files"]
