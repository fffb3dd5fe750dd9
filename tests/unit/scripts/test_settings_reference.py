"""docs/settings.md names every HOROVOD_* variable the code reads, and nothing the code no longer has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
NAME = re.compile(r"HOROVOD_[A-Z0-9_]+")


def _code_names() -> set[str]:
    return {m for f in (REPO / "horovod").rglob("*.py") for m in NAME.findall(f.read_text())}


def _mentions(text: str, name: str) -> bool:
    # HOROVOD_ELASTIC is not mentioned by HOROVOD_ELASTIC_TIMEOUT; __HOROVOD_RANK_ERROR__ mentions
    # HOROVOD_RANK_ERROR__, and HOROVOD_GLOO_* the prefix HOROVOD_GLOO_.
    return re.search(rf"(?<![A-Z0-9]){re.escape(name)}(?![A-Z0-9_])", text) is not None


def test_every_horovod_variable_in_the_code_is_in_the_settings_reference() -> None:
    page = (REPO / "docs" / "settings.md").read_text()
    names = _code_names()
    assert len(names) > 40, f"found only {len(names)} HOROVOD_* names under horovod/"
    missing = sorted(n for n in names if not _mentions(page, n))
    assert not missing, ("docs/settings.md does not document these names the code reads: "
                         f"{missing}; add a row (default, meaning) to the table of their area")


def test_the_settings_reference_names_only_what_the_code_has() -> None:
    page = (REPO / "docs" / "settings.md").read_text()
    code = "\n".join(f.read_text() for f in (REPO / "horovod").rglob("*.py"))
    stale = sorted({n for n in NAME.findall(page) if not _mentions(code, n)})
    assert not stale, f"docs/settings.md documents names no code under horovod/ reads: {stale}"
