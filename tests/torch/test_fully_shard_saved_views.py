"""hvd.fully_shard on real ranks: each unsharded parameter shows its allgather output as it is (no
copy) and autograd's saved views of it are kept by parameter (saved-tensor hooks), so the output
is freed after the forward and gathered anew for the backward; the same training as the unsharded
model (1e-5) with those hooks, with reentrant activation checkpointing, and under a user's own
saved-tensor hooks (the parameters then keep their own storage)."""

from __future__ import annotations

import cloudpickle
import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch
from tests.torch import fully_shard_nets
from tests.torch.fully_shard_nets import average_grads, checkpointed_net, compare, make_batches, net, wrap

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]
cloudpickle.register_pickle_by_value(fully_shard_nets)  # the ranks cannot import the tests

NPS = [2, 3]


def _saved_view_cases():
    import copy
    import gc

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd
    from horovod.torch import _shard_hooks
    from horovod.torch._shard_params import GROUPS

    hvd.init()
    r = hvd.rank()
    out = {}

    def use_count(st):
        return torch._C._storage_Use_Count(st._cdata)

    def run(label, forward=None, hooks=True, steps=4):
        """Train ``steps`` AdamW steps against the unsharded model; on the first, record inside
        block 1's first layer whether its weight shows the allgather output, and after the forward
        how many references to that storage are left besides ours."""
        ref = net(blocks=3)
        m = wrap(copy.deepcopy(ref))
        seen = {}

        def inside(mod, args):
            if "borrowed" not in seen:  # the first step's forward
                q = next(q for q in GROUPS[m.blocks[1]].params if q.fqn == "a.weight")
                seen["borrowed"] = q.borrowed
                seen["storage"] = mod.weight.untyped_storage()

        handle = m.blocks[1].a.register_forward_pre_hook(inside)
        ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        real = _shard_hooks._start_saving
        if not hooks:  # the control: never push our saved-tensor hooks
            _shard_hooks._start_saving = lambda g, root, recompute: None
        try:
            for i, (x, y) in enumerate(make_batches(8, steps, seed=31)):
                ro.zero_grad()
                F.cross_entropy(ref(x), y).backward()
                average_grads(ref)
                ro.step()
                o.zero_grad()
                loss = F.cross_entropy((forward or m)(x), y)
                if i == 0:
                    st = seen.pop("storage")
                    # references to block 1's gathered weight left after the forward (ours: 1)
                    seen["left"] = use_count(st) - 1
                    seen["bytes"] = st.nbytes()
                    del st
                    seen["saved_views"] = sum(1 for obj in gc.get_objects()
                                              if type(obj) is _shard_hooks._SavedView)
                loss.backward()
                o.step()
        finally:
            _shard_hooks._start_saving = real
            handle.remove()
        bad = []
        compare(bad, label, m, ref, 1e-5)
        seen["bad"] = bad
        seen["rank"] = r
        return seen

    out["hooks"] = run("saved views by parameter")
    out["control"] = run("no saved-tensor hooks (control)", hooks=False)

    # reentrant activation checkpointing: each block's forward runs without grad and is recomputed
    # in backward
    ref = checkpointed_net(reentrant=True)
    m = wrap(copy.deepcopy(ref))
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x, y in make_batches(8, 4, seed=32):
        ro.zero_grad()
        F.cross_entropy(ref(x.requires_grad_()), y).backward()
        average_grads(ref)
        ro.step()
        o.zero_grad()
        F.cross_entropy(m(x.detach().requires_grad_()), y).backward()
        o.step()
    bad: list[str] = []
    compare(bad, "reentrant activation checkpointing", m, ref, 1e-5)
    out["reentrant"] = {"bad": bad}

    # a user's own saved-tensor hooks around the step (someone else's: the parameters keep their
    # own storage from forward to backward)
    packed = []

    def pack(t):
        packed.append(1)
        return t

    ref = net(blocks=3)
    m = wrap(copy.deepcopy(ref))
    seen = {}

    def look(mod, args):
        seen.setdefault("borrowed", next(q for q in GROUPS[m.blocks[1]].params if q.fqn == "a.weight").borrowed)

    m.blocks[1].a.register_forward_pre_hook(look)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for x, y in make_batches(8, 4, seed=33):
        ro.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        average_grads(ref)
        ro.step()
        o.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
    bad = []
    compare(bad, "under a user's saved-tensor hooks", m, ref, 1e-5)
    out["foreign"] = {"bad": bad, "borrowed": seen.get("borrowed"), "packed": len(packed)}
    return out


def test_fully_shard_gathered_output_shown_and_freed_after_forward(np_):
    """Inside a block's forward its weight is the allgather's output itself; after the forward
    nothing but the test references that storage (autograd keeps its saved views by parameter),
    and training equals the unsharded run. Without the saved-tensor hooks (the control) autograd's
    saved views keep the output alive after the forward, which this test detects."""
    for out in _LAUNCH[np_].results("saved_views"):
        h, c = out["hooks"], out["control"]
        assert h["borrowed"] is True, h
        assert h["left"] == 0 and h["bytes"] > 0, h  # freed after the forward: nothing else holds it
        assert h["saved_views"] >= 3, h  # each block's saved views of its weights, by parameter
        assert not h["bad"], h["bad"]
        assert c["left"] > 0 and c["saved_views"] == 0, c  # the check can fail
        assert not c["bad"], c["bad"]  # (values stay right: the output is only kept longer)


def test_fully_shard_reentrant_checkpoint_and_foreign_saved_tensor_hooks(np_):
    for out in _LAUNCH[np_].results("saved_views"):
        assert not out["reentrant"]["bad"], out["reentrant"]["bad"]
        f = out["foreign"]
        assert not f["bad"], f["bad"]
        assert f["borrowed"] is False and f["packed"] > 0, f  # own storage under someone else's hooks


@pytest.fixture(params=NPS, ids=lambda n: f"np{n}")
def np_(request):
    return request.param


_LAUNCH = {n: joint_launch("torch", n, {"saved_views": _saved_view_cases}, timeout=240) for n in NPS}
