"""float16 and bfloat16 reduced as themselves on MPI and Gloo: 16 bits handed to the transport,
values against float32 arithmetic, np=2 and np=3, every op, odd counts, in place and not.

At np=2 every op is one pairwise step, so the result is exactly ``round16(op(float32(a),
float32(b)))``; at np=3 the order of MPI's steps is MPI's, so values are checked within two
roundings of the exact float64 result and the bits are checked equal on every rank.
"""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _cases(expect_native: bool | None = True) -> list[str]:
    """``_checks`` with the transports' ``allreduce`` as they were afterwards (the body spies on
    them, in ranks that run other bodies after it). ``expect_native`` None: whatever Gloo reduces
    natively here (``_gloo_reduces``, asked in the rank)."""
    from horovod.common.backends import gloo as gloo_backend
    from horovod.common.backends import mpi as mpi_backend

    if expect_native is None:
        import torch

        dist = torch.distributed
        expect_native = gloo_backend._gloo_reduces(dist, dist.ProcessGroupGloo.create_default_device(),
                                                   torch.bfloat16)
    real = [(cls, cls.allreduce) for cls in (mpi_backend.MPIBackend, gloo_backend.GlooBackend)]
    try:
        return _checks(expect_native)
    finally:
        for cls, method in real:
            cls.allreduce = method


