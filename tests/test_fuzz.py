"""Fuzzing nvckpt's reader in CI (short runs; tools/fuzz.py runs the long ones).

Property (SPEC.md 20): any input either loads (open, every key, row slices,
load()) or raises an NvckptError; never another exception, a crash, a hang,
or memory far above what the file declares.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import struct
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import nvckpt  # noqa: E402
import nvckpt.tools.recover  # noqa: E402,F401  (without it tools/fuzz.py's exercise_recover answers "absent")
from conformance import craft  # noqa: E402

_spec = importlib.util.spec_from_file_location("nvckpt_fuzz", os.path.join(ROOT, "tools", "fuzz.py"))
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)

SEEDS = fuzz.make_seeds() + fuzz.load_seed_files(os.path.join(ROOT, "conformance"))
ERROR_NAMES = {c.__name__ for c in (nvckpt.FormatError, nvckpt.TruncatedError, nvckpt.ChecksumError,
                                    nvckpt.UnsupportedCodecError, nvckpt.UnsupportedFeatureError, nvckpt.LimitError)}
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def holds(data: bytes) -> str:
    """The property: exercise() returns "ok" or an NvckptError's name, and raises nothing else."""
    result = fuzz.exercise(data)
    assert result == "ok" or result in ERROR_NAMES, result
    return result


@pytest.mark.slow
def test_seeds_load():
    assert len(SEEDS) > 20
    for data in fuzz.make_seeds():
        assert holds(data) == "ok"
    for data in SEEDS:  # conformance files with an unknown codec or dtype: that tensor fails, the file opens
        assert holds(data) in {"ok", "UnsupportedCodecError", "UnsupportedFeatureError"}


# -- structure-aware: one field of a valid file changed, checksums recomputed ----------------------------

@pytest.mark.slow
@FUZZ
@given(seed=st.integers(0, len(SEEDS) - 1), rng=st.randoms(use_true_random=False))
def test_structured_mutation(seed, rng):
    holds(fuzz.mutate_structured(SEEDS[seed], rng))


@pytest.mark.slow
@FUZZ
@given(seed=st.integers(0, len(SEEDS) - 1), rng=st.randoms(use_true_random=False))
def test_index_value_mutation(seed, rng):
    """One value anywhere in the index (entries, chunk tables, codecs, tree, metadata)."""
    nv = craft.parse(SEEDS[seed])
    nv.index = fuzz.mutate_value(nv.index, rng)
    try:
        nv.index_frame().payload = craft.pack(nv.index)
    except (OverflowError, ValueError, TypeError):
        return  # msgpack cannot hold the value the mutator picked
    holds(craft.build(nv, fix_index=False))


_HEADER_INTS = st.sampled_from(fuzz.INTERESTING) | st.integers(0, 2**64 - 1)


@pytest.mark.slow
@FUZZ
@given(seed=st.integers(0, len(SEEDS) - 1), which=st.integers(0, 1000), field=st.sampled_from(
    ["frame_type", "flags", "codec_id", "tensor_id", "chunk_index", "padding_length", "stored_length", "raw_length"]),
    value=_HEADER_INTS, fix_index=st.booleans())
def test_frame_header_field(seed, which, field, value, fix_index):
    nv = craft.parse(SEEDS[seed])
    frame = nv.frames[which % len(nv.frames)]
    if frame.padding is None:
        frame.padding = bytes(frame.padding_length)  # only the header field changes
    setattr(frame, field, value & fuzz.HEADER_LIMITS[field])
    holds(craft.build(nv, fix_index=fix_index))


@FUZZ
@given(seed=st.integers(0, len(SEEDS) - 1), field=st.sampled_from(["index_offset", "index_length", "index_checksum"]),
       value=_HEADER_INTS)
def test_footer_field(seed, field, value):
    nv = craft.parse(SEEDS[seed])
    craft.build(nv)
    setattr(nv.footer, field, value & (2**64 - 1))
    holds(craft.build(nv, fix_footer=False))


