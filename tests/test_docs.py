"""The documentation stays true: the Python code of docs/ and README.md runs as printed, the site builds with
``mkdocs build --strict``, and every public name the API reference shows has a docstring.

A page's ```python blocks run in order, in one namespace, in a fresh interpreter in an empty folder (so a
block may use what an earlier block of its page made).  The line before a block may say how it is tested:

    <!-- docs-test: skip: REASON -->   not run here (a GPU, a server); the reason is required
    <!-- docs-test: torchrun -->       a script run with torchrun on 2 processes, then resumed on 1
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")

_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_MARK = re.compile(r"<!-- docs-test: (.*?) -->\s*\n$")
_DIRECTIVE = re.compile(r"^::: ([\w.]+)\n((?:    .*\n|\n)*)", re.M)


def pages() -> list[str]:
    """README.md and every page of docs/, as paths relative to the repository."""
    found = ["README.md"]
    for folder, _, files in os.walk(DOCS):
        found += sorted(os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".md"))
    return found


def blocks(page: str) -> list[tuple[int, str, str]]:
    """(line, how, code) of each python block of ``page``: how is "run", "torchrun" or "skip: REASON"."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 2
        before = text[max(0, m.start() - 200):m.start()]
        mark = _MARK.search(before)
        how = mark.group(1).strip() if mark else "run"
        if not (how in ("run", "torchrun") or re.fullmatch(r"skip: \S.*", how)):
            raise AssertionError(f"{page}:{line - 1}: unknown docs-test marker {how!r} (skip: REASON, or torchrun)")
        out.append((line, how, m.group(1)))
    return out


# Each page in its own interpreter: its saves' exit hooks, signal handlers and lazy imports stay its own,
# and a framework's warnings (Lightning's) are a user's, not this suite's errors.
_RUNNER = textwrap.dedent("""
    import json, sys
    scope = {"__name__": "__main__"}
    for line, code in json.load(sys.stdin):
        exec(compile("\\n" * (line - 1) + code, sys.argv[1], "exec"), scope)
""")


def _run(args: list[str], cwd: str, stdin: str | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.run(args, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in pages() if any(how == "run" for _, how, _ in blocks(p))])
def test_python_blocks_run(page, tmp_path):
    code = [(line, src) for line, how, src in blocks(page) if how == "run"]
    done = _run([sys.executable, "-c", _RUNNER, page], str(tmp_path), json.dumps(code))
    assert done.returncode == 0, f"{page}: its python blocks failed\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in pages() if any(how == "torchrun" for _, how, _ in blocks(p))])
def test_torchrun_scripts_resume_at_another_world_size(page, tmp_path):
    for line, how, src in blocks(page):
        if how != "torchrun":
            continue
        (tmp_path / "train.py").write_text("\n" * (line - 1) + src)
        for ranks in (2, 1):
            done = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                         "train.py", "ckpt"], str(tmp_path))
            assert done.returncode == 0, f"{page}:{line} with {ranks} ranks\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
            assert f"saved ckpt from {ranks} ranks" in done.stdout, done.stdout
        assert "step 20:" in done.stdout, done.stdout  # the second run resumed where the first stopped


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(env, PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    assert (tmp_path / "site" / "reference" / "nvckpt" / "index.html").exists()
    assert (tmp_path / "site" / "SPEC" / "index.html").exists()


def reference_members() -> list[tuple[str, str, object]]:
    """(page, name, object) of every object the API reference pages render, with the members each shows."""
    out = []
    for name in sorted(os.listdir(os.path.join(DOCS, "reference"))):
        page = f"docs/reference/{name}"
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        for m in _DIRECTIVE.finditer(text):
            path, options = m.group(1), m.group(2)
            obj = _resolve(path)
            out.append((page, path, obj))
            listed = re.search(r"members: \[(.*?)\]", options)
            if "members: false" in options:
                continue
            names = ([n.strip() for n in listed.group(1).split(",")] if listed
                     else [n for n in vars(obj) if not n.startswith("_")] if inspect.isclass(obj) else [])
            if inspect.ismodule(obj):  # a module's page shows every name it exports
                for exported in sorted(set(getattr(obj, "__all__", ())) - set(names)):
                    out.append((page, f"{path}.{exported} (in __all__, not shown)", None))
            for member in names:
                out.append((page, f"{path}.{member}", inspect.getattr_static(obj, member)))
    return out


def _resolve(path: str) -> object:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"cannot import {path}")


def _documented(obj: object) -> bool:
    if obj is None:
        return False
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj):
        return bool((obj.__doc__ or "").strip())
    return True  # a constant: documented by a #: comment or the module's docstring


@pytest.mark.slow
def test_every_public_name_in_the_reference_has_a_docstring():
    rendered = reference_members()
    missing = [f"{page}: {name}" for page, name, obj in rendered if not _documented(obj)]
    assert not missing, "no docstring:\n" + "\n".join(missing)
    import nvckpt

    shown = {name for _, name, _ in rendered}
    for public in nvckpt.__all__:
        assert public == "__version__" or f"nvckpt.{public}" in shown, f"nvckpt.{public} is not in the API reference"


def test_changelog_leads_with_this_version():
    import nvckpt

    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        releases = re.findall(r"^## \[([^\]]+)\] - (\d{4}-\d{2}-\d{2})$", f.read(), re.M)
    assert releases and releases[0][0] == nvckpt.__version__, (releases[:1], nvckpt.__version__)
    assert [d for _, d in releases] == sorted((d for _, d in releases), reverse=True)
