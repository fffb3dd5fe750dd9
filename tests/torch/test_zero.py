"""ZeroRedundancyOptimizer on real ranks: the same training as DistributedOptimizer (stage 1 and
2, AdamW, 40 steps, rank-dependent data; parameter groups, an LR scheduler, clipping by the global
norm, GradScaler, a compiled model), the memory goal per rank, the consolidated state loadable by
the plain optimizer, and bad input failing on every rank."""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess, JOINT_TIMEOUT]

NPS = [2, 3]


def _model():
    import torch

    torch.manual_seed(0)
    # uneven sizes (odd world sizes must split them), one bias-free layer, two dtypes of sizes
    return torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 20),
                               torch.nn.ReLU(), torch.nn.Linear(20, 5, bias=False),
                               torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _state_bytes(state):
    import torch

    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _equivalence_cases():
    """40 AdamW steps, each rank on its own data: stage 1 and 2 == DistributedOptimizer."""
    import copy

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    g = torch.Generator().manual_seed(100 + r)  # rank-dependent data
    batches = [(torch.randn(8, 7, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(40)]

    def groups(model):
        ps = list(model.parameters())
        return [{"params": ps[:3], "lr": 3e-3, "weight_decay": 0.1}, {"params": ps[3:]}]

    configs = [
        # label, params(model), kwargs, scheduler, clip, backward passes per step
        ("AdamW", lambda m: m.parameters(), {"lr": 1e-2}, False, None, 1),
        ("AdamW groups+StepLR+clip", groups, {"lr": 1e-2, "weight_decay": 0.01}, True, 0.5, 1),
        ("AdamW 2 passes", lambda m: m.parameters(), {"lr": 1e-2}, False, None, 2),
    ]
    for label, params, kw, sched, clip, passes in configs:
        ref = _model()
        ref_opt = hvd.DistributedOptimizer(torch.optim.AdamW(params(ref), **kw),
                                           named_parameters=ref.named_parameters(),
                                           backward_passes_per_step=passes)
        runs = [(ref, ref_opt, "DistributedOptimizer")]
        for stage in (1, 2):
            m = copy.deepcopy(ref)
            o = hvd.ZeroRedundancyOptimizer(params(m), torch.optim.AdamW, stage=stage,
                                            named_parameters=m.named_parameters(),
                                            backward_passes_per_step=passes, **kw)
            if "groups" in label:  # tiny buckets: many collectives, parameters split across them
                o.bucket_bytes = 200
            if stage == 2 and label != "AdamW":  # one schedule throughout ("auto" tries both)
                o.reduce_schedule = "allreduce" if "groups" in label else "alltoall"
            runs.append((m, o, f"stage {stage}"))
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5) if sched else None
                  for _, o, _ in runs]
        grad_bytes = {}
        for k in range(0, 40, passes):
            for (m, o, name), s in zip(runs, scheds):
                o.zero_grad()
                for x, y in batches[k:k + passes]:
                    F.cross_entropy(m(x), y).backward()
                if clip is not None:
                    if isinstance(o, hvd.ZeroRedundancyOptimizer):
                        o.clip_grad_norm_(clip)
                    else:
                        o.synchronize()
                        torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
                if name == "stage 2":
                    o.synchronize()
                    grad_bytes[k] = sum(p.grad.numel() * p.grad.element_size()
                                        for p in m.parameters() if p.grad is not None)
                if clip is not None and not isinstance(o, hvd.ZeroRedundancyOptimizer):
                    with o.skip_synchronize():
                        o.step()
                else:
                    o.step()
                if s is not None:
                    s.step()
        for m, o, name in runs[1:]:
            for (pn, p), q in zip(m.named_parameters(), ref.parameters()):
                if _rel(p.detach(), q.detach()) > 1e-5:
                    bad.append(f"rank {r}: {label}: {name}: {pn} differs from DistributedOptimizer "
                               f"by {_rel(p.detach(), q.detach()):.2e} (relative)")
            if [g["lr"] for g in o.param_groups] != [g["lr"] for g in ref_opt.param_groups]:
                bad.append(f"rank {r}: {label}: {name}: lr {o.param_groups[0]['lr']} != "
                           f"{ref_opt.param_groups[0]['lr']}")
            # memory: this rank's optimizer state (and stage 2's gradients) against the goal
            total = _state_bytes(ref_opt.state)
            largest = max(p.numel() * p.element_size() for p in m.parameters())
            mine = _state_bytes(o.optim.state)
            if mine > total / n * 1.05 + 2 * largest:  # AdamW: two moments per parameter
                bad.append(f"rank {r}: {label}: {name}: state {mine} B > {total}/{n}*1.05 + "
                           f"2*{largest}")
            if name == "stage 2":
                gtotal = sum(p.numel() * p.element_size() for p in m.parameters())
                worst = max(grad_bytes.values())
                if worst > gtotal / n * 1.05 + largest:
                    bad.append(f"rank {r}: {label}: stage 2 keeps {worst} B of gradients "
                               f"> {gtotal}/{n}*1.05 + {largest}")
            # consolidated state: loadable by plain AdamW, equal to the unsharded state
            o.consolidate_state_dict(to=0)
            if r == 0:
                sd = o.state_dict()
                plain = torch.optim.AdamW(params(copy.deepcopy(m)), **kw)
                plain.load_state_dict(sd)
                want = ref_opt.state_dict()
                if sorted(sd["state"]) != sorted(want["state"]):
                    bad.append(f"{label}: {name}: consolidated ids {sorted(sd['state'])} != "
                               f"{sorted(want['state'])}")
                for pid, st in want["state"].items():
                    for key, v in st.items():
                        got = sd["state"].get(pid, {}).get(key)
                        if got is None or _rel(got.float(), v.float()) > 1e-5:
                            bad.append(f"{label}: {name}: state {pid}.{key} differs")
                if [g["lr"] for g in sd["param_groups"]] != [g["lr"] for g in want["param_groups"]]:
                    bad.append(f"{label}: {name}: consolidated lr differ")
            # load_state_dict(full) on every rank keeps its shard and restores it
            full = o.full_state_dict(None)
            before = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in o.optim.state.items()}
            o.load_state_dict(full)
            for k, v in o.optim.state.items():
                for kk, vv in v.items():
                    if not torch.equal(vv, before[k][kk]):
                        bad.append(f"rank {r}: {label}: {name}: reloaded state {k}.{kk} differs")
            if len(o.optim.state) != len(before):
                bad.append(f"rank {r}: {label}: {name}: reload keeps {len(o.optim.state)} entries, "
                           f"had {len(before)}")
    return bad


