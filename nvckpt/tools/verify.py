"""`nvckpt verify`: check every checksum of a file, decode what can be decoded here.

Two passes.  The first follows the index: every chunk's stored bytes against
its checksum, then its decoding (length included), then each tensor's
checksum over its decoded bytes (a view's or derived tensor's, where it has
one, over its elements as the loader builds them, SPEC.md 13).  Chunks that no CPU decoder reads
(nvcomp-ans) get a second chance on a CUDA GPU with nvCOMP, through the GPU
loader; elsewhere they are reported as not decoded.  The second walks the frames front to back
(as a streaming reader would) and checks that the CODEC, TENSOR and CHUNK
frames agree with the index (SPEC.md 4.3): a file that loads but would not
recover, or that a streaming reader would reject, is reported too.
"""

from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .._signals import leave_to_main_thread
from ..codecs.registry import pipeline_from_json
from ..errors import NvckptError, UnsupportedCodecError, located_message
from ..format.constants import FOOTER_SIZE, FRAME_CHUNK, FRAME_CODEC, FRAME_HEADER_SIZE, FRAME_INDEX, FRAME_TENSOR
from ..format.entry import TensorEntry, parse_entry
from ..format.frames import iter_frames, read_meta_frame
from ..format.structs import Footer, xxh3
from ..read.reader import ChunkReader
from ._util import ProgressFactory, null_bar


@dataclass(frozen=True)
class Problem:
    """One finding, located as precisely as known."""

    message: str
    tensor: str | None = None
    chunk: int | None = None
    offset: int | None = None

    @classmethod
    def from_error(cls, exc: NvckptError, **where: Any) -> "Problem":
        exc.located(**where)
        return cls(exc.reason, exc.tensor, exc.chunk, exc.offset)

    def __str__(self) -> str:
        return located_message(self.message, tensor=self.tensor, chunk=self.chunk, offset=self.offset)

    def to_json(self) -> dict[str, Any]:
        return {"message": self.message, "tensor": self.tensor, "chunk": self.chunk, "offset": self.offset}


@dataclass
class VerifyReport:
    path: str
    file_bytes: int = 0
    tensors: int = 0
    chunks: int = 0
    stored_bytes: int = 0
    chunks_decoded: int = 0
    tensor_checksums: int = 0  # tensor checksums recomputed and matched
    problems: list[Problem] = field(default_factory=list)
    undecoded: list[Problem] = field(default_factory=list)  # checksum fine, no decoder here

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path, "ok": self.ok, "file_bytes": self.file_bytes, "tensors": self.tensors,
            "chunks": self.chunks, "stored_bytes": self.stored_bytes, "chunks_decoded": self.chunks_decoded,
            "tensor_checksums": self.tensor_checksums,
            "problems": [p.to_json() for p in self.problems],
            "undecoded": [p.to_json() for p in self.undecoded],
        }


def _undecoded_reason(reader: ChunkReader, entry: TensorEntry, i: int, exc: UnsupportedCodecError) -> str:
    pipeline = reader.pipelines[entry.chunks[i].codec_id]
    if pipeline.needs_gpu:
        return f"not decoded (needs nvCOMP on a CUDA GPU): {pipeline.describe()}"
    return f"not decoded: {exc.reason}"


