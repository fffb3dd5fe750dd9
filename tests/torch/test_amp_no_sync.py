"""DistributedOptimizer with torch.amp.GradScaler (the PyTorch AMP recipe with unscale_ and
clipping, overflowing steps skipped on every rank, the same weights as DDP) and ``no_sync()``
(one allreduce per gradient for K micro-batches, the weights of one large-batch step)."""

from __future__ import annotations

import os

import pytest

from horovod.testing import run_ranks
from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]

_STEPS = 14


def _amp_loop(rank, size, wrap, ddp=False):
    """PyTorch's AMP recipe (fp16 autocast on CPU) on rank ``rank`` of ``size``. The scaler starts
    at 2**19 and grows every 3 steps; rank 1's inputs are 5x larger, so that its fp16 activations'
    gradients overflow from 2**18 on while rank 0's do from 2**20: steps overflow on rank 1 only
    (the average carries the inf to every rank). Returns (flat weights, number of skipped steps,
    the scale after each step)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt, net = wrap(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 19, growth_interval=3)
    g = torch.Generator().manual_seed(10 + rank)
    skipped, scales = 0, []
    for _ in range(_STEPS):
        x = torch.randn(16, 8, generator=g) * (5.0 if rank == 1 else 1.0)
        y = torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(net(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        scales.append(scaler.get_scale())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat.tolist(), skipped, scales


def _ddp_body(store_path):
    """The AMP loop under torch DDP (gloo), on the ranks ``run_ranks`` starts (no Horovod)."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("HOROVOD_SIZE", "1")))
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=size)
    try:
        def wrap(model):
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), ddp
        return _amp_loop(rank, size, wrap)
    finally:
        dist.destroy_process_group()


def _hvd_amp():
    import torch

    import horovod.torch as hvd

    hvd.init()

    def wrap(model):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters())
        return opt, model
    return _amp_loop(hvd.rank(), hvd.size(), wrap)


def _no_sync_body():
    """K micro-batches (K-1 inside ``no_sync()``) == one step on their concatenation; one
    allreduce per gradient; step() and synchronize() inside the context raise."""
    import copy

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd
    from horovod.common.context import get_context

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    engine = get_context().engine
    names = []
    submit, submit_many = engine.submit, engine.submit_many

    def count(entry, *a, **k):
        names.append(entry.request.name)
        return submit(entry, *a, **k)

    def count_many(entries, *a, **k):
        names.extend(e.request.name for e in entries)
        return submit_many(entries, *a, **k)

    engine.submit, engine.submit_many = count, count_many
    k, b = 3, 4
    g = torch.Generator().manual_seed(5)
    try:
        for step in range(3):
            xs = torch.randn(k * b * n, 6, generator=g)
            ys = torch.randint(0, 3, (k * b * n,), generator=g)
            ref_opt.zero_grad()
            # one large batch: every rank's K micro-batches, mean loss
            F.cross_entropy(ref(xs), ys).backward()
            ref_opt.step()
            opt.zero_grad()
            names.clear()
            mine = [(xs[(r * k + i) * b:(r * k + i + 1) * b], ys[(r * k + i) * b:(r * k + i + 1) * b])
                    for i in range(k)]
            if step == 2:
                # a synchronized pass, then one inside no_sync(): step() averages what it added
                x, y = mine[0]
                (F.cross_entropy(model(x), y) / k).backward()
                with opt.no_sync():
                    for x, y in mine[1:]:
                        (F.cross_entropy(model(x), y) / k).backward()
                opt.step()
                continue
            with opt.no_sync():
                for x, y in mine[:-1]:
                    (F.cross_entropy(model(x), y) / k).backward()
            if names:
                bad.append(f"rank {r}: step {step}: allreduces inside no_sync(): {names}")
            x, y = mine[-1]
            (F.cross_entropy(model(x), y) / k).backward()
            opt.step()
            per = {nm: names.count(nm) for nm in set(names)}
            expected = {f"allreduce.{nm}" for nm, _ in model.named_parameters()}
            if opt.reducer._views:  # flat gradients (the default on CPU): one bucket, last layer first
                expected = {f"grouped_allreduce.{list(model.named_parameters())[-1][0]}"}
            if set(per) != expected or set(per.values()) != {1}:
                bad.append(f"rank {r}: step {step}: allreduces per tensor {per}, expected one each of "
                           f"{sorted(expected)}")
    finally:
        engine.submit, engine.submit_many = submit, submit_many
    for (nm, p), q in zip(model.named_parameters(), ref.parameters()):
        if not torch.allclose(p, q, atol=1e-6, rtol=0):
            bad.append(f"rank {r}: {nm} differs from the large-batch step by {(p - q).abs().max().item():.2e}")
    # a parameter that got its gradient only inside no_sync() is reduced too
    opt.zero_grad()
    with opt.no_sync():
        model(torch.ones(2, 6)).sum().backward()
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat.unsqueeze(0), name="no_sync.after")
    if not all(torch.equal(every[0], every[i]) for i in range(n)):
        bad.append(f"rank {r}: weights differ across ranks after a step whose gradients came only "
                   "inside no_sync()")
    # step() / synchronize() inside no_sync(): an error on every rank, and nothing half done
    for what in ("step", "synchronize"):
        opt.zero_grad()
        try:
            with opt.no_sync():
                model(torch.ones(2, 6)).sum().backward()
                getattr(opt, what)()
            bad.append(f"rank {r}: {what}() inside no_sync() did not raise")
        except RuntimeError as exc:
            if f"optimizer.{what}() was called inside optimizer.no_sync()" not in str(exc):
                bad.append(f"rank {r}: {what}() inside no_sync(): {exc}")
        opt.step()  # outside the context: reduces what was accumulated
    return bad


