"""The layout of an nvckpt DCP directory, without torch (the CLI's info, ls and verify read it).

::

    DIR/
      .metadata          torch.distributed.checkpoint's Metadata (pickle, as FileSystemWriter writes it)
      nvckpt-dcp.json    the manifest: rank files, and every global tensor as the shards that form it
      __0.nvckpt         one ordinary nvckpt file per rank that wrote something
      __1.nvckpt ...

A rank file is a flat map of stored shards: the shard of tensor ``fqn`` at
global offsets ``o`` is named ``fqn`` when ``o`` is all zeros and
``fqn@o0,o1,...`` otherwise (JSON-pointer escaped, SPEC 9).  Non-tensor
values (DCP's BYTE_IO items: torch.save bytes) are stored as uint8 tensors
named ``fqn``.  The manifest says where each piece is, so a tool can check a
directory (missing rank files, shards that do not cover their tensor) from
JSON and nvckpt indexes alone.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import FormatError
from ..io.directory import open_directory
from ..format.dtypes import DTYPES

MANIFEST = "nvckpt-dcp.json"
METADATA = ".metadata"
FORMAT = "nvckpt-dcp"
VERSION = 1


def rank_file(index: int) -> str:
    return f"__{index}.nvckpt"


#: The names a checkpoint directory holds of its own (nvckpt's, FileSystemWriter's, a crashed save's
#: temporaries): an overwrite replaces them; every other entry (a user's config, an export) is kept.
_OWN = re.compile(r"(\.metadata|nvckpt-dcp\.json|__\d+\.nvckpt|__\d+_\d+\.distcp|\..*\.nvckpt-tmp)\Z")


def foreign_rank_file(index_metadata: Any, save_id: str | None, file: str) -> str | None:
    """Why rank file ``file`` (its index's metadata) is not part of the save ``save_id``, or None: a rank
    file copied in from another save of the same shapes would otherwise load as part of this one, and one
    copied over another rank's file of the same save would give its rows as the other rank's.

    Every reader of a directory asks this of each rank file it reads, with the save that
    ``directory_save_id`` (or, in dcp.load, the unpickled ``.metadata``) names."""
    own = index_metadata.get("nvckpt.dcp") if isinstance(index_metadata, dict) else None
    own = own if isinstance(own, dict) else {}
    got, name = own.get("save_id"), own.get("file")
    if save_id and got and got != save_id:
        return f"rank file {file} was written by another save (save_id {got}, the directory's is {save_id})"
    if isinstance(name, str) and name != file:
        return f"rank file {file} holds the shards of {name} (a copy or rename of another rank's file)"
    return None


def save_of(manifest: "Manifest", metadata_save_id: str | None) -> str | None:
    """The save a directory is of: the one its ``.metadata`` names (``metadata_save_id``: what dcp.load plans
    from), which its manifest (what the tools read) must name too; a FormatError where the two name two saves
    (what a copy taken while a new save was published over the directory can hold)."""
    if metadata_save_id and manifest.save_id and metadata_save_id != manifest.save_id:
        raise FormatError(f"{METADATA} and {MANIFEST} are of two saves (save_id {metadata_save_id} and "
                          f"{manifest.save_id}): parts of another save were copied in", path=manifest.directory)
    return metadata_save_id or manifest.save_id


def directory_save_id(manifest: "Manifest") -> str | None:
    """``save_of`` for a tool that does not unpickle ``.metadata`` (merge, convert, verify, info, ls): its save_id
    read by ``metadata_save_id``; a FormatError for a ``.metadata`` missing, damaged, not DCP's, or of
    another save than the manifest."""
    return save_of(manifest, metadata_save_id(manifest.directory))


class _Named:
    """An object a pickle names, rebuilt as the arguments and state it was given: a class or function the
    pickle names is neither imported nor called (``_Inert``), so a ``.metadata`` is read without running it."""

    module = qualname = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Named":
        self = object.__new__(cls)
        self.args, self.state, self.items = args, None, {}
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:  # a dict subclass's items (SETITEMS)
        self.items[key] = value

    def append(self, value: Any) -> None:  # a list subclass's items (APPENDS)
        self.items[len(self.items)] = value

    def field(self, name: str) -> Any:
        return self.state.get(name) if isinstance(self.state, dict) else None


class _Inert(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._classes: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> type:
        key = (module, name)
        if key not in self._classes:
            self._classes[key] = type(name.rpartition(".")[2] or "_", (_Named,), {"module": module, "qualname": name})
        return self._classes[key]


def metadata_save_id(directory: Any) -> str | None:
    """The save_id in the StorageMeta of DCP's ``.metadata`` in ``directory`` (None where it records none), read
    without unpickling it (the tools that call this never run code from a checkpoint); a FormatError for a
    ``.metadata`` missing, damaged or not DCP's Metadata."""
    data = metadata_bytes(directory)
    try:
        root = _Inert(data).load()
    except Exception as exc:  # noqa: BLE001 - opcodes that do not build, a pickle cut short
        raise metadata_damaged(directory, data, exc) from None
    name = f"{root.module}.{root.qualname}" if isinstance(root, _Named) else type(root).__qualname__
    if name != "torch.distributed.checkpoint.metadata.Metadata":
        raise FormatError(f"{METADATA} holds a {name}, not DCP Metadata", path=directory)
    storage = root.field("storage_meta")
    save_id = storage.field("save_id") if isinstance(storage, _Named) else None
    return save_id if isinstance(save_id, str) and save_id else None


def metadata_bytes(directory: Any) -> bytes:
    """DCP's ``.metadata`` file in ``directory`` (a path, a URL or a Directory), or a FormatError saying what is
    wrong with it (missing, unreadable, empty, cut short).  Only its last byte is looked at here (a pickle ends
    with STOP): whoever reads it (``metadata_damaged`` names what stops an unpickler) finds the rest, without a
    walk over every opcode (a list of tens of thousands of them on every load, which set off full garbage
    collections)."""
    store = open_directory(directory)
    directory = store.name
    try:
        data = store.read_bytes(METADATA)
    except FileNotFoundError:
        raise FormatError(f"{METADATA} is missing (dcp.load reads the checkpoint's plan from it)", path=directory) from None
    except OSError as exc:
        raise FormatError(f"{METADATA} cannot be read: {exc.strerror or exc}", path=directory) from None
    if not data.endswith(b"."):  # pickle's STOP opcode
        raise metadata_damaged(directory, data, ValueError("no STOP opcode at its end"))
    return data


def metadata_damaged(directory: Any, data: bytes, exc: BaseException) -> FormatError:
    """The FormatError for a ``.metadata`` of ``data`` that an unpickler stopped at with ``exc``."""
    return FormatError(f"{METADATA} is damaged ({len(data)} bytes, not a whole pickle: {exc})",
                       path=getattr(directory, "name", directory))


def user_entry(name: str) -> bool:
    """An entry of a checkpoint directory that is not the checkpoint's own (an overwrite keeps it)."""
    return _OWN.match(name) is None


def shard_key(fqn: str, offsets: Any) -> str:
    """The key, in a rank file's flat map, of the shard of ``fqn`` at global ``offsets`` (None: a
    non-tensor value); its stored name is ``escape(key)``."""
    return fqn if offsets is None or not any(offsets) else f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


@dataclass(frozen=True)
class Shard:
    """One stored piece of a global tensor: where it is and which box of the tensor it holds."""

    file: str
    tensor: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class GlobalTensor:
    """A tensor of the saved state dict, as the shards that form it."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    shards: tuple[Shard, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the global tensor (0 for a dtype this reader does not know)."""
        n = DTYPES[self.dtype].itemsize if self.dtype in DTYPES else 0
        for s in self.shape:
            n *= s
        return n

    def coverage_gaps(self) -> int:
        """Elements of the global tensor no shard holds (0 for a complete tensor; shards do not overlap)."""
        total = 1
        for s in self.shape:
            total *= s
        held = 0
        for sh in self.shards:
            n = 1
            for s in sh.sizes:
                n *= s
            held += n
        return total - held


@dataclass(frozen=True)
class Manifest:
    directory: str
    world_size: int
    save_id: str | None
    files: dict[str, int]  # rank file -> its size in bytes when written
    tensors: dict[str, GlobalTensor]
    objects: dict[str, tuple[str, str]]  # fqn -> (file, stored name) of a non-tensor value
    paths: dict[str, list[Any]]  # fqn -> its path in the nested state dict (DCP's planner_data)
    # fqn -> positions in its path of dict keys that were ints (DCP writes every dict key as str; an
    # optimizer's state is keyed by int), where the writer had the state (nvckpt split).
    int_keys: dict[str, list[int]] = field(default_factory=dict)
    # fqn -> [position, tag] of the path's other dict keys that were not str (tags: KEY_TYPES), as int_keys.
    key_types: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    # The empty dicts of the state (DCP stores nothing for them: a fresh optimizer's "state": {}), each as
    # {"path": [...], "int_keys": [...], "key_types": [...]} (either list left out when empty): a path as
    # DCP's, its keys' types as above.
    empty_dicts: list[dict[str, Any]] = field(default_factory=list)
    # The Directory it was read from (reads the rank files); None for a manifest being written.
    store: Any = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "world_size": self.world_size, "save_id": self.save_id,
            "files": self.files,
            "tensors": {fqn: {"dtype": t.dtype, "shape": list(t.shape),
                              "shards": [{"file": s.file, "tensor": s.tensor, "offsets": list(s.offsets),
                                          "sizes": list(s.sizes)} for s in t.shards]}
                        for fqn, t in self.tensors.items()},
            "objects": {fqn: {"file": f, "tensor": n} for fqn, (f, n) in self.objects.items()},
            "paths": self.paths,
            **({"int_keys": self.int_keys} if self.int_keys else {}),
            **({"key_types": {fqn: [list(m) for m in v] for fqn, v in self.key_types.items()}}
               if self.key_types else {}),
            **({"empty_dicts": self.empty_dicts} if self.empty_dicts else {}),
        }


