"""The habits torch users bring: torch.load's keywords, keys= as paths and subtrees, Checkpoint as a Mapping,
safetensors' slice methods, and one clear error for each thing that is not possible here."""

from __future__ import annotations

import io

import pytest
import torch

import nvckpt
from conftest import assert_tensor_equal


@pytest.fixture()
def ckpt(tmp_path):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7, "pair": (torch.ones(2), "x")}
    path = tmp_path / "ckpt.nvckpt"
    nvckpt.save(state, path)
    return path, state


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


@pytest.mark.parametrize("where", ["cpu", torch.device("cpu"), {"cuda:0": "cpu", "cpu": "cpu"}, {},
                                   lambda storage, location: storage])
def test_map_location_as_torch_accepts_it(ckpt, where):
    path, state = ckpt
    back = nvckpt.load(path, map_location=where)
    assert same(back, state)
    assert back["model"]["weight"].device.type == "cpu"


def test_map_location_callable_is_called_once_per_storage(tmp_path):
    base = torch.arange(10.0)
    path = tmp_path / "views.nvckpt"
    nvckpt.save({"a": base[:5], "b": base[3:]}, path)
    seen = []

    def move(storage, location):
        seen.append(location)
        return storage

    back = nvckpt.load(path, map_location=move)
    assert seen == ["cpu"]  # one shared storage
    assert back["a"].untyped_storage().data_ptr() == back["b"].untyped_storage().data_ptr()
    assert torch.equal(back["b"], base[3:])
    with pytest.raises(TypeError, match="not a storage"):
        nvckpt.load(path, map_location=lambda s, loc: "elsewhere")


def test_map_location_that_nvckpt_cannot_honour_says_what_to_use(ckpt):
    path, _ = ckpt
    with pytest.raises(ValueError, match="does not record which device"):
        nvckpt.load(path, map_location={"cuda:0": "cpu", "cuda:1": "meta"})
    for device in ("meta", "cpu", torch.device("cpu")):  # an explicit device, whichever it names
        with pytest.raises(ValueError, match="not both"):
            nvckpt.load(path, map_location="cpu", device=device)


@pytest.mark.parametrize("weights_only", [True, False, None])
def test_weights_only_is_accepted_nvckpt_never_unpickles(ckpt, weights_only):
    path, state = ckpt
    assert same(nvckpt.load(path, weights_only=weights_only), state)


def test_mmap_answers_with_what_to_use(ckpt):
    path, state = ckpt
    with pytest.raises(ValueError, match="nvckpt.open"):
        nvckpt.load(path, mmap=True)
    assert same(nvckpt.load(path, mmap=False), state)


@pytest.mark.parametrize("device", ["cuda", 0, "cuda:0", torch.device("cuda", 3)])
def test_cuda_device_without_cuda_is_one_nvckpt_error(ckpt, device):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path, _ = ckpt
    with pytest.raises(nvckpt.UnsupportedFeatureError, match="no CUDA device; load with device='cpu'"):
        nvckpt.load(path, device=device)


def test_a_device_that_is_no_device_is_a_value_error(ckpt):
    with pytest.raises(ValueError, match="device must be"):
        nvckpt.load(ckpt[0], device="gpu0")


def test_bytes_path_says_what_to_do(ckpt):
    with pytest.raises(TypeError, match="os.fsdecode"):
        nvckpt.load(bytes(ckpt[0]))


def test_keys_one_path_returns_that_value(ckpt):
    path, state = ckpt
    assert torch.equal(nvckpt.load(path, keys="model/weight"), state["model"]["weight"])
    assert same(nvckpt.load(path, keys="model"), state["model"])  # just the model's state_dict
    assert nvckpt.load(path, keys="step") == 7
    assert same(nvckpt.load(path, keys="pair"), state["pair"])
    assert same(nvckpt.load(path, keys="optimizer/param_groups/0"), state["optimizer"]["param_groups"][0])


def test_keys_a_list_returns_a_dict_reading_only_what_it_needs(ckpt):
    path, state = ckpt
    with nvckpt.open(path) as ck:
        before = ck.bytes_read
        got = ck.load(["model", "step"])
        model_bytes = ck.bytes_read - before
    assert same(got, {"model": state["model"], "step": 7})
    with nvckpt.open(path) as ck:
        before = ck.bytes_read
        ck.load()
        assert ck.bytes_read - before > model_bytes  # the optimizer's state was not read above


