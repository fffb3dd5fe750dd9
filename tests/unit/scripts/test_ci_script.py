"""``.ci/run`` and the README agree: it runs the README's test command, each of its parts in order,
after the static checks that CONTRIBUTING.md lists, and stops at the first that fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._ci_record import RECORD, passed_before_the_suite

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


def test_ci_names_the_import_rules_record_to_the_suite() -> None:
    """The import rules run once under .ci/run: its static step writes their junit XML, named after
    the checkout, and exports it as HVD_TEST_IMPORT_RULES_PASSED after they passed (``set -e``);
    tests/_ci_record.py then skips them in the suite."""
    commands = _commands((REPO / ".ci" / "run").read_text())
    rules = next(i for i, c in enumerate(commands)
                 if "test_import_cycles.py" in c and "test_import_side_effects.py" in c)
    record = re.search(r'--junitxml="?(\$\w+/[\w.]+)"?', commands[rules])
    assert record and '-o junit_suite_name="$PWD"' in commands[rules], commands[rules]
    exports = [i for i, c in enumerate(commands) if c == f'export {RECORD}="{record.group(1)}"']
    assert exports and rules < exports[0] < commands.index("python -m pytest -q tests"), (
        f".ci/run does not export {RECORD}={record.group(1)} after the import rules and before the suite")


def _fake_checkout(root: Path) -> Path:
    for source in ("horovod/__init__.py", "tests/unit/test_import_cycles.py", "tests/unit/test_import_side_effects.py",
                   "tests/_ci_record.py", "pyproject.toml"):
        (root / source).parent.mkdir(parents=True, exist_ok=True)
        (root / source).write_text("")
        os.utime(root / source, (1_000_000, 1_000_000))  # written "in 1970", before any record
    return root


def test_the_import_rules_are_skipped_only_where_a_fresh_record_of_this_checkout_shows_them_passed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record written by pytest itself (the junit XML .ci/run writes), read for each of its tests."""
    checkout = _fake_checkout(tmp_path / "checkout")
    (checkout / "tests" / "unit" / "test_rules.py").write_text(
        "import pytest\ndef test_ok(): pass\ndef test_bad(): assert False\n"
        "@pytest.mark.parametrize('n', [1])\ndef test_param(n): pass\n"
        "def test_skipped(): pytest.skip('no')\n")
    record = tmp_path / "passed.xml"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={record}",
                          "-o", f"junit_suite_name={checkout}", "tests/unit/test_rules.py"],
                         cwd=checkout, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "1 failed, 2 passed, 1 skipped" in out.stdout, out.stdout[-2000:]
    node = "tests/unit/test_rules.py::"
    monkeypatch.delenv(RECORD, raising=False)
    assert passed_before_the_suite(node + "test_ok", checkout) is None  # the plain pytest run: it runs
    monkeypatch.setenv(RECORD, str(record))
    for passed in ("test_ok", "test_param[1]"):
        reason = passed_before_the_suite(node + passed, checkout)
        assert reason and f"{RECORD}={record} records {node + passed} passed" in reason, reason
    for not_passed in ("test_bad", "test_skipped", "test_absent"):
        assert passed_before_the_suite(node + not_passed, checkout) is None, not_passed
    assert passed_before_the_suite(node + "test_ok", _fake_checkout(tmp_path / "other")) is None  # another checkout
    os.utime(checkout / "horovod" / "__init__.py")  # changed after the record: check the tree as it is now
    os.utime(record, ns=(record.stat().st_atime_ns, checkout.joinpath("horovod", "__init__.py").stat().st_mtime_ns))
    assert passed_before_the_suite(node + "test_ok", checkout) is None
    monkeypatch.setenv(RECORD, str(tmp_path / "absent.xml"))
    with pytest.raises(AssertionError, match="names no file"):
        passed_before_the_suite(node + "test_ok", checkout)