def test_amp_grad_scaler_matches_ddp(tmp_path):
    """The same script under hvd.DistributedOptimizer and under DDP, np=2: the same steps
    skipped (the same scale history) and the same weights, on every rank."""
    import torch

    hvd_results = _AMP[2].results("amp")
    ddp_results = run_ranks(_ddp_body, np=2, timeout=120, args=(str(tmp_path / "store"),))
    for r in range(2):
        w, skipped, scales = hvd_results[r]
        dw, dskipped, dscales = ddp_results[r]
        assert skipped >= 3, f"rank {r}: only {skipped} skipped steps: the test needs overflows"
        assert skipped < _STEPS - 3, f"rank {r}: {skipped} of {_STEPS} steps skipped"
        assert scales == dscales, f"rank {r}: scale history {scales} != DDP's {dscales}"
        assert skipped == dskipped
        diff = (torch.tensor(w) - torch.tensor(dw)).abs().max().item()
        assert diff < 1e-5, f"rank {r}: weights differ from DDP's by {diff:.2e}"
    assert hvd_results[0][0] == hvd_results[1][0], "weights differ across ranks"


def test_amp_grad_scaler_np3():
    """np=3: every rank skips the same steps (rank 1 alone overflows in some) and ends with the
    same weights."""
    res = _AMP[3].results("amp")
    assert res[0][1] >= 3, f"only {res[0][1]} skipped steps"
    for r in range(1, 3):
        assert res[r][2] == res[0][2], f"rank {r}: scale history {res[r][2]} != rank 0's {res[0][2]}"
        assert res[r][0] == res[0][0], f"rank {r}: weights differ from rank 0's"


@pytest.mark.parametrize("np_", [2, 3])
def test_no_sync(np_):
    bad = [b for ranks in _AMP[np_].results("no_sync") for b in ranks]
    assert not bad, "\n".join(bad)


_AMP = {n: joint_launch("torch", n, {"amp": _hvd_amp, "no_sync": _no_sync_body}, timeout=120)
        for n in (2, 3)}
