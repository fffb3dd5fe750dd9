"""horovod.torch on a CUDA GPU: np=1 on NCCL, np=2 sharing one GPU host-staged, the seed recipe.

One GPU is enough: NCCL refuses two ranks of one communicator on the same GPU, so np=2 on one
GPU runs host-staged (``HOROVOD_GPU_OPERATIONS=MPI``) and the NCCL np=2 case checks that the
refusal is a clear error on every rank. Run: ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from horovod.testing import run_mpi_script, run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]

BIN = os.path.join(os.path.dirname(__file__), "bin")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _collectives_on_cuda():
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    r, n = hvd.rank(), hvd.size()
    bad = []

    def check(what, got, want, tol=1e-2):
        if got.device != dev:
            bad.append(f"rank {r}: {what} result on {got.device}, expected {dev}")
            return
        if got.dtype != want.dtype or got.shape != want.shape or not torch.allclose(
                got.double().cpu(), want.double().cpu(), rtol=tol, atol=tol):
            bad.append(f"rank {r}: {what} -> {got}, expected {want}")

    for dt in [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64,
               torch.uint8, torch.int16]:
        x = torch.full((3, 5), float(r + 1), device=dev).to(dt)
        for op, want in [(hvd.Sum, sum(range(1, n + 1))), (hvd.Max, n), (hvd.Min, 1)]:
            check(f"allreduce({dt}, {int(op)})", hvd.allreduce(x, op=op, name=f"ar.{dt}.{int(op)}"),
                  torch.full((3, 5), float(want), device=dev).to(dt))
    check("allreduce(Average)", hvd.allreduce(torch.full((7,), float(r), device=dev), name="avg"),
          torch.full((7,), (n - 1) / 2, device=dev))
    b = torch.tensor([r == 0, True, False], device=dev)
    check("allreduce(bool, Min)", hvd.allreduce(b, op=hvd.Min, name="bool"),
          torch.tensor([n == 1, True, False], device=dev))
    # the input is produced on a side stream: the collective must wait for it (ordering)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big = torch.ones(1 << 22, device=dev)
        big.mul_(float(r + 1))
        h = hvd.allreduce_async_(big, op=hvd.Sum, name="side")
        hvd.synchronize(h)
        total = big.sum()  # runs on `side`, after the result
    side.synchronize()
    want = float(sum(range(1, n + 1)) * (1 << 22))
    if total.item() != want:
        bad.append(f"rank {r}: side-stream allreduce sum {total.item()}, expected {want}")
    ts = [torch.full((k + 1,), float(r), device=dev) for k in range(64)]
    hs = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"fused.{k}") for k, t in enumerate(ts)]
    for k, (t, hd) in enumerate(zip(ts, hs)):
        if hvd.synchronize(hd) is not t:
            bad.append(f"rank {r}: allreduce_async_ #{k} did not return its input")
        check(f"fused #{k}", t, torch.full((k + 1,), float(sum(range(n))), device=dev))
    g = hvd.grouped_allreduce([torch.ones(3, device=dev), torch.ones(2, 2, device=dev)], op=hvd.Sum)
    check("grouped", g[1], torch.full((2, 2), float(n), device=dev))
    x = torch.full((r + 1, 2), float(r), device=dev)
    check("allgather", hvd.allgather(x, name="ag"),
          torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)]).to(dev))
    check("broadcast", hvd.broadcast(torch.full((4,), float(r), device=dev), 0, name="bc"),
          torch.zeros(4, device=dev))
    y = torch.full((4,), float(r), device=dev)
    hvd.broadcast_(y, n - 1, name="bc_")
    check("broadcast_", y, torch.full((4,), float(n - 1), device=dev))
    out = hvd.alltoall(torch.arange(2 * n, dtype=torch.float32, device=dev) + 100 * r, name="a2a")
    check("alltoall", out, torch.tensor([100.0 * k + 2 * r + j for k in range(n) for j in range(2)]).to(dev))
    rs = hvd.reducescatter(torch.ones(2 * n, 3, device=dev), op=hvd.Sum, name="rs")
    check("reducescatter", rs, torch.full((2, 3), float(n), device=dev))
    # CPU and GPU tensors mixed in one step
    hc = hvd.allreduce_async(torch.ones(3), op=hvd.Sum, name="mix.cpu")
    hg = hvd.allreduce_async(torch.ones(3, device=dev), op=hvd.Sum, name="mix.gpu")
    c, gg = hvd.synchronize(hc), hvd.synchronize(hg)
    if c.device.type != "cpu" or not torch.equal(c, torch.full((3,), float(n))):
        bad.append(f"rank {r}: mixed CPU allreduce -> {c}")
    check("mixed GPU allreduce", gg, torch.full((3,), float(n), device=dev))
    # SyncBatchNorm and fp16 compression on the device
    sbn = hvd.SyncBatchNorm(4).to(dev)
    out = sbn(torch.randn(8, 4, device=dev))
    if out.device != dev:
        bad.append(f"rank {r}: SyncBatchNorm output on {out.device}")
    comp = hvd.allreduce(torch.full((5,), 1.5, device=dev), compression=hvd.Compression.fp16, name="fp16")
    check("fp16 compression", comp, torch.full((5,), 1.5, device=dev))
    hvd.shutdown()
    return bad


def test_np1_nccl_every_collective_on_cuda():
    assert run_ranks(_collectives_on_cuda, np=1, timeout=300) == [[]]


def test_np2_sharing_one_gpu_host_staged():
    res = run_ranks(_collectives_on_cuda, np=2, timeout=300, env={"HOROVOD_GPU_OPERATIONS": "MPI"})
    assert res == [[], []]


def _nccl_two_ranks_one_gpu():
    import torch

    import horovod.torch as hvd
    from horovod.common.exceptions import HorovodInternalError

    hvd.init()
    torch.cuda.set_device(0)
    try:
        hvd.allreduce(torch.ones(4, device="cuda"), name="dup")
    except HorovodInternalError as exc:
        return str(exc)
    finally:
        hvd.shutdown()
    return "no error"


@pytest.mark.skipif(_gpus() > 1, reason="needs ranks sharing one GPU")
def test_np2_nccl_on_one_gpu_is_a_clear_error_on_every_rank():
    res = run_ranks(_nccl_two_ranks_one_gpu, np=2, timeout=120, env={"HOROVOD_GPU_OPERATIONS": "NCCL"})
    for text in res:
        assert "ranks [0, 1] use the same GPU" in text, text


def _tensor_on_other_gpu():
    import torch

    import horovod.torch as hvd

    hvd.init()
    torch.cuda.set_device(0)
    try:
        hvd.allreduce(torch.ones(2, device="cuda:1"), name="other")
    except ValueError as exc:
        return str(exc)
    finally:
        hvd.shutdown()
    return "no error"


@pytest.mark.skipif(_gpus() < 2, reason="needs two GPUs")
def test_tensor_on_another_gpu_is_refused():
    [text] = run_ranks(_tensor_on_other_gpu, np=1, timeout=60)
    assert "is on cuda:1, but this process uses cuda:0" in text


@pytest.mark.parametrize("np_,env", [(1, {}), (2, {"HOROVOD_GPU_OPERATIONS": "MPI"})])
def test_seed_recipe_trains_on_cuda(np_, env):
    res = run_mpi_script([sys.executable, os.path.join(BIN, "torch_recipe.py")], np=np_, timeout=300, env=env)
    lines = re.findall(r"rank (\d) device (\S+) loss ([\d.]+) -> ([\d.]+) spread (\S+)", res.stdout)
    assert len(lines) == np_, res.stdout
    for _, device, first, last, spread in lines:
        assert device.startswith("cuda"), res.stdout
        assert float(last) < float(first), res.stdout
        assert float(spread) == 0.0, res.stdout
