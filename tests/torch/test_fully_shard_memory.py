"""hvd.fully_shard on real ranks, memory: the gathered parameters freed between forward and
backward (kept with reshard_after_forward=False), the live tensors each rank holds in forward,
backward and after a step (np=4), and each rank's holdings against the issue's bounds, the same
model replicated failing them, the rows disjoint and complete (np=4)."""

from __future__ import annotations

import cloudpickle
import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch
from tests.torch import fully_shard_nets
from tests.torch.fully_shard_nets import make_batches, net, wrap

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]
cloudpickle.register_pickle_by_value(fully_shard_nets)  # the ranks cannot import the tests

NPS = [2, 3]


def _reshard_cases():
    """Between forward and backward the blocks' gathered parameters have storage 0 (kept with
    reshard_after_forward=False); after backward nothing stays gathered."""
    import torch.nn.functional as F

    import horovod.torch as hvd
    from horovod.torch._shard_params import GROUPS

    hvd.init()
    r = hvd.rank()
    out = {}
    x, y = make_batches(4, 1)[0]
    for raf in (True, False):
        m = wrap(net(blocks=4), reshard_after_forward=raf)
        inside = []
        m.blocks[2].b.register_forward_pre_hook(
            lambda mod, a, inside=inside: inside.append(mod.weight.untyped_storage().nbytes()))
        loss = F.cross_entropy(m(x), y)
        between = [sum(q.unsharded.untyped_storage().nbytes() for q in GROUPS[b].params)
                   for b in m.blocks]
        shard_shapes = {tuple(p.shape) for p in m.blocks[2].parameters()}
        loss.backward()
        after = [sum(q.unsharded.untyped_storage().nbytes() for q in g.params) for g in m._groups()]
        out[raf] = (inside, between, after, shard_shapes, r)
    return out


def _memory_cases():
    """np=4: live tensors (every torch tensor the garbage collector can reach, storages counted
    once) against the unsharded sizes."""
    import gc

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()

    kinds = (torch.Tensor, torch.nn.Parameter)

    def live():  # what is reachable (garbage in reference cycles collected first)
        gc.collect()
        seen, total = set(), 0
        for o in gc.get_objects():
            if type(o) in kinds:
                st = o.untyped_storage()
                if st.nbytes() and st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    total += st.nbytes()
        return total

    gc.collect()
    base = live()
    m = net(d=64, blocks=6)  # six equal blocks of 16.6k parameters; no parameter dominates
    p_total = sum(p.numel() * 4 for p in m.parameters())
    block = sum(p.numel() * 4 for p in m.blocks[0].parameters())
    root = p_total - sum(p.numel() * 4 for p in m.blocks.parameters())  # gathered throughout
    wrap(m)
    gc.collect()
    after_wrap = live() - base
    fwd, bwd = [], []
    hooks = []
    for b in m.blocks[1::2]:  # inside a block's forward: its parameters gathered, the others sharded
        hooks.append(b.b.register_forward_pre_hook(lambda mod, a: fwd.append(live() - base)))
        # as a block's backward starts (after fully_shard's own hook has gathered it)
        hooks.append(b.register_forward_hook(
            lambda mod, a, out: (out.register_hook(lambda g: bwd.append(live() - base)), None)[1]))
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = torch.randn(1, 7), torch.tensor([1])
    steps = []
    for _ in range(3):
        F.cross_entropy(m(x), y).backward()
        for h in hooks:  # measured in the first step (before AdamW's state exists)
            h.remove()
        o.step()
        gc.collect()
        steps.append(live() - base)  # shards, their gradients and AdamW's two moments
        o.zero_grad()
    state = sum(v.numel() * v.element_size() for s in o.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"p_total": p_total, "block": block, "root": root, "after_wrap": after_wrap, "fwd_peak": max(fwd),
            "bwd_peak": max(bwd), "blocks_measured": (len(fwd), len(bwd)),
            "step": max(steps), "state": state}


