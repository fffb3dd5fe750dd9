"""The negotiation wire format between real ranks: a 161-tensor gradient set negotiated uncached
then from the cache, ragged allgathers, a grouped flat allreduce, and a mismatch named exactly."""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _step_and_errors():
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common.exceptions import CollectiveMismatchError

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    grads = [np.full(3 + i % 5, r + i, np.float32) for i in range(161)]
    for step in range(2):  # the first step negotiates every name, the second hits the cache
        handles = [hvd.allreduce_async(g, name=f"grad.layer{i}.weight", op=hvd.Sum) for i, g in enumerate(grads)]
        got = [hvd.synchronize(h) for h in handles]
        for i, v in enumerate(got):
            want = sum(q + i for q in range(n))
            assert v.shape == grads[i].shape and np.allclose(v, want), (step, i, v)
    flat = np.arange(12, dtype=np.float64) + r
    views = [flat[:5], flat[5:]]
    hvd.grouped_allreduce_(views, name="flat.group", op=hvd.Sum)
    assert np.allclose(flat, n * np.arange(12) + sum(range(n)))
    rows = hvd.allgather(np.full((r + 1, 2), r, np.int64), name="ragged")
    assert rows.shape == (n * (n + 1) // 2, 2) and rows[-1, 0] == n - 1
    try:
        hvd.allreduce(np.ones((2, 3 + (r == n - 1)), np.float32), name="odd.shape")
        out["error"] = None
    except CollectiveMismatchError as e:
        out["error"] = str(e)
        out["values"] = e.values
    # The engine goes on negotiating after the error.
    out["after"] = float(hvd.allreduce(np.ones(1), name="after", op=hvd.Sum)[0])
    return out


def test_wire_negotiation_on_three_real_ranks():
    results = _NP3.results("step_and_errors")
    for r, res in enumerate(results):
        assert res["after"] == 3.0, r
        assert res["values"] == {"(2, 3) float32": [0, 1], "(2, 4) float32": [2]}, (r, res)
        assert res["error"].startswith("Mismatched ALLREDUCE tensor shapes for allreduce 'allreduce.odd.shape'"), res
        assert "ranks [0, 1]: (2, 3) float32; rank 2: (2, 4) float32" in res["error"], res


# A part of the np=3 launch that the NumPy modules' plain-init bodies share (tests/_shared_launch.py),
# among the last (a mismatch on purpose).
_NP3 = joint_launch("numpy", 3, {"step_and_errors": _step_and_errors}, timeout=120, late=True)
