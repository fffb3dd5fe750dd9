"""``.ci/run`` and the README agree: it runs the README's test command, each of its parts in order,
after the static checks that CONTRIBUTING.md lists, and stops at the first that fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def _commands(script: str) -> list[str]:
    """The commands of a bash script, one per line, comments and blank lines left out."""
    lines = [ln.split(" #", 1)[0].strip() for ln in script.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def _readme_test_command() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    found = [ln.strip() for b in blocks for ln in b.splitlines() if "pytest" in ln and "constraints" in ln]
    assert len(found) == 1, f"the README shows one install-and-test command, found {found}"
    return found[0]


def test_ci_runs_the_readme_test_command_in_order_and_stops_at_a_failure() -> None:
    script = (REPO / ".ci" / "run").read_text()
    assert "set -euo pipefail" in script  # any failing step fails the run
    commands = _commands(script)
    parts = [p.strip() for p in _readme_test_command().split("&&")]
    at = [commands.index(p) if p in commands else -1 for p in parts]
    assert -1 not in at and at == sorted(at), (
        f"the README's test command {parts} must be in .ci/run, in order, each on a line of its own")
    assert commands[-1] == parts[-1], "the README's tests are .ci/run's last step (its exit status)"


def test_ci_runs_the_static_checks_before_the_tests() -> None:
    commands = _commands((REPO / ".ci" / "run").read_text())
    tests_at = commands.index(_readme_test_command().split("&&")[-1].strip())
    setup = re.search(r"## Set up\n\n```bash\n(.*?)```", (REPO / "CONTRIBUTING.md").read_text(), re.S)
    assert setup, "CONTRIBUTING.md has a 'Set up' block"
    install = [p.strip() for p in _readme_test_command().split("&&")][:-1]  # the README's install steps
    checks = [c for c in _commands(setup.group(1)) if c not in install and not c.startswith("pip install")]
    assert {c.split()[0] for c in checks} == {"ruff", "mypy", "mkdocs"}, checks
    for check in checks:
        found = [i for i, c in enumerate(commands) if check in c]
        assert found and found[0] < tests_at, f".ci/run does not run {check!r} before the tests"
    rules = [i for i, c in enumerate(commands) if "test_import_cycles.py" in c and "test_import_side_effects.py" in c]
    assert rules and rules[0] < tests_at, ".ci/run does not run the import-rule tests before the suite"
    site = next(c for c in commands if "mkdocs build" in c)
    assert re.search(r"-d \"?\$\w+", site), "the site is built into a temporary directory, not the tree"
