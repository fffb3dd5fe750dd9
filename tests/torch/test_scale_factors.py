"""prescale_factor / postscale_factor on every dtype, under mpirun and the Gloo launcher (np=2, 3).

Upstream's definition on the CPU: integers are scaled in float64 and truncated back to the
integer type, float16 is scaled in float32 math (factor rounded to float32), other floats in
their own precision. Both transports sum float16 as float16 (MPI through its user-defined
operations), so the float16 rule must hold for the scaling step itself, not only for a widened path. Also the
reducescatter gradient: ``allgather(grad)``, times the set size for Sum, times both factors.
"""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]

NPS = [2, 3]


def _scaled_cases():
    import numpy as np
    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    rng = np.random.default_rng(1234)

    def same(got, want):
        if got.dtype != want.dtype:
            return False
        if got.dtype == torch.float16 and n > 2:
            # Three or more float16 terms: rounded after each pairwise sum (MPI, as upstream) or
            # summed in float32 and rounded once (Gloo's large buffers): within one ulp.
            return torch.allclose(got.float(), want.float(), rtol=2.0 ** -10, atol=0.0)
        return torch.equal(got, want)
    for dt in [torch.int32, torch.int64, torch.float16, torch.float32, torch.float64]:
        for shape in [(4 * n,), (4 * n, 3)]:
            factor = float(rng.uniform())
            base = torch.arange(int(np.prod(shape)), dtype=torch.float32).reshape(shape) % 23 - 11
            x = base.to(dt)  # the same on every rank: the sum is size * (scaled x)
            if dt.is_floating_point:
                work = torch.float32 if dt == torch.float16 else dt
                pre_expected = (x.to(work) * torch.tensor(factor, dtype=work)).to(dt).to(work) * n
                post_expected = (x.to(work) * n) * torch.tensor(factor, dtype=work)
            else:
                pre_expected = (x.double() * factor).to(dt).double() * n
                post_expected = (x.double() * n) * factor
            for label, kwargs, want in [("prescale", {"prescale_factor": factor}, pre_expected),
                                        ("postscale", {"postscale_factor": factor}, post_expected)]:
                want = want.to(dt)
                got = hvd.allreduce(x, op=hvd.Sum, name=f"ar.{label}.{dt}.{shape}", **kwargs)
                if not same(got, want):
                    bad.append(f"rank {r}: allreduce {label} {dt} {shape}: {got.flatten()[:6].tolist()} "
                               f"!= {want.flatten()[:6].tolist()}")
                got = hvd.reducescatter(x, op=hvd.Sum, name=f"rs.{label}.{dt}.{shape}", **kwargs)
                mine = want[4 * r:4 * (r + 1)]
                if not same(got, mine):
                    bad.append(f"rank {r}: reducescatter {label} {dt} {shape}: {got.flatten()[:6].tolist()} "
                               f"!= {mine.flatten()[:6].tolist()}")
                outs = hvd.grouped_reducescatter([x, x], op=hvd.Sum, name=f"grs.{label}.{dt}.{shape}", **kwargs)
                if any(not same(o, mine) for o in outs):
                    bad.append(f"rank {r}: grouped_reducescatter {label} {dt} {shape}: {outs[0].flatten()[:6]}")
    # the reducescatter gradient, with factors
    for op, size_factor in [(hvd.Sum, n), (hvd.Average, 1)]:
        x = torch.ones(2 * n, 3, requires_grad=True)
        y = hvd.reducescatter(x, op=op, prescale_factor=2.0, postscale_factor=3.0, name=f"g.rs.{int(op)}")
        y.backward(torch.full((2, 3), r + 1.0))
        want = torch.cat([torch.full((2, 3), (k + 1.0) * size_factor * 6.0) for k in range(n)])
        if not torch.equal(x.grad, want):
            bad.append(f"rank {r}: reducescatter gradient op={int(op)} with factors: {x.grad[:, 0].tolist()} "
                       f"!= {want[:, 0].tolist()}")
    return bad


@pytest.mark.parametrize("np_", NPS)
@pytest.mark.parametrize("launcher", ["mpirun", "gloo"])
def test_scale_factors_follow_upstream_rounding(np_, launcher):
    fails = (_GLOO if launcher == "gloo" else _MPIRUN)[np_].results("scaled")
    assert not any(fails), "\n".join(f for per_rank in fails for f in per_rank)


# The body is part of the launch per world size (and launcher) shared with the other torch modules'
# plain-init bodies (tests/_shared_launch.py).
_MPIRUN = {n: joint_launch("torch", n, {"scaled": _scaled_cases}, timeout=180) for n in NPS}
_GLOO = {n: joint_launch("torch", n, {"scaled": _scaled_cases}, timeout=180, gloo=True) for n in NPS}
