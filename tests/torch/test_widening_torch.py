"""The torch binding widens nothing: bool and bfloat16 tensors reach the engine in their own dtype,
as zero-copy views (what crosses the wire is the engine's rule per transport,
``horovod.common.dtypes``), and come back in it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import horovod.torch as hvd
from horovod.torch import _convert


@pytest.mark.parametrize("dtype", [torch.bool, torch.bfloat16, torch.float16, torch.int16])
def test_tensors_reach_the_engine_as_views_of_their_own_dtype(dtype):
    t = torch.zeros(5, dtype=dtype)
    arr, back = _convert.to_engine(t, inplace=True)
    assert arr.dtype.name == str(dtype).replace("torch.", "")
    assert arr.__array_interface__["data"][0] == t.data_ptr()  # no copy
    assert back(arr) is t


def test_bool_and_bfloat16_round_trip_every_operation():
    hvd.init()
    try:
        b = torch.tensor([True, False, True])
        x = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
        assert hvd.allreduce(b, op=hvd.Sum).tolist() == [True, False, True]
        y = b.clone()
        hvd.allreduce_(y, op=hvd.Min)
        assert y.dtype == torch.bool and y.tolist() == [True, False, True]
        for out in (hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x), hvd.broadcast(x, 0),
                    hvd.alltoall(x)):
            assert out.dtype == torch.bfloat16 and torch.equal(out, x)
        rs = hvd.reducescatter(torch.ones(4, dtype=torch.bfloat16), op=hvd.Sum)
        assert rs.dtype == torch.bfloat16 and rs.tolist() == [1.0] * 4
        with pytest.raises(ValueError, match="not defined for bool"):
            hvd.allreduce(b)
        assert np.dtype(_convert._np_bfloat16()).name == "bfloat16"
    finally:
        hvd.shutdown()
