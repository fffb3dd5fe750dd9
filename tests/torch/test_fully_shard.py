"""hvd.fully_shard on real ranks, training: the same training as an unsharded model with averaged
gradients (AdamW, rank-dependent data; blocks wrapped then the root, reshard_after_forward on and
off, a block run twice per forward, a frozen parameter), mixed precision, clipping by the global
norm, no_sync accumulation, fp16 compression, activation checkpointing, GradScaler's recipe, bad
input failing on every rank, and the example. Memory: test_fully_shard_memory.py; checkpoints:
test_fully_shard_checkpoint.py."""

from __future__ import annotations

import cloudpickle
import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch
from tests.torch import fully_shard_nets
from tests.torch.fully_shard_nets import (
    average_grads,
    checkpointed_net,
    compare,
    make_batches,
    net,
    rel,
    value_error,
    wrap,
)

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]
cloudpickle.register_pickle_by_value(fully_shard_nets)  # the ranks cannot import the tests

NPS = [2, 3]


def _equivalence_cases():
    """AdamW (SGD for one), 12 steps: fully sharded == unsharded with averaged gradients (1e-5)."""
    import copy

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    batches = make_batches(8, 12)
    for label, kw, twice, clip in [("reshard", {}, False, None),
                                   ("keep", {"reshard_after_forward": False}, False, None),
                                   ("block twice+clip", {}, True, 0.3)]:
        ref = net(twice=twice)
        ref.blocks[1].a.bias.requires_grad_(False)  # a frozen parameter
        m = wrap(copy.deepcopy(ref), **kw)
        # parameters() are this rank's rows: the shards of every rank tile the model
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            rows = q.shape[0] if q.dim() else 1
            c = -(-rows // n)
            if p.shape[0] != max(0, min(rows, (r + 1) * c) - r * c) or p.dim() != max(q.dim(), 1):
                bad.append(f"rank {r}: {label}: shard {name} has shape {tuple(p.shape)} of {tuple(q.shape)}")
        total = sum(p.numel() for p in ref.parameters())
        mine = hvd.allgather_object(sum(p.numel() for p in m.parameters()))
        if sum(mine) != total:
            bad.append(f"rank {r}: {label}: shards hold {mine} elements, the model {total}")
        # AdamW hardly sees a gradient's scale (a sum instead of an average): SGD does
        opt, kw = ((torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}) if label == "keep"
                   else (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}))
        ro = opt([p for p in ref.parameters() if p.requires_grad], **kw)
        o = opt([p for p in m.parameters() if p.requires_grad], **kw)
        for x, y in batches:
            ro.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            average_grads(ref)
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            if clip is not None:
                want = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
                got = m.clip_grad_norm_(clip)
                if rel(got, want) > 1e-5:
                    bad.append(f"rank {r}: {label}: clip norm {float(got)} != {float(want)}")
            for p in m.parameters():
                if p.requires_grad and p.grad is None:
                    bad.append(f"rank {r}: {label}: no gradient for a shard of shape {tuple(p.shape)}")
                    break
            ro.step()
            o.step()
        compare(bad, label, m, ref, 1e-5)
        if m.blocks[1].a.bias.grad is not None:
            bad.append(f"rank {r}: {label}: the frozen parameter's shard has a gradient")
        # eval without grad: no backward, everything freed again
        with torch.no_grad():
            m(batches[0][0])
        for g in m._groups():
            left = [q.fqn for q in g.params if q.unsharded.untyped_storage().size()]
            if left:
                bad.append(f"rank {r}: {label}: {left} still gathered after a no_grad forward")
    return bad


def _mixed_precision_cases():
    """bf16 compute, fp32 reduce, fp32 shards == an unsharded bf16 copy of fp32 weights."""
    import copy

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    bad = []
    ref = net()
    policy = hvd.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    m = wrap(copy.deepcopy(ref), mp_policy=policy)
    seen = set()
    hooks = [b.a.register_forward_pre_hook(lambda mod, a: seen.add((mod.weight.dtype, a[0].dtype)))
             for b in m.blocks]
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x, y in make_batches(8, 8, seed=7):
        low = copy.deepcopy(ref).to(torch.bfloat16)
        F.cross_entropy(low(x.to(torch.bfloat16)).float(), y).backward()
        for p, q in zip(ref.parameters(), low.parameters()):
            p.grad = hvd.allreduce(q.grad.float(), op=hvd.Average)
        ro.step()
        ro.zero_grad()
        F.cross_entropy(m(x).float(), y).backward()
        o.step()
        for p in m.parameters():
            if p.dtype != torch.float32 or p.grad.dtype != torch.float32:
                bad.append(f"rank {r}: shard {p.dtype}, gradient {p.grad.dtype} (float32 expected)")
                break
        o.zero_grad()
    for h in hooks:
        h.remove()
    if seen != {(torch.bfloat16, torch.bfloat16)}:
        bad.append(f"rank {r}: blocks computed with (weight, input) dtypes {seen}")
    compare(bad, "bf16", m, ref, 1e-5)
    return bad


