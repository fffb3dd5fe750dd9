"""Fixtures of the one-process torch tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def hv() -> Iterator[Any]:
    """``horovod.torch``, initialized as a job of one for the test, shut down after it."""
    import horovod.torch as hvd

    hvd.init()
    yield hvd
    hvd.shutdown()
