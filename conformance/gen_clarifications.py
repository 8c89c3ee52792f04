#!/usr/bin/env python3
"""The conformance cases of SPEC.md 1.1, second edition (section 19.1): the clarifications of a review
of nvckpt and the independent reader, each a file that a reader had accepted, or rejected with another
error, before the clarification.

Built from committed files of the suite (``files/valid-base.nvckpt`` and a few others) with craft.py,
using the helpers of ``tools/gen_conformance.py`` (pinned writer map, expected decode documents from
the Python objects).  Adds its cases to ``manifest.json`` (replacing any of the same id) and rewrites
the case tables of README.md; run it after ``tools/gen_conformance.py``, which does not know them:

    python3 conformance/gen_clarifications.py [--out conformance]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import os
import struct
import sys
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import msgpack  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402
import zstandard  # noqa: E402

from conformance import craft  # noqa: E402


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("gen_conformance", os.path.join(ROOT, "tools", "gen_conformance.py"))
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


gen = _generator()
BOTH, STREAMING, RANDOM_ACCESS = gen.BOTH, gen.STREAMING, ["random-access"]
EXT6 = msgpack.ExtType(6, (2**64).to_bytes(9, "little", signed=True))  # 2^64: the shortest ext 6 there is


def _raw_data(nv: craft.NvFile, tid: int) -> bytes:
    """A tensor's raw bytes, from its raw-coded CHUNK payloads (the files below use the raw codec only)."""
    n = len(nv.index["tensors"][tid]["chunks"])
    return b"".join(nv.chunk_frame(tid, i).payload for i in range(n))


