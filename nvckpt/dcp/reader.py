"""``nvckpt.dcp.Reader``: a torch.distributed.checkpoint StorageReader for directories ``Writer`` made.

DCP's load planner turns the target state dict (any world size, any
sharding) into ReadItems, each an n-d box of one stored shard; the reader
decodes each box with ``Checkpoint.read_boxes_into`` straight into its target
on the CPU (each chunk once, only those holding the box's rows), with
``Checkpoint.read_box`` on a GPU.  Each chunk's checksum is verified before it is
decoded, each whole tensor's after; an error names the rank file and the
tensor.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import FormatError
from ..io.directory import location, open_directory
from ..options import LoadOptions, options_from
from ..session.load import Checkpoint
from .._gc import paused as gc_paused
from ..sharded.layout import (METADATA, check_directory, foreign_rank_file, metadata_bytes, metadata_damaged,
                              read_manifest, save_of)


class Reader(StorageReader):
    """``dcp.load(state, storage_reader=nvckpt.dcp.Reader(DIR))``.

    Each box is decoded on the device of the tensor DCP loads it into (the
    GPU loader for CUDA targets where nvCOMP is).  Keywords are
    ``nvckpt.open``'s except ``device`` (workers, untrusted,
    max_tensor_bytes, gpu).  Like FileSystemReader, it unpickles DCP's
    ``.metadata``: open only directories you trust."""

    def __init__(self, path: str | os.PathLike, **options: Any) -> None:
        super().__init__()
        if "device" in options:
            raise TypeError("nvckpt.dcp.Reader decodes on the device of each target tensor; it takes no device=")
        self.path = location(path)
        self.options: LoadOptions = options_from(LoadOptions, "nvckpt.dcp.Reader", options)
        self.store = open_directory(self.path, self.options.storage_options)
        self.storage_data: dict[Any, Any] = {}
        self.bytes_read = 0  # this rank's bytes read from rank files by the last read_data
        self.save_id: str | None = None  # the save the metadata names (its rank files must be of that save)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        self.save_id = None
        if checkpoint_id:
            self.path = location(checkpoint_id)
            self.store = open_directory(self.path, self.options.storage_options)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        from ..sharded.layout import is_dcp_directory

        return isinstance(checkpoint_id, (str, os.PathLike)) and is_dcp_directory(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        check_directory(self.store)  # a clear error for a missing, foreign or unfinished directory
        # Entries that one publish wrote (an object store's commit object names them) are of one save: the
        # manifest, which says so for a folder whose files may have been copied in one by one, is not read.
        manifest = None if self.store.one_save() else read_manifest(self.store)
        data = metadata_bytes(self.store)
        try:
            with gc_paused():  # tens of thousands of objects, none cyclic: no full collection while they are made
                metadata = pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - a pickle cut short or damaged
            raise metadata_damaged(self.path, data, exc) from None
        if not isinstance(metadata, Metadata):
            raise FormatError(f"{METADATA} holds a {type(metadata).__qualname__}, not DCP Metadata", path=self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        located = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
        files = manifest.files if manifest is not None else {getattr(loc, "file", "") for loc in located.values()}
        missing = sorted(f for f in files if isinstance(f, str) and f and self.store.size(f) is None)
        if missing:
            raise FormatError(f"rank file{'s' if len(missing) > 1 else ''} {', '.join(missing)} missing", path=self.path)
        if manifest is not None:
            save_of(manifest, getattr(metadata.storage_meta, "save_id", None))  # the manifest's save is the plan's
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise FormatError("the metadata has no storage_data", path=self.path)
        self.storage_data = metadata.storage_data
        self.save_id = getattr(metadata.storage_meta, "save_id", None)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Marks the rank files that more than one rank reads (a reshard: every rank reads a column box of
        every stored shard): those ranks read them through the page cache, so one read from the disk serves
        all of them; a file that one rank alone reads is read with O_DIRECT where the GPU loader does that."""
        readers: dict[str, set[int]] = {}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                loc = self.storage_data.get(item.storage_index)
                if loc is not None:
                    readers.setdefault(loc.file, set()).add(rank)
        shared = {file for file, ranks in readers.items() if len(ranks) > 1}
        out = []
        for rank, plan in enumerate(plans):
            mine = sorted(file for file in shared if rank in readers[file])
            storage = dict(plan.storage_data) if isinstance(plan.storage_data, dict) else {}
            storage["shared_files"] = mine
            out.append(dataclasses.replace(plan, storage_data=storage))
        return out

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        future: Future[None] = Future()
        try:
            self._read(plan, planner)
            future.set_result(None)
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            loc = self.storage_data.get(item.storage_index)
            if loc is None:
                raise FormatError(f"the metadata does not locate {item.storage_index.fqn!r}", path=self.path)
            per_file.setdefault(loc.file, []).append((item, loc))
        opened: dict[tuple[str, str], Checkpoint] = {}
        self.bytes_read = 0
        shared = set(plan.storage_data.get("shared_files", ())) if isinstance(plan.storage_data, dict) else set()
        through_cache = dataclasses.replace(self.options, gpu=dataclasses.replace(self.options.gpu, direct_io=False))

        def checkpoint(file: str, device: torch.device) -> Checkpoint:
            key = (file, str(device))
            if key not in opened:
                options = through_cache if file in shared else self.options
                ck = opened[key] = Checkpoint(self.store.open_source(file), dataclasses.replace(options, device=device))
                foreign = foreign_rank_file(ck.file.index.metadata, self.save_id, file)
                if foreign:
                    raise FormatError(foreign, path=self.path)
            return opened[key]

        try:
            for file, items in per_file.items():
                whole: list[tuple[Any, Any]] = []  # boxes spanning all rows of their stored tensor
                boxes: list[tuple[Any, Any, torch.Tensor]] = []
                for item, loc in items:
                    if item.type == LoadItemType.BYTE_IO:
                        raw = checkpoint(file, torch.device("cpu")).get_tensor(loc.tensor)
                        planner.load_bytes(item, io.BytesIO(raw.numpy().tobytes()))
                        continue
                    boxes.append((item, loc, planner.resolve_tensor(item).detach()))
                on_cpu = [b for b in boxes if b[2].device.type == "cpu"]
                if on_cpu:
                    # Decoded straight into the targets, every box of the file in one run of the decode threads.
                    ck = checkpoint(file, torch.device("cpu"))
                    left = set(ck.read_boxes_into([(loc.tensor, item.storage_offsets, item.lengths, target)
                                                   for item, loc, target in on_cpu]))
                    for k, (item, loc, target) in enumerate(on_cpu):
                        if k not in left:
                            planner.commit_tensor(item, target)
                    boxes = [b for b in boxes if b[2].device.type != "cpu"] + [on_cpu[k] for k in sorted(left)]
                for item, loc, target in boxes:
                    ck = checkpoint(file, target.device)
                    rows = ck.file.entry(loc.tensor).shape[:1]
                    if not rows or (item.storage_offsets[0] == 0 and item.lengths[0] == rows[0]):
                        whole.append((item, loc, target))
                    else:
                        self._commit(planner, item, target,
                                     ck.read_box(loc.tensor, item.storage_offsets, item.lengths), file, loc)
                self._read_whole(file, whole, checkpoint, planner)
        finally:
            for ck in opened.values():
                self.bytes_read += ck.bytes_read
                ck.close()

    def _read_whole(self, file: str, items: list[tuple[Any, Any, torch.Tensor]], checkpoint: Any,
                    planner: LoadPlanner) -> None:
        """Whole stored tensors, decoded in batches of about ``gpu.decode_batch_bytes`` (one GPU loader
        run per batch, not per tensor), then cut to each box in the other dims."""
        limit = self.options.gpu.decode_batch_bytes
        by_device: dict[torch.device, list[tuple[Any, Any, torch.Tensor]]] = {}
        for entry in items:
            by_device.setdefault(entry[2].device, []).append(entry)
        for device, group in by_device.items():
            ck = checkpoint(file, device)
            batch: list[tuple[Any, Any, torch.Tensor]] = []
            size = 0
            for k, entry in enumerate(group):
                batch.append(entry)
                size += ck.file.entry(entry[1].tensor).nbytes
                if size >= limit or k == len(group) - 1:
                    loaded = ck.load(dict.fromkeys(loc.tensor for _, loc, _ in batch))
                    for item, loc, target in batch:
                        box = loaded[loc.tensor]
                        for d in range(1, box.dim()):
                            box = box.narrow(d, item.storage_offsets[d], item.lengths[d])
                        self._commit(planner, item, target, box, file, loc)
                    del loaded
                    batch, size = [], 0

    def _commit(self, planner: LoadPlanner, item: Any, target: torch.Tensor, box: torch.Tensor, file: str,
                loc: Any) -> None:
        if box.shape != target.shape:
            raise FormatError(f"stored box of shape {list(box.shape)} for a target of shape {list(target.shape)}",
                              path=self.store.join(file), tensor=loc.tensor)
        target.copy_(box)
        planner.commit_tensor(item, target)


__all__ = ["Reader"]
