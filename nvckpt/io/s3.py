"""S3 and S3-compatible stores (``s3://bucket/key``), through obstore (Rust object_store).

obstore was chosen by measurement (benchmarks/results/bench_s3.md): about 1 s of
client CPU per GB put against 4 s for boto3, no copy of the object in memory,
and the quickest end to a stalled server.

- Reads (``S3Source``): one suffix GET at open gives the size, the ETag and the
  object's tail (footer and index), so that ``open`` costs one request, two for an
  index larger than the tail.  Every later GET carries ``If-Match`` with that
  ETag: an object replaced since it was opened gives a named error (ESTALE),
  never a mix of old and new bytes.  A large read is cut into ranges fetched
  concurrently; a whole load reads ahead of its decoding (``read_ahead``,
  nvckpt.io.readahead) into a bounded set of reused buffers.
- Writes (``S3Target``): a multipart upload streamed from the save, parts
  (``part_size``, 32 MiB) uploaded concurrently with at most ``parts_in_flight``
  (6) of them buffered, so a save holds at most 224 MiB whatever the checkpoint
  size; completing the upload is the commit, so the object appears only whole
  and the previous one stays readable until then.  A failure or a cancel aborts
  the upload.  An upload that a killed process or a dead server left open is
  reported by the next save to that key and removed by ``nvckpt reap URL``.
- Directories (``nvckpt.dcp.Writer("s3://bucket/run/step100")``):
  nvckpt.io.prefix, published by one object written last.
- A process forked after obstore ran (a DataLoader worker) makes the same
  requests through botocore (nvckpt.io.s3_botocore): obstore's runtime has no
  threads there, and every call on it would wait forever.

Where the endpoint and credentials come from: ``storage_options`` first, then
the environment as boto3 reads it (``AWS_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_PROFILE``), then the shared
credentials and config files (``~/.aws/credentials``, ``~/.aws/config``), then
the instance's role.  Throttling (503 SlowDown), other 5xx answers, resets and
timeouts are retried with exponential backoff and jitter for up to ``timeout``
seconds; a transfer that makes no progress for ``timeout`` seconds (60) fails.
Every error is one line naming the URL and, where the store said one, its code.
A bucket is never created.
"""

from __future__ import annotations

import configparser
import contextlib
import datetime
import errno
import os
import re
import threading
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator

from .._threads import WorkerPool, shared_pool
from .prefix import COMMIT, PrefixDirectory
from .readahead import ReadAhead
from .ranges import Coalescing
from .source import _Counted
from .target import SinkOptions

try:
    import obstore
    from obstore.store import S3Store
except ModuleNotFoundError as exc:  # schemes.backend_for says what to install
    raise ModuleNotFoundError("obstore is not installed (pip install 'nvckpt[s3]')", name="obstore") from exc

MiB = 1 << 20

#: An object store read costs a request (~1 ms and up): ranges up to 1 MiB apart share one, a read stays
#: under 64 MiB (cut into concurrent GETs of ``read_size`` by the source), and a whole load reads its
#: chunks in those groups too.
S3_COALESCING = Coalescing(max_gap=1 * MiB, max_span=64 * MiB, alone_from=64 * MiB, whole_loads=True)


