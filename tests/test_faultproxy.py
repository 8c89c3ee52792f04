"""The fault-injecting proxy (nvckpt.testing.faultproxy): it passes HTTP/1.1 through byte for byte in every
framing a client or server uses, and each fault does exactly what it says, where it says.  The framing
tests run against a plain stdlib HTTP server; the S3 tests against the real SeaweedFS server."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import os
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvckpt.testing.faultproxy import FaultProxy


def _payload(n: int) -> bytes:
    return hashlib.shake_256(str(n).encode()).digest(n) if n else b""


class _Handler(http.server.BaseHTTPRequestHandler):
    """GET /len/N: N bytes with Content-Length; /chunked/N: chunked; /close/N: delimited by the close;
    /empty: 204.  HEAD /len/N: the headers alone.  PUT/POST: the body's sha256 and length (Content-Length or
    chunked body; Expect: 100-continue honoured)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _n(self) -> int:
        return int(self.path.rsplit("/", 1)[1])

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("Content-Length", str(self._n()))
        self.end_headers()

    def do_GET(self):
        if self.path == "/empty":
            self.send_response(204)
            self.end_headers()
            return
        kind, body = self.path.split("/")[1], _payload(self._n())
        self.send_response(200)
        if kind == "len":
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif kind == "chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body), 1000):
                piece = body[i:i + 1000]
                self.wfile.write(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\nX-Trailer: yes\r\n\r\n")
        else:
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

    def do_PUT(self):
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() != b"\r\n":
                        pass
                    break
                body += self.rfile.read(size)
                self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        answer = f"{hashlib.sha256(body).hexdigest()} {len(body)}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_POST = do_PUT


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # the resets the tests cause are not news
        pass


@pytest.fixture(scope="module")
def upstream():
    server = _QuietServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def proxy(upstream):
    kills: list[float] = []
    with FaultProxy(upstream, on_kill=lambda: kills.append(time.monotonic())) as p:
        p.kills = kills  # type: ignore[attr-defined]
        p.opened = []  # type: ignore[attr-defined]
        yield p
        for conn in p.opened:  # type: ignore[attr-defined]
            conn.close()


def _conn(proxy: FaultProxy, timeout: float = 10) -> http.client.HTTPConnection:
    """A client connection to the proxy, closed after the test."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=timeout)
    proxy.opened.append(conn)  # type: ignore[attr-defined]
    return conn


def _raw(proxy: FaultProxy, request: bytes, timeout: float = 10) -> tuple[bytes, str]:
    """Send ``request`` on a new socket and read until the connection ends: (what came, how it ended)."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout) as s:
        s.sendall(request)
        got = b""
        while True:
            try:
                data = s.recv(1 << 16)
            except ConnectionResetError:
                return got, "reset"
            except socket.timeout:
                return got, "timeout"
            if not data:
                return got, "eof"
            got += data


# -- passing through -----------------------------------------------------------------------------

def test_every_framing_passes_on_one_kept_alive_connection(proxy):
    conn = _conn(proxy)
    for path, n in [("/len/0", 0), ("/len/700000", 700000), ("/chunked/25000", 25000), ("/len/5", 5)]:
        conn.request("GET", path)
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == _payload(n), path
    conn.request("HEAD", "/len/12345")
    resp = conn.getresponse()
    assert resp.getheader("Content-Length") == "12345" and resp.read() == b""
    conn.request("GET", "/empty")
    resp = conn.getresponse()
    assert resp.status == 204 and resp.read() == b""
    body = os.urandom(300000)
    conn.request("PUT", "/put", body=body)
    assert conn.getresponse().read() == f"{hashlib.sha256(body).hexdigest()} {len(body)}".encode()
    conn.request("PUT", "/put", body=iter([body[:1000], body[1000:]]), encode_chunked=True)
    assert conn.getresponse().read() == f"{hashlib.sha256(body).hexdigest()} {len(body)}".encode()
    conn.close()
    assert [r.status for r in proxy.requests] == [200, 200, 200, 200, 200, 204, 200, 200]
    assert len({r.at for r in proxy.requests}) == len(proxy.requests)


def test_close_delimited_response(proxy):
    got, end = _raw(proxy, b"GET /close/50000 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert end == "eof" and got.endswith(b"\r\n\r\n" + _payload(50000))


def test_expect_100_continue(proxy):
    body = os.urandom(2 << 20)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"PUT /put HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert s.recv(1 << 10).startswith(b"HTTP/1.1 100")
        s.sendall(body)
        f = s.makefile("rb")
        assert f.readline().startswith(b"HTTP/1.1 200")
        while f.readline() != b"\r\n":
            pass
        assert f.read(64 + 1 + len(str(len(body)))) == f"{hashlib.sha256(body).hexdigest()} {len(body)}".encode()
    assert proxy.requests[0].status == 200


# -- faults ---------------------------------------------------------------------------------------

def test_fail_answers_s3_error_then_keeps_the_connection(proxy):
    fault = proxy.fail(503, "SlowDown", times=2, skip=1, method="GET", target="/len/")
    conn = _conn(proxy)
    statuses = []
    for _ in range(4):
        conn.request("GET", "/len/100")
        resp = conn.getresponse()
        body = resp.read()
        statuses.append(resp.status)
        if resp.status == 503:
            assert b"<Code>SlowDown</Code>" in body and b"<Resource>/len/100</Resource>" in body
            assert resp.getheader("Content-Type") == "application/xml" and resp.getheader("x-amz-request-id")
        else:
            assert body == _payload(100)
    conn.request("GET", "/chunked/10")  # the target does not match
    assert conn.getresponse().read() == _payload(10)
    assert statuses == [200, 503, 503, 200] and fault.fired == 2 and fault.seen == 3
    assert [r.fault for r in proxy.requests] == [None, "error", "error", None, None]


def test_fail_on_a_request_with_a_body(proxy):
    proxy.fail(500, "InternalError", method="PUT")
    conn = _conn(proxy)
    body = os.urandom(100000)
    conn.request("PUT", "/put", body=body)  # no Expect: the body is read and dropped, the connection kept
    resp = conn.getresponse()
    assert resp.status == 500 and b"<Code>InternalError</Code>" in resp.read()
    conn.request("PUT", "/put", body=body)
    assert conn.getresponse().read().startswith(hashlib.sha256(body).hexdigest().encode())
    proxy.fail(503, method="PUT")  # with Expect: answered at once, no body sent, connection closed
    got, end = _raw(proxy, b"PUT /put HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 999\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 503") and b"Connection: close" in got and end == "eof"


def test_fail_on_head_has_no_body(proxy):
    proxy.fail(503, method="HEAD")
    conn = _conn(proxy)
    conn.request("HEAD", "/len/10")
    resp = conn.getresponse()
    assert resp.status == 503 and resp.read() == b""
    conn.request("GET", "/len/10")
    assert conn.getresponse().read() == _payload(10)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 300000), cut=st.floats(0, 1), framing=st.sampled_from(["len", "chunked"]))
