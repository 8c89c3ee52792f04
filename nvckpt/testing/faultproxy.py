"""An HTTP/1.1 proxy on loopback that injects the faults of an object store between a client and a real
server: throttling (503 SlowDown) and other 5xx answers, connection resets, stalls (a server that accepts
and never answers, or stops in the middle of a body), slow answers, and the server killed in the middle
of a transfer.

    with FaultProxy(server.endpoint_url, on_kill=server.kill) as proxy:
        client = server.client(endpoint_url=proxy.endpoint_url)
        proxy.fail(503, "SlowDown", times=2, method="PUT", target="partNumber=")
        proxy.reset(during="response", after_bytes=1 << 20, method="GET")
        proxy.stall(method="GET")                 # never answers, until proxy.clear()
        proxy.kill_server(during="request", after_bytes=8 << 20, target="partNumber=")

The proxy runs an asyncio loop in a thread of its own; its methods may be called from any thread.
Requests pass through byte for byte (signatures stay valid); the proxy parses only the framing
(request and status lines, headers, Content-Length and chunked bodies, ``Expect: 100-continue``), so that
it can tell requests apart on a kept-alive connection and count the bytes of each body.  Each request
meets at most one fault: the first, in the order added, whose method and target match and which has
shots left.  ``proxy.requests`` records every request and what became of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from typing import Literal
from urllib.parse import urlsplit

__all__ = ["FaultProxy", "Fault", "Request"]

Action = Literal["error", "reset", "stall", "kill", "delay"]
Phase = Literal["request", "response"]

_BLOCK = 256 << 10
_MAX_HEAD = 64 << 10


@dataclasses.dataclass
class Fault:
    """One fault: what it does (``action``), to which requests (``method``: exact, ``target``: a substring of
    the request target such as ``"partNumber="`` or ``"?uploads"``), how often (``times``: None for every
    matching request; the first ``skip`` matching requests pass), and where in the exchange (``during`` the
    request or the response, after ``after_bytes`` bytes of its body have passed; 0 is before the head of
    the response, or right after the request's head).  ``fired`` counts the requests it hit."""

    action: Action
    method: str | None = None
    target: str | None = None
    times: int | None = 1
    skip: int = 0
    during: Phase = "request"
    after_bytes: int = 0
    status: int = 503
    code: str = "SlowDown"
    message: str = "Please reduce your request rate."
    seconds: float = 0.0
    fired: int = 0
    seen: int = 0

    def _matches(self, method: str, target: str) -> bool:
        return (self.method is None or self.method == method) and (self.target is None or self.target in target)


@dataclasses.dataclass
class Request:
    """A request that reached the proxy: its method and target, the status the client got (None if it got
    none), the fault it met (None), and how many bytes of its body went to the server and of the answer's
    body to the client (what a client receives of bytes sent just before a reset may be fewer: TCP drops
    unread data when the reset arrives)."""

    method: str
    target: str
    status: int | None = None
    fault: Action | None = None
    at: float = 0.0
    request_bytes: int = 0
    response_bytes: int = 0


class _Reset(Exception):
    """The fault ends the connection with a reset."""


class _Closed(Exception):
    """A peer closed or reset its side."""


class FaultProxy:
    """A fault-injecting HTTP proxy from ``127.0.0.1:<port>`` to ``upstream`` (a URL such as the S3
    server's endpoint).  ``on_kill`` is called (in a worker thread) when a ``kill`` fault fires: give it the
    server's kill."""

    def __init__(self, upstream: str, *, on_kill: Callable[[], object] | None = None, port: int = 0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, not {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self.on_kill = on_kill
        self._want_port = port
        self.port = 0
        self.requests: list[Request] = []
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._release: asyncio.Event | None = None
        self._conns: set[asyncio.StreamWriter] = set()

    @property
    def endpoint_url(self) -> str:
        """The proxy's URL, to give a client instead of the server's."""
        return f"http://127.0.0.1:{self.port}"

    # -- faults -----------------------------------------------------------------------------------
    def add(self, fault: Fault) -> Fault:
        """Inject ``fault`` into the requests it matches from now on; returns it (its counters say what it did)."""
        with self._lock:
            self._faults.append(fault)
        return fault

    def fail(self, status: int = 503, code: str = "SlowDown", message: str | None = None, *,
             times: int | None = 1, skip: int = 0, method: str | None = None, target: str | None = None) -> Fault:
        """Answer matching requests with ``status`` and an S3 error document carrying ``code``, instead of
        passing them to the server."""
        if not 400 <= status <= 599:
            raise ValueError(f"an error status is 400-599, not {status}")
        msg = message if message is not None else {503: "Please reduce your request rate."}.get(status, "Injected error")
        return self.add(Fault("error", method, target, times, skip, status=status, code=code, message=msg))

    def reset(self, *, during: Phase = "request", after_bytes: int = 0, times: int | None = 1, skip: int = 0,
              method: str | None = None, target: str | None = None) -> Fault:
        """Reset the client's connection (TCP RST) at the given point of matching requests."""
        return self.add(Fault("reset", method, target, times, skip, during=during, after_bytes=after_bytes))

    def stall(self, *, during: Phase = "request", after_bytes: int = 0, times: int | None = None, skip: int = 0,
              method: str | None = None, target: str | None = None) -> Fault:
        """Stop passing bytes either way at the given point of matching requests and never answer, as a
        frozen server does, until :meth:`clear` (which then closes those connections) or :meth:`close`."""
        return self.add(Fault("stall", method, target, times, skip, during=during, after_bytes=after_bytes))

    def delay(self, seconds: float, *, during: Phase = "response", after_bytes: int = 0, times: int | None = 1,
              skip: int = 0, method: str | None = None, target: str | None = None) -> Fault:
        """Pause ``seconds`` at the given point of matching requests, then go on: a slow server."""
        return self.add(Fault("delay", method, target, times, skip, during=during, after_bytes=after_bytes,
                              seconds=seconds))

    def kill_server(self, *, during: Phase = "request", after_bytes: int = 0, times: int | None = 1, skip: int = 0,
                    method: str | None = None, target: str | None = None) -> Fault:
        """Call ``on_kill`` at the given point of a matching request, then go on passing bytes: the client
        sees whatever a dying server gives it."""
        if self.on_kill is None:
            raise ValueError("kill_server needs the proxy's on_kill (for example on_kill=server.kill)")
        return self.add(Fault("kill", method, target, times, skip, during=during, after_bytes=after_bytes))

    def clear(self) -> None:
        """Remove every fault and end the connections stalled so far."""
        with self._lock:
            self._faults.clear()
        if self._loop is not None and self._release is not None:
            self._loop.call_soon_threadsafe(self._release_stalled)

    def _release_stalled(self) -> None:
        assert self._release is not None
        self._release.set()
        self._release = asyncio.Event()

    def _pick(self, method: str, target: str) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if not f._matches(method, target) or (f.times is not None and f.fired >= f.times):
                    continue
                f.seen += 1
                if f.seen <= f.skip:
                    continue
                f.fired += 1
                return f
        return None

    # -- life cycle -------------------------------------------------------------------------------
    def start(self) -> FaultProxy:
        """Start listening on a free loopback port (use as a context manager to stop it)."""
        if self._thread is not None:
            return self
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._open())
            except BaseException as exc:  # a bind failure: reported by start()
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._shutdown())
                loop.close()

        self._thread = threading.Thread(target=run, name="nvckpt-fault-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    async def _open(self) -> None:
        self._release = asyncio.Event()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self._want_port, limit=_MAX_HEAD)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        if self._release is not None:
            self._release.set()
        for w in list(self._conns):
            w.transport.abort()
        # The connections' tasks end by themselves once their sockets are gone (cancelling them instead
        # makes asyncio's stream callback log each CancelledError); the rest are cancelled.
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=5)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def close(self) -> None:
        """Stop listening and end every connection."""
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._thread = None
        self._loop = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one client connection --------------------------------------------------------------------
    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self._conns.add(cwriter)
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        try:
            while True:
                try:
                    head = await creader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                method, target, headers = _parse_head(head)
                record = Request(method, target, at=time.monotonic())
                self.requests.append(record)
                fault = self._pick(method, target)
                if fault is not None:
                    record.fault = fault.action
                if fault is not None and fault.action == "error":
                    keep = await self._answer_error(fault, method, target, headers, creader, cwriter, record)
                    if not keep:
                        return
                    continue
                if upstream is None:
                    try:
                        upstream = await asyncio.open_connection(*self.upstream, limit=_MAX_HEAD)
                    except OSError:
                        _abort(cwriter)  # nothing listens there (a killed server): the client sees a reset
                        return
                    self._conns.add(upstream[1])
                keep = await self._exchange(method, head, headers, creader, cwriter, *upstream, fault, record)
                if not keep:
                    return
        except _Reset:
            _abort(cwriter)
        except (_Closed, ConnectionError, asyncio.IncompleteReadError):
            _abort(cwriter)
        finally:
            self._conns.discard(cwriter)
            if upstream is not None:
                self._conns.discard(upstream[1])
                upstream[1].transport.abort()
            if not cwriter.transport.is_closing():
                cwriter.close()

    async def _answer_error(self, fault: Fault, method: str, target: str, headers: dict[str, str],
                            creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter, record: Request) -> bool:
        """Answer with the fault's error instead of the server.  A request whose client waits for
        ``100 Continue`` sends no body: it is answered at once and the connection closed (its body may
        still come).  Otherwise the body is read and dropped first (a close with unread data would reset the
        connection and hide the answer) and the connection stays open."""
        expects = headers.get("expect", "").lower() == "100-continue"
        if not expects:
            await _relay_body(headers, creader, None, None)
        rid = uuid.uuid4().hex[:16].upper()
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{fault.code}</Code><Message>{fault.message}'
                f"</Message><Resource>{_xml(target)}</Resource><RequestId>{rid}</RequestId></Error>").encode()
        reason = {500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
                  504: "Gateway Timeout"}.get(fault.status, "Error")
        head = (f"HTTP/1.1 {fault.status} {reason}\r\nContent-Type: application/xml\r\nx-amz-request-id: {rid}\r\n"
                f"Content-Length: {0 if method == 'HEAD' else len(body)}\r\n"
                f"Connection: {'close' if expects else 'keep-alive'}\r\n\r\n").encode()
        cwriter.write(head if method == "HEAD" else head + body)
        await cwriter.drain()
        record.status = fault.status
        return not expects

    async def _exchange(self, method: str, head: bytes, headers: dict[str, str],
                        creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter,
                        ureader: asyncio.StreamReader, uwriter: asyncio.StreamWriter,
                        fault: Fault | None, record: Request) -> bool:
        """Pass one request and its answer.  True if the connection can carry another request."""
        req_fault = fault if fault is not None and fault.during == "request" else None
        resp_fault = fault if fault is not None and fault.during == "response" else None
        stalled: list[asyncio.Event] = []  # set once a stall fired: then nothing more passes either way

        async def fire(f: Fault) -> None:
            if f.action == "stall":
                assert self._release is not None
                stalled.append(self._release)
            await self._fire(f)

        async def hold_if_stalled() -> None:
            if stalled:
                await stalled[0].wait()
                raise _Reset()

        if req_fault is not None and req_fault.after_bytes == 0:
            await fire(req_fault)
        uwriter.write(head)
        body_task = asyncio.ensure_future(_relay_body(headers, creader, uwriter, req_fault, fire, record))
        try:
            # The answer may come before the body is sent (100 Continue, or an early error).
            while True:
                rhead = await _read_head(ureader, body_task)
                await hold_if_stalled()  # a server's own timeout answer must not pass a stalled request
                status = int(rhead.split(b" ", 2)[1])
                if resp_fault is not None and resp_fault.after_bytes == 0 and status >= 200:
                    await fire(resp_fault)
                cwriter.write(rhead)
                await cwriter.drain()
                if status >= 200 or status == 101:
                    break
            record.status = status
            rheaders = _parse_head(rhead)[2]
            until_close = False
            if method == "HEAD" or status in (204, 304):
                pass
            elif "chunked" in rheaders.get("transfer-encoding", "").lower() or "content-length" in rheaders:
                await _relay_body(rheaders, ureader, cwriter, resp_fault, fire, record, "response_bytes")
            else:
                until_close = True
                await _relay_until_eof(ureader, cwriter, resp_fault, fire, record)
            if not body_task.done():  # answered before the body was read: the connection's state is unknown
                return False
            await body_task
            close = rheaders.get("connection", "").lower() == "close" or headers.get("connection", "").lower() == "close"
            return not (close or until_close)
        except (_Closed, ConnectionError, asyncio.IncompleteReadError):
            await hold_if_stalled()  # the server gave up on a stalled request: the client still sees nothing
            raise
        finally:
            if not body_task.done():
                body_task.cancel()
                with contextlib.suppress(BaseException):
                    await body_task

    async def _fire(self, fault: Fault) -> None:
        """Do what ``fault`` does at the point reached; returns for faults after which bytes go on."""
        if fault.action == "reset":
            raise _Reset()
        if fault.action == "stall":
            assert self._release is not None
            await self._release.wait()
            raise _Reset()
        if fault.action == "delay":
            await asyncio.sleep(fault.seconds)
        elif fault.action == "kill":
            assert self.on_kill is not None
            await asyncio.get_running_loop().run_in_executor(None, self.on_kill)


