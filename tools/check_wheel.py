"""Check the wheel a user installs (CI runs both steps; see .ci/run).

    python3 tools/check_wheel.py contents dist/nvckpt-*.whl
    VENV/bin/python tools/check_wheel.py smoke            # in a fresh virtualenv where only the wheel is installed

``contents``: the wheel holds the package with its package data (``py.typed``) and its compiled kernels, and
nothing of the repository beside it (tests, benchmarks, tools, conformance, docs).  ``smoke``: the installed
package (not a checkout) saves, loads, opens a row slice, and its command line answers ``--version`` and
``verify``; a missing module, package-data file or entry point fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile

KERNELS = ("nvckpt/codecs/_planes.", "nvckpt/plan/_derived.", "nvckpt/format/_columns.")
NOT_SHIPPED = ("tests/", "benchmarks/", "tools/", "conformance/", "docs/")


def contents(wheel: str) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    problems = [n for n in names if n.startswith(NOT_SHIPPED)]
    problems += [f"no {k}*.so" for k in KERNELS if not any(n.startswith(k) and n.endswith(".so") for n in names)]
    for needed in ("nvckpt/__init__.py", "nvckpt/py.typed", "nvckpt/cli.py", "nvckpt/testing/io.py"):
        if needed not in names:
            problems.append(f"no {needed}")
    if not any(n.endswith(".dist-info/entry_points.txt") for n in names):
        problems.append("no entry_points.txt (the nvckpt command)")
    if problems:
        sys.exit(f"{wheel}: " + "; ".join(problems))
    print(f"{os.path.basename(wheel)}: {len(names)} files, package data and kernels present, no repository files")


def smoke() -> None:
    import torch

    import nvckpt
    from nvckpt.codecs import planes

    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.dirname(os.path.dirname(os.path.abspath(nvckpt.__file__))) == os.path.dirname(here):
        sys.exit(f"nvckpt was imported from the checkout ({nvckpt.__file__}), not from the installed wheel")
    assert planes.kernel() == "c", "the compiled byte-plane kernel did not load from the wheel"
    bindir = os.path.dirname(sys.executable)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "smoke.nvckpt")
        model = torch.nn.Linear(256, 256)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7,
                 "half": model.weight.detach().to(torch.bfloat16)}
        result = nvckpt.save(state, path, metadata={"smoke": True})
        back = nvckpt.load(path)
        assert back["step"] == 7 and torch.equal(back["model"]["weight"], model.weight.detach())
        assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], opt.state[model.weight]["exp_avg"])
        with nvckpt.open(path) as f:
            assert f.metadata() == {"smoke": True}
            assert torch.equal(f.get_slice("model/weight")[10:20], model.weight.detach()[10:20])
        version = subprocess.run([os.path.join(bindir, "nvckpt"), "--version"], capture_output=True, text=True,
                                 check=True).stdout.strip()
        assert version == f"nvckpt {nvckpt.__version__}", version
        verify = subprocess.run([os.path.join(bindir, "nvckpt"), "verify", path], capture_output=True, text=True)
        assert verify.returncode == 0, verify.stdout + verify.stderr
    print(f"{version} from {os.path.dirname(nvckpt.__file__)}: save, load, open, verify ok "
          f"(ratio {result.ratio:.3f})")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "contents":
        contents(sys.argv[2])
    elif sys.argv[1:] == ["smoke"]:
        smoke()
    else:
        sys.exit(__doc__)