# Dict keys other than str and int that DCP writes as str(key) and a manifest gives their type back: the tag
# in "key_types" -> the key from its str.  (int keys: "int_keys", the field older manifests have.)
KEY_TYPES: dict[str, Any] = {"float": float, "bool": lambda text: text == "True", "none": lambda text: None}


def key_tag(key: Any) -> str | None:
    """The type tag of a non-str dict key: "int", or one of KEY_TYPES; None for a str or another type."""
    if isinstance(key, bool):
        return "bool"
    if isinstance(key, int):
        return "int"
    if isinstance(key, float):
        return "float"
    return "none" if key is None else None


def typed_path(path: list[Any], int_keys: Any = (), key_types: Any = ()) -> tuple[list[Any], set[int]]:
    """DCP's path with its dict keys' own types back, and the positions that are dict keys (not list indices)."""
    path = list(path)
    marked = set()

    def position(i: Any) -> bool:  # a key's place in the path (a crafted manifest may name any value)
        if type(i) is not int or i < 0:
            raise ValueError(f"key position {i!r} is not a non-negative int")
        return i < len(path)

    for i in int_keys or ():
        if position(i):
            path[i] = int(path[i])
            marked.add(i)
    for i, tag in key_types or ():
        if position(i) and tag in KEY_TYPES:
            path[i] = KEY_TYPES[tag](str(path[i]))
            marked.add(i)
    return path, marked


