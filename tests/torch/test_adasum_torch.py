"""Adasum through horovod.torch on real ranks: allreduce values against the NumPy oracle, upstream's
rules (non-power-of-two worlds, process sets, predivide), and the delta optimizer against a
hand-computed reference (local step per rank, Adasum of the deltas), with accumulation and fp16
compression."""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch, own_init

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]


def _allreduce_cases():
    import numpy as np
    import torch

    import horovod.torch as hvd
    from horovod.common.engine.adasum import adasum_reference

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    rng = np.random.default_rng(7)
    shapes = [(5,), (3, 4), (1,), (257,), (2, 3, 5)]
    per_rank = [[rng.standard_normal(s) for s in shapes] for _ in range(n)]
    for dt, tdt, tol in [("float64", torch.float64, 1e-12), ("float32", torch.float32, 1e-6),
                         ("float16", torch.float16, 2e-3)]:
        ts = [torch.from_numpy(per_rank[r][i].astype(dt)) for i in range(len(shapes))]
        outs = [hvd.synchronize(h) for h in
                [hvd.allreduce_async(t, op=hvd.Adasum, name=f"a.{dt}.{i}") for i, t in enumerate(ts)]]
        grouped = hvd.grouped_allreduce([t.clone() for t in ts], op=hvd.Adasum, name=f"g.{dt}")
        inplace = [t.clone() for t in ts]
        for i, t in enumerate(inplace):
            hvd.allreduce_(t, op=hvd.Adasum, name=f"i.{dt}.{i}")
        for i in range(len(shapes)):
            want = adasum_reference([per_rank[k][i].astype(dt) for k in range(n)])
            for label, got in [("async", outs[i]), ("grouped", grouped[i]), ("inplace", inplace[i])]:
                if got.dtype != tdt or tuple(got.shape) != shapes[i]:
                    bad.append(f"rank {r}: {label} {dt} {shapes[i]} -> {got.dtype} {tuple(got.shape)}")
                elif not np.allclose(got.numpy().astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol):
                    bad.append(f"rank {r}: {label} {dt} {shapes[i]}: {got.numpy()} != {want}")
    # Orthogonal vectors add, parallel ones average (upstream's test_orthogonal / test_parallel on CPU).
    q, _ = np.linalg.qr(np.random.default_rng(3).standard_normal((64, n)))
    got = hvd.allreduce(torch.from_numpy(q[:, r].copy()), op=hvd.Adasum, name="orth").numpy()
    if not np.allclose(got, q.sum(axis=1), atol=1e-12):
        bad.append(f"rank {r}: orthogonal vectors did not add: {np.abs(got - q.sum(axis=1)).max()}")
    base = np.random.default_rng(4).standard_normal(64)
    scales = [1.0 + k for k in range(n)]
    got = hvd.allreduce(torch.from_numpy(base * scales[r]), op=hvd.Adasum, name="par").numpy()
    # Parallel a, c*a: the pair gives (a + c a)/2 exactly; the tree of equal-direction vectors averages.
    if not np.allclose(got, base * sum(scales) / n, rtol=1e-12):
        bad.append(f"rank {r}: parallel vectors did not average: {got[:3]} vs {base[:3] * sum(scales) / n}")
    # float16 at the edges of its range stays finite (upstream's test_stability_2 idea).
    big = torch.full((1024,), 200.0 * (r + 1), dtype=torch.float16)
    got = hvd.allreduce(big, op=hvd.Adasum, name="f16big")
    if not torch.isfinite(got).all() or not torch.allclose(got.float(), torch.full((1024,), 100.0 * (n + 1))):
        bad.append(f"rank {r}: float16 Adasum of parallel large values -> {got[:3]}")
    tiny = torch.full((64,), 1e-7 * (r + 1), dtype=torch.float16)
    got = hvd.allreduce(tiny, op=hvd.Adasum, name="f16tiny")
    if not torch.isfinite(got).all():
        bad.append(f"rank {r}: float16 Adasum of tiny values not finite: {got[:3]}")
    # Zero vectors: coefficients stay 1 (no division by zero).
    z = torch.zeros(8) if r == 0 else torch.ones(8)
    got = hvd.allreduce(z, op=hvd.Adasum, name="zero")
    if n == 2 and not torch.equal(got, torch.ones(8)):
        bad.append(f"rank {r}: zero + ones -> {got}")
    # Prescale and postscale around the reduction, as upstream.
    got = hvd.allreduce(torch.from_numpy(q[:, r].copy()), op=hvd.Adasum, prescale_factor=2.0,
                        postscale_factor=0.25, name="scaled").numpy()
    if not np.allclose(got, q.sum(axis=1) * 0.5, atol=1e-12):
        bad.append(f"rank {r}: pre/postscaled Adasum wrong")
    # Integers are refused on every rank.
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum, name="int")
        bad.append(f"rank {r}: int32 Adasum did not raise")
    except ValueError as exc:
        if "float16, float32 and float64" not in str(exc):
            bad.append(f"rank {r}: int32 Adasum error: {exc}")
    return bad


@pytest.mark.parametrize("np_", [2, 4])
def test_adasum_allreduce_values(np_):
    fails = (_NP2 if np_ == 2 else _NP4).results("allreduce")
    for bad in fails:
        assert bad == []


