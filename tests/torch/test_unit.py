"""horovod.torch in one process (no launcher): surface, dtype translation, argument errors."""

from __future__ import annotations

import warnings

import pytest
import torch

import horovod.torch as hvd
from horovod.common import BASICS

pytestmark = pytest.mark.unit


def test_surface_reexports_every_basic_name_and_collective():
    missing = [n for n in BASICS if n not in hvd.__all__ or not hasattr(hvd, n)]
    assert not missing, f"horovod.torch lacks process-level names {missing}"
    for name in ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
                 "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
                 "allgather_async", "grouped_allgather", "broadcast", "broadcast_", "broadcast_async",
                 "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
                 "grouped_reducescatter", "synchronize", "poll", "join", "barrier", "DistributedOptimizer",
                 "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
                 "Compression", "SyncBatchNorm"]:
        assert name in hvd.__all__ and callable(getattr(hvd, name)), name


def test_not_initialized_raises_value_error():
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.allreduce(torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                   torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool])
def test_single_rank_round_trip_every_dtype(hv, dtype):
    x = (torch.arange(6).reshape(2, 3) % 2 == 1) if dtype == torch.bool else torch.arange(6).reshape(2, 3).to(dtype)
    op = hvd.Max if dtype == torch.bool else hvd.Average
    for out in [hvd.allreduce(x, op=op), hvd.allgather(x), hvd.broadcast(x, 0), hvd.alltoall(x)]:
        assert out.dtype == dtype and torch.equal(out, x), f"{dtype}: {out}"
    y = x.clone()
    assert hvd.allreduce_(y, op=op) is y and torch.equal(y, x)
    if dtype != torch.bool:
        assert torch.equal(hvd.reducescatter(x), x)


def test_bfloat16_moves_bits_exactly(hv):
    x = torch.randn(100).to(torch.bfloat16)
    assert torch.equal(hvd.broadcast(x, 0).view(torch.int16), x.view(torch.int16))
    assert torch.equal(hvd.allgather(x).view(torch.int16), x.view(torch.int16))


def test_in_place_ops_write_into_the_tensor_memory(hv):
    x = torch.ones(5)
    ptr = x.data_ptr()
    h = hvd.allreduce_async_(x, op=hvd.Sum)
    assert hvd.synchronize(h) is x and x.data_ptr() == ptr
    nc = torch.ones(4, 4).t()
    assert hvd.broadcast_(nc, 0) is nc


def test_argument_errors(hv):
    with pytest.raises(TypeError, match="torch.Tensor"):
        hvd.allreduce(3.0)
    with pytest.raises(ValueError, match="Tensor type torch.ComplexFloatTensor is not supported"):
        hvd.allgather(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(NotImplementedError, match="supports CPU and CUDA tensors"):
        hvd.broadcast_(torch.ones(2, device="meta"), 0)
    with pytest.raises(ValueError, match="not defined for bool"):
        hvd.allreduce(torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.poll(987654)
    assert hvd.synchronize(987654) is None
    with pytest.raises(TypeError, match="list of tensors"):
        hvd.grouped_allreduce(torch.ones(2))
    with pytest.raises(ValueError, match="invalid params"):
        hvd.broadcast_parameters(torch.ones(2), 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.allreduce(torch.ones(2), average=True)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)


def test_compression_fp16_round_trip():
    x = torch.tensor([1.5, -2.25], dtype=torch.float64)
    c, ctx = hvd.Compression.fp16.compress(x)
    assert c.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(c, ctx).dtype == torch.float64
    i = torch.tensor([1, 2])
    assert hvd.Compression.fp16.compress(i)[0] is i
    assert hvd.Compression.none.compress(x)[0] is x


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_distributed_optimizer_validation(hv):
    m = _model()
    with pytest.raises(ValueError, match="tuples"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=list(m.parameters()))
    params = list(m.named_parameters())
    dup = [("w", params[0][1]), ("w", params[1][1]), ("x", params[2][1]), ("y", params[3][1])]
    with pytest.raises(ValueError, match="Found duplicates: w"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=dup)
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=params[:2])
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), groups="two")
    with pytest.raises(ValueError, match="once"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), groups=[[params[0][1]], [params[0][1]]])
    # op=Adasum on one rank: upstream's plain wrapper (the delta optimizer needs more than one rank)
    adasum_opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), op=hvd.Adasum)
    assert type(adasum_opt).__name__ == "SGD" and adasum_opt.op == hvd.Adasum
    with pytest.warns(DeprecationWarning):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), num_groups=1)


