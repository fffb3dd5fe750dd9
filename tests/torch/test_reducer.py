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


@pytest.fixture
def hv():
    hvd.init()
    yield hvd
    hvd.shutdown()


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
