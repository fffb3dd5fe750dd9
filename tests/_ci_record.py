"""The import-rule tests (``tests/unit/test_import_cycles.py``, ``test_import_side_effects.py``) run
once under ``.ci/run``: its static step runs them before the suite with ``--junitxml`` and names that
record to the suite (``HVD_TEST_IMPORT_RULES_PASSED``). The suite then skips a test of theirs only
where the record shows that very test passed, in this checkout, after the last change to anything
it reads (``horovod/``, the two test files, this file, ``pyproject.toml``); the skip names the
record. Without the variable (the README's plain ``python -m pytest -q tests``), or with a record
that is stale, from another checkout or without the test passing, the test runs."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECORD = "HVD_TEST_IMPORT_RULES_PASSED"


def sources(repo: Path = REPO) -> list[Path]:
    """What the import rules read of the tree."""
    return [*(repo / "horovod").rglob("*.py"), repo / "tests" / "unit" / "test_import_cycles.py",
            repo / "tests" / "unit" / "test_import_side_effects.py", repo / "tests" / "_ci_record.py",
            repo / "pyproject.toml"]


def _address(nodeid: str) -> tuple[str, str]:
    """The (classname, name) that pytest's junit XML gives the test ``nodeid``."""
    names = nodeid.split("::")
    names[0] = names[0].replace("/", ".").removesuffix(".py")
    return ".".join(names[:-1]), names[-1]


def passed_before_the_suite(nodeid: str, repo: Path = REPO) -> str | None:
    """Why the test ``nodeid`` need not run again (the skip's reason), or None where it must run."""
    given = os.environ.get(RECORD)
    if not given:
        return None
    record = Path(given)
    assert record.is_file(), f"{RECORD}={given} names no file (.ci/run's --junitxml of the import rules)"
    root = ET.parse(record).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    classname, name = _address(nodeid)
    for suite in suites:
        if Path(suite.get("name", "")).resolve() != repo.resolve():
            continue  # another checkout's record (.ci/run names its suite after the checkout)
        for case in suite.iter("testcase"):
            if (case.get("classname"), case.get("name")) != (classname, name):
                continue
            if len(case):  # a <failure>, <error> or <skipped> child: it did not pass
                return None
            written = record.stat().st_mtime_ns
            if any(p.is_file() and p.stat().st_mtime_ns >= written for p in sources(repo)):
                return None  # a source changed after the record: check the tree as it is now
            return (f"passed in .ci/run's static step before the suite, on this tree as it is now "
                    f"({RECORD}={given} records {nodeid} passed after the last change to horovod/ and "
                    f"the import-rule tests); unset {RECORD} to run it again")
    return None


@pytest.fixture
def once_under_ci(request: pytest.FixtureRequest) -> None:
    """Under .ci/run, skip a test its static step already ran and passed on this tree (above)."""
    reason = passed_before_the_suite(request.node.nodeid)
    if reason:
        pytest.skip(reason)
