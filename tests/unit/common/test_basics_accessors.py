"""The topology accessors (``hvd.size()``, ``hvd.rank()``...) that ``horovod.common.basics`` builds
from one factory read like the functions they replace: name, docstring, signature, errors, values."""

from __future__ import annotations

import inspect
import pickle

import pytest

import horovod.numpy as hvd
from horovod.common import basics
from horovod.common.context import get_context
from horovod.common.exceptions import NotInitializedError

FIELDS = ("size", "rank", "local_size", "local_rank", "cross_size", "cross_rank")


@pytest.mark.parametrize("field", FIELDS)
def test_accessor_is_named_documented_and_typed(field: str) -> None:
    fn = getattr(basics, field)
    assert (fn.__name__, fn.__qualname__, fn.__module__) == (field, field, "horovod.common.basics")
    assert fn.__doc__ and fn.__doc__.endswith(".")
    sig = inspect.signature(fn)
    assert not sig.parameters and sig.return_annotation in (int, "int")
    assert pickle.loads(pickle.dumps(fn)) is fn
    assert getattr(hvd, field) is fn  # what the bindings re-export


def test_accessors_need_init_then_read_this_ranks_topology() -> None:
    hvd.shutdown()
    for field in FIELDS:
        with pytest.raises(NotInitializedError):
            getattr(basics, field)()
    hvd.init()
    topology = get_context().topology
    got = {field: getattr(hvd, field)() for field in FIELDS}
    assert got == {field: getattr(topology, field) for field in FIELDS}
    assert got["size"] == 1 and got["rank"] == 0 and all(type(v) is int for v in got.values())
