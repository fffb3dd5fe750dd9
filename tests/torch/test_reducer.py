"""The ``GradientReducer`` and ``ShardedStateful`` protocols (horovod/torch/reducer.py) in one
process: which optimizers compose which reducer, and the members the Lightning strategy and
``hvd.checkpoint`` rely on. (The reducers' values across ranks: test_optimizer.py, test_zero.py,
test_amp_no_sync.py.)"""

from __future__ import annotations

import pytest
import torch

import horovod.torch as hvd
from horovod.torch._dense_reducer import DenseReducer
from horovod.torch._zero_grads import ShardedGradients
from horovod.torch.reducer import GradientReducer, ShardedStateful, reducer_of

pytestmark = pytest.mark.unit


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _optimizers(m: torch.nn.Module) -> dict[str, torch.optim.Optimizer]:
    return {
        "distributed": hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                                named_parameters=m.named_parameters()),
        "zero1": hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, stage=1, lr=0.1),
        "zero2": hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, stage=2, lr=0.1),
    }


def test_each_optimizer_composes_a_gradient_reducer(hv):
    opts = _optimizers(_model())
    kinds = {name: type(reducer_of(o)) for name, o in opts.items()}
    assert kinds == {"distributed": DenseReducer, "zero1": DenseReducer, "zero2": ShardedGradients}
    for o in opts.values():
        reducer = reducer_of(o)
        assert isinstance(reducer, GradientReducer)
        assert reducer.backward_passes_per_step == 1 and not reducer.pending()
        assert reducer.state_dict() == {}
        o.set_backward_passes_per_step(3)
        assert reducer.backward_passes_per_step == 3
        assert reducer.synchronize_on_step
        with o.skip_synchronize():
            assert not reducer.synchronize_on_step
        assert reducer.synchronize_on_step
    assert reducer_of(torch.optim.SGD(_model().parameters(), lr=0.1)) is None


def test_powersgd_state_is_the_reducers_and_travels_with_the_optimizer(hv):
    m = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), compression=hvd.PowerSGD(rank=1))
    assert set(opt.reducer.state_dict()) == {"horovod_compression"}
    assert "horovod_compression" in opt.state_dict()
    opt.load_state_dict(opt.state_dict())


def test_only_the_sharded_optimizer_is_sharded_stateful(hv):
    opts = _optimizers(_model())
    assert not isinstance(opts["distributed"], ShardedStateful)
    for name in ("zero1", "zero2"):
        z = opts[name]
        assert isinstance(z, ShardedStateful)
        assert z.num_shards == 1 and z.owned_indices() == [0, 1, 2, 3]
        assert z.local_state_dict() == {}
    m = _model()
    z = hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, stage=2, lr=0.1)
    m(torch.ones(1, 4)).sum().backward()
    z.step()
    local = z.local_state_dict()
    assert sorted(local) == [0, 1, 2, 3] and all("exp_avg" in v for v in local.values())


def test_reset_drops_a_pending_step_and_check_idle_guards_zero_grad(hv):
    m = _model()
    z = hvd.ZeroRedundancyOptimizer(m.parameters(), torch.optim.SGD, stage=1, lr=0.1,
                                    backward_passes_per_step=2)
    z.reducer.check_idle()
    z.reducer.reset()
    assert not z.reducer.pending()
    z.zero_grad()


def test_clip_grad_norm_of_every_reducer_is_torchs_at_one_rank(hv):
    """``GradientReducer.clip_grad_norm_`` (dense, ZeRO-2, fully sharded) == torch's
    ``clip_grad_norm_`` over the whole gradient (one rank: every part is this rank's)."""
    from horovod.torch.fully_shard import FullyShardedReducer, reducer_for

    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    ref = _model()
    ref(x).pow(2).sum().backward()
    want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    want = [p.grad.clone() for p in ref.parameters()]
    reducers = {}
    for name, o in _optimizers(_model()).items():
        if name != "zero1":
            reducers[name] = (o.param_groups[0]["params"], reducer_of(o))
    m = hvd.fully_shard(_model())
    reducers["fully_shard"] = (list(m.parameters()), reducer_for(m))
    assert isinstance(reducer_for(m), FullyShardedReducer) and reducer_for(m) is reducer_for(m)
    for name, (params, reducer) in reducers.items():
        assert isinstance(reducer, GradientReducer), name
        model = m if name == "fully_shard" else None
        if model is None:  # the optimizer's parameters are those of a fresh _model()
            for p in params:
                p.grad = None
            torch.manual_seed(0)
        out = (model or _Holder(params))(x).pow(2).sum()
        out.backward()
        norm = reducer.clip_grad_norm_(0.1)
        assert abs(float(norm) - float(want_norm)) < 1e-5, (name, norm, want_norm)
        got = [p.grad.reshape(w.shape) for p, w in zip(params, want)]
        assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want)), name


class _Holder(torch.nn.Module):
    """_model()'s forward over given parameters (an optimizer's)."""

    def __init__(self, params):
        super().__init__()
        self.p = params

    def forward(self, x):
        w1, b1, w2, b2 = self.p
        return torch.nn.functional.linear(torch.nn.functional.linear(x, w1, b1), w2, b2)
