"""The torch device plane (the GPU path) on real ranks, through its CPU twin on torch.distributed Gloo.

``HOROVOD_TORCH_CPU_PLANE=1`` routes CPU torch tensors through the same plane that runs CUDA tensors
on NCCL: device-resident fusion, per-process-set process groups, ordering hooks (no-ops on CPU),
join zeros, error paths. Only the CUDA calls differ (those run in tests/gpu on a GPU machine).
Each rank body runs every case of a family and returns its failures, so one launch reports them all.
"""

from __future__ import annotations

import pytest

from horovod.testing import run_ranks
from tests._shared_launch import JOINT_TIMEOUT, joint_launch, own_init, run_as_main

pytestmark = pytest.mark.multiprocess

TWIN = {"HOROVOD_TORCH_CPU_PLANE": "1"}
NPS = [2, 3]


def _plane_ran() -> bool:
    from horovod.common.context import get_context

    planes = get_context().engine._executor.planes._planes
    return "torch" in planes and bool(planes["torch"]._transports)


def _collective_cases():
    import torch

    import horovod.torch as hvd

    hvd.init(process_sets="dynamic")
    r, n = hvd.rank(), hvd.size()
    bad = []

    def check(what, got, want, tol=1e-2):
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape) or not torch.allclose(
                got.double(), want.double(), rtol=tol, atol=tol):
            bad.append(f"rank {r}: {what} -> {got}, expected {want}")

    # allreduce: every dtype and op, out of place and in place
    for dt in [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
               torch.bfloat16, torch.float32, torch.float64]:
        base = torch.arange(12, dtype=torch.float64).reshape(3, 4) % 5
        allx = [base + k for k in range(n)]
        x = (base + r).to(dt)
        prod = torch.ones_like(base)
        for a in allx:
            prod = prod * a
        for op, want in [(hvd.Sum, sum(allx)), (hvd.Min, allx[0]), (hvd.Max, allx[-1]),
                         (hvd.Average, sum(allx) / n), (hvd.Product, prod)]:
            if op == hvd.Product and dt in (torch.uint8, torch.int8, torch.float16, torch.bfloat16):
                continue  # overflows/rounds: not a fair exact comparison
            got = hvd.allreduce(x, op=op, name=f"{dt}.{int(op)}")
            w = want.to(dt) if dt.is_floating_point else torch.trunc(want).to(dt)
            check(f"allreduce({dt}, op={int(op)})", got, w)
        y = x.clone()
        out = hvd.allreduce_(y, op=hvd.Sum, name=f"inplace.{dt}")
        if out is not y:
            bad.append(f"rank {r}: allreduce_({dt}) returned another tensor")
        check(f"allreduce_({dt})", y, sum(allx).to(dt))
    # bool: Sum/Max = or, Min = and
    b = torch.tensor([r == 0, True, False])
    for op, want in [(hvd.Sum, [True, True, False]), (hvd.Min, [n == 1, True, False])]:
        got = hvd.allreduce(b, op=op, name=f"bool.{int(op)}")
        if got.dtype != torch.bool or got.tolist() != want:
            bad.append(f"rank {r}: allreduce(bool, op={int(op)}) -> {got}, expected {want}")
    # scale factors, input untouched, non-contiguous in place, a large tensor (sent unfused)
    x = torch.full((6,), r + 1.0)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="scaled")
    check("scaled allreduce", got, torch.full((6,), float(sum(k + 1 for k in range(n)))))
    check("allreduce input", x, torch.full((6,), r + 1.0), tol=0)
    nc = torch.zeros(4, 4)[:, ::2]
    nc.fill_(float(r))
    hvd.allreduce_(nc, op=hvd.Sum, name="noncontig")
    check("non-contiguous allreduce_", nc, torch.full((4, 2), float(sum(range(n)))))
    big = torch.full((300_000,), float(r))
    check("large allreduce", hvd.allreduce(big, name="big"), torch.full((300_000,), (n - 1) / 2))
    # many async small ones (fused on the plane) mixed with large ones, in place and not
    ts = [torch.full((k + 2,), float(r)) for k in range(30)] + [torch.full((70_000,), float(r))]
    hs = [hvd.allreduce_async_(t, name=f"async_.{k}") for k, t in enumerate(ts)]
    hs2 = [hvd.allreduce_async(torch.full((k + 1,), float(r) * k), name=f"async.{k}", op=hvd.Sum)
           for k in range(20)]
    outs = [hvd.synchronize(h) for h in hs]
    if any(o is not t for o, t in zip(outs, ts)):
        bad.append(f"rank {r}: allreduce_async_ did not return its input")
    for k, t in enumerate(ts):
        check(f"allreduce_async_ #{k}", t, torch.full_like(t, (n - 1) / 2))
    for k, h in enumerate(hs2):
        check(f"allreduce_async #{k}", hvd.synchronize(h), torch.full((k + 1,), float(k * sum(range(n)))))
    # grouped, in place and not
    g = hvd.grouped_allreduce([torch.full((3,), float(r)), torch.full((2, 2), 2.0 * r)], op=hvd.Sum,
                              name="grouped")
    check("grouped_allreduce[0]", g[0], torch.full((3,), float(sum(range(n)))))
    check("grouped_allreduce[1]", g[1], torch.full((2, 2), 2.0 * sum(range(n))))
    gi = [torch.full((3,), float(r)), torch.full((5,), 1.0)]
    hvd.grouped_allreduce_(gi, op=hvd.Sum, name="grouped_")
    check("grouped_allreduce_[1]", gi[1], torch.full((5,), float(n)))
    # allgather: ragged first dimension, every dtype kind, grouped, zero rows on a rank
    for dt in [torch.float32, torch.bfloat16, torch.bool, torch.int16, torch.uint8]:
        x = (torch.arange((r + 1) * 3).reshape(r + 1, 3) + 10 * r).to(dt)
        want = torch.cat([(torch.arange((k + 1) * 3).reshape(k + 1, 3) + 10 * k).to(dt) for k in range(n)])
        check(f"allgather({dt})", hvd.allgather(x, name=f"ag.{dt}"), want)
    same = hvd.allgather(torch.full((2, 2), float(r)), name="ag.equal")
    check("allgather(equal)", same, torch.cat([torch.full((2, 2), float(k)) for k in range(n)]))
    empty_on_0 = torch.full((0 if r == 0 else 2,), float(r))
    check("allgather(zero rows on rank 0)", hvd.allgather(empty_on_0, name="ag.zero"),
          torch.cat([torch.full((0 if k == 0 else 2,), float(k)) for k in range(n)]))
    ga = hvd.grouped_allgather([torch.full((1,), float(r)), torch.full((r + 1, 2), 1.0)], name="gag")
    check("grouped_allgather[0]", ga[0], torch.arange(n, dtype=torch.float32))
    check("grouped_allgather[1]", ga[1], torch.ones((sum(range(1, n + 1)), 2)))
    # broadcast: out of place, in place, fused, bf16/bool, non-zero root
    root = n - 1
    for dt in [torch.float32, torch.bfloat16, torch.bool, torch.int64]:
        x = torch.full((2, 3), float(r + 1)).to(dt)
        got = hvd.broadcast(x, root, name=f"bc.{dt}")
        check(f"broadcast({dt})", got, torch.full((2, 3), float(root + 1)).to(dt))
        check(f"broadcast({dt}) input", x, torch.full((2, 3), float(r + 1)).to(dt), tol=0)
    bs = [torch.full((k + 1,), float(r)) for k in range(10)]
    hs = [hvd.broadcast_async_(t, 0, name=f"bc_.{k}") for k, t in enumerate(bs)]
    for k, h in enumerate(hs):
        check(f"broadcast_async_ #{k}", hvd.synchronize(h), torch.zeros(k + 1))
    # alltoall: even, with splits (zeros included), received splits
    x = torch.arange(n * 2, dtype=torch.float32) + 100 * r
    got = hvd.alltoall(x, name="a2a.even")
    check("alltoall(even)", got, torch.tensor([100.0 * k + 2 * r + j for k in range(n) for j in range(2)]))
    splits = [k % 2 + (1 if k == r else 0) for k in range(n)]  # some zero entries
    x = torch.full((sum(splits), 2), float(r), dtype=torch.float64)
    out, rs = hvd.alltoall(x, splits=torch.tensor(splits, dtype=torch.int32), name="a2a.splits")
    recv = [k2 % 2 + (1 if k2 == k else 0) for k in range(n) for k2 in [r]]
    if rs.tolist() != recv:
        bad.append(f"rank {r}: alltoall received splits {rs.tolist()}, expected {recv}")
    check("alltoall(splits)", out, torch.cat([torch.full((c, 2), float(k), dtype=torch.float64)
                                              for k, c in enumerate(recv)]))
    # reducescatter: uneven rows, Average and Sum, scale factors, grouped
    rows = 2 * n + 1
    x = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * (r + 1)
    full = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * sum(range(1, n + 1))
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(counts[:r])
    mine = full[start:start + counts[r]]
    check("reducescatter(Sum)", hvd.reducescatter(x, op=hvd.Sum, name="rs.sum"), mine)
    check("reducescatter(Average)", hvd.reducescatter(x, name="rs.avg"), mine / n)
    check("reducescatter(scaled)", hvd.reducescatter(x, op=hvd.Sum, prescale_factor=0.5,
                                                     postscale_factor=4.0, name="rs.scaled"), mine * 2)
    gr = hvd.grouped_reducescatter([x.to(torch.int32), x.to(torch.int32) * 2], op=hvd.Sum, name="grs")
    check("grouped_reducescatter[1]", gr[1], mine.to(torch.int32) * 2)
    # a process set without rank 0 (one rank at np=2, two at np=3)
    members = list(range(1, n))
    ps = hvd.add_process_set(members)
    if r in members:
        got = hvd.allreduce(torch.full((4,), float(r)), op=hvd.Sum, name="ps", process_set=ps)
        check("allreduce(process set)", got, torch.full((4,), float(sum(members))))
        got = hvd.allgather(torch.full((1,), float(r)), name="ps.ag", process_set=ps)
        check("allgather(process set)", got, torch.tensor([float(m) for m in members]))
        got = hvd.broadcast(torch.full((2,), float(r)), n - 1, name="ps.bc", process_set=ps)
        check("broadcast(process set)", got, torch.full((2,), n - 1.0))
    hvd.barrier()
    from horovod.common.context import get_context

    plane = get_context().engine._executor.planes._planes["torch"]
    had = any(k[0].ranks == members for k in plane._transports)
    hvd.remove_process_set(ps)
    if r in members and not had:
        bad.append(f"rank {r}: the process set's operations did not make a plane process group")
    if any(k[0].ranks == members for k in plane._transports):
        bad.append(f"rank {r}: the plane kept the removed process set's process group")
    _repeat_cases(hvd, r, n, check, bad)
    # differentiable ops keep working on the plane
    w = torch.full((3,), float(r + 1), requires_grad=True)
    hvd.allreduce(w, op=hvd.Sum, name="grad.ar").sum().backward()
    check("allreduce gradient", w.grad, torch.full((3,), float(n)))
    if not _plane_ran():
        bad.append(f"rank {r}: the device plane never ran (HOROVOD_TORCH_CPU_PLANE ignored?)")
    hvd.shutdown()
    return bad


