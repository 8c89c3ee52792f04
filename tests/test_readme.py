"""README's quickstart runs as printed, and what its comments promise is true."""

from __future__ import annotations

import os
import re

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_runs_and_keeps_its_promises(tmp_path, monkeypatch):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as readme:
        text = readme.read()
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md quickstart", "exec"), scope)  # noqa: S102 - our own README
    scope["future"].result()
    import nvckpt

    with nvckpt.open(tmp_path / "ckpt.nvckpt") as f:
        assert f.keys()[:3] == ["model/weight", "model/bias", "optimizer/state/0/step"]
        assert f.metadata() == {"run": "exp-42"}
    assert torch.equal(scope["rows"], scope["w"][128:256])
    assert list(scope["model_state"]) == ["weight", "bias"]
