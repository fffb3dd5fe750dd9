"""Argument checks of horovod.common.collectives at size 1 (plain python, local backend)."""

from __future__ import annotations

import numpy as np
import pytest

import horovod.numpy as hvd
from horovod.common import collectives as C


@pytest.fixture(autouse=True)
def _init():
    hvd.init()
    yield


def test_allreduce_writes_into_given_outputs_and_keeps_inputs():
    xs = [np.arange(5, dtype=np.float32), np.arange(100_000, dtype=np.float32)]
    outs = [np.empty_like(x) for x in xs]
    got = C.allreduce_async(xs, name="out_ok", grouped=True, out=outs).wait()
    assert got[0] is outs[0] and got[1] is outs[1]
    np.testing.assert_array_equal(outs[1], np.arange(100_000, dtype=np.float32))
    np.testing.assert_array_equal(xs[0], np.arange(5, dtype=np.float32))


@pytest.mark.parametrize("bad, match", [
    ([np.empty(4, np.float32)], "2 inputs but 1 output"),
    ([np.empty(4, np.float32), np.empty(3, np.float32)], r"output 1 must be .* shape \(4,\)"),
    ([np.empty(4, np.float32), np.empty(4, np.float64)], "output 1 must be a writeable C-contiguous float32"),
    ([np.empty(4, np.float32), np.empty(8, np.float32)[::2]], "output 1 must be"),
])
def test_allreduce_rejects_outputs_that_do_not_match(bad, match):
    xs = [np.ones(4, np.float32), np.ones(4, np.float32)]
    with pytest.raises(ValueError, match=match):
        C.allreduce_async(xs, name="out_bad", grouped=True, out=bad)
    with pytest.raises(ValueError, match="either inplace=True or out="):
        C.allreduce_async(xs, name="out_both", grouped=True, out=xs, inplace=True)
    # nothing was left in flight: the same name works at once
    assert len(C.allreduce_async(xs, name="out_bad", grouped=True).wait()) == 2
