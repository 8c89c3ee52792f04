"""Hostile files through every reading path, in child processes under a memory cap.

tools/hostile.py builds the files (nests and counts in every msgpack payload,
indexes of many chunks and tensors, a small legal file declaring a 2 GiB
tensor, a 64 GiB stride-0 view, and the conformance suite's hostile cases) and
runs each through open/load on the CPU, untrusted=True, info, ls (library and
CLI), verify, recover and the GPU loader's code on the host backend, in a
forked child whose address space is capped (RLIMIT_AS) at 1.5 GiB above its
parent's.  Every path must end in a result or a named NvckptError; no child
may die of a signal; and each path's peak memory must stay within
``PEAK_BOUND(file bytes)``.

The last tests measure the index parser: a file listing a million chunks
opens in at most 2 s and 500 MB, one of a million tensors (and its keys) in 2 s of CPU and 300 MB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTILE = os.path.join(ROOT, "tools", "hostile.py")
NAMED = {"ok", "NvckptError", "FormatError", "TruncatedError", "ChecksumError", "UnsupportedCodecError",
         "UnsupportedFeatureError", "LimitError"}
MiB = 1 << 20


def PEAK_BOUND(file_bytes: int) -> int:
    """The most one reading path may add to a process's peak memory for a file of ``file_bytes``: a constant
    for what any read costs (numpy, threads, buffers of 16 MiB chunks) plus 64 bytes a byte of file, which
    covers the worst expansion of msgpack into Python objects (an empty map: 1 byte -> 64) once."""
    return 128 * MiB + 64 * file_bytes


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # Minutes on 2 shared cores (every file through every path, each in a child): its tests are marked slow.
    folder = tmp_path_factory.mktemp("hostile")
    p = subprocess.run([sys.executable, HOSTILE, "--out", str(folder), "--json"], capture_output=True, text=True,
                       timeout=900)
    assert p.stdout.strip(), p.stderr[-3000:]
    return {r["file"].removesuffix(".nvckpt"): r for r in json.loads(p.stdout)}


@pytest.mark.slow
def test_no_crash_no_unnamed_error_and_bounded_memory(results):
    assert len(results) > 60
    problems = []
    for name, r in results.items():
        if r["crashed"]:
            problems.append(f"{name}: killed by signal {r['crashed']}")
        for path, outcome in r["outcomes"].items():
            if outcome not in NAMED:
                problems.append(f"{name}: {path}: {outcome}")
        for path, peak in (r.get("peaks") or {}).items():
            if peak > PEAK_BOUND(r["bytes"]):
                problems.append(f"{name}: {path} peaked {peak >> 20} MiB above its start, more than "
                                f"{PEAK_BOUND(r['bytes']) >> 20} MiB for {r['bytes']} bytes")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_every_path_ran_on_every_file(results):
    paths = {"load", "untrusted", "info", "ls", "cli-info", "cli-ls", "verify", "recover", "gpu-host"}
    assert all(set(r["outcomes"]) == paths for r in results.values())


@pytest.mark.slow
def test_nests_are_named_errors_everywhere(results):
    """Tuples 200 deep (msgpack's C unpacker crashed on them) and arrays 5000 deep, in every payload of the index.
    Under a key a reader ignores (the writer map, unknown keys, a view's unknown key) tuples are ext data, which is
    never parsed outside the tree (SPEC 1): those files load."""
    ignored = ("writer", "unknown-key", "entry-key", "view")
    for place in ("tree", "metadata", "writer", "unknown-key", "entry-key", "entry-shape", "view", "codec-config"):
        for kind in ("tuples-200", "arrays-5000", "maps-1025", "array-count-2p32"):
            r = results[f"{place}-{kind}"]
            for path in ("load", "untrusted", "info", "ls", "verify", "gpu-host"):
                if kind == "tuples-200" and place in ignored:
                    if path != "verify":  # verify: the view's copy in its TENSOR frame lacks the key (4.3)
                        assert r["outcomes"][path] == "ok", (place, kind, path, r["outcomes"])
                    continue
                assert r["outcomes"][path] in {"LimitError", "FormatError"}, (place, kind, path, r["outcomes"])
    for frame in ("tensor-frame", "codec-frame"):  # only the streaming side (verify, recover) parses them
        for kind in ("tuples-200", "arrays-5000", "array-count-2p32"):
            r = results[f"{frame}-{kind}"]
            assert r["outcomes"]["load"] == "ok" and r["outcomes"]["verify"] == "FormatError", (frame, kind, r)


@pytest.mark.slow
def test_a_huge_declared_tensor_and_a_stride0_view_are_bounded(results):
    huge = results["huge-tensor-2g"]
    assert huge["outcomes"]["load"] == "LimitError" and huge["outcomes"]["gpu-host"] == "LimitError"
    assert huge["outcomes"]["verify"] == "ok"  # the file is legal: every chunk decodes and checks
    view = results["stride0-view-64g"]
    assert view["outcomes"]["load"] == "ok" and view["outcomes"]["untrusted"] == "LimitError"  # max_tensor_bytes


@pytest.mark.slow
def test_verify_rejects_what_load_rejects(results):
    for cid in ("bool-byte-2", "chunk-frame-padding-nonzero", "chunk-list-long-negative", "zstd-bomb-declared"):
        assert results[cid]["outcomes"]["verify"] == "FormatError", cid
    assert results["bool-byte-2"]["outcomes"]["load"] == "FormatError"


# -- the index parser: a million chunks in <= 2 s and <= 500 MB --------------------------------------

OPEN = r"""
import json, sys, time, gc
sys.path.insert(0, {root!r})
import nvckpt
import nvckpt.session.load
from nvckpt.read.reader import ChunkReader

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

ChunkReader({small!r}).close()  # imports (numpy too) before the measurement
seconds, cpu, grew = [], [], 0
for _ in range(3):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = status("VmRSS")
    t, c = time.perf_counter(), time.process_time()
    if {keys!r}:
        reader = nvckpt.open({path!r})
        n = len(reader.keys())
    else:
        reader = ChunkReader({path!r})
    seconds.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
    grew = max(grew, status("VmHWM") - start)
    if not {keys!r}:
        n = sum(len(e.chunks or ()) for e in reader.index.tensors)
    reader.close()
    del reader
    gc.collect()
print(json.dumps({{"seconds": seconds, "cpu": cpu, "grew": grew, "count": n}}))
"""


def _open_stats(tmp_path, name: str, make: str, keys: bool = False) -> dict:
    """Three opens of the file ``hostile.<make>`` builds, each in the same fresh process: wall and CPU seconds,
    the most memory one added, and its chunks (a ChunkReader's) or, with ``keys``, its keys (nvckpt.open's)."""
    path = tmp_path / f"{name}.nvckpt"
    small = tmp_path / "small.nvckpt"
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); sys.path.insert(0, {os.path.join(ROOT, 'tools')!r}); "
            f"import hostile; open({str(path)!r}, 'wb').write(hostile.{make}); "
            f"open({str(small)!r}, 'wb').write(hostile.many_chunks(2000))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)
    p = subprocess.run([sys.executable, "-c", OPEN.format(root=ROOT, path=str(path), small=str(small), keys=keys)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    out["file_bytes"] = path.stat().st_size
    print(name, out)
    return out


@pytest.mark.slow
def test_open_a_million_chunks_in_2s_and_500mb(tmp_path):
    out = _open_stats(tmp_path, "chunks-1m", "many_chunks(1_000_000)")
    assert out["count"] == 1_000_000
    assert min(out["seconds"]) <= 2.0, out  # best of three: CI machines are shared
    assert out["grew"] <= 500 * MiB, out
    assert out["grew"] <= 12 * out["file_bytes"], out  # memory proportional to the index (19 MB here)


@pytest.mark.slow
def test_open_many_tensors_memory_is_proportional(tmp_path):
    out = _open_stats(tmp_path, "tensors-100k", "many_tensors(100_000)")
    assert out["count"] == 100_000
    assert out["grew"] <= 12 * out["file_bytes"], out  # about 900 bytes a tensor, for about 90 of index
    assert min(out["seconds"]) <= 15.0, out


@pytest.mark.slow
def test_open_a_million_tensors_and_list_them_in_2s_and_300mb(tmp_path):
    """A state of 1,048,576 one-chunk tensors (an index of 65 MB): ``open`` and ``keys()`` take CPU seconds, not
    wall seconds (what a shared machine still tells apart; ~1.2 s on the 2-core CI machine, 2 s the target,
    3 s the bound for a loaded one) and at most 300 MB."""
    out = _open_stats(tmp_path, "tensors-1m", "many_tensors(1 << 20)", keys=True)
    assert out["count"] == 1 << 20
    assert min(out["cpu"]) <= 3.0, out
    assert out["grew"] <= 300 * MiB, out


def test_the_builders_legal_files_are_legal(tmp_path):
    """The files tools/hostile.py builds as legal are: the index-only ones load with every chunk and tensor
    checksum verified (a random-access reader reads no other frame), and the ones with every frame pass
    nvckpt verify."""
    import io

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import hostile

    import nvckpt
    from nvckpt.tools.verify import verify

    data = hostile.many_tensors(300)
    loaded = nvckpt.load(io.BytesIO(data))
    assert len(loaded) == 300 and int(loaded["t7"][0]) == 49
    chunks = nvckpt.load(io.BytesIO(hostile.many_chunks(3000)))["t"]
    assert bytes(chunks.numpy()) == bytes(i * 7 & 0xFF for i in range(3000))
    for name, data in (("huge", hostile.huge_tensor(32 << 20)), ("view", hostile.stride0_view(1 << 20))):
        path = tmp_path / f"{name}.nvckpt"
        path.write_bytes(data)
        report = verify(str(path))
        assert report.ok, [str(p) for p in report.problems]