def _checks(expect_native: bool) -> list[str]:
    import zlib

    import ml_dtypes
    import numpy as np
    import torch

    import horovod.numpy as hvd
    import horovod.torch as htorch
    from horovod.common.backends import gloo as gloo_backend
    from horovod.common.backends import mpi as mpi_backend

    # Spy on the dtype every reduction hands to the transport.
    handed: list[str] = []
    for cls in (mpi_backend.MPIBackend, gloo_backend.GlooBackend):
        orig = cls.allreduce

        def spy(self, buf, op, group, src=None, _orig=orig):
            handed.append(buf.dtype.name)
            return _orig(self, buf, op, group, src)
        cls.allreduce = spy

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad: list[str] = []
    bf16 = np.dtype(ml_dtypes.bfloat16)
    ops = [("sum", hvd.Sum, np.add), ("average", hvd.Average, np.add), ("min", hvd.Min, np.minimum),
           ("max", hvd.Max, np.maximum), ("product", hvd.Product, np.multiply)]
    for dt, eps in ((np.dtype(np.float16), 2.0 ** -10), (bf16, 2.0 ** -7)):
        for count in (1, 7, 1001, 300_001):  # the last above the fusion cut and MPI's segments
            per_rank = []
            for k in range(n):
                rng = np.random.default_rng(1000 * k + count)
                # products of three stay in range; sums mix magnitudes (rounding matters)
                per_rank.append((rng.uniform(0.5, 2.0, count) * rng.choice([-1, 1], count)).astype(dt))
            wide = [x.astype(np.float64) for x in per_rank]
            for label, op, uf in ops:
                for inplace in (False, True):
                    name = f"{dt.name}.{count}.{label}.{int(inplace)}"
                    handed.clear()
                    x = per_rank[r].copy()
                    got = hvd.allreduce_(x, op=op, name=name) if inplace else hvd.allreduce(x, op=op, name=name)
                    if inplace and got is not x:
                        bad.append(f"rank {r}: {name}: in place returned another array")
                    if got.dtype != dt:
                        bad.append(f"rank {r}: {name}: dtype {got.dtype}")
                        continue
                    if expect_native and set(handed) != {dt.name}:
                        bad.append(f"rank {r}: {name}: the transport was handed {sorted(set(handed))}")
                    exact = wide[0]
                    for w in wide[1:]:
                        exact = uf(exact, w)
                    if label == "average":
                        exact = exact / n
                    g = got.astype(np.float64)
                    if n == 2:  # one pairwise step in float32, rounded once (then / 2, exact)
                        step = uf(per_rank[0].astype(np.float32), per_rank[1].astype(np.float32)).astype(dt)
                        want = step if label != "average" else (step.astype(np.float32) / 2).astype(dt)
                        if not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
                            i = int(np.nonzero(got.view(np.uint16) != want.view(np.uint16))[0][0])
                            bad.append(f"rank {r}: {name}: [{i}] = {g[i]}, want {float(want[i])}")
                    else:  # each pairwise step rounds once: within n roundings of the magnitudes
                        scale = sum(np.abs(w) for w in wide) if uf is np.add else np.abs(exact)
                        scale = scale / n if label == "average" else scale
                        err = np.abs(g - exact) - n * eps * scale
                        if (err > 0).any():
                            i = int(np.argmax(err))
                            bad.append(f"rank {r}: {name}: [{i}] = {g[i]}, exact {exact[i]}")
                    digest = hvd.allgather(np.array([zlib.crc32(got.tobytes())], np.int64), name=name + ".bits")
                    if len(set(digest.tolist())) != 1:
                        bad.append(f"rank {r}: {name}: ranks hold different bits")
    # torch: bfloat16 and float16 tensors, fp16 and bf16 compression, on the same transport
    htorch.init()
    for tdt in (torch.float16, torch.bfloat16):
        handed.clear()
        t = torch.full((1001,), 1.5 + r, dtype=tdt)
        out = htorch.allreduce_(t, op=htorch.Sum, name=f"torch.{tdt}")
        want = sum(1.5 + k for k in range(n))
        if out is not t or not torch.all(t.float() == want):
            bad.append(f"rank {r}: torch {tdt} -> {t[:3]}, want {want}")
        if expect_native and set(handed) != {str(tdt).replace("torch.", "")}:
            bad.append(f"rank {r}: torch {tdt}: the transport was handed {sorted(set(handed))}")
    for comp, wire in ((htorch.Compression.fp16, "float16"), (htorch.Compression.bf16, "bfloat16")):
        handed.clear()
        got = htorch.allreduce(torch.full((77,), 0.25 * (r + 1)), name=f"comp.{wire}", compression=comp)
        want = 0.25 * (n + 1) / 2
        if got.dtype != torch.float32 or not torch.allclose(got, torch.full((77,), want), rtol=1e-2):
            bad.append(f"rank {r}: {wire} compression -> {got[:3]}, want {want}")
        if expect_native and set(handed) != {wire}:
            bad.append(f"rank {r}: {wire} compression: the transport was handed {sorted(set(handed))}")
    # ``hvd.allreduce(compression=fp16/bf16)`` of a tensor without a gradient is narrowed in the
    # engine's fusion buffer (test_fused_compression.py): the same bits as compress / allreduce /
    # decompress done by hand.
    gen = torch.Generator().manual_seed(100 + r)
    for comp, wdt in ((htorch.Compression.fp16, torch.float16), (htorch.Compression.bf16, torch.bfloat16)):
        for op, pre, post in ((htorch.Average, 1.0, 1.0), (htorch.Sum, 0.5, 3.0)):
            x = torch.randn(4099, generator=gen)
            label = f"fused.{wdt}.{op}"
            ref = htorch.allreduce(x.to(wdt), name=label + ".ref", op=op, prescale_factor=pre,
                                   postscale_factor=post).to(torch.float32)
            for i in range(2):
                got = htorch.allreduce(x, name=f"{label}.{i}", op=op, prescale_factor=pre,
                                       postscale_factor=post, compression=comp)
                if got.dtype != torch.float32 or not torch.equal(got, ref):
                    at = int((got != ref).nonzero()[0, 0]) if got.shape == ref.shape else 0
                    bad.append(f"rank {r}: {label} call {i}: [{at}] = {got[at]}, by hand {ref[at]}")
        # with a gradient to carry, the differentiable path (and its gradient) as before
        x = torch.full((9,), 0.5 * (r + 1), requires_grad=True)
        y = htorch.allreduce(x, name=f"kept.grad.{wdt}", op=htorch.Sum, compression=comp)
        y.sum().backward()
        if not torch.allclose(y.detach(), torch.full((9,), 0.5 * n * (n + 1) / 2)) or x.grad is None:
            bad.append(f"rank {r}: {wdt} compression with a gradient -> {y[:3]}, grad {x.grad}")
    return bad


def _cases_gloo() -> list[str]:
    return _cases(expect_native=None)


# Parts of the torch launches at np=2 and np=3 that other modules share (tests/_shared_launch.py),
# on mpirun and on Gloo (horovodrun --gloo): the ranks start and import torch once for all of them.
_MPIRUN = {n: joint_launch("torch", n, {"half": _cases}, timeout=240) for n in (2, 3)}
_GLOO = {n: joint_launch("torch", n, {"half": _cases_gloo}, timeout=240, gloo=True) for n in (2, 3)}


@pytest.mark.parametrize("np_", [2, 3])
def test_half_reductions_mpi(np_):
    for bad in _MPIRUN[np_].results("half"):
        assert bad == []


@pytest.mark.parametrize("np_", [2, 3])
def test_half_reductions_gloo(np_):
    for bad in _GLOO[np_].results("half"):
        assert bad == []