def _scaled_runs(ref, batches, at, on, label, explicit=True):
    """DistributedOptimizer, stage 1 and stage 2 under GradScaler, an overflow in the last
    parameter's gradient at step ``at`` on rank ``on`` only: one step skipped on every rank, the
    same weights. ``explicit``: upstream's recipe (``synchronize()``, then ``step()`` inside
    ``skip_synchronize()``); otherwise PyTorch's own (docs/pytorch.md), the gradients averaged by
    the end of backward, clipped after ``unscale_`` (ZeRO: across the shards)."""
    import copy

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    r = hvd.rank()
    bad = []
    ref_opt = hvd.DistributedOptimizer(torch.optim.Adam(ref.parameters(), lr=1e-2),
                                       named_parameters=ref.named_parameters())
    runs = [(ref, ref_opt)]
    for stage in (1, 2):
        m = copy.deepcopy(ref)
        runs.append((m, hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, stage=stage,
                                                    lr=1e-2)))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in runs]
    for k, (x, y) in enumerate(batches):
        for (m, o), sc in zip(runs, scalers):
            o.zero_grad()
            hook = None
            if k == at and r == on:
                hook = list(m.parameters())[-1].register_hook(
                    lambda grad: grad.index_fill(0, torch.tensor([0]), float("inf")))
            sc.scale(F.cross_entropy(m(x), y)).backward()
            if hook is not None:
                hook.remove()
            if explicit:
                o.synchronize()
                sc.unscale_(o)
                with o.skip_synchronize():
                    sc.step(o)
            else:
                sc.unscale_(o)
                if isinstance(o, hvd.ZeroRedundancyOptimizer):
                    o.clip_grad_norm_(0.5)
                else:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                sc.step(o)
            sc.update()
    for i, ((m, _o), sc) in enumerate(zip(runs, scalers)):
        scales = hvd.allgather_object(sc.get_scale())
        if len(set(scales)) != 1 or scales[0] != 2.0 ** 9:
            bad.append(f"rank {r}: {label}: run {i}: scales {scales} (one skipped step expected "
                       "everywhere)")
        if i:
            for (pn, p), q in zip(m.named_parameters(), ref.parameters()):
                if _rel(p.detach(), q.detach()) > 1e-5:
                    bad.append(f"rank {r}: {label} stage {i}: {pn} differs by "
                               f"{_rel(p.detach(), q.detach()):.2e}")
    return bad