def _no_sync_and_compression_cases():
    """Three backward passes per step (two under no_sync) == the unsharded sum; fp16 compression
    == averaging fp16 gradients."""
    import copy

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    bad = []
    batches = make_batches(6, 12, seed=3)
    for label in ("no_sync", "set_requires_gradient_sync", "fp16"):
        ref = net()
        m = wrap(copy.deepcopy(ref), **({"compression": hvd.Compression.fp16} if label == "fp16" else {}))
        ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        passes = 1 if label == "fp16" else 3
        for k in range(0, len(batches), passes):
            group = batches[k:k + passes]
            for x, y in group:
                F.cross_entropy(ref(x), y).backward()
            average_grads(ref, torch.float16 if label == "fp16" else None)
            for i, (x, y) in enumerate(group):
                last = i == len(group) - 1
                if label == "no_sync" and not last:
                    with m.no_sync():
                        F.cross_entropy(m(x), y).backward()
                else:
                    m.set_requires_gradient_sync(last)
                    F.cross_entropy(m(x), y).backward()
                if not last and any(p.grad is not None for p in m.parameters()):
                    bad.append(f"rank {r}: {label}: a shard has a gradient before the synced pass")
            ro.step()
            o.step()
            ro.zero_grad()
            o.zero_grad()
        compare(bad, label, m, ref, 1e-3 if label == "fp16" else 1e-5)
    return bad


def _activation_checkpoint_cases():
    """Blocks under torch.utils.checkpoint (recomputed inside backward, stopped early): the same
    training as the unsharded model, and no freed tensor left registered afterwards."""
    import copy

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    bad = []

    ref = checkpointed_net(reentrant=False)
    m = wrap(copy.deepcopy(ref))
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x, y in make_batches(8, 6, seed=5):
        ro.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        average_grads(ref)
        ro.step()
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
        freed = [n for n, p in m.named_parameters() if p.numel() and not p.untyped_storage().nbytes()]
        if freed:
            bad.append(f"rank {r}: freed tensors registered after backward: {freed}")
            break
    if not bad:
        compare(bad, "activation checkpointing", m, ref, 1e-5)
    return bad


def _grad_scaler_cases():
    """DistributedOptimizer's GradScaler recipe (scale, backward, unscale_, clip, step, update; no
    synchronize) on a fully sharded model == an unsharded one with averaged gradients, with an
    inf at step 2 in the gradient of one parameter whose only row rank 0 holds (it comes from
    rank 1's data): every rank skips that step and halves its scale."""
    import copy

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    bad = []

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(7, 7), torch.nn.Tanh())
                                               for _ in range(2)])
            self.scale = torch.nn.Parameter(torch.tensor(1.5))  # 0-d: one row, on rank 0
            self.out = torch.nn.Linear(7, 3)

        def forward(self, x, poison):
            for b in self.blocks:
                x = b(x)
            return self.out(x * self.scale), self.scale * poison

    torch.manual_seed(0)
    ref = Net()
    m = copy.deepcopy(ref)
    for b in m.blocks:
        hvd.fully_shard(b)
    hvd.fully_shard(m)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    s_ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    s = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scales = []
    for step, (x, y) in enumerate(make_batches(8, 6, seed=21)):
        poison = torch.tensor(float("inf") if step == 2 and r == 1 else 0.0)
        ro.zero_grad()
        logits, reg = ref(x, poison)
        s_ref.scale(F.cross_entropy(logits, y) + reg).backward()
        average_grads(ref)
        s_ref.unscale_(ro)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        s_ref.step(ro)
        s_ref.update()
        o.zero_grad()
        logits, reg = m(x, poison)
        s.scale(F.cross_entropy(logits, y) + reg).backward()
        s.unscale_(o)
        m.clip_grad_norm_(1.0)
        s.step(o)
        s.update()
        scales.append((s.get_scale(), s_ref.get_scale()))
    if [a for a, _ in scales] != [b for _, b in scales]:
        bad.append(f"rank {r}: scale history {[a for a, _ in scales]} != the unsharded {[b for _, b in scales]}")
    if not scales[2][0] < scales[1][0]:
        bad.append(f"rank {r}: step 2 was not skipped (scales {scales})")
    compare(bad, "GradScaler", m, ref, 1e-5)
    return bad


