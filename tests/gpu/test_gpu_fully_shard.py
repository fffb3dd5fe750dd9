"""hvd.fully_shard on CUDA tensors: the gathered parameters' storage freed and refilled on the GPU,
allgathers and reduce-scatters on NCCL (np=2 on two GPUs; one GPU: np=1 on NCCL and np=2 sharing
it host-staged), AdamW over the shards == the unsharded model with averaged gradients. Without a
GPU every test here skips with the reason (tests/gpu/conftest.py). Run: ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest

from horovod.testing import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _same_weights_as_unsharded(bf16: bool = False) -> list[str]:
    import copy

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                                    torch.nn.Linear(64, 32)) for _ in range(3)],
                              torch.nn.Linear(32, 5)).to(dev)
    m = copy.deepcopy(ref)
    policy = hvd.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    for block in list(m)[:3]:
        hvd.fully_shard(block, mp_policy=policy)
    hvd.fully_shard(m, mp_policy=policy)
    bad = [f"rank {r}: shard {n} on {p.device}" for n, p in m.named_parameters() if p.device != dev]
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + r)
    for _ in range(6):
        x = torch.randn(16, 32, generator=g).to(dev)
        y = torch.randint(0, 5, (16,), generator=g).to(dev)
        ro.zero_grad()
        low = copy.deepcopy(ref).to(torch.bfloat16) if bf16 else ref
        F.cross_entropy(low(x.to(torch.bfloat16) if bf16 else x).float(), y).backward()
        for p, q in zip(ref.parameters(), low.parameters()):
            p.grad = hvd.allreduce(q.grad.float(), op=hvd.Average)
        ro.step()
        o.zero_grad()
        F.cross_entropy(m(x).float(), y).backward()
        o.step()
        left = [n for n, p in m.named_parameters() if p.grad is None or p.grad.device != dev]
        if left:
            bad.append(f"rank {r}: shards without a gradient on {dev}: {left}")
            break
    full = m.full_state_dict()
    for k, v in ref.state_dict().items():
        err = float((full[k].float() - v.float()).abs().max() / v.float().abs().max().clamp_min(1e-12))
        if err > 1e-5:
            bad.append(f"rank {r}: {k} differs from the unsharded run by {err}")
    hvd.shutdown()
    return bad


def test_np1_nccl_fully_shard():
    assert run_ranks(_same_weights_as_unsharded, np=1, timeout=300, env={"HOROVOD_GPU_OPERATIONS": "NCCL"}) == [[]]


@pytest.mark.skipif(_gpus() < 2, reason="NCCL at np=2 needs two GPUs (NCCL refuses two ranks on one GPU)")
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_np2_nccl_fully_shard_same_weights_as_unsharded(bf16):
    res = run_ranks(_same_weights_as_unsharded, np=2, timeout=300, args=(bf16,),
                    env={"HOROVOD_GPU_OPERATIONS": "NCCL"})
    assert res == [[], []], res


def test_np2_sharing_one_gpu_host_staged_fully_shard():
    res = run_ranks(_same_weights_as_unsharded, np=2, timeout=300, env={"HOROVOD_GPU_OPERATIONS": "MPI"})
    assert res == [[], []], res
