"""What real checkpoints hold beyond tensors and JSON (SPEC 9.2): torch.dtype, torch.device, complex, ints
beyond 64 bits, set and frozenset round-trip, with no pickle; a file that needs them says so in its preamble."""

from __future__ import annotations

import collections
import enum
import io
import math
import struct

import msgpack
import numpy as np
import pytest
import torch

import nvckpt
from nvckpt.format.constants import FEATURE_TYPED_TREE
from nvckpt.format.frames import FrameWriter
from nvckpt.format.tree import DeviceName, DtypeName, check_tree, pack_tree, unpack_tree


def roundtrip(obj, **kw):
    stream = io.BytesIO()
    nvckpt.save(obj, stream, **kw)
    stream.seek(0)
    return nvckpt.load(stream), stream.getvalue()


CONFIG = {
    "dtype": torch.bfloat16, "dtypes": [torch.float8_e4m3fn, torch.uint8, torch.complex64, torch.bool],
    "device": torch.device("cuda", 1), "cpu": torch.device("cpu"), "meta": torch.device("meta"),
    "z": complex(1.5, -2.0), "z_nan": complex(float("nan"), float("inf")),
    "big": 2**64, "huge": 3**500, "neg": -(2**63) - 1, "edge": 2**64 - 1,
    "tags": {"a", "b", 3, 2.5, None, (1, "x"), frozenset({1, 2})}, "empty": set(), "frozen": frozenset({torch.float16}),
}


def test_typed_values_round_trip_exactly():
    back, data = roundtrip({"w": torch.ones(3), "config": CONFIG})
    config = back["config"]
    for key, value in CONFIG.items():
        if key == "z_nan":
            assert math.isnan(config[key].real) and config[key].imag == float("inf")
            continue
        assert config[key] == value and type(config[key]) is type(value), key
    assert isinstance(config["dtype"], torch.dtype) and isinstance(config["device"], torch.device)
    # A file that holds them is version 1.1 with required feature bit 1 (SPEC 3, 9.2, 19.1).
    assert struct.unpack_from("<HHI", data, 8) == (1, 1, FEATURE_TYPED_TREE)


def test_files_without_typed_values_stay_version_1_0():
    _, data = roundtrip({"w": torch.ones(3), "step": 2**64 - 1, "hp": {"lr": 0.1}})
    assert struct.unpack_from("<HHI", data, 8) == (1, 0, 0)


def test_a_set_is_written_in_one_order_whatever_the_hashing():
    # Sets iterate in hash order; the file must not depend on it (reproducible files, byte-identical suite).
    a, b = {"x", "y", "zz", 1, 2.5}, set()
    for item in ["zz", 2.5, "y", 1, "x"]:
        b.add(item)
    assert pack_tree({"s": a}) == pack_tree({"s": b})


def test_optimizer_hyperparameters_with_a_dtype_and_device():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "amp": {"dtype": torch.float16, "device": torch.device("cpu")}}
    back, _ = roundtrip(state)
    opt2 = torch.optim.AdamW(torch.nn.Linear(4, 2).parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])
    assert back["amp"] == state["amp"]


def test_numpy_scalars_are_stored_as_python_numbers():
    obj = {"i": np.int64(-5), "u": np.uint64(2**64 - 1), "f": np.float64(0.1), "h": np.float32(0.5),
           "b": np.bool_(True), "c": np.complex64(1 + 2j), "keys": {np.int32(3): "three"}}
    back, _ = roundtrip(obj)
    assert back == {"i": -5, "u": 2**64 - 1, "f": 0.1, "h": 0.5, "b": True, "c": 1 + 2j, "keys": {3: "three"}}
    assert [type(back[k]) for k in "iufhbc"] == [int, int, float, float, bool, complex]


def test_a_set_refuses_what_it_cannot_hold():
    with pytest.raises(nvckpt.UnsupportedObjectError, match="set at s: a set cannot hold Tensor"):
        nvckpt.save({"s": {torch.ones(1)}}, io.BytesIO())
    with pytest.raises(nvckpt.UnsupportedObjectError, match="two items"):
        nvckpt.save({"s": {float("nan"), float("nan")}}, io.BytesIO())
    with pytest.raises(nvckpt.UnsupportedObjectError, match="dict key"):
        nvckpt.save({"d": {torch.float32: 1}}, io.BytesIO())  # keys stay str, int, float, bool, None


def bad(code: int, data: bytes) -> bytes:
    return msgpack.packb({"k": msgpack.ExtType(code, data)})