def gen_clarifications(s: Any, committed: dict[str, dict], files: str) -> None:
    def read(cid: str) -> bytes:
        with open(os.path.join(files, f"{cid}.nvckpt"), "rb") as f:
            return f.read()

    base, typed = read("valid-base"), read("valid-typed-tree")
    one_chunk = gen.save({"w": torch.arange(4, dtype=torch.float32)}, codec="raw")  # one tensor of one chunk
    assert len(craft.parse(one_chunk).index["tensors"][0]["chunks"]) == 1

    def edit(fn: Callable[[craft.NvFile], Any], src: bytes = base, sync: bool = True, **build_kw: Any) -> bytes:
        nv = craft.parse(src)
        fn(nv)
        if sync:
            craft.sync_tensor_frames(nv)
        return craft.build(nv, **build_kw)

    def entry(name: str, fn: Callable[[dict], Any], src: bytes = base) -> bytes:
        return edit(lambda nv: fn(nv.index["tensors"][nv.tensor_id(name)]), src)

    inv = s.invalid

    # -- section 3 (and 5): a file shorter than the preamble -----------------------------------------
    inv("short-not-magic", b"PK\x03\x04\x14\x00\x00\x00\x08\x00 not nvckpt", "format", section="3",
        flags=["magic", "truncated"], description="a 21-byte file that is not the start of an nvckpt file (a zip "
                                                  "header): FormatError, not TruncatedError",
        danger="a reader that calls every short file truncated sends users to recovery tools for a file of another "
               "format")
    inv("short-magic-differs", b"\x89NVCKX", "format", section="3", flags=["magic", "truncated"],
        description="a 6-byte file whose fifth byte differs from the magic's", danger="as above")

    # -- section 5: the footer's checks in order, and the frame it points at -------------------------
    def footer_past_index(nv: craft.NvFile) -> None:
        nv.footer.index_length += 1  # check 6 fails (the index would run into the footer) ...
        idx = nv.index_frame()
        right = int.from_bytes(idx.header()[20:24], "little")
        idx.header_checksum = right ^ 0xFF  # ... and check 7's header checksum too

    inv("footer-index-into-footer-bad-header", edit(footer_past_index, sync=False, fix_footer=False), "format",
        section="5", flags=["footer", "check-order"], readers=RANDOM_ACCESS,
        description="index_offset + 48 + index_length runs one byte into the footer (check 6) and the INDEX header "
                    "checksum is wrong (check 7): check 6 comes first, FormatError, before any header byte is read",
        danger="a reader that reads the header before it bounds the index by the footer trusts offsets it has not "
               "checked")
    for ftype in (5, 127, 200):
        inv(f"index-frame-type-{ftype}", edit(lambda nv, t=ftype: setattr(nv.index_frame(), "frame_type", t),
                                              sync=False, fix_index=False),
            "format", section="5", flags=["frame", "frame-type"], readers=RANDOM_ACCESS,
            description=f"the frame the footer points at has type {ftype}: FormatError (section 5 check 7), not "
                        "the UnsupportedFeatureError of 4.2 for a frame met in a walk",
            danger="the footer must point at the INDEX frame; any other frame there means a damaged or spliced file")

    # -- section 1: values under ignored keys may hold any ext ------------------------------------------
    def unknown_exts(nv: craft.NvFile) -> None:
        nv.index["x-future"] = [msgpack.ExtType(9, b"abc"), msgpack.ExtType(1, b"\x00"), msgpack.ExtType(2, b"\x01"),
                                msgpack.ExtType(0, b"")]
        nv.index["tensors"][0]["x-future"] = msgpack.ExtType(9, b"")  # and in its TENSOR frame (synced)
        nv.index["writer"]["build"] = msgpack.ExtType(9, b"\x01")

    s.valid("valid-unknown-keys-any-ext", edit(unknown_exts), _expected(committed["valid-base"]),
            section="1", flags=["unknown-keys", "ext"],
            description="ext values a reader must ignore: ext 9, ext 0, an ext 1 of 1 byte and an ext 2 that holds no "
                        "array under an unknown index key, ext 9 under an unknown key of a tensor entry (and its "
                        "TENSOR frame) and as a writer map value")

    # -- sections 8.6, 9.2, 11.2: an ext 6 integer is no int outside tree values ------------------------
    inv("typed-bigint-as-map-key", edit(lambda nv: nv.index["tree"].__setitem__("k", {EXT6: 1}), typed), "format",
        section="9.2", flags=["tree", "typed", "bigint"],
        description="a tree map whose key is an ext 6 integer (2^64), in a file with required_features bit 1",
        danger="typed extensions are never keys; a reader that decodes ext 6 to a plain integer first accepts it")
    inv("metadata-bigint-ext", edit(lambda nv: nv.index.__setitem__("metadata", {"x": EXT6}), typed), "format",
        section="8.6", flags=["metadata", "typed", "bigint"],
        description="an ext 6 integer (2^64) in the metadata, in a file with required_features bit 1",
        danger="metadata is JSON-like; an ext decoded to an integer slips past a type check on integers")

    def zstd_level_bigint(nv: craft.NvFile) -> None:
        pipeline = [{"name": "zstd", "configuration": {"level": EXT6}}]
        nv.index["codecs"] = [pipeline]
        next(f for f in nv.frames if f.frame_type == craft.CODEC).payload = craft.pack(pipeline)
        chunk = nv.chunk_frame(0, 0)
        chunk.raw_length = len(chunk.payload)
        chunk.payload = zstandard.ZstdCompressor(level=3).compress(chunk.payload)

    inv("codec-zstd-level-bigint", edit(zstd_level_bigint, typed), "format", section="11.2",
        flags=["codec", "typed", "bigint"], codec="zstd",
        description="a zstd step whose 'level' is an ext 6 integer (2^64), not a msgpack int",
        danger="as above, in the codec table")

    # -- section 8.3-8.5 ----------------------------------------------------------------------------------
    inv("tensor-checksum-nil", entry("w", lambda e: e.__setitem__("checksum", None)), "format", section="8.3",
        flags=["types"], description="a tensor entry with \"checksum\": nil (an int when present)",
        danger="nil taken for an absent checksum skips a check the entry claims to have")

    def frame_checksum_nil(nv: craft.NvFile) -> None:
        frame = nv.tensor_frame(nv.tensor_id("v/1"))
        described = craft.unpack(frame.payload)
        described["checksum"] = None  # the index entry has no "checksum"
        frame.payload = craft.pack(described)

    inv("tensor-frame-checksum-nil", edit(frame_checksum_nil, sync=False), "format", section="8.3",
        flags=["types", "tensor-frame"], readers=STREAMING,
        description="a view's TENSOR frame says \"checksum\": nil, its index entry has no \"checksum\"",
        danger="present with nil and absent are not the same map: the TENSOR frame does not describe the entry")

    def tensor_frame_nchunks(value: Any) -> Callable[[craft.NvFile], None]:
        def fn(nv: craft.NvFile) -> None:
            frame = nv.tensor_frame(0)
            described = craft.unpack(frame.payload)
            described["nchunks"] = value
            frame.payload = craft.pack(described)
        return fn

    for label, value in (("bool", True), ("float", 1.0)):
        inv(f"tensor-frame-nchunks-{label}", edit(tensor_frame_nchunks(value), one_chunk, sync=False), "format",
            section="8.3", flags=["types", "tensor-frame"], readers=STREAMING,
            description=f"a one-chunk tensor's TENSOR frame says \"nchunks\": {json.dumps(value)} (an int is listed)",
            danger="true == 1 == 1.0 in several languages: a reader that compares values without types accepts it")

    def empty_table(nv: craft.NvFile) -> None:
        tid = nv.tensor_id("i")
        nv.index["tensors"][tid]["chunks"] = []
        nv.frames = [f for f in nv.frames if not (f.frame_type == craft.CHUNK and f.tensor_id == tid)]

    inv("chunks-empty-table-nonempty-shape", edit(empty_table), "format", section="8.4",
        flags=["chunk-table", "lengths"],
        description="an int64 tensor of shape [5] whose chunk table is empty (its TENSOR frame says 0 chunks, no "
                    "CHUNK frame holds it): the raw lengths add up to 0 bytes, not 40",
        danger="a reader that allocates nbytes and fills it from no chunk returns uninitialized memory")

    def one_chunk_over_limit(nv: craft.NvFile) -> None:
        raw = (1 << 24) + 4
        pipeline = [{"name": "zstd", "configuration": {"level": 3}}]
        nv.index["codecs"] = [pipeline]
        next(f for f in nv.frames if f.frame_type == craft.CODEC).payload = craft.pack(pipeline)
        e = nv.index["tensors"][0]
        e["dtype"], e["shape"] = "uint8", [raw]
        e.pop("checksum", None)
        chunk = nv.chunk_frame(0, 0)
        chunk.raw_length = raw
        # A 1 MiB window (within MAX_ZSTD_WINDOW): only the raw_length limit tells a reader not to decode it.
        params = zstandard.ZstdCompressionParameters.from_level(3, window_log=20)
        chunk.payload = zstandard.ZstdCompressor(compression_params=params).compress(bytes(raw))

    inv("chunk-one-raw-length-over-limit", edit(one_chunk_over_limit, one_chunk), "limit", also=["format"],
        section="8.4", flags=["limit", "decompression-bomb"], codec="zstd",
        description="a tensor of ONE chunk whose raw_length is 2^24 + 4 (MAX_CHUNK_LENGTH is 2^24); shape matches",
        danger="a reader that checks the limit only on tables of several chunks decodes 16 MiB and more from a few "
               "hundred bytes")

    for label, what, fn in (("missing", "missing", lambda d: d.pop("function")),
                            ("int", "the int 7", lambda d: d.__setitem__("function", 7)),
                            ("bin", "the bin 'bf16_rne'", lambda d: d.__setitem__("function", b"bf16_rne"))):
        inv(f"derived-function-{label}", entry("b", lambda e, fn=fn: fn(e["derived"])), "format", section="8.5",
            flags=["derived", "types"],
            description=f"a derived entry whose \"function\" is {what} (a str is listed): FormatError at open, "
                        "not an unknown function reported when the tensor is read",
            danger="only a str can name a function a later version defines; anything else is a malformed entry")

    # -- section 13: the checksum of a view or derived tensor covers its own elements -----------------------
    nv0 = craft.parse(base)
    storage = _raw_data(nv0, nv0.tensor_id("v/0@base"))
    v1 = storage[2 * 4: 10 * 4]  # v/1: offset 2, shape [8], stride [1]
    from nvckpt.plan.derived import bf16_rne
    m = torch.frombuffer(bytearray(_raw_data(nv0, nv0.tensor_id("m"))), dtype=torch.float32)
    b = bf16_rne(m).view(torch.uint8).numpy().tobytes()
    for name, raw in (("v/1", v1), ("b", b)):  # the bytes must be those the suite expects
        assert hashlib.sha256(raw).hexdigest() == committed["valid-base"]["expected"]["tensors"][name]["sha256"], name
    h = xxhash.xxh3_64_intdigest

    def checksums(good: bool) -> Callable[[craft.NvFile], None]:
        def fn(nv: craft.NvFile) -> None:
            for name, raw in (("v/1", v1), ("b", b)):
                nv.index["tensors"][nv.tensor_id(name)]["checksum"] = h(raw) if good else h(raw) ^ 1
        return fn

    s.valid("valid-view-derived-checksums", edit(checksums(True)), _expected(committed["valid-base"]), section="13",
            flags=["checksum", "view", "derived"],
            description="a view and a derived tensor with a \"checksum\" of their own elements (C order, nbytes bytes)")
    for name, label in (("v/1", "view"), ("b", "derived")):
        def wrong(nv: craft.NvFile, name: str = name) -> None:
            nv.index["tensors"][nv.tensor_id(name)]["checksum"] = h(v1 if name == "v/1" else b) ^ 1

        inv(f"checksum-{label}-tensor", edit(wrong), "checksum", level="should", section="13",
            flags=["checksum", label],
            description=f"the {label} tensor '{name}' has a \"checksum\" that its elements do not match (its "
                        f"{'base' if label == 'view' else 'source'} is intact)",
            danger="a reader that verifies stored tensors only returns a view or derived tensor the writer never saw")

    # -- sections 1 and 9: exactly one msgpack object, no trailing bytes --------------------------------------
    def index_tail(nv: craft.NvFile) -> None:
        nv.index_frame().payload += b"\xa1"

    inv("index-trailing-incomplete-object", edit(index_tail, sync=False, fix_index=False), "format", section="1",
        flags=["msgpack", "trailing-bytes"],
        description="the INDEX payload is followed by the byte a1 (a str header whose byte is missing)",
        danger="a parser that takes 'not enough data for a second object' for 'no second object' accepts trailing bytes")
    inv("tree-tuple-trailing-incomplete-object",
        edit(lambda nv: nv.index["tree"].__setitem__("t", msgpack.ExtType(2, craft.pack([1, 2]) + b"\xa1")), sync=False),
        "format", section="9", flags=["tree", "msgpack", "trailing-bytes"],
        description="a tuple ext whose data is an array followed by the byte a1 (an incomplete object)",
        danger="as above, inside the tree: the tuple's data is not exactly one msgpack array")

    # -- a view of one element with stride 0 (valid) ---------------------------------------------------------
    flat = torch.arange(16, dtype=torch.float32)
    obj = {"a": flat[2:6], "c": flat[8:]}
    data = gen.save(obj, codec="raw")
    exp = gen.expected_decode(obj, None, data)
    nv = craft.parse(data)
    view = nv.index["tensors"][nv.tensor_id("a")]
    start = obj["a"].storage_offset() - view["view"]["offset"]  # the base's first element in flat
    view["shape"], view["view"] = [1], {"base": view["view"]["base"], "offset": 11, "stride": [0]}
    craft.sync_tensor_frames(nv)
    element = flat[start + 11: start + 12]  # flat.as_strided((1,), (0,), start + 11), as one plain element
    exp["tensors"]["a"] = gen.tensor_json("float32", [1], gen.raw_bytes(element))
    s.valid("valid-view-one-element-stride-0", craft.build(nv), exp, section="8.5", flags=["view", "stride-0"],
            description="a view of shape [1] and stride [0] (element 11 of its base): one element, whatever its stride")


def _expected(case: dict) -> dict:
    out = copy.deepcopy(case["expected"])
    out.pop("keys", None)  # Suite.valid derives them from the tree
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=HERE)
    args = ap.parse_args(argv)
    with open(os.path.join(args.out, "manifest.json")) as f:
        manifest = json.load(f)
    committed = {c["id"]: c for c in manifest["cases"]}
    s = gen.Suite(args.out, None)
    gen_clarifications(s, committed, os.path.join(args.out, "files"))
    new = {c["id"] for c in s.cases}
    manifest["cases"] = [c for c in manifest["cases"] if c["id"] not in new] + s.cases
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False, sort_keys=False)
        f.write("\n")
    readme = os.path.join(args.out, "README.md")
    if os.path.exists(readme):
        with open(readme) as f:
            text = f.read()
        for key, body in gen.readme_tables(manifest["cases"]).items():
            text = gen.replace_block(text, key, body)
        with open(readme, "w") as f:
            f.write(text)
    print(f"{len(s.cases)} cases added or replaced; the suite has {len(manifest['cases'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
