"""NumPy arrays and pathlib paths in the saved object (SPEC 9.3, required feature bit 2, format 1.2): stored as
a tensor entry referenced as an array (ext 9) and as a path's class and str (ext 10), loaded back as what they
were, never through pickle."""

from __future__ import annotations

import io
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import nvckpt
from conformance import craft, reference_reader
from nvckpt.format import structs
from nvckpt.format.constants import FEATURE_ARRAYS_PATHS, FEATURE_TYPED_TREE

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
          "float64", "complex64", "complex128"]


def roundtrip(obj, **kw):
    buf = io.BytesIO()
    nvckpt.save(obj, buf, **kw)
    return nvckpt.load(io.BytesIO(buf.getvalue())), buf.getvalue()


def same_array(back, arr) -> None:
    """Same dtype (native byte order), shape and bytes in C order; a plain C-contiguous ndarray."""
    assert type(back) is np.ndarray
    assert back.dtype == arr.dtype.newbyteorder("=") and back.shape == arr.shape
    assert back.flags.c_contiguous
    assert back.tobytes() == np.array(arr, dtype=arr.dtype.newbyteorder("="), order="C").tobytes()


def layouts(arr: np.ndarray) -> st.SearchStrategy:
    """The array as stored by a user: itself, Fortran-ordered, transposed, strided, reversed, big-endian."""
    options = [arr, np.asfortranarray(arr), arr.T, arr.astype(arr.dtype.newbyteorder(">"))]
    if arr.ndim:
        options += [arr[::2], arr[::-1]]
    return st.sampled_from(options)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(DTYPES).flatmap(
    lambda d: hnp.arrays(d, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))).flatmap(layouts),
    st.sampled_from(["raw", "zstd"]))
def test_arrays_round_trip_bit_exact(arr, codec):
    back, data = roundtrip({"a": arr, "t": (arr, 1)}, codec=codec)
    same_array(back["a"], arr)
    same_array(back["t"][0], arr)
    assert data[10:16] == bytes([2, 0, FEATURE_ARRAYS_PATHS, 0, 0, 0])  # version 1.2, required_features bit 2 only


def test_zero_d_empty_and_shared_arrays():
    base = np.arange(12, dtype=np.int32)
    obj = {"zero_d": np.array(2.5), "empty": np.zeros((0, 4), np.float32), "scalar_u64": np.array(2**64 - 1, np.uint64),
           "whole": base, "head": base[:4], "tensor": torch.from_numpy(base)}
    back, _ = roundtrip(obj)
    same_array(back["zero_d"], obj["zero_d"])
    same_array(back["empty"], obj["empty"])
    assert back["scalar_u64"].item() == 2**64 - 1
    same_array(back["whole"], base)
    same_array(back["head"], base[:4])
    assert torch.equal(back["tensor"], torch.from_numpy(base))
    assert back["head"].base is not None  # arrays sharing memory are stored once and share memory again
    back["whole"][0] = 99
    assert back["head"][0] == 99


def test_numpy_legacy_random_state_continues_identically():
    np.random.seed(1234)
    np.random.standard_normal(3)  # a cached Gaussian: has_gauss = 1
    state = np.random.get_state()
    expected = np.random.random(5)
    back, _ = roundtrip({"rng": state})
    assert isinstance(back["rng"], tuple) and back["rng"][1].dtype == np.uint32
    np.random.seed(0)
    np.random.set_state(back["rng"])
    assert np.array_equal(np.random.random(5), expected)


@pytest.mark.parametrize("bit_generator", [np.random.MT19937, np.random.PCG64, np.random.Philox, np.random.SFC64])
def test_generator_state_continues_identically(bit_generator):
    g = np.random.Generator(bit_generator(7))
    g.standard_normal(3)
    state = g.bit_generator.state
    expected = g.integers(0, 2**63, 8)
    back, _ = roundtrip({"g": state})
    other = np.random.Generator(bit_generator(0))
    other.bit_generator.state = back["g"]
    assert np.array_equal(other.integers(0, 2**63, 8), expected)


@pytest.mark.parametrize("path", [pathlib.Path("/data/run 1/shard.bin"), pathlib.Path("relative/x"), pathlib.Path("."),
                                  pathlib.PurePosixPath("/a/b"), pathlib.PureWindowsPath(r"C:\runs\é\x.ckpt"),
                                  pathlib.PureWindowsPath(r"\\server\share\dir")])
def test_paths_round_trip_as_their_class(path):
    back, data = roundtrip({"hparams": {"data_dir": path, "many": [path, (path,)]}})
    for value in (back["hparams"]["data_dir"], back["hparams"]["many"][0], back["hparams"]["many"][1][0]):
        assert type(value) is type(path) and value == path and str(value) == str(path)
    assert data[12] == FEATURE_ARRAYS_PATHS