def test_keys_unknown_path_names_it(ckpt):
    with pytest.raises(nvckpt.TensorNotFoundError, match="nothing is saved at 'model/nope'"):
        nvckpt.load(ckpt[0], keys="model/nope")
    with pytest.raises(TypeError, match="str"):
        nvckpt.load(ckpt[0], keys=[3])


def test_checkpoint_is_a_mapping_like_safe_open(ckpt):
    path, state = ckpt
    with nvckpt.open(path) as ck:
        assert torch.equal(ck["model/weight"], state["model"]["weight"])
        assert ck.get("missing") is None and "model/bias" in ck
        assert dict(ck.items()).keys() == set(ck.keys())
        assert ck == ck and ck != {} and hash(ck) == hash(ck)
        with pytest.raises(KeyError):
            ck["missing"]
        sl = ck.get_slice("model/weight")
        assert sl.get_shape() == [4, 8] and sl.shape == (4, 8) and sl.ndim == 2
        assert sl.get_dtype() == "F32" and sl.dtype is torch.float32 and sl.dtype_name == "float32"
        assert torch.equal(sl[1:3], state["model"]["weight"][1:3])


def test_save_and_load_document_every_option():
    for fn, fields in ((nvckpt.save, nvckpt.SaveOptions), (nvckpt.open, nvckpt.LoadOptions)):
        for name in fields.__dataclass_fields__:
            assert f"``{name}``" in fn.__doc__, (fn.__name__, name)
    assert "Returns" in nvckpt.save.__doc__ and "Raises" in nvckpt.save.__doc__
    for method in ("get_tensor", "get_slice", "keys", "metadata", "writer", "load"):
        assert getattr(nvckpt.Checkpoint, method).__doc__, method


