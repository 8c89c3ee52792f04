"""`nvckpt recover`: rebuild a valid file from a truncated or damaged one (SPEC.md 7, 15.2).

The walk goes front to back without the index, as a recovering reader does:
CODEC frames give the codec table, TENSOR frames each tensor's description and
chunk count, CHUNK frames the stored bytes.  It stops at the first frame whose
header is damaged or cut off; a frame with a valid header but a damaged
payload is skipped (its lengths can be trusted, so the walk goes on).  Frames
seen twice (same codec id, tensor id, or tensor id and chunk index) are not
used at all.

A tensor is complete when its TENSOR frame and all its chunks are present and
intact and their lengths add up; a view or derived tensor also needs its base
or source.  Complete tensors are written to a new file with their stored chunk
payloads as they are (no re-encoding).  The tree and metadata live only in
the index: when the INDEX frame is intact and nothing was lost they are kept;
otherwise the tensors are stored in nested dicts rebuilt from their names, so
that every tensor keeps its name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..codecs.base import Pipeline
from ..codecs.registry import pipeline_from_json
from ..errors import ChecksumError, NvckptError, UnsupportedCodecError
from ..format.constants import (
    FOOTER_SIZE,
    FRAME_CHUNK,
    FRAME_CODEC,
    FRAME_INDEX,
    FRAME_TENSOR,
    MAX_CHUNK_LENGTH,
    MAX_META_FRAME_LENGTH,
    PREAMBLE_SIZE,
)
from ..format.entry import TensorEntry, parse_entry, reference_problem
from ..format.frames import FrameWriter, check_index_floor, iter_frames, read_meta_frame
from ..format.index import Index, parse_index, unpack_index, writer_info
from ..format.structs import Footer, FrameHeader, Preamble, xxh3
from ..format.tree import ArrayRef, TensorRef, escape, resolve_refs, tree_features
from ..io.atomic import atomic_output
from ..io.source import ByteSource, open_source
from ..read.reader import ChunkReader
from ._util import ProgressFactory, UsageError, check_output_folder, nest_by_name, null_bar, overwrites_source

#: Metadata keys a recovered file carries.
RECOVERED_FROM = "nvckpt.recovered_from"
LOST = "nvckpt.lost"


@dataclass
class RecoveryReport:
    src: str
    dst: str
    recovered: list[str] = field(default_factory=list)  # names of the tensors written to dst
    lost: dict[str, str] = field(default_factory=dict)  # name -> why it could not be recovered
    problems: list[str] = field(default_factory=list)  # frames that were skipped, and why
    index_found: bool = False  # an intact INDEX frame was reached (the file was not truncated)
    footer_problem: str | None = None  # the INDEX frame is intact but the footer after it is not (nothing lost)
    tree_kept: bool = False  # the original tree and non-tensor values were written
    stopped_at: int | None = None  # offset where the walk met a damaged or cut-off frame
    stop_reason: str | None = None
    frames: int = 0  # intact frames walked
    src_bytes: int = 0
    dst_bytes: int = 0
    raw_bytes: int = 0  # raw bytes of the recovered data tensors

    @property
    def complete(self) -> bool:
        """Everything the source held is in the output: its index was intact and nothing was lost."""
        return self.index_found and not self.lost and not self.problems

    def to_json(self) -> dict[str, Any]:
        return {
            "src": self.src, "dst": self.dst, "complete": self.complete, "recovered": self.recovered,
            "lost": self.lost, "problems": self.problems, "index_found": self.index_found,
            "tree_kept": self.tree_kept, "stopped_at": self.stopped_at, "stop_reason": self.stop_reason,
            "footer_problem": self.footer_problem,
            "frames": self.frames, "src_bytes": self.src_bytes, "dst_bytes": self.dst_bytes,
            "raw_bytes": self.raw_bytes,
        }


@dataclass
class _Chunk:
    payload_offset: int
    stored_length: int
    raw_length: int
    codec_id: int
    checksum: int


class _Walk:
    """What the front-to-back walk found."""

    def __init__(self) -> None:
        self.codecs: dict[int, Pipeline] = {}
        self.tensors: dict[int, TensorEntry] = {}
        self.chunks: dict[tuple[int, int], _Chunk] = {}
        # Ids seen twice: neither copy may be used (SPEC.md 15.2).
        self.dup_codecs: set[int] = set()
        self.dup_tensors: set[int] = set()
        self.dup_chunks: set[tuple[int, int]] = set()
        self.bad_chunks: dict[tuple[int, int], str] = {}  # payload damaged
        self.bad_tensors: dict[int, str] = {}  # TENSOR frame damaged or invalid
        self.bad_codecs: dict[int, str] = {}
        # tensor id -> the checksum of a TENSOR frame that disagrees with the index's: the bytes must match both
        self.frame_checksums: dict[int, int] = {}
        self.problems: list[str] = []
        self.index: Index | None = None
        self.index_offset: int | None = None
        self.stopped_at: int | None = None
        self.stop_reason: str | None = None
        self.frames = 0


def _footer_problem(source: ByteSource, index_offset: int | None) -> str | None:
    """Why the file's footer is not the one its INDEX frame needs, or None."""
    if source.size < FOOTER_SIZE:
        return "the file has no footer"
    try:
        footer = Footer.unpack(source.read(source.size - FOOTER_SIZE, FOOTER_SIZE), source.size - FOOTER_SIZE)
    except NvckptError:
        return "the footer is missing or damaged (the file was cut or changed after its INDEX frame)"
    if footer.index_offset != index_offset:
        return (f"the footer points at offset {footer.index_offset}, not at the INDEX frame at {index_offset} "
                "(the file was cut or changed after it)")
    return None


