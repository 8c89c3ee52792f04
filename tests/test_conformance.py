"""The conformance suite (conformance/) against nvckpt and against the independent reader.

Runs every case in-process through the same comparison code as conformance/run.py
(fast enough for CI), checks the runner's command-line protocol on a few cases,
validates the manifest against its JSON Schema, checks that the generator is
deterministic, and that readers on several threads share one open file.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import nvckpt  # noqa: E402
from conformance import reference_reader, run  # noqa: E402
from conformance.adapters import nvckpt_impl  # noqa: E402

SUITE = os.path.join(ROOT, "conformance")
MANIFEST = os.path.join(SUITE, "manifest.json")

# Cases nvckpt fails today, each a disagreement with SPEC.md (see conformance/README.md).  The test
# fails when this list is wrong in either direction, so a fix must also remove its line here.
NVCKPT_KNOWN_FAILURES: dict[str, str] = {}  # case id -> why nvckpt fails it (none at present)


@pytest.fixture(scope="module")
def manifest() -> dict:
    with open(MANIFEST) as f:
        return json.load(f)


def in_process(decode) -> run.Decoder:
    return lambda paths: [(decode(p), "") for p in paths]


def outcome_map(report: run.Report) -> dict[str, run.Outcome]:
    return {o.case["id"]: o for o in report.outcomes}


# -- the manifest ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_manifest_matches_schema(manifest):
    with open(os.path.join(SUITE, "manifest.schema.json")) as f:
        schema = json.load(f)
    try:
        import jsonschema
    except ImportError:  # not a test dependency: check the parts the runner relies on by hand
        jsonschema = None
    if jsonschema is not None:
        jsonschema.Draft202012Validator.check_schema(schema)
        errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(manifest), key=str)
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])
    levels, results = {"must", "should", "may"}, {"valid", "invalid"}
    for case in manifest["cases"]:
        assert case["result"] in results and case["level"] in levels and case["flags"] and case["section"]
        if case["result"] == "valid":
            for t in case["expected"]["tensors"].values():
                assert ("sha256" in t) != ("error" in t), case["id"]
        else:
            assert case["error"] in manifest["errors"] and case["danger"], case["id"]


def test_files_listed_exist_and_suite_is_small(manifest):
    listed = {c["file"] for c in manifest["cases"]}
    on_disk = {f"files/{n}" for n in os.listdir(os.path.join(SUITE, "files"))}
    assert listed == on_disk
    assert len({c["id"] for c in manifest["cases"]}) == len(manifest["cases"])
    total = 0
    for case in manifest["cases"]:
        size = os.path.getsize(os.path.join(SUITE, case["file"]))
        assert size == case["bytes"], case["id"]
        total += size
    assert total < 5 * 2**20, f"suite is {total} bytes"
    ids = {c["id"] for c in manifest["cases"]}
    assert set(NVCKPT_KNOWN_FAILURES) <= ids


def test_suite_covers_the_issue(manifest):
    """Every category the suite promises is there (a regression guard on the generator)."""
    flags = {f for c in manifest["cases"] for f in c["flags"]}
    from nvckpt.format.dtypes import DTYPES

    assert {f"valid-dtype-{d}" for d in DTYPES} <= {c["id"] for c in manifest["cases"]}
    for flag in ("0-d", "empty", "multi-chunk", "codec-raw", "codec-zstd", "codec-byteshuffle", "derived", "view",
                 "tree", "metadata", "unicode", "alignment", "optional-feature", "optional-frame", "pipe",
                 "truncated", "magic", "required-feature", "unknown-codec", "checksum", "offsets", "overlap",
                 "decompression-bomb", "limit", "depth", "duplicate-name", "overflow", "self-reference", "dangling"):
        assert flag in flags, flag
    checksums = {c["id"] for c in manifest["cases"] if "checksum" in c["flags"] and c["result"] == "invalid"}
    for what in ("chunk", "index", "index-frame-header", "footer", "tensor"):
        assert f"checksum-{what}" in checksums


# -- implementations ---------------------------------------------------------------------------------

def test_nvckpt_passes_the_suite():
    report = run.run_suite(in_process(nvckpt_impl.decode), manifest_path=MANIFEST)
    outcomes = outcome_map(report)
    failed = {i for i, o in outcomes.items() if o.status == "failed"}
    unexpected = {i: outcomes[i].reason for i in failed - set(NVCKPT_KNOWN_FAILURES)}
    assert not unexpected, unexpected
    fixed = set(NVCKPT_KNOWN_FAILURES) - failed
    assert not fixed, f"now passing, remove from NVCKPT_KNOWN_FAILURES: {fixed}"
    # The streaming-only cases are the only skips of a random-access reader.
    assert all(o.case["readers"] == ["streaming"] for o in report.outcomes if o.status == "skipped")


@pytest.mark.parametrize("streaming", [False, True], ids=["random-access", "streaming"])
def test_independent_reader_passes_every_case(streaming):
    decoder = in_process(lambda p: reference_reader.decode_file(p, streaming))
    report = run.run_suite(decoder, manifest_path=MANIFEST, reader="streaming" if streaming else "random-access")
    assert not [o for o in report.outcomes if o.status == "failed"], report.failures()
    assert sum(o.status == "passed" for o in report.outcomes) > 200


def test_independent_reader_does_not_import_nvckpt():
    code = (
        "import sys, json; sys.path.insert(0, {root!r}); from conformance import reference_reader as r; "
        "doc = r.decode_file({path!r}); "
        "print(json.dumps([doc['status'], sorted(m for m in sys.modules if m == 'nvckpt' or m.startswith('nvckpt.') "
        "or m == 'torch')]))"
    ).format(root=ROOT, path=os.path.join(SUITE, "files", "valid-base.nvckpt"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == ["ok", []]


@pytest.mark.slow
def test_runner_protocol_end_to_end(tmp_path):
    """conformance/run.py driving real commands: the table, the exit status, crash and stdin handling."""
    ids = ["valid-base", "valid-pipe", "checksum-chunk", "truncated-at-00024", "valid-unknown-codec", "frame-type-5"]
    cmd = [sys.executable, os.path.join(SUITE, "run.py"), "--only", *ids, "--json", str(tmp_path / "r.json"), "--",
           sys.executable, os.path.join(SUITE, "reference_reader.py")]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "| must | valid | 3 | 0 | 0 |" in p.stdout and "| must | invalid | 2 | 0 | 1 |" in p.stdout
    results = {r["id"]: r["status"] for r in json.loads((tmp_path / "r.json").read_text())}
    assert results["frame-type-5"] == "skipped" and results["checksum-chunk"] == "passed"

    # Streaming reader, files on stdin: the frame-type case now applies.
    cmd_stream = [sys.executable, os.path.join(SUITE, "run.py"), "--reader", "streaming", "--stdin", "--only", *ids,
                  "--", sys.executable, os.path.join(SUITE, "reference_reader.py"), "--streaming"]
    p = subprocess.run(cmd_stream, capture_output=True, text=True)
    assert p.returncode == 0 and "| must | invalid | 3 | 0 | 0 |" in p.stdout, p.stdout + p.stderr

    # nvckpt through its adapter, as another implementation would be driven.
    cmd_nv = [sys.executable, os.path.join(SUITE, "run.py"), "--only", *ids, "--",
              sys.executable, os.path.join(SUITE, "adapters", "nvckpt_impl.py")]
    p = subprocess.run(cmd_nv, capture_output=True, text=True)
    assert p.returncode == 0 and "| must | valid | 3 | 0 | 0 |" in p.stdout, p.stdout + p.stderr

    # An implementation that crashes, or accepts everything, fails must-level cases: exit status 1.
    crashing = tmp_path / "crash.py"
    crashing.write_text("import sys\nraise SystemExit(3)\n")
    accepting = tmp_path / "accept.py"
    accepting.write_text("import sys, json\nfor _ in sys.argv[2:]: print(json.dumps({'status': 'ok', 'tensors': {}, "
                         "'tree': None, 'metadata': {'$map': []}}))\n")
    for impl, reason in ((crashing, "exit code 3"), (accepting, "accepted an invalid file")):
        p = subprocess.run([sys.executable, os.path.join(SUITE, "run.py"), "--only", *ids, "--", sys.executable, str(impl)],
                           capture_output=True, text=True)
        assert p.returncode == 1 and reason in p.stdout, p.stdout + p.stderr


def test_runner_judges_wrong_answers():
    with open(MANIFEST) as f:
        cases = {c["id"]: c for c in json.load(f)["cases"]}
    path = os.path.join(SUITE, cases["valid-base"]["file"])
    good = reference_reader.decode_file(path)
    assert run.judge(cases["valid-base"], good, "", set()).status == "passed"
    bad = json.loads(json.dumps(good))
    bad["tensors"]["w"]["sha256"] = "0" * 64
    assert "sha256" in run.judge(cases["valid-base"], bad, "", set()).reason
    bad = json.loads(json.dumps(good))
    bad["tree"]["$map"][0][0] = "renamed"
    assert "tree differs" in run.judge(cases["valid-base"], bad, "", set()).reason
    wrong_class = {"status": "error", "error": "format", "message": "x"}
    assert run.judge(cases["checksum-footer"], wrong_class, "", set()).status == "failed"
    assert run.judge(cases["chunk-raw-length-over-limit"], wrong_class, "", set()).status == "passed"  # also accepted


# -- the generator -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_generator_is_deterministic(tmp_path, manifest):
    ids = ["valid-base", "valid-tree", "valid-views", "valid-optional-frames", "truncated-at-00024", "checksum-chunk",
           "tree-depth-65"]
    zstd_same = manifest["generator"]["zstd"] == ".".join(map(str, __import__("zstandard").ZSTD_VERSION))
    if zstd_same:  # zstd bytes depend on the libzstd version the manifest records
        ids += ["valid-codec-zstd", "valid-codec-byteshuffle-zstd", "zstd-bomb-declared"]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gen_conformance.py"), "--out", str(tmp_path),
                        "--only", *ids], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    regenerated = json.loads((tmp_path / "manifest.json").read_text())["cases"]
    committed = {c["id"]: c for c in manifest["cases"]}
    assert sorted(c["id"] for c in regenerated) == sorted(ids)
    for case in regenerated:
        new = (tmp_path / case["file"]).read_bytes()
        with open(os.path.join(SUITE, case["file"]), "rb") as f:
            assert new == f.read(), f"{case['id']}: regenerated bytes differ from the committed file"
        assert case == committed[case["id"]]


@pytest.mark.slow
def test_clarification_cases_are_reproducible(tmp_path, manifest):
    """conformance/gen_clarifications.py (SPEC 1.1 second edition, 19.1) rebuilds its committed cases exactly."""
    import shutil

    (tmp_path / "files").mkdir()
    for cid in ("valid-base", "valid-typed-tree"):  # the committed files it starts from
        shutil.copy(os.path.join(SUITE, "files", f"{cid}.nvckpt"), tmp_path / "files")
    shutil.copy(MANIFEST, tmp_path / "manifest.json")
    p = subprocess.run([sys.executable, os.path.join(SUITE, "gen_clarifications.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    regenerated = json.loads((tmp_path / "manifest.json").read_text())["cases"]
    assert regenerated == manifest["cases"]  # every case already committed, none changed
    made = sorted(n for n in os.listdir(tmp_path / "files") if n not in ("valid-base.nvckpt", "valid-typed-tree.nvckpt"))
    assert len(made) >= 20
    if manifest["generator"]["zstd"] != ".".join(map(str, __import__("zstandard").ZSTD_VERSION)):
        zstd = {c["file"].removeprefix("files/") for c in manifest["cases"] if c["codec"] == "zstd"}
        made = [n for n in made if n not in zstd]  # zstd bytes depend on the libzstd version the manifest records
    for name in made:
        with open(os.path.join(SUITE, "files", name), "rb") as f:
            assert (tmp_path / "files" / name).read_bytes() == f.read(), name


# Valid cases whose bytes craft cannot give back: encodings a Python value does not keep (float 32, wide ints,
# other int encodings than the shortest) and an extension frame whose raw_length the rebuild fixes up.
CRAFT_NOT_BYTE_EXACT = {"valid-msgpack-wide", "valid-msgpack-float32", "valid-msgpack-float32-nan",
                        "valid-keys-distinct-across-types", "valid-metadata-edge-values", "valid-many-chunks",
                        "valid-extension-frame-raw-length"}


def test_craft_takes_apart_and_rebuilds_every_valid_case(manifest):
    """conformance/craft.py (what the generator and the fuzzers edit files with) gives back every valid case
    byte for byte: payloads unpack and repack unchanged, array and map keys under unknown keys and negative
    ext types included."""
    from conformance import craft

    rebuilt = set()
    for case in manifest["cases"]:
        if case["result"] != "valid" or case["id"] in CRAFT_NOT_BYTE_EXACT:
            continue
        with open(os.path.join(SUITE, case["file"]), "rb") as f:
            data = f.read()
        nv = craft.parse(data)
        for frame in nv.frames:
            if frame.frame_type in (craft.CODEC, craft.TENSOR, craft.INDEX):
                assert craft.pack(craft.unpack(frame.payload)) == frame.payload, (case["id"], frame.frame_type)
        assert craft.build(nv) == data, case["id"]
        rebuilt.add(case["id"])
    assert {"valid-unknown-key-keys-of-every-kind", "valid-non-str-keys-in-ignored-values"} <= rebuilt


def test_craft_keeps_keys_of_different_kinds_apart():
    """Array, ext and map keys that Python's tuple equality would merge (SPEC 1: keys of different kinds are
    never the same key) stay four keys."""
    from conformance import craft

    payload = (b"\x84" + b"\x92\x09\xc4\x01x\x00"  # [9, bin "x"]: 0
               + b"\xd4\x09x\x01"  # ext 9 "x": 1
               + b"\x81\xa1a\x01\x02"  # {"a": 1}: 2
               + b"\x91\x92\xa1a\x01\x03")  # [["a", 1]]: 3
    assert len(craft.unpack(payload)) == 4
    assert craft.pack(craft.unpack(payload)) == payload


# -- concurrent readers ------------------------------------------------------------------------------

def test_threads_share_one_open_file(manifest):
    """Many threads reading tensors and row slices of one open Checkpoint get exactly the expected bytes."""
    cases = {c["id"]: c for c in manifest["cases"]}
    for cid in ("valid-multichunk", "valid-codec-byteshuffle-zstd", "valid-views", "valid-derived-bf16"):
        case = cases[cid]
        expected = case["expected"]["tensors"]
        errors: list[str] = []
        with nvckpt.open(os.path.join(SUITE, case["file"])) as ck:
            names = [n for n in expected if n in ck.keys()]
            full = {n: ck.get_tensor(n) for n in names}
            barrier = threading.Barrier(8)

            def reader(k: int) -> None:
                try:
                    barrier.wait()
                    for r in range(12):
                        name = names[(k + r) % len(names)]
                        t = ck.get_tensor(name)
                        digest = hashlib.sha256(nvckpt_impl.raw_bytes(t)).hexdigest()
                        if digest != expected[name]["sha256"]:
                            errors.append(f"{cid}/{name}: thread {k} got different bytes")
                        if t.dim() and t.shape[0] > 2:
                            lo = (k + r) % (t.shape[0] - 1)
                            part = ck.get_slice(name)[lo:lo + 2]
                            if nvckpt_impl.raw_bytes(part) != nvckpt_impl.raw_bytes(full[name][lo:lo + 2]):
                                errors.append(f"{cid}/{name}: thread {k} rows {lo}:{lo + 2} differ")
                except Exception as exc:  # reported below, with the thread's name
                    errors.append(f"{cid}: thread {k}: {type(exc).__name__}: {exc}")

            threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert not errors, errors[:5]
