"""broadcast_parameters / broadcast_optimizer_state / SyncBatchNorm on real ranks."""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]

NPS = [2, 3]


def _broadcast_cases():
    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []

    def same_everywhere(label, tensors):
        flat = torch.cat([t.detach().double().reshape(-1) for t in tensors])
        allf = hvd.allgather(flat.unsqueeze(0), name=f"same.{label}")
        if not all(torch.equal(allf[0], allf[k]) for k in range(n)):
            bad.append(f"rank {r}: {label}: values differ across ranks")

    # different seeds -> different initial weights; identical after the broadcasts
    torch.manual_seed(1234 + r)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 4 * 4, 3))
    model(torch.randn(2, 1, 6, 6))  # moves BN running stats, differently per rank
    opt = torch.optim.Adam(model.parameters(), lr=0.001 * (r + 1), betas=(0.9, 0.99 - 0.01 * r))
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "lr": 0.5 + r})
    root_sd = {k: v.clone() for k, v in model.state_dict().items()}
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    same_everywhere("state_dict", list(model.state_dict().values()))
    if r == 0 and any(not torch.equal(v, model.state_dict()[k]) for k, v in root_sd.items()):
        bad.append("rank 0: broadcast_parameters changed the root's values")
    if opt.param_groups[0]["lr"] != 0.001 or opt.param_groups[0]["betas"] != (0.9, 0.99) or \
            opt.param_groups[1]["lr"] != 0.5 or not isinstance(opt.param_groups[0]["betas"], tuple):
        bad.append(f"rank {r}: param_groups options not synced: {opt.param_groups[0]}, lr1={opt.param_groups[1]['lr']}")
    st = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if not st:
        bad.append(f"rank {r}: fresh Adam has no state after broadcast_optimizer_state")
    same_everywhere("adam state", st)
    # named_parameters() (a generator) and a list of tensors also work
    torch.manual_seed(r)
    lin = torch.nn.Linear(3, 3)
    hvd.broadcast_parameters(lin.named_parameters(), root_rank=n - 1)
    same_everywhere("named_parameters", list(lin.parameters()))
    ts = [torch.full((2,), float(r)), torch.full((3,), float(r), dtype=torch.bfloat16)]
    hvd.broadcast_parameters(ts, root_rank=1)
    if not all(torch.equal(t.float(), torch.ones_like(t, dtype=torch.float32)) for t in ts):
        bad.append(f"rank {r}: list broadcast -> {ts}")
    # scalar state (a non-tensor 'step') and an optimizer that already has state on some ranks
    torch.manual_seed(0)
    lin = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    if r == 0:
        lin(torch.ones(1, 2)).sum().backward()
        sgd.step()
        for s in sgd.state.values():
            s["custom_counter"] = 7
    else:
        for p in lin.parameters():
            sgd.state[p]["custom_counter"] = r
            sgd.state[p]["momentum_buffer"] = torch.full_like(p, float(r))
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    counters = [s.get("custom_counter") for s in sgd.state.values()]
    if counters != [7, 7]:
        bad.append(f"rank {r}: scalar optimizer state not synced: {counters}")
    same_everywhere("sgd momentum", [s["momentum_buffer"] for s in sgd.state.values()])
    # a stateless optimizer returns without communicating; DistributedOptimizer works too
    plain = torch.optim.SGD(lin.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(plain, root_rank=0)
    dopt = hvd.DistributedOptimizer(torch.optim.RMSprop(lin.parameters(), lr=0.01 * (r + 1)),
                                    named_parameters=lin.named_parameters())
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    if dopt.param_groups[0]["lr"] != 0.01:
        bad.append(f"rank {r}: DistributedOptimizer lr not synced: {dopt.param_groups[0]['lr']}")
    same_everywhere("rmsprop state", [v for s in dopt.state.values() for v in s.values()
                                      if isinstance(v, torch.Tensor)])
    return bad


def _sync_batch_norm_cases():
    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    torch.manual_seed(0)
    sizes = [k + 2 for k in range(n)]  # different batch size per rank
    full = torch.randn(sum(sizes), 3, 4, 4, dtype=torch.float64) * 3 + 1
    start = sum(sizes[:r])
    mine = full[start:start + sizes[r]].clone().requires_grad_(True)
    ref_in = full.clone().requires_grad_(True)
    sbn = hvd.SyncBatchNorm(3).double()
    bn = torch.nn.BatchNorm2d(3).double()
    with torch.no_grad():
        sbn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        sbn.bias.copy_(torch.tensor([0.0, 1.0, -1.0]))
    bn.load_state_dict(sbn.state_dict())
    gy = torch.randn_like(full)
    out = sbn(mine)
    out.backward(gy[start:start + sizes[r]])
    ref = bn(ref_in)
    ref.backward(gy)
    if not torch.allclose(out, ref[start:start + sizes[r]], atol=1e-8):
        bad.append(f"rank {r}: SyncBatchNorm forward differs by {(out - ref[start:start + sizes[r]]).abs().max()}")
    if not torch.allclose(mine.grad, ref_in.grad[start:start + sizes[r]], atol=1e-8):
        bad.append(f"rank {r}: SyncBatchNorm input grad differs")
    if not torch.allclose(sbn.running_mean, bn.running_mean) or not torch.allclose(sbn.running_var, bn.running_var):
        bad.append(f"rank {r}: running stats {sbn.running_mean} {sbn.running_var} vs "
                   f"{bn.running_mean} {bn.running_var}")
    wgrad = hvd.allreduce(sbn.weight.grad, op=hvd.Sum, name="sbn.wgrad")
    if not torch.allclose(wgrad, bn.weight.grad, atol=1e-8):
        bad.append(f"rank {r}: summed weight grad {wgrad} vs {bn.weight.grad}")
    sbn.eval()
    bn.eval()
    if not torch.allclose(sbn(mine.detach()), bn(mine.detach())):
        bad.append(f"rank {r}: eval mode differs from BatchNorm")
    return bad


@pytest.mark.parametrize("np_", NPS)
def test_broadcast_parameters_and_optimizer_state(np_):
    fails = _LAUNCH[np_].results("broadcast")
    assert not any(fails), "\n".join(f for per_rank in fails for f in per_rank)


@pytest.mark.parametrize("np_", NPS)
def test_sync_batch_norm_matches_batch_norm_on_global_batch(np_):
    fails = _LAUNCH[np_].results("sync_batch_norm")
    assert not any(fails), "\n".join(f for per_rank in fails for f in per_rank)


# Both bodies are part of one launch per world size, shared with the other torch modules'
# plain-init bodies (tests/_shared_launch.py).
_LAUNCH = {n: joint_launch("torch", n, {"broadcast": _broadcast_cases, "sync_batch_norm": _sync_batch_norm_cases},
                           timeout=300) for n in NPS}
