"""s3:// end to end against a real S3 server (SeaweedFS on loopback) and the fault proxy in front of it:
save, async_save, load, open, DCP and the CLI on s3:// URLs; requests per open and per tensor; throttling,
resets, a stalled and a killed server; an object replaced while it is read; one-line errors; open uploads."""

from __future__ import annotations

import errno
import gc
import itertools
import os
import sys
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

import nvckpt
from conftest import assert_tree_equal, small_training_state

pytest.importorskip("obstore")

_keys = itertools.count()


@pytest.fixture(scope="module")
def bucket(s3_server):
    """One bucket for the module (making one costs seconds here); each test writes under its own prefix."""
    s3_server.start()
    return s3_server.create_bucket()


@pytest.fixture
def s3(s3_server, bucket, monkeypatch):
    """(server, a fresh s3:// prefix) with the server's endpoint and credentials in the environment, where
    boto3 users keep them; the server is running and thawed again after the test."""
    s3_server.thaw()
    s3_server.start()
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    yield s3_server, f"s3://{bucket}/t{next(_keys)}"
    s3_server.thaw()
    s3_server.start()


def _state(mb: float = 6.0) -> dict:
    state = small_training_state()
    g = torch.Generator().manual_seed(1)
    state["big"] = torch.randn(int(mb * (1 << 20) / 4), generator=g)
    state["rows"] = torch.randn(256, 1024, generator=g)
    return state


def _requests_since(proxy, start: int) -> list:
    return proxy.requests[start:]


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


# -- round trips -------------------------------------------------------------------------------

@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
def test_save_load_open_round_trip(s3):
    server, prefix = s3
    url = f"{prefix}/step100.nvckpt"
    state = _state()
    result = nvckpt.save(state, url, storage_options={"part_size": 5 << 20})  # several parts
    assert result.path == url
    assert_tree_equal(nvckpt.load(url), state)
    with nvckpt.open(url) as ck:
        assert torch.equal(ck.get_tensor("big"), state["big"])
        assert torch.equal(ck.get_slice("rows")[10:20], state["rows"][10:20])
    part = nvckpt.load(url, keys=["rows"])
    assert list(part) == ["rows"] and torch.equal(part["rows"], state["rows"])
    future = nvckpt.async_save(state, f"{prefix}/async.nvckpt")
    future.result(timeout=120)
    assert_tree_equal(nvckpt.load(f"{prefix}/async.nvckpt"), state)
    bucket = url.split("/")[2]
    assert server.open_uploads(bucket, prefix.split("/", 3)[3]) == []


@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
def test_storage_options_override_the_environment(s3, monkeypatch):
    server, prefix = s3
    url = f"{prefix}/opts.nvckpt"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    options = {"endpoint_url": server.endpoint_url, "aws_secret_access_key": server.secret_key}
    nvckpt.save({"w": torch.arange(10)}, url, storage_options=options)
    assert torch.equal(nvckpt.load(url, storage_options=options)["w"], torch.arange(10))


@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
def test_config_files_give_credentials_and_endpoint(s3, monkeypatch, tmp_path):
    server, prefix = s3
    (tmp_path / "credentials").write_text(f"[ckpt]\naws_access_key_id = {server.access_key}\n"
                                          f"aws_secret_access_key = {server.secret_key}\n")
    (tmp_path / "config").write_text(f"[profile ckpt]\nregion = {server.region}\nendpoint_url = {server.endpoint_url}\n")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    url = f"{prefix}/profile.nvckpt"
    nvckpt.save({"w": torch.ones(4)}, url)
    assert torch.equal(nvckpt.load(url)["w"], torch.ones(4))