def test_reset_during_response_after_exact_bytes(proxy, size, cut, framing):
    after = max(1, int(size * cut))
    proxy.clear()
    proxy.reset(during="response", after_bytes=after)
    got, end = _raw(proxy, f"GET /{framing}/{size} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert end == "reset"
    assert proxy.requests[-1].response_bytes == after and proxy.requests[-1].fault == "reset"
    # What reaches the client is a prefix, up to the reset: TCP drops bytes still unread when it arrives.
    body = got.split(b"\r\n\r\n", 1)[1]
    assert len(body) <= after
    if framing == "len":
        assert body == _payload(size)[:len(body)]


def test_reset_before_any_answer_and_during_request_body(proxy):
    proxy.reset(method="GET")
    got, end = _raw(proxy, b"GET /len/10 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (got, end) == (b"", "reset")
    proxy.reset(method="PUT", after_bytes=50000)
    conn = _conn(proxy)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        conn.request("PUT", "/put", body=os.urandom(4 << 20))
        conn.getresponse()
    conn.close()
    assert [r.fault for r in proxy.requests] == ["reset", "reset"]
    conn = _conn(proxy)
    conn.request("GET", "/len/10")  # faults spent: traffic passes again
    assert conn.getresponse().read() == _payload(10)


def test_stall_holds_until_cleared(proxy):
    proxy.stall(method="GET", target="/len/")
    got, end = _raw(proxy, b"GET /len/10 HTTP/1.1\r\nHost: x\r\n\r\n", timeout=0.5)
    assert (got, end) == (b"", "timeout")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"GET /len/10 HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.3)
        t0 = time.monotonic()
        proxy.clear()  # the stalled connection is ended, promptly
        with pytest.raises(ConnectionResetError):
            while s.recv(100):
                pass
        assert time.monotonic() - t0 < 5
    conn = _conn(proxy)
    conn.request("GET", "/len/10")
    assert conn.getresponse().read() == _payload(10)


@pytest.mark.slow
def test_stall_mid_response_and_mid_upload(proxy):
    proxy.stall(during="response", after_bytes=4096, method="GET")
    got, end = _raw(proxy, b"GET /len/100000 HTTP/1.1\r\nHost: x\r\n\r\n", timeout=0.5)
    assert end == "timeout" and got.split(b"\r\n\r\n", 1)[1] == _payload(100000)[:4096]
    proxy.clear()
    proxy.stall(during="request", after_bytes=1000, method="PUT")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=0.5) as s:
        s.sendall(b"PUT /put HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000)
        with pytest.raises(socket.timeout):
            s.recv(100)


def test_close_ends_stalled_connections(upstream):
    p = FaultProxy(upstream).start()
    p.stall()
    s = socket.create_connection(("127.0.0.1", p.port), timeout=10)
    s.sendall(b"GET /len/10 HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.2)
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 5
    with pytest.raises(ConnectionError):
        while s.recv(100):
            pass
        raise ConnectionResetError("closed")
    s.close()


def test_delay(proxy):
    proxy.delay(0.4, method="GET")
    conn = _conn(proxy)
    t0 = time.monotonic()
    conn.request("GET", "/len/10")
    assert conn.getresponse().read() == _payload(10)
    assert time.monotonic() - t0 >= 0.4


def test_kill_fires_at_the_given_byte(proxy):
    proxy.kill_server(during="request", after_bytes=70000, method="PUT")
    conn = _conn(proxy)
    body = os.urandom(200000)
    conn.request("PUT", "/put", body=body)
    assert conn.getresponse().read().startswith(hashlib.sha256(body).hexdigest().encode())  # the fake kill kills nothing
    assert len(proxy.kills) == 1


def test_bad_arguments(upstream):
    with pytest.raises(ValueError, match="http://host:port"):
        FaultProxy("https://127.0.0.1:1")
    p = FaultProxy(upstream)
    with pytest.raises(ValueError, match="400-599"):
        p.fail(200)
    with pytest.raises(ValueError, match="on_kill"):
        p.kill_server()


def test_nothing_listening_upstream_is_a_reset():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with FaultProxy(f"http://127.0.0.1:{port}") as p:
        assert _raw(p, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == (b"", "reset")


# -- against the real S3 server -------------------------------------------------------------------

@pytest.mark.slow
def test_s3_throttling_is_retried_by_a_client(s3_server, s3_bucket, fault_proxy):
    from botocore.exceptions import ClientError

    data = os.urandom(6 << 20)
    s3_server.client().put_object(Bucket=s3_bucket, Key="obj", Body=data)
    fault_proxy.fail(503, "SlowDown", times=2, method="GET")
    patient = s3_server.client(endpoint_url=fault_proxy.endpoint_url, retries=3)
    assert patient.get_object(Bucket=s3_bucket, Key="obj")["Body"].read() == data
    assert [r.status for r in fault_proxy.requests] == [503, 503, 200]
    fault_proxy.fail(503, "SlowDown", times=1, method="GET")
    with pytest.raises(ClientError) as exc:
        s3_server.client(endpoint_url=fault_proxy.endpoint_url, retries=0).get_object(Bucket=s3_bucket, Key="obj")
    assert exc.value.response["Error"]["Code"] == "SlowDown"


@pytest.mark.slow
def test_s3_multipart_through_faults(s3_server, s3_bucket, fault_proxy):
    """A multipart upload (Expect: 100-continue on each part) passes the proxy; a reset in the middle of a
    part and a 503 on another are retried by the client, and the object is exact."""
    import io

    from boto3.s3.transfer import TransferConfig

    data = os.urandom(17 << 20)
    fault_proxy.reset(during="request", after_bytes=1 << 20, target="partNumber=2")
    fault_proxy.fail(503, "SlowDown", target="partNumber=3")
    client = s3_server.client(endpoint_url=fault_proxy.endpoint_url, retries=3)
    client.upload_fileobj(io.BytesIO(data), s3_bucket, "mp", Config=TransferConfig(
        multipart_threshold=5 << 20, multipart_chunksize=5 << 20, max_concurrency=2))
    assert s3_server.client().get_object(Bucket=s3_bucket, Key="mp")["Body"].read() == data
    faults = [(r.target.split("partNumber=")[1].split("&")[0], r.fault) for r in fault_proxy.requests if r.fault]
    assert sorted(faults) == [("2", "reset"), ("3", "error")]
    assert s3_server.open_uploads(s3_bucket) == []


@pytest.mark.slow
def test_s3_server_killed_mid_part(s3_server, s3_bucket, fault_proxy):
    client = s3_server.client(endpoint_url=fault_proxy.endpoint_url, retries=0, timeout=10)
    upload = client.create_multipart_upload(Bucket=s3_bucket, Key="dies")["UploadId"]
    fault_proxy.kill_server(during="request", after_bytes=2 << 20, target="partNumber=1")
    t0 = time.monotonic()
    with pytest.raises(Exception) as exc:
        client.upload_part(Bucket=s3_bucket, Key="dies", UploadId=upload, PartNumber=1, Body=os.urandom(6 << 20))
    assert time.monotonic() - t0 < 10, f"no prompt error after the server died: {exc.value!r}"
    while s3_server.alive and time.monotonic() - t0 < 30:  # the client may see the sockets go first
        time.sleep(0.05)
    assert not s3_server.alive
    s3_server.start()
    assert s3_server.keys(s3_bucket) == []
    assert [u["UploadId"] for u in s3_server.open_uploads(s3_bucket)] == [upload]


@pytest.mark.slow
def test_s3_stalled_server_ends_in_the_client_timeout(s3_server, s3_bucket, fault_proxy):
    from botocore.exceptions import ReadTimeoutError

    s3_server.client().put_object(Bucket=s3_bucket, Key="obj", Body=b"x" * 1000)
    fault_proxy.stall(method="GET")
    client = s3_server.client(endpoint_url=fault_proxy.endpoint_url, retries=0, timeout=1)
    t0 = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        client.get_object(Bucket=s3_bucket, Key="obj")
    assert time.monotonic() - t0 < 10