def verify(path: str | os.PathLike, *, progress: ProgressFactory | None = None, workers: int | None = None) -> VerifyReport:
    """Check a whole file.  Raises only when it cannot be opened at all (bad footer or index);
    everything found after that is collected in the report.  ``progress(description, total)``
    makes a progress bar (an object with update(n) and close()), fed with stored bytes."""
    with closing(ChunkReader(path, workers=1)) as reader:
        report = VerifyReport(reader.path, file_bytes=reader.source.size, tensors=len(reader.index.tensors))
        workers = workers or os.cpu_count() or 1
        bar = (progress or null_bar)("verifying", sum(e.stored_bytes for e in reader.index.tensors))
        gpu_candidates: list[TensorEntry] = []  # intact, but some chunks need a GPU decoder
        status: dict[int, str] = {}  # stored tensor id -> "ok", "damaged" or "undecoded"
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="nvckpt-verify", initializer=leave_to_main_thread) as pool:
                for entry in reader.index.tensors:
                    if entry.unsupported is not None:  # SPEC 10, 8.5: valid, but no reader here builds it
                        report.undecoded.append(Problem(f"not readable here: {entry.unsupported}", entry.name))
                    if entry.chunks:
                        status[entry.tensor_id] = _verify_tensor(reader, entry, pool, 2 * workers, report, bar)
                        if status[entry.tensor_id] == "undecoded":
                            gpu_candidates.append(entry)
                    elif entry.chunks is not None:  # an empty stored tensor: nothing to decode
                        status[entry.tensor_id] = "ok"
        finally:
            bar.close()
        if gpu_candidates:
            _decode_on_gpu(reader.path, gpu_candidates, report)
        # Views and derived tensors with a checksum of their own, on an intact base or source (a damaged one
        # is reported already; nvckpt writes no such checksum, so this is usually empty).
        built = [e for e in reader.index.tensors if e.chunks is None and e.checksum is not None and e.unsupported is None
                 and status.get(e.view["base"] if e.view is not None else e.derived["source"]) == "ok"]
        if built:
            _verify_built(reader.path, built, report)
        _verify_frames(reader, report)
        return report


def _verify_built(path: str, entries: list[TensorEntry], report: VerifyReport) -> None:
    """The checksums of views and derived tensors (SPEC 13), on the tensors as the loader builds them."""
    from ..options import LoadOptions
    from ..session.load import Checkpoint

    with Checkpoint(path, LoadOptions(device="cpu", workers=1)) as ck:
        for entry in entries:
            try:
                ck.get_tensor(entry.name)  # ChecksumError when its elements do not match
            except NvckptError as exc:
                report.problems.append(Problem.from_error(exc, tensor=entry.name))
            else:
                report.tensor_checksums += 1


def _decode_on_gpu(path: str, entries: list[TensorEntry], report: VerifyReport) -> None:
    """A second chance for chunks no CPU decoder reads (nvcomp-ans): the GPU loader, where CUDA and nvCOMP are."""
    import torch

    if not torch.cuda.is_available():
        return
    from ..options import LoadOptions
    from ..session.load import Checkpoint

    with Checkpoint(path, LoadOptions(device="cuda")) as ck:
        for entry in entries:
            try:
                tensor = ck.get_tensor(entry.name)
            except UnsupportedCodecError:
                continue  # no nvCOMP here either: the chunks stay "not decoded"
            except NvckptError as exc:
                report.undecoded = [n for n in report.undecoded if n.tensor != entry.name]
                report.problems.append(Problem.from_error(exc, tensor=entry.name))
                continue
            decoded = [n for n in report.undecoded if n.tensor == entry.name]
            report.undecoded = [n for n in report.undecoded if n.tensor != entry.name]
            report.chunks_decoded += len(decoded)
            if entry.checksum is not None:
                raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
                if xxh3(raw) != entry.checksum:
                    report.problems.append(Problem("tensor checksum does not match its decoded bytes (GPU)", entry.name))
                else:
                    report.tensor_checksums += 1


def _check_chunk(reader: ChunkReader, entry: TensorEntry, i: int) -> tuple[Any, Problem | None, Problem | None]:
    """(decoded bytes or None, problem, not-decoded note) for chunk i."""
    try:
        data = reader.read_payload(entry, i)
    except NvckptError as exc:
        return None, Problem.from_error(exc, tensor=entry.name, chunk=i, offset=entry.chunks[i].offset), None
    try:
        return reader.decode_payload(entry, i, data), None, None
    except UnsupportedCodecError as exc:
        note = Problem(_undecoded_reason(reader, entry, i, exc), entry.name, i, entry.chunks[i].offset)
        return None, None, note
    except NvckptError as exc:
        return None, Problem.from_error(exc, tensor=entry.name, chunk=i, offset=entry.chunks[i].offset), None


