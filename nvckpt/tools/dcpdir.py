"""`nvckpt info | ls | verify DIR` on a DCP directory written by nvckpt.dcp.Writer, without torch.

The manifest (nvckpt.sharded.layout) says which rank file holds which shard of
which global tensor; each rank file is an ordinary nvckpt file, read through
its index (info, ls) or checked whole (verify).  Missing or damaged rank
files, shards that do not cover their tensor, and parts of another save (a
``.metadata``, manifest or rank file whose save_id is not the directory's,
which dcp.load refuses) are named.
"""

from __future__ import annotations

import os
from contextlib import closing
from typing import Any

from ..sharded.layout import Manifest, directory_save_id, foreign_rank_file, read_manifest
from ..errors import NvckptError
from ..format.tree import escape
from ..read.reader import ChunkReader
from ._util import ProgressFactory, ratio
from .verify import Problem, VerifyReport, verify


def _structural_problems(m: Manifest) -> tuple[list[Problem], str | None]:
    """What the manifest and ``.metadata`` show: a ``.metadata`` missing, damaged or of another save, missing
    rank files, sizes that changed, tensors not fully covered; and the save the rank files must be of."""
    problems = []
    try:
        save_id = directory_save_id(m)
    except NvckptError as exc:
        problems.append(Problem(exc.reason))
        save_id = m.save_id
    for name, size in m.files.items():
        got = m.store.size(name)
        if got is None:
            problems.append(Problem(f"rank file {name} is missing"))
        elif got != size:
            problems.append(Problem(f"rank file {name} is {got} bytes, the manifest says {size}"))
    for fqn, t in m.tensors.items():
        gap = t.coverage_gaps()
        if gap:
            problems.append(Problem(f"its shards {'miss' if gap > 0 else 'overlap by'} {abs(gap)} elements of the "
                                    f"global tensor {list(t.shape)}", tensor=fqn))
    return problems, save_id


def describe_directory(path: str | os.PathLike) -> dict[str, Any]:
    """Everything `nvckpt info DIR` prints: the rank files and the global tensors they form."""
    m = read_manifest(path)
    files = []
    stored = 0
    problems, save_id = _structural_problems(m)
    for name, size in m.files.items():
        row: dict[str, Any] = {"file": name, "bytes": size}
        try:
            with closing(ChunkReader(m.store.open_source(name), workers=1)) as f:
                foreign = foreign_rank_file(f.index.metadata, save_id, name)
                if foreign:
                    problems.append(Problem(foreign))
                raw = sum(e.nbytes for e in f.index.tensors if e.chunks is not None)
                row.update(entries=len(f.index.tensors), raw_bytes=raw, stored_bytes=f.source.size,
                           ratio=ratio(raw, f.source.size), rank=f.index.metadata.get("nvckpt.dcp", {}).get("rank"))
                stored += f.source.size
        except (NvckptError, OSError) as exc:
            row["error"] = str(exc)
            if m.store.size(name) is not None:  # a missing one is a structural problem already
                if isinstance(exc, NvckptError):
                    problems.append(Problem(f"rank file {name}: {exc.reason}", exc.tensor, exc.chunk, exc.offset))
                else:
                    problems.append(Problem(f"rank file {name} cannot be read: {exc.strerror or exc}"))
        files.append(row)
    raw = sum(t.nbytes for t in m.tensors.values())
    return {
        "path": m.directory, "format": "nvckpt DCP directory", "world_size": m.world_size, "save_id": m.save_id,
        "files": files, "tensors": len(m.tensors), "objects": len(m.objects),
        "shards": sum(len(t.shards) for t in m.tensors.values()),
        "raw_bytes": raw, "stored_bytes": stored, "ratio": ratio(raw, stored),
        "problems": [p.to_json() for p in problems],
    }