@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
def test_open_and_one_tensor_take_at_most_two_requests(s3, fault_proxy):
    server, prefix = s3
    url = f"{prefix}/many.nvckpt"
    state = {f"layer{i}": torch.randn(64, 1024) for i in range(40)}  # 10 MB in 40 tensors, 1 MiB chunks
    state["big"] = torch.randn(1 << 20)
    nvckpt.save(state, url, chunk_size=1 << 20)
    options = {"endpoint_url": fault_proxy.endpoint_url}
    start = len(fault_proxy.requests)
    with nvckpt.open(url, storage_options=options) as ck:
        opened = len(fault_proxy.requests)
        assert opened - start <= 2, _requests_since(fault_proxy, start)
        assert torch.equal(ck.get_tensor("layer17"), state["layer17"])
        assert len(fault_proxy.requests) - opened <= 2
        before = len(fault_proxy.requests)
        assert torch.equal(ck.get_tensor("big"), state["big"])  # 4 MiB in four chunks: one ranged GET
        assert len(fault_proxy.requests) - before <= 2
        before = len(fault_proxy.requests)
        assert torch.equal(ck.get_slice("layer3")[5:9], state["layer3"][5:9])
        assert len(fault_proxy.requests) - before == 1
    assert all(r.method == "GET" for r in _requests_since(fault_proxy, start))


# -- faults ------------------------------------------------------------------------------------

@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
def test_throttling_5xx_and_resets_are_retried(s3, fault_proxy):
    server, prefix = s3
    url = f"{prefix}/retried.nvckpt"
    state = _state(12)
    options = {"endpoint_url": fault_proxy.endpoint_url, "part_size": 5 << 20, "timeout": 20}
    throttled = fault_proxy.fail(503, "SlowDown", times=2, method="PUT", target="partNumber=")
    failed = fault_proxy.fail(500, "InternalError", times=1, method="POST")
    nvckpt.save(state, url, storage_options=options)
    reset = fault_proxy.reset(during="response", after_bytes=256 << 10, method="GET", times=2)
    slow = fault_proxy.fail(503, "SlowDown", times=2, method="GET")
    assert_tree_equal(nvckpt.load(url, storage_options=options), state)
    assert throttled.fired == 2 and failed.fired == 1 and reset.fired == 2 and slow.fired == 2


@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
def test_a_server_killed_mid_save_fails_in_bounded_time_and_publishes_nothing(s3, fault_proxy):
    from nvckpt.cli import main

    server, prefix = s3
    url = f"{prefix}/killed.nvckpt"
    old = {"w": torch.arange(1000)}
    nvckpt.save(old, url)
    options = {"endpoint_url": fault_proxy.endpoint_url, "part_size": 5 << 20, "timeout": 4}
    fault_proxy.kill_server(during="request", after_bytes=2 << 20, target="partNumber=", skip=1)
    began = time.monotonic()
    with pytest.raises(OSError) as caught:
        nvckpt.save(_state(16), url, storage_options=options)
    took = time.monotonic() - began
    assert took < 60, took
    message = _one_line(caught.value)
    assert url in message
    server.start()
    assert_tree_equal(nvckpt.load(url), old)  # the previous object, as it was
    bucket, key = url[5:].split("/", 1)
    left = server.open_uploads(bucket, key)  # the dead server could not be told to abort
    with pytest.warns(nvckpt.errors.LeftoverTemporaryWarning, match="nvckpt reap"):
        nvckpt.save(old, url)  # the next save to the key reports them
    assert main(["reap", url, "--dry-run"]) == 0
    assert len(server.open_uploads(bucket, key)) == len(left)
    assert main(["reap", url]) == 0
    assert server.open_uploads(bucket, key) == []


@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
def test_a_failed_save_aborts_its_upload(s3, fault_proxy):
    server, prefix = s3
    url = f"{prefix}/refused.nvckpt"
    options = {"endpoint_url": fault_proxy.endpoint_url, "part_size": 5 << 20}
    fault_proxy.fail(400, "InvalidArgument", message="refused by the test", times=None, method="PUT",
                     target="partNumber=", skip=1)
    with pytest.raises(OSError, match="InvalidArgument") as caught:
        nvckpt.save(_state(16), url, storage_options=options)
    assert url in _one_line(caught.value)
    fault_proxy.clear()
    bucket, key = url[5:].split("/", 1)
    assert server.open_uploads(bucket, key) == [] and server.keys(bucket, key) == []


