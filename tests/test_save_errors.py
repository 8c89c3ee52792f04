"""What save refuses, and how: UnsupportedObjectError naming the path, ValueError for bad arguments."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import io
import pathlib
import warnings

import numpy as np
import pytest
import torch

import nvckpt


class Custom:
    pass


def quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # torch deprecates making them, but users still have them
        warnings.simplefilter("ignore")
        return torch.quantize_per_tensor(torch.randn(4), scale=0.1, zero_point=0, dtype=torch.qint8)


def nested(layout: torch.layout) -> torch.Tensor:
    with warnings.catch_warnings():  # the strided layout is a "prototype" to torch, and warns
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)


@pytest.mark.parametrize("obj,where,what", [
    ({"a": {"b": [0, {1, torch.ones(1)}]}}, "a/b/1", "set"),
    ({"opt": {"state": {0: {"fn": Custom()}}}}, "opt/state/0/fn", "Custom"),
    ({"m": {"w": torch.randn(4, 4).to_sparse()}}, "m/w", "sparse"),
    (lambda: {"m": [torch.ones(1), quantized()]}, "m/1", "quantized"),
    ({"x": {"big": {2**64: 1}}}, "x/big", "64 bits"),  # as values they are stored (SPEC 9.2), as keys not
    ({"x": [{-(2**63) - 1: 1}]}, "x/0", "64 bits"),
    ({"k": {("tuple", "key"): torch.ones(1)}}, "k", "tuple"),
    ({"fn": [len]}, "fn/0", "builtin"),
    ({"t": torch.ones(2, device="meta")}, "t", "meta"),
    ({"c": [{complex(1, 2): 1}]}, "c/0", "complex"),
    (lambda: {"n": [nested(torch.strided)]}, "n/0", "nested"),
    (lambda: {"n": [nested(torch.jagged)]}, "n/0", "nested"),
    ({"a": {"arr": np.array(["x"])}}, "a/arr", "arr.tolist()"),  # arrays of numbers are stored (SPEC 9.3)
    ({"s": {"set": {frozenset({object()})}}}, "s/set", "object"),
    ({"s": ["ok", "bad \ud800"]}, "s/1", "Unicode"),  # a lone surrogate cannot be UTF-8
    ({"d": {"\udfff": torch.ones(1)}}, "d", "Unicode"),
])
def test_unsupported_objects_name_their_path(obj, where, what):
    obj = obj() if callable(obj) and not isinstance(obj, dict) else obj
    with pytest.raises(nvckpt.UnsupportedObjectError) as info:
        nvckpt.save(obj, io.BytesIO())
    message = str(info.value)
    assert where in message and what in message, message
    assert isinstance(info.value, nvckpt.NvckptError) and isinstance(info.value, TypeError)


@dataclasses.dataclass
class Config:
    lr: float = 0.1


class Stateful:
    def state_dict(self) -> dict:
        return {"n": 1}


@pytest.mark.parametrize("value,fix", [
    (Config(), "dataclasses.asdict(obj)"),
    (Stateful(), "obj.state_dict()"),
    (torch.nn.Linear(1, 1), "obj.state_dict()"),
    (type("DataPath", (type(pathlib.Path()),), {})("/data/run"), "pathlib.Path(path)"),  # pathlib's own are stored
    (np.ma.masked_array([1, 2], mask=[0, 1]), "np.asarray(arr)"),
    (np.array([object()]), "arr.tolist()"),
    (np.array(["a"]), "arr.tolist()"),
    (np.zeros(2, dtype=np.longdouble), "arr.astype"),
    (argparse.Namespace(lr=0.1), "vars(ns)"),
    (datetime.date(2026, 1, 2), "isoformat()"),
    (enum.Enum("Color", "RED")["RED"], "member.value"),
    (len, "store its name"),
    (Custom(), "state_dict() / load_state_dict()"),
])
def test_what_cannot_be_stored_is_refused_naming_the_fix(value, fix):
    """The error names what to store instead (the fix in the user's code), before the list of storable types."""
    with pytest.raises(nvckpt.UnsupportedObjectError) as info:
        nvckpt.save({"hparams": {"x": value}}, io.BytesIO())
    message = str(info.value)
    assert "hparams/x" in message and fix in message and message.index(fix) < message.index("nvckpt stores"), message


def test_root_unsupported_names_root():
    with pytest.raises(nvckpt.UnsupportedObjectError, match="<root>"):
        nvckpt.save(Custom(), io.BytesIO())


def test_keys_that_collide_as_names():
    t = torch.ones(2)
    for obj in ({1: t, "1": torch.zeros(2)}, {True: t, "True": torch.zeros(2)}, {None: t, "None": torch.zeros(2)}):
        with pytest.raises(nvckpt.UnsupportedObjectError, match="named"):
            nvckpt.save(obj, io.BytesIO())
    # the same key types with scalars (no tensor names involved) are fine
    back_stream = io.BytesIO()
    nvckpt.save({1: "a", "1": "b"}, back_stream)
    back_stream.seek(0)
    assert nvckpt.load(back_stream) == {1: "a", "1": "b"}


def test_enum_and_numpy_like_subclasses_are_stored_as_base_types():
    class Color(enum.IntEnum):
        RED = 3

    stream = io.BytesIO()
    nvckpt.save({"c": Color.RED}, stream)
    stream.seek(0)
    back = nvckpt.load(stream)
    assert back == {"c": 3} and type(back["c"]) is int


def test_too_deep_nesting_is_a_limit():
    obj: object = torch.ones(1)
    for _ in range(80):
        obj = [obj]
    with pytest.raises(nvckpt.LimitError):
        nvckpt.save(obj, io.BytesIO())


@pytest.mark.parametrize("kwargs", [
    {"codec": "lz4"}, {"codec": ""}, {"codec": None}, {"codec": 3},
    {"chunk_size": 0}, {"chunk_size": -1}, {"chunk_size": (16 << 20) + 1}, {"chunk_size": 1.5}, {"chunk_size": "1M"},
    {"alignment": 0}, {"alignment": 3}, {"alignment": 100}, {"alignment": 1 << 21}, {"alignment": -4096}, {"alignment": 64.0},
    {"engine": "tpu"},
])
def test_bad_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        nvckpt.save({"w": torch.ones(3)}, io.BytesIO(), **kwargs)


@pytest.mark.parametrize("metadata", [["not", "a", "dict"], {1: "int key"}, {"x": object()}, {"x": {"y": {1, 2}}},
                                      {"x": b"bytes"}, {"x": (1, 2)}, {"x": "\ud800"}, {"\ud800": 1}])
def test_bad_metadata(metadata):
    with pytest.raises(nvckpt.UnsupportedObjectError):
        nvckpt.save({"w": torch.ones(3)}, io.BytesIO(), metadata=metadata)


def test_nothing_written_to_stream_on_plan_errors():
    stream = io.BytesIO()
    with pytest.raises(nvckpt.UnsupportedObjectError):
        nvckpt.save({"a": torch.ones(1000), "b": object()}, stream)
    assert stream.getvalue() == b""


def test_a_callers_pipeline_that_does_not_fit_a_tensor_names_the_tensor():
    from nvckpt.codecs import ByteShuffle, Pipeline, Zstd

    with pytest.raises(nvckpt.NvckptError, match=r"tensor 'h', chunk 0: byteshuffle\(elementsize=4\).*2002 bytes"):
        nvckpt.save({"h": torch.ones(1001, dtype=torch.float16)}, io.BytesIO(), codec=Pipeline((ByteShuffle(4), Zstd())))


def test_an_uninitialized_parameter_of_a_lazy_module_is_refused_by_name():
    import io

    with pytest.raises(nvckpt.UnsupportedObjectError, match="weight is an uninitialized parameter"):
        nvckpt.save(torch.nn.LazyLinear(4).state_dict(), io.BytesIO())


def test_a_text_mode_file_is_refused_naming_the_mode(tmp_path):
    """save into open(p, 'w') failed in the writer with 'write() argument must be str'; load from open(p) with a
    bare UnicodeDecodeError."""
    path = tmp_path / "t.nvckpt"
    with open(path, "w") as text, pytest.raises(TypeError, match="text mode.*'wb'"):
        nvckpt.save({"x": torch.ones(2)}, text)
    nvckpt.save({"x": torch.ones(2)}, path)
    with open(path) as text, pytest.raises(TypeError, match="text mode.*'rb'"):
        nvckpt.load(text)
