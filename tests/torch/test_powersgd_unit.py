"""PowerSGD and the stateful compression interface in one process: arguments, the compression
plan, the algorithm on a single rank, and DistributedOptimizer's checks."""

from __future__ import annotations

import pytest
import torch

import horovod.torch as hvd
from horovod.torch.compression import StatefulCompressor
from horovod.torch.powersgd import PowerSGD, _orthogonalize_
from tests.torch.model_shapes import resnet18_shapes

pytestmark = pytest.mark.unit


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


# --- two ranks in one process: a fake communicator that really averages -------------------------

class _TwoRanks:
    """The shared half of a two-rank communicator: each rank's call posts its tensors and waits
    for the other's; then both hold the average (in place), as Horovod's fused average leaves them.
    Calls are matched by order and name: a rank calling a different collective fails the test."""

    def __init__(self):
        import threading

        self.barrier = threading.Barrier(2, timeout=30)
        self.posted = {}

    def rank(self, r):
        return _RankComm(self, r)


class _RankComm:
    size = 2

    def __init__(self, shared, rank):
        self.shared, self.rank, self.calls, self.names = shared, rank, 0, []
        self.bytes_submitted = 0

    def _exchange(self, name, value):
        key = self.calls
        self.calls += 1
        self.names.append(name)
        self.shared.posted[(key, self.rank)] = (name, value)
        self.shared.barrier.wait()
        both = [self.shared.posted[(key, r)] for r in (0, 1)]
        self.shared.barrier.wait()  # both have read this call's posts
        assert both[0][0] == both[1][0], f"call {key}: rank 0 ran {both[0][0]}, rank 1 ran {both[1][0]}"
        return [v for _, v in both]

    def allreduce_async_(self, tensors, name):
        if not tensors:
            return None
        self.bytes_submitted += sum(t.numel() * t.element_size() for t in tensors)
        posted = self._exchange(name, [t.detach().clone() for t in tensors])
        for i, t in enumerate(tensors):
            t.copy_((posted[0][i] + posted[1][i]) / 2)
        return None

    def wait(self, handle):
        pass

    def allreduce_(self, tensors, name):
        self.allreduce_async_(tensors, name)

    def agree(self, values, name):
        a, b = self._exchange(name, list(values))
        return a == b

    def allgather_object(self, obj, name):
        return self._exchange(name, obj)


def _two_ranks(step):
    """Run ``step(rank, comm)`` on two threads (two ranks) sharing one fake communicator; the
    ranks' results in rank order."""
    import threading

    shared, out, errors = _TwoRanks(), [None, None], []

    def run(r):
        try:
            out[r] = step(r, shared.rank(r))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            shared.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


def test_two_ranks_low_rank_gradients_average_exactly():
    """Gradients of rank 2 sharing their column space: their average is rank 2 too, and PowerSGD
    at rank 2 gives it exactly, the same on both ranks; the vector (uncompressed) is averaged."""
    g = torch.Generator().manual_seed(1)
    cols = torch.randn(30, 2, generator=g)
    mats = [cols @ torch.randn(2, 20, generator=g) for _ in (0, 1)]
    vecs = [torch.randn(7, generator=g) for _ in (0, 1)]

    def step(r, comm):
        c = PowerSGD(rank=2, start_iter=0, min_compression_rate=1)
        x, v = mats[r].clone(), vecs[r].clone()
        c.reduce_([x, v], ["w", "b"], comm)
        return x, v, comm.names

    (x0, v0, names0), (x1, v1, _) = _two_ranks(step)
    assert torch.equal(x0, x1) and torch.equal(v0, v1), "the ranks ended with different gradients"
    assert torch.allclose(x0, (mats[0] + mats[1]) / 2, atol=1e-4)
    assert torch.allclose(v0, (vecs[0] + vecs[1]) / 2)
    assert names0 == ["powersgd.w.agree", "powersgd.w.uncompressed", "powersgd.w.P", "powersgd.w.Q"]


def test_two_ranks_before_start_iter_average_exactly():
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(12, 7, generator=g) for _ in (0, 1)]

    def step(r, comm):
        c = PowerSGD(rank=1, start_iter=2, min_compression_rate=0)
        y = grads[r].clone()
        c.reduce_([y], ["w"], comm)
        return y

    y0, y1 = _two_ranks(step)
    assert torch.equal(y0, y1) and torch.allclose(y0, (grads[0] + grads[1]) / 2)


def test_two_ranks_error_feedback_carries_each_ranks_own_error():
    """Full-rank gradients, different on each rank, 40 steps: each step's result is the average
    of the ranks' (gradient + carried error) minus the average of what each rank's
    approximation missed, so what was sent plus the ranks' mean remaining error is 40 times the
    average gradient; and the result approaches that average."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(30, 20, generator=g) for _ in (0, 1)]
    avg = (grads[0] + grads[1]) / 2

    def step(r, comm):
        c = PowerSGD(rank=2, start_iter=0, min_compression_rate=1)
        sent = torch.zeros(30, 20)
        for _ in range(40):
            x = grads[r].clone()
            c.reduce_([x], ["w"], comm)
            sent += x
        return sent, c._errors["w"].clone()

    (sent0, err0), (sent1, err1) = _two_ranks(step)
    assert torch.equal(sent0, sent1), "the ranks applied different updates"
    assert not torch.allclose(err0, err1), "each rank carries its own error"
    assert torch.allclose(sent0 + (err0 + err1) / 2, 40 * avg, atol=1e-3)
    assert (sent0 / 40 - avg).norm() < 0.2 * avg.norm()