def test_distributed_optimizer_single_process_is_local_and_keeps_class(hv):
    m = _model()
    base = torch.optim.Adam(m.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(base, named_parameters=m.named_parameters())
    assert type(opt).__name__ == "Adam" and isinstance(opt, torch.optim.Adam)
    ref = _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    for mod, o in ((m, opt), (ref, ref_opt)):
        for _ in range(3):
            o.zero_grad()
            mod(torch.ones(2, 3)).sum().backward()
            o.step()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    opt.set_backward_passes_per_step(2)
    with pytest.raises(ValueError):
        opt.set_backward_passes_per_step(0)


def test_broadcast_optimizer_state_single_process(hv):
    m = _model()
    with pytest.raises(ValueError, match="cannot broadcast torch.optim.LBFGS state"):
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(m.parameters()), 0)
    frozen = torch.nn.Linear(2, 2)
    frozen.bias.requires_grad_(False)
    opt = torch.optim.Adam(frozen.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(opt, 0)
    assert frozen.bias.grad is None and frozen.weight in opt.state
    hvd.broadcast_optimizer_state(torch.optim.SGD(m.parameters(), lr=0.1), 0)  # stateless: no-op


def test_sync_batch_norm_single_process_equals_batch_norm(hv):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 5)
    sbn, bn = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    assert torch.allclose(sbn(x), bn(x))
    with pytest.raises(ValueError, match="expected at least 2D input"):
        sbn(torch.ones(3))


def test_torch_memory_counts_as_huge_pages_only_with_thp_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    from horovod.common.engine import pages
    from horovod.torch import _convert

    monkeypatch.setattr(pages, "_mode", "madvise")
    big, small = torch.ones(1 << 20), torch.ones(1000)  # 4 MiB, 4 KB
    monkeypatch.setattr(_convert, "_TORCH_THP", True)
    assert pages.huge_page_backed(big.reshape(-1).numpy())
    assert pages.huge_page_backed(big[5:].numpy())  # a view: the storage decides
    assert not pages.huge_page_backed(small.numpy())
    monkeypatch.setattr(_convert, "_TORCH_THP", False)
    assert not pages.huge_page_backed(big.numpy())