@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_a_stalled_server_times_out_naming_the_url(s3, fault_proxy, method):
    server, prefix = s3
    url = f"{prefix}/stalled.nvckpt"
    state = _state(12)
    if method == "GET":
        nvckpt.save(state, url)
    options = {"endpoint_url": fault_proxy.endpoint_url, "part_size": 5 << 20, "timeout": 2}
    fault_proxy.stall(method=method, during="request" if method == "PUT" else "response",
                      after_bytes=1 << 20 if method == "PUT" else 0)
    began = time.monotonic()
    with pytest.raises(OSError) as caught:
        if method == "GET":
            nvckpt.load(url, storage_options=options)
        else:
            nvckpt.save(state, url, storage_options=options)
    assert time.monotonic() - began < 30
    message = _one_line(caught.value)
    assert url in message and ("no progress" in message or "timed out" in message.lower()), message
    fault_proxy.clear()


@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
def test_an_object_replaced_while_read_gives_old_bytes_or_a_named_error(s3):
    server, prefix = s3
    url = f"{prefix}/replaced.nvckpt"
    old, new = _state(4), _state(4)
    new["big"] = new["big"] + 1
    nvckpt.save(old, url)
    with nvckpt.open(url) as ck:
        nvckpt.save(new, url)
        try:
            got = ck.get_tensor("big")
        except OSError as exc:
            assert exc.errno == errno.ESTALE and url in _one_line(exc) and "replaced" in str(exc)
        else:
            assert torch.equal(got, old["big"])
    assert torch.equal(nvckpt.load(url)["big"], new["big"])


# -- errors ------------------------------------------------------------------------------------

@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
def test_wrong_credentials_missing_bucket_and_key_are_one_line_errors(s3, monkeypatch):
    server, prefix = s3
    bucket = prefix.split("/")[2]
    url = f"{prefix}/x.nvckpt"
    nvckpt.save({"w": torch.ones(3)}, url)
    with pytest.raises(PermissionError) as caught:
        nvckpt.load(url, storage_options={"secret_access_key": "wrong"})
    message = _one_line(caught.value)
    assert url in message and ("SignatureDoesNotMatch" in message or "AccessDenied" in message)
    assert f"bucket {bucket!r}" in message and "key 't" in message

    with pytest.raises(FileNotFoundError) as caught:
        nvckpt.load(f"{prefix}/missing.nvckpt")
    assert "NoSuchKey" in _one_line(caught.value)

    missing = "nvckpt-no-such-bucket"
    with pytest.raises(FileNotFoundError) as caught:
        nvckpt.save({"w": torch.ones(3)}, f"s3://{missing}/x.nvckpt")
    message = _one_line(caught.value)
    assert "NoSuchBucket" in message and f"bucket {missing!r}" in message
    assert missing not in [b["Name"] for b in server.client().list_buckets()["Buckets"]]  # never created

    with pytest.raises(ValueError, match="not an S3 bucket name"):
        nvckpt.load("s3://A_B/x")
    with pytest.raises(ValueError, match="storage option 'colour'"):
        nvckpt.load(url, storage_options={"colour": "blue"})


def test_without_obstore_a_one_line_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)
    monkeypatch.delitem(sys.modules, "nvckpt.io.s3", raising=False)
    with pytest.raises(ValueError, match=r"pip install 'nvckpt\[s3\]'") as caught:
        nvckpt.load("s3://bucket/x.nvckpt")
    _one_line(caught.value)


# -- DCP and the CLI -------------------------------------------------------------------------

_SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
@_SINGLE_PROCESS
def test_dcp_directory_published_by_its_commit_object(s3, capsys):
    import torch.distributed.checkpoint as dcp

    import nvckpt.dcp
    from nvckpt.cli import main
    from nvckpt.io.directory import open_directory
    from nvckpt.sharded.transaction import DirectorySave

    server, prefix = s3
    url = f"{prefix}/step100"
    state = {"model": {"w": torch.randn(300, 40), "b": torch.arange(7)}, "step": 3}
    dcp.save(state, storage_writer=nvckpt.dcp.Writer(url))
    target = {"model": {"w": torch.zeros(300, 40), "b": torch.zeros(7, dtype=torch.int64)}, "step": 0}
    dcp.load(target, storage_reader=nvckpt.dcp.Reader(url))
    assert torch.equal(target["model"]["w"], state["model"]["w"]) and target["step"] == 3

    # a save killed before its commit (ranks wrote, the coordinator never published): the old one stays
    save = DirectorySave(open_directory(url))
    token = save.begin()
    save.write_rank(token, "__0.nvckpt", {"model": {"w": torch.ones(300, 40)}}, nvckpt.options.SaveOptions())
    del save  # the coordinator is gone: what it staged is stale
    gc.collect()
    again = {"model": {"w": torch.zeros(300, 40), "b": torch.zeros(7, dtype=torch.int64)}, "step": 0}
    dcp.load(again, storage_reader=nvckpt.dcp.Reader(url))
    assert torch.equal(again["model"]["w"], state["model"]["w"])

    # the next save removes what the killed one left, and replaces the checkpoint whole
    state["model"]["w"] += 1
    dcp.save(state, storage_writer=nvckpt.dcp.Writer(url))
    dcp.load(again, storage_reader=nvckpt.dcp.Reader(url))
    assert torch.equal(again["model"]["w"], state["model"]["w"])
    bucket, key = url[5:].split("/", 1)
    generations = {k.split("/")[3] for k in server.keys(bucket, key + "/.nvckpt-generations/")}
    assert len(generations) == 1  # the previous one and the abandoned one are gone

    for command in ("info", "ls", "verify"):
        assert main([command, url]) == 0, command
    assert "OK" in capsys.readouterr().out

    # a rank file asked for by its name lives under the save's generation: the error says how to read it
    with pytest.raises(FileNotFoundError) as err:
        nvckpt.open(f"{url}/__0_0.nvckpt")
    assert "sharded checkpoint published by its commit object" in str(err.value) and url in str(err.value)
    with pytest.raises(FileNotFoundError) as err:  # a missing object elsewhere: no such hint
        nvckpt.open(f"{prefix}/nothing-here.nvckpt")
    assert "sharded checkpoint" not in str(err.value)


@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
@_SINGLE_PROCESS
def test_dcp_load_requests(s3, fault_proxy):
    """dcp.load through nvckpt.dcp.Reader reads the plan in two requests (the commit object, .metadata), opens
    a rank file in at most two (its tail with the index, its preamble) and reads one tensor's chunks with one;
    a whole load opens each rank file once; a row box (a resharded load's) reads only its rows' chunks."""
    import torch.distributed.checkpoint as dcp

    import nvckpt.dcp
    from nvckpt.io.directory import open_directory

    server, prefix = s3
    url = f"{prefix}/step7"
    g = torch.Generator().manual_seed(7)
    master = {f"layer{i}": torch.randn(256, 1024, generator=g) for i in range(8)}  # 1 MiB each
    state = {"master": master, "model": {k: v.to(torch.bfloat16) for k, v in master.items()},  # derived (SPEC 14.2)
             "big": torch.randn(1024, 1024, generator=g), "step": 7}  # 4 MiB: beyond the tail open reads
    dcp.save(state, storage_writer=nvckpt.dcp.Writer(url, chunk_size=1 << 18))
    options = {"endpoint_url": fault_proxy.endpoint_url}

    def requests(load) -> list:
        start = len(fault_proxy.requests)
        load()
        return [(r.method, r.target.rsplit("/", 1)[-1]) for r in fault_proxy.requests[start:]]

    one = {"big": torch.zeros(1024, 1024)}
    got = requests(lambda: dcp.load(one, storage_reader=nvckpt.dcp.Reader(url, storage_options=options)))
    assert torch.equal(one["big"], state["big"])
    assert all(method == "GET" for method, _ in got), got
    names = [name for _, name in got]
    assert names[:2] == [".nvckpt-published", ".metadata"], got  # the plan: no manifest, no HEAD
    assert names[2:] == ["__0.nvckpt"] * 3, got  # open: the tail and the preamble; the tensor: one ranged GET

    bf16 = {"model": {"layer3": torch.zeros(256, 1024, dtype=torch.bfloat16)}}
    got = requests(lambda: dcp.load(bf16, storage_reader=nvckpt.dcp.Reader(url, storage_options=options)))
    assert torch.equal(bf16["model"]["layer3"], state["model"]["layer3"])  # computed from its master's chunks
    assert len(got) == 5, got

    whole = {"master": {k: torch.zeros_like(v) for k, v in master.items()},
             "model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "big": torch.zeros(1024, 1024),
             "step": 0}
    reader = nvckpt.dcp.Reader(url, storage_options=options)
    got = requests(lambda: dcp.load(whole, storage_reader=reader))
    assert_tree_equal(whole, state)
    stored = open_directory(url).size("__0.nvckpt")
    assert reader.bytes_read <= stored  # each stored byte read at most once (the bf16 weights from their master's)
    assert all(method == "GET" for method, _ in got) and len(got) <= 2 + 2 + 9 + 1, got  # a stored tensor: a GET at most

    with nvckpt.open(open_directory(url, options).open_source("__0.nvckpt")) as ck:
        chunks = ck.file.entry("big").chunks
        rows = torch.zeros(256, 1024)
        start = len(fault_proxy.requests)
        assert ck.read_boxes_into([("big", (512, 0), (256, 1024), rows)]) == []
        assert torch.equal(rows, state["big"][512:768])
        read = fault_proxy.requests[start:]
        assert len(read) == 1 and read[0].response_bytes <= sum(
            c.stored_length + 64 for c in chunks if 2 << 20 <= c.raw_start < 3 << 20), read


