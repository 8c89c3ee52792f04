"""Issue 13's commands, each run as a user runs it (a process, ``python -m nvckpt``): every failure is one
line on stderr, naming the user's file (never a temporary one), with the exit code README documents."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch

import nvckpt
from nvckpt.cli import EXIT_IO, EXIT_OK, EXIT_PROBLEMS, EXIT_UNSUPPORTED, EXIT_USAGE
from nvckpt.io.atomic import AtomicReplace
from nvckpt.tools.bench import touch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 1 << 20  # bytes a process may write into one file: a disk that fills up mid-write


def _small_disk() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, like ENOSPC
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def nvckpt_cli(*args: str, cwd, full_disk: bool = False) -> tuple[int, str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "nvckpt", *args], cwd=cwd, env=env, capture_output=True, text=True,
                       preexec_fn=_small_disk if full_disk else None, timeout=300)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli13")
    nvckpt.save({"w": torch.randn(1 << 19), "b": torch.ones(3)}, d / "big.nvckpt")  # 2 MiB of fp32, > LIMIT
    torch.save({"w": torch.ones(3), "cfg": {"dtype": torch.float16, "device": torch.device("cpu"), "z": 1j,
                                           "big": 2**70, "tags": {1, 2}}}, d / "model.pt")
    (d / "disguised.pt").write_bytes((d / "big.nvckpt").read_bytes())  # an nvckpt file under a torch name
    data = (d / "big.nvckpt").read_bytes()
    (d / "damaged.nvckpt").write_bytes(data[: len(data) // 2])
    (d / "adir").mkdir()
    torch.save({"w": {("a", 1): torch.ones(1)}}, d / "tuplekey.pt")  # torch.load accepts it; a tree key cannot be a tuple
    return d


def one_error_line(code: int, out: str, err: str, expected_code: int) -> str:
    lines = err.strip().splitlines()
    assert code == expected_code and len(lines) == 1 and lines[0].startswith("nvckpt: error: "), (code, out, err)
    assert ".nvckpt-tmp" not in lines[0] and "Traceback" not in err
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("dst", ["full.safetensors", "full.pt", "full.nvckpt", "full.ckpt"])
def test_a_full_disk_is_one_line_and_exit_4(files, dst):
    line = one_error_line(*nvckpt_cli("convert", "big.nvckpt", dst, cwd=files, full_disk=True), EXIT_IO)
    # safetensors and nvckpt see the OS's error (EFBIG here, ENOSPC on a full disk); torch's zip writer reports
    # none, so it is an I/O error (ENOSPC when the folder's disk is full); in each case the user's path.
    assert line.startswith(f"nvckpt: error: {dst}: ") and ("File too large" in line or "torch.save failed" in line)
    assert not [f for f in os.listdir(files) if f.startswith(".full") or f.startswith("full")]  # nothing left


@pytest.mark.slow
def test_a_disk_full_within_a_block_is_named_as_full(files):
    """A limit that cuts a write short of O_DIRECT's alignment (here 1000 bytes into the file): the kernel then
    refused the rest with EINVAL, and the error said "Invalid argument" instead of what stopped the write."""
    def tiny_disk() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "nvckpt", "convert", "big.nvckpt", "tiny.nvckpt"], cwd=files, env=env,
                       capture_output=True, text=True, preexec_fn=tiny_disk, timeout=300)
    line = one_error_line(p.returncode, p.stdout, p.stderr, EXIT_IO)
    assert line.startswith("nvckpt: error: tiny.nvckpt: ") and "File too large" in line, line
    assert not [f for f in os.listdir(files) if "tiny" in f]


@pytest.mark.slow
@pytest.mark.parametrize("args,code,says", [
    (["convert", "big.nvckpt", "nodir/x.nvckpt"], EXIT_IO, "nodir"),
    (["convert", "big.nvckpt", "adir/"], EXIT_USAGE, "cannot tell the format"),
    (["convert", "big.nvckpt", "adir", "--to", "nvckpt"], EXIT_IO, "adir: Is a directory"),
    (["info", "adir"], EXIT_IO, "adir: Is a directory"),
    (["info", "model.pt"], EXIT_PROBLEMS, "it is a torch.save file: `nvckpt convert model.pt model.nvckpt`"),
    (["ls", "model.pt"], EXIT_PROBLEMS, "it is a torch.save file"),
    (["info", "missing.nvckpt"], EXIT_IO, "missing.nvckpt"),
    (["bench", "--smoke"], EXIT_USAGE, "unrecognized arguments: --smoke"),
    (["convert", "tuplekey.pt", "tuplekey.nvckpt"], EXIT_UNSUPPORTED, "tuplekey.pt: dict key ('a', 1) at w has type tuple"),
    (["verify"], EXIT_USAGE, "the following arguments are required: file"),
])
def test_each_failure_is_one_line_with_its_exit_code(files, args, code, says):
    assert says in one_error_line(*nvckpt_cli(*args, cwd=files), code)


@pytest.mark.slow
def test_convert_sniffs_content_and_stores_what_torch_checkpoints_hold(files):
    code, out, err = nvckpt_cli("convert", "model.pt", "model.nvckpt", cwd=files)
    assert code == EXIT_OK and err == "", err
    cfg = nvckpt.load(files / "model.nvckpt")["cfg"]
    assert cfg == {"dtype": torch.float16, "device": torch.device("cpu"), "z": 1j, "big": 2**70, "tags": {1, 2}}
    code, out, err = nvckpt_cli("convert", "disguised.pt", "back.safetensors", cwd=files)  # nvckpt content, .pt name
    assert code == EXIT_OK and "(nvckpt," in out, err
    code, out, err = nvckpt_cli("convert", "model.nvckpt", "lightning.ckpt", cwd=files)  # Lightning's extension
    assert code == EXIT_OK and "(torch," in out, err
    assert torch.load(files / "lightning.ckpt", weights_only=True)["cfg"]["big"] == 2**70


@pytest.mark.slow
def test_verify_json_on_a_damaged_file_says_so_on_stdout(files):
    code, out, err = nvckpt_cli("verify", "--json", "damaged.nvckpt", cwd=files)
    one_error_line(code, out, err, EXIT_PROBLEMS)
    doc = json.loads(out)
    assert doc["ok"] is False and doc["exit_code"] == EXIT_PROBLEMS and doc["error"] == "TruncatedError"


@pytest.mark.slow
def test_subcommand_help_gives_exit_codes_in_one_line(files):
    code, out, _ = nvckpt_cli("info", "--help", cwd=files)
    assert code == EXIT_OK and "exit codes: 0 ok, 1 damage" in out and "130 interrupted" not in out
    code, out, _ = nvckpt_cli("--help", cwd=files)
    assert "130 interrupted" in out  # the full table, once


def test_the_atomic_replace_names_the_target_not_its_temporary_file(tmp_path):
    def refuse(tmp: str) -> None:
        raise PermissionError(13, "Permission denied", tmp)  # a read-only folder (root ignores chmod)

    with pytest.raises(PermissionError) as info:
        AtomicReplace(tmp_path / "good.nvckpt", refuse)
    assert info.value.filename == str(tmp_path / "good.nvckpt") and "nvckpt-tmp" not in str(info.value)
    with pytest.raises(OSError) as info:  # a write that fails with no file named (ENOSPC)
        with AtomicReplace(tmp_path / "x.nvckpt"):
            raise OSError(28, "No space left on device")
    assert info.value.filename == str(tmp_path / "x.nvckpt") and not os.listdir(tmp_path)


def test_bench_touches_every_tensor_it_times():
    tree = {"a": torch.ones(5000), "b": [torch.zeros(3, dtype=torch.bool), (torch.randn(4, 4).t(),)],
            "c": torch.ones(2, dtype=torch.complex64), "e": torch.empty(0)}
    assert touch(tree) is tree