def _repeat_cases(hvd, r, n, check, bad):
    """Named in-place allreduces repeated step after step take the plane's repeat path (the
    checked request resubmitted on new wrappers): exact values on the same tensors, on new
    tensors, after a shape change (checked again), and for grouped calls."""
    import torch

    from horovod.common.context import get_context

    same = torch.zeros(5)
    for step in range(4):
        same.copy_(torch.arange(5.0) * (r + 1) + step)
        fresh = torch.full((2, 3), float(r + step), dtype=torch.float64)
        hs = [hvd.allreduce_async_(same, name="rep.same", op=hvd.Sum),
              hvd.allreduce_async_(fresh, name="rep.fresh", op=hvd.Average)]
        got = [hvd.synchronize(h) for h in hs]
        if got[0] is not same or got[1] is not fresh:
            bad.append(f"rank {r}: repeated allreduce_async_ did not return its tensor (step {step})")
        check(f"repeat same tensor (step {step})", same, torch.arange(5.0) * (n * (n + 1) // 2) + n * step)
        check(f"repeat new tensor (step {step})", fresh,
              torch.full((2, 3), (n - 1) / 2 + step, dtype=torch.float64), tol=0)
    sig = get_context().repeats.get(("rep.same", hvd.Sum, 1.0, 1.0, 0))
    if sig is None or sig[7].host or sig[7].cuda:
        bad.append(f"rank {r}: no device-plane repeat signature for a repeated twin allreduce_: {sig}")
    changed = torch.full((7,), float(r))  # another shape: the checked path, same name
    check("repeat after a shape change", hvd.allreduce_(changed, name="rep.same", op=hvd.Sum),
          torch.full((7,), float(sum(range(n)))))
    group = [torch.full((k + 1,), float(r * 10 + k)) for k in range(9)] + [torch.full((3,), r, dtype=torch.int32)]
    for step in range(3):
        for k, t in enumerate(group[:9]):
            t.fill_(float(r * 10 + k + step))
        group[9].fill_(r + step)
        out = hvd.grouped_allreduce_(group[:9], name="rep.group", op=hvd.Average)
        ints = hvd.grouped_allreduce_([group[9]], name="rep.group.int", op=hvd.Sum)
        if any(o is not t for o, t in zip(out, group[:9])) or ints[0] is not group[9]:
            bad.append(f"rank {r}: repeated grouped_allreduce_ did not return its tensors (step {step})")
        for k, t in enumerate(group[:9]):
            check(f"repeat grouped[{k}] (step {step})", t, torch.full((k + 1,), 10 * (n - 1) / 2 + k + step), tol=0)
        check(f"repeat grouped int (step {step})", group[9],
              torch.full((3,), n * (n - 1) // 2 + n * step, dtype=torch.int32), tol=0)
    rep = get_context().repeats.get(("grouped", "rep.group", hvd.Average, 1.0, 1.0, 0))
    if rep is None or rep.facts is None or rep.arrays[0].tensor is not group[0]:
        bad.append(f"rank {r}: the grouped twin call did not keep its wrappers for the repeat path")


@pytest.mark.parametrize("np_", NPS)
@JOINT_TIMEOUT
def test_device_plane_collectives_on_cpu_twin(np_):
    results = _TWIN[np_].results("collectives")
    assert results == [[]] * np_, "\n".join(x for res in results for x in res)


def test_device_plane_collectives_under_the_gloo_launcher():
    """Under horovodrun --gloo the job's transport is itself torch.distributed: the plane's own
    process groups and stores must live beside it."""
    import sys

    gloo = [sys.executable, "-m", "horovod.runner", "--gloo", "-np", "2"]
    results = run_ranks(_collective_cases, np=2, timeout=180, env=TWIN, launcher=gloo)
    assert results == [[]] * 2, "\n".join(x for res in results for x in res)


def _mixed_join_and_errors():
    import numpy as np
    import torch

    import horovod.numpy as hnp
    import horovod.torch as hvd
    from horovod.common.exceptions import CollectiveMismatchError, HorovodInternalError

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    # plane (torch) and host (NumPy) operations in flight together in one step
    ht = [hvd.allreduce_async(torch.full((4,), float(r)), op=hvd.Sum, name=f"mix.t{k}") for k in range(5)]
    hn = [hnp.allreduce_async(np.full(4, float(r)), op=hnp.Sum, name=f"mix.n{k}") for k in range(5)]
    for k in range(5):
        t = hvd.synchronize(ht[k])
        a = hnp.synchronize(hn[k])
        if not torch.equal(t, torch.full((4,), float(sum(range(n))))):
            bad.append(f"rank {r}: mixed torch allreduce #{k} -> {t}")
        if not np.array_equal(a, np.full(4, float(sum(range(n))))):
            bad.append(f"rank {r}: mixed numpy allreduce #{k} -> {a}")
    # the same name on the plane on rank 0 and on the host elsewhere: an error on every rank
    try:
        if r == 0:
            hvd.allreduce(torch.ones(3, dtype=torch.float64), name="devmix")
        else:
            hnp.allreduce(np.ones(3), name="devmix")
        bad.append(f"rank {r}: device mismatch did not raise")
    except CollectiveMismatchError as exc:
        if exc.field != "device" or "torch:cpu" not in str(exc) or "cpu" not in exc.values:
            bad.append(f"rank {r}: device mismatch error without the devices: {exc!r} {exc.values}")
        if sorted(r2 for ranks in exc.values.values() for r2 in ranks) != list(range(n)):
            bad.append(f"rank {r}: device mismatch error does not name every rank: {exc.values}")
    # a bad argument on one rank only (bool Average) fails the call on every rank
    try:
        x = torch.tensor([True]) if r == 1 else torch.ones(1)
        hvd.allreduce(x, name="badarg")
        bad.append(f"rank {r}: bad argument did not raise")
    except (ValueError, HorovodInternalError) as exc:
        if r == 1 and "bool" not in str(exc):
            bad.append(f"rank {r}: unexpected error {exc!r}")
    # a failure inside the plane fails that operation on every rank, named, and nothing else
    from horovod.torch import _device_plane as dp

    real = dp.TorchTransport._reduce

    def failing(self, t, op):
        raise RuntimeError("injected transport failure")

    dp.TorchTransport._reduce = failing
    try:
        hvd.allreduce(torch.ones(2), name="planefail")
        bad.append(f"rank {r}: a failing plane did not raise")
    except HorovodInternalError as exc:
        text = str(exc)
        if "planefail" not in text or f"failed on rank {r}" not in text or "injected" not in text:
            bad.append(f"rank {r}: plane failure error lacks the name/rank/cause: {text}")
    finally:
        dp.TorchTransport._reduce = real
    # the engine keeps serving afterwards
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after")
    if not torch.equal(got, torch.full((2,), float(n))):
        bad.append(f"rank {r}: allreduce after errors -> {got}")
    # join: the last rank keeps reducing, the others contribute zeros from the plane
    if r == n - 1:
        for k in range(3):
            got = hvd.allreduce(torch.full((5,), 6.0), op=hvd.Sum, name=f"join.{k}")
            if not torch.equal(got, torch.full((5,), 6.0)):
                bad.append(f"rank {r}: allreduce with joined ranks -> {got}")
        avg = hvd.allreduce(torch.full((2,), 6.0), name="join.avg")
        if not torch.allclose(avg, torch.full((2,), 6.0 / n)):
            bad.append(f"rank {r}: Average with joined ranks -> {avg} (divides by the set size)")
    last = hvd.join()
    if last != n - 1:
        bad.append(f"rank {r}: join() returned {last}, expected {n - 1}")
    if not _plane_ran():
        bad.append(f"rank {r}: the device plane never ran")
    hvd.shutdown()
    # init again: a new engine makes new process groups (the old ones were shut down)
    hvd.init()
    got = hvd.allreduce(torch.full((3,), float(r)), op=hvd.Sum, name="reinit")
    if not torch.equal(got, torch.full((3,), float(sum(range(n))))) or not _plane_ran():
        bad.append(f"rank {r}: allreduce after re-init -> {got}")
    hvd.shutdown()
    return bad


@pytest.mark.parametrize("np_", NPS)
@JOINT_TIMEOUT
def test_device_plane_mixes_with_host_joins_and_fails_everywhere(np_):
    results = _TWIN[np_].results("mixed")
    assert results == [[]] * np_, "\n".join(x for res in results for x in res)


# One launch per world size on the CPU twin runs both bodies above, each from a fresh hvd.init()
# (own_init; the first starts with dynamic process sets, the second provokes errors).
_TWIN = {n: joint_launch("torch", n, {"collectives": own_init(_collective_cases),
                                      "mixed": own_init(_mixed_join_and_errors)}, timeout=300, env=TWIN)
         for n in NPS}


def _training():
    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []

    def data(k):
        g = torch.Generator().manual_seed(100 + k)
        return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)

    def model():
        torch.manual_seed(r)  # different on every rank until broadcast_parameters
        return torch.nn.Linear(4, 1)

    for comp_name, compression, tol in [("none", hvd.Compression.none, 1e-6), ("fp16", hvd.Compression.fp16, 2e-3)]:
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters(), compression=compression)
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        # the reference: one process averaging every rank's gradient by hand
        torch.manual_seed(0)
        ref = torch.nn.Linear(4, 1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            x, y = data(r)
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
            ref_opt.zero_grad()
            grads = []
            for k in range(n):
                ref.zero_grad()
                xk, yk = data(k)
                torch.nn.functional.mse_loss(ref(xk), yk).backward()
                grads.append([p.grad.clone() for p in ref.parameters()])
            for i, p in enumerate(ref.parameters()):
                p.grad = sum(gk[i] for gk in grads) / n
            ref_opt.step()
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            if not torch.allclose(p, q, atol=tol, rtol=tol):
                bad.append(f"rank {r}: {comp_name}: parameter {name} {p.tolist()} != reference {q.tolist()}")
        # optimizer state: momentum buffers from rank 0 everywhere
        if r != 0:
            for s in opt.state.values():
                s["momentum_buffer"].add_(100.0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        buf = [s["momentum_buffer"] for s in opt.state.values()]
        gathered = hvd.allgather(torch.cat([b.reshape(-1) for b in buf]).unsqueeze(0), name=f"mom.{comp_name}")
        if not torch.allclose(gathered, gathered[0].expand_as(gathered)):
            bad.append(f"rank {r}: {comp_name}: momentum differs across ranks after broadcast_optimizer_state")
    # SyncBatchNorm against BatchNorm over every rank's batch
    sbn = hvd.SyncBatchNorm(3)
    bn = torch.nn.BatchNorm1d(3)
    xs = [torch.arange(12, dtype=torch.float32).reshape(4, 3) * (k + 1) + k for k in range(n)]
    xr = xs[r].clone().requires_grad_(True)
    out = sbn(xr)
    out.sum().backward()
    want = bn(torch.cat(xs))[4 * r:4 * r + 4]
    if not torch.allclose(out, want, atol=1e-4):
        bad.append(f"rank {r}: SyncBatchNorm {out} != BatchNorm over all ranks {want}")
    if not torch.allclose(sbn.running_mean, bn.running_mean, atol=1e-4):
        bad.append(f"rank {r}: SyncBatchNorm running mean {sbn.running_mean} != {bn.running_mean}")
    if not _plane_ran():
        bad.append(f"rank {r}: the device plane never ran")
    hvd.shutdown()
    return bad


def test_device_plane_training_recipe_on_cpu_twin(tmp_path):
    timeline = tmp_path / "timeline.json"
    results = run_ranks(_training, np=2, timeout=120, env={**TWIN, "HOROVOD_TIMELINE": str(timeline)})
    assert results == [[]] * 2, "\n".join(x for res in results for x in res)
    # the plane's batches show in the timeline under upstream's activity names
    text = timeline.read_text()
    assert "GLOO_ALLREDUCE" in text and "GLOO_BCAST" in text and "MEMCPY_IN_FUSION_BUFFER" not in text


def _seed_recipe_as_written() -> str:
    """tests/gpu/bin/torch_recipe.py as ``__main__`` in this rank: what it printed."""
    import os

    return run_as_main(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu", "bin",
                                    "torch_recipe.py"))


# A part of the CPU twin's launch at np=2 (below), from a fresh hvd.init() after its other bodies.
_RECIPE = joint_launch("torch", 2, {"seed_recipe": own_init(_seed_recipe_as_written)}, timeout=120, env=TWIN,
                       late=True)


@JOINT_TIMEOUT
def test_seed_recipe_runs_as_written_on_cpu_twin():
    """The seed's script (GPU pinning, model.cuda() when CUDA exists) trains through the plane."""
    import re

    out = "".join(_RECIPE.results("seed_recipe"))
    lines = re.findall(r"rank (\d) device (\S+) loss ([\d.]+) -> ([\d.]+) spread (\S+)", out)
    assert len(lines) == 2, out
    for _, _, first, last, spread in lines:
        assert float(last) < float(first) and float(spread) == 0.0, out


def _gpu_nccl_without_cuda():
    import horovod.torch as hvd
    from horovod.common.exceptions import ConfigError

    try:
        hvd.init()
    except ConfigError as exc:
        return (exc.variable, "torch.cuda.is_available() is False" in str(exc))
    hvd.shutdown()
    return "init did not raise"


def test_gpu_operations_nccl_without_cuda_fails_init_on_every_rank():
    results = run_ranks(_gpu_nccl_without_cuda, np=2, timeout=60,
                        env={"HOROVOD_GPU_OPERATIONS": "NCCL"})
    assert results == [("HOROVOD_GPU_OPERATIONS", True)] * 2