@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
def test_cli_on_s3_files(s3, tmp_path, capsys):
    from nvckpt.cli import main

    server, prefix = s3
    url = f"{prefix}/cli.nvckpt"
    state = small_training_state()
    nvckpt.save(state, url)
    assert main(["info", url]) == 0 and main(["ls", url]) == 0 and main(["verify", url]) == 0
    assert main(["convert", url, f"{prefix}/cli.pt"]) == 0
    assert main(["convert", f"{prefix}/cli.pt", str(tmp_path / "back.nvckpt")]) == 0
    assert_tree_equal(nvckpt.load(tmp_path / "back.nvckpt"), state)
    assert main(["convert", url, f"{prefix}/cli.pt"]) == 2  # an existing object: only with --force
    assert main(["recover", url, f"{prefix}/recovered.nvckpt"]) == 0
    assert_tree_equal(nvckpt.load(f"{prefix}/recovered.nvckpt"), state)
    capsys.readouterr()
    assert main(["info", f"{prefix}/nothing.nvckpt"]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "NoSuchKey" in err and f"{prefix}/nothing.nvckpt" in err


# -- other URLs through fsspec ---------------------------------------------------------------

@_SINGLE_PROCESS
def test_memory_urls_through_fsspec():
    import fsspec
    import torch.distributed.checkpoint as dcp

    import nvckpt.dcp

    root = f"memory://nvckpt-{os.getpid()}-{next(_keys)}"
    try:
        state = _state(2)
        nvckpt.save(state, f"{root}/a.nvckpt")
        assert_tree_equal(nvckpt.load(f"{root}/a.nvckpt"), state)
        with nvckpt.open(f"{root}/a.nvckpt") as ck:
            assert torch.equal(ck.get_slice("rows")[3:5], state["rows"][3:5])
        dstate = {"w": torch.randn(50, 8)}
        dcp.save(dstate, storage_writer=nvckpt.dcp.Writer(f"{root}/dcp"))
        target = {"w": torch.zeros(50, 8)}
        dcp.load(target, storage_reader=nvckpt.dcp.Reader(f"{root}/dcp"))
        assert torch.equal(target["w"], dstate["w"])
    finally:
        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)


# -- a whole load: fetched ahead of its decoding, in bounded buffers ----------------------------