def _check_header(header: FrameHeader) -> str | None:
    """Header fields a recovering reader must not trust (then it stops walking)."""
    if header.frame_type == FRAME_CHUNK:
        if not 1 <= header.stored_length <= MAX_CHUNK_LENGTH or not 1 <= header.raw_length <= MAX_CHUNK_LENGTH:
            return f"CHUNK frame lengths {header.stored_length}/{header.raw_length} are outside 1..{MAX_CHUNK_LENGTH}"
    elif header.frame_type in (FRAME_CODEC, FRAME_TENSOR):
        if header.raw_length != header.stored_length or header.stored_length > MAX_META_FRAME_LENGTH:
            return f"frame payload length {header.stored_length} is invalid (limit {MAX_META_FRAME_LENGTH})"
    return None


def _walk(source: ByteSource, bar: Any, required_features: int) -> _Walk:
    """``required_features``: the preamble's; the INDEX frame is checked with it, as a random-access reader
    checks it (SPEC 15.2: a typed tree in a file without bit 1 is invalid, 9.2)."""
    walk = _Walk()
    frames = iter_frames(source)
    position = PREAMBLE_SIZE
    while True:
        try:
            offset, header = next(frames)
        except StopIteration:
            if walk.index is None:
                walk.stop_reason = "the file ends after the last complete frame, without an INDEX frame"
                walk.stopped_at = source.size
            break
        except NvckptError as exc:
            walk.stopped_at = exc.offset if exc.offset is not None else position
            walk.stop_reason = exc.reason
            break
        invalid = _check_header(header)
        if invalid is not None:
            walk.stopped_at, walk.stop_reason = offset, invalid
            break
        end = offset + header.payload_skip + header.stored_length
        bar.update(end - position)
        position = end
        walk.frames += 1
        kind = header.frame_type
        if kind == FRAME_CHUNK:
            key = (header.tensor_id, header.chunk_index)
            at = offset + header.payload_skip
            if key in walk.chunks or key in walk.bad_chunks:
                walk.dup_chunks.add(key)
                walk.problems.append(f"offset {offset}: second CHUNK frame for tensor id {key[0]}, chunk {key[1]}: neither is used")
                continue
            if xxh3(source.read(at, header.stored_length)) != header.payload_checksum:
                walk.bad_chunks[key] = f"its payload at offset {at} is damaged (checksum mismatch)"
                walk.problems.append(f"offset {offset}: CHUNK frame of tensor id {key[0]}, chunk {key[1]}: payload checksum mismatch, skipped")
                continue
            walk.chunks[key] = _Chunk(at, header.stored_length, header.raw_length, header.codec_id, header.payload_checksum)
        elif kind == FRAME_CODEC:
            cid = header.codec_id
            if cid in walk.codecs or cid in walk.bad_codecs:
                walk.dup_codecs.add(cid)
                walk.problems.append(f"offset {offset}: second CODEC frame for codec id {cid}: neither is used")
                continue
            try:
                walk.codecs[cid] = pipeline_from_json(read_meta_frame(source, offset, header))
            except NvckptError as exc:
                walk.bad_codecs[cid] = exc.reason
                walk.problems.append(f"offset {offset}: CODEC frame for codec id {cid}: {exc.reason}, skipped")
        elif kind == FRAME_TENSOR:
            tid = header.tensor_id
            if tid in walk.tensors or tid in walk.bad_tensors:
                walk.dup_tensors.add(tid)
                walk.problems.append(f"offset {offset}: second TENSOR frame for tensor id {tid}: neither is used")
                continue
            try:
                # An unknown dtype or derived function (entry.unsupported) is kept too: its frames are copied as
                # they are, and a reader that knows it reads it (SPEC 10, 15.2: every complete tensor).
                walk.tensors[tid] = parse_entry(tid, read_meta_frame(source, offset, header))
            except NvckptError as exc:
                walk.bad_tensors[tid] = exc.reason
                walk.problems.append(f"offset {offset}: TENSOR frame for tensor id {tid}: {exc.reason}, skipped")
        elif kind == FRAME_INDEX:
            try:
                payload = source.read(offset + header.payload_skip, header.stored_length)
                if xxh3(payload) != header.payload_checksum:
                    raise ChecksumError("payload checksum does not match")
                walk.index = parse_index(unpack_index(payload), offset, required_features)
                walk.index_offset = offset
            except NvckptError as exc:
                walk.problems.append(f"offset {offset}: INDEX frame: {exc.reason}; the tree and metadata are lost")
        # Optional extension frames (types 128..255) are skipped.
    return walk


