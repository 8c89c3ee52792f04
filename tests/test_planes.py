"""The portable codec's host fast path (nvckpt.codecs.planes) and the signshift filter (SPEC 11.9)."""

import io

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import example, given, settings
from hypothesis import strategies as st

import nvckpt
from nvckpt.codecs import ByteShuffle, Pipeline, SignShift, Zstd, planes
from nvckpt.codecs.presets import portable


@pytest.fixture(params=["c", "numpy"])
def kernel(request, monkeypatch):
    """Each test of the planes runs with the compiled kernel and with its numpy twin."""
    if request.param == "numpy":
        monkeypatch.setattr(planes, "_kernel", None)
    elif planes.kernel() != "c":
        pytest.skip("the compiled kernel is not built here")
    return request.param


@pytest.mark.parametrize("k,shift", [(1, False), (2, False), (2, True), (3, False), (4, True), (4, False), (8, True), (16, False)])
@pytest.mark.parametrize("n", [1, 37, 5000, 300_000])
def test_planes_round_trip_and_match_the_spec_steps(k, shift, n, kernel):
    raw = np.random.default_rng(n + k).integers(0, 256, n * k, dtype=np.uint8)
    out = np.empty(planes.chunk_bound(raw.nbytes, k), np.uint8)
    size = planes.encode_chunk(raw, k, shift, out)
    # Any zstd library decodes the frames; undoing the SPEC's steps gives the raw bytes back.
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(bytes(out[:size])), read_across_frames=True)
    data = reader.read(n * k + 1)
    while len(data) <= n * k and (more := reader.read(n * k + 1 - len(data))):
        data += more
    if k > 1:
        data = bytes(ByteShuffle(k).decode(memoryview(data), len(data)))
    if shift:
        data = bytes(SignShift(k).decode(memoryview(data), len(data)))
    assert data == raw.tobytes()
    back = np.empty_like(raw)
    planes.decode_chunk(out[:size], k, shift, back)
    assert np.array_equal(back, raw)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(k=st.sampled_from([2, 3, 4, 8, 16]), shift=st.booleans(), data=st.binary(max_size=3000),
       offset=st.integers(0, 7))
def test_the_kernel_writes_the_bytes_of_the_numpy_steps(k, shift, data, offset):
    if planes.kernel() != "c":
        return
    n = len(data) // k * k
    store = np.zeros(n + 8, np.uint8)
    raw = store[offset: offset + n]  # any alignment
    raw[:] = np.frombuffer(data[:n], np.uint8)
    want = np.empty(n, np.uint8)
    planes.split_numpy(raw, k, shift, want)
    got = np.full(n + 3, 7, np.uint8)
    planes.split(raw, k, shift, got)
    assert np.array_equal(got[:n], want) and (got[n:] == 7).all()
    back_numpy, back = np.empty(n, np.uint8), np.full(n + 3, 7, np.uint8)
    planes.join_numpy(want.copy(), k, shift, back_numpy)
    planes.join(want, k, shift, back[:n])
    assert np.array_equal(back_numpy, raw) and np.array_equal(back[:n], raw) and (back[n:] == 7).all()


def test_the_kernel_refuses_what_it_cannot_code():
    if planes.kernel() != "c":
        pytest.skip("the compiled kernel is not built here")
    k = planes._kernel
    buf = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="not a multiple of elementsize 4"):
        k.split(buf[:10], np.empty(10, np.uint8), 4, False)
    with pytest.raises(ValueError, match="fewer than 64"):
        k.join(buf, np.empty(63, np.uint8), 2, False)
    with pytest.raises(ValueError, match="overlap"):
        k.split(buf[:32], buf[16:48], 2, True)
    with pytest.raises(ValueError, match="at least 2 bytes"):
        k.split(buf, np.empty(64, np.uint8), 1, True)
    with pytest.raises(TypeError):
        k.join(buf, bytes(64), 2, False)  # not writable


def test_the_kernel_is_built_where_a_compiler_is():
    """An install that found a C compiler must not fall back to numpy without a word."""
    import shutil
    import sysconfig

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(compiler):
        pytest.skip(f"no C compiler ({compiler}) here")
    assert planes.kernel() == "c", "nvckpt/codecs/_planes.c was not built: pip install -e . builds it"


