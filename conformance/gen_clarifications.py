#!/usr/bin/env python3
"""The conformance cases of SPEC.md 1.1, second and third editions (section 19.1): the clarifications of a
review of nvckpt and the independent reader, and of a second implementation that passed the whole suite,
each a file that a reader had accepted, or rejected with another error, before the clarification; and a
case for each reader MUST that had none.

Built from committed files of the suite (``files/valid-base.nvckpt`` and a few others) with craft.py,
using the helpers of ``tools/gen_conformance.py`` (pinned writer map, expected decode documents from
the Python objects).  Adds its cases to ``manifest.json`` (replacing any of the same id) and rewrites
the case tables of README.md; ``tools/gen_conformance.py`` runs it last (it needs the files made before):

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


def committed_file(files: str, cid: str) -> bytes:
    with open(os.path.join(files, f"{cid}.nvckpt"), "rb") as f:
        return f.read()


def edited(fn: Callable[[craft.NvFile], Any], src: bytes, sync: bool = True, **build_kw: Any) -> bytes:
    """``src`` changed by ``fn``, its TENSOR frames rewritten from the index (``sync``), rebuilt by craft."""
    nv = craft.parse(src)
    fn(nv)
    if sync:
        craft.sync_tensor_frames(nv)
    return craft.build(nv, **build_kw)


def gen_clarifications(s: Any, committed: dict[str, dict], files: str) -> None:
    base, typed = (committed_file(files, cid) for cid in ("valid-base", "valid-typed-tree"))
    one_chunk = gen.save({"w": torch.arange(4, dtype=torch.float32)}, codec="raw")  # one tensor of one chunk
    assert len(craft.parse(one_chunk).index["tensors"][0]["chunks"]) == 1

    def edit(fn: Callable[[craft.NvFile], Any], src: bytes = base, sync: bool = True, **build_kw: Any) -> bytes:
        return edited(fn, src, sync, **build_kw)

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


# --------------------------------------------------------------------------------------------
# SPEC.md 1.1, third edition (19.1): map keys of every kind, the payload depth bound, tied tensors,
# device indices kept exactly, and a case for each reader MUST that had none
# --------------------------------------------------------------------------------------------

SENTINEL = "\x00raw msgpack goes here\x00"


def splice(data: bytes, raw: bytes) -> bytes:
    """``data`` with every packed SENTINEL (in TENSOR, CODEC and INDEX payloads) replaced by the msgpack bytes
    ``raw``, which Python's dict cannot build (two equal keys, array keys), offsets and checksums fixed up."""
    marker = craft.pack(SENTINEL)
    nv = craft.parse(data)
    for f in nv.frames:
        if f.frame_type != craft.INDEX:
            f.payload = f.payload.replace(marker, raw)
    nv = craft.parse(craft.build(nv))  # chunk offsets follow the frames that grew; the index still has the marker
    nv.index_frame().payload = nv.index_frame().payload.replace(marker, raw)
    assert marker not in nv.index_frame().payload or not raw
    return craft.build(nv, fix_index=False)  # the INDEX frame is last: no chunk moves