@dataclass(frozen=True)
class S3Options:
    """The ``storage_options`` an s3:// URL takes (each also has the name boto3 or s3fs gives it).

    ``endpoint_url``, ``region``, ``access_key_id``, ``secret_access_key``, ``session_token``, ``profile``:
    where and who (default: the environment and AWS config files, as boto3 finds them).  ``part_size`` and
    ``parts_in_flight``: a save's multipart upload (buffers: ``part_size * (parts_in_flight + 1)``).  S3 allows
    10,000 parts (32 MiB parts: objects up to 312 GiB): a save that may write more uses larger parts, fewer
    in flight, within the same buffers where it can (``part_plan``).  ``read_size`` and ``reads_in_flight``: how
    a large read is cut into concurrent GETs.  ``timeout``: seconds without progress before a transfer
    fails, and how long failed requests are retried.  ``checksum``: the per-part checksum the server checks
    (``crc64nvme``, ``sha256``, or None)."""

    endpoint_url: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    profile: str | None = None
    part_size: int = 32 * MiB
    parts_in_flight: int = 6
    read_size: int = 8 * MiB
    reads_in_flight: int = 8
    timeout: float = 60.0
    checksum: str | None = "crc64nvme"
    extra: dict[str, Any] = field(default_factory=dict)  # obstore S3Config keys, passed as they are

    ALIASES = {"endpoint": "endpoint_url", "region_name": "region", "aws_access_key_id": "access_key_id",
               "key": "access_key_id", "aws_secret_access_key": "secret_access_key", "secret": "secret_access_key",
               "aws_session_token": "session_token", "token": "session_token", "max_concurrency": "parts_in_flight"}

    @classmethod
    def of(cls, options: dict[str, Any] | None) -> "S3Options":
        given: dict[str, Any] = {}
        names = {f.name for f in fields(cls)} - {"extra"}
        for key, value in (options or {}).items():
            name = cls.ALIASES.get(key, key)
            if name == "config" and isinstance(value, dict):
                given["extra"] = dict(value)
            elif name not in names:
                raise ValueError(f"storage option {key!r} is not one an s3:// URL takes ({', '.join(sorted(names))}, "
                                 "or config={...} of obstore S3Config keys)")
            else:
                given[name] = value
        opts = cls(**given)
        for name in ("part_size", "parts_in_flight", "read_size", "reads_in_flight"):
            value = getattr(opts, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"storage option {name} must be a positive int, not {value!r}")
        if opts.part_size < 5 * MiB:
            raise ValueError(f"storage option part_size must be at least 5 MiB (S3's smallest part), not {opts.part_size}")
        if not isinstance(opts.timeout, (int, float)) or isinstance(opts.timeout, bool) or opts.timeout <= 0:
            raise ValueError(f"storage option timeout must be a positive number of seconds, not {opts.timeout!r}")
        if opts.checksum not in (None, "crc64nvme", "sha256"):
            raise ValueError(f"storage option checksum must be 'crc64nvme', 'sha256' or None, not {opts.checksum!r}")
        return opts

    def key(self) -> tuple:
        return tuple((f.name, repr(getattr(self, f.name))) for f in fields(self))


