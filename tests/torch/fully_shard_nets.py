"""The models, data and comparisons that the fully_shard tests share (tests/torch/test_fully_shard*.py;
shipped to the ranks by value)."""

from __future__ import annotations


def net(d=9, blocks=3, twice=False):
    import torch

    class Block(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.a = torch.nn.Linear(d, 2 * d)
            self.b = torch.nn.Linear(2 * d, d)

        def forward(self, x):
            return x + self.b(torch.tanh(self.a(x)))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(7, d)
            self.blocks = torch.nn.ModuleList([Block(d) for _ in range(blocks)])
            self.scale = torch.nn.Parameter(torch.tensor(1.5))  # 0-d: one row
            self.out = torch.nn.Linear(d, 3)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            if twice:
                x = self.blocks[0](x)
            return self.out(x * self.scale)

    torch.manual_seed(0)
    return Net()



def checkpointed_net(reentrant):
    """Three blocks under torch.utils.checkpoint (recomputed inside backward) and an output layer."""
    import torch
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(7, 7), torch.nn.Tanh())
                                               for _ in range(3)])
            self.out = torch.nn.Linear(7, 3)

        def forward(self, x):
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=reentrant)
            return self.out(x)

    torch.manual_seed(0)
    return Net()

def wrap(m, **kw):
    import horovod.torch as hvd

    for b in m.blocks:
        hvd.fully_shard(b, **kw)
    hvd.fully_shard(m, **{k: v for k, v in kw.items() if k != "reshard_after_forward"})
    return m


def make_batches(n, steps, seed=100, rank=None):
    """``steps`` batches of ``n`` rows of ``rank``'s data (default: this rank's)."""
    import torch

    if rank is None:
        import horovod.torch as hvd

        rank = hvd.rank()
    g = torch.Generator().manual_seed(seed + rank)  # rank-dependent data
    return [(torch.randn(n, 7, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


def batches_for(rank, steps, seed=11):
    """``make_batches(8, steps, seed=11)`` of rank ``rank`` (where no hvd runs)."""
    return make_batches(8, steps, seed, rank)


def rel(a, b):
    if not b.numel():  # a parameter of no element
        return 0.0 if a.shape == b.shape else float("inf")
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def compare(bad, label, model, ref, tol):
    import horovod.torch as hvd

    full = model.full_state_dict()
    want = ref.state_dict()
    if sorted(full) != sorted(want):
        bad.append(f"rank {hvd.rank()}: {label}: keys {sorted(full)} != {sorted(want)}")
    for k, v in want.items():
        if k in full and (full[k].shape != v.shape or rel(full[k], v) > tol):
            bad.append(f"rank {hvd.rank()}: {label}: {k} differs from the unsharded run by "
                       f"{rel(full[k], v) if full[k].shape == v.shape else full[k].shape}")


def average_grads(ref, dtype=None):
    import horovod.torch as hvd

    for p in ref.parameters():
        if p.grad is not None:
            g = p.grad if dtype is None else p.grad.to(dtype)
            p.grad = hvd.allreduce(g, op=hvd.Average).to(p.dtype)


def value_error(fn):
    """The message of the ValueError that ``fn()`` raises, or "no error"."""
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"