def test_one_frame_per_plane_and_literals_beat_matches_on_weights():
    w = (torch.randn(256, 512) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().reshape(-1)
    out = np.empty(planes.chunk_bound(w.nbytes, 2), np.uint8)
    size = planes.encode_chunk(w, 2, True, out)
    from nvckpt.codecs.builtin import zstd_window_sizes

    assert zstd_window_sizes(out[:size]) == [w.nbytes // 2] * 2  # single-segment frames of one plane each
    shuffled = bytes(ByteShuffle(2).encode(memoryview(bytes(SignShift(2).encode(memoryview(w.tobytes()))))))
    assert size < len(zstandard.ZstdCompressor(level=1).compress(shuffled))


def test_without_the_cffi_backend_frames_are_still_valid(monkeypatch):
    monkeypatch.setattr(planes, "_native", False)
    raw = (torch.randn(10000) * 0.1).view(torch.uint8).numpy()
    out = np.empty(planes.chunk_bound(raw.nbytes, 4), np.uint8)
    size = planes.encode_chunk(raw, 4, True, out)
    back = np.empty_like(raw)
    planes.decode_chunk(out[:size], 4, True, back)
    assert np.array_equal(back, raw) and size < raw.nbytes and planes.backend() == "zstandard-level1"


def test_decoding_rejects_wrong_lengths():
    raw = np.arange(4096, dtype=np.uint8)
    out = np.empty(planes.chunk_bound(raw.nbytes, 2), np.uint8)
    size = planes.encode_chunk(raw, 2, False, out)
    with pytest.raises(ValueError):
        planes.decode_chunk(out[:size], 2, False, np.empty(4094, np.uint8))
    with pytest.raises(ValueError):
        planes.decode_chunk(out[:size], 2, False, np.empty(4098, np.uint8))


def test_portable_presets_and_byte_identical_saves():
    assert [s.name for s in portable("bfloat16").steps] == ["signshift", "byteshuffle", "zstd"]
    assert [s.name for s in portable("float16").steps] == ["byteshuffle", "zstd"]
    assert [s.name for s in portable("uint8").steps] == ["zstd"]
    state = {"w": torch.randn(300, 200).to(torch.bfloat16), "m": torch.randn(300, 200), "i": torch.arange(999)}
    files = []
    for workers in (1, 2):
        buf = io.BytesIO()
        nvckpt.save(state, buf, codec="portable", workers=workers)
        files.append(buf.getvalue())
    assert files[0] == files[1]  # deterministic whatever the threads
    back = nvckpt.load(io.BytesIO(files[0]))
    assert all(torch.equal(back[k].view(torch.uint8), state[k].view(torch.uint8)) for k in state)


def test_signshift_checks_its_configuration():
    for bad in (0, 1, 3, 16, True, "2"):
        with pytest.raises(ValueError):
            SignShift(bad)
    with pytest.raises(ValueError):
        SignShift(4).decode(memoryview(b"123456"), 6)
    pipe = Pipeline((SignShift(2), ByteShuffle(2), Zstd(1)))
    data = memoryview(torch.randn(1000).to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
    assert bytes(pipe.decode(memoryview(bytes(pipe.encode(data))), len(data))) == bytes(data)


@pytest.mark.slow
def test_many_small_tensors_round_trip(tmp_path):
    state = {"state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.full((3,), float(i))} for i in range(3000)}}
    nvckpt.save(state, tmp_path / "s.nvckpt")
    back = nvckpt.load(tmp_path / "s.nvckpt")
    assert all(torch.equal(back["state"][i]["step"], state["state"][i]["step"]) for i in range(3000))


def _frames_cases():
    c = zstandard.ZstdCompressor(level=1)
    small = c.compress(b"abc" * 1000)
    # A frame that declares a 32 MiB window (non-single-segment, no content size): over SPEC 11.4's bound.
    cobj = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(
        window_log=25, write_content_size=False)).compressobj()
    big = cobj.compress(b"x" * 100) + cobj.flush()
    skippable = (0x184D2A50).to_bytes(4, "little") + (3).to_bytes(4, "little") + b"zzz"
    return {"one frame": (small, 3000), "two frames": (small + small, 6000), "skippable first": (skippable + small, 3000),
            "only skippable": (skippable, 0), "window over the bound": (big, 100), "cut": (small[:-2], 3000),
            "junk after": (small + b"\x00\x01", 3000), "empty": (b"", 0), "bad magic": (b"\x00" * 16, 16)}


def _window_outcomes(data: bytes, n: int, monkeypatch, walks: int = 3) -> list[tuple[str, bytes | None]]:
    """decode_frames' outcome with each walk of the frames: the kernel's, libzstd's (through cffi), the
    pure-Python parser's (check_zstd_window, where neither is)."""
    outcomes = []
    for native, kernel in ((None, planes._frames), (None, None), (False, None))[:walks]:
        monkeypatch.setattr(planes, "_native", native)
        monkeypatch.setattr(planes, "_frames", kernel)
        out = np.empty(n, np.uint8)
        try:
            planes.decode_frames(data, out)
            outcomes.append(("ok", bytes(out)))
        except ValueError as exc:
            outcomes.append(("window" if "SPEC 11.4" in str(exc) else "error", None))
    return outcomes


@pytest.mark.parametrize("case", list(_frames_cases()))
def test_native_window_check_agrees_with_the_python_parser(case, monkeypatch):
    """decode_frames checks SPEC 11.4 in the kernel (frame and block headers walked in C, the GIL kept), else
    in libzstd; the pure-Python parser (check_zstd_window) is the last fallback: all accept and refuse the
    same chunks."""
    if not planes._load_native() or planes._frames is None:
        pytest.skip("no cffi backend or no kernel")
    data, n = _frames_cases()[case]
    outcomes = _window_outcomes(data, n, monkeypatch)
    assert outcomes[0] == outcomes[1] == outcomes[2], outcomes
    assert (outcomes[0][0] == "ok") == (case in ("one frame", "two frames", "skippable first"))
    if case == "window over the bound":
        assert outcomes[0][0] == "window"


def _frames_of(draw_bytes: bytes, window_log: int, single: bool, checksum: bool) -> bytes:
    params = zstandard.ZstdCompressionParameters(window_log=window_log, write_content_size=single,
                                                 write_checksum=checksum)
    if single:
        return zstandard.ZstdCompressor(compression_params=params).compress(draw_bytes)
    cobj = zstandard.ZstdCompressor(compression_params=params).compressobj()
    return cobj.compress(draw_bytes) + cobj.flush()


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.tuples(st.binary(max_size=3000), st.integers(10, 26), st.booleans(), st.booleans(),
                                st.booleans()), min_size=0, max_size=3),
       cut=st.integers(0, 40), flip=st.one_of(st.none(), st.tuples(st.integers(0, 10**6), st.integers(1, 255))))
@example(parts=[(b"\0\0\0", 16, False, False, True), (b"", 10, False, False, False), (b"", 10, False, False, False)],
         cut=0, flip=(16, 128))  # a window log above 31: libzstd's error too
def test_the_kernels_frame_walk_agrees_with_libzstd_on_any_chunk(parts, cut, flip):
    """Frames of any window (single-segment or not, with checksums, skippable ones between), cut short or with
    a byte changed: the kernel's walk and libzstd's give decode_frames one outcome (the Python fallback decodes
    through python-zstandard, whose errors on damaged frames are its own: compared on the cases above only)."""
    if not planes._load_native() or planes._frames is None:
        pytest.skip("no cffi backend or no kernel")
    data, n = b"", 0
    for raw, window_log, single, checksum, skippable in parts:
        if skippable:
            data += (0x184D2A53).to_bytes(4, "little") + (len(raw) % 9).to_bytes(4, "little") + raw[: len(raw) % 9]
        data += _frames_of(raw * 8, window_log, single, checksum)
        n += len(raw) * 8
    data = data[: max(0, len(data) - cut)] if cut < 20 else data
    if flip is not None and data:
        at, mask = flip
        b = bytearray(data)
        b[at % len(b)] ^= mask
        data = bytes(b)
    with pytest.MonkeyPatch.context() as mp:
        outcomes = _window_outcomes(data, n, mp, walks=2)
    assert outcomes[0] == outcomes[1], outcomes


def test_the_zstd_level_is_honoured_and_integers_are_matched():
    """portable ignored zstd_level (every level wrote the same bytes, the index naming another), and coded
    integer and byte planes as literals only, missing their repeats (a counter, text)."""
    import io

    import torch

    import nvckpt

    state = {"counter": torch.arange(200_000) % 1000,
             "text": torch.tensor(list(b"hello world, this is text " * 4000), dtype=torch.uint8)}
    raw = sum(t.numel() * t.element_size() for t in state.values())

    def size(level: int) -> int:
        out = io.BytesIO()
        nvckpt.save(state, out, codec="portable", zstd_level=level)
        assert_equal = nvckpt.load(io.BytesIO(out.getvalue()))
        assert all(torch.equal(assert_equal[k], v) for k, v in state.items())
        return len(out.getvalue())

    level1, level19 = size(1), size(19)
    assert level1 * 40 < raw  # matched, not literals only (those left ~7x of the counter)
    assert level19 < level1
    weights = {"w": torch.randn(300_000).to(torch.bfloat16)}
    sizes = []
    for level in (1, 3):
        out = io.BytesIO()
        nvckpt.save(weights, out, codec="portable", zstd_level=level)
        sizes.append(len(out.getvalue()))
        with nvckpt.open(io.BytesIO(out.getvalue())) as ck:
            assert any(step.get("configuration", {}).get("level") == level
                       for codec in ck.index.codecs for step in codec)
    if planes.backend() == "libzstd-sequences":  # (python-zstandard's public API alone codes each level as it is)
        assert sizes[1] <= sizes[0]  # a level above 1 keeps the literals frame where it is the smaller


@pytest.mark.parametrize("n", [0, 1, 2, 31, 8160, 8161, 8192, 300_001])
def test_repeats_counts_bytes_equal_to_the_one_before(n, kernel):
    rng = np.random.default_rng(n)
    data = rng.integers(0, 3, n, dtype=np.uint8)
    assert planes.repeats(data) == sum(int(data[i] == data[i - 1]) for i in range(1, n))
    if n > 8:  # a view at an odd offset: the kernel reads any alignment
        assert planes.repeats(data[3:]) == int(np.count_nonzero(data[4:] == data[3:-1]))
    zeros = np.zeros(n, np.uint8)  # every byte repeats: the kernel's byte lanes count 255 steps, not 256
    assert planes.repeats(zeros) == max(n - 1, 0) == planes.repeats(bytes(n))
    assert planes.repeats(np.zeros(max(n // 4, 1), np.float32)) == max(n // 4, 1) * 4 - 1  # bytes, not elements


def test_a_kernel_without_repeats_falls_back_to_numpy(monkeypatch):
    """An editable install whose compiled kernel predates repeats() (built before a pull) must still encode."""
    if planes.kernel() != "c":
        pytest.skip("the compiled kernel is not built here")
    old = type("OldKernel", (), {"split": staticmethod(planes._kernel.split), "join": staticmethod(planes._kernel.join)})
    monkeypatch.setattr(planes, "_kernel", old)
    raw = np.zeros(4096, np.uint8)
    out = np.empty(planes.chunk_bound(raw.nbytes, 4), np.uint8)
    size = planes.encode_chunk(raw, 4, True, out)
    back = np.empty_like(raw)
    planes.decode_chunk(out[:size], 4, True, back)
    assert np.array_equal(back, raw) and planes.repeats(raw) == 4095


def test_low_planes_with_runs_are_matched_and_random_ones_are_not(kernel):
    """MiniLM's fp32 weights hold rows whose low bytes are zero (values of a shorter type): literals alone
    left those runs almost as they were (77 KB of 74 MB), matches code them.  Random low planes keep
    their literals frame (no match search spent on them)."""
    rng = np.random.default_rng(0)
    w = torch.from_numpy(rng.standard_normal((64, 1024), dtype=np.float32) * 0.05)
    w[::4] = w[::4].to(torch.bfloat16).float()  # every 4th row: low two bytes zero
    raw = w.view(torch.uint8).numpy().reshape(-1)
    out = np.empty(planes.chunk_bound(raw.nbytes, 4), np.uint8)
    size = planes.encode_chunk(raw, 4, True, out)
    back = np.empty_like(raw)
    planes.decode_chunk(out[:size], 4, True, back)
    assert np.array_equal(back, raw)
    m = raw.nbytes // 4
    split = np.empty_like(raw)
    planes.split(raw, 4, True, split)
    literals = np.empty(planes.plane_bound(m), np.uint8)
    if planes.backend() == "libzstd-sequences":
        ffi, lib = planes._load_native()
        lit = sum(planes._frame_literals(ffi, lib, ffi.from_buffer("char[]", split[j * m:]), m,
                                         ffi.from_buffer("char[]", literals, require_writable=True), literals.nbytes)
                  for j in range(4))
        assert size + 10_000 < lit  # the zero runs of planes 0 and 1 matched (literals coded each zero in ~2 bits)
    noise = torch.from_numpy(rng.standard_normal(65536, dtype=np.float32)).view(torch.uint8).numpy()
    planes.split(noise, 4, True, split[: noise.nbytes])
    assert not any(planes._runs(split[j * 65536: (j + 1) * 65536]) for j in range(3))
    # the bar: 1 in 50 repeats; 1 in 30 is a run, 1 in 100 is not
    for every, runs in ((30, True), (100, False)):
        plane = np.arange(30_000, dtype=np.uint8) * 7  # no byte equals the one before
        plane[::every] = plane[np.arange(0, 30_000, every) - 1]
        assert planes._runs(plane) is runs
