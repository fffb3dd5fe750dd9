"""PowerSGD and the stateful compression interface in one process: arguments, the compression
plan, the algorithm on a single rank, and DistributedOptimizer's checks."""

from __future__ import annotations

import pytest
import torch

import horovod.torch as hvd
from horovod.torch.compression import StatefulCompressor
from horovod.torch.powersgd import PowerSGD, _orthogonalize_
from tests.torch.test_powersgd import resnet18_shapes

pytestmark = pytest.mark.unit


@pytest.fixture
def hv():
    hvd.init()
    yield hvd
    hvd.shutdown()


class _OneRank:
    """A communicator for one rank (averages are the tensors themselves), counting bytes."""

    rank, size = 0, 1

    def __init__(self):
        self.bytes_submitted = 0
        self.names = []

    def agree(self, values, name):
        return True

    def allreduce_async_(self, tensors, name):
        if not tensors:
            return
        self.names.append(name)
        self.bytes_submitted += sum(t.numel() * t.element_size() for t in tensors)

    def wait(self, handle):
        pass

    def allreduce_(self, tensors, name):
        self.allreduce_async_(tensors, name)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_rank_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        PowerSGD(rank=bad)


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="start_iter"):
        PowerSGD(start_iter=-1)
    with pytest.raises(ValueError, match="min_compression_rate"):
        PowerSGD(min_compression_rate=-0.5)


def test_exported_and_an_instance_of_the_interface():
    assert "PowerSGD" in hvd.__all__ and hvd.PowerSGD is PowerSGD
    assert isinstance(PowerSGD(), StatefulCompressor)
    assert repr(PowerSGD(rank=2, seed=3)).startswith("PowerSGD(rank=2, start_iter=10")


def test_resnet18_plan_is_under_a_tenth():
    before, after = PowerSGD(rank=2, min_compression_rate=2).compressed_numel(resnet18_shapes())
    assert before == 11_689_512
    assert after * 10 <= before, (before, after)


def test_plan_vectors_and_low_rate_matrices_stay_uncompressed():
    c = PowerSGD(rank=2, min_compression_rate=2)
    # (10,) vector; (4, 24): 96 < 2 * 28 * 2; (24, 10): 240 >= 2 * 34 * 2
    assert c.compressed_numel([(10,)]) == (10, 10)
    assert c.compressed_numel([(4, 24)]) == (96, 96)
    assert c.compressed_numel([(24, 10)]) == (240, 68)
    assert c.compressed_numel([(8, 2, 3, 3)]) == (144, (8 + 18) * 2)


def test_orthogonalize_gram_schmidt_and_qr_and_zero_columns():
    g = torch.Generator().manual_seed(0)
    for r in (1, 2, 4):
        m = torch.randn(20, r, generator=g)
        _orthogonalize_(m)
        assert torch.allclose(m.t() @ m, torch.eye(r), atol=1e-5)
    z = torch.zeros(6, 2)
    _orthogonalize_(z)
    assert torch.equal(z, torch.zeros(6, 2))


def test_one_rank_low_rank_approximation_and_error_feedback():
    """On one rank a rank-r matrix is reproduced exactly; a full-rank one loses what error
    feedback then carries into the next step, so the sum over steps converges to the sum of
    gradients."""
    comm = _OneRank()
    g = torch.Generator().manual_seed(0)
    low = torch.randn(30, 2, generator=g) @ torch.randn(2, 20, generator=g)
    c = PowerSGD(rank=2, start_iter=0, min_compression_rate=1)
    x = low.clone()
    c.reduce_([x], ["w"], comm)
    assert torch.allclose(x, low, atol=1e-4)
    assert comm.names == ["powersgd.w.P", "powersgd.w.Q"]
    full = torch.randn(30, 20, generator=g)
    c = PowerSGD(rank=2, start_iter=0, min_compression_rate=1)
    sent = torch.zeros_like(full)
    for _ in range(40):
        x = full.clone()
        c.reduce_([x], ["w"], comm)
        sent += x
    # error feedback: what was sent so far + what is still owed == every gradient
    assert torch.allclose(sent + c._errors["w"], 40 * full, atol=1e-3)
    assert (sent / 40 - full).norm() < 0.2 * full.norm()


def test_before_start_iter_gradients_pass_exactly():
    comm = _OneRank()
    c = PowerSGD(rank=1, start_iter=2, min_compression_rate=0)
    x = torch.randn(12, 7)
    y = x.clone()
    c.reduce_([y], ["w"], comm)
    assert torch.equal(x, y) and c.iter == 1 and comm.names == ["powersgd.w.all"]


def test_distributed_optimizer_rejects_what_powersgd_cannot_do(hv):
    model = torch.nn.Linear(4, 3)
    for kwargs, match in [({"op": hvd.Sum}, "op=hvd.Average"), ({"groups": 2}, "leave groups"),
                          ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor")]:
        with pytest.raises(ValueError, match=match):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(),
                                     compression=PowerSGD(rank=2), **kwargs)


def test_optimizer_state_dict_carries_the_compressor_state(hv):
    model = torch.nn.Linear(4, 3)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=PowerSGD(rank=2, seed=5))
    sd = opt.state_dict()
    assert sd["horovod_compression"]["config"]["seed"] == 5
    opt.load_state_dict(sd)
    plain = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    assert "horovod_compression" not in plain.state_dict()