def _rules_cases():
    import torch

    import horovod.torch as hvd

    ps = hvd.ProcessSet([0, 1])
    hvd.init(process_sets=[ps])
    r, n = hvd.rank(), hvd.size()
    bad = []
    try:
        hvd.allreduce(torch.ones(4), op=hvd.Adasum, name="np3")
        bad.append(f"rank {r}: Adasum on {n} ranks did not raise")
    except NotImplementedError as exc:
        if "non-power of 2 ranks" not in str(exc):
            bad.append(f"rank {r}: wrong error {exc}")
    model = torch.nn.Linear(3, 2)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
        bad.append(f"rank {r}: DistributedOptimizer(op=Adasum) on {n} ranks did not raise")
    except NotImplementedError:
        pass
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
                                 gradient_predivide_factor=2.0)
        bad.append(f"rank {r}: predivide with Adasum did not raise")
    except ValueError as exc:
        if "op != Average" not in str(exc):
            bad.append(f"rank {r}: wrong predivide error {exc}")
    if r in (0, 1):
        try:
            hvd.allreduce(torch.ones(4), op=hvd.Adasum, process_set=ps, name="ps")
            bad.append(f"rank {r}: Adasum on a process set did not raise")
        except NotImplementedError as exc:
            if "non-global process sets" not in str(exc):
                bad.append(f"rank {r}: wrong error {exc}")
    # The engine keeps serving after the refused calls.
    if hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist() != [float(n)] * 2:
        bad.append(f"rank {r}: engine broken after Adasum errors")
    return bad


def test_adasum_rules_np3():
    for bad in _NP3.results("rules"):
        assert bad == []


def _optimizer_cases():
    import copy

    import numpy as np
    import torch

    import horovod.torch as hvd
    from horovod.common.engine.adasum import adasum_reference

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []

    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    g = torch.Generator().manual_seed(11)
    data = [[(torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]
            for _ in range(6)]

    def loss_fn(m, xy):
        return ((m(xy[0]) - xy[1]) ** 2).mean()

    configs = [("SGD", lambda p: torch.optim.SGD(p, lr=0.1), {}, 1),
               ("Adam", lambda p: torch.optim.Adam(p, lr=0.01), {}, 1),
               ("SGD momentum bpps=2", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                {"backward_passes_per_step": 2}, 2),
               ("SGD fp16", lambda p: torch.optim.SGD(p, lr=0.1), {"compression": hvd.Compression.fp16}, 1)]
    for label, make_opt, kw, passes in configs:
        model = make_model()
        opt = hvd.DistributedOptimizer(make_opt(model.parameters()), named_parameters=model.named_parameters(),
                                       op=hvd.Adasum, **kw)
        if type(opt).__name__ != type(make_opt(model.parameters())).__name__:
            bad.append(f"{label}: class renamed to {type(opt).__name__}")
        # Reference: every rank's model replica steps locally; the deltas are combined by Adasum.
        refs = [make_model() for _ in range(n)]
        ref_opts = [make_opt(m.parameters()) for m in refs]
        for step in range(0, 6, passes):
            for p_i in range(passes):
                loss_fn(model, data[step + p_i][r]).backward()
            opt.step()
            opt.zero_grad()
            starts = [copy.deepcopy(m.state_dict()) for m in refs]
            for k in range(n):
                for p_i in range(passes):
                    loss_fn(refs[k], data[step + p_i][k]).backward()
                ref_opts[k].step()
                ref_opts[k].zero_grad()
            for name, _ in refs[0].named_parameters():
                deltas = [(refs[k].state_dict()[name] - starts[k][name]).numpy() for k in range(n)]
                if "compression" in kw:
                    deltas = [d.astype(np.float16) for d in deltas]
                new = starts[0][name].numpy() + adasum_reference(deltas).astype(np.float32)
                for k in range(n):
                    refs[k].state_dict()[name].copy_(torch.from_numpy(new))
        tol = 2e-3 if "compression" in kw else 1e-5
        for (name, p), (_, q) in zip(model.named_parameters(), refs[0].named_parameters()):
            if not torch.allclose(p, q, atol=tol, rtol=tol):
                bad.append(f"rank {r}: {label}: {name} differs from the reference by "
                           f"{(p - q).abs().max().item():.3g}")
    # synchronize() is a no-op, skip_synchronize() is refused, as upstream.
    opt.synchronize()
    try:
        with opt.skip_synchronize():
            pass
        bad.append("skip_synchronize did not raise")
    except AssertionError as exc:
        if "Adasum" not in str(exc):
            bad.append(f"skip_synchronize: {exc}")
    return bad


def test_adasum_delta_optimizer_np2():
    # np=2 suffices here: the optimizer only calls the allreduce that test_adasum_allreduce_values
    # checks at np=4 (several VHDD levels).
    for bad in _NP2.results("optimizer"):
        assert bad == []


# The allreduce values and the optimizer are part of the np=2 launch shared with the other torch
# modules' plain-init bodies (tests/_shared_launch.py).
_NP2 = joint_launch("torch", 2, {"allreduce": _allreduce_cases, "optimizer": _optimizer_cases}, timeout=360)
# At np=4 a late part of the np=4 launch (after tests/torch/test_fully_shard_memory.py's live-tensor
# bounds, which tensors this body leaves behind must not enter).
_NP4 = joint_launch("torch", 4, {"allreduce": _allreduce_cases}, timeout=180, late=True)
# The rules at np=3 (a static process set): a late part of the np=3 launch, between shutdowns of
# its own (own_init).
_NP3 = joint_launch("torch", 3, {"rules": own_init(_rules_cases)}, timeout=120, late=True)