def _key_mark(mark: Any) -> tuple[int, str]:
    position, tag = mark
    if tag not in KEY_TYPES:
        raise ValueError(f"key type {tag!r} is not one of {', '.join(KEY_TYPES)}")
    return int(position), str(tag)


def _state_path(path: Any) -> list[Any]:
    """A value's path in the nested state dict (DCP's planner data): a non-empty list of str keys and int
    list positions."""
    if not isinstance(path, list) or not path or not all(type(p) in (str, int) for p in path):
        raise ValueError(f"a path in the state must be a non-empty array of str and int, got {path!r:.80}")
    return path


def is_dcp_directory(path: Any) -> bool:
    return open_directory(path).size(MANIFEST) is not None  # a manifest is there only in a directory


def check_directory(store: Any) -> None:
    """Raise what is wrong with ``store`` (a Directory) as an nvckpt DCP directory: a file given where a directory
    belongs, nothing there, a plain folder, or a directory of torch's FileSystemWriter.  Asks for the manifest
    first: in an object store its size comes with the commit object, so a checkpoint costs that one request."""
    if store.size(MANIFEST) is not None:
        return
    path = store.name
    if store.is_file():  # a file given where a DCP directory belongs (nvckpt merge FILE)
        raise NotADirectoryError(20, "is a file, not a checkpoint directory (nvckpt.dcp.Writer writes a directory)", path)
    if not store.exists():
        raise FileNotFoundError(2, "no such checkpoint directory", path)
    if store.size(METADATA) is None:  # no checkpoint of any kind: a folder given for a file
        raise IsADirectoryError(21, f"Is a directory (neither an nvckpt file nor a checkpoint directory: no {MANIFEST})",
                                path)
    hint = (" (it holds a .metadata: a DCP directory of torch's FileSystemWriter, read with FileSystemReader, "
            "which has no checksums to verify; `nvckpt info --allow-pickle` and `nvckpt convert --allow-pickle` "
            "read it)")
    raise FormatError(f"not an nvckpt DCP directory: no {MANIFEST}{hint}", path=path)