def test_repeat_host_view_keeps_its_tensors_huge_page_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    # The view kept for a repeated in-place allreduce does not reference its tensor: the engine's
    # placement must still learn that a large tensor's memory is on huge pages (else every large
    # gradient of a repeated step is copied through the fusion buffer: ResNet-50's set at np=2
    # spent 37 ms of a 60 ms step packing and unpacking).
    from horovod.common.engine import pages
    from horovod.torch import _convert
    from horovod.torch._repeat import _HostView

    monkeypatch.setattr(pages, "_mode", "madvise")
    monkeypatch.setattr(pages, "_malloc_thp", False)
    big, small = torch.ones(1 << 20), torch.ones((3 << 20) // 4)  # 4 MiB, 3 MiB
    for thp in (True, False):
        monkeypatch.setattr(_convert, "_TORCH_THP", thp)
        for t, want in ((big, thp), (small, False)):
            memo = _HostView()
            memo.view(t)
            kept = memo.view(t)  # the second call makes the kept (ctypes-backed) view
            assert memo.view(t) is kept and kept.base is not None and not isinstance(kept.base, torch.Tensor)
            assert pages.huge_page_backed(kept) is want, (t.numel(), thp)
            assert pages.huge_page_backed(kept[1:]) is want  # a piece of it: the same memory


def test_blocking_calls_drive_the_engine_themselves(hv, monkeypatch: pytest.MonkeyPatch) -> None:
    # A blocking call waits at once, so it does not wake the engine thread (a wake-up costs a
    # thread switch, ~30 us at np=2 on a 2-core host); an async call must, nobody may wait soon.
    from horovod.common.context import Prepared

    seen: list[tuple[str, bool]] = []
    real = Prepared.submit

    def spy(self, *args, **kwargs):  # the one submit path: Prepared.submit(inputs, outputs, splits, wake, ...)
        seen.append((self.request.name, kwargs.get("wake", args[3] if len(args) > 3 else True)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Prepared, "submit", spy)
    t = torch.ones(3)
    hv.allreduce_(t, name="b1")
    hv.allreduce(t, name="b2")
    hv.grouped_allreduce_([t], name="b3")
    hv.broadcast_(t, 0, name="b4")
    hv.broadcast(t, 0, name="b5")
    hv.synchronize(hv.allreduce_async_(t, name="a1"))
    hv.synchronize(hv.broadcast_async(t, 0, name="a2"))
    wakes = {name.split(".")[-1]: wake for name, wake in seen}
    assert wakes == {"b1": False, "b2": False, "b3": False, "b4": False, "b5": False,
                     "a1": True, "a2": True}, seen


def test_torch_memory_counts_as_huge_pages_from_4_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's THP blocks are not 2 MiB-aligned: only blocks of 4 MiB or more are mostly huge pages.
    import torch

    from horovod.common.engine.pages import huge_page_backed
    from horovod.torch import _convert

    monkeypatch.setattr("horovod.common.engine.pages._mode", "madvise")
    monkeypatch.setattr("horovod.common.engine.pages._malloc_thp", False)
    small, big = torch.ones((3 << 20) // 4), torch.ones((4 << 20) // 4)
    for thp in (True, False):
        monkeypatch.setattr(_convert, "_TORCH_THP", thp)
        assert not huge_page_backed(small.numpy())
        assert huge_page_backed(big.numpy()) is thp
        # a view of a flat gradient buffer counts by its whole storage
        assert huge_page_backed(big[:100].numpy()) is thp
    # under jemalloc with thp:always every block from 2 MiB is on huge pages
    monkeypatch.setattr("horovod.common.engine.pages._malloc_thp", True)
    assert huge_page_backed(small.numpy()) and not huge_page_backed(torch.ones(1000).numpy())


def test_grouped_allreduce_inplace_accepts_a_generator_every_time(hv):
    # A generator is consumed by the first submission: the repeat cache must not store an empty
    # signature for the name (the next call with that name then raised TypeError on len()).
    ts = [torch.ones(3), torch.full((2,), 2.0)]
    for step in range(3):
        out = hv.synchronize(hv.grouped_allreduce_async_((t for t in ts), name="gen.group", op=hv.Sum))
        assert [o.tolist() for o in out] == [[1.0] * 3, [2.0] * 2], step
        assert all(o is t for o, t in zip(out, ts)), step


@pytest.mark.parametrize("groups", [None, 1, 4])
def test_optimizer_hooks_hash_tensors_a_bounded_number_of_times_per_parameter(hv, groups, monkeypatch):
    # A step's hooks must cost O(parameters), not O(parameters x group size): a tensor's
    # __hash__ is a Python call, and a dictionary keyed by a group (a tuple of tensors) hashes
    # every tensor of the group in each of its hooks (161 parameters, groups=1: 26k calls).
    n = 60
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(n)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), groups=groups,
                                   named_parameters=[(f"p{i}", p) for i, p in enumerate(params)])
    opt.reducer.register_hooks()  # one rank: the optimizer has none of its own
    x = torch.ones(3)
    calls = []
    real = torch.Tensor.__hash__

    def counting(self):
        calls.append(1)
        return real(self)

    for step in range(3):
        opt.zero_grad()
        loss = torch.stack([(p * x).sum() for p in params]).sum()
        if step == 2:
            monkeypatch.setattr(torch.Tensor, "__hash__", counting)
        loss.backward()
        opt.step()
        monkeypatch.undo()
        for p in params:  # the gradient is averaged over one rank: unchanged; SGD steps by it
            assert torch.allclose(p, torch.full((3,), 1.0 - 0.1 * (step + 1)))
    assert len(calls) <= 8 * n, f"{len(calls)} tensor hashes in one step of {n} parameters"


def test_repeat_host_view_is_reused_for_the_same_tensor_and_never_keeps_it_alive():
    import gc
    import weakref

    import numpy as np

    from horovod.torch._repeat import _HostView

    memo = _HostView()
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    first = memo.view(t)  # first sighting: the tensor's own numpy() view
    second = memo.view(t)  # second: the view kept for later calls
    assert memo.view(t) is second and second.shape == (2, 3) and second.dtype == np.float32
    second[1, 2] = 42.0  # the kept view writes the tensor's memory
    assert t[1, 2].item() == 42.0 and first[1, 2] == 42.0
    t.data = torch.zeros(3, 4)  # new memory under the same tensor object: a fresh view, never the old one
    again = memo.view(t)
    assert again.shape == (3, 4) and again is not second
    other = torch.ones(2, 3)
    assert memo.view(other) is not second  # another tensor object: its own view
    ref = weakref.ref(t)
    memo.view(t), memo.view(t)
    del t, first, again
    gc.collect()
    assert ref() is None, "the kept view must not keep its tensor alive"