def _scaler_and_compile_cases():
    """GradScaler (an overflow on one rank skips the step on every rank) and a compiled model."""
    import copy

    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    bad = []
    g = torch.Generator().manual_seed(7 + r)
    batches = [(torch.randn(6, 7, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(6)]
    bad += _scaled_runs(_model(), batches, at=3, on=n - 1, label="GradScaler")
    # fewer parameters than ranks at np=3 (Linear: 2): a rank that owns nothing still steps
    # with the scaler, and skips the overflowing step with the others
    torch.manual_seed(1)
    bad += _scaled_runs(torch.nn.Linear(7, 3), batches[:4], at=2, on=0, label="2 parameters")
    # PyTorch's recipe without synchronize()/skip_synchronize(): stage 2's gradients are reduced
    # by the end of backward ("No inf checks were recorded for this optimizer" before)
    bad += _scaled_runs(_model(), batches, at=3, on=0, label="GradScaler, no synchronize()",
                        explicit=False)
    torch.manual_seed(1)
    bad += _scaled_runs(torch.nn.Linear(7, 3), batches[:4], at=1, on=n - 1,
                        label="2 parameters, no synchronize()", explicit=False)
    # torch.compile'd model (aot_eager: the compiled autograd path without a C++ toolchain's cost)
    ref = _model()
    ref_opt = hvd.DistributedOptimizer(torch.optim.AdamW(ref.parameters(), lr=1e-2),
                                       named_parameters=ref.named_parameters())
    runs = [(ref, ref_opt)]
    for stage in (1, 2):
        m = copy.deepcopy(ref)
        runs.append((m, hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, stage=stage,
                                                    lr=1e-2)))
    compiled = [torch.compile(m, backend="aot_eager") for m, _ in runs]
    for x, y in batches[:4]:
        for (_m, o), c in zip(runs, compiled):
            o.zero_grad()
            F.cross_entropy(c(x), y).backward()
            o.step()
    for stage, (m, _) in enumerate(runs[1:], start=1):
        for (pn, p), q in zip(m.named_parameters(), ref.parameters()):
            if _rel(p.detach(), q.detach()) > 1e-5:
                bad.append(f"rank {r}: compiled stage {stage}: {pn} differs by "
                           f"{_rel(p.detach(), q.detach()):.2e}")
    return bad


def _bad_input_cases():
    """Each bad input raises ValueError on every rank, naming the problem."""
    import torch

    import horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = "no error"
        except ValueError as exc:
            out[key] = str(exc)

    m = _model()
    attempt("stage3", lambda: hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, stage=3, lr=0.1))
    attempt("stage_x", lambda: hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, stage="two", lr=0.1))
    attempt("adasum", lambda: hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, op=hvd.Adasum, lr=0.1))
    # two devices on one rank (the meta device stands in for a second device on this CPU machine)
    devs = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, device="meta"))]
    attempt("devices", lambda: hvd.ZeroRedundancyOptimizer(devs, torch.optim.SGD, lr=0.1))
    # only the last rank's model differs
    other = [torch.nn.Parameter(torch.zeros(4 if r == hvd.size() - 1 else 5))]
    attempt("models", lambda: hvd.ZeroRedundancyOptimizer(other, torch.optim.SGD, lr=0.1))
    # stage 3 on one rank only: the others must fail too, not wait
    attempt("stage3_one_rank", lambda: hvd.ZeroRedundancyOptimizer(
        m.parameters(), torch.optim.SGD, stage=3 if r == 0 else 1, lr=0.1))
    z = hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, lr=0.1)
    try:
        z.state_dict()
        out["unconsolidated"] = "no error"
    except RuntimeError as exc:
        out["unconsolidated"] = str(exc)
    # one rank's shard instead of the full state (it does not say which parameters it holds)
    attempt("shard_state", lambda: z.load_state_dict(z.optim.state_dict()))
    attempt("wrong_state", lambda: z.load_state_dict(
        torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1).state_dict()))
    return out


def test_zero_matches_distributed_optimizer(np_):
    fails = _LAUNCH[np_].results("equivalence")
    assert not any(fails), "\n".join(f for rank_fails in fails for f in rank_fails)


def test_zero_grad_scaler_and_compiled_model(np_):
    fails = _LAUNCH[np_].results("scaler_compile")
    assert not any(fails), "\n".join(f for rank_fails in fails for f in rank_fails)


def test_zero_bad_input_fails_on_every_rank(np_):
    outs = _BAD[np_].results("bad")
    n = len(outs)
    for r, out in enumerate(outs):
        assert "stage=3" in out["stage3"] and "not implemented" in out["stage3"], out["stage3"]
        assert "stage='two'" in out["stage_x"], out["stage_x"]
        assert "Adasum" in out["adasum"] or "op=" in out["adasum"], out["adasum"]
        assert "different devices" in out["devices"] and "meta" in out["devices"], out["devices"]
        assert f"ranks [{n - 1}]" in out["models"], out["models"]
        assert "rank 0: stage=3" in out["stage3_one_rank"], (r, out["stage3_one_rank"])
        assert f"on rank {r}" in out["unconsolidated"] and "consolidate_state_dict" in out["unconsolidated"]
        assert "groups of sizes" in out["wrong_state"], out["wrong_state"]
        assert f"on rank {r}" in out["shard_state"] and "opt.optim.state_dict()" in out["shard_state"], \
            out["shard_state"]


def test_partition_is_balanced_by_bytes():
    from horovod.torch.zero import partition_by_bytes

    sizes = [400, 7, 1000, 1000, 3, 250, 250, 999, 12, 64]
    for n in (1, 2, 3, 4, 7):
        owner = partition_by_bytes(sizes, n)
        loads = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(n)]
        assert sum(loads) == sum(sizes)
        assert max(loads) <= sum(sizes) / n + max(sizes), (n, loads)
        assert owner == partition_by_bytes(list(sizes), n)  # deterministic


@pytest.fixture(params=NPS, ids=lambda n: f"np{n}")
def np_(request):
    return request.param


_LAUNCH = {n: joint_launch("torch", n, {"equivalence": _equivalence_cases,
                                        "scaler_compile": _scaler_and_compile_cases}, timeout=300)
           for n in NPS}
_BAD = {n: joint_launch("torch", n, {"bad": _bad_input_cases}, timeout=90, late=True) for n in NPS}