def read_manifest(path: Any) -> Manifest:
    """The manifest of the nvckpt DCP directory ``path`` (a path, a URL or a Directory; FormatError naming
    what is wrong).  ``Manifest.store`` is that Directory, which reads its rank files."""
    store = open_directory(path)
    path = store.name
    where = store.join(MANIFEST)
    check_directory(store)
    try:
        doc = json.loads(store.read_bytes(MANIFEST))
        if doc.get("format") != FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, not {FORMAT!r}")
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')!r} is not supported (this reader: {VERSION})")
        files = {str(k): int(v) for k, v in doc["files"].items()}
        tensors = {}
        for fqn, t in doc["tensors"].items():
            shards = tuple(Shard(str(s["file"]), str(s["tensor"]), tuple(map(int, s["offsets"])),
                                 tuple(map(int, s["sizes"]))) for s in t["shards"])
            tensors[fqn] = GlobalTensor(fqn, str(t["dtype"]), tuple(map(int, t["shape"])), shards)
        objects = {fqn: (str(o["file"]), str(o["tensor"])) for fqn, o in doc["objects"].items()}
        int_keys = {str(fqn): [int(i) for i in v] for fqn, v in (doc.get("int_keys") or {}).items()}
        key_types = {str(fqn): [_key_mark(m) for m in v] for fqn, v in (doc.get("key_types") or {}).items()}
        empty_dicts = [{"path": list(e["path"]), "int_keys": [int(i) for i in e.get("int_keys") or ()],
                        "key_types": [_key_mark(m) for m in e.get("key_types") or ()]}
                       for e in doc.get("empty_dicts") or ()]
        paths = {str(fqn): _state_path(p) for fqn, p in (doc.get("paths") or {}).items()}
        manifest = Manifest(path, int(doc["world_size"]), doc.get("save_id"), files, tensors, objects,
                            paths, int_keys, key_types, empty_dicts, store)
        for e in empty_dicts:  # what nest() will convert, checked here (a bad manifest is one FormatError)
            if not all(type(p) in (str, int) for p in e["path"]):
                raise ValueError(f"an empty dict's path {e['path']!r} holds a value that is not a str or int")
            typed_path(e["path"], e["int_keys"], e["key_types"])
        for fqn in set(int_keys) | set(key_types):  # what nest() will convert, as for the empty dicts
            typed_path(manifest.paths.get(fqn) or [fqn], int_keys.get(fqn), key_types.get(fqn))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FormatError(f"bad manifest: {exc}", path=where) from None
    for name in files:
        if os.path.basename(name) != name or name in ("", ".", "..") or name.startswith("."):
            raise FormatError(f"bad manifest: rank file name {name!r} is not a plain file name", path=where)
    for fqn, t in manifest.tensors.items():
        for s in t.shards:
            if s.file not in files or len(s.offsets) != len(t.shape) or len(s.sizes) != len(t.shape) or any(
                    o < 0 or n < 0 or o + n > size for o, n, size in zip(s.offsets, s.sizes, t.shape)):
                raise FormatError(f"bad manifest: a shard of {fqn!r} lies outside the tensor or in an unlisted "
                                  f"file ({s.file})", path=where)
    for fqn, (f, _) in manifest.objects.items():
        if f not in files:
            raise FormatError(f"bad manifest: {fqn!r} is in an unlisted file ({f})", path=where)
    return manifest


__all__ = ["MANIFEST", "METADATA", "Manifest", "GlobalTensor", "Shard", "is_dcp_directory", "check_directory",
           "read_manifest",
           "rank_file", "shard_key", "KEY_TYPES", "key_tag", "typed_path", "foreign_rank_file", "save_of",
           "directory_save_id", "metadata_save_id", "metadata_bytes", "metadata_damaged"]