def split_url(url: str) -> tuple[str, str]:
    """(bucket, key) of ``s3://bucket/key`` (ValueError naming the URL if it has no bucket)."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
        raise ValueError(f"{url!r}: {bucket!r} is not an S3 bucket name (3 to 63 lower-case letters, digits, '.' "
                         "and '-'); an s3:// URL is s3://BUCKET/KEY")
    return bucket, key


# -- configuration: storage options, the environment, AWS config files ------------------------------

def _profile_settings(profile: str | None) -> dict[str, str]:
    """What the shared credentials and config files say for ``profile`` (AWS_PROFILE, else "default")."""
    profile = profile or os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE") or "default"
    out: dict[str, str] = {}
    home = os.path.expanduser("~")
    sources = ((os.environ.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
                "default" if profile == "default" else f"profile {profile}"),
               (os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"), profile))
    for path, section in sources:
        parser = configparser.RawConfigParser()
        try:
            parser.read(path)
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
        if parser.has_section(section):
            out.update({k: v.strip() for k, v in parser.items(section) if v.strip()})
    return out


def _store_config(opts: S3Options, bucket: str) -> dict[str, Any]:
    """obstore's S3Config for ``bucket``: the options, then what boto3 would find that obstore does not read
    itself (the AWS config files; it reads the environment and the instance's role)."""
    env = os.environ
    config: dict[str, Any] = {}
    files = {} if env.get("AWS_ACCESS_KEY_ID") and opts.profile is None else _profile_settings(opts.profile)
    endpoint = (opts.endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
                or files.get("endpoint_url"))
    region = opts.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or files.get("region")
    key_id = opts.access_key_id or env.get("AWS_ACCESS_KEY_ID") or files.get("aws_access_key_id")
    secret = opts.secret_access_key or env.get("AWS_SECRET_ACCESS_KEY") or files.get("aws_secret_access_key")
    token = opts.session_token or env.get("AWS_SESSION_TOKEN") or files.get("aws_session_token")
    if endpoint:
        config["endpoint"] = endpoint
    if region:
        config["region"] = region
    if key_id and secret:
        config["access_key_id"], config["secret_access_key"] = key_id, secret
        if token:
            config["token"] = token
    if opts.checksum:
        config["checksum_algorithm"] = opts.checksum
        config["unsigned_payload"] = True  # the checksum covers the body: not hashed a second time to sign it
    config.update(opts.extra)
    return config


_STORES: dict[tuple, Any] = {}
_STORES_LOCK = threading.Lock()
#: What makes the requests: obstore, unless this process was forked after obstore ran (in it or in a parent),
#: whose runtime a fork leaves without its threads: then botocore (nvckpt.io.s3_botocore).
_ops: Any = obstore
_obstore_ran = False


_forks = 0  # forks since this process began (a store made before one is the parent's)


class _HasStore:
    """An object of one bucket whose ``store`` is this process's own: made again after a fork."""

    opts: S3Options
    _bucket: str

    def _use_bucket(self, bucket: str) -> None:
        self._bucket = bucket
        self._store, self._store_forks = store_for(bucket, self.opts), _forks

    @property
    def store(self) -> Any:
        if self._store_forks != _forks:  # a source or directory opened in the parent, used in a forked child
            self._store, self._store_forks = store_for(self._bucket, self.opts), _forks
        return self._store


def _after_fork_in_child() -> None:
    global _ops, _STORES_LOCK, _forks
    _forks += 1
    _STORES_LOCK = threading.Lock()
    _STORES.clear()  # the parent's stores: their connections and runtime stayed behind
    if _obstore_ran:
        from . import s3_botocore

        _ops = s3_botocore


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def store_for(bucket: str, opts: S3Options) -> Any:
    """One obstore S3Store per bucket and options (its connection pool is shared by every read and write)."""
    config = _store_config(opts, bucket)
    cache_key = (bucket, opts.key(), tuple(sorted((k, repr(v)) for k, v in config.items())),
                 tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    global _obstore_ran
    with _STORES_LOCK:
        store = _STORES.get(cache_key)
        if store is None and _ops is not obstore:
            from .s3_botocore import BotoStore

            store = _STORES[cache_key] = BotoStore(bucket, _control_client(
                bucket, opts, connections=opts.reads_in_flight + opts.parts_in_flight + 2))
        if store is None:
            _obstore_ran = True
            endpoint = str(config.get("endpoint") or "")
            timeout = datetime.timedelta(seconds=opts.timeout)
            client = {"allow_http": endpoint.startswith("http://") or os.environ.get("AWS_ALLOW_HTTP", "") == "true",
                      "connect_timeout": datetime.timedelta(seconds=min(opts.timeout, 10.0)),
                      # no byte for `timeout` seconds fails a read; a request (a part) may take twice that
                      "read_timeout": timeout, "timeout": 2 * timeout}
            retry = {"max_retries": 10, "retry_timeout": timeout,
                     "backoff": {"init_backoff": datetime.timedelta(milliseconds=100),
                                 "max_backoff": datetime.timedelta(seconds=min(15.0, opts.timeout / 4)), "base": 2}}
            try:
                store = S3Store(bucket, config=config, client_options=client, retry_config=retry)
            except Exception as exc:  # obstore's configuration errors (a malformed endpoint, an unknown key)
                raise ValueError(f"s3://{bucket}: the S3 configuration is not usable: {_first_line(str(exc))}") from None
            _STORES[cache_key] = store
        return store


# -- errors: one line, the URL and what the store said ----------------------------------------------

_CODE = re.compile(r"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_STATUS = re.compile(r"status code: (\d{3})")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def s3_error(exc: BaseException, url: str, action: str, opts: S3Options | None = None) -> BaseException:
    """An obstore error (or a timeout) as one OSError naming ``url``: FileNotFoundError (no such key or
    bucket), PermissionError (refused credentials), TimeoutError (no progress), ESTALE (the object was
    replaced since it was opened), else EIO; the S3 error code and HTTP status where the store gave them."""
    if (type(exc).__module__ or "").startswith("botocore"):
        return _boto_error(exc, url, action, opts)
    if not _is_store_error(exc):
        return exc
    text = str(exc)
    code = _CODE.search(text)
    message = _MESSAGE.search(text)
    status = _STATUS.search(text)
    code_s = code.group(1) if code else None
    bucket, key = split_url(url) if url.startswith("s3://") else (None, url)
    where = f" (bucket {bucket!r}, key {key!r})" if bucket else ""
    said = f"{code_s}: {message.group(1).strip() if message else ''}".rstrip(": ") if code_s else None
    status_s = f"HTTP {status.group(1)}" if status else None
    name = type(exc).__name__
    if name == "PreconditionError" or code_s == "PreconditionFailed":
        return OSError(errno.ESTALE, f"{action}: the object was replaced since it was opened (ETag changed; "
                       f"{said or 'PreconditionFailed'}){where}: open it again to read the new one", url)
    if isinstance(exc, FileNotFoundError) or name == "NotFoundError" or code_s in ("NoSuchKey", "NoSuchBucket"):
        what = said or "NoSuchKey: not found"
        if code_s == "NoSuchBucket":
            what += " (a bucket is never created implicitly: create it first)"
        return FileNotFoundError(errno.ENOENT, f"{action}: {what}{where}", url)
    if name in ("PermissionDeniedError", "UnauthenticatedError") or code_s in (
            "AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "ExpiredToken", "InvalidToken"):
        return PermissionError(errno.EACCES, f"{action}: {said or name} (check the credentials: AWS_ACCESS_KEY_ID, "
                               f"AWS_PROFILE, storage_options){where}", url)
    lowered = text.lower()
    limit = f"{opts.timeout:g} s" if opts is not None else "the timeout"
    took = re.search(r" in ([\d.]+)(s|ms)\b", text)
    elapsed = (float(took.group(1)) / (1000 if took.group(2) == "ms" else 1)) if took else 0.0
    stalled = opts is not None and "error sending request" in lowered and elapsed >= 0.9 * opts.timeout
    if "timed out" in lowered or "timeout" in lowered or "deadline" in lowered or stalled:
        return TimeoutError(errno.ETIMEDOUT, f"{action}: no progress for {limit} (the server is stalled or "
                            f"unreachable; storage option timeout=){where}", url)
    detail = said or status_s or _cause(text)
    if status_s and said:
        detail = f"{said} ({status_s})"
    retries = re.search(r"after (\d+) retries", text)
    if retries:
        detail += f", after {retries.group(1)} retries within {limit}"
    return OSError(errno.EIO, f"{action}: {detail}{where}", url)


def _cause(text: str) -> str:
    """The innermost reason an obstore error gives (a refused connection, a reset), one line."""
    first = _first_line(text)
    for pattern in (r"(Connection refused[^,)\n]*)", r"(connection reset[^,)\n]*)", r"(error sending request[^\n]*)",
                    r"(connection closed[^\n]*)", r"(dns error[^\n]*)"):
        found = re.search(pattern, text, re.IGNORECASE)
        if found:
            return found.group(1).strip()[:200]
    return first[:300]


def _is_store_error(exc: BaseException) -> bool:
    """An error obstore raised (its own classes, or builtin ones such as FileNotFoundError with its request
    text), not one nvckpt raised itself."""
    if (type(exc).__module__ or "").startswith("obstore"):
        return True
    return isinstance(exc, OSError) and getattr(exc, "filename", None) is None and (
        "Error performing" in str(exc) or "S3 error" in str(exc) or isinstance(exc, TimeoutError))


@contextlib.contextmanager
def _translated(url: str, action: str, opts: S3Options | None) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        translated = s3_error(exc, url, action, opts)
        if translated is exc:
            raise
        raise translated from None


# -- the objects of one bucket -------------------------------------------------------------------

class S3Bucket(_HasStore):
    """The objects of one bucket (nvckpt.io.prefix's KeyStore)."""

    def __init__(self, bucket: str, opts: S3Options) -> None:
        self.bucket = bucket
        self.opts = opts
        self._use_bucket(bucket)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def get(self, key: str, etag: str | None = None) -> bytes:
        with _translated(self.url(key), "GET", self.opts):
            options = {"if_match": etag} if etag else None
            return bytes(_ops.get(self.store, key, options=options).bytes())

    def head(self, key: str) -> tuple[int, str | None] | None:
        try:
            with _translated(self.url(key), "HEAD", self.opts):
                meta = _ops.head(self.store, key)
        except FileNotFoundError as exc:
            if "NoSuchBucket" in str(exc):
                raise
            return None
        return int(meta["size"]), meta.get("e_tag")

    def put(self, key: str, data: bytes) -> None:
        with _translated(self.url(key), "PUT", self.opts):
            _ops.put(self.store, key, data, use_multipart=False)

    def list(self, prefix: str) -> dict[str, tuple[int, str | None]]:
        out: dict[str, tuple[int, str | None]] = {}
        with _translated(self.url(prefix), "LIST", self.opts):
            for batch in _ops.list(self.store, prefix=prefix or None, chunk_size=1000):
                for meta in batch:
                    if meta["path"].startswith(prefix):  # object_store lists by path segment: "a/b" matches "a/bc"
                        out[meta["path"]] = (int(meta["size"]), meta.get("e_tag"))
        return out

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            with _translated(self.url(keys[i]), "DELETE", self.opts):
                _ops.delete(self.store, keys[i: i + 1000])

    def source(self, key: str, name: str, etag: str | None = None) -> "S3Source":
        return S3Source(self.url(key), self.opts, etag=etag, name=name)

    def target(self, key: str, name: str) -> "S3Target":
        return S3Target(self.url(key), self.opts, name=name)


# -- reads -----------------------------------------------------------------------------------------

_TAIL = 1 * MiB  # what open fetches of the object's end: the footer and (most) indexes
_STREAM_CHUNK = 1 * MiB  # a streamed GET's body comes in pieces of this size (small buffers, reused)


def _pool(workers: int) -> WorkerPool:
    """Threads that fetch the ranges of large reads concurrently (obstore releases the GIL while it waits):
    the process's own, apart from the decode threads that wait for them (a forked child gets new ones)."""
    return shared_pool("nvckpt-s3", workers)


class S3Source(_Counted, _HasStore):
    """One object read by position, pinned to the ETag it had when opened (see the module docstring).
    ``requests`` counts the GETs it made."""

    exact_size = True
    coalescing = S3_COALESCING

    def __init__(self, url: str, opts: S3Options | None = None, *, etag: str | None = None,
                 name: str | None = None) -> None:
        super().__init__()
        self.name = name or url  # a DCP rank file: named as published, not by its generation's key
        self.opts = opts or S3Options()
        self.coalescing = S3_COALESCING.with_(load_span=self.opts.read_size)  # a load's runs fit its buffers
        bucket, self.key = split_url(url)
        if not self.key or self.key.endswith("/"):
            raise IsADirectoryError(errno.EISDIR, "names a prefix, not an object (an nvckpt file is one object)", url)
        self._use_bucket(bucket)
        self.requests = 0
        self._closed = False
        with _translated(url, "GET", self.opts):
            options: dict[str, Any] = {"range": {"suffix": _TAIL}}
            if etag:
                options["if_match"] = etag
            try:
                got = _ops.get(self.store, self.key, options=options)
                tail = bytes(got.bytes())
            except Exception as exc:  # an empty object has no suffix to give (416): its metadata instead
                if "416" not in str(exc) and "InvalidRange" not in str(exc):
                    raise
                got, tail = _ops.head(self.store, self.key), b""
                if etag and got.get("e_tag") != etag:
                    raise OSError(errno.ESTALE, "GET: the object was replaced since it was listed (ETag changed): "
                                  "open it again to read the new one", url) from None
            self.requests += 1
        meta = got.meta if hasattr(got, "meta") else got
        self.size = int(meta["size"])
        self.etag: str | None = meta.get("e_tag")
        self._tail = tail
        self._tail_start = self.size - len(tail)

    @property
    def closed(self) -> bool:
        return self._closed

    def _get(self, start: int, end: int) -> Any:
        """Bytes [start, end) of the pinned object: one ranged GET with If-Match."""
        options: dict[str, Any] = {"range": (start, end)}
        if self.etag:
            options["if_match"] = self.etag
        with self._lock:
            self.requests += 1
        with _translated(self.name, f"GET bytes {start}-{end - 1}", self.opts):
            data = _ops.get(self.store, self.key, options=options).bytes()
        if len(data) != end - start:
            raise OSError(errno.EIO, f"GET bytes {start}-{end - 1}: the store returned {len(data)} bytes, not "
                          f"{end - start}", self.name)
        return data

    def _fill(self, offset: int, view: memoryview) -> None:
        length = view.nbytes
        if offset >= self._tail_start:  # from what open fetched
            view[:] = self._tail[offset - self._tail_start: offset - self._tail_start + length]
            return
        step = self.opts.read_size
        if length <= step:
            view[:] = self._get(offset, offset + length)
            return
        pieces = [(i, min(i + step, length)) for i in range(0, length, step)]

        def fetch(piece: tuple[int, int]) -> None:
            a, b = piece
            view[a:b] = self._get(offset + a, offset + b)

        pool = _pool(self.opts.reads_in_flight)
        futures = [pool.submit(fetch, p) for p in pieces[1:]]
        try:
            fetch(pieces[0])
        finally:
            errors = []
            for f in futures:
                try:
                    f.result()
                except BaseException as exc:  # noqa: BLE001 - the first is raised
                    errors.append(exc)
            if errors:
                raise errors[0]

    def read_ahead(self, ranges: list[tuple[int, int]]) -> ReadAhead:
        """A whole load's ranges fetched ahead of its decoding (nvckpt.io.readahead): GETs of up to
        ``read_size`` bytes, ``reads_in_flight`` at a time, into ``2 * reads_in_flight`` buffers of
        ``read_size`` bytes reused for the whole load."""
        opts = self.opts
        for offset, length in ranges:
            self._check_range(offset, length)
        return ReadAhead(self._get_into, _pool(opts.reads_in_flight), ranges, piece=opts.read_size,
                         slots=2 * opts.reads_in_flight, max_gap=self.coalescing.max_gap)

    def _get_into(self, start: int, end: int, view: memoryview) -> None:
        """Bytes [start, end) of the pinned object streamed into ``view``: one ranged GET with If-Match, its
        body copied as it arrives (no buffer of the whole response allocated per request)."""
        with self._reading():
            if start >= self._tail_start:
                view[:] = self._tail[start - self._tail_start: end - self._tail_start]
                self.count(end - start)
                return
            options: dict[str, Any] = {"range": (start, end)}
            if self.etag:
                options["if_match"] = self.etag
            with self._lock:
                self.requests += 1
            at = 0
            with _translated(self.name, f"GET bytes {start}-{end - 1}", self.opts):
                for piece in _ops.get(self.store, self.key, options=options).stream(min_chunk_size=_STREAM_CHUNK):
                    n = len(piece)
                    if at + n > view.nbytes:
                        break
                    view[at: at + n] = piece
                    at += n
            if at != end - start:
                raise OSError(errno.EIO, f"GET bytes {start}-{end - 1}: the store returned {at} bytes or more, "
                              f"not {end - start}", self.name)
            self.count(end - start)

    def read(self, offset: int, length: int) -> bytes:
        with self._reading():
            self._check_range(offset, length)
            if offset >= self._tail_start:
                data = self._tail[offset - self._tail_start: offset - self._tail_start + length]
            elif length <= self.opts.read_size:
                data = bytes(self._get(offset, offset + length)) if length else b""
            else:
                data = bytearray(length)  # filled by concurrent GETs (a bytes-like result: no second copy)
                self._fill(offset, memoryview(data))
            self.count(length)
            return data

    def read_into(self, offset: int, buf: Any) -> None:
        view = memoryview(buf).cast("B")
        with self._reading():
            self._check_range(offset, view.nbytes)
            if view.nbytes:
                self._fill(offset, view)
            self.count(view.nbytes)

    def close(self) -> None:
        with self._state:
            self._drain()
            self._closed = True
            self._tail = b""


# -- writes ----------------------------------------------------------------------------------------

MAX_PARTS = 10_000  # S3's limit on the parts of one multipart upload
_PART_UNIT = 1 * MiB


def part_plan(opts: S3Options, expected_bytes: int | None) -> tuple[int, int]:
    """(part size, parts in flight) of an upload of at most ``expected_bytes``: the configured ones where
    they reach that size within MAX_PARTS (a tenth of the parts left spare), else parts large enough, and as
    many in flight as the configured buffers (``part_size * (parts_in_flight + 1)``) hold, at least 2."""
    part, in_flight = opts.part_size, opts.parts_in_flight
    if expected_bytes is None or expected_bytes <= part * (MAX_PARTS * 9 // 10):
        return part, in_flight
    need = -(-expected_bytes // (MAX_PARTS * 9 // 10))
    grown = -(-need // _PART_UNIT) * _PART_UNIT
    buffers = part * (in_flight + 1)
    return grown, max(2, buffers // grown - 1)


class S3Sink:
    """The stream a save writes: obstore's buffered multipart writer (parts uploaded as they fill)."""

    def __init__(self, target: "S3Target", expected_bytes: int | None = None) -> None:
        self.target = target
        self.part_size, self.parts_in_flight = part_plan(target.opts, expected_bytes)
        self.writer = _ops.open_writer(target.store, target.key, buffer_size=self.part_size,
                                       max_concurrency=self.parts_in_flight)
        self.written = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n:
            with _translated(self.target.name, "PUT (multipart upload)", self.target.opts):
                # obstore keeps a reference to what it is given until its part is sent, and the save reuses
                # its buffers: it gets a copy
                self.writer.write(bytes(data))
            self.written += n
        return n


class S3Target(_HasStore):
    """A save's object (see the module docstring): atomic, completed at commit, aborted otherwise."""

    atomic = True

    def __init__(self, url: str, opts: S3Options | None = None, *, name: str | None = None) -> None:
        self.opts = opts or S3Options()
        self.bucket, self.key = split_url(url)
        if not self.key or self.key.endswith("/"):
            raise IsADirectoryError(errno.EISDIR, "names a prefix, not an object: give the checkpoint's key "
                                    "(s3://BUCKET/PATH/NAME.nvckpt)", url)
        self.url = url
        self.name = name or url  # errors name the file as the caller knows it (a DCP rank file: once published)
        self.path: str | None = url
        self.order_key: str | None = url
        self._use_bucket(self.bucket)
        self._sink: S3Sink | None = None
        self._done = False

    def check(self) -> None:
        """The bucket exists and the credentials may list it (one request): a save fails at once, not at its end."""
        with _translated(self.url, "LIST (checking the bucket)", self.opts):
            next(iter(_ops.list(self.store, prefix=self.key, chunk_size=1)), None)

    def leftovers(self) -> list[str]:
        """Multipart uploads to this key left open by saves that did not finish (a killed process, a server
        that died), as "upload ID (started TIME)"; nothing where boto3 is not installed to list them."""
        try:
            uploads = open_uploads(self.url, self.opts, exact=True)
        except (ModuleNotFoundError, OSError):
            return []  # a report only: a save is not failed for it
        return [f"upload {u['UploadId']} (started {u['Initiated']:%Y-%m-%d %H:%M:%S %Z})" for u in uploads]

    def leftover_advice(self) -> str:
        return f"`nvckpt reap {self.url}` aborts them (they hold storage until then)"

    def open_sink(self, options: SinkOptions) -> S3Sink:
        with _translated(self.url, "PUT", self.opts):
            self._sink = S3Sink(self, options.expected_bytes)
        return self._sink

    def commit(self, before_publish: Callable[[], None] | None = None) -> None:
        assert self._sink is not None, "commit before open_sink"
        if before_publish is not None:
            before_publish()
        writer = self._sink.writer
        with _translated(self.url, "PUT (completing the multipart upload)", self.opts):
            writer.close()
        self._done = True

    def abort(self) -> None:
        """Abort the upload (no part of it stays); the object at the key is as it was."""
        sink, self._sink = self._sink, None
        if sink is None or self._done:
            return
        with contextlib.suppress(Exception):  # the error that ended the save is the one to report
            if not sink.writer.closed():
                sink.writer.__exit__(_Aborted, _Aborted(), None)  # obstore aborts the multipart upload on an error

    def restate(self, exc: BaseException) -> BaseException:
        translated = s3_error(exc, self.url, "PUT", self.opts)
        if isinstance(translated, OSError) and self.name != self.url:
            translated = type(translated)(translated.errno, translated.strerror, self.name)
        return translated


class _Aborted(Exception):
    """The save stopped: the writer aborts its multipart upload."""


# -- uploads a crash left open ----------------------------------------------------------------

def _control_client(bucket: str, opts: S3Options, connections: int = 10) -> Any:
    """A botocore client for what obstore cannot do (list and abort multipart uploads, every request in a
    process forked after obstore ran), configured as the store is."""
    try:
        import boto3
        from botocore.config import Config
    except ModuleNotFoundError:
        raise ModuleNotFoundError("listing and aborting open multipart uploads, and S3 requests in a process "
                                  "forked after using S3, need boto3 (pip install 'nvckpt[s3]')",
                                  name="boto3") from None
    config = _store_config(opts, bucket)
    session = boto3.session.Session(profile_name=opts.profile) if opts.profile else boto3.session.Session()
    return session.client(
        "s3", endpoint_url=config.get("endpoint"), region_name=config.get("region"),
        aws_access_key_id=config.get("access_key_id"), aws_secret_access_key=config.get("secret_access_key"),
        aws_session_token=config.get("token"),
        config=Config(s3={"addressing_style": "path" if config.get("endpoint") else "auto"},
                      connect_timeout=min(opts.timeout, 10.0), read_timeout=opts.timeout,
                      retries={"mode": "standard", "total_max_attempts": 5}, max_pool_connections=connections))


def open_uploads(url: str, opts: S3Options | None = None, *, exact: bool = False) -> list[dict[str, Any]]:
    """The multipart uploads open under ``url`` (a key, or a prefix; ``exact``: that key only)."""
    opts = opts or S3Options()
    bucket, key = split_url(url)
    client = _control_client(bucket, opts)
    import botocore.exceptions

    out: list[dict[str, Any]] = []
    kw: dict[str, Any] = {"Bucket": bucket, "Prefix": key}
    try:
        while True:
            page = client.list_multipart_uploads(**kw)
            out += [u for u in page.get("Uploads", []) if not exact or u["Key"] == key]
            if not page.get("IsTruncated"):
                return out
            kw["KeyMarker"], kw["UploadIdMarker"] = page["NextKeyMarker"], page["NextUploadIdMarker"]
    except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
        raise _boto_error(exc, url, "LIST multipart uploads") from None


def reap(url: str, storage_options: dict[str, Any] | None = None, *, older_than: float = 0.0,
         dry_run: bool = False) -> list[dict[str, Any]]:
    """Abort the multipart uploads open under ``url`` (a key or a prefix) started more than ``older_than``
    seconds ago: what saves that did not finish left (their parts hold storage until aborted).  Returns
    those uploads (with "Key", "UploadId", "Initiated"); ``dry_run``: only list them."""
    opts = S3Options.of(storage_options)
    bucket, _ = split_url(url)
    now = datetime.datetime.now(datetime.timezone.utc)
    uploads = [u for u in open_uploads(url, opts)
               if (now - u["Initiated"].astimezone(datetime.timezone.utc)).total_seconds() >= older_than]
    if dry_run or not uploads:
        return uploads
    client = _control_client(bucket, opts)
    import botocore.exceptions

    for u in uploads:
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
        except client.exceptions.NoSuchUpload:
            pass  # completed or aborted meanwhile
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise _boto_error(exc, f"s3://{bucket}/{u['Key']}", "abort multipart upload") from None
    return uploads


def _boto_error(exc: BaseException, url: str, action: str, opts: S3Options | None = None) -> OSError:
    bucket, key = split_url(url) if url.startswith("s3://") else (None, url)
    where = f" (bucket {bucket!r}, key {key!r})" if bucket else ""
    response = getattr(exc, "response", None) or {}
    err = response.get("Error", {})
    code, message = err.get("Code"), err.get("Message", "")
    if code in ("PreconditionFailed", "412"):
        return OSError(errno.ESTALE, f"{action}: the object was replaced since it was opened (ETag changed; "
                       f"PreconditionFailed){where}: open it again to read the new one", url)
    if code in ("NoSuchBucket", "NoSuchKey", "404", "NotFound"):
        what = f"{code}: {message}" if code in ("NoSuchBucket", "NoSuchKey") else "NoSuchKey: not found"
        if code == "NoSuchBucket":
            what += " (a bucket is never created implicitly: create it first)"
        return FileNotFoundError(errno.ENOENT, f"{action}: {what}{where}", url)
    if code in ("AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "403"):
        return PermissionError(errno.EACCES, f"{action}: {code}: {message} (check the credentials){where}", url)
    if "Timeout" in type(exc).__name__:
        limit = f"{opts.timeout:g} s" if opts is not None else "the timeout"
        return TimeoutError(errno.ETIMEDOUT, f"{action}: no progress for {limit} (the server is stalled or "
                            f"unreachable; storage option timeout=){where}", url)
    return OSError(errno.EIO, f"{action}: {code + ': ' + message if code else _first_line(str(exc))}{where}", url)


# -- the backend's entry points (nvckpt.io.schemes) ------------------------------------------------

def open_source(url: str, options: dict[str, Any] | None = None) -> S3Source:
    opts = S3Options.of(options)
    try:
        return S3Source(url, opts)
    except FileNotFoundError as exc:
        hint = _published_directory_hint(url, opts)
        if hint:
            raise FileNotFoundError(exc.errno, f"{exc.strerror}; {hint}", exc.filename) from None
        raise


def _published_directory_hint(url: str, opts: S3Options) -> str | None:
    """What to say of a missing object whose prefix is a published sharded checkpoint (a DCP rank file asked
    for by its name: its bytes live under the save's generation, read through the directory)."""
    bucket, key = split_url(url)
    parent = key.rsplit("/", 1)[0] if "/" in key else ""
    if not parent:
        return None
    try:
        published = S3Bucket(bucket, opts).head(f"{parent}/{COMMIT}") is not None
    except OSError:
        return None
    if not published:
        return None
    directory = f"s3://{bucket}/{parent}"
    return (f"{directory} is a sharded checkpoint published by its commit object: its files are read through "
            f"it (nvckpt.dcp.Reader({directory!r}), `nvckpt ls {directory}`, `nvckpt merge {directory} OUT`)")


def open_target(url: str, options: dict[str, Any] | None = None) -> S3Target:
    return S3Target(url, S3Options.of(options))


def open_directory(url: str, options: dict[str, Any] | None = None) -> PrefixDirectory:
    bucket, key = split_url(url)
    return PrefixDirectory(S3Bucket(bucket, S3Options.of(options)), key, url)


__all__ = ["S3Options", "S3Source", "S3Target", "S3Bucket", "open_source", "open_target", "open_directory",
           "open_uploads", "reap", "split_url", "s3_error"]