def list_directory(path: str | os.PathLike, problems: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per global tensor (and per non-tensor value): `nvckpt ls DIR`, named as nvckpt names values
    ("model/0.weight", as in the file `nvckpt merge` makes; DCP's name, "model.0.weight", in "fqn").  What stops a load (a rank
    file missing, cut or unreadable; shards that do not cover a tensor) is appended to ``problems``."""
    m = read_manifest(path)
    found, save_id = _structural_problems(m)
    if problems is not None:
        problems.extend(p.message for p in found)
    stored_of: dict[tuple[str, str], int] = {}
    for name in m.files:
        try:
            with closing(ChunkReader(m.store.open_source(name), workers=1)) as f:
                foreign = foreign_rank_file(f.index.metadata, save_id, name)
                if foreign and problems is not None:
                    problems.append(foreign)
                for e in f.index.tensors:
                    stored_of[(name, e.name)] = e.stored_bytes
        except (NvckptError, OSError) as exc:  # ls shows what can be read, and says what cannot
            if problems is not None and m.store.size(name) is not None:
                problems.append(f"rank file {name}: {exc.reason if isinstance(exc, NvckptError) else exc.strerror or exc}")
            continue
    rows = []

    def name(fqn: str) -> str:  # as nvckpt names the value (its path, "/"-joined), as in the merged file
        return "/".join(escape(p) for p in (m.paths.get(fqn) or [fqn]))

    for fqn, t in m.tensors.items():
        raw = t.nbytes
        stored = sum(stored_of.get((s.file, s.tensor), 0) for s in t.shards)
        rows.append({"name": name(fqn), "fqn": fqn, "dtype": t.dtype, "shape": list(t.shape), "shards": len(t.shards),
                     "files": sorted({s.file for s in t.shards}), "nbytes": raw, "stored_bytes": stored,
                     "ratio": ratio(raw, stored), "kind": "tensor"})
    for fqn, (file, tensor) in m.objects.items():
        rows.append({"name": name(fqn), "fqn": fqn, "dtype": "-", "shape": [], "shards": 1, "files": [file], "nbytes": 0,
                     "stored_bytes": stored_of.get((file, tensor), 0), "ratio": None, "kind": "object"})
    return rows


def verify_directory(path: str | os.PathLike, *, progress: ProgressFactory | None = None,
                     workers: int | None = None) -> VerifyReport:
    """Every rank file verified whole, and the manifest against them; problems name the rank file."""
    m = read_manifest(path)
    report = VerifyReport(m.directory)
    found, save_id = _structural_problems(m)
    report.problems.extend(found)
    wanted: dict[str, list[tuple[str, str, tuple[int, ...], str]]] = {}
    for fqn, t in m.tensors.items():
        for s in t.shards:
            wanted.setdefault(s.file, []).append((fqn, s.tensor, s.sizes, t.dtype))
    for fqn, (file, tensor) in m.objects.items():
        wanted.setdefault(file, []).append((fqn, tensor, None, "uint8"))
    for name in m.files:
        if m.store.size(name) is None:
            continue
        try:
            one = verify(m.store.open_source(name), progress=progress, workers=workers)
        except NvckptError as exc:
            report.problems.append(Problem(f"{name}: {exc.reason}", exc.tensor, exc.chunk, exc.offset))
            continue
        for field in ("file_bytes", "tensors", "chunks", "stored_bytes", "chunks_decoded", "tensor_checksums"):
            setattr(report, field, getattr(report, field) + getattr(one, field))
        report.problems.extend(Problem(f"{name}: {p.message}", p.tensor, p.chunk, p.offset) for p in one.problems)
        report.undecoded.extend(Problem(f"{name}: {p.message}", p.tensor, p.chunk, p.offset) for p in one.undecoded)
        with closing(ChunkReader(m.store.open_source(name), workers=1)) as f:
            foreign = foreign_rank_file(f.index.metadata, save_id, name)
            if foreign:
                report.problems.append(Problem(foreign))
            entries = {e.name: e for e in f.index.tensors}
            for fqn, tensor, sizes, dtype in wanted.get(name, []):
                e = entries.get(tensor)
                if e is None:
                    report.problems.append(Problem(f"{name}: holds no {tensor!r}, a shard of {fqn!r}", tensor=tensor))
                elif e.dtype.name != dtype or (sizes is not None and tuple(e.shape) != tuple(sizes)):
                    report.problems.append(Problem(f"{name}: {e.dtype.name}{list(e.shape)}, the manifest says "
                                                   f"{dtype}{list(sizes or [])} for a shard of {fqn!r}", tensor=tensor))
    return report


__all__ = ["describe_directory", "list_directory", "verify_directory"]