def test_a_windows_path_read_on_posix_is_a_pure_windows_path():
    """SPEC 9.3: a concrete path of the other system's flavour, which Python cannot make here, is its pure class."""
    data = io.BytesIO()
    nvckpt.save({"p": pathlib.PureWindowsPath(r"C:\a"), "w": torch.ones(1)}, data, codec="raw")
    nv = craft.parse(data.getvalue())
    stored = b"\xc7\x05\x0a\x01C:\\a"  # ext 10 of 5 bytes: flavour 1 (PureWindowsPath), then its str
    assert stored in nv.index_frame().payload
    nv.index_frame().payload = nv.index_frame().payload.replace(stored, b"\xc7\x05\x0a\x03C:\\a")  # WindowsPath
    back = nvckpt.load(io.BytesIO(craft.build(nv)))
    assert type(back["p"]) is pathlib.PureWindowsPath and str(back["p"]) == r"C:\a"


def test_names_keys_and_partial_loads():
    state = {"model": {"w": torch.ones(2)}, "rng": np.random.RandomState(3).get_state(), "dir": pathlib.Path("/d")}
    buf = io.BytesIO()
    nvckpt.save(state, buf)
    with nvckpt.open(io.BytesIO(buf.getvalue())) as ck:
        assert ck.keys() == ["model/w", "rng/1"]
        assert type(ck["rng/1"]) is np.ndarray and "rng/1" in ck
        assert ck.get_tensor("rng/1").dtype == torch.uint32  # the stored tensor, for readers that want one
        assert ck.load("rng")[1].dtype == np.uint32 and ck.load(["rng/1"])["rng/1"].shape == (624,)
        assert ck["dir"] == pathlib.Path("/d")
        assert ck.get_slice("rng/1")[:4].tolist() == state["rng"][1][:4].tolist()


def test_both_feature_bits_and_files_without_them_unchanged():
    _, data = roundtrip({"d": torch.float16, "p": pathlib.Path("/x")})
    assert data[10] == 2 and data[12] == FEATURE_TYPED_TREE | FEATURE_ARRAYS_PATHS
    _, plain = roundtrip({"w": torch.ones(2), "n": np.float64(1.5), "i": np.int64(3)})  # NumPy scalars: Python numbers
    assert plain[10] == 0 and plain[12] == 0


def test_older_readers_refuse_at_the_preamble(monkeypatch):
    """SPEC 3, 9.3: a reader without bit 2 (nvckpt 1.1, the independent reader without it) refuses the file before
    its index with UnsupportedFeatureError naming bit 2, never as a malformed tree."""
    buf = io.BytesIO()
    nvckpt.save({"rng": np.random.get_state()}, buf)
    monkeypatch.setattr(structs, "KNOWN_REQUIRED_FEATURES", FEATURE_TYPED_TREE)
    with pytest.raises(nvckpt.UnsupportedFeatureError, match="bit 2"):
        nvckpt.open(io.BytesIO(buf.getvalue()))
    monkeypatch.setattr(reference_reader, "ARRAYS_PATHS", 0)
    with pytest.raises(reference_reader.UnsupportedFeatureError, match=r"\[2\]"):
        reference_reader.check_preamble(buf.getvalue())


def test_cli_info_and_ls_show_arrays_and_paths(tmp_path):
    path = tmp_path / "s.nvckpt"
    nvckpt.save({"rng": np.random.get_state(), "dir": pathlib.Path("/d"), "w": torch.ones(3)}, path)
    run = lambda *a: subprocess.run([sys.executable, "-m", "nvckpt", *a, str(path)], capture_output=True, text=True,
                                    check=True).stdout
    info = run("info")
    assert "nvckpt 1.2" in info and "arrays and paths (9.3)" in info
    assert "1 names load as NumPy arrays, 1 pathlib paths" in info
    ls = run("ls")
    assert any(line.startswith("rng/1") and line.endswith("data (ndarray)") for line in ls.splitlines()), ls


def test_recover_keeps_arrays_and_paths(tmp_path):
    """nvckpt recover of an intact file keeps the tree: an array stays an array, a path a path (bit 2 kept)."""
    from nvckpt.tools.recover import recover

    src, out = tmp_path / "s.nvckpt", tmp_path / "r.nvckpt"
    state = {"rng": np.random.RandomState(5).get_state(), "dir": pathlib.PurePosixPath("/d"), "w": torch.ones(2)}
    nvckpt.save(state, src)
    assert recover(str(src), str(out)).tree_kept
    back = nvckpt.load(out)
    same_array(back["rng"][1], state["rng"][1])
    assert type(back["dir"]) is pathlib.PurePosixPath and back["dir"] == state["dir"]
    assert out.read_bytes()[12] == FEATURE_ARRAYS_PATHS
