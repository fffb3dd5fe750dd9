"""The docs describe only what a user of the repository has: no path outside it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
OUTSIDE = re.compile(r"\.\./shared|(?<![\w.])/work/"
                     r"|(?<![\w/.])shared/(?:API|DESIGN|STYLE|BENCHMARKS|upstream|tools|bench)")


def test_docs_and_packaging_name_no_path_outside_the_repository() -> None:
    files = [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "pyproject.toml",
             *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "examples").rglob("*.md"))]
    bad = [f"{f.relative_to(REPO)}:{n}: {line.strip()[:120]}" for f in files if f.exists()
           for n, line in enumerate(f.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not bad, "paths outside the repository:\n" + "\n".join(bad)


def test_the_docs_index_lists_every_page() -> None:
    index = (REPO / "docs" / "README.md").read_text()
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md")
    missing = [p for p in pages if f"]({p})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"
    linked = re.findall(r"\]\(([\w.-]+\.md)\)", index)
    assert all((REPO / "docs" / p).exists() for p in linked), linked
