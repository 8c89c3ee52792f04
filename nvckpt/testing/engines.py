"""Contract tests for engines (nvckpt.engines.base.Engine): every engine runs them.

Subclass ``EngineTests`` and give ``engine()`` (a fresh one per call); the
tests save real training states through ``nvckpt.save`` / ``async_save`` with
``engine=`` that engine and check what every engine promises: the file loads
back bit for bit, the same state gives the same bytes, an async_save holds
the values at its call whatever the caller does next, its payloads are
aligned as it says, and a save it cannot finish leaves the target as it was.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from ..engines.base import Engine, is_engine


def training_state(seed: int = 0, steps: int = 2) -> dict[str, Any]:
    """A small model trained ``steps`` AdamW steps: fp32 weights, a tied pair, moments, step counts, a bf16
    copy of the weights (derived tensors), scalars."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64), torch.nn.LayerNorm(64),
                                    torch.nn.Linear(64, 64, bias=False))
        model[1].weight = model[0].weight  # tied: one tensor under two names
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(steps):
            loss = model(torch.randint(0, 64, (4, 8))).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    weights = model.state_dict()
    return {"model": weights, "bf16": {k: v.to(torch.bfloat16) for k, v in weights.items()},
            "optimizer": opt.state_dict(), "step": steps, "lr": 1e-3, "name": "contract"}


def same_tree(a: Any, b: Any) -> bool:
    """Bit-exact equality of nested states (tensors by their bytes, containers by type and items)."""
    if isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.detach().cpu().contiguous().view(-1).view(torch.uint8) if a.numel() else a.cpu(),
                                b.detach().cpu().contiguous().view(-1).view(torch.uint8) if b.numel() else b.cpu()))
    if isinstance(b, dict):
        return isinstance(a, dict) and list(a) == list(b) and all(same_tree(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class EngineTests:
    """The engine contract (see the module docstring)."""

    def engine(self) -> Engine:
        """The engine under test: override in the subclass (a fixture)."""
        raise NotImplementedError

    def test_is_an_engine(self) -> None:
        e = self.engine()
        assert is_engine(e) and isinstance(e.name, str)
        assert e.chunk_size >= 1 and e.alignment >= 1 and e.alignment & (e.alignment - 1) == 0

    @pytest.mark.parametrize("codec", ["auto", "portable", "raw"])
    def test_saves_load_back_bit_for_bit(self, codec: str) -> None:
        import nvckpt

        state = training_state()
        buf = io.BytesIO()
        result = nvckpt.save(state, buf, engine=self.engine(), codec=codec, chunk_size=4096)
        assert result.engine == self.engine().name and result.file_bytes == len(buf.getvalue())
        buf.seek(0)
        assert same_tree(nvckpt.load(buf), state)

    def test_the_same_state_gives_the_same_bytes(self) -> None:
        import nvckpt

        state = training_state()
        files = []
        for _ in range(2):
            buf = io.BytesIO()
            nvckpt.save(state, buf, engine=self.engine(), chunk_size=4096)
            files.append(buf.getvalue())
        assert files[0] == files[1]

    def test_payloads_are_aligned_as_it_says(self) -> None:
        import nvckpt

        buf = io.BytesIO()
        engine = self.engine()
        nvckpt.save({"w": torch.randn(64, 1024), "b": torch.randn(7)}, buf, engine=engine, codec="raw",
                    chunk_size=65536)
        buf.seek(0)
        with nvckpt.open(buf) as ck:
            big = [c for e in ck.index.tensors if e.chunks is not None for c in e.chunks
                   if c.stored_length >= engine.alignment]
        assert big and all(c.offset % engine.alignment == 0 for c in big)

    def test_async_save_holds_the_values_at_its_call(self, tmp_path: Any) -> None:
        import nvckpt

        state = training_state()
        expected = training_state()
        future = nvckpt.async_save(state, tmp_path / "a.nvckpt", engine=self.engine(), chunk_size=4096)
        with torch.no_grad():  # the caller goes on at once: the file must not see this
            for t in state["model"].values():
                t.add_(1.0)
        future.result(timeout=120)
        assert same_tree(nvckpt.load(tmp_path / "a.nvckpt"), expected)

    def test_a_failed_save_leaves_the_target_as_it_was(self, tmp_path: Any) -> None:
        import nvckpt
        from nvckpt.errors import UnsupportedObjectError

        path = tmp_path / "a.nvckpt"
        nvckpt.save({"old": torch.ones(3)}, path, engine=self.engine())
        before = path.read_bytes()
        with pytest.raises(UnsupportedObjectError):
            nvckpt.save({"w": torch.ones(3), "bad": object()}, path, engine=self.engine())
        assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["a.nvckpt"]


__all__ = ["EngineTests", "training_state", "same_tree"]
