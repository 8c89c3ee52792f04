"""The index: parse it and check every rule of SPEC.md before anything trusts it."""

from __future__ import annotations

from array import array
from bisect import bisect_right
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from .._gc import paused as gc_paused
from ..errors import FormatError, LimitError, NvckptError, brief
from .constants import EXT_TENSOR, EXT_TUPLE, KNOWN_REQUIRED_FEATURES, MAX_CODECS, MAX_TENSORS, MAX_TREE_DEPTH, VERSION_MAJOR
from .bulk import LazyEntries, LazyTree, PathTable, compiled, decode_index
from .entry import (ChunkStore, EntryTable, check_list, check_map, check_overlaps, parse_entry,
                    plain_entries, reference_problem)
from .tree import ArrayRef, Ext, TensorRef, check_depth, check_tree, leaf_paths, memory_budget, msgpack_errors



@dataclass
class Index:
    writer: dict[str, Any]
    codecs: list[list[dict[str, Any]]]  # the codec table as stored: one pipeline (list of steps) per codec id
    tensors: EntryTable  # a Sequence[TensorEntry]
    stored_tree: Any  # the tree, or its checked bytes (bulk.LazyTree) until ``tree`` is first read
    metadata: dict[str, Any]
    version: tuple[int, int]
    paths: Mapping[str, int]  # every tree path to a tensor (aliases too) -> tensor id (a dict or bulk.PathTable)
    arrays: frozenset[str] = frozenset()  # the paths of ``paths`` that load as NumPy arrays (ext 9, SPEC 9.3)

    @property
    def tree(self) -> Any:
        """The saved object's structure, its tensors as TensorRefs (decoded when first read: opening a state
        of a million tensors and listing its names needs only ``paths``)."""
        if isinstance(self.stored_tree, LazyTree):
            with gc_paused():
                self.stored_tree = self.stored_tree.decode()
        return self.stored_tree


def unpack_index(payload: bytes, max_memory: int | None = None) -> dict[str, Any]:
    """The decoded INDEX payload; ``max_memory`` bounds the memory its decoding may take (LimitError)."""
    if max_memory is not None and len(payload) > max_memory:
        raise LimitError(f"the index is {len(payload)} bytes, more than max_index_memory={max_memory}")
    with msgpack_errors("index", f"the decoded index of {len(payload)} bytes"), memory_budget(max_memory):
        data = decode_index(payload)
    return check_map(data, "index")


