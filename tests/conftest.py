"""Shared test setup: a clean Horovod context around every test, and root-friendly Open MPI."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests._fakehosts import FakeHosts

_TESTS = Path(__file__).resolve().parent

# Open MPI refuses to run as root without these; CI runs as root.
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


def _fast(path: Path) -> bool:
    """The unit tier (one process, no launch): ``tests/unit`` and ``tests/*/test_*unit*.py``."""
    rel = path.resolve().relative_to(_TESTS)
    return rel.parts[0] == "unit" or "unit" in path.stem


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything outside the unit tier is ``slow`` (it launches ranks, jobs or clusters):
    ``pytest -m "not slow" tests`` is the everyday loop (CONTRIBUTING, "Test tiers")."""
    for item in items:
        path = Path(str(item.path))
        if _TESTS in path.resolve().parents and not _fast(path):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A skipped test of a tier whose ``HVD_TEST_REQUIRE_<TIER>=1`` is set fails (``tests/_require.py``)."""
    outcome = yield
    from tests._require import enforce

    enforce(item, outcome.get_result(), os.environ)  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A module of a required tier skipped while collected (``pytest.importorskip`` at its top)
    fails as well (``tests/_require.py``)."""
    outcome = yield
    from tests._require import enforce

    enforce(collector, outcome.get_result(), os.environ)  # type: ignore[attr-defined]


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """After ``--durations``: the shared launches' time per body (tests/_shared_launch.py), since
    the durations charge a whole launch to the first test that asks for it."""
    import sys

    shared = sys.modules.get("tests._shared_launch")
    if shared is None or not shared.LAUNCHED:
        return
    terminalreporter.write_sep("=", "shared launches: wall seconds, then each body's on its slowest rank")
    for launch in sorted(shared.LAUNCHED, key=lambda ln: -ln.seconds):
        total, bodies = launch.timings()
        parts = ", ".join(f"{name} {sec:.1f}" for sec, name in bodies) or "failed"
        terminalreporter.write_line(f"{total:7.1f}s {launch.label}: {parts}")


@pytest.fixture(autouse=True)
def _horovod_shutdown():
    """Make sure no test leaves an engine running for the next one."""
    yield
    try:
        from horovod.common import basics

        basics.shutdown()
    except ImportError:
        pass


@pytest.fixture
def fakehosts_factory() -> Iterator[Callable[..., FakeHosts]]:
    """``make(n, **kwargs)`` -> a ``tests/_fakehosts.py``'s ``FakeHosts``, closed after the test.

    Skips the test, with the reason, where this machine cannot make fake hosts (not root, no
    network namespaces, OpenSSH not installable).
    """
    from tests import _fakehosts as fakehosts

    reason = fakehosts.unavailable_reason()
    if reason:
        pytest.skip(reason)
    made: list[FakeHosts] = []

    def make(n: int, **kwargs: object) -> FakeHosts:
        fh = fakehosts.FakeHosts(n, **kwargs)  # type: ignore[arg-type]
        made.append(fh)
        return fh

    try:
        yield make
    finally:
        for fh in made:
            fh.close()