@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
def test_a_whole_load_fetches_ahead_in_bounded_buffers(s3, fault_proxy, monkeypatch):
    from nvckpt.io import readahead

    server, prefix = s3
    url = f"{prefix}/ahead.nvckpt"
    g = torch.Generator().manual_seed(3)
    state = {f"small{i}": torch.randn(300, generator=g) for i in range(60)}  # many tensors of 1 KiB
    state["large"] = torch.randn(3 << 20, generator=g)  # 12 MiB in 1 MiB chunks: runs of at most read_size
    state["one chunk"] = torch.randn(4 << 20, generator=g)  # 16 MiB: one chunk larger than read_size below
    nvckpt.save(state, url, codec="raw", chunk_size=1 << 20, storage_options={"part_size": 5 << 20})
    nvckpt.save({"one chunk": state["one chunk"]}, f"{prefix}/one.nvckpt", codec="raw", chunk_size=16 << 20)
    made: list[readahead.ReadAhead] = []
    real = readahead.ReadAhead.__init__

    def recorded(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(readahead.ReadAhead, "__init__", recorded)
    options = {"endpoint_url": fault_proxy.endpoint_url, "read_size": 4 << 20, "reads_in_flight": 2}
    start = len(fault_proxy.requests)
    assert_tree_equal(nvckpt.load(url, storage_options=options), state)
    gets = [r for r in _requests_since(fault_proxy, start) if r.method == "GET"]
    # 28 MiB of chunks in GETs of at most 4 MiB (the 60 small tensors share one): about 8, not one per tensor
    assert len(gets) <= 12, len(gets)
    ahead = made[-1]
    assert ahead._made <= 4  # 2 * reads_in_flight buffers of read_size, reused for the whole load
    # one chunk larger than read_size: its own buffer, filled by concurrent GETs of read_size
    loaded = nvckpt.load(f"{prefix}/one.nvckpt", storage_options=options)
    assert torch.equal(loaded["one chunk"], state["one chunk"])


# -- a process forked after using S3 (DataLoader workers) ---------------------------------------

def _in_forked_child(work, timeout: float = 120.0) -> str:
    """``work()`` in a child forked now; what it returned (a str), or the error it raised, in one line."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        os.close(read)
        import faulthandler
        faulthandler.dump_traceback_later(timeout - 20, exit=True)  # a hang shows where
        torch.set_num_threads(1)  # as a DataLoader worker does: torch's OpenMP threads did not fork
        try:
            out = "ok " + work()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = f"error {type(exc).__name__}: {exc}"
        os.write(write, out.encode()[:4000])
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(read)
        pytest.fail(f"the forked child did not finish within {timeout} s (hung on S3)")
    with os.fdopen(read, "rb") as f:
        return f.read().decode()


@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
@_SINGLE_PROCESS
def test_a_process_forked_after_using_s3_saves_and_loads(s3):
    import torch.distributed.checkpoint as dcp

    import nvckpt.dcp

    server, prefix = s3
    state = _state(12)  # several 5 MiB parts
    nvckpt.save(state, f"{prefix}/parent.nvckpt")
    with nvckpt.open(f"{prefix}/parent.nvckpt") as ck:  # open in the parent, read in the child too
        assert torch.equal(ck.get_tensor("rows"), state["rows"])

        def child() -> str:
            options = {"part_size": 5 << 20}
            nvckpt.save(state, f"{prefix}/child.nvckpt", storage_options=options)
            assert_tree_equal(nvckpt.load(f"{prefix}/child.nvckpt"), state)
            assert_tree_equal(nvckpt.load(f"{prefix}/parent.nvckpt"), state)
            assert torch.equal(ck.get_slice("rows")[3:7], state["rows"][3:7])
            dcp.save({"w": state["rows"]}, storage_writer=nvckpt.dcp.Writer(f"{prefix}/child-dcp"))
            target = {"w": torch.zeros_like(state["rows"])}
            dcp.load(target, storage_reader=nvckpt.dcp.Reader(f"{prefix}/child-dcp"))
            assert torch.equal(target["w"], state["rows"])
            try:
                nvckpt.load(f"{prefix}/nothing.nvckpt")
            except FileNotFoundError as exc:
                return _one_line(exc)
            return "a missing key loaded"

        out = _in_forked_child(child)
        assert out.startswith("ok ") and "NoSuchKey" in out and "nothing.nvckpt" in out, out
        assert torch.equal(ck.get_tensor("big"), state["big"])
    # and the parent goes on with its own client
    nvckpt.save(state, f"{prefix}/parent-after.nvckpt")
    assert_tree_equal(nvckpt.load(f"{prefix}/child.nvckpt"), state)
    bucket = prefix.split("/")[2]
    assert server.open_uploads(bucket, prefix.split("/", 3)[3]) == []


@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
def test_an_upload_aborted_in_a_forked_child_leaves_nothing(s3):
    from nvckpt.io.s3 import open_target, open_uploads
    from nvckpt.io.target import SinkOptions

    server, prefix = s3
    nvckpt.save({"w": torch.ones(3)}, f"{prefix}/before.nvckpt")  # obstore has run in this process
    url = f"{prefix}/aborted.nvckpt"

    def child() -> str:
        target = open_target(url, {"part_size": 5 << 20, "parts_in_flight": 2})
        sink = target.open_sink(SinkOptions(direct=False))
        for _ in range(3):
            sink.write(bytes(4 << 20))  # 12 MiB: two parts sent, the third buffered
        open_before = len(open_uploads(url, exact=True))
        target.abort()
        return f"{open_before} open before the abort"

    out = _in_forked_child(child)
    assert out == "ok 1 open before the abort", out
    bucket, key = prefix.split("/")[2], url.split("/", 3)[3]
    assert server.open_uploads(bucket, key) == [] and key not in server.keys(bucket, key)


# -- DCP with 2 ranks over gloo, and a resharded load -------------------------------------------

def _two_ranks(rank: int, world: int, store: str, url: str, env: dict) -> None:
    import datetime
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    import nvckpt.dcp

    os.environ.update(env)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
        state = {"model": {"w": distribute_tensor(full, mesh, [Shard(0)]), "b": torch.arange(5)}, "step": 7}
        dcp.save(state, storage_writer=nvckpt.dcp.Writer(url))
        # resharded: saved by rows, loaded by columns
        target = {"model": {"w": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(1)]),
                            "b": torch.zeros(5, dtype=torch.int64)}, "step": 0}
        reader = nvckpt.dcp.Reader(url)
        dcp.load(target, storage_reader=reader)
        local = target["model"]["w"].to_local()
        assert torch.equal(local, full[:, rank * 24: (rank + 1) * 24]), rank
        assert torch.equal(target["model"]["b"], torch.arange(5)) and target["step"] == 7
        with open(f"{store}.ok{rank}", "w") as f:
            f.write("ok")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes over gloo against a real S3 server: tens of seconds on 2 shared cores
@_SINGLE_PROCESS
def test_dcp_two_ranks_save_and_reshard_on_s3(s3, tmp_path, capsys):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp

    import nvckpt.dcp
    from nvckpt.cli import main

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    server, prefix = s3
    url = f"{prefix}/step7"
    store = str(tmp_path / "store")
    mp.spawn(_two_ranks, args=(2, store, url, server.env()), nprocs=2, join=True)
    assert os.path.exists(f"{store}.ok0") and os.path.exists(f"{store}.ok1")
    # one process reads the whole of what two wrote, and the tools read it where it is
    full = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    target = {"model": {"w": torch.zeros(64, 48), "b": torch.zeros(5, dtype=torch.int64)}, "step": 0}
    dcp.load(target, storage_reader=nvckpt.dcp.Reader(url))
    assert torch.equal(target["model"]["w"], full)
    assert main(["verify", url]) == 0
    assert main(["merge", url, str(tmp_path / "merged.nvckpt")]) == 0
    merged = nvckpt.load(tmp_path / "merged.nvckpt")
    assert torch.equal(merged["model"]["w"], full) and merged["step"] == 7
    capsys.readouterr()


# -- nvckpt merge / split on s3:// directories ---------------------------------------------------

@pytest.mark.slow  # a real S3 server: seconds on 2 shared cores
@_SINGLE_PROCESS
def test_merge_and_split_on_s3_directories(s3, tmp_path, capsys):
    from nvckpt.cli import main

    server, prefix = s3
    state = {"model": {"w": torch.randn(64, 32), "b": torch.arange(4)}, "step": 5}
    nvckpt.save(state, f"{prefix}/one.nvckpt")
    assert main(["split", f"{prefix}/one.nvckpt", f"{prefix}/dir"]) == 0
    assert main(["split", str(tmp_path / "absent.nvckpt"), f"{prefix}/dir2"]) != 0
    capsys.readouterr()
    assert main(["split", f"{prefix}/one.nvckpt", f"{prefix}/dir"]) == 2  # an existing directory: --force
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists (a directory)" in err and "--force" in err, err
    assert main(["merge", f"{prefix}/dir", f"{prefix}/merged.nvckpt"]) == 0
    assert main(["merge", f"{prefix}/dir", str(tmp_path / "merged.nvckpt")]) == 0
    for merged in (nvckpt.load(f"{prefix}/merged.nvckpt"), nvckpt.load(tmp_path / "merged.nvckpt")):
        assert torch.equal(merged["model"]["w"], state["model"]["w"]) and merged["step"] == 5
    nvckpt.save({"model": {"w": state["model"]["w"] + 1}, "step": 6}, tmp_path / "local.nvckpt")
    assert main(["split", "--force", str(tmp_path / "local.nvckpt"), f"{prefix}/dir"]) == 0
    assert main(["merge", "--force", f"{prefix}/dir", f"{prefix}/merged.nvckpt"]) == 0
    assert nvckpt.load(f"{prefix}/merged.nvckpt")["step"] == 6
    capsys.readouterr()
    assert main(["convert", f"{prefix}/dir", f"{prefix}/c.nvckpt"]) == 2  # a directory: merge, not convert
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nvckpt merge" in err, err


@given(expected=st.one_of(st.none(), st.integers(0, 5 << 40)),
       part_mib=st.integers(5, 64), in_flight=st.integers(1, 16))
@settings(max_examples=300, deadline=None)
def test_part_plan_reaches_any_object_size_within_the_part_limit(expected, part_mib, in_flight):
    from nvckpt.io.s3 import MAX_PARTS, S3Options, part_plan

    opts = S3Options(part_size=part_mib << 20, parts_in_flight=in_flight)
    part, n = part_plan(opts, expected)
    if expected is None or part == opts.part_size:
        assert (part, n) == (opts.part_size, opts.parts_in_flight)  # what was configured, where it is enough
    else:  # larger parts, whole MiB, fewer in flight: the configured buffers where they hold 3 parts
        assert part > opts.part_size and part % (1 << 20) == 0 and n >= 2
        assert part * (n + 1) <= max(opts.part_size * (opts.parts_in_flight + 1), 3 * part)
    if expected is not None:
        assert part * MAX_PARTS * 9 // 10 >= expected  # with a tenth of the parts to spare


def test_a_save_expected_to_outgrow_the_parts_uploads_larger_parts(s3):
    from nvckpt.io.s3 import S3Target
    from nvckpt.io.target import SinkOptions

    server, prefix = s3
    url = f"{prefix}/large.bin"
    target = S3Target(url, nvckpt.io.s3.S3Options(part_size=5 << 20, parts_in_flight=4))
    target.check()
    sink = target.open_sink(SinkOptions(direct=False, expected_bytes=100 << 30))
    assert sink.part_size >= (100 << 30) // 9000 and sink.parts_in_flight == 2  # 12 MiB parts in 25 MiB of buffers
    data = os.urandom(3 << 20)
    for _ in range(6):
        sink.write(data)
    target.commit()
    source = nvckpt.io.source.open_source(url)
    try:
        assert source.size == 6 * len(data) and source.read(0, len(data)) == data
    finally:
        source.close()