def parse_index(data: dict[str, Any], index_offset: int, required_features: int = KNOWN_REQUIRED_FEATURES) -> Index:
    """Validate a decoded index.  Chunk payloads must lie in [preamble end, index_offset).
    ``required_features``: the preamble's (the tree's typed extensions need FEATURE_TYPED_TREE)."""
    if data.get("format") != "nvckpt":
        raise FormatError(f"index 'format' is {brief(data.get('format'), 40)}, expected 'nvckpt'")
    version = check_list(data.get("version"), "index 'version'")
    if len(version) != 2 or any(type(v) is not int or not 0 <= v <= 0xFFFF for v in version):
        raise FormatError(f"index 'version' must be [major, minor], got {brief(version)}")
    if version[0] != VERSION_MAJOR:
        raise FormatError(f"index version {version[0]}.{version[1]} disagrees with the preamble's {VERSION_MAJOR}.x")
    for key, value in data.items():  # the parts no other check walks all of (SPEC 9, "Parser bound")
        if key not in ("tensors", "tree", "metadata"):
            check_depth(value, f"index {brief(key)}", level=2)
    writer = check_map(data.get("writer", {}), "index 'writer'")
    metadata = check_map(data.get("metadata", {}), "index 'metadata'")
    _check_metadata(metadata)

    codec_list = check_list(data.get("codecs"), "index 'codecs'")
    if len(codec_list) > MAX_CODECS:
        raise LimitError(f"{len(codec_list)} codecs exceed the limit of {MAX_CODECS}")
    codecs = [check_codec_spec(c) for c in codec_list]

    raw_tensors = data.get("tensors")
    if not isinstance(raw_tensors, LazyEntries):
        check_list(raw_tensors, "index 'tensors'")
    if len(raw_tensors) > MAX_TENSORS:
        raise LimitError(f"{len(raw_tensors)} tensors exceed the limit of {MAX_TENSORS}")
    store = ChunkStore()
    tensors = EntryTable(store)
    names: dict[str, int] | None = {}  # entry name -> tensor id (None: checked on the name blob, compiled)
    firsts = array("Q")  # index in the store of each tensor's first chunk
    lazy = isinstance(raw_tensors, LazyEntries)
    if lazy and raw_tensors.columns is not None:
        _column_entries(raw_tensors, len(codecs), index_offset, tensors, firsts)
        names = None
        data["tensors"] = raw_tensors = None  # (the index's bytes are no longer needed: memory for the paths)
    for lo in range(0, len(raw_tensors) if names is not None else 0, _BATCH):
        hi = min(lo + _BATCH, len(raw_tensors))
        batch = raw_tensors.plain(lo, hi) if lazy else raw_tensors[lo:hi]
        tid = lo
        while tid < hi:
            # Runs of plain one-chunk entries a column at a time; any other entry (or a run that fails a
            # check) one by one, which says what is wrong.
            start = len(store)
            run = plain_entries(batch, tid - lo, len(codecs), index_offset, tensors) if batch else 0
            if run:
                firsts.extend(range(start, start + run))
                run_names = tensors.names(tid, tid + run)
                if not names.keys().isdisjoint(run_names) or len(set(run_names)) != len(run_names):
                    _duplicate_name(run_names, names)
                names.update(zip(run_names, range(tid, tid + run)))
                tid += run
                continue
            firsts.append(len(store))
            entry = parse_entry(tid, raw_tensors[tid], ncodecs=len(codecs), index_offset=index_offset, store=store)
            if entry.name in names:
                raise FormatError(f"duplicate tensor name {entry.name!r:.200}")
            names[entry.name] = tid
            tensors.append(entry)
            tid += 1
        if not lazy:
            raw_tensors[lo:hi] = [None] * (hi - lo)  # the parsed entries replace them: memory stays near the index's size

    def chunk_name(i: int) -> tuple[str, int]:
        tid = bisect_right(firsts, i) - 1
        return tensors.name(tid), i - firsts[tid]

    check_overlaps(store, chunk_name)
    lookup = (lambda tid: tensors[tid] if tid < len(tensors) else None)
    for tid in tensors.references_to_check():  # (the others' bases and sources were checked a column at a time)
        entry = tensors[tid]
        problem = reference_problem(entry, lookup)
        if problem is not None:
            raise FormatError(f"tensor {entry.name!r:.200}: {problem}")

    if "tree" not in data:
        raise FormatError("index has no 'tree'")
    tree = data["tree"]
    arrays: set[str] = set()
    paths: Mapping[str, int]
    if isinstance(tree, LazyTree) and tree.max_tid < len(tensors):
        paths = tree.paths  # (a tree of containers, scalars, tuples and references: check_tree's checks hold)
    else:
        if isinstance(tree, LazyTree):
            tree = tree.decode()
        check_tree(tree, len(tensors), required_features, lambda tid: tensors[tid].dtype.name)
        paths = found_paths = {}
        for path, ref in leaf_paths(tree):
            if path not in found_paths and type(ref) is ArrayRef:  # a name is its first path's (SPEC 14.1)
                arrays.add(path)
            if found_paths.setdefault(path, ref.tensor_id) != ref.tensor_id:
                raise FormatError(f"the name {path!r:.200} stands for two different tensors")
    # SPEC 14.1: a name identifies one tensor, whether it is an entry's name or a path's.
    if names is None:
        table = paths if isinstance(paths, PathTable) else PathTable.of(paths)
        clash = compiled.name_owner_mismatch(tensors.name_blob, tensors.name_ends, len(tensors), table.blob,
                                             table.ends, table.tids)
        if clash >= 0:
            path = compiled.strings(table.blob, table.ends, clash, clash + 1)[0]
            raise FormatError(f"the name {path!r:.200} stands for two different tensors")
    else:
        for path, tid in paths.items():
            owner = names.get(path)
            if owner is not None and owner != tid:
                raise FormatError(f"the name {path!r:.200} stands for two different tensors")
    del names
    return Index(writer, codecs, tensors, tree, metadata, (version[0], version[1]), paths, frozenset(arrays))