def _data_missing(walk: _Walk, t: TensorEntry, source: ByteSource, indexed: TensorEntry | None) -> str | None:
    """Why data tensor ``t`` is incomplete, or None: every chunk present, intact and decodable where a decoder
    runs here (nvcomp-ans chunks are checked on a GPU when the file is read; a codec this nvckpt does not know
    is copied as it is, SPEC 7 asks no decode); ``indexed``: its entry in an intact index, whose chunk table
    the CHUNK frames must match."""
    known = t.dtype.itemsize > 0  # not for an unknown dtype (itemsize 0), whose size rules SPEC 10 skips
    total = 0
    for i in range(t.nchunks):
        key = (t.tensor_id, i)
        if key in walk.dup_chunks:
            return f"chunk {i} appears twice"
        if key in walk.bad_chunks:
            return f"chunk {i}: {walk.bad_chunks[key]}"
        c = walk.chunks.get(key)
        if c is None:
            return f"chunk {i} of {t.nchunks} is missing"
        if c.codec_id in walk.dup_codecs or c.codec_id not in walk.codecs:
            return f"chunk {i} uses codec id {c.codec_id}, whose CODEC frame is missing, damaged or duplicated"
        if indexed is not None and (c.payload_offset, c.stored_length, c.raw_length, c.codec_id, c.checksum) != \
                tuple(indexed.chunks[i][:5]):
            return f"chunk {i}: its CHUNK frame disagrees with the index (SPEC 4.3 rule 5)"
        if known and c.raw_length % t.dtype.itemsize:
            return f"chunk {i} raw_length {c.raw_length} is not a multiple of the item size {t.dtype.itemsize}"
        total += c.raw_length
    if known and total != t.nbytes:  # an unknown dtype's size is unknown: SPEC 10 skips both rules
        return f"its chunks hold {total} raw bytes, shape and dtype need {t.nbytes}"
    # Every chunk must decode, with the rules a reader applies (SPEC 15.2: a recovering reader applies every
    # check of a random-access reader), and the decoded bytes must match the tensor checksum.
    framed = walk.frame_checksums.get(t.tensor_id)
    hasher = xxhash.xxh3_64() if t.checksum is not None or framed is not None else None
    for i in range(t.nchunks):
        c = walk.chunks[(t.tensor_id, i)]
        pipeline = walk.codecs[c.codec_id]
        if pipeline.needs_gpu:
            hasher = None  # decoded only on a GPU, when the file is read (which checks the tensor checksum)
            continue
        try:
            decoded = memoryview(pipeline.decode(memoryview(source.read(c.payload_offset, c.stored_length)), c.raw_length)).cast("B")
        except UnsupportedCodecError:
            hasher = None  # no decoder here: its payload checksum was checked, it is copied as it is
            continue
        except NvckptError as exc:
            return f"chunk {i} does not decode ({pipeline.describe()}: {exc.reason})"
        except Exception as exc:  # a host decoder rejecting its input
            return f"chunk {i} does not decode ({pipeline.describe()}: {str(exc)[:200]})"
        if decoded.nbytes != c.raw_length:
            return f"chunk {i} decodes to {decoded.nbytes} bytes, not its raw length {c.raw_length}"
        if t.dtype.name == "bool" and bytes(decoded).translate(None, b"\x00\x01"):
            return f"chunk {i} holds a bool byte other than 0 and 1 (SPEC 10)"
        if hasher is not None:
            hasher.update(decoded)
    if hasher is not None and t.checksum is not None and hasher.intdigest() != t.checksum:
        return "its decoded bytes do not match its tensor checksum"
    if hasher is not None and framed is not None and hasher.intdigest() != framed:
        return "its decoded bytes do not match the tensor checksum its TENSOR frame gives"
    return None