def _bad_input_cases():
    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}

    def attempt(key, fn):
        out[key] = value_error(fn)

    # the last rank wraps a module of another shape
    attempt("shapes", lambda: hvd.fully_shard(torch.nn.Linear(4, 5 if r == n - 1 else 6)))
    attempt("modules", lambda: hvd.fully_shard(torch.nn.Linear(4, 4) if r else torch.nn.Conv1d(4, 4, 1)))
    m = hvd.fully_shard(torch.nn.Linear(3, 3))
    attempt("twice", lambda: hvd.fully_shard(m))
    attempt("powersgd", lambda: hvd.fully_shard(torch.nn.Linear(3, 3), compression=hvd.PowerSGD(rank=1)))
    attempt("both", lambda: hvd.fully_shard(torch.nn.Linear(3, 3), compression=hvd.Compression.fp16,
                                            mp_policy=hvd.MixedPrecisionPolicy(reduce_dtype=torch.float32)))
    # a parameter tied between a wrapped block and its parent
    outer = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    outer[1].weight = outer[0].weight
    hvd.fully_shard(outer[0])
    attempt("tied", lambda: hvd.fully_shard(outer))
    return out


def _direct_submodule_cases():
    """A training step that calls the wrapped blocks and the root's own layers directly, never the
    root's forward (as a Lightning ``training_step`` calling ``self.blocks``/``self.out`` does):
    the same weights as the unsharded run (1e-5); every step is one iteration (the order of
    forwards does not grow, the collectives' names start again, the next step prefetches); a
    ``no_grad`` pass called the same way frees every gathered parameter."""
    import copy

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd
    from horovod.torch._shard_params import GROUPS

    hvd.init()
    r = hvd.rank()
    bad = []

    def pieces(model, x):  # what the root's forward does (but the scale), piece by piece from outside
        h = model.inp(x)
        for b in model.blocks:
            h = b(h)
        return model.out(h)

    ref = net()
    m = wrap(copy.deepcopy(ref))
    # no weight decay: the unused scale's shard gets a zero gradient (an unused parameter of a
    # module that reduced), the unsharded one none
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
    root = GROUPS[m]
    for step, (x, y) in enumerate(make_batches(8, 6, seed=31)):
        ro.zero_grad()
        F.cross_entropy(pieces(ref, x), y).backward()
        average_grads(ref)
        ro.step()
        o.zero_grad()
        F.cross_entropy(pieces(m, x), y).backward()
        o.step()
        if len(root.order) != 1 + len(m.blocks) or root.open:
            bad.append(f"rank {r}: step {step}: the iteration's order holds {len(root.order)} modules "
                       f"(want {1 + len(m.blocks)}: the root's own parameters, then each block), open={root.open}")
        seqs = {g.index: dict(g.seq) for g in m._groups()}
        if any(k > 2 for seq in seqs.values() for k in seq.values()):
            bad.append(f"rank {r}: step {step}: the collectives' names did not start again: {seqs}")
    if root.iteration != 6:
        bad.append(f"rank {r}: 6 steps counted as {root.iteration} iterations")
    if root.prev_order != root.order:
        bad.append(f"rank {r}: no prefetch order for the next step")
    compare(bad, "direct", m, ref, 1e-5)
    with torch.no_grad():
        pieces(m, make_batches(8, 1, seed=32)[0][0])
    held = [q.fqn for g in m._groups() for q in g.params if q.allocated()]
    if held or root.open:
        bad.append(f"rank {r}: after a no_grad pass of direct calls, still gathered: {held}, open={root.open}")
    from horovod.torch.fully_shard import is_shard

    unsharded = [n for n, p in m.named_parameters() if not is_shard(p)]
    if unsharded:
        bad.append(f"rank {r}: after a no_grad pass, registered parameters that are not shards: {unsharded}")
    return bad


def _empty_rows_cases():
    """Parameters with fewer rows than ranks and with no element at all (a zero-size dimension):
    ranks whose rows of them are empty train to the unsharded weights (1e-5) and receive
    gradients of their shards' shapes; the gathered state dict has the unsharded shapes."""
    import copy

    import torch

    import horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    bad = []

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(2, 2)  # 2 rows: at np=3 rank 2 holds none
            self.b = torch.nn.Linear(2, 1)  # 1 row: only rank 0 holds it
            self.empty = torch.nn.Parameter(torch.zeros(0, 3))   # no row
            self.hollow = torch.nn.Parameter(torch.zeros(3, 0))  # rows of no element
            self.s = torch.nn.Parameter(torch.tensor(0.5))

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)) * self.s) + self.empty.sum() + self.hollow.sum()

    torch.manual_seed(0)
    ref = Tiny()
    m = copy.deepcopy(ref)
    hvd.fully_shard(m.a)
    hvd.fully_shard(m.b)
    hvd.fully_shard(m)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(40 + r)
    for _ in range(5):
        x = torch.randn(4, 2, generator=g)
        ro.zero_grad()
        ref(x).square().mean().backward()
        for p in ref.parameters():
            if p.numel():
                p.grad = hvd.allreduce(p.grad, op=hvd.Average)
        ro.step()
        o.zero_grad()
        m(x).square().mean().backward()
        for name, p in m.named_parameters():
            if p.grad is None or p.grad.shape != p.shape:
                bad.append(f"rank {r}: shard {name} {tuple(p.shape)} got gradient "
                           f"{None if p.grad is None else tuple(p.grad.shape)}")
        o.step()
    compare(bad, "empty rows", m, ref, 1e-5)
    return bad


