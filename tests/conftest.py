"""Shared test setup: a clean Horovod context around every test, and root-friendly Open MPI."""

from __future__ import annotations

import os

import pytest

# Open MPI refuses to run as root without these; CI runs as root.
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


@pytest.fixture(autouse=True)
def _horovod_shutdown():
    """Make sure no test leaves an engine running for the next one."""
    yield
    try:
        from horovod.common import basics

        basics.shutdown()
    except ImportError:
        pass
