"""No deprecation message promises a removal in a release this package is already past (upstream's
"will be removed in v0.23.0" read as stale in a 0.30 package)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from horovod._version import __version__

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "horovod"
_REMOVAL = re.compile(r"removed in v?(\d+(?:\.\d+){1,2})", re.I)


def _version(text: str) -> tuple[int, ...]:
    parts = [int(p) for p in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_no_deprecation_names_a_release_already_past() -> None:
    current = _version(__version__)
    stale = [f"{p.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
             for p in sorted(PACKAGE.rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             for m in _REMOVAL.finditer(line) if _version(m.group(1)) <= current]
    assert not stale, f"deprecations that name a release before {__version__}: {stale}"


def test_the_check_finds_a_stale_version() -> None:
    assert _version("0.23.0") <= _version(__version__) < _version("1.0")
    assert _REMOVAL.search("and will be removed in v0.23.0.").group(1) == "0.23.0"  # type: ignore[union-attr]