def _use_index(walk: _Walk) -> dict[int, str]:
    """With an intact index, which is authoritative (SPEC 8.3, 15.2): each TENSOR frame that disagrees with its
    entry is reported and the entry used instead; returns why each entry no TENSOR frame stands for is lost
    (SPEC 7: a tensor is complete only with its TENSOR frame)."""
    index = walk.index
    if index is None:
        return {}
    for tid, t in sorted(walk.tensors.items()):
        if tid >= len(index.tensors):
            walk.problems.append(f"TENSOR frame for tensor id {tid} ({t.name!r}) is not in the index")
            continue
        framed, indexed = t.description(), index.tensors[tid].description()
        if framed != indexed:
            keys = [k for k in dict.fromkeys([*indexed, *framed]) if framed.get(k) != indexed.get(k)]
            walk.problems.append(f"TENSOR frame for tensor id {tid} ({t.name!r}) disagrees with the index on "
                                 f"{', '.join(keys)}; the index's entry is used (SPEC 8.3: it is authoritative)")
            walk.tensors[tid] = index.tensors[tid]
            if t.checksum is not None and t.checksum != index.tensors[tid].checksum:
                walk.frame_checksums[tid] = t.checksum  # which one the bytes are is not known: kept only if both
    missing = {}
    for e in index.tensors:
        if e.tensor_id not in walk.tensors:
            bad = walk.bad_tensors.get(e.tensor_id)
            missing[e.tensor_id] = (
                "its TENSOR frame appears twice" if e.tensor_id in walk.dup_tensors
                else f"its TENSOR frame is damaged or invalid ({bad})" if bad is not None
                else "no TENSOR frame stands for it (SPEC 7: a tensor is complete only with its TENSOR frame)")
    return missing


