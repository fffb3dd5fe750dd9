"""Shared test setup: a clean Horovod context around every test, and root-friendly Open MPI."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests._fakehosts import FakeHosts

# Open MPI refuses to run as root without these; CI runs as root.
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A skipped test of a tier whose ``HVD_TEST_REQUIRE_<TIER>=1`` is set fails (``tests/_require.py``)."""
    outcome = yield
    from tests._require import enforce

    enforce(item, outcome.get_result(), os.environ)  # type: ignore[attr-defined]


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
