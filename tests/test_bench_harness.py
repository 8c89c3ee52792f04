"""benchmarks/harness.py, the scaffolding every benchmark script shares: results written whole (the JSON kept
when the markdown fails) and page-cache eviction that works without root and says what it did."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import mmap
import os
import sys

import pytest

_spec = importlib.util.spec_from_file_location(  # benchmarks/ is no package: loaded by its path
    "bench_harness", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "harness.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


def test_results_are_written_and_the_markdown_printed(tmp_path, capsys):
    doc = {"rows": [1, 2], "when": object()}  # what JSON cannot hold is kept as its str
    text = harness.write_results(str(tmp_path / "out"), "run", doc, lambda: "# run\n\n| a |\n", echo=True)
    assert text == "# run\n\n| a |\n"
    assert json.loads((tmp_path / "out" / "run.json").read_text())["rows"] == [1, 2]
    assert (tmp_path / "out" / "run.md").read_text() == text
    assert capsys.readouterr().out == text + "\n"
    assert sorted(os.listdir(tmp_path / "out")) == ["run.json", "run.md"]  # no partial file left


def test_a_failing_markdown_keeps_the_json_and_says_why(tmp_path, capsys):
    harness.write_results(str(tmp_path), "run", {"step": 1}, lambda: "# old\n")

    def broken() -> str:
        raise KeyError("loads")

    assert harness.write_results(str(tmp_path), "run", {"step": 2}, broken, title="Cold loads", echo=True) is None
    assert json.loads((tmp_path / "run.json").read_text()) == {"step": 2}
    assert (tmp_path / "run.md").read_text() == "# Cold loads\n\nmarkdown failed: KeyError: 'loads'\n"
    assert "KeyError" in capsys.readouterr().err  # the traceback, for whoever reads the run's log


def test_json_alone(tmp_path):
    assert harness.write_results(str(tmp_path), "probe", {"a": 1}) is None
    assert os.listdir(tmp_path) == ["probe.json"]


def test_command_line_is_pasteable():
    script = os.path.join(harness.ROOT, "benchmarks", "bench_cpu.py")
    assert harness.command_line(script, ["--out", "my dir"], python="python") == \
        "python benchmarks/bench_cpu.py --out 'my dir'"


def test_load_average_reads_like_proc_loadavg():
    fields = harness.load_average().split()
    assert len(fields) == 3 and all(len(f.split(".")[1]) == 2 for f in fields)


def _resident_share(path: str) -> float:
    """The share of ``path``'s pages in the page cache (mincore on a private, never written mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE) as m:
        base = ctypes.c_char.from_buffer(m)
        try:
            assert libc.mincore(ctypes.c_void_p(ctypes.addressof(base)), ctypes.c_size_t(size), vec) == 0
        finally:
            del base
    return sum(v & 1 for v in vec) / pages


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or not sys.platform.startswith("linux"),
                    reason="posix_fadvise and mincore: Linux")
def test_files_are_evicted_without_root(tmp_path, monkeypatch):
    def refused(path, *args, **kw):  # a process without root (and no whole-machine drop on a shared host)
        if path == "/proc/sys/vm/drop_caches":
            raise PermissionError(13, "Permission denied")
        return open(path, *args, **kw)

    monkeypatch.setattr(harness, "open", refused, raising=False)
    files = [tmp_path / "one", tmp_path / "other", tmp_path / "ckpt" / "rank0"]
    files[2].parent.mkdir()
    for f in files:
        f.write_bytes(os.urandom(4 << 20))
        f.read_bytes()
    assert all(_resident_share(str(f)) == 1.0 for f in files)

    done = harness.drop_page_cache([str(files[0]), str(tmp_path / "ckpt")])  # a file and a checkpoint's folder
    assert done == {"drop_caches": "PermissionError: Permission denied", "fadvise_dontneed": True}
    assert harness.cache_dropped(done)
    assert [_resident_share(str(f)) for f in files] == [0.0, 1.0, 0.0]

    missing = harness.drop_page_cache([str(tmp_path / "missing")])
    assert missing["fadvise_dontneed"] is False and not harness.cache_dropped(missing)
    assert "fadvise_dontneed" not in harness.drop_page_cache()


def test_tree_bytes(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 10)
    (tmp_path / "d" / "b").write_bytes(b"x" * 5)
    assert harness.tree_bytes(str(tmp_path / "d")) == 15
    assert harness.tree_bytes(str(tmp_path / "d" / "a")) == 10
    assert harness.tree_bytes(str(tmp_path / "none")) == 0