def _verify_tensor(reader: ChunkReader, entry: TensorEntry, pool: ThreadPoolExecutor, window: int,
                   report: VerifyReport, bar: Any) -> str:
    """Check one stored tensor's chunks; returns "ok", "damaged" or "undecoded" (intact, not all decodable here)."""
    assert entry.chunks is not None
    hasher = xxhash.xxh3_64() if entry.checksum is not None else None
    damaged = undecoded = False
    for first in range(0, len(entry.chunks), window):
        batch = range(first, min(first + window, len(entry.chunks)))
        # Decode a bounded batch at once; hash in chunk order (the tensor checksum is over raw bytes in order).
        for i, (raw, problem, note) in zip(batch, pool.map(lambda i: _check_chunk(reader, entry, i), batch)):
            report.chunks += 1
            report.stored_bytes += entry.chunks[i].stored_length
            bar.update(entry.chunks[i].stored_length)
            if problem is not None:
                report.problems.append(problem)
                damaged = True
            elif note is not None:
                report.undecoded.append(note)
                undecoded = True
            elif entry.dtype.name == "bool" and bytes(raw).translate(None, b"\x00\x01"):  # SPEC 10, as load checks
                report.problems.append(Problem("bool tensor holds a byte other than 0 and 1", entry.name, i,
                                               entry.chunks[i].offset))
                damaged = True
            else:
                report.chunks_decoded += 1
                if hasher is not None and not (damaged or undecoded):
                    hasher.update(raw)
    if damaged:
        return "damaged"
    if undecoded:
        return "undecoded"
    if hasher is not None:
        if hasher.intdigest() != entry.checksum:
            report.problems.append(Problem("tensor checksum does not match its decoded bytes", entry.name))
            return "damaged"
        report.tensor_checksums += 1
    return "ok"


def _verify_frames(reader: ChunkReader, report: VerifyReport) -> None:
    """Walk the frames front to back and check them against the index (SPEC.md 4.3)."""
    index = reader.index
    source = reader.source
    problems = report.problems
    footer = Footer.unpack(source.read(source.size - FOOTER_SIZE, FOOTER_SIZE), source.size - FOOTER_SIZE)
    expected = {c.offset: (e, i, c) for e in index.tensors for i, c in enumerate(e.chunks or ())}
    seen_codecs: set[int] = set()
    seen_tensors: set[int] = set()
    framed: set[tuple[int, int]] = set()  # (frame type, id) of the CODEC and TENSOR frames met so far, valid or not
    out_of_order: set[tuple[int, int]] = set()  # reported once per id
    try:
        for offset, header in iter_frames(source):
            kind = header.frame_type
            if kind in (FRAME_CODEC, FRAME_TENSOR):
                framed.add((kind, header.codec_id if kind == FRAME_CODEC else header.tensor_id))
            elif kind == FRAME_CHUNK:  # rules 3 and 4: a streaming reader needs both before the chunk
                _check_chunk_order(header, offset, framed, out_of_order, problems)
            if header.padding_length and any(source.read(offset + FRAME_HEADER_SIZE, header.padding_length)):
                problems.append(Problem("frame padding is not zero (SPEC 4.1)", offset=offset + FRAME_HEADER_SIZE))
            if kind == FRAME_CHUNK:
                hit = expected.pop(offset + header.payload_skip, None)
                if hit is None:
                    problems.append(Problem(f"CHUNK frame of tensor id {header.tensor_id}, chunk {header.chunk_index} "
                                            "is not in the index", offset=offset))
                    continue
                entry, i, c = hit
                found = (header.tensor_id, header.chunk_index, header.stored_length, header.raw_length,
                         header.codec_id, header.payload_checksum)
                if found != (entry.tensor_id, i, c.stored_length, c.raw_length, c.codec_id, c.checksum):
                    problems.append(Problem("CHUNK frame header disagrees with the index", entry.name, i, offset))
            elif kind == FRAME_CODEC:
                try:
                    framed_pipeline = read_meta_frame(reader.source, offset, header)
                    pipeline_from_json(framed_pipeline)
                except NvckptError as exc:
                    problems.append(Problem.from_error(exc, offset=offset))
                    continue
                cid = header.codec_id
                if cid in seen_codecs:
                    problems.append(Problem(f"second CODEC frame for codec id {cid}", offset=offset))
                elif cid >= len(index.codecs) or not _same_pipeline(framed_pipeline, index.codecs[cid]):
                    problems.append(Problem(f"CODEC frame for codec id {cid} disagrees with the index's codec table", offset=offset))
                seen_codecs.add(cid)
            elif kind == FRAME_TENSOR:
                tid = header.tensor_id
                try:
                    described = read_meta_frame(reader.source, offset, header)
                except NvckptError as exc:
                    problems.append(Problem.from_error(exc, offset=offset))
                    continue
                if tid in seen_tensors:
                    problems.append(Problem(f"second TENSOR frame for tensor id {tid}", offset=offset))
                    continue
                seen_tensors.add(tid)
                if tid >= len(index.tensors) or not _tensor_frame_matches(described, index.tensors[tid]):
                    name = index.tensors[tid].name if tid < len(index.tensors) else None
                    problems.append(Problem(f"TENSOR frame for tensor id {tid} disagrees with the index", name, offset=offset))
            elif kind == FRAME_INDEX and offset != footer.index_offset:
                problems.append(Problem(f"INDEX frame at {offset}, the footer says {footer.index_offset}", offset=offset))
    except NvckptError as exc:
        problems.append(Problem(f"frame walk stopped: {exc.reason}", offset=exc.offset))
        return
    for cid in range(len(reader.pipelines)):
        if cid not in seen_codecs:
            problems.append(Problem(f"no CODEC frame for codec id {cid}"))
    for entry in index.tensors:
        if entry.tensor_id not in seen_tensors:
            problems.append(Problem("no TENSOR frame for this tensor", entry.name))
    for at, (entry, i, _) in sorted(expected.items()):
        problems.append(Problem("no CHUNK frame holds this chunk", entry.name, i, at))