# -- HTTP/1.1 framing ------------------------------------------------------------------------------
def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    first = lines[0].split(" ", 2)
    if len(first) < 2:
        raise _Closed(f"not an HTTP message: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return first[0], first[1], headers


async def _read_head(reader: asyncio.StreamReader, body_task: asyncio.Future[None]) -> bytes:
    read = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
    try:
        while True:
            done, _ = await asyncio.wait({read, body_task}, return_when=asyncio.FIRST_COMPLETED)
            if read in done:
                try:
                    return read.result()
                except asyncio.IncompleteReadError:
                    raise _Closed("the server closed the connection") from None
            # the request body ended (or failed) first: a failure is the connection's end
            exc = body_task.exception()
            if exc is not None:
                raise exc
            body_task = asyncio.get_running_loop().create_future()  # never completes: wait for the head alone
    finally:
        if not read.done():
            read.cancel()


class _Counter:
    """Bytes passed so far of one body (kept in ``record.<field>``), and the fault due at ``after_bytes``
    of them."""

    def __init__(self, fault: Fault | None, fire: Callable | None, record: Request | None, field: str) -> None:
        self.fault, self.fire, self.record, self.field = fault, fire, record, field
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    @count.setter
    def count(self, value: int) -> None:
        self._count = value
        if self.record is not None:
            setattr(self.record, self.field, value)

    async def write(self, writer: asyncio.StreamWriter | None, data: bytes) -> None:
        f = self.fault
        if f is not None and f.after_bytes > 0 and self.count < f.after_bytes <= self.count + len(data):
            cut = f.after_bytes - self.count
            if writer is not None:
                writer.write(data[:cut])
                await writer.drain()
            self.count += cut
            self.fault = None
            await self.fire(f)
            data = data[cut:]
        self.count += len(data)
        if writer is not None and data:
            writer.write(data)
            await writer.drain()


async def _relay_body(headers: dict[str, str], reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None,
                      fault: Fault | None, fire: Callable | None = None, record: Request | None = None,
                      field: str = "request_bytes") -> None:
    """Pass one message body framed by ``headers`` (chunked or Content-Length; none if neither) from
    ``reader`` to ``writer`` (dropped if None), byte for byte."""
    counter = _Counter(fault, fire, record, field)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            line = await reader.readuntil(b"\r\n")
            await counter.write(writer, line)
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers, up to the empty line
                    line = await reader.readuntil(b"\r\n")
                    await counter.write(writer, line)
                    if line == b"\r\n":
                        return
            await _relay_exactly(size + 2, reader, writer, counter)  # the data and its CRLF
    await _relay_exactly(int(headers.get("content-length", "0") or 0), reader, writer, counter)


async def _relay_exactly(left: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None,
                         counter: _Counter) -> None:
    while left:
        data = await reader.read(min(left, _BLOCK))
        if not data:
            raise _Closed("the body ended early")
        left -= len(data)
        await counter.write(writer, data)


async def _relay_until_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fault: Fault | None,
                           fire: Callable, record: Request) -> None:
    counter = _Counter(fault, fire, record, "response_bytes")
    while True:
        data = await reader.read(_BLOCK)
        if not data:
            return
        await counter.write(writer, data)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (RST), not an orderly FIN: what a client sees of a connection torn down."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