def _column_entries(raw: LazyEntries, ncodecs: int, index_offset: int, tensors: EntryTable, firsts: array) -> None:
    """parse_index's entries from the compiled reader's columns (nvckpt.format._columns): runs of the entries it
    read whose chunks fit the codec table and lie before the index a column at a time, any other entry one by
    one (parse_entry, which says what is wrong), and the first name given twice refused as the one-by-one
    checks refuse it: before any later entry's error."""
    import numpy as np

    columns = raw.columns
    store = tensors.store
    in_columns = np.frombuffer(columns["in_columns"], dtype=np.bool_)  # the entries it read have a row each, in order
    off = np.frombuffer(columns["offset"], dtype=np.uint64)
    room = np.uint64(index_offset) - np.minimum(off, np.uint64(index_offset))  # (no wrap where off is past it)
    chunk_ok = ((np.frombuffer(columns["codec"], dtype=np.uint16) < ncodecs) & (off <= index_offset)
                & (np.frombuffer(columns["stored"], dtype=np.uint64) <= room))
    del off, room
    nchunks = np.frombuffer(columns["nchunks"], dtype=np.uint32)
    ok = in_columns.copy()
    if not chunk_ok.all():  # the rows of the chunks that do not: one by one
        row_ok = np.ones(len(nchunks), dtype=np.bool_)
        row_ok[np.searchsorted(np.cumsum(nchunks, dtype=np.uint64), np.flatnonzero(~chunk_ok), side="right")] = False
        ok[in_columns] = row_ok
    del chunk_ok
    edges = (np.flatnonzero(ok[1:] != ok[:-1]) + 1).tolist()
    if ok.all():  # (every entry in the columns: each column let go once it is copied)
        chunk_at = view_at = None
    else:  # where each row's chunks and view start in their columns
        zero = np.zeros(1, dtype=np.uint64)
        chunk_at = np.concatenate((zero, np.cumsum(nchunks, dtype=np.uint64)))
        view_at = np.concatenate((zero, np.cumsum(np.frombuffer(columns["kind"], dtype=np.uint8) == EntryTable.VIEW,
                                                  dtype=np.uint64)))
    del nchunks
    row = 0
    for lo, hi in zip([0, *edges], [*edges, len(raw)]) if len(raw) else ():
        if ok[lo]:
            if chunk_at is None:
                spans = (0, hi), (0, len(columns["offset"]) // 8), (0, len(columns["view_offset"]) // 8)
            else:
                end = row + hi - lo
                spans = (row, end), (int(chunk_at[row]), int(chunk_at[end])), (int(view_at[row]), int(view_at[end]))
            firsts.frombytes(memoryview(tensors.extend_columns(columns, *spans, whole=chunk_at is None)).cast("B"))
            row += hi - lo
            continue
        for tid in range(lo, hi):
            firsts.append(len(store))
            try:
                if in_columns[tid]:  # (a chunk past the index or of a codec not in the table: parse_entry says which)
                    value, row = raw.row(row), row + 1
                else:
                    value = raw[tid]  # (its decoding may fail: after a name given twice before it)
                entry = parse_entry(tid, value, ncodecs=ncodecs, index_offset=index_offset, store=store)
            except NvckptError:
                _refuse_duplicate(tensors, tid)
                raise
            tensors.append(entry)
    _refuse_duplicate(tensors, len(tensors))


def _refuse_duplicate(tensors: EntryTable, n: int) -> None:
    """The FormatError for the first of entries 0..n-1 whose name an earlier one has, if one has."""
    dup = compiled.names_table(tensors.name_blob, tensors.name_ends, n, False)[0]
    if dup >= 0:
        raise FormatError(f"duplicate tensor name {tensors.name(dup)!r:.200}")


_BATCH = 4096  # index entries decoded and checked together (nvckpt.format.entry.plain_entries)


def _duplicate_name(run: list[str], names: dict[str, int]) -> None:
    """The FormatError for the first name of ``run`` that an earlier entry has (in ``names`` or in the run)."""
    seen: set[str] = set()
    for name in run:
        if name in names or name in seen:
            raise FormatError(f"duplicate tensor name {name!r:.200}")
        seen.add(name)


def _check_metadata(node: Any) -> None:
    """SPEC 8.6: JSON-like values (no ext types, str keys), nested at most MAX_TREE_DEPTH deep (root = 1)."""
    stack = [(node, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_TREE_DEPTH:
                raise LimitError(f"metadata nesting exceeds the limit of {MAX_TREE_DEPTH}")
            if isinstance(item, dict) and not all(isinstance(k, str) for k in item):
                raise FormatError("metadata keys must be strings")
            stack.extend((x, depth + 1) for x in (item.values() if isinstance(item, dict) else item))
        elif isinstance(item, Ext):
            held = "a tuple (ext type 2)" if item.code == 2 else f"an ext type {item.code} value"
            raise FormatError(f"metadata holds {held}; only JSON-like values are allowed (SPEC 8.6)")
        elif item is not None and type(item) not in (bool, int, float, str):
            raise FormatError(f"metadata holds a {type(item).__name__}; only JSON-like values are allowed")


def check_codec_spec(value: Any, in_index: bool = True) -> list[dict[str, Any]]:
    """One codec table entry (SPEC 11.1; ``in_index``: at level 3 of the index, else a CODEC frame's payload),
    checked for its structure; the codecs layer gives it meaning."""
    if not isinstance(value, list) or not value:
        raise FormatError(f"codec pipeline must be a non-empty array, got {type(value).__name__}")
    check_depth(value, "a codec pipeline", level=3 if in_index else 1)
    for step in value:
        if not isinstance(step, dict) or not isinstance(step.get("name"), str):
            raise FormatError(f"codec step must be a map with a string 'name', got {brief(step)}")
        config = step.get("configuration", {})
        if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
            raise FormatError(f"codec {brief(step['name'])}: configuration must be a map with string keys")
        extra = set(step) - {"name", "configuration"}
        if extra:
            raise FormatError(f"codec step {brief(step['name'])} has unknown fields {', '.join(sorted(map(brief, extra)))[:200]}")
    return value


def writer_info(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The index's "writer" map (SPEC 8.2): nvckpt's version, torch's and Python's.  torch's version is read
    from its installed metadata where torch is not imported (``nvckpt recover`` never imports it)."""
    import platform
    import sys

    from .. import __version__

    torch = sys.modules.get("torch")
    if torch is not None:
        version = torch.__version__
    else:
        from importlib.metadata import PackageNotFoundError, version as installed

        try:
            version = installed("torch")
        except PackageNotFoundError:
            version = "none"
    info = {"name": "nvckpt", "version": __version__, "torch": str(version).split("+")[0],
            "python": platform.python_version()}
    info.update(extra or {})
    return info


__all__ = ["writer_info", "Index", "unpack_index", "parse_index", "check_codec_spec", "TensorRef", "EXT_TENSOR", "EXT_TUPLE"]