@pytest.mark.parametrize("payload,message", [
    (bad(3, b"Float32"), "not a valid name"), (bad(3, b""), "not a valid name"), (bad(3, b"a" * 65), "not a valid name"),
    (bad(4, b"cuda:01"), "not a valid name"), (bad(4, b"cuda:"), "not a valid name"),
    (bad(5, bytes(15)), "16"),
    (bad(6, (5).to_bytes(1, "little")), "shortest"),  # inside the msgpack range
    (bad(6, (2**64).to_bytes(10, "little", signed=True)), "shortest"),  # one byte too many
    (bad(6, bytes(1025)), "limit"),
    (bad(7, msgpack.packb([1, 1.0])), "twice"), (bad(7, msgpack.packb([0.0, -0.0])), "twice"),
    (bad(7, msgpack.packb([1, True])), "twice"), (bad(7, msgpack.packb([[1]])), "cannot hold list"),
    (bad(8, msgpack.packb({"a": 1})), "not an array"),
    (bad(7, msgpack.packb([msgpack.ExtType(1, bytes(4))])), "cannot hold a tensor"),
    (bad(7, msgpack.packb([msgpack.ExtType(7, msgpack.packb([]))])), "cannot hold set"),
])
def test_reader_rejects_malformed_typed_extensions(payload, message):
    with pytest.raises(nvckpt.NvckptError, match=message):
        check_tree(unpack_tree(payload), 1)


def test_typed_extension_without_the_feature_bit_is_rejected():
    tree = unpack_tree(pack_tree({"d": DtypeName("float32"), "v": DeviceName("cpu")}))
    check_tree(tree, 0, FEATURE_TYPED_TREE)
    with pytest.raises(nvckpt.FormatError, match="required_features bit 1"):
        check_tree(tree, 0, 0)


@pytest.mark.parametrize("value,what", [(DtypeName("float99"), "torch.float99"), (DeviceName("warp:3"), "warp:3")])
def test_a_dtype_or_device_this_torch_lacks_is_unsupported_on_load(value, what):
    stream = io.BytesIO()
    FrameWriter(stream, [], [], required_features=FEATURE_TYPED_TREE).finish({"v": value, "n": 1}, {}, {})
    stream.seek(0)
    with nvckpt.open(stream) as ck:
        assert ck.load("n") == 1  # the rest of the file reads
        with pytest.raises(nvckpt.UnsupportedFeatureError, match=what):
            ck.load()


# -- what loads back differently, each decided and documented (README "What can be saved") ---------------

def test_documented_conversions():
    Point = collections.namedtuple("Point", "x y")
    bn = torch.nn.BatchNorm2d(3)
    cl = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    sd = bn.state_dict()
    obj = {"p": Point(1, 2), "param": torch.nn.Parameter(torch.ones(2)), "cl": cl, "bn": sd,
           "od": collections.OrderedDict(a=1), "size": torch.Size([2, 3])}
    back, _ = roundtrip(obj)
    assert type(back["p"]) is tuple and back["p"] == (1, 2)                      # namedtuple -> tuple
    assert type(back["param"]) is torch.Tensor and not back["param"].requires_grad  # Parameter -> Tensor
    assert torch.equal(back["cl"], cl) and back["cl"].is_contiguous()          # channels_last -> contiguous
    assert not hasattr(back["bn"], "_metadata") and hasattr(sd, "_metadata")   # state_dict's _metadata dropped
    assert type(back["od"]) is dict and back["size"] == (2, 3) and type(back["size"]) is tuple
    # ... and a module still loads the state_dict (strict), BatchNorm's num_batches_tracked included.
    bn2 = torch.nn.BatchNorm2d(3)
    bn2.load_state_dict(back["bn"])
    assert all(torch.equal(a, b) for a, b in zip(bn2.state_dict().values(), sd.values()))


class _Precision(str, enum.Enum):  # as Lightning's precision names: a str that is also an enum member
    BF16 = "bf16-mixed"


class _Level(enum.IntEnum):
    HIGH = 3


def test_enum_members_are_stored_as_the_str_or_int_they_are():
    # str() of a (str, Enum) member is "Cls.MEMBER" on Python 3.11+: saved as that, it changed the value.
    state = {"hparams": {"precision": _Precision.BF16, "level": _Level.HIGH},
             _Precision.BF16: torch.ones(1), "names": {_Precision.BF16}}
    buf = io.BytesIO()
    nvckpt.save(state, buf)
    buf.seek(0)
    got = nvckpt.load(buf)
    assert got["hparams"] == {"precision": "bf16-mixed", "level": 3}
    assert type(got["hparams"]["precision"]) is str and type(got["hparams"]["level"]) is int
    assert set(got) == {"hparams", "bf16-mixed", "names"} and got["names"] == {"bf16-mixed"}