def _tensor_frame_matches(described: Any, entry: TensorEntry) -> bool:
    try:
        framed = parse_entry(entry.tensor_id, described)
    except NvckptError:
        return False
    return framed.description() == entry.description()


def _check_chunk_order(header: Any, offset: int, framed: set[tuple[int, int]], reported: set[tuple[int, int]],
                       problems: list[Problem]) -> None:
    """Rules 3 and 4 of SPEC 4.3: the CODEC frame of a chunk's codec id and its tensor's TENSOR frame precede it."""
    for kind, ident, what in ((FRAME_CODEC, header.codec_id, f"CODEC frame (codec id {header.codec_id})"),
                              (FRAME_TENSOR, header.tensor_id, f"TENSOR frame (tensor id {header.tensor_id})")):
        if (kind, ident) not in framed and (kind, ident) not in reported:
            reported.add((kind, ident))
            problems.append(Problem(f"CHUNK frame of tensor id {header.tensor_id}, chunk {header.chunk_index} comes "
                                    f"before its {what}; a streaming reader rejects it (SPEC 4.3)", offset=offset))


def _same_pipeline(framed: Any, indexed: Any) -> bool:
    """Rule 3 of SPEC 4.3: the same steps, names and configurations (absent = {}), values of the same msgpack
    type and value; not the codec objects' equality (Zstd fills in a default level, and 1 == 1.0 in Python)."""
    def steps(value: Any) -> list[tuple[Any, Any]]:
        return [(s.get("name"), _msgpack_value(s.get("configuration", {}))) for s in value]

    return steps(framed) == steps(indexed)


def _msgpack_value(v: Any) -> Any:
    """A value compared by msgpack type and value: maps unordered, floats by their bits."""
    if isinstance(v, dict):
        return ("map", frozenset((_msgpack_value(k), _msgpack_value(x)) for k, x in v.items()))
    if isinstance(v, list):
        return ("array", tuple(_msgpack_value(x) for x in v))
    if isinstance(v, bool) or v is None:
        return ("atom", v)
    if isinstance(v, int):
        return ("int", v)
    if isinstance(v, float):
        return ("float", struct.pack("<d", v))
    if isinstance(v, (bytes, str)):
        return (type(v).__name__, v)
    return ("ext", getattr(v, "code", None), getattr(v, "data", repr(v)))
