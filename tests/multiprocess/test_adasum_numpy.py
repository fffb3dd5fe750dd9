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
