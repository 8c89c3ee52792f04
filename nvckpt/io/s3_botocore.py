"""S3 through botocore, for a process forked after obstore ran in it or in its parent.

obstore runs its requests on a tokio runtime whose threads a fork does not copy: in a forked child (a
DataLoader worker, a ``multiprocessing`` process started by fork) every obstore call waits forever, and
obstore cannot start a new runtime (developmentseed/obstore: "obstore is not fork safe").  nvckpt.io.s3
then makes the same calls through these functions, which take the same arguments and give the same results
as obstore's (``get``, ``head``, ``put``, ``list``, ``delete``, ``open_writer``) on a botocore client made in
the child.  Semantics stay those of the module docstring of nvckpt.io.s3: reads pinned with If-Match,
multipart writes with bounded parts in flight, completed at commit and aborted on an error.  botocore's
errors are turned into one-line OSErrors there as obstore's are.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future
from typing import Any, Iterator

from .._threads import shared_pool


class BotoStore:
    """One bucket through a botocore client (what ``store_for`` gives in a forked child)."""

    def __init__(self, bucket: str, client: Any) -> None:
        self.bucket = bucket
        self.client = client


_RANGE_TOTAL = re.compile(r"/(\d+)\s*$")


class _GetResult:
    def __init__(self, answer: dict[str, Any]) -> None:
        self._body = answer["Body"]
        total = _RANGE_TOTAL.search(answer.get("ContentRange") or "")
        self.meta = {"size": int(total.group(1)) if total else int(answer["ContentLength"]),
                     "e_tag": answer.get("ETag")}

    def bytes(self) -> bytes:
        return self._body.read()

    def stream(self, min_chunk_size: int = 10 << 20) -> Iterator[bytes]:
        return self._body.iter_chunks(min_chunk_size)


def get(store: BotoStore, key: str, options: dict[str, Any] | None = None) -> _GetResult:
    kw: dict[str, Any] = {"Bucket": store.bucket, "Key": key}
    options = options or {}
    span = options.get("range")
    if isinstance(span, dict):
        kw["Range"] = f"bytes=-{span['suffix']}"
    elif span is not None:
        kw["Range"] = f"bytes={span[0]}-{span[1] - 1}"
    if options.get("if_match"):
        kw["IfMatch"] = options["if_match"]
    return _GetResult(store.client.get_object(**kw))


def head(store: BotoStore, key: str) -> dict[str, Any]:
    answer = store.client.head_object(Bucket=store.bucket, Key=key)
    return {"size": int(answer["ContentLength"]), "e_tag": answer.get("ETag")}


def put(store: BotoStore, key: str, data: Any, use_multipart: bool = False) -> None:
    store.client.put_object(Bucket=store.bucket, Key=key, Body=bytes(data))


def list(store: BotoStore, prefix: str | None = None, chunk_size: int = 1000) -> Iterator[list[dict[str, Any]]]:  # noqa: A001 - obstore's name
    kw: dict[str, Any] = {"Bucket": store.bucket, "Prefix": prefix or "", "PaginationConfig": {"PageSize": chunk_size}}
    for page in store.client.get_paginator("list_objects_v2").paginate(**kw):
        yield [{"path": o["Key"], "size": o["Size"], "e_tag": o.get("ETag")} for o in page.get("Contents", [])]


def delete(store: BotoStore, keys: Any) -> None:
    keys = [keys] if isinstance(keys, str) else keys
    if keys:
        store.client.delete_objects(Bucket=store.bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})


class _Writer:
    """A multipart upload fed by ``write``: parts of ``buffer_size`` bytes sent as they fill, at most
    ``max_concurrency`` in flight; an object smaller than one part is one PUT at ``close``."""

    def __init__(self, store: BotoStore, key: str, buffer_size: int, max_concurrency: int) -> None:
        self.store, self.key = store, key
        self.part_size = buffer_size
        self.in_flight = max_concurrency
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.parts: dict[int, str] = {}
        self.pending: list[Future] = []
        self.numbers = 0  # parts sent
        self.lock = threading.Lock()
        self._closed = False

    def _send(self, data: bytes) -> None:
        client = self.store.client
        if self.upload_id is None:
            self.upload_id = client.create_multipart_upload(Bucket=self.store.bucket, Key=self.key)["UploadId"]
        while len(self.pending) >= self.in_flight:  # bounded buffers: wait for the oldest part
            self.pending.pop(0).result()
        self.numbers += 1
        number = self.numbers

        def upload() -> None:
            answer = client.upload_part(Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id,
                                        PartNumber=number, Body=data)
            with self.lock:
                self.parts[number] = answer["ETag"]

        self.pending.append(shared_pool("nvckpt-s3-put", self.in_flight).submit(upload))

    def write(self, data: Any) -> None:
        self.buffer += data
        while len(self.buffer) >= self.part_size:
            part = bytes(self.buffer[: self.part_size])
            del self.buffer[: self.part_size]
            self._send(part)

    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        client = self.store.client
        if self.upload_id is None:
            client.put_object(Bucket=self.store.bucket, Key=self.key, Body=bytes(self.buffer))
        else:
            if self.buffer:
                self._send(bytes(self.buffer))
            for f in self.pending:
                f.result()
            self.pending = []
            parts = [{"PartNumber": n, "ETag": self.parts[n]} for n in sorted(self.parts)]
            client.complete_multipart_upload(Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id,
                                             MultipartUpload={"Parts": parts})
        self.buffer = bytearray()
        self._closed = True

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        for f in self.pending:  # the parts in flight end before the upload is aborted
            f.exception()
        self.pending = []
        self._closed = True
        if self.upload_id is not None:
            self.store.client.abort_multipart_upload(Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id)


def open_writer(store: BotoStore, key: str, buffer_size: int, max_concurrency: int) -> _Writer:
    return _Writer(store, key, buffer_size, max_concurrency)


__all__ = ["BotoStore", "get", "head", "put", "list", "delete", "open_writer"]