def _holdings_cases():
    """np=4: the bytes of the tensors each rank holds (parameters' storages, AdamW's state after a
    step), for the fully sharded model and, as the control the bounds must reject, the same model
    replicated (what DistributedOptimizer keeps); and each rank's rows, to check that they tile
    every parameter."""
    import copy

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()

    def held(model, opt):
        seen, params = set(), 0
        for p in model.parameters():
            st = p.untyped_storage()
            if st.data_ptr() not in seen:  # the shards of a module are views of one buffer
                seen.add(st.data_ptr())
                params += st.nbytes()
        state = sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        return params, state

    ref = net(d=64, blocks=6)  # six equal blocks; no parameter dominates
    sizes = {n: p.numel() * 4 for n, p in ref.named_parameters()}
    block = sum(p.numel() * 4 for p in ref.blocks[0].parameters())
    m = wrap(copy.deepcopy(ref))
    out = {"sizes": sizes, "block": block}
    x, y = make_batches(4, 1)[0]
    for label, model in (("sharded", m), ("replicated", ref)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        out[label] = held(model, opt)
    from horovod.torch.fully_shard import row_shards

    out["rows"] = {k: (rs.lo, rs.hi, rs.shape) for k, rs in row_shards(m).items()}
    return out


# --------------------------------------------------------------------------- tests
def test_fully_shard_frees_between_forward_and_backward(np_):
    for out in _LAUNCH[np_].results("reshard"):
        (inside, between, after, shapes, r) = out[True]
        assert inside and all(b > 0 for b in inside), (r, inside)  # gathered inside the forward
        assert between == [0] * 4, (r, between)  # freed after it
        assert after == [0] * len(after), (r, after)
        assert all(s[0] < 18 for s in shapes), (r, shapes)  # the block's parameters are shards again
        (_inside, between, after, _shapes, r) = out[False]
        assert all(b > 0 for b in between), (r, between)  # kept for the backward
        assert after == [0] * len(after), (r, after)


def test_fully_shard_memory_per_rank_np4():
    outs = _MEM.results("memory")
    for r, o in enumerate(outs):
        p, block = o["p_total"], o["block"]
        # parameters: 1/4 of them (one row of padding per parameter at most) once wrapped ...
        assert o["after_wrap"] <= p / 4 + 2048, (r, o)
        # ... plus the one block whose forward runs, and the root's own parameters (the root
        # stays gathered until the backward, as FSDP2's); the activations saved so far (batch of 1:
        # about 1.5 KB per block)
        assert o["fwd_peak"] <= p / 4 + block + o["root"] + 8192, (r, o)
        assert o["blocks_measured"] == (3, 3), (r, o)
        # in backward: the shards, the gradients reduced so far (<= 1/4), the gathered block and
        # the previous one's reduction in flight (its gradients), the root's parameters (measured
        # 288292 of 337816 at the second block; one block's gradients more, which the engine
        # kept after their reduce-scatter had finished until it dropped a finished operation's
        # inputs before waking the waiter, broke it now and then: docs/fully_shard.md, Holdings)
        assert o["bwd_peak"] <= 2 * p / 4 + 2 * block + o["root"] + 2048, (r, o)
        # after a step: 1/4 of parameters, gradients and AdamW's two moments, plus two blocks
        assert o["state"] <= 2 * p / 4 + 4096, (r, o)
        assert o["step"] <= 4 * p / 4 + 2 * block, (r, o)
        # a replicated model (any rank holding everything) would break these bounds
        assert 4 * p > 4 * p / 4 + 2 * block + 4096 and p > p / 4 + block + 2048


def _within_goal(params, state, total, block):
    """The issue's goal at np=4: <= 1/4 of the parameters plus one block, <= 1/4 of AdamW's state
    (two moments) plus two blocks' worth of it."""
    return params <= total / 4 + block and state <= 2 * total / 4 + 2 * (2 * block)


def test_fully_shard_holdings_np4():
    """Each rank holds <= 1/4 of the parameters + one block and <= 1/4 of AdamW's state + two
    blocks (tensor bytes counted, on a model where no parameter dominates); the same model
    replicated fails the same bounds; the ranks' rows of every parameter are disjoint and
    complete."""
    outs = _MEM.results("holdings")
    sizes, block = outs[0]["sizes"], outs[0]["block"]
    total = sum(sizes.values())
    assert max(sizes.values()) < block < total / 5  # no parameter dominates; a block is small
    for r, o in enumerate(outs):
        params, state = o["sharded"]
        assert _within_goal(params, state, total, block), (r, o["sharded"], total, block)
        # the control: every rank holding everything breaks both bounds
        rp, rs = o["replicated"]
        assert rp == total and not _within_goal(rp, rs, total, block), (r, o["replicated"])
        assert not _within_goal(rp, state, total, block) and not _within_goal(params, rs, total, block)
    for name in sizes:
        spans = sorted(o["rows"][name][:2] for o in outs)
        shape = outs[0]["rows"][name][2]
        rows = shape[0] if shape else 1
        covered = [i for lo, hi in spans for i in range(lo, hi)]
        assert covered == list(range(rows)), (name, spans)  # disjoint and complete


@pytest.fixture(params=NPS, ids=lambda n: f"np{n}")
def np_(request):
    return request.param


_LAUNCH = {n: joint_launch("torch", n, {"reshard": _reshard_cases}, timeout=120) for n in NPS}
# One np=4 launch: the live-tensor bounds first (the holdings' model does not count in them), then
# the tensor bytes each rank holds.
_MEM = joint_launch("torch", 4, {"memory": _memory_cases, "holdings": _holdings_cases}, timeout=780)