# -- deep nests and huge counts: what random mutation never reaches (issue 10) ---------------------------

def _nest_bytes(kind: str, depth: int, leaf: bytes) -> bytes:
    return fuzz.deep_nest(random.Random(depth), depth, kind)[:-1] + leaf if kind in ("list", "map") else \
        fuzz.deep_nest(random.Random(depth), depth, kind)


NESTS = st.builds(_nest_bytes, st.sampled_from(["list", "map", "tuple", "mixed"]),
                  st.sampled_from(fuzz.DEPTHS) | st.integers(1, 1100), st.sampled_from([b"\xc0", b"\x01", b"\x90"]))
COUNTS = (st.builds(lambda head, n, tail: head + n.to_bytes(4, "big") + tail, st.sampled_from([b"\xdd", b"\xdf", b"\xdb", b"\xc6"]),
                    st.sampled_from(fuzz.COUNTS) | st.integers(1 << 16, 2**32 - 1), st.sampled_from([b"", b"\xc0", b"\x90\x90"]))
          | st.builds(lambda item, n: b"\xdd" + n.to_bytes(4, "big") + item * n,
                      st.sampled_from([b"\x90", b"\x80", b"\xc0", b"\xa2ab", b"\xd4\x02\x90"]), st.integers(0, 50_000)))


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(seed=st.integers(0, len(SEEDS) - 1), raw=NESTS | COUNTS, place=st.sampled_from(fuzz.PLACES))
def test_deep_nests_and_huge_counts_anywhere(seed, raw, place):
    """A nest (1..5000 levels of arrays, maps, tuples or a mix) or a huge or lying count at any place a
    payload holds a value (tree, metadata, writer, unknown keys, entries, views, codec configurations,
    TENSOR and CODEC frames): a result or a named error, on the reader and on recover."""
    try:
        data = fuzz.place_hostile(SEEDS[seed], random.Random(seed), raw, place)
    except (AssertionError, ValueError, KeyError, IndexError, TypeError):
        return  # a seed without that place (a conformance file that is not well formed)
    holds(data)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, len(SEEDS) - 1), raw=NESTS | COUNTS, place=st.sampled_from(fuzz.PLACES))
def test_recover_on_deep_nests_and_huge_counts(tmp_path_factory, seed, raw, place):
    try:
        data = fuzz.place_hostile(SEEDS[seed], random.Random(seed), raw, place)
    except (AssertionError, ValueError, KeyError, IndexError, TypeError):
        return
    result = fuzz.exercise_recover(data, str(tmp_path_factory.mktemp("recover")))
    assert result == "ok" or result in ERROR_NAMES | {"NvckptError", "UsageError"}, result


# -- blind: random bytes, truncations, bit flips ----------------------------------------------------------

@FUZZ
@given(data=st.binary(max_size=600))
def test_random_bytes(data):
    holds(data)
    holds(craft.PREAMBLE_MAGIC + data)
    holds(SEEDS[0][:24] + data + SEEDS[0][-40:])


@FUZZ
@given(seed=st.integers(0, len(SEEDS) - 1), cut=st.floats(0, 1))
def test_truncation(seed, cut):
    data = SEEDS[seed]
    assert holds(data[: int(len(data) * cut)]) != "ok" or cut == 1


@pytest.mark.slow
@FUZZ
@given(seed=st.integers(0, len(SEEDS) - 1), flips=st.lists(st.integers(0, 2**40), min_size=1, max_size=8))
def test_bit_flips(seed, flips):
    data = bytearray(SEEDS[seed])
    for f in flips:
        data[(f >> 3) % len(data)] ^= 1 << (f & 7)
    holds(bytes(data))


def test_every_truncation_of_a_small_file_is_an_error():
    data = SEEDS[0]
    for n in range(len(data)):
        assert holds(data[:n]) in {"TruncatedError", "FormatError"}, n