def gen_third_edition(s: Any, committed: dict[str, dict], files: str) -> None:
    base, typed = (committed_file(files, cid) for cid in ("valid-base", "valid-typed-tree"))
    exp_base = _expected(committed["valid-base"])
    inv = s.invalid
    one = gen.save({"w": torch.arange(4, dtype=torch.float32)}, codec="raw")  # one tensor, one raw chunk
    exp_one = gen.expected_decode({"w": torch.arange(4, dtype=torch.float32)}, None, one)

    def edit(fn: Callable[[craft.NvFile], Any], src: bytes = base, sync: bool = True, **build_kw: Any) -> bytes:
        return edited(fn, src, sync, **build_kw)

    def with_future(raw: bytes, src: bytes = base) -> bytes:
        """``src`` with an unknown index key "x-future" holding the msgpack bytes ``raw``."""
        return splice(edit(lambda nv: nv.index.__setitem__("x-future", SENTINEL), src), raw)

    m, p = gen._pack_map, craft.pack

    # -- section 1: "the same key" for bins, exts, arrays and maps (only in values a reader ignores) ------
    distinct = [(p([1, 2]), "the array [1, 2]"), (p([1]), "[1]"), (p([1.5]), "[1.5]"), (p(["1"]), "['1']"),
                (m([(p("a"), p(1))]), "the map {a: 1}"), (m([(p("a"), p(2))]), "{a: 2}"),
                (p(b"ab"), "the bin 61 62"), (p("ab"), "the str 'ab'"),
                (p(msgpack.ExtType(9, b"x")), "ext 9 'x'"), (p(msgpack.ExtType(10, b"x")), "ext 10 'x'"),
                (p(msgpack.ExtType(2, p([1]))), "ext 2 holding [1]"),
                (p(msgpack.ExtType(2, p([1.0]))), "ext 2 holding [1.0] (other data)"),
                (b"\xd6\xff" + struct.pack(">I", 1), "the timestamp 1 s"),
                (b"\xd6\xff" + struct.pack(">I", 2), "the timestamp 2 s"),
                (b"\xd4\xfe\x00", "ext -2 (any data)")]
    keys_map = m([(k, p(i)) for i, (k, _) in enumerate(distinct)])
    s.valid("valid-unknown-key-keys-of-every-kind", with_future(keys_map), exp_base, section="1",
            flags=["unknown-keys", "keys", "key-equality"],
            description="an unknown index key whose map has keys of every kind, all different by SPEC 1: "
                        + ", ".join(what for _, what in distinct))
    same = [("bin", p(b"ab"), p(b"ab"), "two bin keys 61 62"),
            ("ext", p(msgpack.ExtType(9, b"xy")), p(msgpack.ExtType(9, b"xy")), "two ext 9 keys with the data 'xy'"),
            ("array", p([1, "a"]), p([True, "a"]), "the array keys [1, 'a'] and [true, 'a'] (1 and true are the "
                                                     "same key, so the arrays are)"),
            ("map", m([(p("a"), p(1)), (p("b"), p(2))]), m([(p("b"), p(2)), (p("a"), p(1.0))]),
             "the map keys {a: 1, b: 2} and {b: 2, a: 1.0} (entries in any order)"),
            ("timestamp", b"\xd6\xff" + struct.pack(">I", 7), b"\xd7\xff" + struct.pack(">Q", 7),
             "the timestamps 7 s in the 32-bit and the 64-bit form (the same instant)")]
    for label, k1, k2, what in same:
        inv(f"unknown-key-duplicate-{label}-keys", with_future(m([(k1, p(1)), (k2, p(2))])), "format", section="1",
            flags=["unknown-keys", "keys", "key-equality", "duplicate-key"],
            description=f"an unknown index key whose map holds {what}: the same key by SPEC 1",
            danger="a reader whose map type merges the two keys drops an entry, one that keeps both does not: "
                   "readers disagree on a value they are told to ignore")
    inv("unknown-key-timestamp-nanoseconds", with_future(b"\xd7\xff" + struct.pack(">Q", 10**9 << 34)), "format",
        section="1", flags=["unknown-keys", "msgpack", "timestamp"],
        description="an unknown index key holding a 64-bit msgpack timestamp whose nanoseconds are 10^9 (at most "
                    "999999999)", danger="not valid msgpack: decoders that build a time value from it fail or wrap")

    # Non-str keys in the ignored values of a tensor entry (and its TENSOR frame) and of an unregistered codec.
    def future_everywhere(nv: craft.NvFile) -> None:
        nv.index["tensors"][0]["x-future"] = SENTINEL
        gen.add_unregistered_codec(nv, {"x": SENTINEL})
        nv.index["writer"]["x-future"] = SENTINEL
    s.valid("valid-non-str-keys-in-ignored-values", splice(edit(future_everywhere), keys_map), exp_base, section="1",
            flags=["unknown-keys", "keys", "unknown-codec"],
            description="the map of valid-unknown-key-keys-of-every-kind (array, map, bin, ext and timestamp keys) "
                        "under an unknown key of a tensor entry and of its TENSOR frame, of the writer map, and in an "
                        "unregistered codec's configuration (and its CODEC frame)")

    # -- section 9: MAX_PAYLOAD_DEPTH (72) at every place an unknown key can be ------------------------
    def at(where: str, value: Any) -> bytes:
        def fn(nv: craft.NvFile) -> None:
            if where == "index":
                nv.index["x-future"] = value
            elif where == "writer":
                nv.index["writer"]["x-future"] = value
            elif where == "tensor-entry":
                nv.index["tensors"][0]["x-future"] = value
            elif where == "view":
                nv.index["tensors"][nv.tensor_id("v/0")]["view"]["x-future"] = value
            else:
                gen.add_unregistered_codec(nv, {"x": value})
        return edit(fn)

    places = (("index", 2, "an unknown index key"), ("writer", 3, "an unknown key of the writer map"),
              ("tensor-entry", 4, "an unknown key of a tensor entry (and its TENSOR frame)"),
              ("view", 5, "an unknown key of a view map (and its TENSOR frame)"),
              ("codec-configuration", 6, "an unregistered codec's configuration (and its CODEC frame)"))
    for where, level, what in places:
        s.valid(f"valid-depth-72-{where}", at(where, gen.nest(73 - level, 0)), exp_base, section="9",
                flags=["depth", "unknown-keys"],
                description=f"{what} holds arrays nested so that the deepest is at level 72 of the index, "
                            "MAX_PAYLOAD_DEPTH: valid")
        inv(f"depth-73-{where}", at(where, gen.nest(74 - level, 0)), "limit", also=["format"], section="9",
            flags=["depth", "limit", "unknown-keys"],
            description=f"{what} holds arrays nested one level deeper: level 73 of the index, past MAX_PAYLOAD_DEPTH",
            danger="readers with different parser limits disagree on whether the file is valid; a recursive "
                   "parser without a bound runs out of stack on a deeper one")
    inv("depth-73-map-key", with_future(m([(p(gen.nest(71, 0)), p(1))])), "limit", also=["format"], section="9",
        flags=["depth", "limit", "unknown-keys", "keys"],
        description="an unknown index key holds a map whose key is arrays nested to level 73 of the index: keys nest "
                    "too", danger="as above, where a depth count that walks only values looks")

    # -- section 14.1: the same tensor, two objects (a tied state_dict) -----------------------------------
    torch.manual_seed(5)
    emb = torch.nn.Embedding(8, 4)
    head = torch.nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    state = {**{f"emb.{k}": v for k, v in emb.state_dict().items()},
             **{f"head.{k}": v for k, v in head.state_dict().items()}}
    assert state["emb.weight"] is not state["head.weight"]  # two objects aliasing one parameter
    tied = gen.save(state, codec="raw")
    w = gen.tensor_json("float32", [8, 4], gen.raw_bytes(state["emb.weight"]))
    exp_tied = {"tensors": {"emb.weight": w},
                "tree": {"$map": [["emb.weight", {"$tensor": "emb.weight"}], ["head.weight", {"$tensor": "emb.weight"}]]},
                "metadata": {"$map": []}}
    assert len(craft.parse(tied).index["tensors"]) == 1
    s.valid("valid-tied-state-dict", tied, exp_tied, section="14.1", flags=["tied", "self-reference"],
            description="the state_dict() of tied weights: two tensor objects that alias one parameter the same way, "
                        "stored as one entry with two tree references (what a writer SHOULD do)")

    def as_views(nv: craft.NvFile) -> None:
        entry = nv.index["tensors"][0]
        entry.update(name="emb.weight@base", shape=[32], internal=True)
        for tid, name in ((1, "emb.weight"), (2, "head.weight")):
            nv.index["tensors"].append({"name": name, "dtype": "float32", "shape": [8, 4],
                                        "view": {"base": 0, "offset": 0, "stride": [4, 1]}})
            nv.frames.insert(len(nv.frames) - 1, craft.Frame(craft.TENSOR, b"", tensor_id=tid))
        nv.index["tree"] = {"emb.weight": msgpack.ExtType(1, struct.pack("<I", 1)),
                            "head.weight": msgpack.ExtType(1, struct.pack("<I", 2))}
    exp_views = {"tensors": {"emb.weight@base": dict(w, shape=[32], internal=True), "emb.weight": w, "head.weight": w},
                 "tree": {"$map": [["emb.weight", {"$tensor": "emb.weight"}],
                                   ["head.weight", {"$tensor": "head.weight"}]]},
                 "metadata": {"$map": []}}
    s.valid("valid-tied-as-views", edit(as_views, tied), exp_views, section="14.1", flags=["tied", "view"],
            description="the same tied state stored as two views of one internal base (what a writer MAY do): "
                        "as valid as one entry with two references")

    # -- section 14.1: names of paths that are no entry's name; 14.3: writer rules readers do not enforce ----
    t = torch.arange(3, dtype=torch.int16)
    long_key = "k" * 5000
    obj = {"a": t, long_key: t}
    data = gen.save(obj, codec="raw")
    s.valid("valid-long-alias-path", data, gen.expected_decode(obj, None, data), section="14.1",
            flags=["tied", "names", "limit"],
            description="a second path to a tied tensor whose name is 5000 bytes: MAX_NAME_BYTES bounds entry names, "
                        "not the names of other paths")
    obj = {"a": t, "b": torch.ones(2, dtype=torch.int16)}
    data = gen.save(obj, codec="raw")
    exp_unref = gen.expected_decode(obj, None, data)
    exp_unref["tree"] = {"$map": [["a", {"$tensor": "a"}]]}

    def unreference(nv: craft.NvFile) -> None:
        del nv.index["tree"]["b"]
    s.valid("valid-unreferenced-entry", edit(unreference, data), exp_unref, section="14.3", flags=["names"],
            description="an entry 'b' that the tree does not reference: a writer rule, not a reader's; 'b' is "
                        "listed and read, and is no key")

    # -- section 9.2: a device index is kept exactly; set rules that had no case ---------------------------
    devices = ["cuda:127", "cuda:128", "cuda:255", "cuda:999999999"]

    def big_devices(nv: craft.NvFile) -> None:
        nv.index["tree"]["devices"] = [msgpack.ExtType(4, d.encode()) for d in devices]
    typed_obj = {"w": torch.arange(2, dtype=torch.float32), "devices": torch.device("cuda:1")}
    typed_file = gen.save(typed_obj, codec="raw")
    exp_dev = gen.expected_decode(typed_obj, None, typed_file)
    exp_dev["tree"]["$map"][1][1] = [{"$device": d} for d in devices]
    s.valid("valid-typed-device-indices", edit(big_devices, typed_file), exp_dev, section="9.2",
            flags=["tree", "typed", "device"],
            description="device exts cuda:127, cuda:128, cuda:255 and cuda:999999999: kept exactly as stored (torch "
                        "holds device indices in 8 bits: a Python reader that cannot return one refuses it when it "
                        "loads, and never returns another device)")

    def typed_value(value: bytes) -> bytes:
        nv = craft.parse(typed_file)
        nv.index["tree"]["devices"] = SENTINEL
        return splice(craft.build(nv), value)

    ext = lambda code, data: p(msgpack.ExtType(code, data))  # noqa: E731
    for cid, value, what, danger in (
            ("typed-device-65-bytes", ext(4, b"d" * 65), "a device ext of 65 bytes", "names are at most 64 bytes"),
            ("typed-set-trailing-bytes", ext(7, p([1, 2]) + b"\xc0"), "a set ext whose data is an array and a nil",
             "the set's data is not exactly one msgpack array"),
            ("typed-frozenset-holds-set", ext(8, b"\x91" + ext(7, p([1]))), "a frozenset holding a set",
             "a set is not hashable: a Python reader cannot build the frozenset")):
        inv(cid, typed_value(value), "format", section="9.2", flags=["tree", "typed"], description=what, danger=danger)
    inv("str-above-u10ffff", typed_value(b"\xa4\xf4\x90\x80\x80"), "format", section="1", flags=["utf-8", "tree"],
        description="a tree str holding f4 90 80 80 (U+110000, above the last code point)",
        danger="lenient decoders turn it into a replacement character or a code point other languages cannot hold")

    # -- section 11: pipelines and chunks with no case ------------------------------------------------
    def pipeline(steps: list, chunk: bytes | None = None) -> Callable[[craft.NvFile], None]:
        def fn(nv: craft.NvFile) -> None:
            nv.index["codecs"] = [steps]
            next(f for f in nv.frames if f.frame_type == craft.CODEC).payload = p(steps)
            if chunk is not None:
                nv.chunk_frame(0, 0).raw_length = 16
                nv.chunk_frame(0, 0).payload = chunk
        return fn

    for cid, steps, what in (
            ("codec-filter-without-coder", [{"name": "byteshuffle", "configuration": {"elementsize": 4}}],
             "pipeline [byteshuffle(4)]: no coder"),
            ("codec-two-coders", [{"name": "zstd", "configuration": {"level": 3}}, {"name": "raw", "configuration": {}}],
             "pipeline [zstd, raw]: two coders")):
        inv(cid, edit(pipeline(steps), one, sync=False), "format", section="11.1", flags=["codec"], description=what,
            danger="a pipeline that is not filters then one coder has no defined decoding")
    for label, version in (("empty", ""), ("int", 6), ("v-prefix", "v6.0.0")):
        ans = [{"name": "nvcomp-ans", "configuration": {"data_type": "<f4", "nvcomp_version": version,
                                                        "bitstream": "raw"}}]
        inv(f"codec-nvcomp-ans-version-{label}", edit(pipeline(ans), one, sync=False), "format", section="11.6",
            flags=["codec", "nvcomp-ans"],
            description=f"an nvcomp-ans codec whose nvcomp_version is {json.dumps(version)} (MAJOR.MINOR.PATCH)",
            danger="a version no reader can compare decides which nvCOMP may decode the chunk")
    zstd3 = [{"name": "zstd", "configuration": {"level": 3}}]
    inv("zstd-skippable-frames-only", edit(pipeline(zstd3, struct.pack("<II", 0x184D2A50, 4) + b"skip"), one,
                                           sync=False),
        "format", section="11.4", flags=["codec-zstd"], codec="zstd",
        description="a zstd chunk that is one skippable frame and no other (a chunk holds at least one frame that "
                    "is not skippable)", danger="a decoder that returns no bytes for it leaves the tensor uninitialized")
    single = gen._zstd_with_content_size(bytes(range(16)), (1 << 24) + 1)
    assert zstandard.get_frame_parameters(single).content_size == (1 << 24) + 1
    inv("zstd-single-segment-window-over-2p24", edit(pipeline(zstd3, single), one, sync=False), "format",
        section="11.4", flags=["codec-zstd", "window"], codec="zstd",
        description="a single-segment zstd frame whose Frame_Content_Size (its Window_Size) is 2^24 + 1: refused "
                    "before decoding, whatever it holds", danger="a streaming decoder allocates the window it is told")
    nv = craft.parse(one)
    chunk = nv.chunk_frame(0, 0).payload
    exp_unsupported = copy.deepcopy(exp_one)
    exp_unsupported["tensors"]["w"] = {k: v for k, v in exp_one["tensors"]["w"].items() if k not in ("nbytes", "sha256")}
    exp_unsupported["tensors"]["w"]["error"] = "unsupported-codec"
    s.valid("valid-unregistered-then-raw", edit(pipeline([{"name": "x-future"}, {"name": "raw"}], chunk[:8]), one,
                                                sync=False),
            exp_unsupported, section="11.3", flags=["unknown-codec"],
            description="pipeline [x-future, raw] on a chunk of 8 stored bytes for 16 raw bytes: the unregistered "
                        "step may be the coder, so the raw length rule does not apply; reading the tensor is "
                        "UnsupportedCodecError")

    def chunk_entry(n: int) -> Callable[[craft.NvFile], None]:
        def fn(nv: craft.NvFile) -> None:
            c = nv.index["tensors"][0]["chunks"][0]
            nv.index["tensors"][0]["chunks"][0] = (c + [0])[:n]
            nv.index_frame().payload = p(nv.index)
        return fn
    for n in (4, 6):
        inv(f"chunk-entry-{n}-elements", edit(chunk_entry(n), one, sync=False, fix_index=False), "format",
            section="8.4", flags=["chunk-table"], description=f"a chunk entry of {n} elements (exactly 5)",
            danger="a reader that reads positions 0-4 of any array takes a malformed entry for a chunk")

    # -- sections 8.1, 8.2, 8.3, 8.5: types and keys with no case --------------------------------------------
    for cid, fn, what, danger in (
            ("index-codecs-not-array", lambda nv: nv.index.__setitem__("codecs", {"0": nv.index["codecs"][0]}),
             "index 'codecs' is a map", "a codec table that is not an array has no codec ids"),
            ("writer-int-key", lambda nv: nv.index["writer"].__setitem__(7, "x"),
             "the writer map has a key 7 (an int) besides its str keys", "every map of section 8 has str keys"),
            ("view-missing-base", lambda nv: nv.index["tensors"][nv.tensor_id("v/0")]["view"].pop("base"),
             "a view map with no 'base'", "a view of nothing"),
            ("view-missing-offset", lambda nv: nv.index["tensors"][nv.tensor_id("v/0")]["view"].pop("offset"),
             "a view map with no 'offset'", "a reader that takes 0 reads other elements than the writer's"),
            ("derived-missing-source", lambda nv: nv.index["tensors"][nv.tensor_id("b")]["derived"].pop("source"),
             "a derived map with no 'source'", "a derived tensor of nothing"),
            ("entry-rank-65-bad-dimension", lambda nv: nv.index["tensors"][0].__setitem__("shape", ["x"] + [1] * 64),
             "a shape of 65 dimensions whose first is a str: the rank is checked before the dimensions (LimitError), "
             "and FormatError is allowed for a limit", "a reader that walks a long shape before counting it")):
        error, also = ("limit", ["format"]) if "rank" in cid else ("format", None)
        inv(cid, edit(fn), error, also=also, section="8", flags=["types"], description=what, danger=danger)

    # -- streaming readers: frame headers and TENSOR frames against entries --------------------------------
    for kind, sel in (("codec", lambda nv: next(f for f in nv.frames if f.frame_type == craft.CODEC)),
                      ("tensor", lambda nv: nv.tensor_frame(0)), ("chunk", lambda nv: nv.chunk_frame(0, 1))):
        inv(f"{kind}-frame-flags-nonzero", edit(lambda nv, sel=sel: setattr(sel(nv), "flags", 1), sync=False),
            "format", section="4.1", readers=STREAMING, flags=["frame", "reserved", "streaming"],
            description=f"a {kind.upper()} frame's reserved flags byte is 1", danger="fields that must be 0 are how "
                                                                                     "damage is noticed")

    def flags_and_type(nv: craft.NvFile) -> None:
        nv.frames.insert(2, craft.Frame(5, b"future", flags=1))
    inv("frame-flags-before-type", edit(flags_and_type, sync=False), "format", section="4.1", readers=STREAMING,
        flags=["frame", "reserved", "frame-type", "streaming"],
        description="a frame of type 5 whose flags byte is 1: flags are checked before the type (FormatError, not "
                    "UnsupportedFeatureError)", danger="readers that check in other orders report other errors")

    def extra_frame(kind: int) -> Callable[[craft.NvFile], None]:
        def fn(nv: craft.NvFile) -> None:
            f = copy.copy(next(f for f in nv.frames if f.frame_type == kind))
            if kind == craft.CODEC:
                f.codec_id = len(nv.index["codecs"])
            else:
                f.tensor_id = len(nv.index["tensors"])
            nv.frames.insert(len(nv.frames) - 1, f)
        return fn
    for label, kind in (("codec", craft.CODEC), ("tensor", craft.TENSOR)):
        inv(f"{label}-frame-id-not-in-index", edit(extra_frame(kind), sync=False), "format", section="4.3",
            readers=STREAMING, flags=["frame-order", "streaming"],
            description=f"a {label.upper()} frame for {label} id {'1' if kind == craft.CODEC else '7'}, which the "
                        "index does not have (rules 3 and 4: no frame with another id)",
            danger="a description no random-access reader sees: the two kinds of reader would disagree")

    def frame_key(name: str, key: str, value: Any) -> Callable[[craft.NvFile], None]:
        def fn(nv: craft.NvFile) -> None:
            frame = nv.tensor_frame(nv.tensor_id(name))
            described = craft.unpack(frame.payload)
            described[key] = value
            frame.payload = p(described)
        return fn
    nv0 = craft.parse(base)
    view0 = nv0.index["tensors"][nv0.tensor_id("v/0")]["view"]
    derived_b = nv0.index["tensors"][nv0.tensor_id("b")]["derived"]
    for cid, fn, what in (
            ("tensor-frame-view-differs", frame_key("v/0", "view", dict(view0, offset=view0["offset"] + 1)),
             "view 'v/0''s TENSOR frame says offset one more than its entry"),
            ("tensor-frame-derived-differs", frame_key("b", "derived", dict(derived_b, function="copy")),
             "derived 'b''s TENSOR frame says function copy, its entry bf16_rne"),
            ("tensor-frame-checksum-differs", frame_key("w", "checksum", nv0.index["tensors"][0]["checksum"] ^ 1),
             "'w''s TENSOR frame has another checksum than its entry"),
            ("tensor-frame-internal-differs", frame_key("v/0@base", "internal", False),
             "the storage base's TENSOR frame says internal: false, its entry true")):
        inv(cid, edit(fn, sync=False), "format", section="8.3", readers=STREAMING, flags=["tensor-frame", "streaming"],
            description=what, danger="a recovering reader (which trusts TENSOR frames) and a normal one would return "
                                     "different tensors")


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
    gen_third_edition(s, committed, os.path.join(args.out, "files"))
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
