"""Checkpoints in file objects: save writes at the stream's position and load reads from its position (as
torch.save / torch.load do), checkpoints back to back, the end of a stream, short reads and writes, and what
is not a file object."""

from __future__ import annotations

import io
import os

import pytest
import torch

import nvckpt
from conftest import assert_tensor_equal


def test_a_checkpoint_in_a_stream_after_a_header_is_read_from_where_it_begins():
    """save writes at the stream's position; load and open read from the position the stream has (as
    torch.load does), and a stream left at its end is read from its start."""
    buf = io.BytesIO()
    buf.write(b"MYHEADER\n")
    start = buf.tell()
    nvckpt.save({"w": torch.arange(5.0)}, buf)
    buf.seek(start)
    assert nvckpt.load(buf)["w"].tolist() == [0.0, 1, 2, 3, 4]
    buf.seek(start)
    with nvckpt.open(buf) as ck:
        assert ck.keys() == ["w"]
    plain = io.BytesIO()
    nvckpt.save({"x": 1}, plain)
    assert nvckpt.load(plain) == {"x": 1}  # written, not rewound
    buf.seek(0)
    with pytest.raises(nvckpt.FormatError, match="not an nvckpt file"):
        nvckpt.load(buf)  # the header is not a checkpoint


def test_checkpoints_saved_back_to_back_in_one_stream_load_in_turn():
    """As torch.load: a load leaves the stream just after its checkpoint, and a checkpoint followed by more
    bytes (a second save into the same stream) is not taken for a damaged one."""
    buf = io.BytesIO()
    nvckpt.save({"a": torch.ones(2)}, buf)
    first_end = buf.tell()
    nvckpt.save({"b": torch.zeros(3), "n": 7}, buf)
    buf.write(b"trailer")
    buf.seek(0)
    assert nvckpt.load(buf)["a"].tolist() == [1.0, 1.0]
    assert buf.tell() == first_end
    second = nvckpt.load(buf)
    assert second["n"] == 7 and second["b"].tolist() == [0.0, 0.0, 0.0]
    assert buf.read() == b"trailer"
    buf.seek(first_end)
    with nvckpt.open(buf) as ck:
        assert ck.keys() == ["b"]
    damaged = bytearray(buf.getvalue()[:first_end])
    damaged[-30] ^= 1  # the footer of a lone checkpoint: still refused, and named
    with pytest.raises(nvckpt.ChecksumError, match="footer"):
        nvckpt.load(io.BytesIO(bytes(damaged)))


def test_reading_checkpoints_from_a_stream_until_its_end_stops_there():
    """A loop that loads until EOFError (as with pickle.load) ends after the last checkpoint: a stream
    that nvckpt's reader left at its end is not read from its start again."""
    buf = io.BytesIO()
    for i in range(3):
        nvckpt.save({"i": i, "w": torch.full((2,), float(i))}, buf)
    buf.seek(0)
    seen = []
    while True:
        try:
            seen.append(nvckpt.load(buf)["i"])
        except EOFError as exc:
            assert isinstance(exc, nvckpt.EndOfStreamError) and "no checkpoint follows" in str(exc)
            break
        assert len(seen) <= 3
    assert seen == [0, 1, 2] and buf.tell() == len(buf.getvalue())
    nvckpt.save({"i": 3}, buf)  # written after the end, not rewound: read from the start, as before
    assert nvckpt.load(buf)["i"] == 0
    buf.seek(0)
    assert nvckpt.load(buf)["i"] == 0


def test_a_raw_stream_that_reads_fewer_bytes_than_asked_is_read_whole():
    """io.RawIOBase.read may return fewer bytes than asked (FileIO over 2 GiB, sockets): that is not a
    truncated file."""
    data = io.BytesIO()
    nvckpt.save({"w": torch.arange(100_000.0)}, data)

    class Short(io.RawIOBase):
        def __init__(self, b):
            self.b, self.pos = b, 0

        def readable(self):
            return True

        def seekable(self):
            return True

        def seek(self, pos, whence=0):
            self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else len(self.b) + pos)
            return self.pos

        def tell(self):
            return self.pos

        def read(self, n=-1):
            n = min(n if n >= 0 else len(self.b), 1000)
            out = self.b[self.pos: self.pos + n]
            self.pos += len(out)
            return out

    assert torch.equal(nvckpt.load(Short(data.getvalue()))["w"], torch.arange(100_000.0))


@pytest.mark.parametrize("target,says", [(b"\x89NVCKPT", "io.BytesIO"), (bytearray(8), "io.BytesIO"),
                                         (memoryview(b"x"), "io.BytesIO"), (None, "not NoneType"),
                                         (3, "not int")])
def test_what_is_not_a_path_or_a_file_object_is_named(target, says):
    with pytest.raises(TypeError, match=says):
        nvckpt.load(target)


def test_a_stream_that_does_not_seek_is_refused_with_one_line():
    r, w = os.pipe()
    os.write(w, b"\x89NVCKPT\n")
    os.close(w)
    with open(r, "rb") as pipe, pytest.raises(TypeError, match="does not seek"):
        nvckpt.load(pipe)


def test_a_stream_that_takes_fewer_bytes_than_given_gets_them_all():
    # io.RawIOBase.write may write less than asked (a socket, a pipe) and says how much: the rest was lost.
    class Short(io.RawIOBase):
        def __init__(self):
            self.buf = bytearray()

        def writable(self):
            return True

        def write(self, b):
            b = memoryview(b).cast("B")[:4096]
            self.buf += b
            return len(b)

    state = {"w": torch.randn(256, 64), "step": 3}
    out = Short()
    result = nvckpt.save(state, out)
    assert result.file_bytes == len(out.buf)
    got = nvckpt.load(io.BytesIO(bytes(out.buf)))
    assert_tensor_equal(got["w"], state["w"]) and got["step"] == 3

    class Stuck(Short):
        def write(self, b):
            return 0

    with pytest.raises(OSError, match="took no bytes"):
        nvckpt.save(state, Stuck())
