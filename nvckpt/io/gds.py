"""Reads of a local checkpoint file straight into device memory through KvikIO (``kvikio-cu12``, optional:
``pip install nvckpt[gds]``): GPUDirect Storage where cuFile runs on this host, else KvikIO's
compatibility mode (POSIX reads through its own pinned bounce buffers).

The GPU loader (``nvckpt.engines.gpu.decode``) takes these reads instead of its pinned host buffers when
``GpuLoadOptions.read_path`` asks for them ("kvikio"), or, with "auto", where KvikIO reports GPUDirect
Storage (its compatibility mode is what the loader's own O_DIRECT reads into pinned buffers already do).
KvikIO is imported only here, when a load first asks for it.  Torch-free: buffers are anything with
``__cuda_array_interface__`` (a CUDA tensor)."""

from __future__ import annotations

import errno
import importlib
import os
import stat
import threading
from typing import Any

from ..errors import TruncatedError, UnsupportedFeatureError
from .source import LocalFile

GDS = "gds"
COMPAT = "kvikio-compat"

_kvikio: Any = None
_kvikio_lock = threading.Lock()


def kvikio_module(required: bool) -> Any:
    """KvikIO, imported once; None where it is not installed (an UnsupportedFeatureError if ``required``)."""
    global _kvikio
    with _kvikio_lock:
        if _kvikio is None:
            try:
                import kvikio  # noqa: PLC0415 - optional, and it loads libcufile
                import kvikio.defaults  # noqa: F401,PLC0415
            except Exception as exc:  # noqa: BLE001 - ImportError, or libcufile / libcuda not found (RuntimeError)
                if required:
                    raise UnsupportedFeatureError(
                        f"read_path='kvikio' needs KvikIO, which does not import here ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:160]}): pip install kvikio-cu12 (nvckpt[gds]), or use "
                        "read_path='auto'") from None
                return None
            _kvikio = kvikio
        return _kvikio


def kvikio_mode(kvikio: Any) -> str:
    """"gds" where KvikIO runs cuFile and cuFile reports GPUDirect Storage (the nvidia-fs driver), else
    "kvikio-compat": POSIX reads through bounce buffers, KvikIO's or cuFile's own compatibility mode."""
    try:
        compat = bool(kvikio.defaults.is_compat_mode_preferred())
    except AttributeError:  # KvikIO before 24.08: compat_mode() is a bool
        compat = bool(kvikio.defaults.compat_mode())
    if compat:
        return COMPAT
    try:
        driver = getattr(kvikio, "cufile_driver", None)
        if driver is None:
            driver = importlib.import_module(kvikio.__name__ + ".cufile_driver")  # opens the cuFile driver
        return GDS if driver.get("is_gds_available") else COMPAT
    except Exception:  # noqa: BLE001 - a cuFile too old to say, or a driver that does not open
        return COMPAT


KVIKIO_THREADS = 16  # KvikIO's thread pool (default 1) splits each read into 4 MiB tasks: the loader's reads
# in flight (read_threads) need several threads each to keep a fast NVMe or RAID busy


def _enough_threads(kvikio: Any) -> None:
    """KvikIO's pool of threads raised to KVIKIO_THREADS, unless KVIKIO_NTHREADS says how many (process-wide)."""
    if "KVIKIO_NTHREADS" in os.environ:
        return
    try:
        if int(kvikio.defaults.get("num_threads")) < KVIKIO_THREADS:
            kvikio.defaults.set("num_threads", KVIKIO_THREADS)
    except (AttributeError, TypeError, ValueError):  # an older KvikIO: num_threads_reset(n)
        reset = getattr(kvikio.defaults, "num_threads_reset", None)
        if reset is not None:
            reset(KVIKIO_THREADS)


class KvikioReads:
    """RangeReads of a LocalFile into device buffers through a KvikIO ``CuFile``: ``read`` fills the
    buffer before it returns; ``close()`` counts the bytes in the source's ``bytes_read``.

    The file is reopened through ``/proc/self/fd`` (the file the source has open, as DirectReads does)."""

    def __init__(self, source: LocalFile, kvikio: Any) -> None:
        self.source = source
        self.mode = kvikio_mode(kvikio)
        self.bytes_read = 0
        self.direct_reads = 0
        self._lock = threading.Lock()
        fd = source.fd
        path = f"/proc/self/fd/{fd}" if fd is not None and os.path.exists(f"/proc/self/fd/{fd}") else source.name
        self._file: Any = kvikio.CuFile(path, "r")
        _enough_threads(kvikio)

    def read(self, start: int, length: int, need: int, buf: Any) -> Any:
        """At least ``need`` bytes from ``start`` into the device buffer ``buf`` (``length`` asked, cut at
        the end of the file): a short read is a TruncatedError, an I/O error names the file and offset."""
        n = min(length, self.source.size - start)
        try:
            got = self._file.pread(buf[:n] if n < len(buf) else buf, n, start).get()
        except OSError as exc:
            raise OSError(exc.errno or errno.EIO, f"{exc.strerror or exc} (KvikIO read of {n} bytes at {start})",
                          self.source.name) from None
        except RuntimeError as exc:  # KvikIO's C++ errors (cuFile, CUDA) come as RuntimeError
            raise OSError(errno.EIO, f"KvikIO read of {n} bytes at {start} failed: {str(exc).splitlines()[0][:200]}",
                          self.source.name) from None
        if got < need:
            raise TruncatedError(f"file ended while reading {need} bytes (KvikIO read {got})", path=self.source.name,
                                 offset=start + got)
        with self._lock:
            self.bytes_read += got
            self.direct_reads += 1
        return buf

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()
        self.source.count(self.bytes_read)
        self.bytes_read = 0


def open_kvikio_reads(source: Any, *, required: bool) -> KvikioReads | None:
    """KvikIO reads of ``source`` where it is an open local file and KvikIO imports; else None (or, if
    ``required``, an UnsupportedFeatureError saying why)."""
    if not isinstance(source, LocalFile) or source.fd is None or not stat.S_ISREG(os.fstat(source.fd).st_mode):
        if required:
            raise UnsupportedFeatureError(f"read_path='kvikio' reads local files only, not {source.name!r}; "
                                          "use read_path='auto'")
        return None
    kvikio = kvikio_module(required)
    return None if kvikio is None else KvikioReads(source, kvikio)


__all__ = ["KvikioReads", "open_kvikio_reads", "kvikio_module", "kvikio_mode", "GDS", "COMPAT"]