# --------------------------------------------------------------------------- tests
def test_fully_shard_matches_unsharded_training(np_):
    fails = _LAUNCH[np_].results("equivalence")
    assert not any(fails), "\n".join(f for rank_fails in fails for f in rank_fails)


def test_fully_shard_mixed_precision(np_):
    fails = _LAUNCH[np_].results("mixed_precision")
    assert not any(fails), "\n".join(f for rank_fails in fails for f in rank_fails)


def test_fully_shard_no_sync_and_compression(np_):
    fails = _LAUNCH[np_].results("no_sync")
    assert not any(fails), "\n".join(f for rank_fails in fails for f in rank_fails)


def test_fully_shard_activation_checkpointing(np_):
    fails = _LAUNCH[np_].results("activation_checkpoint")
    assert not any(fails), "\n".join(f for rank_fails in fails for f in rank_fails)


def test_fully_shard_submodules_called_directly(np_):
    fails = _LAUNCH[np_].results("direct_submodules")
    assert not any(fails), "\n".join(f for rank_fails in fails for f in rank_fails)


def test_fully_shard_parameters_with_empty_rows(np_):
    fails = _LAUNCH[np_].results("empty_rows")
    assert not any(fails), "\n".join(f for rank_fails in fails for f in rank_fails)


def test_fully_shard_grad_scaler_same_recipe_as_distributed_optimizer():
    fails = _SCALER.results("grad_scaler")
    assert not any(fails), "\n".join(f for rank_fails in fails for f in rank_fails)


def test_fully_shard_bad_input_fails_on_every_rank(np_):
    outs = _BAD[np_].results("bad")
    n = len(outs)
    for r, out in enumerate(outs):
        assert f"ranks [{n - 1}]" in out["shapes"] and "weight" in out["shapes"], out["shapes"]
        assert "Conv1d" in out["modules"] and "Linear" in out["modules"], out["modules"]
        assert "already fully sharded" in out["twice"], out["twice"]
        assert "PowerSGD" in out["powersgd"] and "stateful" in out["powersgd"], out["powersgd"]
        assert "reduce_dtype" in out["both"], out["both"]
        assert f"rank {r}" in out["tied"] and "1.weight" in out["tied"] and "tied to weight" in out["tied"], out["tied"]


def test_fully_shard_example_runs(tmp_path):
    import os
    import re
    import sys

    import torch

    from horovod.testing import run_mpi_script

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ck = tmp_path / "ck.pt"
    res = run_mpi_script([sys.executable, os.path.join(root, "examples", "pytorch", "pytorch_fully_shard.py"),
                          "--steps", "30", "--bf16", "--checkpoint", str(ck)], np=2, timeout=300)
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", res.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], res.stdout[-3000:]
    held = [float(x) / 100 for x in re.findall(r"parameter bytes \(([0-9.]+)%\)", res.stdout)]
    assert len(held) == 2 and all(h < 0.55 for h in held), res.stdout[-3000:]
    state = torch.load(ck, weights_only=False)
    assert state["model"]["blocks.0.up.weight"].shape == (512, 128)
    assert set(state["optim"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.fixture(params=NPS, ids=lambda n: f"np{n}")
def np_(request):
    return request.param


_LAUNCH = {n: joint_launch("torch", n, {"equivalence": _equivalence_cases,
                                        "mixed_precision": _mixed_precision_cases,
                                        "no_sync": _no_sync_and_compression_cases,
                                        "activation_checkpoint": _activation_checkpoint_cases,
                                        "direct_submodules": _direct_submodule_cases,
                                        "empty_rows": _empty_rows_cases}, timeout=540)
           for n in NPS}
# np=2 is the GradScaler recipe's one world size (rank 0 holds the poisoned row, rank 1's data).
_SCALER = joint_launch("torch", 2, {"grad_scaler": _grad_scaler_cases}, timeout=300)
_BAD = {n: joint_launch("torch", n, {"bad": _bad_input_cases}, timeout=60, late=True) for n in NPS}
