#!/usr/bin/env python3
"""Run the nvckpt conformance suite against an implementation.

    python3 conformance/run.py [options] -- IMPL_COMMAND...

The runner calls ``IMPL_COMMAND decode FILE [FILE...]``; the implementation
prints one JSON decode document per file, one per line, in order (see
conformance/README.md, "Writing the implementation command").  The runner
compares each with the manifest, prints a report table (passed, failed,
skipped by level and codec) and exits with 1 if any must-level case failed.

Examples:

    python3 conformance/run.py -- python3 conformance/reference_reader.py
    python3 conformance/run.py --reader streaming --stdin -- python3 conformance/reference_reader.py --streaming
    python3 conformance/run.py -- python3 conformance/adapters/nvckpt_impl.py
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
LEVELS = ("must", "should", "may")


@dataclass
class Outcome:
    case: dict
    status: str  # "passed", "failed", "skipped"
    reason: str = ""
    got: Any = None


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)

    def count(self, **where: str) -> dict[str, int]:
        out = {"passed": 0, "failed": 0, "skipped": 0}
        for o in self.outcomes:
            if all(self._key(o, k) == v for k, v in where.items()):
                out[o.status] += 1
        return out

    @staticmethod
    def _key(o: Outcome, k: str) -> str:
        return o.status if k == "status" else str(o.case[k])

    @property
    def must_failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed" and o.case["level"] == "must"]

    def table(self, title: str) -> str:
        """Markdown: passed/failed/skipped by level (valid and invalid files) and by codec."""
        lines = [f"**{title}**", "", "| level | files | passed | failed | skipped |", "|---|---|---:|---:|---:|"]
        for level in LEVELS:
            for result in ("valid", "invalid"):
                c = self.count(level=level, result=result)
                if sum(c.values()):
                    lines.append(f"| {level} | {result} | {c['passed']} | {c['failed']} | {c['skipped']} |")
        c = self.count()
        lines.append(f"| **all** | | **{c['passed']}** | **{c['failed']}** | **{c['skipped']}** |")
        lines += ["", "| codec | passed | failed | skipped |", "|---|---:|---:|---:|"]
        for codec in sorted({o.case["codec"] for o in self.outcomes}):
            c = self.count(codec=codec)
            lines.append(f"| {codec} | {c['passed']} | {c['failed']} | {c['skipped']} |")
        return "\n".join(lines)

    def failures(self) -> str:
        return "\n".join(f"FAILED {o.case['id']} ({o.case['level']}): {o.reason}"
                         for o in self.outcomes if o.status == "failed")


# --------------------------------------------------------------------------------------------
# Comparing a decode document with the manifest
# --------------------------------------------------------------------------------------------

def expected_tensor(exp: dict, capabilities: set[str]) -> dict:
    """A tensor needing a capability the implementation lacks must fail with unsupported-codec."""
    missing = [r for r in exp.get("requires", []) if r not in capabilities]
    if missing:
        return {"dtype": exp["dtype"], "shape": exp["shape"], "internal": exp.get("internal", False),
                "error": "unsupported-codec"}
    return exp


def check_valid(case: dict, doc: dict, capabilities: set[str]) -> str:
    """'' when ``doc`` is the expected decode, else why not."""
    if doc.get("status") != "ok":
        return f"rejected a valid file: {doc.get('error')}: {str(doc.get('message'))[:200]}"
    exp = case["expected"]
    got_tensors = doc.get("tensors")
    if not isinstance(got_tensors, dict):
        return "no 'tensors' object"
    if set(got_tensors) != set(exp["tensors"]):
        missing = sorted(set(exp["tensors"]) - set(got_tensors))[:5]
        extra = sorted(set(got_tensors) - set(exp["tensors"]))[:5]
        return f"tensor names differ: missing {missing}, unexpected {extra}"
    for name, want in exp["tensors"].items():
        want = expected_tensor(want, capabilities)
        got = got_tensors[name]
        for key in ("dtype", "shape"):
            if got.get(key) != want[key]:
                return f"tensor {name!r}: {key} {got.get(key)!r}, expected {want[key]!r}"
        if bool(got.get("internal", False)) != bool(want.get("internal", False)):
            return f"tensor {name!r}: internal {got.get('internal')!r}, expected {want.get('internal')!r}"
        if "error" in want:
            if got.get("error") != want["error"]:
                return f"tensor {name!r}: expected error {want['error']}, got {got.get('error') or 'a decoded tensor'}"
            continue
        if "error" in got:
            return f"tensor {name!r}: {got['error']}: {str(got.get('message'))[:200]}"
        for key in ("nbytes", "sha256"):
            if got.get(key) != want[key]:
                return f"tensor {name!r}: {key} {got.get(key)!r}, expected {want[key]!r}"
    for key in ("keys", "tree", "metadata"):
        if unordered_sets(doc.get(key)) != unordered_sets(exp[key]):
            return f"{key} differs: got {json.dumps(doc.get(key))[:300]}"
    return ""


def unordered_sets(node: Any) -> Any:
    """A decode-document value with the items of every "$set" / "$frozenset" sorted: a set has no order."""
    if isinstance(node, list):
        return [unordered_sets(x) for x in node]
    if isinstance(node, dict):
        out = {k: unordered_sets(v) for k, v in node.items()}
        for tag in ("$set", "$frozenset"):
            if isinstance(out.get(tag), list):
                out[tag] = sorted(out[tag], key=lambda x: json.dumps(x, sort_keys=True))
        return out
    return node


def check_invalid(case: dict, doc: dict) -> str:
    accepted = [case["error"]] + case.get("also_accepted", [])
    if doc.get("status") == "error":
        if doc.get("error") in accepted:
            return ""
        return f"rejected with {doc.get('error')}, expected {' or '.join(accepted)}: {str(doc.get('message'))[:200]}"
    errors = {n: t.get("error") for n, t in (doc.get("tensors") or {}).items() if t.get("error")}
    if any(e in accepted for e in errors.values()):
        return ""
    if errors:
        return f"tensor errors {errors}, expected {' or '.join(accepted)}"
    return f"accepted an invalid file (expected {' or '.join(accepted)})"


def judge(case: dict, doc: dict | None, problem: str, capabilities: set[str]) -> Outcome:
    if doc is None:
        return Outcome(case, "failed", problem or "no decode document")
    why = check_valid(case, doc, capabilities) if case["result"] == "valid" else check_invalid(case, doc)
    return Outcome(case, "failed" if why else "passed", why, doc)


def applicable(case: dict, reader: str) -> str:
    """'' when the case applies to this kind of reader, else why it is skipped."""
    if reader not in case.get("readers", ["random-access", "streaming"]):
        return f"only for {', '.join(case['readers'])} readers"
    return ""


# --------------------------------------------------------------------------------------------
# Driving an implementation
# --------------------------------------------------------------------------------------------

Decoder = Callable[[list[str]], list[tuple[dict | None, str]]]


def command_decoder(command: list[str], *, timeout: float, stdin: bool) -> Decoder:
    """Run ``command decode FILE...`` (or, with stdin, ``command decode -`` once per file)."""

    def one_stdin(path: str) -> tuple[dict | None, str]:
        with open(path, "rb") as f:
            try:
                p = subprocess.run(command + ["decode", "-"], stdin=f, capture_output=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                return None, f"timed out after {timeout} s"
        return _parse(p, 1)[0]

    def batch(paths: list[str]) -> list[tuple[dict | None, str]]:
        if stdin:
            return [one_stdin(p) for p in paths]
        try:
            p = subprocess.run(command + ["decode"] + paths, capture_output=True, timeout=timeout * len(paths))
        except subprocess.TimeoutExpired:
            p = None
        results = _parse(p, len(paths)) if p is not None else None
        if results is not None and all(doc is not None for doc, _ in results):
            return results
        if len(paths) == 1:
            return results or [(None, f"timed out after {timeout} s")]
        return [r for path in paths for r in batch([path])]  # find the file that broke the batch

    return batch


def _parse(p: subprocess.CompletedProcess, n: int) -> list[tuple[dict | None, str]]:
    lines = [line for line in p.stdout.decode("utf-8", "replace").splitlines() if line.strip()]
    err = p.stderr.decode("utf-8", "replace").strip().splitlines()
    tail = err[-1] if err else ""
    if p.returncode not in (0, 1):
        return [(None, f"exit code {p.returncode} (crash): {tail[:300]}")] * n
    out: list[tuple[dict | None, str]] = []
    for i in range(n):
        if i >= len(lines):
            out.append((None, f"no decode document printed: {tail[:300]}"))
            continue
        try:
            doc = json.loads(lines[i])
            out.append((doc, "") if isinstance(doc, dict) else (None, "decode document is not an object"))
        except json.JSONDecodeError:
            out.append((None, f"not JSON: {lines[i][:200]}"))
    return out


def run_suite(decoder: Decoder, *, manifest_path: str = os.path.join(HERE, "manifest.json"), reader: str = "random-access",
              capabilities: Iterable[str] = (), only: Iterable[str] | None = None, batch_size: int = 32,
              jobs: int = 1) -> Report:
    with open(manifest_path) as f:
        manifest = json.load(f)
    root = os.path.dirname(os.path.abspath(manifest_path))
    caps = set(capabilities)
    wanted = set(only) if only else None
    report = Report()
    todo: list[dict] = []
    for case in manifest["cases"]:
        if wanted is not None and case["id"] not in wanted:
            continue
        why = applicable(case, reader)
        if why:
            report.outcomes.append(Outcome(case, "skipped", why))
        else:
            todo.append(case)
    batches = [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]

    def run(batch: list[dict]) -> list[Outcome]:
        results = decoder([os.path.join(root, c["file"]) for c in batch])
        return [judge(c, doc, problem, caps) for c, (doc, problem) in zip(batch, results)]

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for outcomes in pool.map(run, batches):
            report.outcomes.extend(outcomes)
    order = {c["id"]: i for i, c in enumerate(manifest["cases"])}
    report.outcomes.sort(key=lambda o: order[o.case["id"]])
    return report


def _fenced(text: str) -> str:
    return "```\n" + text + "\n```"


def write_readme_report(key: str, body: str) -> None:
    """Put ``body`` between <!-- report:KEY:begin/end --> in the README's reports block (added if missing)."""
    path = os.path.join(HERE, "README.md")
    with open(path) as f:
        text = f.read()
    begin, end = f"<!-- report:{key}:begin -->", f"<!-- report:{key}:end -->"
    if begin not in text:
        anchor = "<!-- reports:end -->"
        text = text.replace(anchor, f"{begin}\n{end}\n\n{anchor}")
    i, j = text.index(begin) + len(begin), text.index(end)
    with open(path, "w") as f:
        f.write(text[:i] + "\n" + body + "\n" + text[j:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    i = argv.index("--")
    opts, command = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description="Run the nvckpt conformance suite against IMPL_COMMAND")
    ap.add_argument("--manifest", default=os.path.join(HERE, "manifest.json"))
    ap.add_argument("--reader", choices=("random-access", "streaming"), default="random-access",
                    help="the kind of reader the implementation is (cases for the other kind are skipped)")
    ap.add_argument("--with", dest="capabilities", action="append", default=[], metavar="CAPABILITY",
                    help="a capability the implementation has (nvcomp: decodes nvcomp-ans)")
    ap.add_argument("--stdin", action="store_true", help="give each file on stdin (IMPL decode -): proves no seeking")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per file")
    ap.add_argument("--batch", type=int, default=32, help="files per invocation")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", nargs="*", help="case ids to run")
    ap.add_argument("--title", default=None)
    ap.add_argument("--json", help="write every outcome to this JSON file")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every failure")
    ap.add_argument("--readme", metavar="KEY", help="also write the report into conformance/README.md (block KEY)")
    args = ap.parse_args(opts)
    if not command:
        ap.error("no IMPL_COMMAND after --")
    decoder = command_decoder(command, timeout=args.timeout, stdin=args.stdin)
    report = run_suite(decoder, manifest_path=args.manifest, reader=args.reader, capabilities=args.capabilities,
                       only=args.only, batch_size=args.batch, jobs=args.jobs)
    title = args.title or f"{shlex.join(command)} ({args.reader} reader{', with ' + ', '.join(args.capabilities) if args.capabilities else ''})"
    print(report.table(title))
    failures = report.failures()
    if failures:
        print()
        print(failures if args.verbose else "\n".join(failures.splitlines()[:40]))
    if args.readme:
        write_readme_report(args.readme, report.table(title) + ("\n\n" + _fenced(failures) if failures else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"id": o.case["id"], "status": o.status, "reason": o.reason} for o in report.outcomes], f, indent=1)
    return 1 if report.must_failures else 0


if __name__ == "__main__":
    sys.exit(main())
