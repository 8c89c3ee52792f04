"""README's quickstart runs as printed, and what its comments promise is true; its two test commands do what
it says, and CI runs the whole-suite one."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_runs_and_keeps_its_promises(tmp_path, monkeypatch):
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", _readme(), re.S).group(1)
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


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as readme:
        return readme.read()


def _test_commands() -> list[list[str]]:
    block = re.search(r"Run the tests:\n\n```sh\n(.*?)```", _readme(), re.S).group(1)
    return [line.split("#")[0].split() for line in block.splitlines() if " pytest" in line]


def test_ci_runs_the_whole_suite_command_of_the_readme():
    quick, full = _test_commands()
    assert quick == ["python", "-m", "pytest"] and full == ["python", "-m", "pytest", "--full"]
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as ci:
        runs = [line.split() for line in ci if " pytest" in line and not line.lstrip().startswith("#")]
    assert len(runs) == 1, runs
    # CI adds only output and coverage options to the README's whole-suite command.
    python, *args = runs[0]
    assert python.startswith("python") and args[:2] == full[1:3], runs[0]
    assert [arg for arg in args[2:] if not arg.startswith(("-q", "--cov"))] == full[3:], runs[0]


@pytest.mark.slow
def test_plain_pytest_leaves_out_the_slow_tests_and_full_runs_them(tmp_path):
    """The selection is the suite's own conftest.py, run on two tests of which one is marked slow."""
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as pyproject:
        markers = re.search(r"^markers = \[.*?^\]", pyproject.read(), re.S | re.M).group(0)
    (tmp_path / "pyproject.toml").write_text(
        f'[tool.pytest.ini_options]\ntestpaths = ["tests"]\naddopts = "--strict-markers"\n{markers}\n')
    (tmp_path / "tests").mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "tests")
    (tmp_path / "tests" / "test_two.py").write_text(
        "import pytest\n\ndef test_quick():\n    pass\n\n@pytest.mark.slow\ndef test_slow():\n    pass\n")

    # The three runs in one process, so that the conftest's import of torch is paid once.
    runs = [[], ["--full"], ["tests/test_two.py"]]  # the last: naming a file runs what was asked for
    script = ("import sys, pytest\n"
              f"for args in {runs!r}:\n"
              "    code = pytest.main(['-p', 'no:cacheprovider', *args])\n"
              "    print('=== exit', int(code), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    quick, full, named, _ = done.stdout.split("=== exit")
    assert done.stdout.count("=== exit 0") == 3, done.stdout + done.stderr
    assert "the tests marked slow are left out" in quick and "1 passed, 1 deselected" in quick, quick
    assert "2 passed" in full and "deselected" not in full, full
    assert "2 passed" in named and "deselected" not in named, named