def test_stream_load_keeps_working():
    stream = io.BytesIO()
    nvckpt.save({"w": torch.ones(2)}, stream)
    stream.seek(0)
    assert torch.equal(nvckpt.load(stream, keys="w"), torch.ones(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("where", [0, "cuda", torch.device("cuda", 0), {"cpu": "cuda:0"},
                                   lambda storage, location: storage.cuda(0)])
def test_map_location_onto_a_gpu(ckpt, where):
    path, state = ckpt
    back = nvckpt.load(path, map_location=where)
    assert back["model"]["weight"].device == torch.device("cuda", 0)
    assert torch.equal(back["model"]["weight"].cpu(), state["model"]["weight"])
    assert torch.equal(nvckpt.load(path, device=0, keys="model/bias").cpu(), state["model"]["bias"])


def test_a_load_onto_the_meta_device_is_refused_naming_the_option(ckpt):
    path, _ = ckpt
    for kwargs in ({"device": "meta"}, {"map_location": "meta"}, {"map_location": torch.device("meta")}):
        with pytest.raises(ValueError, match="device='meta'.*nvckpt.open"):
            nvckpt.load(path, **kwargs)


def test_a_map_location_callable_may_return_none_as_in_torch_load():
    # torch.load: the callable "should return either None or a storage"; None keeps the default placement.
    state = {"w": torch.randn(3, 3), "v": torch.arange(4)}
    buf = io.BytesIO()
    nvckpt.save(state, buf)
    buf.seek(0)
    got = nvckpt.load(buf, map_location=lambda storage, loc: None)
    assert_tensor_equal(got["w"], state["w"]) and got["w"].device.type == "cpu"
    buf.seek(0)
    with pytest.raises(TypeError, match="not a storage or None"):
        nvckpt.load(buf, map_location=lambda storage, loc: 3)


def test_a_callable_map_location_relocates_slices_and_boxes_too(tmp_path):
    """get_slice and read_box return what get_tensor returns: relocated by a callable map_location."""
    path = tmp_path / "c.nvckpt"
    w = torch.arange(60.0).reshape(12, 5)
    nvckpt.save({"w": w}, path)
    calls = []

    def relocate(storage, location):
        calls.append(location)
        return storage.clone()  # a new storage: the result must not share the first one's memory

    with nvckpt.open(path, map_location=relocate) as f:
        whole = f.get_tensor("w")
        assert len(calls) == 1
        for got, want in ((f.get_slice("w")[2:5], w[2:5]), (f.get_slice("w")[3], w[3]),
                          (f.get_slice("w")[[1, 4]], w[[1, 4]]), (f.read_box("w", (1, 2), (3, 2)), w[1:4, 2:4])):
            assert torch.equal(got, want)
        assert len(calls) == 5 and whole.untyped_storage().data_ptr() != 0


def test_a_torch_save_file_is_named_as_such_by_the_library(tmp_path):
    """nvckpt.load of a torch.save (or safetensors) file says what the file is and what reads it, as the CLI
    does, from one piece of code (nvckpt.format.sniff)."""
    pt = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, pt)
    with pytest.raises(nvckpt.FormatError, match=r"it is a torch.save file: `nvckpt convert .*model.pt .*model.nvckpt` "
                                                 r"converts it .*nvckpt.load\(path, allow_pickle=True\)"):
        nvckpt.load(pt)
    with pytest.raises(nvckpt.FormatError, match="it is a torch.save file"):
        nvckpt.open(str(pt))
    safetensors_torch = pytest.importorskip("safetensors.torch")
    st = tmp_path / "model.safetensors"
    safetensors_torch.save_file({"w": torch.ones(2)}, st)
    with pytest.raises(nvckpt.FormatError, match="it is a safetensors file: `nvckpt convert"):
        nvckpt.load(st)


def test_allow_pickle_reads_a_trusted_torch_save_file_and_never_by_default(tmp_path):
    import numpy as np

    state = {"model": {"0.weight": torch.arange(6.0).view(2, 3)}, "rng": np.random.get_state(), "step": 5}
    pt = tmp_path / "legacy.pt"
    torch.save(state, pt)
    with pytest.raises(nvckpt.FormatError, match="allow_pickle=True"):
        nvckpt.load(pt)  # never by default
    back = nvckpt.load(pt, allow_pickle=True)
    assert torch.equal(back["model"]["0.weight"], state["model"]["0.weight"]) and back["step"] == 5
    assert np.array_equal(back["rng"][1], state["rng"][1])
    # keys= as for an nvckpt file: paths, DCP's dotted names, near matches
    assert nvckpt.load(pt, allow_pickle=True, keys="step") == 5
    got = nvckpt.load(pt, allow_pickle=True, keys=["model.0.weight", "model/0.weight"])
    assert torch.equal(got["model.0.weight"], got["model/0.weight"])
    with pytest.raises(nvckpt.TensorNotFoundError, match="did you mean 'step'"):
        nvckpt.load(pt, allow_pickle=True, keys="stepp")
    # weights_only=True keeps torch's restricted unpickler (which refuses the numpy state)
    with pytest.raises(Exception, match="Weights only load failed"):
        nvckpt.load(pt, allow_pickle=True, weights_only=True)
    with pytest.raises(ValueError, match="contradict"):
        nvckpt.load(pt, allow_pickle=True, untrusted=True)
    with pytest.raises(TypeError, match="allow_pickle"):
        nvckpt.load(pt, allow_pickle="yes")
    # an nvckpt file loads as ever; allow_pickle changes nothing for it
    nvckpt.save({"w": torch.ones(2)}, tmp_path / "new.nvckpt")
    assert torch.equal(nvckpt.load(tmp_path / "new.nvckpt", allow_pickle=True)["w"], torch.ones(2))
    with open(pt, "rb") as stream:  # a stream of a torch.save file too
        assert nvckpt.load(stream, allow_pickle=True, keys="step") == 5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.int8, torch.int64, torch.uint8, torch.uint32, torch.bool,
                                   torch.complex64])
def test_get_dtype_is_safetensors_own_name(tmp_path, dtype):
    """get_slice(name).get_dtype() says what safetensors' does for the same tensor: code written for safe_open
    (a table from its names to torch dtypes) runs unchanged."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    t = torch.zeros(4, dtype=dtype)
    safetensors_torch.save_file({"t": t}, tmp_path / "t.safetensors")
    nvckpt.save({"t": t}, tmp_path / "t.nvckpt")
    with safe_open(tmp_path / "t.safetensors", "pt") as st, nvckpt.open(tmp_path / "t.nvckpt") as ck:
        assert ck.get_slice("t").get_dtype() == st.get_slice("t").get_dtype()
        assert ck.get_slice("t").dtype is dtype
