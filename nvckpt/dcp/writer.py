"""``nvckpt.dcp.Writer``: a torch.distributed.checkpoint StorageWriter writing one nvckpt file per rank.

DCP plans what each rank writes (FSDP2/DTensor shards, deduplicated
replicas); each rank writes its items as one ordinary nvckpt file (the path of
``nvckpt.save``: the GPU engine for CUDA shards, the CPU engine otherwise)
into the staging the coordinator began; after every rank succeeded, the
coordinator writes DCP's ``.metadata`` and the manifest there and publishes
the directory (nvckpt.sharded.transaction over nvckpt.io.directory).

What FileSystemWriter does instead: it writes ``__R_N.distcp`` straight into
the target directory (overwriting a previous checkpoint's files in place)
and only ``.metadata`` through a temporary name.  A rank killed mid-save
leaves the directory with the previous ``.metadata`` pointing at half-rewritten
files: the previous checkpoint is lost.  Here it stays whole until the new one
replaces it in one rename.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..format.tree import escape
from ..io.directory import location, open_directory
from ..options import SaveOptions, options_from
from ..tensors.dtypes import name_of
from ..sharded.layout import MANIFEST, METADATA, GlobalTensor, Manifest, Shard, key_tag, rank_file, shard_key
from ..sharded.transaction import DirectorySave
from .split import empty_dicts

DCP_VERSION = "1.0.0"  # the Metadata.version FileSystemWriter writes (torch 2.11 to 2.13)


class Location(NamedTuple):
    """``WriteResult.storage_data``: the rank file and the stored name of one item."""

    file: str
    tensor: str

    @property
    def relative_path(self) -> str:
        # What DCP's FileSystemReader asks of its own storage data: say which reader this directory needs.
        raise RuntimeError(f"this checkpoint directory was written by nvckpt.dcp.Writer (rank file {self.file!r}): "
                           "load it with dcp.load(..., storage_reader=nvckpt.dcp.Reader(DIR)), or make one file "
                           "with `nvckpt merge DIR out.nvckpt`")


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """``SavePlan.storage_data`` from the coordinator: where this rank writes."""

    staging: str  # the staging's token (nvckpt.io.directory.Staging)
    file: str
    save_id: str = ""  # the coordinator's: every rank file records the one save it belongs to


class Writer(StorageWriter):
    """``dcp.save(state, storage_writer=nvckpt.dcp.Writer(DIR))``: DIR becomes a directory of one nvckpt
    file per rank, published only once every rank has written its file.

    ``overwrite``: replace a previous checkpoint at DIR (default True, as
    FileSystemWriter); the other files and folders in it (a config, an export)
    are kept, and an existing directory that is not a checkpoint is never
    replaced.  Other keywords are ``nvckpt.save``'s (codec, chunk_size,
    engine, gpu, ...), used for every rank's file."""

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = True, **options: Any) -> None:
        super().__init__()
        self.path = location(path)
        self.overwrite = overwrite
        self.options: SaveOptions = options_from(SaveOptions, "nvckpt.dcp.Writer", options)
        self.save_id = uuid.uuid4().hex
        self.transaction = DirectorySave(open_directory(self.path, self.options.storage_options), overwrite=overwrite)
        self.rank: int | None = None
        self.is_coordinator = False
        self.last_result: Any = None  # this rank's SaveResult (sizes, seconds, engine) after write_data
        self._staging: str | None = None  # the coordinator's staging (its token) of the save in progress
        # The state being saved, where the caller has it whole (nvckpt split): DCP's planner data turns dict
        # keys into str, and the manifest's paths then get the keys' own types back (an optimizer's int keys).
        self.source: Any = None

    # -- StorageWriter --------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = location(checkpoint_id)
            self.transaction = DirectorySave(open_directory(self.path, self.options.storage_options),
                                             overwrite=self.overwrite)
        self.save_id = uuid.uuid4().hex
        if self._staging is not None:  # a Writer used again: a new save, started now
            self.transaction.restart()
            self._staging = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        if kwargs.get("use_collectives", True) is False:
            raise ValueError("nvckpt.dcp.Writer publishes the directory after every rank succeeded, which needs "
                             "DCP's collectives: call dcp.save without use_collectives=False")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator checks the target, clears what failed saves left, and stages the new checkpoint."""
        staging = self._staging = self.transaction.begin()
        return [dataclasses.replace(p, storage_data=RankPlan(staging, rank_file(i), self.save_id))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future: Future[list[WriteResult]] = Future()
        try:
            future.set_result(self._write(plan, planner))
        except BaseException as exc:  # DCP gathers every rank's failure and raises them together
            where = getattr(plan, "storage_data", None)
            self.abandon(where if isinstance(where, RankPlan) else None)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: torch's Future takes Exceptions only; the caller gets it as is
            future.set_exception(exc)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Every rank succeeded: write the metadata and the manifest, then publish the directory."""
        located = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        staging = self._staging
        if staging is None:
            raise RuntimeError("nvckpt.dcp.Writer.finish before prepare_global_plan (not the coordinator?)")
        metadata.version = DCP_VERSION
        metadata.storage_data = located
        metadata.storage_meta = self.storage_meta()
        try:
            manifest = self._manifest(metadata, staging, world_size=len(results))
        except BaseException:
            self.abandon()
            raise
        # Not published (a full disk, a newer save published first): nothing of it stays (the transaction).
        self.transaction.finish(staging, {METADATA: pickle.dumps(metadata),
                                          MANIFEST: json.dumps(manifest.to_json(), indent=1).encode()})

    def abandon(self, where: RankPlan | None = None) -> None:
        """This save failed and can no longer publish (DCP publishes only once every rank has succeeded): its
        staging (``where.staging`` on a rank, this Writer's own on the coordinator) is removed with whatever
        the ranks wrote there.  A rank still writing into it then fails too (naming why) instead of recreating
        it, and the failed save leaves nothing beside its target, not even on a full disk."""
        self.transaction.abandon(where.staging if where is not None else self._staging)

    # -- the work ---------------------------------------------------------------------------------
    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        where = plan.storage_data
        if not isinstance(where, RankPlan):
            raise TypeError("nvckpt.dcp.Writer.write_data got a plan its prepare_global_plan did not make")
        if not plan.items:
            return []
        state: dict[str, torch.Tensor] = {}
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = bytes(data.getbuffer()) if isinstance(data, io.BytesIO) else bytes(data)
                tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                key, size = shard_key(item.index.fqn, None), len(raw)
            else:
                tensor = data.detach()
                key, size = shard_key(item.index.fqn, item.tensor_data.chunk.offsets), tensor.numel() * tensor.element_size()
            if key in state:
                raise ValueError(f"two items of this rank would be stored as {key!r}: rename the state dict key")
            state[key] = tensor
            results.append(WriteResult(index=item.index, size_in_bytes=size,
                                       storage_data=Location(where.file, escape(key))))
        meta = dict(self.options.metadata or {})
        meta["nvckpt.dcp"] = {"save_id": where.save_id or self.save_id, "file": where.file, "rank": self.rank}
        options = dataclasses.replace(self.options, metadata=meta)
        self.last_result = self.transaction.write_rank(where.staging, where.file, state, options)
        return results

    def _manifest(self, metadata: Metadata, staging: str, world_size: int) -> Manifest:
        located: dict[MetadataIndex, Location] = metadata.storage_data
        files = {loc.file: self.transaction.size(staging, loc.file) for loc in located.values()}
        tensors, objects = {}, {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                loc = located[MetadataIndex(fqn)]
                objects[fqn] = (loc.file, loc.tensor)
                continue
            shards = []
            for chunk in md.chunks:
                loc = located[MetadataIndex(fqn, chunk.offsets)]
                shards.append(Shard(loc.file, loc.tensor, tuple(chunk.offsets), tuple(chunk.sizes)))
            tensors[fqn] = GlobalTensor(fqn, name_of(md.properties.dtype), tuple(md.size), tuple(shards))
        paths, int_keys, key_types = {}, {}, {}
        by_str: dict[int, dict[str, Any]] = {}
        if isinstance(metadata.planner_data, dict):
            for fqn, path in metadata.planner_data.items():
                if isinstance(path, (tuple, list)) and all(isinstance(p, (str, int)) for p in path):
                    paths[fqn] = list(path)
                    ints, typed = ([], []) if self.source is None else _dict_key_types(list(path), self.source, by_str)
                    if ints:
                        int_keys[fqn] = ints  # the field older readers know
                    if typed:
                        key_types[fqn] = typed
        empty = empty_dicts(self.source) if self.source is not None else []
        return Manifest(self.path, world_size, self.save_id, files, tensors, objects, paths, int_keys, key_types,
                        empty)


def _dict_key_types(path: list[Any], source: Any,
                    by_str: dict[int, dict[str, Any]]) -> tuple[list[int], list[tuple[int, str]]]:
    """Positions in ``path`` (DCP's, dict keys as str) of dict keys that are not str in ``source``: the ints,
    and the others with their type tag (nvckpt.sharded.layout.KEY_TYPES).  ``by_str``: id(dict) -> its non-str
    keys by their str, filled as needed (an optimizer's state has a key per parameter, reached by every path)."""
    ints: list[int] = []
    typed: list[tuple[int, str]] = []
    node = source
    for i, key in enumerate(path):
        if isinstance(node, Mapping) and key not in node and isinstance(key, str):
            keys = by_str.get(id(node))
            if keys is None:  # one key per str at most: write_directory refuses two
                keys = by_str[id(node)] = {str(k): k for k in node if not isinstance(k, str) and key_tag(k) is not None}
            if key in keys:
                key = keys[key]
                tag = key_tag(key)
                if tag == "int":
                    ints.append(i)
                else:
                    typed.append((i, tag))
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            break
    return ints, typed


__all__ = ["Writer", "Location", "RankPlan"]