@pytest.mark.slow
def test_every_single_byte_change_is_caught():
    """Change each byte of a file once: a random-access reader notices every change to a byte it uses.

    The bytes it may not notice are exactly those it never reads (SPEC.md 15.1): optional_features, and the
    headers and payloads of frames other than the INDEX frame (CHUNK payloads are checked through the index)."""
    data = SEEDS[5]
    nv = craft.parse(data)
    unread = set(range(16, 20))
    unread.update((10, 11))  # version_minor: any minor is accepted, and it need not equal the index's (8.1)
    for f in nv.frames:
        if f.frame_type != craft.INDEX:
            end = f.offset + 48 + f.padding_length + (len(f.payload) if f.frame_type != craft.CHUNK else 0)
            unread.update(range(f.offset, end))
    for i in range(len(data)):
        b = bytearray(data)
        b[i] ^= 0x5A
        if holds(bytes(b)) == "ok":
            assert i in unread, f"a change at byte {i} went unnoticed"


# -- regressions found by tools/fuzz.py -----------------------------------------------------------------

def _views_file() -> craft.NvFile:
    flat = torch.arange(12.0)
    buf = io.BytesIO()
    nvckpt.save({"a": flat[:4], "b": flat[2:10]}, buf)
    return craft.parse(buf.getvalue())


def test_tree_reference_to_an_internal_entry_loads():
    """Found by fuzzing: load() raised KeyError when the tree referred to an entry marked internal."""
    nv = _views_file()
    base = next(i for i, e in enumerate(nv.index["tensors"]) if e.get("internal"))
    nv.index["tree"]["base"] = fuzz.msgpack.ExtType(1, struct.pack("<I", base))
    data = craft.build(nv)
    loaded = nvckpt.load(io.BytesIO(data))
    assert torch.equal(loaded["base"], torch.arange(12.0)[:10])
    assert holds(data) == "ok"


@pytest.mark.parametrize("shape", [[0, 2**63 + 5], [0, 2**62, 8], [2**64 - 1, 0]])
def test_empty_tensor_with_a_huge_dimension_is_rejected(shape):
    """Found by fuzzing: torch.empty() raised TypeError for an empty shape with a dimension >= 2^63."""
    nv = _views_file()
    nv.index["tensors"].append({"name": "huge", "dtype": "float32", "shape": shape, "chunks": []})
    nv.index["tree"]["huge"] = fuzz.msgpack.ExtType(1, struct.pack("<I", len(nv.index["tensors"]) - 1))
    with pytest.raises((nvckpt.LimitError, nvckpt.FormatError)):
        nvckpt.open(io.BytesIO(craft.build(nv)))


def test_metadata_with_a_tensor_reference_is_rejected(tmp_path):
    """Found by fuzzing: an ext type in the metadata was accepted, and recover then failed to re-pack it."""
    nv = _views_file()
    nv.index["metadata"] = {"m": [fuzz.msgpack.ExtType(1, struct.pack("<I", 0))]}
    data = craft.build(nv)
    with pytest.raises(nvckpt.FormatError):
        nvckpt.open(io.BytesIO(data))
    assert fuzz.exercise_recover(data, str(tmp_path)) in {"ok", "absent"}


# -- memory and time bounds, in subprocesses ----------------------------------------------------------

MEASURE = r"""
import io, json, resource, sys, time
sys.path.insert(0, {root!r})
import nvckpt
import nvckpt.session.load  # torch: imported before the clock starts (12 s on a loaded 2-core machine)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {{}}
for path in {paths!r}:
    t = time.perf_counter()
    try:
        with nvckpt.open(path) as ck:
            for k in ck.keys():
                ck.get_tensor(k)
        out[path] = "ok"
    except nvckpt.NvckptError as exc:
        out[path] = type(exc).__name__
    out[path + ":s"] = time.perf_counter() - t
out["grew_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps(out))
"""