def _resolve(walk: _Walk, source: ByteSource) -> tuple[list[TensorEntry], dict[int, str]]:
    """The tensors to keep (in their original order) and why the others were lost."""
    why: dict[int, str] = {}
    index = walk.index
    first_named: dict[str, int] = {}
    for tid in sorted(walk.tensors):
        t = walk.tensors[tid]
        if tid in walk.dup_tensors:
            why[tid] = "its TENSOR frame appears twice"
        elif t.name in first_named:  # names are unique in a valid file: keep the first
            why[tid] = f"tensor id {first_named[t.name]} has the same name"
        else:
            first_named[t.name] = tid
        if tid not in why and t.is_data:
            indexed = index.tensors[tid] if index is not None and tid < len(index.tensors) else None
            reason = _data_missing(walk, t, source, indexed if indexed is not None and indexed.is_data else None)
            if reason is not None:
                why[tid] = reason

    def usable_data(tid: int) -> TensorEntry | None:
        t = walk.tensors.get(tid)
        return t if t is not None and t.is_data and tid not in why else None

    for tid, t in walk.tensors.items():
        if tid in why or t.is_data:
            continue
        problem = reference_problem(t, usable_data)
        if problem is not None:
            why[tid] = f"{problem} (missing, incomplete or not what it needs)"

    orphans = sorted(key for key in walk.chunks if key[0] not in walk.tensors or key[1] >= walk.tensors[key[0]].nchunks)
    if orphans:
        walk.problems.append(f"{len(orphans)} CHUNK frames belong to no intact TENSOR frame (first: tensor id "
                             f"{orphans[0][0]}, chunk {orphans[0][1]}); not used")

    kept_views = {t.view["base"] for tid, t in walk.tensors.items() if t.view is not None and tid not in why and not t.internal}
    kept = []
    for tid in sorted(walk.tensors):
        t = walk.tensors[tid]
        if tid in why:
            continue
        # An internal entry only exists as the base of views (SPEC.md 14.3): keep it only for a kept view.
        if t.internal and (not t.is_data or tid not in kept_views):
            continue
        kept.append(t)
    return kept, why


def _entry(t: TensorEntry, new_id: dict[int, int]) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": t.name, "dtype": t.dtype.name, "shape": list(t.shape)}
    # Only the keys SPEC 8.5 defines: keys a reader ignores (any msgpack, exts kept as stored) are not rewritten.
    if t.view is not None:
        entry["view"] = {"base": new_id[t.view["base"]], "offset": t.view["offset"], "stride": t.view["stride"]}
    if t.derived is not None:
        entry["derived"] = {"function": t.derived["function"], "source": new_id[t.derived["source"]]}
    if t.internal:
        entry["internal"] = True
    return entry


