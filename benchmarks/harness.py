"""What the benchmark scripts do around their measurements, written once: a timestamped log, the run's
description (date, command, machine, package versions, load average, code commit), evicting files from the
page cache with a report of what could be done, and writing a result's JSON and markdown.

Standard library only, so that importing it costs a script nothing and needs no GPU.  The scripts run as
``python benchmarks/X.py`` (this folder is then on ``sys.path``); a script also loaded by file path
(tests/test_gpu.py loads bench_gpu.py) puts this folder on ``sys.path`` itself.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(*args: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


# -- the run's description ----------------------------------------------------------------------------------
def utc_date() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line(script: str, argv: list[str], python: str = "python3") -> str:
    """The command that ran ``script`` with ``argv``, from the repository root, as a reader can paste it."""
    return " ".join([python, os.path.relpath(os.path.abspath(script), ROOT)] + [shlex.quote(a) for a in argv])


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages as /proc/loadavg writes them ("0.52 0.61 0.70"): on a shared
    machine, how much of the cores other processes took."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def shell(cmd: str, timeout: float = 20) -> str:
    """A shell command's stdout, stripped (a failing command gives what it printed, often ""; one that cannot
    run or times out, its error's name): a description must never stop a run."""
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__


def code_commit() -> str:
    """The repository's HEAD, short ("" outside a git checkout)."""
    return shell(f"git -C {shlex.quote(ROOT)} rev-parse --short HEAD")


def filesystem(path: str) -> str:
    """``df -T``'s line for the filesystem ``path`` is on (device, type, sizes, mount point)."""
    return shell(f"df -T {shlex.quote(path)} | tail -1")


def hardware() -> dict[str, Any]:
    """The host: CPU model, cores, memory, machine, Python, kernel."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "memory_MB": mem, "machine": platform.machine(),
            "python": platform.python_version(), "kernel": platform.release()}


def package_versions(names: Iterable[str]) -> dict[str, str]:
    """Each installed distribution's version, "not installed" for the others."""
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except Exception:  # noqa: BLE001
            out[name] = "not installed"
    return out


# -- files and the page cache ------------------------------------------------------------------------------
def files_of(path: str) -> list[str]:
    """``path`` itself if it is not a folder, else every file below it (a checkpoint of several files)."""
    if not os.path.isdir(path):
        return [path]
    return [os.path.join(d, n) for d, _, names in os.walk(path) for n in names]


def tree_bytes(path: str) -> int:
    """The bytes of a file, or of every file below a folder (0 if there is none)."""
    return sum(os.path.getsize(f) for f in files_of(path)) if os.path.exists(path) else 0


def drop_page_cache(paths: Iterable[str] = ()) -> dict[str, Any]:
    """Evict from the page cache, so that the next read of ``paths`` comes from the disk: every clean page
    where the process may write /proc/sys/vm/drop_caches (root), and always each of ``paths`` (files, or
    folders: their files) with posix_fadvise(DONTNEED) after its fsync, which needs no root.

    Returns what it could do: ``drop_caches`` True or the error's name and text, and, given paths,
    ``fadvise_dontneed`` True if every file was evicted."""
    os.sync()
    done: dict[str, Any] = {}
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        done["drop_caches"] = True
    except OSError as exc:
        done["drop_caches"] = f"{type(exc).__name__}: {exc.strerror}"
    paths = list(paths)
    if paths:
        ok = True
        for file in [f for p in paths for f in files_of(p)]:
            try:
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            except (OSError, AttributeError):  # AttributeError: no posix_fadvise on this OS
                ok = False
        done["fadvise_dontneed"] = ok
    return done


def cache_dropped(report: dict[str, Any]) -> bool:
    """Whether a ``drop_page_cache`` report says the files were evicted (by either means)."""
    return report.get("drop_caches") is True or report.get("fadvise_dontneed") is True


# -- the results ----------------------------------------------------------------------------------------------
def _replace(path: str, text: str) -> None:
    """Write ``path`` whole or not at all: a run killed while writing leaves the previous file."""
    part = path + ".part"
    with open(part, "w") as f:
        f.write(text)
    os.replace(part, path)


def write_results(out: str, name: str, doc: Any, markdown: Callable[[], str] | None = None, *,
                  title: str | None = None, echo: bool = False) -> str | None:
    """Write ``out/name.json`` (``doc``; what JSON cannot hold as its ``str``) and, given a renderer,
    ``out/name.md``.  The JSON is written first and kept when the renderer fails (a half-filled result of a
    run cut short still counts): the .md then says why, under ``# title`` if one is given.  ``echo`` prints
    the markdown (or the failure, with its traceback on stderr).  Returns the markdown, None if it failed or
    there is no renderer."""
    os.makedirs(out, exist_ok=True)
    _replace(os.path.join(out, name + ".json"), json.dumps(doc, indent=1, default=str))
    if markdown is None:
        return None
    try:
        text: str | None = markdown()
        body = text
    except Exception as exc:  # noqa: BLE001 - an incomplete section must not lose the JSON
        text = None
        body = (f"# {title}\n\n" if title else "") + f"markdown failed: {type(exc).__name__}: {exc}\n"
        if echo:
            traceback.print_exc(file=sys.stderr)
    _replace(os.path.join(out, name + ".md"), body)
    if echo:
        print(body)
    return text
