"""ZeroRedundancyOptimizer really shards, on real ranks: on a model where no parameter dominates
(the largest holds about 8% of the parameters), the parameters whose optimizer state each rank
holds are disjoint across ranks and cover every parameter, and their bytes sum to the whole state
once; each rank holds at most total/N + the largest parameter's state (a replicated state, 1 x
total, breaks it at np=2). Stage 2 (both schedules): after the reduction and after the step, each
rank holds only its own parameters' gradients (disjoint, complete, at most total/N + largest).
Stage 2's inf agreement, at np=2 in the torch launch shared with the other modules: an infinite
gradient on one rank makes every rank see a non-finite gradient (checked before any step, so a
broken agreement fails at once instead of hanging in the step), and GradScaler then skips the step
everywhere."""

from __future__ import annotations

import pytest

from tests._shared_launch import JOINT_TIMEOUT, joint_launch

pytestmark = [pytest.mark.multiprocess]

NPS = [2, 3]
WIDTHS = [20, 24, 22, 26, 21, 25, 23, 24, 20, 22, 26, 24, 21]  # 12 layers of similar size


def _model():
    import torch

    torch.manual_seed(3)
    layers = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _sharding_cases():
    """Two AdamW steps per configuration; what each rank holds after the reduction and after
    the step."""
    import copy

    import torch

    import horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    base = _model()
    out = {}
    for stage, schedule in ((1, None), (2, "alltoall"), (2, "allreduce")):
        m = copy.deepcopy(base)
        params = list(m.parameters())
        opt = hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, stage=stage, lr=1e-2)
        if schedule is not None:
            opt.reduce_schedule = schedule
        g = torch.Generator().manual_seed(50 + r)
        held = []
        for _ in range(2):
            opt.zero_grad()
            m(torch.randn(8, WIDTHS[0], generator=g)).square().mean().backward()
            opt.synchronize()
            after_reduction = sorted(i for i, p in enumerate(params) if p.grad is not None)
            with opt.skip_synchronize():
                opt.step()
            after_step = sorted(i for i, p in enumerate(params) if p.grad is not None)
            held.append((after_reduction, after_step))
        state = {i: opt.optim.state[p] for i, p in enumerate(params) if opt.optim.state.get(p)}
        out[f"stage {stage}" + (f" {schedule}" if schedule else "")] = {
            "state_ids": sorted(state),
            "state_bytes": _tensor_bytes(v for s in state.values() for v in s.values()
                                         if isinstance(v, torch.Tensor) and v.dim() > 0),
            "grads": held,
            "sizes": [p.numel() * p.element_size() for p in params],
        }
    return out


def _check_partition(sets, n_params, label):
    every = [i for s in sets for i in s]
    assert len(every) == len(set(every)), f"{label}: ranks share parameters: {sets}"
    assert sorted(every) == list(range(n_params)), f"{label}: parameters no rank holds: " \
        f"{sorted(set(range(n_params)) - set(every))}"


@pytest.mark.parametrize("n", NPS)
@JOINT_TIMEOUT
def test_optimizer_state_and_gradients_are_sharded(n):
    results = _SHARDING[n].results("sharding")
    assert len(results) == n
    for label in results[0]:
        sizes = results[0][label]["sizes"]
        assert max(sizes) <= 0.1 * sum(sizes), "the test model must not have a dominant parameter"
        total_state = 2 * sum(sizes)  # AdamW: exp_avg and exp_avg_sq per parameter
        largest_state = 2 * max(sizes)
        _check_partition([res[label]["state_ids"] for res in results], len(sizes), f"{label}: optimizer state")
        assert sum(res[label]["state_bytes"] for res in results) == total_state, label
        for r, res in enumerate(results):
            assert res[label]["state_bytes"] <= total_state / n + largest_state, \
                f"{label}: rank {r} holds {res[label]['state_bytes']} B of state, more than " \
                f"{total_state}/{n} + {largest_state}"
            assert res[label]["state_bytes"] < total_state  # a replicated state never passes
        if label.startswith("stage 2"):
            for k in range(2):
                for when in (0, 1):
                    sets = [res[label]["grads"][k][when] for res in results]
                    what = f"{label}: step {k}: gradients {('after the reduction', 'after the step')[when]}"
                    _check_partition(sets, len(sizes), what)
                    for r, s in enumerate(sets):
                        held = sum(sizes[i] for i in s)
                        assert held <= sum(sizes) / n + max(sizes), \
                            f"{what}: rank {r} holds {held} B of {sum(sizes)}"
                    # each rank's gradients are those of the parameters whose state it holds
                    assert sets == [res[label]["state_ids"] for res in results], what


def _inf_agreement():
    """Stage 2 at np=2, both schedules: rank 1 makes the gradient of a parameter rank 0 owns
    infinite. After synchronize() every rank must see a non-finite gradient among its own (rank 1
    sees none of its own: only the agreement can tell it). The GradScaler step runs only if every
    rank agrees, so a broken agreement fails here at once instead of hanging in the step."""
    import torch

    import horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    for schedule in ("alltoall", "allreduce"):
        m = _model()  # a fresh model: stage 2's gradient hooks are per optimizer
        params = list(m.parameters())
        opt = hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, stage=2, lr=1e-2)
        opt.reduce_schedule = schedule
        mine = {id(q) for g in opt.optim.param_groups for q in g["params"]}
        owned = [i for i, p in enumerate(params) if id(p) in mine]
        owners = hvd.allgather_object(owned)
        victim = owners[0][0]  # a parameter of rank 0's
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        opt.zero_grad()
        hook = None
        if r == n - 1:
            hook = params[victim].register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), float("inf")))
        scaler.scale(m(torch.ones(4, WIDTHS[0])).square().mean()).backward()
        if hook is not None:
            hook.remove()
        opt.synchronize()
        sees = any(not bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)
        agreed = hvd.allgather_object(sees)
        result = {"sees_nonfinite": sees, "owned": owned, "victim": victim}
        if all(agreed):
            before = [p.detach().clone() for p in params]
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            result["scale"] = scaler.get_scale()
            result["unchanged"] = all(torch.equal(p, q) for p, q in zip(params, before))
        out[schedule] = result
    return out


@JOINT_TIMEOUT
def test_stage2_inf_agreement_fails_fast_when_broken():
    results = _INF.results("inf")
    for schedule in ("alltoall", "allreduce"):
        rows = [res[schedule] for res in results]
        assert rows[0]["victim"] in rows[0]["owned"] and rows[0]["victim"] not in rows[1]["owned"], rows
        missing = [r for r, row in enumerate(rows) if not row["sees_nonfinite"]]
        assert not missing, f"{schedule}: ranks {missing} did not learn of rank 1's infinite gradient " \
            "(stage 2's agreement on non-finite gradients is broken: GradScaler would step on some ranks only)"
        for r, row in enumerate(rows):
            assert row["scale"] == 2.0 ** 7 and row["unchanged"], (schedule, r, row)


_SHARDING = {n: joint_launch("torch", n, {"sharding": _sharding_cases}, timeout=120) for n in NPS}
# (the agreement is checked before the step: a broken one fails this test, it hangs no rank)
_INF = joint_launch("torch", 2, {"inf": _inf_agreement}, timeout=60)
