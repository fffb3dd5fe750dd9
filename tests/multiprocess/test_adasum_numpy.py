"""Adasum through horovod.numpy on both transports (mpirun and Gloo), np=2 and 4: fused batches of
mixed sizes against the NumPy oracle, identical bits on every rank."""

from __future__ import annotations

import sys

import pytest

from horovod.testing import run_ranks
from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _cases():
    import zlib

    import numpy as np

    import horovod.numpy as hvd
    from horovod.common.engine.adasum import adasum_reference

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    rng = np.random.default_rng(9)
    shapes = [(1,), (13,), (4, 4), (300_000,)]  # the last one is above the fusion cut
    per_rank = [[rng.standard_normal(s) for s in shapes] for _ in range(n)]
    for dt in ("float32", "float64"):
        hs = [hvd.allreduce_async(per_rank[r][i].astype(dt), op=hvd.Adasum, name=f"{dt}.{i}")
              for i in range(len(shapes))]
        for i, h in enumerate(hs):
            got = hvd.synchronize(h)
            want = adasum_reference([per_rank[k][i].astype(dt) for k in range(n)])
            if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
                bad.append(f"rank {r}: {dt} tensor {i}: max error {np.abs(got - want).max()}")
            digest = hvd.allgather(np.array([zlib.crc32(got.tobytes())], np.int64), name=f"bits.{dt}.{i}")
            if len(set(digest.tolist())) != 1:
                bad.append(f"rank {r}: {dt} tensor {i}: ranks hold different bits")
    return bad


@pytest.mark.parametrize("np_,launcher", [(2, "mpirun"), (4, "mpirun"), (4, "gloo")])
def test_adasum_numpy_both_transports(np_, launcher):
    gloo = [sys.executable, "-m", "horovod.runner", "--gloo", "-np", str(np_)]
    if (np_, launcher) == (2, "mpirun"):
        results = _NP2.results("cases")
    else:
        results = run_ranks(_cases, np=np_, timeout=180, launcher=gloo if launcher == "gloo" else None)
    for bad in results:
        assert bad == []


# np=2 under mpirun: a part of the launch that the NumPy modules' plain-init bodies share
# (tests/_shared_launch.py); np=4 and the Gloo launcher keep launches of their own.
_NP2 = joint_launch("numpy", 2, {"cases": _cases}, timeout=180)


def _joined():
    import numpy as np

    import horovod.numpy as hvd
    from horovod.common.engine.adasum import adasum_reference

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(5)
    shapes = [(7,), (3, 5), (1000,)]
    per_rank = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(n)]
    bad = []
    if r == n - 1:  # joins at once: takes part in the others' Adasum with zeros
        last = hvd.join()
        if last == r:
            bad.append(f"rank {r}: joined first but was reported as the last to join")
        return bad
    pre, post = 0.5, 2.0
    hs = [hvd.allreduce_async(per_rank[r][i], op=hvd.Adasum, name=f"j.{i}", prescale_factor=pre,
                              postscale_factor=post) for i in range(len(shapes))]
    for i, h in enumerate(hs):
        got = hvd.synchronize(h)
        vecs = [per_rank[k][i].astype(np.float64) * pre for k in range(n - 1)]
        want = adasum_reference(vecs + [np.zeros(shapes[i])]) * post
        if got.dtype != np.float32 or not np.allclose(got, want, rtol=1e-5, atol=1e-6):
            bad.append(f"rank {r}: tensor {i} with rank {n - 1} joined: max error "
                       f"{np.abs(got.astype(np.float64) - want).max()}")
    hvd.join()
    return bad


def test_adasum_with_a_joined_rank_is_the_formula_with_its_zeros():
    """np=4, rank 3 joined: the other ranks' fused Adasum (prescaled, postscaled) is the formula
    over their vectors and a zero one, as the executor's lane gives a joined rank's zeros."""
    for bad in run_ranks(_joined, np=4, timeout=180):
        assert bad == []
