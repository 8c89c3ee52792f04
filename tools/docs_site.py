"""MkDocs hooks of the documentation site (mkdocs.yml): the repository's own documents become pages.

SPEC.md, CHANGELOG.md, the conformance suite's README and benchmarks/results/ are not copied into docs/:
they join the site at their repository paths, so their own relative links keep working, and a docs/ page
links to them as it does on a repository browser (``../SPEC.md``), rewritten here to the site's path.
"""

from __future__ import annotations

import glob
import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ["SPEC.md", "CHANGELOG.md", "conformance/README.md"]
RESULTS = "benchmarks/results"
_LINK = re.compile(r"\]\(((?:\.\./)+)")


def repository_documents() -> list[str]:
    """The repository paths that join the site: the documents above and every benchmark result."""
    results = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, RESULTS, "*")) if os.path.isfile(p))
    return DOCUMENTS + results


def on_files(files, config):
    for rel in repository_documents():
        files.append(File.generated(config, rel, abs_src_path=os.path.join(ROOT, rel)))
    return files


def on_page_markdown(markdown, page, config, files):
    # docs/ is one level below the repository root: a link that climbs out of docs/ (../SPEC.md from
    # docs/x.md, ../../SPEC.md from docs/reference/x.md) climbs one level less on the site.
    docs_dir = os.path.abspath(config["docs_dir"])
    if not page.file.abs_src_path or not os.path.abspath(page.file.abs_src_path).startswith(docs_dir + os.sep):
        return markdown
    depth = page.file.src_uri.count("/")

    def climb(match: re.Match) -> str:
        ups = match.group(1).count("../")
        return "](" + "../" * (ups - 1 if ups == depth + 1 else ups)

    return _LINK.sub(climb, markdown)