@pytest.mark.slow
def test_decompression_bombs_stay_small():
    """zstd frames that hold 256 MiB and 64 MiB for 1 KiB chunks: rejected without allocating their size."""
    paths = [os.path.join(ROOT, "conformance", "files", f"{c}.nvckpt")
             for c in ("zstd-bomb-declared", "zstd-bomb-undeclared", "zstd-lies-content-size")]
    p = subprocess.run([sys.executable, "-c", MEASURE.format(root=ROOT, paths=paths)], capture_output=True, text=True,
                       timeout=120)
    out = json.loads(p.stdout)
    assert all(out[path] == "FormatError" for path in paths), out
    assert out["grew_kib"] < 48 * 1024, f"peak RSS grew by {out['grew_kib']} KiB"
    assert all(out[path + ":s"] < 5 for path in paths), out


@pytest.mark.slow
def test_fuzzer_under_memory_and_time_limits(tmp_path):
    """tools/fuzz.py in a subprocess: address space capped (setrlimit) at start + 1 GiB, 10 s per input.

    A crash, hang, MemoryError or non-NvckptError exception is a finding and a non-zero exit."""
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "fuzz.py"), "--inputs", "1500", "--workers", "1", "--seed", "5",
         "--mem-mb", "1024", "--timeout", "10", "--recover-every", "5", "--out", str(tmp_path / "findings"),
         "--scratch", str(tmp_path / "scratch"), "--log-every", "1000"],
        capture_output=True, text=True, timeout=600)
    last = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0 and not last["findings"], (last, os.listdir(tmp_path / "findings")
                                                        if (tmp_path / "findings").exists() else None)
    assert last["inputs"] == 1500
    assert last["outcomes"].get("ok", 0) > 50 and last["outcomes"].get("FormatError", 0) > 50


def test_coverage_guided_fuzzing_of_every_reading_path_and_tool(tmp_path):
    """tools/fuzz.py's atheris engine (libFuzzer's coverage feedback over nvckpt's own code, the structure-aware
    mutations as its mutator) over --targets all: the reading API, load(untrusted=True), `nvckpt info | ls | verify
    | recover | convert` of a file and `info | ls | verify | merge` of a DCP directory whose rank file, manifest or
    .metadata is the input.  A fixed time (45 s of fuzzing; about 2 min in all on a loaded 2-core machine) so that CI's budget holds; an input
    that breaks the property is kept in findings/ with its traceback and fails the test."""
    pytest.importorskip("atheris")
    out = tmp_path / "findings"
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "fuzz.py"), "--engine", "atheris", "--targets", "all",
         "--out", str(out), "--scratch", str(tmp_path / "scratch"), "--timeout", "60", "--mem-mb", "2048",
         "--", "-max_total_time=45", "-seed=1"],
        capture_output=True, text=True, timeout=600)
    found = sorted(out.glob("*.txt")) if out.exists() else []
    assert p.returncode == 0 and not found, (p.returncode, p.stderr[-4000:],
                                             [(f.name, f.read_text()[-2000:]) for f in found])
    runs = [int(line.split()[-1]) for line in p.stderr.splitlines() if line.startswith("stat::number_of_executed_units")]
    assert runs and runs[0] >= 100, p.stderr[-2000:]


# -- recovery walks damaged files too -----------------------------------------------------------------

@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, len(SEEDS) - 1), rng=st.randoms(use_true_random=False))
def test_recover_on_mutants(tmp_path_factory, seed, rng):
    data = fuzz.mutate(SEEDS[seed], rng, SEEDS)
    result = fuzz.exercise_recover(data, str(tmp_path_factory.mktemp("recover")))
    assert result == "ok" or result in ERROR_NAMES | {"NvckptError", "UsageError"}, result


def test_mutators_are_deterministic():
    a = fuzz.mutate(SEEDS[3], random.Random(10), SEEDS)
    b = fuzz.mutate(SEEDS[3], random.Random(10), SEEDS)
    assert a == b and a != SEEDS[3]