def recover(src: str | os.PathLike, dst: str | os.PathLike, *, progress: ProgressFactory | None = None) -> RecoveryReport:
    """Write every complete tensor of ``src`` (truncated or damaged) to a new valid file ``dst``."""
    if overwrites_source(src, dst):
        raise UsageError("the recovered file must not overwrite its source")
    check_output_folder(dst)
    make_bar = progress or null_bar
    source = open_source(src)
    try:
        report = RecoveryReport(os.path.abspath(source.name), os.path.abspath(os.fspath(dst)), src_bytes=source.size)
        try:
            preamble = Preamble.unpack(source.read(0, min(PREAMBLE_SIZE, source.size)))
        except NvckptError as exc:
            raise exc.located(path=source.name)
        bar = make_bar("scanning", source.size)
        try:
            walk = _walk(source, bar, preamble.required_features)
        finally:
            bar.close()
        unframed = _use_index(walk)
        kept, why = _resolve(walk, source)
        report.frames = walk.frames
        report.problems = walk.problems
        report.stopped_at, report.stop_reason = walk.stopped_at, walk.stop_reason
        report.index_found = walk.index is not None
        if walk.index is not None:  # SRC was whole only with the footer that points at this INDEX frame
            report.footer_problem = _footer_problem(source, walk.index_offset)
        # An internal base is not a name users know: its loss shows through its views.
        entry_of = {**({e.tensor_id: e for e in walk.index.tensors} if walk.index is not None else {}), **walk.tensors}
        report.lost = {entry_of[tid].name: reason for tid, reason in sorted({**why, **unframed}.items())
                       if not entry_of[tid].internal}
        new_id = {t.tensor_id: i for i, t in enumerate(kept)}
        entries = [_entry(t, new_id) for t in kept]
        named = [t for t in kept if not t.internal]
        report.recovered = [t.name for t in named]

        metadata: dict[str, Any] = dict(walk.index.metadata) if walk.index is not None else {}
        index = walk.index
        if index is not None and not why and len(kept) == len(index.tensors) and all(
                t.tensor_id == e.tensor_id and t.name == e.name for t, e in zip(kept, index.tensors)):
            # An array reference stays one (SPEC 9.3); paths and the other typed values are kept as they are.
            tree = resolve_refs(index.tree, lambda tid: TensorRef(new_id[tid]), array=lambda ref: ArrayRef(ref.tensor_id))
            report.tree_kept = True
        else:
            tree = nest_by_name([(t.name, TensorRef(new_id[t.tensor_id])) for t in named])
            if tree is None:
                # The names cannot all be paths of one tree: a flat map, whose paths are the escaped names.
                tree = {}
                for t in named:
                    entries[new_id[t.tensor_id]]["name"] = escape(t.name)
                    tree[t.name] = TensorRef(new_id[t.tensor_id])
                report.problems.append("tensor names do not nest into one tree; stored as a flat map (names escaped)")
        # Metadata is msgpack str, UTF-8 only: a file name that is not (surrogate-escaped bytes) is kept readable.
        metadata[RECOVERED_FROM] = os.fsencode(report.src).decode("utf-8", "backslashreplace")
        metadata[LOST] = list(report.lost)

        lengths = [[walk.chunks[(t.tensor_id, i)].raw_length for i in range(t.nchunks)] for t in kept]
        report.raw_bytes = sum(map(sum, lengths))

        pipelines = {walk.chunks[(t.tensor_id, i)].codec_id for t in kept for i in range(t.nchunks)}
        nvcomp = [op.written_by for cid in sorted(pipelines) if (op := walk.codecs[cid].device_op()) is not None
                  and op.written_by]
        info = writer_info({"nvcomp": nvcomp[0]} if nvcomp else None)

        check_index_floor(entries, lengths, tree, metadata, info)
        bar = make_bar("writing", sum(walk.chunks[(t.tensor_id, i)].stored_length for t in kept for i in range(t.nchunks)))
        try:
            with atomic_output(dst) as tmp:
                with open(tmp, "wb", buffering=8 << 20) as out:
                    writer = FrameWriter(out, entries, lengths, required_features=tree_features(tree))
                    for t in kept:
                        tid = new_id[t.tensor_id]
                        writer.tensor(tid, t.checksum)
                        for i in range(t.nchunks):
                            c = walk.chunks[(t.tensor_id, i)]
                            payload = source.read(c.payload_offset, c.stored_length)
                            if xxh3(payload) != c.checksum:
                                raise ChecksumError("the file changed while it was being recovered",
                                                    path=source.name, tensor=t.name, chunk=i, offset=c.payload_offset)
                            writer.chunk(tid, i, walk.codecs[c.codec_id], payload, c.raw_length, c.checksum)
                            bar.update(c.stored_length)
                    report.dst_bytes = writer.finish(tree, metadata, info)
                # What we wrote must open as a valid file (it is parsed and checked like any other).
                try:
                    ChunkReader(tmp, workers=1).close()
                except NvckptError as exc:
                    raise NvckptError(f"the recovered file does not validate (a bug in nvckpt recover): {exc}") from exc
        finally:
            bar.close()
        return report
    finally:
        source.close()


__all__ = ["recover", "RecoveryReport", "RECOVERED_FROM", "LOST"]
