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


# --- user docs read like a manual: no machine paths, no issue numbers, no dead links ---------------

MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:tmp|work|root)/")
ISSUE = re.compile(r"\b(?:issue|pr|pull request)s?\s+#?\d+|(?<![\w&/])#\d+\b", re.I)
UPSTREAM_REF = re.compile(r"upstream(?:'s)?\s+(?:horovod\s+)?(?:issue\s+|pr\s+)?$|horovod/horovod\S*$", re.I)
HISTORY = re.compile(r"this session|the issue measured|other engineers|\blanded tree|\bAPI\.md\b", re.I)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _user_docs() -> list[Path]:
    pages = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]
    return [p for p in pages if p.exists()]


def _lines(path: Path):
    fenced = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        yield n, line, fenced
        if line.lstrip().startswith("```"):
            fenced = not fenced


def test_user_docs_name_no_machine_path_issue_number_or_development_history() -> None:
    bad = []
    for f in _user_docs():
        for n, line, _ in _lines(f):
            where = f"{f.relative_to(REPO)}:{n}"
            if MACHINE_PATH.search(line):
                bad.append(f"{where}: machine path: {line.strip()[:100]}")
            for m in ISSUE.finditer(line):
                if not UPSTREAM_REF.search(line[:m.start()][-40:]):
                    bad.append(f"{where}: issue number {m.group(0)!r}: {line.strip()[:100]}")
            if HISTORY.search(line):
                bad.append(f"{where}: development history: {line.strip()[:100]}")
    assert not bad, "user docs must read like a manual:\n" + "\n".join(bad)


def test_user_docs_link_only_to_files_that_exist() -> None:
    dead = []
    for f in _user_docs():
        for n, line, fenced in _lines(f):
            if fenced:
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue
                path = (f.parent / target.split("#", 1)[0]).resolve()
                if not path.exists():
                    dead.append(f"{f.relative_to(REPO)}:{n}: {target}")
    assert not dead, "links to files that do not exist:\n" + "\n".join(dead)


@pytest.mark.parametrize("text, flagged", [
    ("see issue 26 for details", True), ("fixed in #26.", True), ("as upstream #603 does", False),
    ("upstream issue #1234", False), ("written to /tmp/timeline.json", True), ("`hvd.rank()`", False),
    ("(#estimators-fitdataframe)", False), ("the issue measured 1.38 ms", True), ("a ./tmp/ dir", False),
])
def test_the_docs_checks_flag_what_they_should(text: str, flagged: bool) -> None:
    hits = bool(MACHINE_PATH.search(text) or HISTORY.search(text)
                or any(not UPSTREAM_REF.search(text[:m.start()][-40:]) for m in ISSUE.finditer(text)))
    assert hits == flagged, text
